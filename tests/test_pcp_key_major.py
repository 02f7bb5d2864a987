"""Key-major PCP backward (``cp_modules.kernels.prefill.pcp_key_major``) against dense causal attention.

Every rank's own key chunks against the queries at or after them, on ragged batches: summed
over ranks the queries' gradients, and gathered from their owners the keys' gradients, equal
the dense backward of each request.
"""

from types import SimpleNamespace

import pytest
import torch

from cp_modules.kernels.prefill.pcp_key_major import (
    pcp_key_major_backward,
    request_ends,
    tall_causal_backward,
)
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import attention_with_lse, attention_with_lse_backward
from cp_modules.testing.numerics import max_abs_err

DIMS = {"GQA": (4, 2, 8, 8), "MLA": (3, 3, 12, 8)}


def _batch(lens, dims, dtype=torch.float64, device="cpu", seed=0):
    hq, hkv, dqk, dv = dims
    n = sum(lens)
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(n, hq, dqk, generator=g, dtype=dtype, device=device)
    k = torch.randn(n, hkv, dqk, generator=g, dtype=dtype, device=device)
    v = torch.randn(n, hkv, dv, generator=g, dtype=dtype, device=device)
    dout = torch.randn(n, hq, dv, generator=g, dtype=dtype, device=device)
    return q, k, v, dout


def _dense(q, k, v, dout, lens, scale):
    """Per-request causal attention: out, lse and (dq, dk, dv), in fp32 / fp64."""
    outs, lses, grads, a = [], [], [], 0
    for n in lens:
        r = slice(a, a + n)
        o, s = attention_with_lse(q[r], k[r], v[r], scale=scale, causal=True)
        outs.append(o), lses.append(s)
        grads.append(
            attention_with_lse_backward(dout[r], q[r], k[r], v[r], o, s, scale=scale, causal=True)
        )
        a += n
    return torch.cat(outs), torch.cat(lses), [torch.cat(g) for g in zip(*grads)]


def _all_ranks(dout, q, k, v, out, lse, lens, pcp, scale, backend=None):
    """Every rank's key-major gradients, combined: dq summed, dk / dv from their owners."""
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for r in range(pcp):
        plan = plan_pcp(lens, [0] * len(lens), pcp, r, device=q.device)
        tok, valid = plan.token_indices, plan.local_valid
        gq, gk, gv = pcp_key_major_backward(
            dout, q, out.to(q.dtype), lse, k[tok], v[tok], plan.segments_host, scale,
            backend=backend,
        )  # fmt: skip
        assert gq.shape == q.shape and gk.shape == (tok.shape[0], *k.shape[1:])
        assert torch.all(gk[~valid] == 0) and torch.all(gv[~valid] == 0)  # padding rows
        mine = tok[valid]
        assert torch.all(dk[mine].isnan())  # each key on exactly one rank
        dq += gq.double()
        dk[mine], dv[mine] = gk[valid], gv[valid]
    return dq, dk, dv


@pytest.mark.parametrize("dims", list(DIMS.values()), ids=list(DIMS))
@pytest.mark.parametrize(
    "pcp, lens",
    [
        (1, [9, 4]),
        (2, [21, 3, 9]),
        (2, [16, 8]),
        (3, [30, 7, 1]),
        (4, [37, 2, 11, 16]),
        (8, [40, 5]),
    ],
    ids=lambda x: str(x),
)
def test_ranks_equal_dense_backward(pcp, lens, dims):
    q, k, v, dout = _batch(lens, dims, seed=pcp)
    out, lse, want = _dense(q, k, v, dout, lens, 0.3)
    got = _all_ranks(dout, q, k, v, out, lse, lens, pcp, 0.3)
    for a, b in zip(got, want):
        assert not a.isnan().any()  # every real key row is some rank's
        assert max_abs_err(a, b) < 1e-12


