#!/usr/bin/env python
"""One-GPU decoder training parity: a swapped HF model's decoder against HF's ``sdpa``.

Run from the repository root on a CUDA machine:

    python -m benchmarks.bench_decoder_parity [--seqs 8192,32768] [--models ...]
        [--prefill] [--profile DIR] [--out DIR]

The whole-model training rows of ``bench_parity`` time the causal LM with its 128k-vocabulary
head and loss, whose cost hides the attention layers. These rows time the decoder alone: the
models of ``bench_parity.MODELS`` (Llama-3-8B, Qwen2.5-7B, DeepSeek-V3: 2 decoder layers of
the real dimensions, random weights, bf16), one sequence of ``seq`` tokens, loss = the mean of
the squared final hidden states in fp32, forward + backward; 8 warm-up and 10 timed steps per
side, the two sides' steps interleaved, medians. CP: ``swap_attention`` at world size 1, each
step sharded as a training loop does (``CPTrainingContext.single().shard_batch``: a new plan
every step); HF: the same model with ``attn_implementation="sdpa"``. Before any timing both
sides' losses and gradients are compared (no speed is reported for a side that disagrees).

Rows (CP time / HF time; below 1 CP is faster):
  ``one-GPU parity decoder training <model> seq=<n> (CP / HF sdpa)``
With ``--prefill`` also ``bench_parity``'s prefill and new-length prefill rows (the first call
on a length not seen before). ``--profile DIR``: a ``torch.profiler`` table of the CUDA kernels
of 3 steps per side (``DIR/decoder-<model>-<n>-{cp,hf}.txt``).
Results: ``--out`` (benchmarks/results)/decoder-parity-<date>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback

import torch

from benchmarks import bench_parity
from benchmarks.common import RESULTS, write_results

WARMUP, TIMED = 8, 10


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])


def decoder_rows(name: str, seqs: list[int], metrics: dict, profile: str | None) -> None:
    from cp_modules.training import CPTrainingContext

    dev = bench_parity.DEV
    hf, cp = bench_parity.build(name)
    hf.train(), cp.train()
    ctx = CPTrainingContext.single(dev)
    for n in seqs:
        _decoder_row(name, hf, cp, ctx, 128 if dev.type == "cpu" else n, metrics, profile)
    hf.zero_grad(set_to_none=True), cp.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()


def _decoder_row(name, hf, cp, ctx, n: int, metrics: dict, profile: str | None) -> None:
    from cp_modules.step import cp_step

    dev = bench_parity.DEV
    g = torch.Generator(device=dev).manual_seed(n)
    ids = torch.randint(0, hf.config.vocab_size, (1, n), device=dev, generator=g)

    def cp_fn():
        cb = ctx.shard_batch({"input_ids": ids})
        with cp_step(cb.meta):
            h = cp.model(
                input_ids=cb.input_ids[None], position_ids=cb.positions[None], use_cache=False
            ).last_hidden_state
        loss = h.float().square().mean()
        loss.backward()
        return loss

    def hf_fn():
        h = hf.model(input_ids=ids, use_cache=False).last_hidden_state
        loss = h.float().square().mean()
        loss.backward()
        return loss

    row = f"decoder training {name} seq={n}"
    for m in (hf, cp):
        m.zero_grad(set_to_none=True)
    l_cp, l_hf = float(cp_fn().detach()), float(hf_fn().detach())
    err = abs(l_cp - l_hf) / abs(l_hf)
    gerr = bench_parity._agree(_grads(cp), _grads(hf))
    metrics[f"parity {row} loss rel err"] = err
    metrics[f"parity {row} grad rel err"] = gerr
    if err > 1e-2 or gerr > 5e-2:
        raise RuntimeError(f"{row}: CP differs from HF: loss {err:.3g}, grad {gerr:.3g}")
    for m in (hf, cp):
        m.zero_grad(set_to_none=True)  # gradients accumulate from here on (as in a step)
    for _ in range(WARMUP):
        cp_fn(), hf_fn()
    t_cp, t_hf = bench_parity._time_pair(cp_fn, hf_fn, TIMED)
    metrics[f"one-GPU parity {row} (CP / HF sdpa)"] = t_cp / t_hf
    metrics[f"parity {row} ms CP"] = t_cp * 1e3
    metrics[f"parity {row} ms HF"] = t_hf * 1e3
    print(f"{row}: CP {t_cp * 1e3:.2f} ms, HF {t_hf * 1e3:.2f} ms, {t_cp / t_hf:.4f}", flush=True)
    if profile:
        _profile_steps(f"{profile}/decoder-{name}-{n}", {"cp": cp_fn, "hf": hf_fn}, metrics)
    for m in (hf, cp):
        m.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()


def _profile_steps(prefix: str, fns: dict, metrics: dict, steps: int = 3) -> None:
    """The CUDA kernels of ``steps`` steps per side, sorted by CUDA time (per-step times in
    the table are its totals / ``steps``); the top kernels' names also go into ``metrics``."""
    from torch.profiler import ProfilerActivity, profile

    for side, fn in fns.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            bench_parity._sync()
        kernels: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels.setdefault(e.name, [0.0, 0])
                k[0] += e.device_time / 1e3 / steps  # ms a step
                k[1] += 1
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])
        total = sum(v[0] for v in kernels.values())
        with open(f"{prefix}-{side}.txt", "w") as f:
            f.write(f"CUDA kernel time a step: {total:.3f} ms over {steps} steps\n")
            f.write(f"{'ms/step':>9} {'calls/step':>10}  kernel\n")
            for kname, (ms, calls) in top[:40]:
                f.write(f"{ms:9.3f} {calls / steps:10.1f}  {kname[:160]}\n")
            f.write("\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
        metrics[f"profile {prefix.rsplit('/', 1)[-1]} {side} top kernels"] = [
            (kname[:100], round(ms, 3), calls / steps) for kname, (ms, calls) in top[:8]
        ]
        metrics[f"profile {prefix.rsplit('/', 1)[-1]} {side} CUDA ms a step"] = total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(bench_parity.MODELS))
    ap.add_argument("--seqs", default="8192,32768")
    ap.add_argument("--prefill", action="store_true", help="also bench_parity's prefill rows")
    ap.add_argument("--profile", default=None, help="folder for profiler tables")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (no timing value)")
    a = ap.parse_args()
    if a.smoke:
        bench_parity.DEV, bench_parity.DT = torch.device("cpu"), torch.float32
    metrics: dict = {}
    failed = []
    seqs = [int(s) for s in a.seqs.split(",")]
    t0 = time.time()
    jobs = [("decoder", name) for name in a.models.split(",")]
    if a.prefill:
        jobs += [("prefill", name) for name in a.models.split(",")]
    for kind, name in jobs:
        try:
            if kind == "decoder":
                decoder_rows(name, seqs, metrics, a.profile)
            else:
                bench_parity.prefill_rows(name, a.smoke, metrics, a.profile)
        except Exception:
            traceback.print_exc()
            failed.append(f"{kind} {name}")
        gc.collect()
        torch.cuda.empty_cache()
        print(f"done {kind} {name} at {time.time() - t0:.0f} s", flush=True)
        # Partial results survive a run that is cut short.
        write_results("decoder-parity", metrics, a.out, failed=failed)
    for k, v in metrics.items():
        if isinstance(v, float):
            print(f"{k}: {v:.4g}")
    path = write_results("decoder-parity", metrics, a.out, failed=failed)
    print(f"wrote {path}")
    if failed:
        print(f"failed: {json.dumps(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
