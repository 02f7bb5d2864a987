"""Triton kernels of the KV-cache writes (launchers only; the ``cp`` ops live in ops/).

Shape letters: T = new tokens, H = heads per token row, D = elements per head, BS = tokens per
block. One program stores one token: two source rows [H, D0] and [H, D1] go to their cache
rows at column offsets, which covers GQA (K into one cache, V into the other) and MLA (latent and
rope key side by side in one cache row) with one launch. Slot -1 stores nothing. The caches are
written through all their strides (a token-minor V cache, :func:`~cp_modules.cache.paged.
allocate_kv_cache`, has a head-dim stride of BS).

An fp8 cache (``torch.float8_e4m3fn``) stores ``x / scale`` saturated to +-448 and rounded to
nearest even, ``scale`` one fp32 value per head row (a scalar scale: a stride of 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_modules.kernels.decode.fp8 import fp8_scale_args

__all__ = ["write_kv_cache_kernel", "write_mla_cache_kernel"]

# A token-minor V cache (token stride 1) is written 16 tokens a program from this many tokens
# on (prefill chunks: consecutive slots of a block write consecutive bytes), and one token a
# program below (a decode step's tokens sit in different blocks; more programs in flight),
# through the strides: one byte per (head, dim) row and token. Read at every write.
WRITE_GROUPED_MIN_TOKENS = 512
_TOKENS = 16


@triton.jit
def _round_to_e4m3(x):
    """fp32 ``x`` (|x| <= 448) rounded to the nearest fp8 e4m3 value (ties to even), as fp32.

    The rounding is done here, in fp32 arithmetic, so that the conversion to fp8 that follows is
    exact: the same bits on every GPU and under the interpreter (whose fp8 conversion does not
    carry a rounded-up mantissa into the exponent). e4m3 keeps 3 mantissa bits: the step of the
    binade 2^e is 2^(e-3), and 2^-9 below 2^-6 (subnormals). Adding and subtracting
    ``M = 1.5 * 2^23 * step`` to ``|x|`` rounds to a multiple of the step, ties to even.
    """
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((e - 3 + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic) - magic
    # The sign bit put back as a bit (``-r`` is ``0 - r``, which turns -0 into +0), so that
    # tiny negatives round to -0 as torch's conversion does.
    r_bits = r.to(tl.int32, bitcast=True) | (bits & -2147483648)
    return r_bits.to(tl.float32, bitcast=True)


@triton.jit
def _write_cache_kernel(
    SRC0,
    SRC1,
    DST0,
    DST1,
    SLOTS,
    SCALE0,
    SCALE1,
    stride_sc0,
    stride_sc1,
    stride_s0t,
    stride_s0h,
    stride_s1t,
    stride_s1h,
    stride_d0b,
    stride_d0s,
    stride_d0h,
    stride_d0d,
    stride_d1b,
    stride_d1s,
    stride_d1h,
    stride_d1d,
    COL0: tl.constexpr,
    COL1: tl.constexpr,
    NUM_H: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D0: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    PAGE: tl.constexpr,
    QUANT: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        h = tl.arange(0, BLOCK_H)
        d0 = tl.arange(0, BLOCK_D0)
        m0 = (h[:, None] < NUM_H) & (d0[None, :] < D0)
        x0 = tl.load(SRC0 + t * stride_s0t + h[:, None] * stride_s0h + d0[None, :], mask=m0)
        dst0 = DST0 + blk * stride_d0b + off * stride_d0s + h[:, None] * stride_d0h + COL0
        if QUANT:
            sc0 = tl.load(SCALE0 + h * stride_sc0, mask=h < NUM_H, other=1.0)
            # IEEE division (``/`` is approximate on the GPU): the reference's quotient.
            x0 = tl.div_rn(x0.to(tl.float32), tl.broadcast_to(sc0[:, None], x0.shape))
            x0 = _round_to_e4m3(tl.clamp(x0, -448.0, 448.0))
        tl.store(dst0 + d0[None, :] * stride_d0d, x0.to(DST0.dtype.element_ty), mask=m0)
        d1 = tl.arange(0, BLOCK_D1)
        m1 = (h[:, None] < NUM_H) & (d1[None, :] < D1)
        x1 = tl.load(SRC1 + t * stride_s1t + h[:, None] * stride_s1h + d1[None, :], mask=m1)
        dst1 = DST1 + blk * stride_d1b + off * stride_d1s + h[:, None] * stride_d1h + COL1
        if QUANT:
            sc1 = tl.load(SCALE1 + h * stride_sc1, mask=h < NUM_H, other=1.0)
            x1 = tl.div_rn(x1.to(tl.float32), tl.broadcast_to(sc1[:, None], x1.shape))
            x1 = _round_to_e4m3(tl.clamp(x1, -448.0, 448.0))
        tl.store(dst1 + d1[None, :] * stride_d1d, x1.to(DST1.dtype.element_ty), mask=m1)


@triton.jit
def _quantized(x, SCALE, stride_sc, h, NUM_H: tl.constexpr, QUANT: tl.constexpr, DST):
    """``x`` [..., H, D] as stored in ``DST``'s type (fp8: over the head's scale, saturated and
    rounded as :func:`_write_cache_kernel` does)."""
    if QUANT:
        sc = tl.load(SCALE + h * stride_sc, mask=h < NUM_H, other=1.0)
        x = tl.div_rn(x.to(tl.float32), tl.broadcast_to(sc[None, :, None], x.shape))
        x = _round_to_e4m3(tl.clamp(x, -448.0, 448.0))
    return x.to(DST.dtype.element_ty)


@triton.jit
def _write_token_minor_kernel(
    K, V, KC, VC, SLOTS, KS, VS, stride_ksh, stride_vsh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vch, stride_vcd,
    num_tokens, NUM_H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, TOKENS: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """``TOKENS`` tokens a program into a row-major K cache and a token-minor V cache (token
    stride 1); tokens at consecutive slots of one block write each V row's bytes together."""
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(SLOTS + t, mask=t < num_tokens, other=-1).to(tl.int64)
    ok = slot >= 0
    blk = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = ok[:, None, None] & (h < NUM_H)[None, :, None] & (d < D)[None, None, :]
    rows = t[:, None, None]
    x = tl.load(K + rows * stride_kt + h[None, :, None] * stride_kh + d[None, None, :], mask=m)
    x = _quantized(x, KS, stride_ksh, h, NUM_H, QUANT, KC)
    dst = KC + blk[:, None, None] * stride_kcb + off[:, None, None] * stride_kcs
    tl.store(dst + h[None, :, None] * stride_kch + d[None, None, :], x, mask=m)
    y = tl.load(V + rows * stride_vt + h[None, :, None] * stride_vh + d[None, None, :], mask=m)
    y = _quantized(y, VS, stride_vsh, h, NUM_H, QUANT, VC)
    row = h[None, :, None] * stride_vch + d[None, None, :] * stride_vcd
    # The program's tokens at consecutive slots of one block (a prefill's): their bytes of a
    # row are consecutive, which the compiler sees from the offsets and spreads the tokens
    # over the threads; else each token is stored at its own slot.
    s0 = tl.load(SLOTS + tl.program_id(0).to(tl.int64) * TOKENS).to(tl.int64)
    run = tl.min((slot == s0 + tl.arange(0, TOKENS)).to(tl.int32), 0) == 1
    if run & (s0 >= 0) & (s0 % PAGE + TOKENS <= PAGE):
        dst = VC + (s0 // PAGE) * stride_vcb + s0 % PAGE + tl.arange(0, TOKENS)[:, None, None]
        tl.store(dst + row, y, mask=m)
    else:
        tl.store(VC + (blk * stride_vcb + off)[:, None, None] + row, y, mask=m)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def write_kv_cache_kernel(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``k, v`` [T, Hkv, D] (last dim contiguous) into [NB, BS, Hkv, D] caches of any
    strides (e.g. a token-minor V cache).

    fp8 caches: ``k_scale``, ``v_scale`` fp32 [Hkv] or [1] (None: 1.0)."""
    t, h, d = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    if t == 0:
        return
    quant = k_cache.dtype == torch.float8_e4m3fn
    ks, vs, sk, sv = fp8_scale_args(k_cache, k_scale, v_scale)
    page = k_cache.shape[1]
    if t >= WRITE_GROUPED_MIN_TOKENS and v_cache.stride(1) == 1 and page > 1:
        _write_token_minor_kernel[(triton.cdiv(t, _TOKENS),)](
            k, v, k_cache, v_cache, slot_mapping, ks, vs, sk, sv, k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(2), v_cache.stride(3), t, NUM_H=h, D=d,
            BLOCK_H=_pow2(h), BLOCK_D=_pow2(d), PAGE=page, TOKENS=_TOKENS, QUANT=quant,
        )  # fmt: skip
        return
    _write_cache_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs, sk, sv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        COL0=0, COL1=0, NUM_H=h, D0=d, D1=v.shape[-1],
        BLOCK_H=_pow2(h), BLOCK_D0=_pow2(d), BLOCK_D1=_pow2(v.shape[-1]),
        PAGE=k_cache.shape[1], QUANT=quant,
    )  # fmt: skip


def write_mla_cache_kernel(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Store ``kv_c`` [T, R] and ``k_pe`` [T, P] side by side into ``cache`` [NB, BS, R + P].

    An fp8 cache: ``scale`` fp32 [1] (None: 1.0) for the whole row."""
    t, r = kv_c.shape
    p = k_pe.shape[-1]
    assert kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1 and cache.stride(-1) == 1
    if t == 0:
        return
    quant = cache.dtype == torch.float8_e4m3fn
    s0, s1, st0, st1 = fp8_scale_args(cache, scale, scale)
    _write_cache_kernel[(t,)](
        kv_c, k_pe, cache, cache, slot_mapping, s0, s1, st0, st1,
        kv_c.stride(0), 0, k_pe.stride(0), 0,
        cache.stride(0), cache.stride(1), 0, 1,
        cache.stride(0), cache.stride(1), 0, 1,
        COL0=0, COL1=r, NUM_H=1, D0=r, D1=p,
        BLOCK_H=1, BLOCK_D0=_pow2(r), BLOCK_D1=_pow2(p),
        PAGE=cache.shape[1], QUANT=quant,
    )  # fmt: skip
