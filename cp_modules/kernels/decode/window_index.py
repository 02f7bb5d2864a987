"""The fp8 cache's bf16 window: a step's index math in one launch each.

:func:`~cp_modules.cache.exact_window.window_decode_ranges` (which keys each decode query reads
from the window, and the range left to the paged kernel) and
:func:`~cp_modules.cache.exact_window.window_write_index` (where each new token is stored in the
window) are their pure-PyTorch references. There they take about 100 small PyTorch kernels a
step; here one Triton launch each. Same arguments and results, integers only (exact).

Shape letters: T = decode queries, N = new tokens, S = sink tokens, R = recent tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_modules.cache.exact_window import ExactWindow, WindowRanges

__all__ = ["window_decode_ranges_triton", "window_write_index_triton"]

_BLOCK_T = 64


@triton.jit
def _local(x, DCP: tl.constexpr, RANK: tl.constexpr, INTERLEAVE: tl.constexpr):
    # local_seq_len of lengths x >= 0 (cp_modules.cache.dcp)
    base = x // (DCP * INTERLEAVE) * INTERLEAVE
    rest = x - base * DCP - RANK * INTERLEAVE
    return base + tl.minimum(tl.maximum(rest, 0), INTERLEAVE)


@triton.jit
def _ranges_kernel(
    rows_ptr, pos_ptr, len_ptr, first_ptr,
    start_ptr, klen_ptr, slots_ptr, valid_ptr, sink_local_ptr, sink_valid_ptr, positions_ptr,
    T, SLOTS,
    SINK: tl.constexpr, RECENT: tl.constexpr, CAP: tl.constexpr, HAS_FIRST: tl.constexpr,
    DCP: tl.constexpr, RANK: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    p = tl.load(pos_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
    length = tl.load(len_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
    row = tl.load(rows_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
    if HAS_FIRST:
        g0 = tl.maximum(tl.load(first_ptr + offs_t, mask=t_ok, other=0).to(tl.int64), 0)
    else:
        g0 = tl.zeros([BLOCK_T], dtype=tl.int64)
    g_recent = tl.maximum(p + 1 - RECENT, g0)
    lo = _local(g_recent, DCP, RANK, INTERLEAVE)
    g_sink_end = tl.minimum(g_recent, SINK)
    sink_lo = _local(tl.minimum(g0, g_sink_end), DCP, RANK, INTERLEAVE)
    sink_hi = _local(g_sink_end, DCP, RANK, INTERLEAVE)
    start0 = _local(g0, DCP, RANK, INTERLEAVE)
    kernel_start = tl.minimum(tl.maximum(start0, sink_hi), lo)
    tl.store(start_ptr + offs_t, kernel_start.to(start_ptr.dtype.element_ty), mask=t_ok)
    tl.store(klen_ptr + offs_t, lo.to(klen_ptr.dtype.element_ty), mask=t_ok)

    # Columns: the S sink keys, then the R recent ones.
    c = tl.arange(0, BLOCK_C).to(tl.int64)
    is_sink = c < SINK
    k_rec = c - SINK
    j = lo[:, None] + k_rec[None, :]  # local index of a recent key
    sink_valid = (c[None, :] >= sink_lo[:, None]) & (c[None, :] < sink_hi[:, None])
    rec_valid = j < length[:, None]
    if CAP > 0:
        rec_slot = SINK + j % CAP
    else:
        rec_slot = j * 0
    base = row[:, None] * SLOTS
    slot = tl.where(is_sink[None, :], base + c[None, :], base + rec_slot)
    valid = tl.where(is_sink[None, :], sink_valid, rec_valid)
    local = tl.where(is_sink[None, :], c[None, :] + j * 0, j)
    cols = SINK + RECENT
    m2 = t_ok[:, None] & (c[None, :] < cols)
    at = offs_t.to(tl.int64)[:, None] * cols + c[None, :]
    tl.store(slots_ptr + at, slot, mask=m2)
    tl.store(valid_ptr + at, valid.to(tl.int8), mask=m2)
    tl.store(positions_ptr + at, local, mask=m2)
    ms = t_ok[:, None] & is_sink[None, :]
    at_s = offs_t.to(tl.int64)[:, None] * SINK + c[None, :]
    tl.store(sink_local_ptr + at_s, c[None, :] + j * 0, mask=ms)
    sink_kept = sink_valid & (c[None, :] < lo[:, None])
    tl.store(sink_valid_ptr + at_s, sink_kept.to(tl.int8), mask=ms)


def window_decode_ranges_triton(
    buf: torch.Tensor,
    window: ExactWindow,
    rows: torch.Tensor,
    positions: torch.Tensor,
    kv_len: torch.Tensor,
    first: torch.Tensor | None,
    dcp: tuple[int, int, int] = (1, 0, 1),
) -> WindowRanges:
    """:func:`~cp_modules.cache.exact_window.window_decode_ranges` in one launch (same
    arguments and results)."""
    rows, positions, kv_len = rows.contiguous(), positions.contiguous(), kv_len.contiguous()
    first = None if first is None else first.contiguous()
    t = positions.shape[0]
    s, r = window.sink, window.recent
    dev = positions.device
    kernel_start = torch.empty_like(kv_len)
    kernel_len = torch.empty_like(kv_len)
    slots = torch.empty(t, s + r, dtype=torch.int64, device=dev)
    valid = torch.empty(t, s + r, dtype=torch.bool, device=dev)
    local = torch.empty(t, s + r, dtype=torch.int64, device=dev)
    sink_local = torch.empty(t, s, dtype=torch.int64, device=dev)
    sink_valid = torch.empty(t, s, dtype=torch.bool, device=dev)
    if t:
        size, rank, interleave = dcp
        _ranges_kernel[(triton.cdiv(t, _BLOCK_T),)](
            rows, positions, kv_len, first if first is not None else positions,
            kernel_start, kernel_len, slots, valid.view(torch.int8), sink_local,
            sink_valid.view(torch.int8), local, t, buf.shape[1],
            SINK=s, RECENT=r, CAP=window.capacity, HAS_FIRST=first is not None,
            DCP=size, RANK=rank, INTERLEAVE=interleave,
            BLOCK_T=_BLOCK_T, BLOCK_C=triton.next_power_of_2(max(s + r, 1)),
        )  # fmt: skip
    return WindowRanges(kernel_start, kernel_len, slots, valid, sink_local, sink_valid, local)


@triton.jit
def _write_index_kernel(
    owned_ptr, rows_ptr, pos_ptr, ends_ptr, ring_ptr, sink_ptr,
    N, SLOTS, SCRATCH,
    SINK: tl.constexpr, CAP: tl.constexpr,
    DCP: tl.constexpr, RANK: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    owned = tl.load(owned_ptr + offs, mask=ok, other=0) != 0
    row = tl.load(rows_ptr + offs, mask=ok, other=0).to(tl.int64)
    p_raw = tl.load(pos_ptr + offs, mask=ok, other=-1).to(tl.int64)
    pos = tl.maximum(p_raw, 0)
    j = _local(pos, DCP, RANK, INTERLEAVE)
    base = row * SLOTS
    live = owned & (p_raw >= 0)
    if CAP > 0:
        end = tl.load(ends_ptr + offs, mask=ok, other=0).to(tl.int64)
        keep = live & (j >= _local(end, DCP, RANK, INTERLEAVE) - CAP)
        tl.store(ring_ptr + offs, tl.where(keep, base + SINK + j % CAP, SCRATCH), mask=ok)
    if SINK > 0:
        keep_s = live & (p_raw < SINK)
        tl.store(sink_ptr + offs, tl.where(keep_s, base + j, SCRATCH), mask=ok)


def window_write_index_triton(
    buf: torch.Tensor,
    window: ExactWindow,
    owned: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    ends: torch.Tensor,
    dcp: tuple[int, int, int] = (1, 0, 1),
) -> tuple[torch.Tensor, ...]:
    """:func:`~cp_modules.cache.exact_window.window_write_index` in one launch (same arguments
    and results)."""
    owned, rows = owned.contiguous(), rows.contiguous()
    positions, ends = positions.contiguous(), ends.contiguous()
    n = positions.shape[0]
    n_rows, slots = buf.shape[0] - 1, buf.shape[1]
    ring = torch.empty_like(positions, dtype=torch.int64) if window.capacity else None
    sink = torch.empty_like(positions, dtype=torch.int64) if window.sink else None
    if n:
        size, rank, interleave = dcp
        dummy = ring if ring is not None else sink
        _write_index_kernel[(triton.cdiv(n, _BLOCK_T),)](
            owned.view(torch.int8) if owned.dtype == torch.bool else owned, rows, positions,
            ends, ring if ring is not None else dummy, sink if sink is not None else dummy,
            n, slots, n_rows * slots,
            SINK=window.sink, CAP=window.capacity, DCP=size, RANK=rank, INTERLEAVE=interleave,
            BLOCK_N=_BLOCK_T,
        )  # fmt: skip
    return tuple(x for x in (ring, sink) if x is not None)
