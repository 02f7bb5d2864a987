"""Triton kernels of the KV-cache writes (launchers only; the ``cp`` ops live in ops/).

Shape letters: T = new tokens, H = heads per token row, D = elements per head, BS = tokens per
block. One program stores one token: two source rows [H, D0] and [H, D1] go to their cache
rows at column offsets, which covers GQA (K into one cache, V into the other) and MLA (latent and
rope key side by side in one cache row) with one launch. Slot -1 stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv_cache_kernel", "write_mla_cache_kernel"]


@triton.jit
def _write_cache_kernel(
    SRC0,
    SRC1,
    DST0,
    DST1,
    SLOTS,
    stride_s0t,
    stride_s0h,
    stride_s1t,
    stride_s1h,
    stride_d0b,
    stride_d0s,
    stride_d0h,
    stride_d1b,
    stride_d1s,
    stride_d1h,
    COL0: tl.constexpr,
    COL1: tl.constexpr,
    NUM_H: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D0: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    PAGE: tl.constexpr,
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
        tl.store(dst0 + d0[None, :], x0.to(DST0.dtype.element_ty), mask=m0)
        d1 = tl.arange(0, BLOCK_D1)
        m1 = (h[:, None] < NUM_H) & (d1[None, :] < D1)
        x1 = tl.load(SRC1 + t * stride_s1t + h[:, None] * stride_s1h + d1[None, :], mask=m1)
        dst1 = DST1 + blk * stride_d1b + off * stride_d1s + h[:, None] * stride_d1h + COL1
        tl.store(dst1 + d1[None, :], x1.to(DST1.dtype.element_ty), mask=m1)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def write_kv_cache_kernel(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k, v`` [T, Hkv, D] (last dim contiguous) into [NB, BS, Hkv, D] caches."""
    t, h, d = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if t == 0:
        return
    _write_cache_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        COL0=0, COL1=0, NUM_H=h, D0=d, D1=v.shape[-1],
        BLOCK_H=_pow2(h), BLOCK_D0=_pow2(d), BLOCK_D1=_pow2(v.shape[-1]),
        PAGE=k_cache.shape[1],
    )  # fmt: skip


def write_mla_cache_kernel(
    kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``kv_c`` [T, R] and ``k_pe`` [T, P] side by side into ``cache`` [NB, BS, R + P]."""
    t, r = kv_c.shape
    p = k_pe.shape[-1]
    assert kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1 and cache.stride(-1) == 1
    if t == 0:
        return
    _write_cache_kernel[(t,)](
        kv_c, k_pe, cache, cache, slot_mapping,
        kv_c.stride(0), 0, k_pe.stride(0), 0,
        cache.stride(0), cache.stride(1), 0,
        cache.stride(0), cache.stride(1), 0,
        COL0=0, COL1=r, NUM_H=1, D0=r, D1=p,
        BLOCK_H=1, BLOCK_D0=_pow2(r), BLOCK_D1=_pow2(p),
        PAGE=cache.shape[1],
    )  # fmt: skip
