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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fp8_bias", "fp8_query_shift", "fp8_bits_kind", "fp8_e4m3_bits_to"]

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


_BF16_ASM8 = tl.constexpr(_eight(_BF16_ASM_TEXT))
_FP16_ASM8 = tl.constexpr(_eight(_FP16_ASM_TEXT))

# Target kinds (a constexpr of the kernels): 0 = fp32, 1 = bf16, 2 = fp16.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def fp8_bits_kind(dtype: torch.dtype) -> int:
    """The kernels' ``FP8_KIND`` for a query of ``dtype`` (fp32, bf16 or fp16)."""
    return _KINDS[dtype]


def fp8_bias(dtype: torch.dtype) -> int:
    """``bias`` with ``fp8_e4m3_bits_to(b) == e4m3(b) * 2**-bias`` for a target of ``dtype``."""
    return 8 if dtype == torch.float16 else 120


def fp8_query_shift(dtype: torch.dtype) -> int:
    """The power of two the kernels move from the softmax scale onto the query and into P."""
    return 0 if dtype == torch.float16 else 64


@triton.jit
def fp8_e4m3_bits_to(x, KIND: tl.constexpr, ASM: tl.constexpr, PACK: tl.constexpr = 4):
    """uint8 e4m3 bytes -> the float of kind ``KIND`` equal to ``e4m3 * 2**-bias`` (exact).

    ``ASM``: the packed permute-and-mask PTX (CUDA); else the same with Triton's integer ops
    (the interpreter, and the reference for the PTX in the tests). ``PACK`` (4 or 8) bytes per
    PTX block: with 4 the compiler may move the conversion past the copy into a product's
    operand layout (right for an operand whose contraction dimension is contiguous in memory);
    with 8 it converts in the load's layout, so a tile contracted along its strided dimension
    (the values of P @ V) reaches the product through 16-bit transposing shared-memory loads
    instead of single-byte ones.
    """
    if KIND == 0:
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
