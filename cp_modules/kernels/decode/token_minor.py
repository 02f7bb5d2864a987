"""Tile loads of a token-minor value cache for the GQA decode kernel
(:mod:`cp_modules.kernels.decode.paged`).

A token-minor cache ([NB, BS, Hkv, D] with strides ``(Hkv * D * BS, 1, D * BS, BS)``,
:func:`cp_modules.cache.paged.allocate_kv_cache`) holds each (block, head, dim) row's BS tokens
contiguously, so the value tile of ``P @ V``, contracted along the tokens, is loaded as
[Dv, N] with the tokens contiguous and transposed in registers: the product's operand then
comes from whole words of shared memory (``ldmatrix``), not one byte at a time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cp_modules.kernels.decode.fp8 import fp8_e4m3_bits_to

__all__ = ["sub_entries", "token_minor_value_tile"]


@triton.jit
def sub_entries(bt_row, n0, p_hi, first, PAGE: tl.constexpr, SUBS: tl.constexpr):
    """The block-table entries of the ``SUBS`` blocks of the tile at ``n0`` (0 for a block
    with no key in ``[first, p_hi)``)."""
    offs_s = n0 + tl.arange(0, SUBS) * PAGE
    return tl.load(bt_row + offs_s // PAGE, mask=(offs_s < p_hi) & (offs_s + PAGE > first), other=0)


@triton.jit
def token_minor_value_tile(
    V_h, v_tok, vblk, n_mask, offs_dv, dv_mask, stride_vb, stride_vd,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SUBS: tl.constexpr, KV_FP8: tl.constexpr,
    FP8_KIND: tl.constexpr, FP8_ASM: tl.constexpr, HIDDEN: tl.constexpr,
):  # fmt: skip
    """The value tile [N, Dv] of the KV head at ``V_h`` (fp8: converted as the decode kernel's
    ``FP8_KIND`` says), loaded as [Dv, N] with the tokens contiguous.

    ``SUBS`` > 1: the tile spans ``SUBS`` whole blocks of entries ``vblk`` [SUBS], loaded as
    [Dv, SUBS, PAGE]. Else ``v_tok`` [N] is each token's offset; with ``PAGE % N == 0`` the
    tile lies in one block. In those two cases every entry is a block's (masked entries read
    block 0), so the loads take no mask along the tokens and stay vectorised; ``HIDDEN`` (the
    tile may hold keys outside ``n_mask``): their values, anything, are made finite, which
    with p = 0 for them adds nothing (the integer conversions give finite values for every
    byte, the hardware one NaN for 0x7F / 0xFF, which no write stores: min/max take the other
    operand of a NaN; other caches are zeroed there). Otherwise (a block size that neither
    divides nor is divided by the tile) the tokens are loaded one by one under ``n_mask``.
    """
    if SUBS > 1:
        vt = tl.load(V_h + vblk[None, :, None] * stride_vb + offs_dv[:, None, None] * stride_vd
                     + tl.arange(0, PAGE)[None, None, :], mask=dv_mask[:, None, None],
                     other=0)  # fmt: skip
        vt = tl.reshape(vt, [offs_dv.shape[0], BLOCK_N])
    elif PAGE % BLOCK_N == 0:
        vt = tl.load(V_h + v_tok[None, :] + offs_dv[:, None] * stride_vd, mask=dv_mask[:, None],
                     other=0)  # fmt: skip
    else:
        vt = tl.load(V_h + v_tok[None, :] + offs_dv[:, None] * stride_vd,
                     mask=n_mask[None, :] & dv_mask[:, None], other=0)  # fmt: skip
    v = tl.trans(vt)
    if KV_FP8:
        v = fp8_e4m3_bits_to(v, FP8_KIND, FP8_ASM, 4)
    if HIDDEN and KV_FP8 and FP8_KIND == 3:
        lim = tl.full([1, 1], 448.0, tl.float16)
        v = tl.minimum(tl.maximum(v, -lim), lim)
    elif HIDDEN and not KV_FP8:
        v = tl.where(n_mask[:, None], v, 0.0)
    return v