def test_tall_causal_backward_is_top_left():
    # 7 queries from the position of the first of 3 keys: query i sees keys 0..min(i, 2).
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for n in (7, 3, 3))
    dout = torch.randn(7, 2, 4, generator=g, dtype=torch.float64)
    mask = torch.arange(3)[None, :] <= torch.arange(7)[:, None]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    s = torch.einsum("lhd,mhd->hlm", leaves[0], leaves[1]) * 0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    ref_out = torch.einsum("hlm,mhd->lhd", p, leaves[2])
    want = torch.autograd.grad(ref_out, leaves, dout)
    lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1).T.detach()
    pieces, dk, dv = tall_causal_backward(dout, q, k, v, ref_out.detach(), lse, scale=0.5)
    assert [(a, x.shape[0]) for a, x in pieces] == [(0, 3), (3, 4)]
    dq = torch.cat([x for _, x in pieces])
    for a, b in zip((dq, dk, dv), want):
        assert max_abs_err(a, b) < 1e-12


def test_tall_causal_backward_rejects_more_keys_than_queries():
    q, k = torch.zeros(2, 1, 4), torch.zeros(3, 1, 4)
    with pytest.raises(ValueError, match="at least as many queries as keys, got 2 < 3"):
        tall_causal_backward(q, q, k, k, q, torch.zeros(2, 1), scale=1.0)


def test_request_ends():
    plan = plan_pcp([5, 1, 7, 3], [0, 0, 0, 0], 2, 1)
    assert request_ends(plan.segments_host, 16) == [5, 6, 13, 16]


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(32, 32, 192, 128), (8, 2, 128, 128)], ids=["MLA", "GQA"])
@pytest.mark.parametrize("pcp", [2, 4])
def test_gpu_kernels_equal_reference(pcp, dims):
    # cuDNN's tall causal calls (bf16) against the fp32 reference: within twice the error of the
    # dense bf16 backward of the same kernels, plus 1e-5.
    from cp_modules.kernels.prefill.attention_blocks import (
        attention_block_backward,
        attention_block_forward,
    )

    lens = [1500, 37, 700]
    q, k, v, dout = _batch(lens, dims, dtype=torch.bfloat16, device="cuda")
    scale = dims[2] ** -0.5
    out32, lse, want = _dense(*(x.float() for x in (q, k, v, dout)), lens, scale)
    got = _all_ranks(dout, q, k, v, out32, lse, lens, pcp, scale)
    base, a = [0.0, 0.0, 0.0], 0
    for n in lens:  # the dense bf16 kernels' own error
        r = slice(a, a + n)
        o, s = attention_block_forward(q[r], k[r], v[r], scale=scale, causal=True)
        g = attention_block_backward(dout[r], q[r], k[r], v[r], o, s, scale=scale, causal=True)
        base = [max(b, max_abs_err(x, w[r])) for b, x, w in zip(base, g, want)]
        a += n
    for x, w, b in zip(got, want, base):
        assert not x.isnan().any()
        assert max_abs_err(x, w) <= 2 * b + 1e-5, (max_abs_err(x, w), b)


# ------------------------------------------------------------ MLA's choice of backward path


KEY_MAJOR_MIN_ROWS = CPPolicy().key_major_min_rows


def _meta(pcp, lens, rank=0, policy=None):
    plan = plan_pcp(lens, [0] * len(lens), pcp, rank)
    runtime = SimpleNamespace(pcp_size=pcp, policy=policy or CPPolicy())
    return SimpleNamespace(runtime=runtime, plan=plan)


def test_mla_backward_path_choice():
    from cp_modules.ops.mla_attention import mla_backward_path

    q, out = torch.zeros(4, 2, 12), torch.zeros(4, 2, 8)
    # auto: query-major off CUDA, whatever the chunk lengths.
    assert mla_backward_path(_meta(4, [8 * KEY_MAJOR_MIN_ROWS] * 2), q, out) == "query_major"
    for forced in ("key_major", "query_major"):
        meta = _meta(1, [3], policy=CPPolicy(mla_backward=forced))
        assert mla_backward_path(meta, q, out) == forced
    with pytest.raises(ValueError, match=r"mla_backward must be one of \['auto', 'key_major'"):
        CPPolicy(mla_backward="keymajor")


