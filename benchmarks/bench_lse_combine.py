"""DCP combine kernels on one GPU: bandwidth of the a2a combine, its packed variant and the ag_rs
correction, next to the device copy bandwidth, the per-launch floor and the eager references.

Shapes (decode, bf16): B = 512 tokens, N in {2, 4, 8} DCP ranks, H_local = 128 / N heads per
rank after the all-to-all, D in {128, 512}. The correction runs on all 128 gathered heads.
Bytes counted = bytes read + bytes written by the kernel (partials, LSEs, outputs).

Every kernel is first checked against the pure-PyTorch reference on the benchmark shapes (the
flash-attention 2x rule against an fp32 reference); a wrong kernel stops the run before any
speed is reported. Kernel times are CUDA-graph replays cycling over enough input copies to
defeat the L2 cache; eager times use ``triton.testing.do_bench`` (which flushes L2).

    python -m benchmarks.bench_lse_combine            # ~1-2 min on an H200
    python -m benchmarks.bench_lse_combine --no-sweep # default launch configs only
    python -m benchmarks.bench_lse_combine --comm     # the collectives too, on N >= 2 GPUs

Writes ``benchmarks/results/lse_combine-<date>.json`` (``--comm``: ``dcp_comm-<date>.json``,
see :func:`run_comm`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys

import torch
import triton
from triton.testing import do_bench

from benchmarks.common import RESULTS
from cp_modules.kernels.merge import (
    correct_attn_out_triton,
    lse_combine_tile,
    lse_combine_triton,
)
from cp_modules.ops.dcp_comm import DCPCommSpec, dcp_a2a_send_buffers
from cp_modules.ops.lse_combine import lse_combine, pack_partials, unpack_partials
from cp_modules.reference.lse_merge import (
    correct_attn_out_reference,
    lse_combine_reference,
    lse_weights_reference,
)
from cp_modules.testing.numerics import assert_close_to_reference, max_abs_err

B = 512
TOTAL_HEADS = 128
NS = (2, 4, 8)
DS = (128, 512)
DTYPE = torch.bfloat16
GOAL_TBPS = {128: 2.0, 512: 3.4}
L2_DEFEAT_BYTES = 512 << 20  # input copies per graph: well beyond the 50-60 MB L2
# (BLOCK_R, BLOCK_D, num_warps) candidates per D; the default config is always measured too.
SWEEP = {
    128: [(8, 128, 4), (16, 128, 4), (32, 128, 8), (64, 128, 4), (64, 128, 8)],
    512: [(2, 512, 4), (4, 512, 4), (8, 512, 8), (16, 512, 8), (16, 256, 4)],
}


@triton.jit
def _noop_kernel(x_ptr):
    pass


def graph_us(calls: list, launches: int = 240) -> float:
    """Microseconds per call of ``calls`` (cycled) replayed from one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    rounds = max(1, launches // len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (rounds * len(calls)))
    return sorted(times)[len(times) // 2]


def copy_gbps(num_bytes: int) -> float:
    """Device copy bandwidth (read + write) of cloning a ``num_bytes`` tensor."""
    big = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    return 2 * num_bytes / (do_bench(lambda: big.clone()) * 1e-3) / 1e9


def copies_for(bytes_per_call: int) -> int:
    return max(2, math.ceil(L2_DEFEAT_BYTES / bytes_per_call))


def make_partials(n: int, d: int, h: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(n, B, h, d, device="cuda", generator=g).to(DTYPE)
    lse = 4 * torch.randn(n, B, h, device="cuda", generator=g)
    lse[0, :7] = float("-inf")  # empty shards on a few rows
    lse[:, 7] = float("nan")  # an all-empty row
    return out, lse


def check_combine(out, lse, got, got_lse, what: str) -> float:
    ref32, ref_lse = lse_combine_reference(out.float(), lse)
    w, _ = lse_weights_reference(lse)
    same = torch.where(w[..., None] > 0, out * w.to(out.dtype)[..., None], 0).sum(0)
    assert_close_to_reference(got, ref32, same, atol=1e-6, name=what)
    torch.testing.assert_close(got_lse, ref_lse, rtol=0, atol=1e-5, msg=what)
    return max_abs_err(got, ref32)


def bench_shape(n: int, d: int, metrics: dict, sweep: bool) -> None:
    h = TOTAL_HEADS // n
    tag = f"D{d}_N{n}"
    esize = DTYPE.itemsize
    comb_bytes = (n * B * h * d + B * h * d) * esize + (n * B * h + B * h) * 4
    copies = copies_for(n * B * h * d * esize)
    inputs = [make_partials(n, d, h, seed=i) for i in range(copies)]
    out, lse = inputs[0]

    # Correctness first, on the benchmark shapes: no speed for a wrong kernel.
    got, got_lse = lse_combine_triton(out, lse)
    metrics[f"lse_combine_max_err_{tag}"] = check_combine(out, lse, got, got_lse, f"combine {tag}")
    packed_inputs = [pack_partials(o, lg) for o, lg in inputs]
    views = [unpack_partials(p, h, d) for p in packed_inputs]
    got_p, got_p_lse = lse_combine_triton(*views[0])
    check_combine(out, lse, got_p, got_p_lse, f"packed combine {tag}")
    metrics[f"lse_combine_packed_equals_unpacked_{tag}"] = bool(
        torch.equal(got_p, got) and torch.equal(got_p_lse, got_lse)
    )
    hg = TOTAL_HEADS
    corr_inputs = [
        (torch.randn(B, hg, d, device="cuda").to(DTYPE), 4 * torch.randn(n, B, hg, device="cuda"))
        for _ in range(copies_for(B * hg * d * esize))
    ]
    c_out, c_lse = corr_inputs[0]
    corr, corr_lse = correct_attn_out_triton(c_out, c_lse, 1, num_blocks=n)
    ref, ref_lse = correct_attn_out_reference(c_out.float(), c_lse, 1, num_blocks=n)
    assert_close_to_reference(corr, ref, ref.to(DTYPE), atol=1e-6, name=f"correction {tag}")
    torch.testing.assert_close(corr_lse, ref_lse, rtol=0, atol=1e-5)
    metrics[f"correct_attn_out_max_err_{tag}"] = max_abs_err(corr, ref)

    # Kernel times (CUDA graph, cold L2) and bandwidth.
    t = graph_us([lambda o=o, lg=lg: lse_combine_triton(o, lg) for o, lg in inputs])
    metrics[f"lse_combine_us_{tag}"] = t
    metrics[f"lse_combine_GBps_{tag}"] = comb_bytes / t / 1e3
    metrics[f"lse_combine_config_{tag}"] = "R{}-BD{}-W{}".format(*lse_combine_tile(d, esize))
    t = graph_us([lambda v=v: lse_combine_triton(*v) for v in views])
    metrics[f"lse_combine_packed_us_{tag}"] = t
    metrics[f"lse_combine_packed_GBps_{tag}"] = comb_bytes / t / 1e3
    corr_bytes = 2 * B * hg * d * esize + (n * B * hg + B * hg) * 4
    t = graph_us(
        [
            lambda o=o, lg=lg: correct_attn_out_triton(o, lg, 1, num_blocks=n)
            for o, lg in corr_inputs
        ]
    )
    metrics[f"correct_attn_out_us_{tag}"] = t
    metrics[f"correct_attn_out_GBps_{tag}"] = corr_bytes / t / 1e3

    # Eager: the public op (launch overhead included) and the PyTorch reference.
    metrics[f"lse_combine_eager_us_{tag}"] = do_bench(lambda: lse_combine(out, lse)) * 1e3
    metrics[f"lse_combine_reference_eager_us_{tag}"] = (
        do_bench(lambda: lse_combine_reference(out, lse)) * 1e3
    )

    # Sender side of the a2a: one packed buffer vs separate output and LSE buffers.
    s_out, s_lse = torch.randn(B, hg, d, device="cuda").to(DTYPE), torch.randn(B, hg, device="cuda")
    for packed in (False, True):
        spec = DCPCommSpec("dcp", n, 0, "tp", n, 0, "a2a", packed, tuple(range(n)))
        name = "packed" if packed else "unpacked"
        metrics[f"a2a_send_{name}_us_{tag}"] = graph_us(
            [lambda spec=spec: dcp_a2a_send_buffers(s_out, s_lse, spec)]
        )

    if sweep:
        best = (metrics[f"lse_combine_GBps_{tag}"], metrics[f"lse_combine_config_{tag}"])
        for r, bd, w in SWEEP[d]:
            cand = lse_combine_triton(out, lse, block_rows=r, block_d=bd, num_warps=w)
            try:
                check_combine(out, lse, *cand, f"combine {tag} R{r}-BD{bd}-W{w}")
            except AssertionError as e:  # a wrong config gets no speed
                metrics[f"lse_combine_sweep_error_{tag}_R{r}-BD{bd}-W{w}"] = str(e)
                continue
            t = graph_us(
                [
                    lambda o=o, lg=lg, r=r, bd=bd, w=w: lse_combine_triton(
                        o, lg, block_rows=r, block_d=bd, num_warps=w
                    )
                    for o, lg in inputs
                ]
            )
            best = max(best, (comb_bytes / t / 1e3, f"R{r}-BD{bd}-W{w}"))
        metrics[f"lse_combine_best_GBps_{tag}"], metrics[f"lse_combine_best_config_{tag}"] = best


# --comm: the combine with its collectives on several GPUs (not part of the one-GPU suite).
# Query heads, decode query dim, output dim (Llama-3-8B; DeepSeek-V3 absorbed MLA).
COMM_SHAPES = {"llama3_8b": (32, 128, 128), "deepseek_v3": (128, 576, 512)}
COMM_BATCHES = (1, 8, 64, 256)


def _events_us(fn, iters=50):
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


def _comm_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from cp_modules.config import ParallelConfig, valid_dcp_sizes
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.ops.dcp_comm import DCPCommSpec, dcp_combine, dcp_prepare_query
    from cp_modules.reference.lse_merge import lse_combine_reference

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
                cfg = ParallelConfig(
                    tensor_parallel_size=tp,
                    prefill_context_parallel_size=pcp,
                    decode_context_parallel_size=dcp,
                    dcp_comm_backend=backend,
                )
                groups = init_cp_groups(cfg)
                spec = DCPCommSpec.from_groups(groups, packed=packed)
                name = f"tp{tp}_pcp{pcp}_dcp{dcp}_{backend}{'_packed' if packed else ''}"
                for model, (h, dq, dv) in COMM_SHAPES.items():
                    hl = h // tp
                    for b in COMM_BATCHES:
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
                        ref, _ = lse_combine_reference(
                            torch.stack(all_out).float(), torch.stack(all_lse)
                        )
                        own = slice(spec.gather_rank * hl, (spec.gather_rank + 1) * hl)
                        err = (got.float() - ref[:, own]).abs().max().item()
                        # bf16 outputs: within 2 bf16 ulps of the largest output (ag_rs rounds
                        # the corrected partials and their sum; a2a rounds once).
                        bound = 2 * 2.0**-7 * ref[:, own].abs().max().item()

                        def step(q=q, out=out, lse=lse, spec=spec):
                            dcp_prepare_query(q, spec)
                            return dcp_combine(out, lse, spec)

                        eager = _events_us(step)
                        s = torch.cuda.Stream()
                        s.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(s):
                            step()
                        torch.cuda.current_stream().wait_stream(s)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            step()
                        graphed = _events_us(graph.replay)
                        results[f"{name}_{model}_B{b}"] = dict(
                            eager_us=eager, graph_us=graphed, max_err=err, err_bound=bound
                        )
    return results


def run_comm(world_size: int, out: str | None) -> int:
    """DCP decode communication on several GPUs (NCCL): query preparation + combine per layer.

    For each layout of the world size with dcp > 1 and each combine (ag_rs, a2a, packed a2a):
    Llama-3-8B decode shapes (32 q heads, D = 128) and DeepSeek-V3 absorbed MLA (128 heads,
    q 576, out 512), bf16, B in {1, 8, 64, 256} decode tokens. Every combine's output is first
    checked against the exact LSE-weighted merge of all ranks' partials (gathered separately),
    within 2 bf16 ulps of the largest output. Times: eager (CUDA events around 50 iterations)
    and CUDA-graph replay of the same step. Writes dcp_comm-<date>.json, the machine in "gpu".
    """
    from cp_modules.testing.distributed import run_distributed

    if world_size < 2 or torch.cuda.device_count() < world_size:
        print(f"--comm needs >= 2 GPUs (have {torch.cuda.device_count()})", file=sys.stderr)
        return 2
    per_rank = run_distributed(_comm_rank, world_size, backend="nccl", timeout_s=900)
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
        print(
            f"{k:<48} eager {v['eager_us']:8.1f} us  graph {v['graph_us']:8.1f} us  err {v['max_err']:.1e}"
        )
    report = {"date": datetime.date.today().isoformat(),
              "gpu": f"{world_size}x {torch.cuda.get_device_name()}",
              "torch": torch.__version__, "triton": triton.__version__,
              "metrics": merged, "wrong": bad}  # fmt: skip
    path = pathlib.Path(out) if out else RESULTS / f"dcp_comm-{report['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}; {'all exact' if not bad else f'WRONG: {bad}'}")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    parser.add_argument("--out", default=None, help="output JSON path")
    parser.add_argument("--comm", action="store_true",
                        help="only the DCP communication per layer on several GPUs (NCCL)")  # fmt: skip
    parser.add_argument("--world-size", type=int, default=None,
                        help="GPUs of one host for --comm (default: all)")  # fmt: skip
    args = parser.parse_args()
    if args.comm:
        return run_comm(args.world_size or torch.cuda.device_count(), args.out)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    metrics: dict = {}

    x = torch.empty(1, device="cuda")
    metrics["launch_floor_us"] = do_bench(lambda: _noop_kernel[(1,)](x)) * 1e3
    metrics["launch_floor_graph_us"] = graph_us([lambda: _noop_kernel[(1,)](x)])
    metrics["copy_GBps"] = copy_gbps(1 << 30)

    for d in DS:
        for n in NS:
            bench_shape(n, d, metrics, sweep=not args.no_sweep)
            print(
                f"D={d} N={n}: combine {metrics[f'lse_combine_GBps_D{d}_N{n}']:.0f} GB/s "
                f"({metrics[f'lse_combine_us_D{d}_N{n}']:.2f} us), packed "
                f"{metrics[f'lse_combine_packed_GBps_D{d}_N{n}']:.0f} GB/s, correction "
                f"{metrics[f'correct_attn_out_GBps_D{d}_N{n}']:.0f} GB/s, eager op "
                f"{metrics[f'lse_combine_eager_us_D{d}_N{n}']:.1f} us, reference "
                f"{metrics[f'lse_combine_reference_eager_us_D{d}_N{n}']:.1f} us",
                flush=True,
            )
    for d, goal in GOAL_TBPS.items():
        worst = min(metrics[f"lse_combine_GBps_D{d}_N{n}"] for n in NS)
        metrics[f"goal_TBps_D{d}"] = goal
        metrics[f"goal_met_D{d}"] = worst >= goal * 1e3
    print(
        f"floor {metrics['launch_floor_us']:.2f} us (graph {metrics['launch_floor_graph_us']:.2f} us), "
        f"copy {metrics['copy_GBps']:.0f} GB/s"
    )

    date = datetime.date.today().isoformat()
    report = {
        "date": date,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "metrics": metrics,
    }
    path = pathlib.Path(args.out) if args.out else RESULTS / f"lse_combine-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
