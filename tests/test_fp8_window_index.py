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


@pytest.mark.parametrize("scaled", [False, True])
def test_window_merge_reads_the_mla_sink_rows_from_the_fp8_cache(scaled):
    """The merge kernel's in-kernel read of the sink's fp8 rows (MLA, dequantized in fp32)
    against merge_exact with the rows gathered by gather_cache_rows in fp32 (its reference)."""
    from cp_modules.cache.exact_window import gather_cache_rows, gather_window, merge_exact
    from cp_modules.kernels.decode.exact_window import window_merge_triton

    torch.manual_seed(5)
    t, hq, d, rk, page = 6, 8, 24, 16, 4
    win = check_exact_window(3, 4)
    buf = torch.randn(4, win.slots, d)
    pos = torch.tensor([0, 2, 3, 9, 20, 41])
    row = torch.tensor([0, 1, 2, 0, 1, 2])
    r = window_decode_ranges(buf, win, row, pos, pos + 1, None)
    # Finite e4m3 bytes only (the interpreter reads the NaN pattern as 480); unit rows, as in
    # the merge test of tests/test_fp8_exact_window.py (larger sink keys make the removal a
    # near-cancellation, ill-conditioned in any fp32 arithmetic).
    cache = torch.randn(40, page, d).to(torch.float8_e4m3fn)
    table = torch.randperm(40)[: 3 * 12].view(3, 12).to(torch.int32)
    scale = torch.tensor([0.37]) if scaled else None
    q = torch.randn(t, hq, d)
    out = torch.randn(t, hq, rk)
    lse = torch.randn(t, hq) * 3
    sub = gather_cache_rows(cache, table, row, r.sink_local, scale, torch.float32)
    # A scale takes the rows off the bf16 grid (e4m3 alone is on it): read in fp32, not bf16.
    assert torch.equal(sub, sub.to(torch.bfloat16).float()) != scaled
    k, ks = gather_window(buf, r.slots)[:, :, None, :], sub[:, :, None, :]
    want = merge_exact(out, lse, q, k, k[..., :rk], r.valid, 0.3, None, k_sub=ks,
                       v_sub=ks[..., :rk], sub_valid=r.sink_valid)  # fmt: skip
    got = window_merge_triton(
        out, lse, q, buf, r.slots, r.valid, 0.3, None, value_dim=rk, value_offset=0,
        sub_valid=r.sink_valid, sub_cache=(cache, table, row, r.sink_local, scale),
    )  # fmt: skip
    assert bool(r.sink_valid.any()) and not bool(r.sink_valid.all())
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


def _window_steps(family: str, device: str, window: tuple[int, int]):
    """Decode outputs of 3 requests (a prefill, then 4 decode steps) through one attention op
    with an fp8 cache and the window ``(sink, recent)`` ((0, 0): none), on ``device``."""
    from cp_modules.cache.kv_dtype import kv_scale
    from cp_modules.cache.paged import allocate_kv_cache, allocate_mla_cache
    from cp_modules.ops.gqa_attention import gqa_attention
    from cp_modules.ops.mla_attention import mla_attention
    from cp_modules.step import CPRuntime, build_step_metadata, cp_step

    g = torch.Generator().manual_seed(0)
    dt, bs, done, outs = torch.bfloat16, 16, [0, 0, 0], []
    table = torch.arange(3 * 8, dtype=torch.int32).view(3, 8).to(device)
    win = check_exact_window(*window)
    if family == "gqa":
        hq, hkv, d = 8, 2, 64
        kc, vc = allocate_kv_cache(24, bs, hkv, d, dtype=torch.float8_e4m3fn, device=device)
        sc = (kv_scale(0.5, hkv, device=device), kv_scale(0.25, hkv, device=device))
        tail = (2, hkv, d)
    else:
        h, rk, dr, dn = 16, 512, 64, 64
        cache = allocate_mla_cache(24, bs, rk, dr, dtype=torch.float8_e4m3fn, device=device)
        c_scale = kv_scale(0.5, 1, device=device)
        w_uk = (torch.randn(h, dn, rk, generator=g) * rk**-0.5).to(device, dt)
        w_uv = (torch.randn(h, dn, rk, generator=g) * rk**-0.5).to(device, dt)
        tail = (rk + dr,)
    fw = None
    if win is not None:
        fw = (allocate_window_buffer(3, win, tail, dtype=dt, device=device), *window)
    for num_new in ([37, 20, 53], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]):
        meta = build_step_metadata(CPRuntime.single(), num_new, done, block_table=table,
                                   block_size=bs, device=device)  # fmt: skip
        n = sum(num_new)
        with cp_step(meta):
            if family == "gqa":
                q = torch.randn(n, hq, d, generator=g).to(device, dt)
                k = (torch.randn(n, hkv, d, generator=g) * 3).to(device, dt)
                v = torch.randn(n, hkv, d, generator=g).to(device, dt)
                out = gqa_attention(q, k, v, (kc, vc), scale=d**-0.5, kv_scales=sc,
                                    fp8_window=fw)  # fmt: skip
            else:
                q = torch.randn(n, h, dn + dr, generator=g).to(device, dt)
                lat = (torch.randn(n, rk + dr, generator=g) * 2).to(device, dt)
                out = mla_attention(q, lat, w_uk, w_uv, cache, scale=(dn + dr) ** -0.5,
                                    kv_lora_rank=rk, cache_scale=c_scale,
                                    fp8_window=fw)  # fmt: skip
        if done[0]:
            outs.append(out.float().cpu())
        done = [c + m for c, m in zip(done, num_new)]
    return torch.stack(outs)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gqa", "mla"])
def test_gpu_window_decode_equals_the_cpu_path(family):
    """CUDA's window path (the fp8 kernel on the range left to it, the index kernels, the
    merge, for MLA the sink's fp8 copies removed in the merge) against the CPU's (one
    reference call with the window's rows in place), on the same inputs; the window's own
    effect is several times the difference between the devices."""
    got = _window_steps(family, "cuda", (1, 6))
    want = _window_steps(family, "cpu", (1, 6))
    plain = _window_steps(family, "cuda", (0, 0))
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)  # bf16 outputs up to ~6
    # Relative norms: the devices differ by bf16 roundings (~0.5 %); the window moves the
    # output by ~2-3 % (measured on the CPU path).
    err = ((got - want).norm() / want.norm()).item()
    effect = ((got - plain).norm() / want.norm()).item()
    assert err < 0.01 and effect > 4 * err, (effect, err)
