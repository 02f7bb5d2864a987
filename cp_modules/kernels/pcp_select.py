"""Triton kernel: pack q_head, q_tail, k_head, v_head, k_tail, v_tail in one launch.

Shape letters: T = local queries, N = restored new tokens, Hq / Hkv = heads, Dqk / Dv = head
dims, Lh / Lt = packed head / tail queries, Mh / Mt = packed head / tail keys.

Each output row is a whole [H, D] row of its source (contiguous in memory), named by a host-built
index, so the kernel is six row gathers sharing one grid: program ids are dealt to the six jobs
in turn and every program copies ``BLOCK_R`` rows in ``BLOCK_C``-element strips.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pcp_select_triton"]


@triton.jit
def _copy_rows(
    src, dst, index, num_rows, width, src_stride, block,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    src_rows = tl.load(index + rows, mask=row_mask, other=0).to(tl.int64)
    src_base = src + src_rows[:, None] * src_stride
    dst_base = dst + rows.to(tl.int64)[:, None] * width
    for c0 in range(0, width, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < width)[None, :]
        x = tl.load(src_base + cols[None, :], mask=mask)
        tl.store(dst_base + cols[None, :], x, mask=mask)


@triton.jit
def _pcp_select_kernel(
    q, k, v, q_head_index, q_tail_index, k_head_index, k_tail_index,
    q_head, q_tail, k_head, v_head, k_tail, v_tail,
    num_q_head, num_q_tail, num_k_head, num_k_tail,
    q_width, k_width, v_width, q_stride, k_stride, v_stride,
    end0, end1, end2, end3, end4,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < end0:
        _copy_rows(q, q_head, q_head_index, num_q_head, q_width, q_stride, pid, BLOCK_R, BLOCK_C)
    elif pid < end1:
        _copy_rows(
            q, q_tail, q_tail_index, num_q_tail, q_width, q_stride, pid - end0, BLOCK_R, BLOCK_C
        )
    elif pid < end2:
        _copy_rows(
            k, k_head, k_head_index, num_k_head, k_width, k_stride, pid - end1, BLOCK_R, BLOCK_C
        )
    elif pid < end3:
        _copy_rows(
            v, v_head, k_head_index, num_k_head, v_width, v_stride, pid - end2, BLOCK_R, BLOCK_C
        )
    elif pid < end4:
        _copy_rows(
            k, k_tail, k_tail_index, num_k_tail, k_width, k_stride, pid - end3, BLOCK_R, BLOCK_C
        )
    else:
        _copy_rows(
            v, v_tail, k_tail_index, num_k_tail, v_width, v_stride, pid - end4, BLOCK_R, BLOCK_C
        )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    # A row must be one contiguous run of H·D elements; only the token stride may be arbitrary.
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def pcp_select_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_head_index: torch.Tensor,
    q_tail_index: torch.Tensor,
    k_head_index: torch.Tensor,
    k_tail_index: torch.Tensor,
    *,
    block_rows: int = 8,
    block_cols: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`cp_modules.reference.pcp_select.pcp_select_reference`.

    ``block_rows`` / ``block_cols`` set the tile (powers of two); the default strip is the
    widest row rounded up to a power of two, at most 1024 elements.
    """
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    indices = [x.contiguous() for x in (q_head_index, q_tail_index, k_head_index, k_tail_index)]
    qh, qt, kh, kt = indices
    outs = (
        q.new_empty((qh.shape[0],) + q.shape[1:]),
        q.new_empty((qt.shape[0],) + q.shape[1:]),
        k.new_empty((kh.shape[0],) + k.shape[1:]),
        v.new_empty((kh.shape[0],) + v.shape[1:]),
        k.new_empty((kt.shape[0],) + k.shape[1:]),
        v.new_empty((kt.shape[0],) + v.shape[1:]),
    )
    rows = [qh.shape[0], qt.shape[0], kh.shape[0], kh.shape[0], kt.shape[0], kt.shape[0]]
    ends, total = [], 0
    for n in rows:
        total += triton.cdiv(n, block_rows)
        ends.append(total)
    if total == 0:
        return outs
    widths = [x.shape[1] * x.shape[2] for x in (q, k, v)]
    if block_cols is None:
        block_cols = min(1024, triton.next_power_of_2(max(widths)))
    _pcp_select_kernel[(total,)](
        q, k, v, qh, qt, kh, kt, *outs,
        rows[0], rows[1], rows[2], rows[4],
        *widths, q.stride(0), k.stride(0), v.stride(0),
        *ends[:5],
        BLOCK_R=block_rows, BLOCK_C=block_cols,
    )  # fmt: skip
    return outs
