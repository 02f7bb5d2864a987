"""Triton kernel: scale one rank's partial attention output by its LSE weight (DCP ``ag_rs``).

Shape legend:
    N: DCP ranks    B: tokens    H: heads (all gathered heads)    D: value head dim
    K: head blocks of the output    R: rows, one per (token, head), R = B * H

Every rank holds the all-gathered LSEs ``[N, B, H]`` and its own partial output ``[B, H, D]``;
it writes ``w_rank * out`` so that a sum over ranks (reduce-scatter or all-reduce) is the exact
combine. The result is written head-block-major, ``[K, B, H/K, D]``, so a reduce-scatter over K
ranks sends contiguous blocks with no extra copy. Reference:
:mod:`cp_modules.reference.correct_attn_out`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_modules.kernels.lse_combine import (
    _exp,
    _log,
    _row_max_and_sum,
    _sanitize_lse,
    lse_combine_launch_config,
)

__all__ = ["correct_attn_out_triton"]


@triton.jit
def _correct_attn_out_kernel(
    x_ptr,  # [B, H, D] this rank's partial output, D contiguous
    l_ptr,  # [N, B, H] fp32 LSEs of every rank
    y_ptr,  # [K, B, H/K, D] corrected output
    z_ptr,  # [B, H] fp32 combined LSE
    rank,
    num_rows,
    num_heads,
    heads_per_block,
    s_xb,
    s_xh,
    s_ln,
    s_lb,
    s_lh,
    s_yk,
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
    b = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)

    l_ptrs = l_ptr + b * s_lb + h * s_lh
    m, s = _row_max_and_sum(l_ptrs, s_ln, row_ok, N, BASE2)
    nonempty = s > 0.0
    own = _sanitize_lse(tl.load(l_ptrs + rank * s_ln, mask=row_ok, other=float("-inf")))
    w = _exp(own - m, BASE2) / tl.where(nonempty, s, 1.0)

    x = tl.load(x_ptr + (b * s_xb + h * s_xh)[:, None] + d[None, :], mask=mask, other=0.0)
    # where(), not a product alone: an empty shard's output may be NaN and 0 * NaN is NaN.
    y = tl.where(w[:, None] > 0.0, x.to(tl.float32) * w[:, None], 0.0)
    blk = h // heads_per_block
    y_off = blk * s_yk + b * s_yb + (h - blk * heads_per_block) * s_yh
    tl.store(y_ptr + y_off[:, None] + d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    out_lse = tl.where(nonempty, m + _log(tl.where(nonempty, s, 1.0), BASE2), float("-inf"))
    tl.store(z_ptr + b * s_zb + h * s_zh, out_lse, mask=row_ok & (pid_d == 0))


def correct_attn_out_triton(
    out: torch.Tensor,
    all_lse: torch.Tensor,
    rank: int,
    *,
    num_blocks: int = 1,
    base2: bool = False,
    block_rows: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the correction: ``[B, H, D]`` + ``[N, B, H]`` fp32 -> ``[K, B, H/K, D]`` + ``[B, H]``.

    ``out`` may be strided with a contiguous last dim; ``all_lse`` any strided fp32 view.
    """
    b, h, d = out.shape
    n = all_lse.shape[0]
    assert out.stride(-1) == 1, "the head dim of out must be contiguous"
    assert all_lse.shape == (n, b, h) and all_lse.dtype == torch.float32
    assert 0 <= rank < n and h % num_blocks == 0
    y = out.new_empty((num_blocks, b, h // num_blocks, d))
    out_lse = all_lse.new_empty((b, h))
    rows = b * h
    if rows == 0:
        return y, out_lse
    cfg_r, cfg_d, cfg_w = lse_combine_launch_config(d, out.element_size())
    block_r = block_rows or cfg_r
    block_d = block_d or cfg_d
    grid = (triton.cdiv(rows, block_r), triton.cdiv(d, block_d))
    _correct_attn_out_kernel[grid](
        out,
        all_lse,
        y,
        out_lse,
        rank,
        rows,
        h,
        h // num_blocks,
        *out.stride()[:2],
        *all_lse.stride(),
        *y.stride()[:3],
        *out_lse.stride(),
        N=n,
        HEAD_DIM=d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        BASE2=base2,
        num_warps=num_warps or cfg_w,
    )
    return y, out_lse
