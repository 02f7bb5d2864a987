"""Self-check: run the CP attention modules on several processes and compare with one process.

    python -m cp_modules.verify --world-size 4 --tp 2 --pcp 2 --dcp 2 --dcp-comm-backend a2a \
        --attention {gqa,mla} --mode {train,prefill,decode,mixed} [--seq-lens 1000,37,5] \
        [--decode-steps 8] [--dtype float32] [--interleave 1] [--block-size 16] [--compile] \
        [--widths {tiny,model}] [--seed 0] [--json]

Ranks are spawned on this machine (gloo on CPU, NCCL with one GPU per rank when CUDA has
enough devices). Every rank builds the same seeded layer, shards it with tensor parallelism,
runs the requested mode on random inputs and compares its restored outputs (and, for
``train``, the input and parameter gradients) with the same layer run unsharded in a single
process. Prints the max abs error per output/gradient; exit status 0 only within tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from cp_modules.config import ParallelConfig
from cp_modules.testing.gradients import full_input_grads, full_param_grads

__all__ = ["VerifyArgs", "main", "run_verify", "verify_rank"]


def _default_parallel() -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                          decode_context_parallel_size=2)  # fmt: skip


@dataclass
class VerifyArgs:
    """One check: the layout (``parallel``; dp = pp = 1) and the layer, steps and numerics."""

    parallel: ParallelConfig = field(default_factory=_default_parallel)
    attention: str = "gqa"
    mode: str = "mixed"
    seq_lens: list[int] = field(default_factory=lambda: [37, 5, 12])
    decode_steps: int = 3
    dtype: str = "float32"
    block_size: int = 16
    compile: bool = False
    seed: int = 0
    packed_a2a: bool = True
    num_kv_heads: int | None = None
    widths: str = "tiny"
    mla_backward: str = "auto"
    pcp_varlen: str = "auto"
    policy_changes: dict = field(default_factory=dict)  # other CPPolicy fields
    sinks: bool = False
    sliding_window: int | None = None
    softcap: float | None = None
    # "fp8_e4m3": both runs keep an fp8 KV cache (static scales 0.5 for K / the latent, 2.0 for
    # V), so the sharded run is compared with the single process's fp8 run.
    kv_cache_dtype: str = "bf16"
    # An fp8 cache's bf16 window (sink, recent) in both runs (cp_modules.cache.exact_window).
    fp8_window: tuple[int, int] = (0, 0)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def policy(self):
        """The :class:`~cp_modules.policy.CPPolicy` of these choices (raises on bad values)."""
        from cp_modules.policy import CPPolicy

        return CPPolicy(mla_backward=self.mla_backward, pcp_varlen=self.pcp_varlen,
                        **self.policy_changes)  # fmt: skip


# fp32/fp64: absolute bound on |parallel - single process|. bf16/fp16 use the 2x rule instead
# (see verify_rank); the values here are only used for fp32/fp64.
TOLERANCE = {"float32": 2e-4, "float64": 1e-9}
DTYPES = ("float32", "float64", "bfloat16", "float16")

# Layer widths. "tiny" keeps the check quick on CPUs. "model" has real models' head dims
# (Llama's 128; DeepSeek-V3's MLA 128 + 64 / 128 over a 512-wide latent) with 8 heads, so on a
# GPU the check runs the kernels those models run; its projections are also wide enough that
# cuBLAS's bf16 GEMMs stay at bf16 rounding (docs/experiments/2026-11-30-wgrad-gemm-probe.md:
# weight gradients of 256 x 256 or fewer elements lost accuracy at a few token counts, wider
# ones did not).
WIDTHS = ("tiny", "model")
GQA_SHAPES = {
    "tiny": dict(hidden_size=64, num_heads=8, head_dim=16),
    "model": dict(hidden_size=1024, num_heads=8, head_dim=128),
}
MLA_SHAPES = {
    "tiny": dict(hidden_size=64, num_heads=8, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
    "model": dict(hidden_size=1024, num_heads=8, q_lora_rank=512, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}  # fmt: skip


def _shape(a: VerifyArgs) -> dict:
    if a.widths not in WIDTHS:
        raise ValueError(f"--widths must be one of {WIDTHS}, got {a.widths!r}")
    return (GQA_SHAPES if a.attention == "gqa" else MLA_SHAPES)[a.widths]


def _config(a: VerifyArgs) -> ParallelConfig:
    _shape(a)
    if a.sinks and a.attention != "gqa":
        raise ValueError("--sinks applies to --attention gqa only (MLA models have no sinks)")
    if a.sliding_window is not None and a.sliding_window < 1:
        raise ValueError(f"--sliding-window must be >= 1, got {a.sliding_window}")
    if a.softcap is not None and not a.softcap > 0:
        raise ValueError(f"--softcap must be > 0, got {a.softcap}")
    if (a.sliding_window or a.softcap) and a.attention != "gqa":
        raise ValueError("--sliding-window and --softcap apply to --attention gqa only")
    p = a.parallel
    if p.dp != 1 or p.pp != 1:
        raise ValueError(
            f"verify checks one replica without pipeline stages: data_parallel_size={p.dp}, "
            f"pipeline_parallel_size={p.pp} must be 1"
        )
    return p


def _kv_heads(a: VerifyArgs, cfg) -> int:
    """The most KV heads (<= 4) the configuration can serve, unless given."""
    heads = GQA_SHAPES[a.widths]["num_heads"]
    if a.num_kv_heads is not None:
        cfg.validate_heads(heads, a.num_kv_heads)
        return a.num_kv_heads
    for kv in (4, 2, 1):
        try:
            cfg.validate_heads(heads, kv)
            return kv
        except ValueError:
            continue
    raise ValueError("no KV-head count serves this configuration")


def _build_layer(a: VerifyArgs, cfg, dtype):
    from cp_modules.modules import CPFlashAttention, CPMLAAttention

    torch.manual_seed(a.seed)
    layer: CPFlashAttention | CPMLAAttention
    if a.attention == "gqa":
        layer = CPFlashAttention(
            num_kv_heads=_kv_heads(a, cfg), bias=True, sinks=a.sinks,
            sliding_window=a.sliding_window, softcap=a.softcap, **_shape(a),
        )  # fmt: skip
        if layer.sinks is not None:
            with torch.no_grad():
                layer.sinks.normal_()
    elif a.attention == "mla":
        cfg.validate_heads(_shape(a)["num_heads"], None)
        layer = CPMLAAttention(**_shape(a))
    else:
        raise ValueError(f"--attention must be 'gqa' or 'mla', got {a.attention!r}")
    return layer.to(dtype)


def _allocate_cache(layer, num_blocks: int, block_size: int, dtype, device, kv_cache_dtype="bf16",
                    fp8_window=(0, 0), rows: int = 1):  # fmt: skip
    from cp_modules.cache.exact_window import allocate_window_buffer, check_exact_window
    from cp_modules.cache.kv_dtype import kv_cache_storage_dtype, kv_scale
    from cp_modules.cache.paged import allocate_kv_cache, allocate_mla_cache
    from cp_modules.modules import CPFlashAttention

    store = kv_cache_storage_dtype(kv_cache_dtype, dtype, device)
    fp8 = store != dtype
    win = check_exact_window(*fp8_window)
    model_dtype, dtype = dtype, store

    def window(tail):
        if win is None:
            return None
        buf = allocate_window_buffer(rows, win, tail, dtype=model_dtype, device=device)
        return buf, win.sink, win.recent

    if isinstance(layer, CPFlashAttention):
        kv = layer.num_kv_heads if layer.kv_replica_index is None else 1
        heads = layer.k_proj.weight
        local_kv = (heads.to_local() if hasattr(heads, "to_local") else heads).shape[
            0
        ] // layer.head_dim
        kv = min(kv, local_kv)
        if fp8:
            layer.kv_scales = (kv_scale(0.5, kv, device=device), kv_scale(2.0, kv, device=device))
        layer.fp8_window = window((2, kv, layer.head_dim))
        return allocate_kv_cache(
            num_blocks, block_size, kv, layer.head_dim, dtype=dtype, device=device
        )
    if fp8:
        layer.kv_cache_scale = kv_scale(0.5, 1, device=device)
    layer.fp8_window = window((layer.kv_lora_rank + layer.qk_rope_head_dim,))
    return allocate_mla_cache(
        num_blocks,
        block_size,
        layer.kv_lora_rank,
        layer.qk_rope_head_dim,
        dtype=dtype,
        device=device,
    )


def _steps(a: VerifyArgs) -> list[tuple[list[int], list[int]]]:
    """(num_new, num_computed) per step for the mode; requests keep their batch rows."""
    lens = list(a.seq_lens)
    if a.mode in ("train", "prefill"):
        return [(lens, [0] * len(lens))]
    steps = [(lens, [0] * len(lens))]
    done = list(lens)
    if a.mode == "decode":
        for _ in range(a.decode_steps):
            steps.append(([1] * len(lens), list(done)))
            done = [d + 1 for d in done]
        return steps
    if a.mode == "mixed":
        # Step 2: request 0 decodes, request 1 continues with a chunk (chunked prefill over its
        # cached prefix), the others decode; then decode steps.
        new = [1] * len(lens)
        if len(lens) > 1:
            new[1] = 7
        steps.append((new, list(done)))
        done = [d + n for d, n in zip(done, new)]
        for _ in range(max(1, a.decode_steps - 1)):
            steps.append(([1] * len(lens), list(done)))
            done = [d + 1 for d in done]
        return steps
    raise ValueError(f"--mode must be train, prefill, decode or mixed, got {a.mode!r}")


def _run(layer, runtime, a: VerifyArgs, inputs, device, compiled, block_table, train):
    """Outputs [N, hidden] per step (restored), and gradients for train mode."""
    from cp_modules.modules import build_step_metadata, cp_step, restore_tokens

    outs = []
    for (new, comp), x in zip(_steps(a), inputs):
        meta = build_step_metadata(
            runtime,
            new,
            comp,
            block_table=None if train else block_table,
            block_size=a.block_size,
            device=device,
        )
        x_local = x.to(device)[meta.token_indices]
        if train:
            x_local = x_local.detach().requires_grad_(True)
        with cp_step(meta), torch.set_grad_enabled(train):
            y = compiled(x_local, meta.positions)
            y_full = restore_tokens(y.detach(), meta)
        outs.append((y_full, y, x_local, meta))
    return outs


def verify_rank(rank: int, world_size: int, a: VerifyArgs) -> dict:
    """Body of one rank (also the single-process reference when run with world size 1)."""
    import torch.distributed as dist

    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules import CPRuntime, apply_tensor_parallel

    dtype = getattr(torch, a.dtype)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    cfg = _config(a)
    groups = init_cp_groups(cfg)
    runtime = CPRuntime.from_groups(groups, packed_a2a=a.packed_a2a, policy=a.policy())
    steps = _steps(a)
    train = a.mode == "train"

    # Inputs: identical on every rank (same seed), one [N, hidden] tensor per step.
    g = torch.Generator().manual_seed(a.seed + 1)
    hidden = _shape(a)["hidden_size"]
    inputs = [torch.randn(sum(new), hidden, generator=g).to(dtype) for new, _ in steps]
    grad_w = [torch.randn(sum(new), hidden, generator=g).to(dtype) for new, _ in steps]

    max_len = max(n + c for new, comp in steps for n, c in zip(new, comp))
    # Sized for the single-process reference (dcp = 1), the largest need; the sharded run
    # uses the first ceil(L / (block_size * dcp)) entries of each row.
    blocks_per_req = -(-max_len // a.block_size)
    num_reqs = len(a.seq_lens)
    block_table = (torch.arange(num_reqs * blocks_per_req, dtype=torch.int32) + 1).view(
        num_reqs, blocks_per_req
    )
    num_blocks = num_reqs * blocks_per_req + 1

    # Low-precision runs follow the 2x rule: the parallel result's error against an fp32 run of
    # the same (rounded) weights and inputs may be at most twice the single-process same-dtype
    # run's error, plus one ulp of the largest value.
    low_precision = dtype not in (torch.float32, torch.float64)
    labels = ("reference", "parallel") + (("reference_fp32",) if low_precision else ())
    results: dict[str, Any] = {}
    for label in labels:
        run_dtype = torch.float32 if label == "reference_fp32" else dtype
        layer = _build_layer(a, cfg, dtype).to(device=device, dtype=run_dtype)
        if label == "parallel":
            layer = apply_tensor_parallel(layer, groups.mesh["tp"], cfg)
            rt = runtime
        else:
            rt = CPRuntime.single(policy=a.policy())
        if not train:
            layer.kv_cache = _allocate_cache(
                layer, num_blocks, a.block_size, run_dtype, device, a.kv_cache_dtype,
                a.fp8_window, num_reqs,
            )  # fmt: skip
        fn = layer
        if a.compile and label == "parallel":
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            fn = torch.compile(layer, fullgraph=True, dynamic=True)
        run_inputs = [x.to(run_dtype) for x in inputs]
        saved = _run(layer, rt, a, run_inputs, device, fn, block_table, train)
        res: dict[str, Any] = {"outputs": [y.float().cpu() for y, _, _, _ in saved]}
        if train:
            # Each rank's loss covers its own real tokens (as in training), so the gradients
            # summed over PCP ranks are those of the whole batch.
            loss = sum(
                (
                    y.float()
                    * (w.to(device).float()[m.token_indices] * m.plan.local_valid[:, None])
                ).sum()
                for (_, y, _, m), w in zip(saved, grad_w)
            )
            loss.backward()
            # Each PCP rank's gradient covers its own tokens' loss: the sum is the full one.
            pcp = groups.pcp if label == "parallel" and rt.pcp_size > 1 else None
            res["grad_input"] = full_input_grads(saved, pcp)
            res["grad_params"] = full_param_grads(layer, pcp)
        results[label] = res
        if a.compile and label == "parallel":
            results["graph_breaks"] = int(sum(torch._dynamo.utils.counters["graph_break"].values()))
            results["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    def flat(res):
        out = {f"out/step{i}": y for i, y in enumerate(res["outputs"])}
        if train:
            out["grad/input"] = res["grad_input"]
            out.update({f"grad/{n}": g for n, g in res["grad_params"].items()})
        return out

    ref, par = flat(results["reference"]), flat(results["parallel"])
    errors, bounds = {}, {}
    if low_precision:
        ref32 = flat(results["reference_fp32"])
        ulp = torch.finfo(dtype).eps
        for key, r32 in ref32.items():
            if r32.numel() == 0:
                continue
            errors[key] = float((par[key] - r32).abs().max())
            bounds[key] = 2 * float((ref[key] - r32).abs().max()) + ulp * float(r32.abs().max())
    else:
        for key, r in ref.items():
            errors[key] = float((r - par[key]).abs().max()) if r.numel() else 0.0
            bounds[key] = TOLERANCE[a.dtype]
    return {
        "rank": rank,
        "errors": errors,
        "bounds": bounds,
        "graph_breaks": results.get("graph_breaks"),
        "graphs": results.get("graphs"),
    }


def sweep_cases(a: VerifyArgs) -> list[VerifyArgs]:
    """Every configuration ParallelConfig accepts at ``a.world_size`` (dp = pp = 1), both comm
    backends, both layer types, in ``a.mode`` (and ``train`` wherever pcp > 1)."""
    from dataclasses import replace

    from cp_modules.config import valid_dcp_sizes

    cases = []
    for pcp in range(1, a.world_size + 1):
        if a.world_size % pcp:
            continue
        tp = a.world_size // pcp
        for dcp in valid_dcp_sizes(tp, pcp):
            for backend in ("ag_rs", "a2a") if dcp > 1 else ("ag_rs",):
                for att in ("gqa", "mla"):
                    layout = replace(
                        a.parallel,
                        tensor_parallel_size=tp,
                        prefill_context_parallel_size=pcp,
                        decode_context_parallel_size=dcp,
                        dcp_comm_backend=backend,
                    )
                    base = replace(a, parallel=layout, attention=att)
                    cases.append(base)
                    if pcp > 1 and dcp == 1 and backend == "ag_rs":
                        cases.append(replace(base, mode="train"))
    return cases


def _sweep_rank(rank: int, world_size: int, cases: list[VerifyArgs]) -> list[dict]:
    out = []
    for c in cases:
        r = verify_rank(rank, world_size, c)
        p = c.parallel
        r["case"] = f"tp{p.tp}-pcp{p.pcp}-dcp{p.dcp}-{p.dcp_comm_backend}-{c.attention}-{c.mode}"
        out.append(r)
    return out


def run_sweep(a: VerifyArgs) -> dict:
    """One spawn running :func:`sweep_cases`; per-case max errors and an overall verdict."""
    from cp_modules.testing.distributed import run_distributed

    cases = sweep_cases(a)
    backend = (
        "nccl"
        if torch.cuda.is_available() and torch.cuda.device_count() >= a.world_size
        else "gloo"
    )
    per_rank = run_distributed(_sweep_rank, a.world_size, cases, backend=backend, timeout_s=3600)
    summary, ok = {}, True
    for i in range(len(cases)):
        err = max(max(r[i]["errors"].values()) for r in per_rank)
        within = all(e <= r[i]["bounds"][k] for r in per_rank for k, e in r[i]["errors"].items())
        summary[per_rank[0][i]["case"]] = {"max_abs_err": err, "ok": within}
        ok &= within
    worst = max(v["max_abs_err"] for v in summary.values())
    return {
        "ok": ok,
        "max_abs_err": worst,
        "rule": _rule(a),
        "backend": backend,
        "cases": summary,
        "num_cases": len(cases),
    }


def _rule(a: VerifyArgs) -> str:
    if a.dtype in ("float32", "float64"):
        return f"max abs err <= {TOLERANCE[a.dtype]:.0e}"
    return f"{a.dtype}: err vs fp32 run <= 2 x single-process {a.dtype} err + 1 ulp"


def _args_record(a: VerifyArgs) -> dict:
    # The arguments as the command line names them (the layout's sizes first).
    record = asdict(a)
    del record["parallel"]
    p = a.parallel
    layout = dict(world_size=p.world_size, tp=p.tp, pcp=p.pcp, dcp=p.dcp,
                  dcp_comm_backend=p.dcp_comm_backend, interleave=p.interleave)  # fmt: skip
    return {**layout, **record}


def run_verify(a: VerifyArgs) -> dict:
    """Spawn the ranks, run :func:`verify_rank`, and summarise."""
    from cp_modules.testing.distributed import run_distributed

    _config(a)  # validate before spawning anything
    backend = (
        "nccl"
        if torch.cuda.is_available() and torch.cuda.device_count() >= a.world_size
        else "gloo"
    )
    per_rank = run_distributed(verify_rank, a.world_size, a, backend=backend, timeout_s=1800)
    errors: dict[str, float] = {}
    bounds: dict[str, float] = {}
    for r in per_rank:
        for k, v in r["errors"].items():
            errors[k] = max(errors.get(k, 0.0), v)
            bounds[k] = min(bounds.get(k, float("inf")), r["bounds"][k])
    max_err = max(errors.values()) if errors else 0.0
    within = all(errors[k] <= bounds[k] for k in errors)
    gb = [r["graph_breaks"] for r in per_rank if r["graph_breaks"] is not None]
    summary = {
        "ok": bool(within and (not a.compile or max(gb, default=0) == 0)),
        "max_abs_err": max_err,
        "rule": _rule(a),
        "errors": errors,
        "bounds": bounds,
        "backend": backend,
        "args": _args_record(a),
    }
    if a.compile:
        summary["graph_breaks"] = max(gb, default=0)
        # Compiled graphs over all steps (one per distinct shape class; steps with new batch
        # compositions must not add any).
        summary["compiled_graphs"] = max(r["graphs"] for r in per_rank)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cp_modules.verify", description=__doc__.split("\n")[0]
    )
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pcp", type=int, default=2)
    p.add_argument("--dcp", type=int, default=2)
    p.add_argument("--dcp-comm-backend", default="ag_rs", choices=["ag_rs", "a2a"])
    p.add_argument("--attention", default="gqa", choices=["gqa", "mla"])
    p.add_argument("--mode", default="mixed", choices=["train", "prefill", "decode", "mixed"])
    p.add_argument("--seq-lens", default="37,5,12")
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=None)
    p.add_argument("--unpacked-a2a", action="store_true", help="two all-to-alls instead of one")
    p.add_argument("--compile", action="store_true")
    p.add_argument(
        "--widths",
        default="tiny",
        choices=list(WIDTHS),
        help="layer widths: tiny (quick on CPUs) or model (real head dims, for GPUs)",
    )
    p.add_argument(
        "--mla-backward",
        default="auto",
        choices=["auto", "key_major", "query_major"],
        help="MLA's training backward path (CPPolicy.mla_backward)",
    )
    p.add_argument(
        "--pcp-varlen",
        default="auto",
        choices=["auto", "always", "never"],
        help="PCP prefill path: blocks or one varlen call (CPPolicy.pcp_varlen)",
    )
    p.add_argument("--sinks", action="store_true", help="a learned sink logit per head (GQA)")
    p.add_argument("--sliding-window", type=int, default=None, help="window W of every query (GQA)")
    p.add_argument("--softcap", type=float, default=None, help="logit soft-cap c (GQA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="every accepted configuration of --world-size (both backends, gqa and mla) in one spawn",
    )
    ns = p.parse_args(argv)
    try:
        seq_lens = [int(s) for s in ns.seq_lens.split(",") if s]
    except ValueError:
        print(f"--seq-lens must be comma-separated integers, got {ns.seq_lens!r}", file=sys.stderr)
        return 2
    try:
        if ns.tp * ns.pcp != ns.world_size:
            raise ValueError(f"--world-size {ns.world_size} must equal tp*pcp = {ns.tp}*{ns.pcp} "
                             "(dp = pp = 1 here)")  # fmt: skip
        parallel = ParallelConfig(
            tensor_parallel_size=ns.tp, prefill_context_parallel_size=ns.pcp,
            decode_context_parallel_size=ns.dcp, dcp_comm_backend=ns.dcp_comm_backend,
            dcp_kv_cache_interleave_size=ns.interleave,
        )  # fmt: skip
    except ValueError as e:
        print(f"invalid arguments: {e}", file=sys.stderr)
        return 2
    # Every other option has its VerifyArgs field's name.
    names = {f.name for f in fields(VerifyArgs)} - {"parallel", "seq_lens", "packed_a2a"}
    a = VerifyArgs(
        parallel=parallel,
        seq_lens=seq_lens,
        packed_a2a=not ns.unpacked_a2a,
        **{k: v for k, v in vars(ns).items() if k in names},
    )
    if ns.sweep:
        summary = run_sweep(a)
        if ns.json:
            print(json.dumps(summary))
        else:
            for k, v in summary["cases"].items():
                print(f"{k:<40} max abs err {v['max_abs_err']:.3e}  {'ok' if v['ok'] else 'FAIL'}")
            print(
                f"{'OK' if summary['ok'] else 'FAILED'}: {summary['num_cases']} cases, max abs err "
                f"{summary['max_abs_err']:.3e} ({summary['rule']}, {summary['backend']})"
            )
        return 0 if summary["ok"] else 1
    try:
        summary = run_verify(a)
    except ValueError as e:
        print(f"invalid arguments: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(summary))
    else:
        for k, v in sorted(summary["errors"].items()):
            b = summary["bounds"][k]
            print(f"{k:<28} max abs err {v:.3e} (bound {b:.1e})  {'ok' if v <= b else 'FAIL'}")
        if a.compile:
            print(
                f"graph breaks: {summary['graph_breaks']}, compiled graphs: {summary['compiled_graphs']}"
            )
        print(
            f"{'OK' if summary['ok'] else 'FAILED'}: max abs err {summary['max_abs_err']:.3e} "
            f"({summary['rule']}, {summary['backend']})"
        )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
