#!/usr/bin/env python
"""Launch the default Gluon MLA decode on one shape, for a profiler run (``ncu``) or a clock probe.

Run from the repository root on a CUDA machine:

    python tools/probe_mla_ncu.py --block-size 64 --batch 8 --ctx 4096 [--launches 2]
    python tools/probe_mla_ncu.py ... --replay-s 3   # CUDA-graph replays for 3 s (clock probe)

The op is checked against the reference first (a failed check exits with status 1). Then it is
launched ``--launches`` times eagerly (under ``ncu``, profile the last with ``--launch-skip``), or
replayed for ``--replay-s`` seconds in a CUDA graph while ``nvidia-smi`` samples the clocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_mla_decode as bm  # noqa: E402
from cp_modules.kernels import paged_decode_mla_gluon as gluon  # noqa: E402


def flush_modes(fn, reps: int = 50) -> dict:
    """Median µs of one graph replay of ``fn`` after: ``zero`` (do_bench's flush: 256 MB
    written, so the L2 is full of dirty lines that the op's misses must write back), ``read``
    (256 MB read: the L2 holds clean lines), ``none`` (the op's own data still in the L2; a
    spin kernel keeps the GPU busy while the host launches the graph, as the flushes do)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    buf = torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda")
    flushes = {"zero": buf.zero_, "read": lambda: torch.sum(buf, dtype=torch.int64),
               "none": lambda: torch.cuda._sleep(200_000)}  # fmt: skip
    res = {"do_bench_us": float(do_bench(graph.replay, warmup=5, rep=30,
                                         return_mode="median")) * 1e3}  # fmt: skip
    for name, flush in flushes.items():
        times = []
        for _ in range(reps):
            flush()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        res[name + "_us"] = statistics.median(times)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--variant", default="", help="a GLUON_MLA_VARIANTS name (default schedule)")
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--replay-s", type=float, default=0.0)
    ap.add_argument(
        "--flush-modes",
        action="store_true",
        help="time the graph replay after each kind of L2 flush",
    )
    a = ap.parse_args()
    pool = bm.make_pool(a.block_size, a.batch * a.ctx)
    q, bt, seq, lens = bm.make_inputs(pool, a.heads, a.batch, a.ctx)
    ref = bm.reference(pool, q, bt, seq, lens)
    config = gluon.GLUON_MLA_VARIANTS[a.variant] if a.variant else None

    def fn():
        return gluon.paged_mla_attention_gluon(q, pool, bt, seq, lens, bm.SCALE, bm.RK,
                                               config=config)  # fmt: skip

    got = bm.check(*fn(), ref)
    print(f"check: {got}", flush=True)
    if not got["ok"]:
        return 1
    for _ in range(a.launches):
        fn()
    torch.cuda.synchronize()
    if a.replay_s > 0:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.replay_s:
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            n += 20
        dt = time.perf_counter() - t0
        print(f"replays: {n} in {dt:.2f} s, {dt / n * 1e6:.1f} us each", flush=True)
    if a.flush_modes:
        print(json.dumps(flush_modes(fn)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
