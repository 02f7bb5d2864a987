"""The fp8 window's per-step index kernels (CUDA's path) against their PyTorch references,
under the Triton interpreter: every field equal, over DCP layouts, sliding windows, sink-only
and recent-only windows, decode runs (a ring larger than the recent count), padding tokens and
tokens another rank stores."""

from __future__ import annotations

import pytest
import torch

from cp_modules.cache.dcp import local_seq_len
from cp_modules.cache.exact_window import (
    allocate_window_buffer,
    check_exact_window,
    window_decode_ranges,
    window_write_index,
)
from cp_modules.kernels.decode.window_index import (
    window_decode_ranges_triton,
    window_write_index_triton,
)

CASES = [
    # sink, recent, max_query_len, (dcp size, rank, interleave), sliding window
    (1, 16, 1, (1, 0, 1), 0),
    (4, 5, 3, (1, 0, 1), 0),
    (0, 7, 1, (2, 1, 1), 0),
    (3, 0, 1, (2, 0, 4), 0),
    (2, 6, 2, (4, 3, 2), 0),
    (2, 6, 1, (1, 0, 1), 9),
    (1, 4, 2, (2, 1, 2), 5),
]


def _inputs(seed: int, t: int, rows: int, dcp):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 90, (t,), generator=g)
    pos[:3] = torch.tensor([0, 1, 2])[: min(3, t)]
    row = torch.randint(0, rows, (t,), generator=g)
    kv_len = local_seq_len(pos + 1, *dcp).to(torch.int32)
    return pos, row, kv_len


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_window_decode_ranges_kernel_equals_the_reference(case):
    sink, recent, qlen, dcp, sliding = case
    win = check_exact_window(sink, recent, qlen)
    buf = allocate_window_buffer(6, win, (2, 1, 4), dtype=torch.bfloat16)
    pos, row, kv_len = _inputs(sum(case[:3]), 70, 6, dcp)
    first = (pos - sliding + 1).clamp_min(0) if sliding else None
    want = window_decode_ranges(buf, win, row, pos, kv_len, first, dcp)
    got = window_decode_ranges_triton(buf, win, row, pos, kv_len, first, dcp)
    for name in ("kernel_start", "kernel_len", "slots", "valid", "sink_local", "sink_valid",
                 "positions"):  # fmt: skip
        w, o = getattr(want, name), getattr(got, name)
        assert o.dtype == w.dtype and o.shape == w.shape, name
        assert torch.equal(o, w), name
    # The kernel sees a shrunken range wherever a key moved to the window.
    assert bool((got.kernel_len <= kv_len).all())


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_window_write_index_kernel_equals_the_reference(case):
    sink, recent, qlen, dcp, _ = case
    win = check_exact_window(sink, recent, qlen)
    buf = allocate_window_buffer(6, win, (8,), dtype=torch.bfloat16)
    pos, row, _ = _inputs(7 + sum(case[:3]), 53, 6, dcp)
    pos[5] = -1  # a padding token
    owned = torch.rand(pos.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    ends = pos.clamp_min(0) + torch.randint(1, 4, pos.shape)
    want = window_write_index(buf, win, owned, row, pos, ends, dcp)
    got = window_write_index_triton(buf, win, owned, row, pos, ends, dcp)
    assert len(got) == len(want) == (win.capacity > 0) + (win.sink > 0)
    for w, o in zip(want, got):
        assert torch.equal(o, w.to(o.dtype))
    scratch = (buf.shape[0] - 1) * buf.shape[1]
    assert all(bool((o[5] == scratch).all()) for o in got)  # padding goes nowhere


def test_window_index_kernels_take_no_tokens():
    win = check_exact_window(1, 4)
    buf = allocate_window_buffer(2, win, (8,), dtype=torch.bfloat16)
    e = torch.zeros(0, dtype=torch.int64)
    r = window_decode_ranges_triton(buf, win, e, e, e.to(torch.int32), None)
    assert r.slots.shape == (0, 5) and r.kernel_len.dtype == torch.int32
    assert [x.shape for x in window_write_index_triton(buf, win, e > 0, e, e, e)] == [(0,), (0,)]
