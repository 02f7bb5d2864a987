#!/usr/bin/env python
"""The GPU kernels of one engine decode step, with their times.

Run from the repository root on a CUDA machine:
``python tools/probes/probe_engine_decode_kernels.py [--out D]``. Builds bench_parity's Llama-3-8B
shape (4 layers, bf16, random weights), warms the engine up on 16 prompts of 2048 tokens, then
profiles ``generate`` with 130 and with 2 new tokens; the difference over 128 steps is one
decode step (prefill and the first steps cancel). Writes ``D/decode_kernels.txt``: time and
launches per step of every kernel, most time first.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_parity  # noqa: E402
from cp_modules.engine import GenerationEngine, SamplingParams  # noqa: E402


def kernels(engine, prompts, new: int) -> dict[str, list[float]]:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name][0] += e.time_range.elapsed_us()
            total[e.name][1] += 1
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    _, cp = bench_parity.build("llama3-8b", layers=4, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128000, (2048,), generator=g).tolist() for _ in range(16)]
    engine = GenerationEngine(
        cp, block_size=64, max_num_tokens=16 * 2048, max_num_seqs=16, progress=False
    )
    long, short, steps = kernels(engine, prompts, 130), kernels(engine, prompts, 2), 128
    rows = []
    for name, (t, n) in long.items():
        dt = (t - short.get(name, [0.0, 0])[0]) / steps
        dn = (n - short.get(name, [0.0, 0])[1]) / steps
        if dn > 0.5 or dt > 1:
            rows.append((dt, dn, name))
    rows.sort(reverse=True)
    lines = [
        f"per decode step: {sum(r[0] for r in rows):.1f} us in {sum(r[1] for r in rows):.1f} kernels"
    ]
    lines += [f"{dt:9.1f} us {dn:6.2f}x  {name[:160]}" for dt, dn, name in rows]
    Path(a.out, "decode_kernels.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
