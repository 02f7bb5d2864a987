"""``bench_pcp key-major``: MLA's training backward by key chunks against the query-major blocks."""

from __future__ import annotations

import functools

import torch
from triton.testing import do_bench

from benchmarks.pcp.common import (
    SHAPES,
    max_err,
    median,
    rank_fns,
    reference,
    shape_inputs,
)
from cp_modules.kernels.prefill.attention_blocks import (
    attention_block_backward,
    attention_block_forward,
    select_block_backend,
)
from cp_modules.kernels.prefill.pcp_key_major import pcp_key_major_backward
from cp_modules.partition import plan_pcp

# --- key-major: MLA's training backward by key chunks (cp_modules.kernels.prefill.pcp_key_major) ------
# Rank j keeps its own key chunks and takes for each every query at or after it, in one tall
# top-left causal call; the chunks' dK / dV come out complete and the dQ pieces go back to the
# queries' owners by a reduce-scatter, after all-gathering Q, O, dO and the LSE. Checked like the
# suite (the key-major gradients summed over ranks against the fp32 reference, 2x rule), then
# timed against the query-major rank backward (rank_fns), both over dense backward / P.

KEY_MAJOR_ROUNDS = 3


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


def key_major_shape(name, pcps):
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
        for _ in range(KEY_MAJOR_ROUNDS):
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
