#!/usr/bin/env python
"""One attention layer end to end: eager vs compiled, prefill and decode, CUDA graphs.

Run from the repository root on a CUDA machine (no Hydra needed):

    python -m benchmarks.bench_modules [--quick]      # the suite's part, one GPU
    python -m benchmarks.bench_modules --many-only    # many prompts, three paths
    python -m benchmarks.bench_modules --train-paths  # MLA training step on all GPUs (>= 2)

Shapes: Llama-3-8B attention (hidden 4096, 32 q heads, 8 KV heads, D=128) as CPFlashAttention
and DeepSeek-V3 MLA (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128, rope 64,
v 128) as CPMLAAttention, bf16, one rank (tp = pcp = dcp = 1: what one rank of a larger layout
runs per layer, minus its collectives):
  - prefill of one 32k-token prompt (the PCP path with P = 1), eager and compiled;
  - decode of B = 64 requests with 32k cached tokens each (paged cache, block size 64), eager,
    compiled, and the compiled step replayed as a CUDA graph;
  - prefill of 64 prompts of 512 tokens, eager, with the PCP attention on its block path
    (``CPPolicy(pcp_varlen="never")``), on one varlen call (``"always"``) and as chosen
    automatically (``"auto"``, for a plan whose shapes an earlier plan had), outputs compared
    (``--many-only``: this alone over 64 x 512 ... 2 x 16384, also for the MLA layer with 32
    heads (a tp = 4 rank's share), written to modules-many-<date>.json).
Before timing, each layer's prefill output is checked against the same projections run through
dense causal SDPA on a 2k prompt (the 2x tolerance rule against a bf16 reference); the decode
kernels are checked by bench_decode, and here the CUDA-graph replay is compared with the eager
step. Peak memory of the eager prefill is reported.
Results: ``--out`` (benchmarks/results)/modules-<date>.json ({"date","gpu","torch","triton",
"metrics"}; modules-many-<date>.json with --many-only; ``--train-paths``: see
:func:`train_paths`, mla-train-paths-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from benchmarks.common import RESULTS, write_results
from cp_modules.cache.paged import allocate_kv_cache, allocate_mla_cache
from cp_modules.modules import (
    CPFlashAttention,
    CPMLAAttention,
    CPRuntime,
    build_step_metadata,
    cp_step,
)
from cp_modules.modules.rope import apply_rotary
from cp_modules.policy import CPPolicy

RT = CPRuntime.single()
DEV = torch.device("cuda")
DT = torch.bfloat16


def llama_layer():
    return CPFlashAttention(4096, 32, 8, 128, rope_theta=500000.0).to(DEV, DT)


def mla_layer(heads=128):
    return CPMLAAttention(
        7168,
        heads,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ).to(DEV, DT)


def mla_layer_tp4():
    # A tensor-parallel rank's share of the DeepSeek-V3 layer at tp = 4: 32 of its 128 heads.
    return mla_layer(32)


def dense_reference(layer, x, dtype):
    """The layer's own projections with dense causal SDPA, computed in ``dtype``: [S, hidden]."""
    layer = layer.to(dtype)
    x = x.to(dtype)
    s = x.shape[0]
    cos, sin = layer.rotary(torch.arange(s, device=DEV))
    if isinstance(layer, CPFlashAttention):
        q = apply_rotary(layer.q_proj(x).view(s, -1, 128), cos, sin)
        k = apply_rotary(layer.k_proj(x).view(s, -1, 128), cos, sin)
        v = layer.v_proj(x).view(s, -1, 128)
    else:
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(s, -1, 192)
        kv_c, k_pe = layer.kv_a_proj_with_mqa(x).split([512, 64], -1)
        q_nope, q_pe = q.split([128, 64], -1)
        q = torch.cat((q_nope, apply_rotary(q_pe, cos, sin)), -1)
        k_pe = apply_rotary(k_pe.unsqueeze(1), cos, sin)
        kvb = layer.kv_b_proj(layer.kv_a_layernorm(kv_c)).view(s, -1, 256)
        k = torch.cat((kvb[..., :128], k_pe.expand(-1, 128, -1)), -1)
        v = kvb[..., 128:]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        enable_gqa=True,
        scale=layer.scaling,
    )
    out = layer.o_proj(o.transpose(0, 1).reshape(s, -1)).float()
    layer.to(DT)
    return out


