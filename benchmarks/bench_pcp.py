"""PCP head/tail prefill attention on one GPU: correctness, balance, speed.

Every PCP rank's work is simulated on the one GPU: rank r's DualChunkSwap queries (head chunk
r, tail chunk 2P-1-r) attend the full K/V prefix they need, exactly as
``cp::pcp_prefill_attention`` runs it on that rank (causal square + rectangle + LSE merge on
PyTorch's fused kernels), forward and backward. The baseline is dense causal attention of the
whole sequence on the fastest kernel PyTorch ships for the shape (cuDNN for all of them here).

Shapes (bf16, one sequence of S tokens): MHA 32 heads x 128 at S = 32k and 128k; GQA 32/8 x 128
and MLA prefill (qk 192 / v 128, 32 heads) at S = 32k; P in {2, 4, 8}.

Correctness first, on the benchmark shapes: every rank's output and LSE, and the q/k/v
gradients summed over the ranks (in fp32), against the fp32 pure-PyTorch reference (evaluated
in query chunks), with the flash-attention rule: error <= 2 x base + 1e-5, base = the larger
error of the dense fused kernel and of plain PyTorch attention in bf16.
A shape that fails is reported as failed, without speeds, and the script exits with status 1.

Metrics per shape and P: per-rank forward / backward time, ratio = rank time / (dense time / P)
(dense and rank timings alternate over 5 rounds, medians kept; worst and mean over ranks;
goals: worst forward <= 1.05 for the balance and <= 1.10 for forward and backward), peak memory
of a rank vs dense.

    python -m benchmarks.bench_pcp                 # the suite's part, ~2-3 min on an H200
    python -m benchmarks.bench_pcp --shapes mha-32k --pcp 2 4

Writes ``benchmarks/results/pcp-<date>.json``. Further measurements the report cites, each a
subcommand with its own options (``python -m benchmarks.bench_pcp <study> --help``) and its
own results file:

- ``key-major``: MLA's training backward by key chunks against the query-major blocks, with the
  bytes each moves (pcp-key-major-<date>.json);
- ``grad-layout``: the training backward's K/V gradients written straight into the
  reduce-scatter layout against restored order (pcp-grad-layout-<date>.json);
- ``varlen``: many requests, the block path against one varlen call (pcp-varlen-<date>.json);
- ``new-shapes``: the first call on prompts of new lengths against the next, per path
  (pcp-new-shapes-<date>.json);
- ``timeline``: where a rank's GPU time goes in steady state (pcp-timeline-<date>.json).

What they measured and the switch points taken from them: ``docs/switch-points.md``. The
shared helpers and each study live in ``benchmarks/pcp/`` (this module runs them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import sys
from statistics import median as statistics_median

import torch
import triton
from triton.testing import do_bench

from benchmarks.common import RESULTS, write_results
from benchmarks.pcp.common import (
    ALWAYS_VARLEN,
    BLOCKS,
    DEVICE,
    GOAL_BALANCE,
    GOAL_SPEED,
    NEVER_VARLEN,
    NO_BASELINE,
    ROUNDS,
    SHAPES,
    max_err,
    median,
    peak_mib,
    rank_fns,
    reference,
    shape_inputs,
)
from benchmarks.pcp.grad_layout import (
    GRAD_LAYOUT_SHAPES,
    grad_layout_shape,
)
from benchmarks.pcp.key_major import (  # noqa: F401 - also used through this module
    bytes_per_token,
    key_major_all_ranks,
    key_major_shape,
)
from benchmarks.pcp.new_shapes import (
    NEW_SHAPE_PATHS,
    new_shape_prompt,
)
from benchmarks.pcp.timeline import (
    timeline_shape,
)
from benchmarks.pcp.varlen import (
    MANY_SHAPES,
    varlen_batch,
)
from cp_modules.kernels.prefill.attention_blocks import (
    attention_block_backward,
    attention_block_forward,
    select_block_backend,
)
from cp_modules.ops.pcp_policy import (
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
)
from cp_modules.partition import plan_pcp
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
)


def bench_shape(name, pcps, check_only=False):
    S, hq, hkv, dqk, dv = SHAPES[name]
    q, k, v, dout, scale = shape_inputs(name)
    backend = select_block_backend(q, k, v, True)
    res = {"S": S, "Hq": hq, "Hkv": hkv, "Dqk": dqk, "Dv": dv, "dense_backend": backend}
    print(f"[{name}] dense backend: {backend}", flush=True)
    if backend in NO_BASELINE:
        # Neither cuDNN nor FlashAttention-2 serves this shape here: there is no fast baseline,
        # and the dense fp32 fallback would need an [H, S, S] score matrix.
        print(f"[{name}] skipped: no fused kernel serves this shape on this GPU", flush=True)
        res["skipped"] = "no fused kernel for this shape"
        return res, True

    def dense_fwd():
        return attention_block_forward(q, k, v, scale=scale, causal=True, backend=backend)

    out_d, lse_d = dense_fwd()
    grads_d = attention_block_backward(
        dout, q, k, v, out_d, lse_d, scale=scale, causal=True, backend=backend
    )
    (ref_out, ref_lse, *ref_grads), low = reference(q, k, v, dout, scale)
    res["dense_err"] = {
        "out": max_err(out_d, ref_out),
        "lse": max_err(lse_d, ref_lse),
        "dq_dk_dv": [max_err(a, b) for a, b in zip(grads_d, ref_grads)],
    }
    res["same_dtype_torch_err"] = {
        "out": max_err(low[0], ref_out),
        "dq_dk_dv": [max_err(a, b) for a, b in zip(low[1:], ref_grads)],
    }
    del low
    # The 2x rule's base: the larger error of the dense fused kernel and of plain PyTorch in the
    # same dtype.
    base_out = max(res["dense_err"]["out"], res["same_dtype_torch_err"]["out"])
    base_grads = [
        max(a, b)
        for a, b in zip(res["dense_err"]["dq_dk_dv"], res["same_dtype_torch_err"]["dq_dk_dv"])
    ]

    ok = True
    res["pcp"] = {}
    for P in pcps:
        errs = {"out": 0.0, "lse": 0.0}
        totals = [torch.zeros(x.shape, device=DEVICE) for x in ref_grads]
        plans = [plan_pcp([S], [0], P, r, device=DEVICE) for r in range(P)]
        for plan in plans:
            ql, dl = q[plan.token_indices], dout[plan.token_indices]
            inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, scale)
            o, lse = pcp_prefill_attention_cuda(inputs, **BLOCKS)
            rows, valid = plan.token_indices[plan.local_valid], plan.local_valid
            errs["out"] = max(errs["out"], max_err(o[valid], ref_out[rows]))
            errs["lse"] = max(errs["lse"], max_err(lse[valid], ref_lse[rows]))
            gq, gk, gv = pcp_prefill_attention_backward_cuda(dl, o, lse, inputs, **BLOCKS)[:3]
            totals[0].index_add_(0, rows, gq[valid].float())
            totals[1] += gk.float()
            totals[2] += gv.float()
        errs["dq_dk_dv"] = [max_err(a, b) for a, b in zip(totals, ref_grads)]
        bound_out = 2 * base_out + 1e-5
        bound_grads = [2 * b + 1e-5 for b in base_grads]
        passed = (
            errs["out"] <= bound_out
            and errs["lse"] <= 2 * res["dense_err"]["lse"] + 1e-4
            and all(e <= b for e, b in zip(errs["dq_dk_dv"], bound_grads))
        )
        print(
            f"[{name}] P={P} errors {errs} (dense {res['dense_err']}): {'ok' if passed else 'WRONG'}",
            flush=True,
        )
        res["pcp"][P] = {"correct": passed, "err": errs}
        ok &= passed
        del totals
    del ref_out, ref_lse, ref_grads
    torch.cuda.empty_cache()
    if not ok or check_only:
        res["correct"] = ok
        return res, ok

    def dense_bwd():
        return attention_block_backward(
            dout, q, k, v, out_d, lse_d, scale=scale, causal=True, backend=backend
        )

    res["dense_peak_mib"] = peak_mib(
        lambda: attention_block_backward(
            dout, q, k, v, *dense_fwd(), scale=scale, causal=True, backend=backend
        )
    )
    # Dense and per-rank timings alternate over a few rounds (medians kept), so a drift of the
    # GPU clock during the run moves the baseline and the ranks alike.
    dense_f, dense_b = [], []
    for P in pcps:
        fns = [
            rank_fns(plan_pcp([S], [0], P, r, device=DEVICE), q, k, v, dout, scale)
            for r in range(P)
        ]
        fwd_runs, bwd_runs = [[] for _ in range(P)], [[] for _ in range(P)]
        for _ in range(ROUNDS):
            dense_f.append(do_bench(dense_fwd, return_mode="median"))
            dense_b.append(do_bench(dense_bwd, return_mode="median"))
            for r, (f, b, _) in enumerate(fns):
                fwd_runs[r].append(do_bench(f, return_mode="median"))
                bwd_runs[r].append(do_bench(b, return_mode="median"))
        t_fwd, t_bwd = median(dense_f[-ROUNDS:]), median(dense_b[-ROUNDS:])
        fwd, bwd = [median(x) for x in fwd_runs], [median(x) for x in bwd_runs]
        # A rank holds the gathered K/V (k, v: already allocated) plus its own activations.
        peaks = [peak_mib(both) for _, _, both in fns]
        del fns
        ideal_f, ideal_b = t_fwd / P, t_bwd / P
        entry = res["pcp"][P]
        entry.update(
            dense_ms={"fwd": t_fwd, "bwd": t_bwd},
            fwd_ms=fwd,
            bwd_ms=bwd,
            fwd_ratio_worst=max(fwd) / ideal_f,
            fwd_ratio_mean=sum(fwd) / P / ideal_f,
            bwd_ratio_worst=max(bwd) / ideal_b,
            bwd_ratio_mean=sum(bwd) / P / ideal_b,
            fwd_imbalance=max(fwd) / (sum(fwd) / P),
            peak_mib_worst_rank=max(peaks),
        )
        entry["goal_balance_met"] = entry["fwd_ratio_worst"] <= GOAL_BALANCE
        entry["goal_speed_met"] = (
            max(entry["fwd_ratio_worst"], entry["bwd_ratio_worst"]) <= GOAL_SPEED
        )
        print(
            f"[{name}] P={P} fwd worst/mean ratio {entry['fwd_ratio_worst']:.3f}/{entry['fwd_ratio_mean']:.3f}"
            f"  bwd {entry['bwd_ratio_worst']:.3f}/{entry['bwd_ratio_mean']:.3f}"
            f"  (dense fwd {t_fwd:.2f} ms, bwd {t_bwd:.2f} ms)  peak {max(peaks):.0f} MiB vs dense "
            f"{res['dense_peak_mib']:.0f} MiB",
            flush=True,
        )
    res["dense_ms"] = {"fwd": median(dense_f), "bwd": median(dense_b)}
    res["correct"] = True
    return res, True


def needs_cuda() -> bool:
    if torch.cuda.is_available():
        return True
    print("needs a CUDA GPU", file=sys.stderr)
    return False


def run_suite_part(args) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    metrics, all_ok = {}, True
    for name in args.shapes:
        metrics[name], ok = bench_shape(name, args.pcp, args.check_only)
        all_ok &= ok
        torch.cuda.empty_cache()
    path = write_results("pcp", metrics, args.out)
    print(
        f"wrote {path}; {'all correct' if all_ok else 'SOME KERNELS ARE WRONG (no speeds for them)'}"
    )
    return 0 if all_ok else 1


def run_key_major(args) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    metrics, all_ok = {}, True
    for name in args.shapes:
        metrics[name], ok = key_major_shape(name, args.pcp)
        all_ok &= ok
        torch.cuda.empty_cache()
    path = write_results("pcp-key-major", metrics, args.out)
    print(f"wrote {path}; {'all correct' if all_ok else 'SOME RESULTS ARE WRONG'}")
    return 0 if all_ok else 1


def run_grad_layout(args) -> int:
    out = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rounds": args.rounds,
        "shapes": {name: grad_layout_shape(name, args.rounds) for name in args.shapes},
    }
    path = pathlib.Path(args.out) / f"pcp-grad-layout-{out['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


def run_varlen(args) -> int:
    res = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {k: dict(zip(("Hq", "Hkv", "Dqk", "Dv"), v)) for k, v in MANY_SHAPES.items()},
        "dtype": "bfloat16",
        "runs": [],
    }
    path = pathlib.Path(args.out) / f"pcp-varlen-{res['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        for P in args.pcp:
            for b in args.batches:
                R, rest = b.split("x")
                L, _, C = rest.partition("+")
                res["runs"].append(varlen_batch(shape, int(R), int(L), P, args.rounds, int(C or 0)))
                path.write_text(json.dumps(res, indent=1))  # after every run: partial results
                torch.cuda.empty_cache()
    print(f"wrote {path}")
    return 0


def run_new_shapes(args) -> int:
    rng = random.Random(0)
    # Warm up the libraries (first-ever calls) on a shape no measured prompt has.
    for policy in (NEVER_VARLEN, ALWAYS_VARLEN):
        for shape in args.shapes:
            new_shape_prompt(shape, 1000, 2, policy)
    res = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "shapes": {k: dict(zip(("Hq", "Hkv", "Dqk", "Dv"), v)) for k, v in MANY_SHAPES.items()},
        "dtype": "bfloat16",
        "runs": [],
    }
    for shape in args.shapes:
        for P in args.pcp:
            summary = {}
            lengths = [rng.randint(12000, 30000) for _ in range(args.prompts)]
            for path, policy in NEW_SHAPE_PATHS.items():
                runs = [new_shape_prompt(shape, S, P, policy) for S in lengths]
                res["runs"].append(
                    {"shape": shape, "P": P, "path": path, "lengths": lengths, "calls": runs}
                )
                summary[path] = {
                    f"{c}_{d}": statistics_median(r[c][f"{d}_ms"] for r in runs)
                    for c in ("first", "second")
                    for d in ("fwd", "bwd")
                }
            print(
                f"{shape} P={P} median ms (first / second call), fwd | bwd: "
                + "; ".join(
                    f"{p} {s['first_fwd']:.1f} / {s['second_fwd']:.2f} | "
                    f"{s['first_bwd']:.1f} / {s['second_bwd']:.2f}"
                    for p, s in summary.items()
                ),
                flush=True,
            )
    path = pathlib.Path(args.out) / f"pcp-new-shapes-{res['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0


def run_timeline(args) -> int:
    metrics = {name: timeline_shape(name, args.pcp) for name in args.shapes}
    path = write_results("pcp-timeline", metrics, args.out)
    print(f"wrote {path}")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.set_defaults(run=run_suite_part)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--pcp", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    parser.add_argument("--out", default=str(RESULTS), help="directory of the results file")
    studies = parser.add_subparsers(title="studies outside the suite", metavar="STUDY")

    def study(name, run, doc, shapes, shape_default, pcp_default):
        sub = studies.add_parser(name, help=doc, description=doc)
        sub.set_defaults(run=run)
        sub.add_argument("--shapes", nargs="+", default=shape_default, choices=list(shapes))
        if pcp_default is not None:
            sub.add_argument("--pcp", nargs="+", type=int, default=pcp_default)
        sub.add_argument("--out", default=str(RESULTS), help="directory of the results file")
        return sub

    study("key-major", run_key_major,
          "MLA's training backward by key chunks against the query-major blocks",
          SHAPES, ["mla-32k", "mha-32k", "gqa-32k"], [2, 4, 8])  # fmt: skip
    sub = study("grad-layout", run_grad_layout,
                "training backward: K/V gradients straight into the reduce-scatter layout",
                GRAD_LAYOUT_SHAPES, list(GRAD_LAYOUT_SHAPES), None)  # fmt: skip
    sub.add_argument("--rounds", type=int, default=5)
    sub = study("varlen", run_varlen, "many requests: the block path against one varlen call",
                MANY_SHAPES, list(MANY_SHAPES), [2, 8])  # fmt: skip
    sub.add_argument(
        "--batches",
        nargs="+",
        default=["1x32768", "2x16384", "4x8192", "8x4096", "1x8192", "2x4096", "16x1024", "64x512"],
        help="RxL or RxL+C: R requests of L new tokens after C cached ones",
    )
    sub.add_argument("--rounds", type=int, default=2)
    sub = study("new-shapes", run_new_shapes,
                "prompts of new lengths: the first call against the next, per path",
                MANY_SHAPES, list(MANY_SHAPES), [2, 8])  # fmt: skip
    sub.add_argument("--prompts", type=int, default=6)
    study("timeline", run_timeline, "where a rank's GPU time goes in steady state",
          SHAPES, ["mha-32k", "gqa-32k", "mla-32k"], [4, 8])  # fmt: skip
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not needs_cuda():
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
