"""The PCP benchmark's calls on CPU: every rank's forward and backward through the forced block
path (what the suite times) and the varlen path (what the varlen study times against it), with
the arguments the benchmark passes, against dense causal attention."""

import torch

from benchmarks import bench_pcp as bench
from cp_modules.partition import plan_pcp
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    attention_with_lse,
    attention_with_lse_backward,
)
from cp_modules.testing.numerics import max_abs_err


def test_rank_calls_on_both_paths_equal_dense():
    S, P, scale = 2 * 2 * 4 + 3, 2, 0.3  # padded chunks
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(S, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(S, 2, 6, generator=g, dtype=torch.float64)
    dout = torch.randn(S, 4, 6, generator=g, dtype=torch.float64)
    out, lse = attention_with_lse(q, k, v, scale=scale, causal=True)
    want = attention_with_lse_backward(dout, q, k, v, out, lse, scale=scale, causal=True)
    assert bench.BLOCKS["policy"].pcp_varlen == "never"
    assert {p: x.pcp_varlen for p, x in bench.NEW_SHAPE_PATHS.items()} == {
        "varlen": "always", "auto": "auto", "blocks": "never",
    }  # fmt: skip
    for policy in (bench.NEVER_VARLEN, bench.ALWAYS_VARLEN):
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for r in range(P):
            plan = plan_pcp([S], [0], P, r, device="cpu")
            ql, dl = q[plan.token_indices], dout[plan.token_indices]
            inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, scale)
            o, s = bench.pcp_prefill_attention_cuda(inputs, policy=policy)
            rows, valid = plan.token_indices[plan.local_valid], plan.local_valid
            assert max_abs_err(o[valid], out[rows]) < 1e-12
            assert max_abs_err(s[valid], lse[rows]) < 1e-12
            gq, gk, gv, gpk, gpv = bench.pcp_prefill_attention_backward_cuda(
                dl, o, s, inputs, policy=policy
            )
            assert gpk is None and gpv is None
            dq.index_add_(0, rows, gq[valid])
            dk += gk
            dv += gv
        for a, b in zip((dq, dk, dv), want):
            assert max_abs_err(a, b) < 1e-12
    # The suite's rank callables run the block path with the same arguments.
    plan = plan_pcp([S], [0], P, 1, device="cpu")
    fwd, bwd, both = bench.rank_fns(plan, q, k, v, dout, scale)
    o = fwd()[0]
    rows, valid = plan.token_indices[plan.local_valid], plan.local_valid
    assert max_abs_err(o[valid], out[rows]) < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(bwd()[:3], both()[:3]))