def run_prefill(layer, x):
    meta = build_step_metadata(RT, [x.shape[0]], device=DEV)
    with cp_step(meta):
        return layer(x[meta.token_indices], meta.positions)[: x.shape[0]]


def check_prefill(name, layer, metrics):
    torch.manual_seed(0)
    x = torch.randn(2048, layer.hidden_size, device=DEV, dtype=DT)
    with torch.no_grad():
        out = run_prefill(layer, x).float()
        ref = dense_reference(layer, x, torch.float32)
        ref_bf16 = dense_reference(layer, x, DT)
    err = (out - ref).abs().max().item()
    base = (ref_bf16 - ref).abs().max().item()
    metrics[f"{name}_prefill_check_err"] = err
    metrics[f"{name}_prefill_check_bf16_ref_err"] = base
    if not err <= 2 * base + 1e-3:
        raise SystemExit(f"{name}: prefill output wrong: err {err:.3e} > 2 x {base:.3e}")


def seen_shapes(layer, lengths):
    """Run ``layer`` once on a plan of these prompt lengths, so that the measured plan (built
    next) is one whose shapes an earlier plan had: the automatic PCP path then takes the
    cuDNN blocks for large segments, as in a run whose batches repeat (a first plan of new
    shapes runs as varlen calls, sparing cuDNN's per-shape plan builds)."""
    meta = build_step_metadata(RT, lengths, device=DEV)
    x = torch.randn(meta.num_local_tokens, layer.hidden_size, device=DEV, dtype=DT)
    with torch.no_grad(), cp_step(meta):
        layer(x, meta.positions)


def bench_prefill(name, layer, seq, metrics):
    x = torch.randn(seq, layer.hidden_size, device=DEV, dtype=DT)
    seen_shapes(layer, [seq])
    meta = build_step_metadata(RT, [seq], device=DEV)
    xl = x[meta.token_indices]
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad(), cp_step(meta):
        torch.cuda.reset_peak_memory_stats()
        t_eager = do_bench(lambda: layer(xl, meta.positions), warmup=3, rep=20)
        metrics[f"{name}_prefill{seq // 1024}k_peak_GiB"] = (
            torch.cuda.max_memory_allocated() / 2**30
        )
        compiled(xl, meta.positions)
        t_comp = do_bench(lambda: compiled(xl, meta.positions), warmup=3, rep=20)
    metrics[f"{name}_prefill{seq // 1024}k_eager_ms"] = t_eager
    metrics[f"{name}_prefill{seq // 1024}k_compiled_ms"] = t_comp


MANY_SHAPES = ((64, 512), (32, 1024), (16, 2048), (8, 4096), (4, 8192), (2, 16384))


def bench_prefill_many(name, layer, batch, length, metrics):
    """Prefill of ``batch`` prompts of ``length`` tokens, eager, with the PCP attention on its
    block path (``pcp_varlen="never"``), on the varlen call (``"always"``) and as chosen
    (``"auto"``); the block and varlen outputs are compared first."""
    x = torch.randn(batch * length, layer.hidden_size, device=DEV, dtype=DT)
    seen_shapes(layer, [length] * batch)
    times, outs = {}, {}
    with torch.no_grad():
        for path in ("never", "always", "auto"):
            rt = CPRuntime.single(policy=CPPolicy(pcp_varlen=path))
            meta = build_step_metadata(rt, [length] * batch, device=DEV)
            xl = x[meta.token_indices]
            with cp_step(meta):
                outs[path] = layer(xl, meta.positions).float()
                times[path] = do_bench(
                    lambda xl=xl, meta=meta: layer(xl, meta.positions), warmup=3, rep=20
                )
    diff = (outs["always"] - outs["never"]).abs().max().item()
    scale = outs["never"].abs().max().item()
    key = f"{name}_prefill_{batch}x{length}"
    metrics[f"{key}_blocks_eager_ms"] = times["never"]
    metrics[f"{key}_varlen_eager_ms"] = times["always"]
    metrics[f"{key}_auto_eager_ms"] = times["auto"]
    metrics[f"{key}_paths_rel_maxdiff"] = diff / scale
    if not diff <= 2e-2 * scale:
        raise SystemExit(
            f"{name}: block and varlen prefill outputs differ: {diff:.3e} (max {scale:.3e})"
        )


