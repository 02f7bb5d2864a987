"""PCP training backward by key chunks ("key-major") against the current one, on one GPU.

The backward of ``cp::pcp_prefill_attention`` is query-major: rank j's two query chunks (j and
2P-1-j, c = S / 2P rows each) against the gathered keys, in blocks of at most c query rows;
the K/V gradients then go back to their owners by a reduce-scatter. cuDNN's backward is slow
on blocks with few query rows at MLA's head dims (Dqk 192 / Dv 128: ~230-300 TFLOP/s at 2k
rows, ~470 on a dense 32k sequence; see 2026-11-30-pcp-block-variants.md).

A key-major backward turns the loop around. Rank j keeps its own key chunks j and 2P-1-j, and
takes for each one every query at or after it. That is one tall call per chunk with a top-left
causal mask, which is the mask cuDNN's entry applies when L > M:
- chunk j: (2P-j)·c query rows against c keys;
- chunk 2P-1-j: (j+1)·c query rows against c keys.

Each chunk's dK / dV are then whole (no sums, no reduce-scatter). The dQ pieces are summed into
an [S, ...] buffer, and a reduce-scatter would take that buffer back to the queries' owners.
The price is communication: the backward all-gathers Q, O, dO and the LSE, where the current
path reduce-scatters dK / dV. This script reports the bytes per token both designs move.

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

from bench_pcp import SHAPES, max_err, median, rank_fns, reference  # noqa: E402
from results_file import write_results  # noqa: E402

from cp_modules.kernels.pcp_attention import (  # noqa: E402
    attention_block_backward,
    attention_block_forward,
    select_block_backend,
    sum_pieces_into,
)
from cp_modules.partition import plan_pcp  # noqa: E402

ROUNDS = 3


def tall_causal_backward(dout, q, k, v, out, lse, *, scale, backend):
    """(dq, dk, dv) of queries q [L, ...] against keys k [M, ...], L >= M, causal with the
    first query and the first key at the same position (top-left), from the merged ``out`` and
    ``lse``. cuDNN's causal mask is top-left for L != M, so it is one call there; elsewhere it
    is the causal square of the first M rows plus the unmasked rows after it."""
    L, M = q.shape[0], k.shape[0]
    assert L >= M
    if backend == "cudnn" or L == M:
        return attention_block_backward(
            dout, q, k, v, out, lse, scale=scale, causal=True, backend=backend
        )
    sq = attention_block_backward(
        dout[:M], q[:M], k, v, out[:M], lse[:M], scale=scale, causal=True, backend=backend
    )
    rest = attention_block_backward(
        dout[M:], q[M:], k, v, out[M:], lse[M:], scale=scale, causal=False, backend=backend
    )
    return torch.cat([sq[0], rest[0]]), sq[1] + rest[1], sq[2] + rest[2]


def key_major_rank(dout, q, k, v, out, lse, P, rank, *, scale, backend):
    """Rank ``rank``'s key-major backward of one sequence of S = 2P·c tokens.

    Returns (dq [S, Hq, Dqk], the reduce-scatter input: this rank's dQ contributions, zero
    before its first key chunk; {first key row: (dk, dv)} of its two chunks)."""
    S = q.shape[0]
    c = S // (2 * P)
    assert c * 2 * P == S
    dq_pieces, dkv = [], {}
    for a in (rank * c, (2 * P - 1 - rank) * c):
        gq, gk, gv = tall_causal_backward(
            dout[a:], q[a:], k[a : a + c], v[a : a + c], out[a:], lse[a:],
            scale=scale, backend=backend,
        )  # fmt: skip
        dq_pieces.append((a, gq))
        dkv[a] = (gk, gv)
    return sum_pieces_into(torch.empty_like(q), dq_pieces), dkv


def key_major_all_ranks(dout, q, k, v, out, lse, P, *, scale, backend):
    """Every rank's key-major gradients combined: (dq summed over ranks in fp32, dk, dv)."""
    dq = torch.zeros(q.shape, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype,
                     device=q.device)  # fmt: skip
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for r in range(P):
        gq, dkv = key_major_rank(dout, q, k, v, out, lse, P, r, scale=scale, backend=backend)
        dq += gq.to(dq.dtype)
        for a, (gk, gv) in dkv.items():
            dk[a : a + gk.shape[0]] = gk
            dv[a : a + gv.shape[0]] = gv
    return dq, dk, dv


def bytes_per_token(hq, hkv, dqk, dv) -> dict[str, int]:
    """Bytes a token moves over the PCP group in one backward (bf16; LSE fp32), per design."""
    return {
        "query_major": 2 * hkv * (dqk + dv),  # dK / dV reduce-scattered
        "key_major": 2 * hq * (dqk + 2 * dv) + 4 * hq + 2 * hq * dqk,  # Q, O, dO, LSE; dQ
    }


def bench_shape(name, pcps):
    S, hq, hkv, dqk, dv = SHAPES[name]
    scale = dqk**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(S, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    )
    dout = torch.randn(S, hq, dv, device="cuda", generator=g, dtype=torch.bfloat16)
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
        got = key_major_all_ranks(dout, q, k, v, out, lse, P, scale=scale, backend=backend)
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
        key_fns = [
            functools.partial(
                key_major_rank, dout, q, k, v, out, lse, P, r, scale=scale, backend=backend
            )
            for r in range(P)
        ]
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
