#!/usr/bin/env python
"""Where the time of the Gluon MLA decode goes: one shape for a profiler run (``ncu``), a clock
probe, the L2 state's share, and the op's fixed cost against its cost per tile.

Run from the repository root on a CUDA machine:

    python tools/probes/probe_mla_costs.py --block-size 64 --batch 8 --ctx 4096 [--launches 2]
    python tools/probes/probe_mla_costs.py ... --replay-s 3   # CUDA-graph replays for 3 s (clocks)
    python tools/probes/probe_mla_costs.py ... --flush-modes  # after a dirty, clean or no L2 flush
    python tools/probes/probe_mla_costs.py --batch 8 --splits 8 --ctx-sweep 0,512,1024,2048,4096,8192
    python tools/probes/probe_mla_costs.py --batch 8 --ctx 4096 --layers 8  # per layer, in a step's graph

The op is checked against the reference first (a failed check exits with status 1). Then it is
launched ``--launches`` times eagerly (under ``ncu``, profile the last with ``--launch-skip``),
replayed for ``--replay-s`` seconds in a CUDA graph while ``nvidia-smi`` samples the clocks, or
timed after each kind of L2 flush. ``--ctx-sweep`` times the op (``do_bench`` of its CUDA graph,
as the benchmark does) at a fixed split count over several context lengths, 0 included (every
program launched, Q loaded, its empty partial stored and merged: the fixed cost), fits time =
fixed + per-tile cost x tiles per program, and times the floors beside it: a graph of one empty
kernel, the zero-fill of a buffer the size of the fp32 partials, and the split merge alone.
``--layers N`` builds N layers, each with its own cache, query and block table (every one
checked), and times one CUDA graph that runs the op once per layer back to back, as a decode
step's graph does (``do_bench``: the L2 flushed once before each replay; the graph's time / N
is the cost a layer), next to the one-op graph that the benchmark times; ``--no-merge`` adds
the same graph with the split merge replaced by a no-op (the kernel alone).
Writes one JSON line per measurement; ``--out`` also writes them to a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_mla_decode as bm  # noqa: E402
from benchmarks.common import graph_replay_us  # noqa: E402
from cp_modules.kernels.decode import mla_gluon as gluon  # noqa: E402


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


@triton.jit
def _empty_kernel(X):
    pass


def ctx_sweep(a, ctxs: list[int]) -> list[dict]:
    """The op at ``a.splits`` splits over ``ctxs``, the least-squares line through the
    nonzero lengths' times against tiles per program, and the floors."""
    from cp_modules.kernels.merge import merge_splits_triton

    splits = a.splits or 8
    top = max(max(ctxs), 64)
    pool = bm.make_pool(a.block_size, a.batch * top)
    config = gluon.GLUON_MLA_VARIANTS[a.variant] if a.variant else None
    lines: list[dict] = []
    for ctx in ctxs:
        q, bt, seq, lens = bm.make_inputs(pool, a.heads, a.batch, max(ctx, 64))
        if ctx == 0:
            lens.zero_()
        else:
            lens.fill_(ctx)

        def fn(q=q, bt=bt, seq=seq, lens=lens):
            return gluon.paged_mla_attention_gluon(q, pool, bt, seq, lens, bm.SCALE, bm.RK, splits,
                                                   config=config)  # fmt: skip

        row: dict = {"what": "op", "batch": a.batch, "ctx": ctx, "splits": splits,
                     "block_size": a.block_size,
                     "tiles_per_program": triton.cdiv(triton.cdiv(ctx, splits), 64)}  # fmt: skip
        if ctx:
            row.update(bm.check(*fn(), bm.reference(pool, q, bt, seq, lens)))
        row["us"] = graph_replay_us(fn, rep=50)
        print(json.dumps(row), flush=True)
        lines.append(row)
    pts = [(r["tiles_per_program"], r["us"]) for r in lines if r["ctx"]]
    if len(pts) >= 2:
        n = len(pts)
        mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        fit = {"what": "fit", "us_per_tile": slope, "fixed_us": my - slope * mx}
        print(json.dumps(fit), flush=True)
        lines.append(fit)
    rows = a.batch * a.heads
    o_buf = torch.zeros(a.batch, a.heads, splits, bm.RK, device="cuda")
    l_buf = torch.zeros(a.batch, a.heads, splits, device="cuda")
    out = torch.empty(a.batch, a.heads, bm.RK, device="cuda", dtype=bm.DTYPE)
    lse = torch.empty(a.batch, a.heads, device="cuda")
    x = torch.empty(1, device="cuda")
    half = torch.zeros_like(o_buf, dtype=torch.bfloat16)
    floors = {
        "empty kernel (1 program)": lambda: _empty_kernel[(1,)](x),
        f"empty kernel ({rows // 64 * splits} programs)": lambda: _empty_kernel[
            (rows // 64 * splits,)
        ](x),
        f"zero-fill of the fp32 partials ({o_buf.numel() * 4 / 1e6:.1f} MB)": o_buf.zero_,
        f"zero-fill of the same partials in bf16 ({o_buf.numel() * 2 / 1e6:.1f} MB)": half.zero_,
        "split merge alone": lambda: merge_splits_triton(o_buf, l_buf, out, lse),
    }
    for name, f in floors.items():
        row = {"what": "floor", "name": name, "us": graph_replay_us(f, rep=50)}
        print(json.dumps(row), flush=True)
        lines.append(row)
    return lines


def layers(a, n: int) -> list[dict]:
    """The op once per layer for ``n`` layers (each its own cache) in one CUDA graph: µs a
    layer, against the benchmark's graph of one op."""
    config = gluon.GLUON_MLA_VARIANTS[a.variant] if a.variant else None
    fns, lines = [], []
    for layer in range(n):
        pool = bm.make_pool(a.block_size, a.batch * a.ctx, seed=layer)
        q, bt, seq, lens = bm.make_inputs(pool, a.heads, a.batch, a.ctx, seed=layer)

        def fn(args=(q, pool, bt, seq, lens)):
            return gluon.paged_mla_attention_gluon(*args, bm.SCALE, bm.RK, config=config)

        got = bm.check(*fn(), bm.reference(pool, q, bt, seq, lens))
        if not got["ok"]:
            lines.append({"what": "check", "layer": layer, **got})
            return lines
        fns.append(fn)
    one = graph_replay_us(fns[0], rep=50)
    step = graph_replay_us(lambda: [f() for f in fns], rep=50)
    timed = [("one op a graph (the benchmark)", one), (f"{n} layers a graph", step / n)]
    if a.no_merge:
        # The kernel alone: the split merge replaced by a no-op (after the checks above), so
        # the time is what any merge, however fast, would add to.
        real_merge = gluon.merge_splits_triton
        gluon.merge_splits_triton = lambda *args, **kw: None  # type: ignore[assignment]
        try:
            step = graph_replay_us(lambda: [f() for f in fns], rep=50)
        finally:
            gluon.merge_splits_triton = real_merge
        timed.append((f"{n} layers a graph, the split merge a no-op", step / n))
    for what, us in timed:
        row = {"what": what, "batch": a.batch, "ctx": a.ctx, "block_size": a.block_size,
               "layers": n, "us_per_layer": us,
               "tflops": bm.tflops(a.heads, a.batch, a.ctx, us / 1e3), "ok": True}  # fmt: skip
        print(json.dumps(row), flush=True)
        lines.append(row)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--variant", default="", help="a GLUON_MLA_VARIANTS name (default schedule)")
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--replay-s", type=float, default=0.0)
    ap.add_argument("--splits", type=int, default=0, help="KV splits (0: the kernel's choice)")
    ap.add_argument("--ctx-sweep", default="", help="comma-separated context lengths")
    ap.add_argument("--out", default="", help="also write the JSON lines to this file")
    ap.add_argument("--layers", type=int, default=0, help="time N layers in one graph")
    ap.add_argument(
        "--no-merge",
        action="store_true",
        help="with --layers: also time the layers with the split merge a no-op",
    )
    ap.add_argument(
        "--flush-modes",
        action="store_true",
        help="time the graph replay after each kind of L2 flush",
    )
    a = ap.parse_args()
    if a.ctx_sweep or a.layers:
        if a.ctx_sweep:
            lines = ctx_sweep(a, [int(c) for c in a.ctx_sweep.split(",")])
        else:
            lines = layers(a, a.layers)
        if a.out:
            Path(a.out).write_text("".join(json.dumps(x) + "\n" for x in lines))
        return 0 if all(x.get("ok", True) for x in lines) else 1
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
