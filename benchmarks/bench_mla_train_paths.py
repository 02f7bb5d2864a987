"""MLA layer training step on P GPUs (NCCL): key-major against query-major backward.

One DeepSeek-V3 MLA layer with 32 heads (a tp = 4 rank's share of its 128: hidden 7168,
q_lora 1536, kv_lora 512, nope 128, rope 64, v 128), bf16, one long sequence split over
P = the number of GPUs by PCP. Each rank runs the layer's forward and backward (projections,
all-gathers, attention, reduce-scatters), with ``CP_MLA_BACKWARD`` set to each path in turn;
``ROUNDS`` alternating rounds of CUDA-event timings, medians kept; the step time of the slowest
rank is reported. Before timing, both paths' gradients are compared with each other (the input's
and every weight's, the weights' summed over ranks, relative to the largest value).

    python benchmarks/bench_mla_train_paths.py [--seq-lens 32768 65536] [--out DIR]

Needs at least two CUDA GPUs. Writes ``mla-train-paths-<date>.json`` (under ``--out`` if given,
else benchmarks/results).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from results_file import write_results  # noqa: E402

from cp_modules.ops.cp_attention import MLA_BACKWARD_ENV  # noqa: E402
from cp_modules.testing import run_distributed  # noqa: E402

PATHS = ("query_major", "key_major")
ROUNDS, ITERS = 3, 5


def _step(layer, params, meta, xl, gyl):
    """The layer's forward and backward on this rank's rows: (d input, d every parameter)."""
    from cp_modules.modules import cp_step

    xi = xl.detach().requires_grad_()
    with cp_step(meta):
        y = layer(xi, meta.positions)
    return torch.autograd.grad(y, [xi, *params], gyl, allow_unused=True)


def _rank(rank: int, world_size: int, seq_lens: list[int]) -> dict:
    from cp_modules import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules import CPMLAAttention, CPRuntime, build_step_metadata

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", torch.cuda.current_device())
    groups = init_cp_groups(ParallelConfig(prefill_context_parallel_size=world_size))
    rt = CPRuntime.from_groups(groups)
    torch.manual_seed(0)  # the same weights on every rank
    layer = CPMLAAttention(
        7168, 32, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
    ).to(dev, torch.bfloat16)  # fmt: skip
    params = list(layer.parameters())
    res = {}
    for S in seq_lens:
        g = torch.Generator(device=dev).manual_seed(S)
        x = torch.randn(S, 7168, device=dev, dtype=torch.bfloat16, generator=g)
        gy = torch.randn(S, 7168, device=dev, dtype=torch.bfloat16, generator=g)
        meta = build_step_metadata(rt, [S], device=dev)
        xl, gyl = x[meta.token_indices], gy[meta.token_indices]
        step = functools.partial(_step, layer, params, meta, xl, gyl)

        grads = {}
        for path in PATHS:
            os.environ[MLA_BACKWARD_ENV] = path
            grads[path] = step()  # also the warm-up (cuDNN plans)
            # A rank's weight gradients are partial sums (query-major: its queries' share;
            # key-major: its keys'); data-parallel training all-reduces them, so compare sums.
            for t in grads[path][1:]:
                if t is not None:
                    dist.all_reduce(t)
        diff = max(
            ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
            for a, b in zip(*grads.values())
            if a is not None and b is not None
        )
        del grads
        times = {p: [] for p in PATHS}
        for rnd in range(ROUNDS):
            for path in PATHS if rnd % 2 == 0 else PATHS[::-1]:
                os.environ[MLA_BACKWARD_ENV] = path
                step()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                for _ in range(ITERS):
                    step()
                end.record()
                torch.cuda.synchronize()
                times[path].append(start.elapsed_time(end) / ITERS)
        torch.cuda.reset_peak_memory_stats()
        peaks = {}
        for path in PATHS:
            os.environ[MLA_BACKWARD_ENV] = path
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peaks[path] = (torch.cuda.max_memory_allocated() - base) / 2**20
        res[S] = {
            "ms": {p: sorted(t)[len(t) // 2] for p, t in times.items()},
            "peak_mib": peaks,
            "grad_rel_diff": diff,
        }
        del x, gy, xl, gyl, step
        torch.cuda.empty_cache()
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[32768, 65536])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    n = torch.cuda.device_count()
    if n < 2:
        print("needs at least two CUDA GPUs", file=sys.stderr)
        return 2
    per_rank = run_distributed(_rank, n, args.seq_lens, backend="nccl", timeout_s=1200)
    metrics = {}
    for S in args.seq_lens:
        ms = {p: max(r[S]["ms"][p] for r in per_rank) for p in PATHS}
        metrics[f"S={S} P={n}"] = {
            "step_ms_slowest_rank": ms,
            "key_major_speedup": ms["query_major"] / ms["key_major"],
            "peak_mib_worst_rank": {p: max(r[S]["peak_mib"][p] for r in per_rank) for p in PATHS},
            "grad_rel_diff": max(r[S]["grad_rel_diff"] for r in per_rank),
            "per_rank_ms": [r[S]["ms"] for r in per_rank],
        }
        m = metrics[f"S={S} P={n}"]
        print(
            f"S={S} P={n}: layer fwd+bwd query-major {ms['query_major']:.2f} ms, key-major "
            f"{ms['key_major']:.2f} ms ({m['key_major_speedup']:.3f}x); peak MiB "
            f"{m['peak_mib_worst_rank']}; gradients differ by {m['grad_rel_diff']:.1e}",
            flush=True,
        )
    path = write_results("mla-train-paths", metrics, args.out, layer="deepseek_v3_mla_32heads")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