def bench_decode(name, layer, batch, ctx, metrics, block_size=64):
    blocks_per = -(-(ctx + 1) // block_size)
    nb = batch * blocks_per + 1
    if isinstance(layer, CPFlashAttention):
        kc, vc = allocate_kv_cache(nb, block_size, 8, 128, dtype=DT, device=DEV)
        kc.normal_()
        vc.normal_()
        layer.kv_cache = (kc, vc)
    else:
        c = allocate_mla_cache(nb, block_size, 512, 64, dtype=DT, device=DEV)
        c.normal_()
        layer.kv_cache = c
    bt = (torch.arange(batch * blocks_per, dtype=torch.int32, device=DEV) + 1).view(
        batch, blocks_per
    )
    meta = build_step_metadata(
        RT, [1] * batch, [ctx] * batch, block_table=bt, block_size=block_size, device=DEV
    )
    x = torch.randn(meta.num_local_tokens, layer.hidden_size, device=DEV, dtype=DT)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad(), cp_step(meta):
        t_eager = do_bench(lambda: layer(x, meta.positions), warmup=3, rep=30)
        compiled(x, meta.positions)
        t_comp = do_bench(lambda: compiled(x, meta.positions), warmup=3, rep=30)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                compiled(x, meta.positions)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_graph = compiled(x, meta.positions)
        g.replay()
        y_eager = layer(x, meta.positions)
        torch.cuda.synchronize()
        err = (y_graph.float() - y_eager.float()).abs().max().item()
        t_graph = do_bench(g.replay, warmup=3, rep=30)
    metrics[f"{name}_decode_B{batch}_ctx{ctx // 1024}k_eager_ms"] = t_eager
    metrics[f"{name}_decode_B{batch}_ctx{ctx // 1024}k_compiled_ms"] = t_comp
    metrics[f"{name}_decode_B{batch}_ctx{ctx // 1024}k_cudagraph_ms"] = t_graph
    metrics[f"{name}_decode_B{batch}_ctx{ctx // 1024}k_graph_vs_eager_maxdiff"] = err
    layer.kv_cache = None
    del g
    torch.cuda.empty_cache()


# --train-paths: the MLA layer's training step on several GPUs, key-major against query-major.
TRAIN_PATHS = ("query_major", "key_major")
TRAIN_ROUNDS, TRAIN_ITERS = 3, 5


def _train_step(layer, params, meta, xl, gyl):
    """The layer's forward and backward on this rank's rows: (d input, d every parameter)."""
    xi = xl.detach().requires_grad_()
    with cp_step(meta):
        y = layer(xi, meta.positions)
    return torch.autograd.grad(y, [xi, *params], gyl, allow_unused=True)


def _train_rank(rank: int, world_size: int, seq_lens: list[int]) -> dict:
    import torch.distributed as dist

    from cp_modules import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", torch.cuda.current_device())
    groups = init_cp_groups(ParallelConfig(prefill_context_parallel_size=world_size))
    runtimes = {
        p: CPRuntime.from_groups(groups, policy=CPPolicy(mla_backward=p)) for p in TRAIN_PATHS
    }
    torch.manual_seed(0)  # the same weights on every rank
    layer = mla_layer_tp4().to(dev)
    params = list(layer.parameters())
    res = {}
    for S in seq_lens:
        g = torch.Generator(device=dev).manual_seed(S)
        x = torch.randn(S, 7168, device=dev, dtype=DT, generator=g)
        gy = torch.randn(S, 7168, device=dev, dtype=DT, generator=g)
        steps = {}
        for path, rt in runtimes.items():
            meta = build_step_metadata(rt, [S], device=dev)
            xl, gyl = x[meta.token_indices], gy[meta.token_indices]
            steps[path] = functools.partial(_train_step, layer, params, meta, xl, gyl)

        grads = {}
        for path in TRAIN_PATHS:
            grads[path] = steps[path]()  # also the warm-up (cuDNN plans)
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
        times: dict[str, list[float]] = {p: [] for p in TRAIN_PATHS}
        for rnd in range(TRAIN_ROUNDS):
            for path in TRAIN_PATHS if rnd % 2 == 0 else TRAIN_PATHS[::-1]:
                steps[path]()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                for _ in range(TRAIN_ITERS):
                    steps[path]()
                end.record()
                torch.cuda.synchronize()
                times[path].append(start.elapsed_time(end) / TRAIN_ITERS)
        torch.cuda.reset_peak_memory_stats()
        peaks = {}
        for path in TRAIN_PATHS:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            steps[path]()
            torch.cuda.synchronize()
            peaks[path] = (torch.cuda.max_memory_allocated() - base) / 2**20
        res[S] = {
            "ms": {p: sorted(t)[len(t) // 2] for p, t in times.items()},
            "peak_mib": peaks,
            "grad_rel_diff": diff,
        }
        del x, gy, steps
        torch.cuda.empty_cache()
    return res


def train_paths(seq_lens: list[int], out: str) -> int:
    """MLA layer training step on all GPUs (NCCL): key-major against query-major backward.

    One DeepSeek-V3 MLA layer with 32 heads (a tp = 4 rank's share), bf16, one sequence split
    over P = the number of GPUs by PCP; each rank runs forward and backward (projections,
    all-gathers, attention, reduce-scatters) with ``CPPolicy(mla_backward=...)`` set to each
    path in turn; ``TRAIN_ROUNDS`` alternating rounds of CUDA-event timings, medians kept, the
    slowest rank reported. Both paths' gradients are compared first (the input's and every
    weight's, the weights' summed over ranks, relative to the largest value). Writes
    ``mla-train-paths-<date>.json``.
    """
    from cp_modules.testing import run_distributed

    n = torch.cuda.device_count()
    if n < 2:
        print("--train-paths needs at least two CUDA GPUs", file=sys.stderr)
        return 2
    per_rank = run_distributed(_train_rank, n, seq_lens, backend="nccl", timeout_s=1200)
    metrics = {}
    for S in seq_lens:
        ms = {p: max(r[S]["ms"][p] for r in per_rank) for p in TRAIN_PATHS}
        m = metrics[f"S={S} P={n}"] = {
            "step_ms_slowest_rank": ms,
            "key_major_speedup": ms["query_major"] / ms["key_major"],
            "peak_mib_worst_rank": {
                p: max(r[S]["peak_mib"][p] for r in per_rank) for p in TRAIN_PATHS
            },
            "grad_rel_diff": max(r[S]["grad_rel_diff"] for r in per_rank),
            "per_rank_ms": [r[S]["ms"] for r in per_rank],
        }
        print(
            f"S={S} P={n}: layer fwd+bwd query-major {ms['query_major']:.2f} ms, key-major "
            f"{ms['key_major']:.2f} ms ({m['key_major_speedup']:.3f}x); peak MiB "
            f"{m['peak_mib_worst_rank']}; gradients differ by {m['grad_rel_diff']:.1e}",
            flush=True,
        )
    path = write_results("mla-train-paths", metrics, out, layer="deepseek_v3_mla_32heads")
    print(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--many-only",
        action="store_true",
        help="only the many-prompt prefill (writes modules-many-<date>.json)",
    )
    ap.add_argument(
        "--train-paths",
        action="store_true",
        help="only the MLA training step on all GPUs, both backward paths "
        "(writes mla-train-paths-<date>.json)",
    )
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[32768, 65536],
                    help="sequence lengths of --train-paths")  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS), help="directory of the results file")
    args = ap.parse_args()
    if args.train_paths:
        return train_paths(args.seq_lens, args.out)
    seq, batch, ctx = (8192, 16, 8192) if args.quick else (32768, 64, 32768)
    metrics: dict[str, float] = {}
    layers = [("llama3_8b", llama_layer), ("deepseek_v3_mla", mla_layer)]
    if args.many_only:
        layers.append(("deepseek_v3_mla_32heads", mla_layer_tp4))
    for name, build in layers:
        torch.manual_seed(0)
        layer = build()
        if not args.many_only:
            check_prefill(name, layer, metrics)
            bench_prefill(name, layer, seq, metrics)
            bench_decode(name, layer, batch, ctx, metrics)
        for b, n in MANY_SHAPES if args.many_only else MANY_SHAPES[:1]:
            bench_prefill_many(name, layer, b, n, metrics)
        print(
            json.dumps({k: round(v, 4) for k, v in metrics.items() if k.startswith(name)}),
            flush=True,
        )
    out = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "metrics": metrics,
    }
    kind = "modules-many" if args.many_only else "modules"
    path = Path(args.out) / f"{kind}-{out['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
