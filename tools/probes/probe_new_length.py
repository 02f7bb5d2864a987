#!/usr/bin/env python
"""Where a new-length prefill's extra time goes, CP against HF sdpa (one H200).

``benchmarks.bench_parity``'s ``new-length prefill`` row times the first call on a prompt of a
length not seen before. This probe runs the same calls (the model warm at 16k, then lengths
16k + 64 i + 7 (i odd), each side once per length, interleaved) and records per side and call:
the wall time, the caching allocator's device allocations and frees (``num_device_alloc`` /
``num_device_free`` deltas of ``torch.cuda.memory_stats``), the reserved bytes, and, for the
last ``--profile`` lengths, a ``torch.profiler`` table of CPU and CUDA time per op.

    python tools/probes/probe_new_length.py [--model deepseek-v3] [--lengths 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks import bench_parity


def _stats() -> dict:
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--lengths", type=int, default=8)
    ap.add_argument("--profile", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/new-length-probe")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(a.out, exist_ok=True)
    dev = bench_parity.DEV
    hf, cp = bench_parity.build(a.model)
    sides = {"cp": (cp, bench_parity._cp_prefill), "hf": (hf, bench_parity._hf_prefill)}
    vocab = hf.config.vocab_size
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, vocab, (a.seq,), device=dev, generator=g)
    calls: dict[str, list[dict]] = {"cp": [], "hf": []}
    with torch.no_grad():
        for _ in range(3):
            for model, fn in sides.values():
                fn(model, ids)
        torch.cuda.synchronize()
        for i in range(1, a.lengths + 1):
            m = a.seq + 64 * i + (7 if i % 2 else 0)
            x = torch.randint(0, vocab, (m,), device=dev, generator=g)
            prof_this = i > a.lengths - a.profile
            for side, (model, fn) in sides.items():
                torch.cuda.synchronize()
                before = _stats()
                if prof_this:
                    with profile(
                        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
                    ) as p:
                        t0 = time.perf_counter()
                        fn(model, x)
                        torch.cuda.synchronize()
                        dt = time.perf_counter() - t0
                    avg = p.key_averages()
                    with open(f"{a.out}/{a.model}-len{m}-{side}.txt", "w") as f:
                        for key in ("cpu_time_total", "self_cpu_time_total", "cuda_time_total"):
                            f.write(avg.table(sort_by=key, row_limit=30) + "\n")
                        # Per input shape: which copies and concatenations each side runs.
                        by_shape = p.key_averages(group_by_input_shape=True)
                        f.write(
                            by_shape.table(
                                sort_by="self_cuda_time_total",
                                row_limit=40,
                                max_name_column_width=40,
                                max_shapes_column_width=120,
                            )
                            + "\n"
                        )
                else:
                    t0 = time.perf_counter()
                    fn(model, x)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                after = _stats()
                calls[side].append(
                    {
                        "length": m,
                        "ms": dt * 1e3,
                        "profiled": prof_this,
                        "reserved GiB": torch.cuda.memory_reserved() / 2**30,
                        **{k: after[k] - before[k] for k in before},
                    }
                )
            # The same length again (warm), as a reference for the first call's extra.
            for side, (model, fn) in sides.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(model, x)
                torch.cuda.synchronize()
                calls[side][-1]["warm ms"] = (time.perf_counter() - t0) * 1e3
    unprof = {s: [c for c in v if not c["profiled"]] for s, v in calls.items()}
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": a.model,
        "median first ms": {s: statistics.median(c["ms"] for c in v) for s, v in unprof.items()},
        "median warm ms": {
            s: statistics.median(c["warm ms"] for c in v) for s, v in unprof.items()
        },
        "calls": calls,
    }
    res["first cp / hf"] = res["median first ms"]["cp"] / res["median first ms"]["hf"]
    with open(f"{a.out}/{a.model}.json", "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "calls"}, indent=1))
    for side in calls:
        for c in calls[side]:
            print(side, c)


if __name__ == "__main__":
    main()