@pytest.mark.gpu
def test_gpu_mla_backward_path_auto():
    from cp_modules.ops.mla_attention import mla_backward_path

    q = torch.zeros(8, 4, 192, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(8, 4, 128, device="cuda", dtype=torch.bfloat16)
    long = [4 * KEY_MAJOR_MIN_ROWS, 4 * KEY_MAJOR_MIN_ROWS + 8]
    short = [4 * KEY_MAJOR_MIN_ROWS, 3 * KEY_MAJOR_MIN_ROWS]
    for rank in (0, 1):
        assert mla_backward_path(_meta(2, long, rank), q, out) == "key_major"
        assert mla_backward_path(_meta(2, short, rank), q, out) == "query_major"
    assert mla_backward_path(_meta(1, long), q, out) == "query_major"


def test_long_chunks_is_the_same_on_every_rank():
    # The ranks' own rows differ (here rank 0's tail chunk is short: 2048 and 1948 real rows,
    # rank 1's 2048 and 2048), but the two paths' collectives differ, so the choice must not.
    from cp_modules.ops.mla_attention import _long_chunks

    for n, want in ((4 * KEY_MAJOR_MIN_ROWS - 100, False), (4 * KEY_MAJOR_MIN_ROWS, True)):
        plans = [plan_pcp([n], [0], 2, r) for r in (0, 1)]
        assert [_long_chunks(p, KEY_MAJOR_MIN_ROWS) for p in plans] == [want, want]


def test_mla_layer_gradients_equal_on_both_paths():
    # One process (P = 1): the key-major backward of a whole MLA layer equals the query-major one.
    from cp_modules.modules import CPMLAAttention, CPRuntime, build_step_metadata, cp_step

    torch.manual_seed(0)
    m = CPMLAAttention(64, 4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
    x = torch.randn(23, 64)
    gy = None
    grads = {}
    for path in ("query_major", "key_major"):
        runtime = CPRuntime.single(policy=CPPolicy(mla_backward=path))
        meta = build_step_metadata(runtime, [12, 3, 8])
        if gy is None:
            gy = torch.randn(meta.token_indices.shape[0], 64)
        xl = x[meta.token_indices].clone().requires_grad_()
        with cp_step(meta):
            y = m(xl, meta.positions)
        leaves = [xl, *m.parameters()]
        grads[path] = torch.autograd.grad(y, leaves, gy)
    for a, b in zip(grads["key_major"], grads["query_major"]):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_dq_into_targets_equals_fresh_dq():
    # dQ written straight into views of another buffer (as into the reduce-scatter layout).
    lens, pcp = [21, 3, 9], 2
    q, k, v, dout = _batch(lens, DIMS["MLA"])
    out, lse, _ = _dense(q, k, v, dout, lens, 0.3)
    plan = plan_pcp(lens, [0] * len(lens), pcp, 1)
    args = (dout, q, out, lse, k[plan.token_indices], v[plan.token_indices], plan.segments_host)
    dq, dk, dv = pcp_key_major_backward(*args, 0.3)
    buf = torch.full((40, *q.shape[1:]), float("nan"), dtype=q.dtype)
    targets = [(0, buf[30:40]), (10, buf[0:20]), (30, buf[20:23])]  # rows 0-9, 10-29, 30-32
    for into in (targets, lambda: targets):  # the targets, or a function returning them
        buf[:] = float("nan")
        none, dk2, dv2 = pcp_key_major_backward(*args, 0.3, dq_into=into)
        assert none is None and torch.equal(dk2, dk) and torch.equal(dv2, dv)
        assert torch.equal(torch.cat([buf[30:40], buf[0:20], buf[20:23]]), dq)
        assert buf[23:30].isnan().all()  # nothing outside the targets is written


def test_compiled_mla_training_on_the_key_major_path(monkeypatch):
    # fullgraph compile of an MLA layer; its backward op runs key-major (opaque to the graph).
    import cp_modules.ops.mla_attention as ops
    from cp_modules.modules import CPMLAAttention, CPRuntime, build_step_metadata, cp_step

    calls, inner = [], ops.pcp_key_major_backward
    monkeypatch.setattr(
        ops, "pcp_key_major_backward", lambda *a, **k: calls.append(1) or inner(*a, **k)
    )
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = CPMLAAttention(64, 4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
    compiled = torch.compile(m, fullgraph=True, dynamic=True)
    runtime = CPRuntime.single(policy=CPPolicy(mla_backward="key_major"))
    meta = build_step_metadata(runtime, [15, 8])
    x = torch.randn(meta.num_local_tokens, 64)
    grads = []
    for fn in (m, compiled):
        xl = x.clone().requires_grad_()
        with cp_step(meta):
            y = fn(xl, meta.positions)
        grads.append(torch.autograd.grad(y.square().sum(), [xl, *m.parameters()]))
    assert len(calls) == 2  # the eager and the compiled backward
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
