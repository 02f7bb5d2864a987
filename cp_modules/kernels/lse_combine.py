"""Triton kernel: LSE-weighted combine of N partial attention outputs (the DCP ``a2a`` combine).

Shape legend:
    N: partial results (KV shards)    B: tokens    H: heads    D: value head dim
    R: rows, one per (token, head), R = B * H

The kernel is memory-bound: it reads ``N * R * D`` elements and writes ``R * D``. A program owns
``BLOCK_R`` rows and a ``BLOCK_D`` slice of D (the whole row for D <= 512), computes each row's
N weights in fp32 from its N LSEs (two passes over them, so the combine is the exact two-pass
formula of the reference), and streams the N partial tiles with 16-byte loads. Partial outputs
may be strided views (the packed all-to-all buffer is read in place) as long as D is
contiguous. Reference: :mod:`cp_modules.reference.lse_combine`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["lse_combine_launch_config", "lse_combine_triton"]


@triton.jit
def _sanitize_lse(lse):
    # NaN and +inf mark an empty shard: treat them as -inf so the shard's weight is 0.
    return tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)


@triton.jit
def _exp(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.log2(x)
    else:
        return tl.log(x)


@triton.jit
def _row_max_and_sum(l_ptrs, s_ln, row_ok, N: tl.constexpr, BASE2: tl.constexpr):
    """Per row: max of the sanitized LSEs (0 when all are -inf) and sum of exp(lse - max)."""
    m = tl.full(row_ok.shape, float("-inf"), tl.float32)
    for i in tl.static_range(N):
        lse = _sanitize_lse(tl.load(l_ptrs + i * s_ln, mask=row_ok, other=float("-inf")))
        m = tl.maximum(m, lse)
    m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.zeros(row_ok.shape, tl.float32)
    for i in tl.static_range(N):
        lse = _sanitize_lse(tl.load(l_ptrs + i * s_ln, mask=row_ok, other=float("-inf")))
        s += _exp(lse - m, BASE2)
    return m, s


@triton.jit
def _lse_combine_kernel(
    x_ptr,  # [N, B, H, D] partial outputs, D contiguous
    l_ptr,  # [N, B, H] fp32 partial LSEs
    y_ptr,  # [B, H, D] combined output, D contiguous
    z_ptr,  # [B, H] fp32 combined LSE
    num_rows,
    num_heads,
    s_xn,
    s_xb,
    s_xh,
    s_ln,
    s_lb,
    s_lh,
    s_yb,
    s_yh,
    s_zb,
    s_zh,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BASE2: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    # int64 row offsets: N * B * H * D can exceed 2**31 for long prefill-context combines.
    b = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)

    l_ptrs = l_ptr + b * s_lb + h * s_lh
    m, s = _row_max_and_sum(l_ptrs, s_ln, row_ok, N, BASE2)
    nonempty = s > 0.0
    inv_s = 1.0 / tl.where(nonempty, s, 1.0)

    x_ptrs = x_ptr + (b * s_xb + h * s_xh)[:, None] + d[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for _ in tl.static_range(N):
        lse = _sanitize_lse(tl.load(l_ptrs, mask=row_ok, other=float("-inf")))
        w = _exp(lse - m, BASE2) * inv_s
        # Each partial is read exactly once: keep it from evicting the LSEs and the output.
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        # where(), not a product alone: an empty shard's output may be NaN and 0 * NaN is NaN.
        acc += tl.where(w[:, None] > 0.0, x * w[:, None], 0.0)
        l_ptrs += s_ln
        x_ptrs += s_xn

    y_ptrs = y_ptr + (b * s_yb + h * s_yh)[:, None] + d[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    out_lse = tl.where(nonempty, m + _log(tl.where(nonempty, s, 1.0), BASE2), float("-inf"))
    tl.store(z_ptr + b * s_zb + h * s_zh, out_lse, mask=row_ok & (pid_d == 0))


@functools.cache
def lse_combine_launch_config(head_dim: int, elem_size: int) -> tuple[int, int, int]:
    """Default ``(BLOCK_R, BLOCK_D, num_warps)`` for a value head dim and element size.

    About 8 KiB of each partial per program of 4 warps gives every thread four 16-byte loads
    per partial, which the compiler issues back to back (on sm_90: ~90 registers at N = 8, no
    spills, no shared memory); D up to 512 stays in one tile so each row's weights are
    computed once. ``benchmarks/bench_lse_combine.py`` sweeps the alternatives.
    """
    block_d = min(triton.next_power_of_2(head_dim), 512)
    block_r = triton.next_power_of_2(max(1, min(64, 8192 // (block_d * elem_size))))
    return block_r, block_d, 4


def lse_combine_triton(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    base2: bool = False,
    block_rows: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the combine: ``[N, B, H, D]`` + ``[N, B, H]`` fp32 -> ``[B, H, D]`` + ``[B, H]`` fp32.

    ``partial_out`` may be any strided view whose last dim is contiguous; ``partial_lse`` any
    strided fp32 view. The block sizes and warps default to :func:`lse_combine_launch_config`.
    """
    n, b, h, d = partial_out.shape
    assert partial_out.stride(-1) == 1, "the head dim of partial_out must be contiguous"
    assert partial_lse.shape == (n, b, h) and partial_lse.dtype == torch.float32
    out = partial_out.new_empty((b, h, d))
    out_lse = partial_lse.new_empty((b, h))
    rows = b * h
    if rows == 0:
        return out, out_lse
    cfg_r, cfg_d, cfg_w = lse_combine_launch_config(d, partial_out.element_size())
    block_r = block_rows or cfg_r
    block_d = block_d or cfg_d
    grid = (triton.cdiv(rows, block_r), triton.cdiv(d, block_d))
    _lse_combine_kernel[grid](
        partial_out,
        partial_lse,
        out,
        out_lse,
        rows,
        h,
        *partial_out.stride()[:3],
        *partial_lse.stride(),
        *out.stride()[:2],
        *out_lse.stride(),
        N=n,
        HEAD_DIM=d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        BASE2=base2,
        num_warps=num_warps or cfg_w,
    )
    return out, out_lse
