#!/usr/bin/env python
"""DCP decode communication on several GPUs (NCCL): query preparation + combine per layer.

    python benchmarks/bench_dcp_comm.py [--world-size N]     # N GPUs of one host (default: all)

For each layout of the world size with dcp > 1 and each combine (ag_rs, a2a, packed a2a):
Llama-3-8B decode shapes (32 q heads, D = 128) and DeepSeek-V3 absorbed MLA (128 heads, q 576,
out 512), bf16, B in {1, 8, 64, 256} decode tokens. Before timing, every combine's output is
checked against the exact LSE-weighted merge of all ranks' partials (gathered separately),
within 2 bf16 ulps of the largest output.
Times: eager (CUDA events around 50 iterations) and CUDA-graph replay of the same step.
Writes benchmarks/results/dcp_comm-<date>.json with the machine kind in "gpu".
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

SHAPES = {"llama3_8b": (32, 128, 128), "deepseek_v3": (128, 576, 512)}
BATCHES = (1, 8, 64, 256)


def _time(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters * 1e3  # us


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from cp_modules.config import ParallelConfig, valid_dcp_sizes
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.ops.dcp_comm import DCPCommSpec, dcp_combine, dcp_prepare_query
    from cp_modules.reference.lse_combine import lse_combine_reference

    dev = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for pcp in (1, 2, 4, 8):
        if world % pcp:
            continue
        tp = world // pcp
        for dcp in valid_dcp_sizes(tp, pcp):
            if dcp == 1:
                continue
            for backend, packed in (("ag_rs", False), ("a2a", False), ("a2a", True)):
                cfg = ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                                     decode_context_parallel_size=dcp, dcp_comm_backend=backend)
                groups = init_cp_groups(cfg)
                spec = DCPCommSpec.from_groups(groups, packed=packed)
                name = f"tp{tp}_pcp{pcp}_dcp{dcp}_{backend}{'_packed' if packed else ''}"
                for model, (h, dq, dv) in SHAPES.items():
                    hl = h // tp
                    for b in BATCHES:
                        g = torch.Generator(device=dev).manual_seed(1000 * rank + b)
                        q = torch.randn(b, hl, dq, device=dev, dtype=torch.bfloat16, generator=g)
                        hg = hl * spec.gather_size
                        out = torch.randn(b, hg, dv, device=dev, dtype=torch.bfloat16, generator=g)
                        lse = torch.randn(b, hg, device=dev, dtype=torch.float32, generator=g)
                        # Exactness: merge all DCP ranks' partials directly and compare.
                        got = dcp_combine(out, lse, spec)
                        all_out = [torch.empty_like(out) for _ in range(dcp)]
                        all_lse = [torch.empty_like(lse) for _ in range(dcp)]
                        dist.all_gather(all_out, out, group=groups.dcp)
                        dist.all_gather(all_lse, lse, group=groups.dcp)
                        ref, _ = lse_combine_reference(torch.stack(all_out).float(), torch.stack(all_lse))
                        own = slice(spec.gather_rank * hl, (spec.gather_rank + 1) * hl)
                        err = (got.float() - ref[:, own]).abs().max().item()
                        # bf16 outputs: within 2 bf16 ulps of the largest output (ag_rs rounds
                        # the corrected partials and their sum; a2a rounds once).
                        bound = 2 * 2.0**-7 * ref[:, own].abs().max().item()

                        def step(q=q, out=out, lse=lse, spec=spec):
                            dcp_prepare_query(q, spec)
                            return dcp_combine(out, lse, spec)

                        eager = _time(step)
                        s = torch.cuda.Stream()
                        s.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(s):
                            step()
                        torch.cuda.current_stream().wait_stream(s)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            step()
                        graphed = _time(graph.replay)
                        results[f"{name}_{model}_B{b}"] = dict(
                            eager_us=eager, graph_us=graphed, max_err=err, err_bound=bound
                        )
    return results


def main() -> int:
    from cp_modules.testing.distributed import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    a = ap.parse_args()
    if a.world_size < 2 or torch.cuda.device_count() < a.world_size:
        print(f"needs >= 2 GPUs (have {torch.cuda.device_count()})", file=sys.stderr)
        return 2
    per_rank = run_distributed(_rank, a.world_size, backend="nccl", timeout_s=900)
    merged = {}
    for key in per_rank[0]:
        merged[key] = dict(
            eager_us=max(r[key]["eager_us"] for r in per_rank),
            graph_us=max(r[key]["graph_us"] for r in per_rank),
            max_err=max(r[key]["max_err"] for r in per_rank),
            err_bound=min(r[key]["err_bound"] for r in per_rank),
        )
    bad = {k: v["max_err"] for k, v in merged.items() if v["max_err"] > v["err_bound"]}
    for k, v in merged.items():
        print(f"{k:<48} eager {v['eager_us']:8.1f} us  graph {v['graph_us']:8.1f} us  err {v['max_err']:.1e}")
    out = {"date": datetime.date.today().isoformat(),
           "gpu": f"{a.world_size}x {torch.cuda.get_device_name()}",
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "metrics": merged, "wrong": bad}
    path = REPO / "benchmarks" / "results" / f"dcp_comm-{out['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}; {'all exact' if not bad else f'WRONG: {bad}'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
