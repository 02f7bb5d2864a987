#!/usr/bin/env python
"""One-GPU prefill (``bench_parity``'s warm 16k row) with and without the kept one-rank plans.

Times CP's prefill of one model with ``plan_pcp``'s kept plans and with a fresh plan every
call (interleaved, medians), beside HF sdpa, and writes a ``torch.profiler`` table of both CP
variants' CUDA kernels.

    python tools/probes/probe_prefill_plan.py [--model llama3-8b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks import bench_parity
from cp_modules.partition import plan as plan_mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    kept = plan_mod._plan_one_rank_cached

    def fresh(n, computed, is_decode, device):
        return plan_mod._plan_one_rank(n, computed, is_decode, device)

    hf, cp = bench_parity.build(a.model)
    ids = torch.randint(0, hf.config.vocab_size, (16384,), device=bench_parity.DEV)
    variants = {"kept": kept, "fresh": fresh}

    def run(v):
        plan_mod._plan_one_rank_cached = variants[v]
        return bench_parity._cp_prefill(cp, ids)

    times: dict = {"kept": [], "fresh": [], "hf": []}
    with torch.no_grad():
        for _ in range(2):
            run("kept"), run("fresh"), bench_parity._hf_prefill(hf, ids)
        for _ in range(a.reps):
            for side in times:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run(side) if side != "hf" else bench_parity._hf_prefill(hf, ids)
                torch.cuda.synchronize()
                times[side].append((time.perf_counter() - t0) * 1e3)
        for v in ("kept", "fresh"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                run(v)
                torch.cuda.synchronize()
            with open(f"{a.out}/prefill-plan-{a.model}-{v}.txt", "w") as f:
                f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    plan_mod._plan_one_rank_cached = kept
    res = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"model": a.model, "median ms": res}, indent=1))


if __name__ == "__main__":
    main()
