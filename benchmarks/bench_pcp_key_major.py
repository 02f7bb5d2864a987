"""PCP training backward by key chunks ("key-major") against the query-major one, on one GPU.

The block backward of ``cp::pcp_prefill_attention`` is query-major: rank j's two query chunks (j
and 2P-1-j, c = S / 2P rows each) against the gathered keys, in blocks of at most c query rows,
the K/V gradients then reduce-scattered to their owners. cuDNN's backward is slow on such blocks
at MLA's head dims (Dqk 192 / Dv 128: ~300 TFLOP/s unmasked, against ~480 for a long causal
call; see 2026-11-30-pcp-block-variants.md).

The key-major backward (:mod:`cp_modules.kernels.pcp_key_major`, used by MLA's training path)
keeps rank j's own key chunks and takes for each every query at or after it, in one tall
top-left causal call: (2P-j)·c query rows for chunk j, (j+1)·c for chunk 2P-1-j. The chunks'
dK / dV are then complete; the dQ pieces, summed into [S, ...] rows, go back to the queries'
owners by a reduce-scatter. The price is communication: the backward all-gathers Q, O, dO and
the LSE, where the query-major path reduce-scatters dK / dV. This script reports the bytes per
token both designs move.

Per shape and P, every rank is run on the one GPU:
- Correctness: the key-major gradients, summed over ranks, against the fp32 reference (the
  rule of ``bench_pcp.py``: error <= 2 x base + 1e-5).
- Speed: key-major rank time, and the current path's rank time (``bench_pcp.rank_fns``), each
  over (cuDNN dense causal backward / P). Dense and rank timings alternate over ``ROUNDS``
  rounds, medians kept.

    python benchmarks/bench_pcp_key_major.py [--shapes mla-32k mha-32k] [--pcp 2 4 8]

Writes ``benchmarks/results/pcp-key-major-<date>.json`` (under ``--out`` if given).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import torch
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_pcp import SHAPES, max_err, median, rank_fns, reference, shape_inputs  # noqa: E402
from results_file import write_results  # noqa: E402

from cp_modules.kernels.pcp_attention import (  # noqa: E402
    attention_block_backward,
    attention_block_forward,
    select_block_backend,
)
from cp_modules.kernels.pcp_key_major import pcp_key_major_backward  # noqa: E402
from cp_modules.partition import plan_pcp  # noqa: E402

ROUNDS = 3


def key_major_fn(dout, q, out, lse, k, v, P, rank, scale):
    """Rank ``rank``'s key-major backward of one sequence (its own K / V rows gathered first,
    outside what is timed)."""
    plan = plan_pcp([q.shape[0]], [0], P, rank, device=q.device)
    k_own, v_own = k[plan.token_indices], v[plan.token_indices]
    return functools.partial(
        pcp_key_major_backward, dout, q, out, lse, k_own, v_own, plan.segments_host, scale
    ), plan


def key_major_all_ranks(dout, q, k, v, out, lse, P, scale):
    """Every rank's key-major gradients combined: (dq summed over ranks in fp32, dk, dv)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for r in range(P):
        fn, plan = key_major_fn(dout, q, out, lse, k, v, P, r, scale)
        gq, gk, gv = fn()
        valid = plan.local_valid
        dq += gq.float()
        dk[plan.token_indices[valid]] = gk[valid]
        dv[plan.token_indices[valid]] = gv[valid]
    return dq, dk, dv


def bytes_per_token(hq, hkv, dqk, dv) -> dict[str, int]:
    """Bytes a token moves over the PCP group in one backward (bf16; LSE fp32), per design."""
    return {
        "query_major": 2 * hkv * (dqk + dv),  # dK / dV reduce-scattered
        "key_major": 2 * hq * (dqk + 2 * dv) + 4 * hq + 2 * hq * dqk,  # Q, O, dO, LSE; dQ
    }


def bench_shape(name, pcps):
    S, hq, hkv, dqk, dv = SHAPES[name]
    q, k, v, dout, scale = shape_inputs(name)
    backend = select_block_backend(q, k, v, True)
    res = {"S": S, "Hq": hq, "Hkv": hkv, "Dqk": dqk, "Dv": dv, "backend": backend}
    res["bytes_per_token"] = bytes_per_token(hq, hkv, dqk, dv)
    out, lse = attention_block_forward(q, k, v, scale=scale, causal=True, backend=backend)
    dense = attention_block_backward(
        dout, q, k, v, out, lse, scale=scale, causal=True, backend=backend
    )
    (_, _, *ref_grads), low = reference(q, k, v, dout, scale)
    base = [
        max(max_err(a, r), max_err(b, r)) for a, b, r in zip(dense, low[1:], ref_grads)
    ]  # the larger error of the dense kernel and of plain PyTorch in bf16
    del low
    res["pcp"], ok = {}, True
    for P in pcps:
        got = key_major_all_ranks(dout, q, k, v, out, lse, P, scale)
        errs = [max_err(a, r) for a, r in zip(got, ref_grads)]
        passed = all(e <= 2 * b + 1e-5 for e, b in zip(errs, base))
        res["pcp"][P] = {"correct": passed, "err_dq_dk_dv": errs, "base_dq_dk_dv": base}
        print(f"[{name}] P={P} key-major errors {errs} (base {base}): "
              f"{'ok' if passed else 'WRONG'}", flush=True)  # fmt: skip
        ok &= passed
    del ref_grads
    torch.cuda.empty_cache()
    if not ok:
        return res, False

    def dense_bwd():
        return attention_block_backward(
            dout, q, k, v, out, lse, scale=scale, causal=True, backend=backend
        )

    for P in pcps:
        key_fns = [key_major_fn(dout, q, out, lse, k, v, P, r, scale)[0] for r in range(P)]
        query_fns = [
            rank_fns(plan_pcp([S], [0], P, r, device="cuda"), q, k, v, dout, scale)[1]
            for r in range(P)
        ]
        runs = {"dense": [], "key": [[] for _ in range(P)], "query": [[] for _ in range(P)]}
        for _ in range(ROUNDS):
            runs["dense"].append(do_bench(dense_bwd, return_mode="median"))
            for r in range(P):
                runs["key"][r].append(do_bench(key_fns[r], return_mode="median"))
                runs["query"][r].append(do_bench(query_fns[r], return_mode="median"))
        ideal = median(runs["dense"]) / P
        entry = res["pcp"][P]
        entry["dense_bwd_ms"] = median(runs["dense"])
        for path in ("key", "query"):
            t = [median(x) for x in runs[path]]
            entry[f"{path}_major_ms"] = t
            entry[f"{path}_major_worst"] = max(t) / ideal
            entry[f"{path}_major_mean"] = sum(t) / P / ideal
        print(
            f"[{name}] P={P} backward worst/mean: key-major {entry['key_major_worst']:.3f}/"
            f"{entry['key_major_mean']:.3f}  query-major {entry['query_major_worst']:.3f}/"
            f"{entry['query_major_mean']:.3f}  (dense {entry['dense_bwd_ms']:.2f} ms)",
            flush=True,
        )
        del key_fns, query_fns
    return res, True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["mla-32k", "mha-32k", "gqa-32k"],
                        choices=list(SHAPES))  # fmt: skip
    parser.add_argument("--pcp", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    metrics, all_ok = {}, True
    for name in args.shapes:
        metrics[name], ok = bench_shape(name, args.pcp)
        all_ok &= ok
        torch.cuda.empty_cache()
    path = write_results("pcp-key-major", metrics, args.out)
    print(f"wrote {path}; {'all correct' if all_ok else 'SOME RESULTS ARE WRONG'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
