"""Sliding windows and soft-capping in the PCP head/tail reference against the dense
masked-softmax oracle (fp64): every rank's rows of the output, the LSE, and the gradients
summed over the ranks, for windows smaller than a chunk, spanning chunks and longer than the
sequence, with and without a cached prefix."""

from __future__ import annotations

import pytest
import torch

from cp_modules.partition import plan_pcp
from cp_modules.reference.masked_attention import dense_attention
from cp_modules.reference.pcp_attention import (
    pcp_prefill_attention_backward_reference,
    pcp_prefill_attention_reference,
)

H, HKV, D = 4, 2, 8
NEW, CACHED = [23, 4, 9], [0, 5, 0]


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    total = [n + c for n, c in zip(NEW, CACHED)]
    mk = lambda h: [torch.randn(t, h, D, generator=g, dtype=torch.float64) for t in total]  # noqa: E731
    return mk(H), mk(HKV), mk(HKV), mk(H)  # q, k, v, dout per request (prefix first)


@pytest.mark.parametrize("pcp", [1, 2, 3])
@pytest.mark.parametrize("window, softcap", [(3, None), (7, None), (64, None), (None, 2.0), (5, 1.5)])
def test_windowed_softcapped_pcp_reference_equals_dense(pcp, window, softcap):
    qs, ks, vs, dos = _tensors()
    scale = D**-0.5
    # The oracle per request over its whole sequence (prefix + new); rows of the new tokens.
    leaves = [[t.clone().requires_grad_() for t in xs] for xs in (qs, ks, vs)]
    want_out, want_lse, grads = [], [], []
    for r, c in enumerate(CACHED):
        q, k, v = (x[r] for x in leaves)
        o, lse = dense_attention(q, k, v, scale=scale, sliding_window=window, softcap=softcap)
        want_out.append(o[c:])
        want_lse.append(lse[c:])
        # Only the new tokens' queries are attended here; their gradient reaches the prefix too.
        grads.append(torch.autograd.grad(o[c:], (q, k, v), dos[r][c:]))
    new = lambda xs: torch.cat([x[c:] for x, c in zip(xs, CACHED)])  # noqa: E731
    pre = lambda xs: torch.cat([x[:c] for x, c in zip(xs, CACHED)])  # noqa: E731
    k_new, v_new, k_pre, v_pre = new(ks), new(vs), pre(ks), pre(vs)
    prefix_cu = torch.tensor([0, *torch.tensor(CACHED).cumsum(0).tolist()])
    q_all, do_all = new(qs), new(dos)
    dk = torch.zeros_like(k_new)
    dv = torch.zeros_like(v_new)
    dpk, dpv = torch.zeros_like(k_pre), torch.zeros_like(v_pre)
    dq = torch.zeros_like(q_all)
    for rank in range(pcp):
        plan = plan_pcp(NEW, CACHED, pcp, rank, decode_threshold=0)
        idx, valid = plan.token_indices, plan.local_valid
        args = (q_all[idx], k_new, v_new, plan.segments_host, k_pre, v_pre, prefix_cu, scale)
        out, lse = pcp_prefill_attention_reference(*args, window=window, softcap=softcap)
        torch.testing.assert_close(out[valid], torch.cat(want_out)[idx][valid], atol=1e-13, rtol=1e-12)
        torch.testing.assert_close(lse[valid], torch.cat(want_lse)[idx][valid], atol=1e-13, rtol=1e-12)
        gl = do_all[idx] * valid[:, None, None]
        gq, gk, gv, gpk, gpv = pcp_prefill_attention_backward_reference(
            gl, args[0], k_new, v_new, out, lse, *args[3:], window=window, softcap=softcap
        )
        dq.index_add_(0, idx[valid], gq[valid])
        dk += gk
        dv += gv
        dpk += gpk
        dpv += gpv
    wq = torch.cat([g[0][c:] for g, c in zip(grads, CACHED)])
    torch.testing.assert_close(dq, wq, atol=1e-12, rtol=1e-11)
    torch.testing.assert_close(dk, torch.cat([g[1][c:] for g, c in zip(grads, CACHED)]), atol=1e-12, rtol=1e-11)
    torch.testing.assert_close(dv, torch.cat([g[2][c:] for g, c in zip(grads, CACHED)]), atol=1e-12, rtol=1e-11)
    torch.testing.assert_close(dpk, torch.cat([g[1][:c] for g, c in zip(grads, CACHED)]), atol=1e-12, rtol=1e-11)
    torch.testing.assert_close(dpv, torch.cat([g[2][:c] for g, c in zip(grads, CACHED)]), atol=1e-12, rtol=1e-11)
