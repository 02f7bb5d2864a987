"""e4m3 cache bytes to the query's float type with integer operations, for the decode kernels.

An e4m3 byte ``s eeee mmm`` becomes the float whose sign is ``s`` and whose exponent and mantissa
bits are ``eeee mmm`` moved to the top of the target's exponent/mantissa field: for bf16 (and
fp32) ``(b & 0x80) << 8 | (b & 0x7F) << 4`` (``<< 24 | << 20``), for fp16 ``<< 8 | << 7``. That
float is the e4m3 value times ``2**-bias`` exactly, subnormals included, with ``bias`` = 127 - 7
= 120 for bf16/fp32 and 15 - 7 = 8 for fp16 (:func:`fp8_bias`). The kernels fold the power of
two into scales they apply anyway, so a byte costs a few integer operations (on the GPU one
byte permute, a shift and a masked merge per two bytes, :data:`_BF16_ASM`) instead of the
hardware's e4m3 -> f16 -> f32 -> bf16 conversion chain, whose quarter-rate ``cvt`` instructions
bound an fp8 decode kernel below the memory's speed.

Where the power of two goes (bias 120): keys ``k = k_bits * 2**120`` -- the query is multiplied
by ``2**QUERY_SHIFT`` (exact in bf16/fp32, so ``q * k_bits`` stays clear of fp32's subnormal
range) and the softmax scale by ``2**(120 - QUERY_SHIFT)``; values ``v = v_bits * 2**120`` --
the probabilities are computed as ``p * 2**QUERY_SHIFT`` (``exp2(s - (m - shift))``, no extra
operation) so ``p * v_bits`` stays clear of it too, the LSE subtracts the shift and the output
is multiplied by ``v_scale * 2**120 / l``. With bias 8 (fp16) nothing needs shifting.

Kind 3 (:data:`HW_FP16`, the GQA decode kernel): the hardware's one-instruction conversion of
two e4m3 bytes to two fp16 (``cvt.rn.f16x2.e4m3x2``, exact, bias 0), and the products in fp16.
The kernel brings each query row into fp16 by a power of two (its largest element to
``[2**14, 2**15)``) and divides the row's scores by it: exact, bf16's 8-bit significands fit
fp16's 11, but for elements under ``2**-31`` of the row's largest, which fp16's subnormals round
to ``2**-39`` of it.
Under the interpreter the same fp16 value comes from the integer operations times ``2**8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "HW_FP16",
    "Fp8LaunchArgs",
    "fp8_bias",
    "fp8_bits_kind",
    "fp8_e4m3_bits_to",
    "fp8_launch_args",
    "fp8_query_shift",
    "fp8_scale_args",
]

# Four e4m3 bytes in $2 -> four bf16 in $0 (bytes 0, 1) and $1 (bytes 2, 3): each byte moved
# to the high half of a 16-bit lane by one permute, then the exponent/mantissa bits shifted
# down by 4 under a mask and the sign kept in place.
_BF16_ASM_TEXT = """
{
.reg .b32 z, a, b, ta, tb;
mov.b32 z, 0;
prmt.b32 a, $2, z, 0x1404;
prmt.b32 b, $2, z, 0x3424;
shr.b32 ta, a, 4;
shr.b32 tb, b, 4;
and.b32 ta, ta, 0x07F007F0;
and.b32 tb, tb, 0x07F007F0;
and.b32 a, a, 0x80008000;
and.b32 b, b, 0x80008000;
or.b32 $0, a, ta;
or.b32 $1, b, tb;
}
"""
# The same to fp16 (5 exponent bits): shifted down by 1.
_FP16_ASM_TEXT = (
    _BF16_ASM_TEXT.replace("ta, a, 4", "ta, a, 1")
    .replace("tb, b, 4", "tb, b, 1")
    .replace("0x07F007F0", "0x3F803F80")
)
_BF16_ASM = tl.constexpr(_BF16_ASM_TEXT)
_FP16_ASM = tl.constexpr(_FP16_ASM_TEXT)


def _eight(four: str) -> str:
    """The four-byte block twice: eight bytes in $4, $5 -> eight halves in $0..$3."""
    swap = {"$0": "$0", "$1": "$1", "$2": "$4"}, {"$0": "$2", "$1": "$3", "$2": "$5"}
    blocks = []
    for names in swap:
        block = four
        for old, new in names.items():
            block = block.replace(old, "@" + new[1:])
        blocks.append(block.replace("@", "$"))
    return "".join(blocks)


# Four e4m3 bytes in $2 -> four fp16 in $0, $1 by the hardware (two bytes per instruction).
_HW16_ASM = tl.constexpr("""
{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}
""")

# The same for eight bytes in $4, $5 -> $0..$3.
_HW16_ASM8 = tl.constexpr("""
{
.reg .b16 l0, h0, l1, h1;
mov.b32 {l0, h0}, $4;
mov.b32 {l1, h1}, $5;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, h0;
cvt.rn.f16x2.e4m3x2 $2, l1;
cvt.rn.f16x2.e4m3x2 $3, h1;
}
""")

_BF16_ASM8 = tl.constexpr(_eight(_BF16_ASM_TEXT))
_FP16_ASM8 = tl.constexpr(_eight(_FP16_ASM_TEXT))

# Target kinds (a constexpr of the kernels): 0 = fp32, 1 = bf16, 2 = fp16, 3 = fp16 by the
# hardware conversion (bias 0; the query brought into fp16 by the kernel).
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
HW_FP16 = 3


def fp8_bits_kind(dtype: torch.dtype, hw_fp16: bool = False) -> int:
    """The kernels' ``FP8_KIND`` for a query of ``dtype`` (fp32, bf16 or fp16); ``hw_fp16``:
    :data:`HW_FP16` for bf16 and fp16 queries."""
    return HW_FP16 if hw_fp16 and dtype != torch.float32 else _KINDS[dtype]


def fp8_bias(dtype: torch.dtype, hw_fp16: bool = False) -> int:
    """``bias`` with ``fp8_e4m3_bits_to(b) == e4m3(b) * 2**-bias`` for a target of ``dtype``."""
    if fp8_bits_kind(dtype, hw_fp16) == HW_FP16:
        return 0
    return 8 if dtype == torch.float16 else 120


def fp8_query_shift(dtype: torch.dtype, hw_fp16: bool = False) -> int:
    """The power of two the kernels move from the softmax scale onto the query and into P."""
    if dtype == torch.float16 or fp8_bits_kind(dtype, hw_fp16) == HW_FP16:
        return 0
    return 64


@dataclass(frozen=True)
class Fp8LaunchArgs:
    """How a decode launch folds the integer e4m3 conversion's ``2**-bias`` into its scales:
    the query times ``q_mult``, the scores' scale times ``score_mult``, P times
    ``2**p_shift``, the output times ``out_mult``."""

    kind: int
    asm: bool
    q_mult: float
    score_mult: float
    p_shift: int
    out_mult: float


NO_FP8 = Fp8LaunchArgs(kind=1, asm=False, q_mult=1.0, score_mult=1.0, p_shift=0, out_mult=1.0)


def fp8_launch_args(
    q_dtype: torch.dtype, device: torch.device, *, asm: bool = True, hw_fp16: bool = False
) -> Fp8LaunchArgs:
    """The fp8 conversion's launch arguments for queries of ``q_dtype`` on ``device``: the PTX
    (``asm``) on CUDA; CPU tensors only reach a kernel under the interpreter, which runs Triton
    ops. ``hw_fp16``: :data:`HW_FP16` (kernels that bring the query into fp16 themselves)."""
    bias, shift = fp8_bias(q_dtype, hw_fp16), fp8_query_shift(q_dtype, hw_fp16)
    return Fp8LaunchArgs(
        kind=fp8_bits_kind(q_dtype, hw_fp16),
        asm=asm and device.type == "cuda",
        q_mult=2.0**shift,
        score_mult=2.0 ** (bias - shift),
        p_shift=shift,
        out_mult=2.0**bias,
    )


def fp8_scale_args(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(key scales, value scales, their head strides) for a decode launch: for an fp8 cache the
    fp32 scales ([Hkv] or [1], stride 0; None: 1.0), else placeholders the kernel never reads."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache, cache, 0, 0
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=cache.device)
    ks = k_scale if k_scale is not None else one
    vs = v_scale if v_scale is not None else one
    assert ks is not None and vs is not None
    return ks, vs, int(ks.numel() > 1), int(vs.numel() > 1)


@triton.jit
def fp8_e4m3_bits_to(x, KIND: tl.constexpr, ASM: tl.constexpr, PACK: tl.constexpr = 4):
    """uint8 e4m3 bytes -> the float of kind ``KIND`` equal to ``e4m3 * 2**-bias`` (exact;
    kind 3: the hardware conversion to fp16, bias 0).

    ``ASM``: the packed permute-and-mask PTX (CUDA); else the same with Triton's integer ops
    (the interpreter, and the reference for the PTX in the tests). ``PACK`` (4 or 8) bytes per
    PTX block: with 4 the compiler may move the conversion past the copy into a product's
    operand layout (right for an operand whose contraction dimension is contiguous in memory);
    with 8 it converts in the load's layout, so a tile contracted along its strided dimension
    (the values of P @ V) reaches the product through 16-bit transposing shared-memory loads
    instead of single-byte ones. Kind 3 with 8: the PTX is marked impure, which keeps the
    compiler from moving it (the products' operands then come through 16-bit shared-memory
    loads, at the price of a staging buffer).
    """
    if KIND == 3:
        if ASM and PACK == 8:
            # Not pure: the compiler then converts in the load's layout (see above).
            y = tl.inline_asm_elementwise(
                _HW16_ASM8, "=r,=r,=r,=r,r,r", [x], dtype=tl.float16, is_pure=False, pack=8
            )
        elif ASM:
            y = tl.inline_asm_elementwise(
                _HW16_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4
            )
        else:
            w16 = x.to(tl.uint16)
            y = (((w16 & 0x80) << 8) | ((w16 & 0x7F) << 7)).to(tl.float16, bitcast=True) * 256.0
    elif KIND == 0:
        w = x.to(tl.uint32)
        y = (((w & 0x80) << 24) | ((w & 0x7F) << 20)).to(tl.float32, bitcast=True)
    elif ASM:
        if PACK == 8:
            if KIND == 1:
                y = tl.inline_asm_elementwise(
                    _BF16_ASM8, "=r,=r,=r,=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=8
                )
            else:
                y = tl.inline_asm_elementwise(
                    _FP16_ASM8, "=r,=r,=r,=r,r,r", [x], dtype=tl.float16, is_pure=True, pack=8
                )
        elif KIND == 1:
            y = tl.inline_asm_elementwise(
                _BF16_ASM, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=4
            )
        else:
            y = tl.inline_asm_elementwise(
                _FP16_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4
            )
    else:
        w16 = x.to(tl.uint16)
        if KIND == 1:
            y = (((w16 & 0x80) << 8) | ((w16 & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
        else:
            y = (((w16 & 0x80) << 8) | ((w16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return y
