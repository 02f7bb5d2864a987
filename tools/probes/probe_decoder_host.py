#!/usr/bin/env python
"""Where the decoder-parity step's wall time goes beyond its kernels (one H200).

For one model and length of ``benchmarks.bench_decoder_parity``: per side, the wall time of a
step (synchronised before and after, as the benchmark times it), the GPU time between a CUDA
event recorded at the step's start and one at its end, the host time of CP's batch sharding
alone, and every host-device synchronisation CP's step makes (``torch.cuda.set_sync_debug_mode``).
Steps interleaved CP / HF, medians of ``--reps``.

    python tools/probes/probe_decoder_host.py [--model llama3-8b] [--seq 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings

import torch

from benchmarks import bench_parity


def _host_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _shard_parts(ctx, ids: torch.Tensor, reps: int) -> dict:
    """Host ms of shard_batch's parts and of the ways to stage a small host array."""
    import numpy as np

    from cp_modules.partition.plan import _to_device
    from cp_modules.pinned import pinned_copy
    from cp_modules.step import build_step_metadata

    dev = ids.device
    small = torch.arange(8, dtype=torch.int64)
    arrays = {"a": np.arange(4, dtype=np.int64), "b": np.ones(3, dtype=bool)}
    n = [int(ids.numel())]
    parts = {
        "build_step_metadata": lambda: build_step_metadata(ctx.runtime, n, device=dev),
        "plan _to_device (2 arrays)": lambda: _to_device(arrays, dev),
        "pin_memory() + copy": lambda: small.pin_memory().to(dev, non_blocking=True),
        "pinned_copy + copy": lambda: pinned_copy(small).to(dev, non_blocking=True),
        "pageable copy": lambda: small.to(dev),
        "torch.arange on device": lambda: torch.arange(n[0], device=dev),
        "one elementwise launch": lambda: ids.ne(0),
    }
    return {f"host ms {k}": _host_ms(fn, reps) for k, fn in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from cp_modules.step import cp_step
    from cp_modules.training import CPTrainingContext

    dev = bench_parity.DEV
    hf, cp = bench_parity.build(a.model)
    hf.train(), cp.train()
    ctx = CPTrainingContext.single(dev)
    ids = torch.randint(0, hf.config.vocab_size, (1, a.seq), device=dev)

    def cp_fn():
        cb = ctx.shard_batch({"input_ids": ids})
        with cp_step(cb.meta):
            h = cp.model(
                input_ids=cb.input_ids[None], position_ids=cb.positions[None], use_cache=False
            ).last_hidden_state
        h.float().square().mean().backward()

    def hf_fn():
        h = hf.model(input_ids=ids, use_cache=False).last_hidden_state
        h.float().square().mean().backward()

    for _ in range(5):
        cp_fn(), hf_fn()
    torch.cuda.synchronize()
    syncs: list[str] = []
    stacks: list[str] = []

    def _keep(message, category, filename, lineno, file=None, line=None):
        # Where each synchronising call came from: the Python frames of this project and HF.
        frames = [f for f in traceback.format_stack()[:-1] if "/torch/" not in f]
        stacks.append(str(message).splitlines()[0][:160] + "\n" + "".join(frames[-6:]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _keep
        torch.cuda.set_sync_debug_mode(1)
        cp_fn()
        torch.cuda.set_sync_debug_mode(0)
    syncs = stacks
    torch.cuda.synchronize()
    res: dict = {
        "model": a.model,
        "seq": a.seq,
        "cp step syncs": len(syncs),
        "sync messages": syncs[:20],
    }
    shard = []
    for _ in range(a.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ctx.shard_batch({"input_ids": ids})
        shard.append(time.perf_counter() - t0)
    res["cp shard_batch host ms"] = statistics.median(shard) * 1e3
    res.update(_shard_parts(ctx, ids, a.reps))
    if a.out:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                ctx.shard_batch({"input_ids": ids})
            torch.cuda.synchronize()
        with open(f"{a.out}/shard-batch-profile-{a.model}-{a.seq}.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    wall: dict = {"cp": [], "hf": []}
    gpu: dict = {"cp": [], "hf": []}
    for _ in range(a.reps):
        for side, fn in (("cp", cp_fn), ("hf", hf_fn)):
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            wall[side].append((time.perf_counter() - t0) * 1e3)
            gpu[side].append(e0.elapsed_time(e1))
    for side in ("cp", "hf"):
        res[f"{side} wall ms"] = statistics.median(wall[side])
        res[f"{side} event ms"] = statistics.median(gpu[side])
    res["wall cp / hf"] = res["cp wall ms"] / res["hf wall ms"]
    res["event cp / hf"] = res["cp event ms"] / res["hf event ms"]
    print(json.dumps(res, indent=1))
    if a.out:
        with open(f"{a.out}/decoder-host-{a.model}-{a.seq}.json", "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
