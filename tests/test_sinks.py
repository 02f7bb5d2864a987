"""Attention sinks (one learned logit per head): the CP op against the dense masked-softmax
oracle (fp64, output and gradients, the sinks' own included), and every layout on gloo ranks
against one process (prefill, decode with the DCP combine, mixed and training steps)."""

from __future__ import annotations

import pytest
import torch

from cp_modules.ops.cp_attention import gqa_attention
from cp_modules.reference.masked_attention import dense_attention
from cp_modules.step import CPRuntime, build_step_metadata, cp_step, restore_tokens
from cp_modules.testing import run_distributed
from cp_modules.verify import TOLERANCE, VerifyArgs, run_verify, verify_rank

LENS = [13, 1, 6]
H, HKV, D = 4, 2, 8


def _parallel(tp, pcp, dcp, backend="ag_rs"):
    from cp_modules.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                          decode_context_parallel_size=dcp, dcp_comm_backend=backend)  # fmt: skip


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENS)
    q, k, v = (torch.randn(n, h, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV))
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    dout = torch.randn(n, H, D, generator=g, dtype=torch.float64)
    return q, k, v, sinks, dout


def _leaves(*xs):
    return [x.clone().requires_grad_() for x in xs]


def test_sinks_equal_the_dense_oracle():
    q0, k0, v0, s0, dout = _inputs()
    scale = D**-0.5
    # The oracle, request by request.
    q, k, v, s = _leaves(q0, k0, v0, s0)
    outs, start = [], 0
    for n in LENS:
        o, _ = dense_attention(q[start : start + n], k[start : start + n], v[start : start + n],
                               scale=scale, sinks=s)  # fmt: skip
        outs.append(o)
        start += n
    want = torch.cat(outs)
    want_grads = torch.autograd.grad(want, [q, k, v, s], dout)
    # The CP op on one process (DualChunkSwap segments, padding included).
    meta = build_step_metadata(CPRuntime.single(), LENS)
    idx = meta.token_indices
    q, k, v, s = _leaves(q0[idx], k0[idx], v0[idx], s0)
    with cp_step(meta):
        out = gqa_attention(q, k, v, scale=scale, sinks=s)
    got = restore_tokens(out, meta)
    torch.testing.assert_close(got, want, atol=1e-13, rtol=1e-12)
    gl = dout[idx] * meta.plan.local_valid[:, None, None]
    grads = torch.autograd.grad(out, [q, k, v, s], gl)
    for name, g, w in zip("qkv", grads[:3], want_grads[:3]):
        torch.testing.assert_close(restore_tokens(g, meta), w, atol=1e-12, rtol=1e-11, msg=name)
    torch.testing.assert_close(grads[3], want_grads[3], atol=1e-12, rtol=1e-11, msg="sinks")
    # Sinks take probability: the output differs from plain attention.
    with cp_step(meta), torch.no_grad():
        plain = restore_tokens(gqa_attention(q, k, v, scale=scale), meta)
    assert (plain - got).abs().max() > 1e-3


def test_sinks_must_be_one_logit_per_head():
    q, k, v, s, _ = _inputs()
    meta = build_step_metadata(CPRuntime.single(), LENS)
    idx = meta.token_indices
    with cp_step(meta), pytest.raises(ValueError, match=r"one logit per local query head, \[4\]"):
        gqa_attention(q[idx], k[idx], v[idx], scale=1.0, sinks=s[:3])


def test_verify_refuses_sinks_on_mla_before_spawning():
    with pytest.raises(ValueError, match="--sinks applies to --attention gqa only"):
        run_verify(VerifyArgs(parallel=_parallel(1, 2, 1), attention="mla", sinks=True))


def _run_cases(rank, world_size, cases):
    def label(a):
        p = a.parallel
        return f"{p.tp}-{p.pcp}-{p.dcp}-{p.dcp_comm_backend}-{a.mode}"

    return [(label(a), verify_rank(rank, world_size, a)["errors"]) for a in cases]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, layouts",
    [
        (2, [(1, 2, 2, "ag_rs"), (2, 1, 2, "a2a")]),
        (4, [(2, 2, 2, "a2a"), (1, 4, 4, "ag_rs"), (2, 2, 4, "a2a")]),
    ],
    ids=["world2", "world4"],
)
def test_sinks_on_every_path_equal_one_process(world_size, layouts):
    cases = [
        VerifyArgs(parallel=_parallel(tp, pcp, dcp, backend),
                   mode=mode, seq_lens=[19, 3, 8], decode_steps=2, block_size=4, sinks=True)
        for tp, pcp, dcp, backend in layouts
        for mode in ("mixed", "train")
    ]  # fmt: skip
    results = run_distributed(_run_cases, world_size, cases, timeout_s=900)
    for per_rank in results:
        for name, errors in per_rank:
            assert errors, name
            assert max(errors.values()) <= TOLERANCE["float32"], (name, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[300, 1, 77], [2048]], ids=["ragged", "one-2k"])
def test_gpu_sinks_follow_the_two_x_rule(lens):
    # bf16 on CUDA (cuDNN / FlashAttention blocks, sinks applied after the merge, the backward
    # fed the sink-normalised output and LSE) against the fp64 oracle: error at most twice the
    # same-dtype dense reference's, output and every gradient.
    torch.manual_seed(0)
    h, hkv, d = 8, 2, 64
    n = sum(lens)
    q, k, v = (torch.randn(n, x, d, dtype=torch.float64) for x in (h, hkv, hkv))
    s, dout = torch.randn(h, dtype=torch.float64), torch.randn(n, h, d, dtype=torch.float64)
    scale = d**-0.5

    def dense(qq, kk, vv, ss):
        outs, a = [], 0
        for m in lens:
            outs.append(
                dense_attention(qq[a : a + m], kk[a : a + m], vv[a : a + m], scale=scale, sinks=ss)[
                    0
                ]
            )
            a += m
        return torch.cat(outs)

    def grads(fn, dtype, device):
        xs = [t.to(device, dtype).requires_grad_() for t in (q, k, v, s)]
        out = fn(*xs)
        g = torch.autograd.grad(out, xs, dout.to(device, out.dtype))
        return [t.double().cpu() for t in (out, *g)]

    want = grads(dense, torch.float64, "cpu")
    same = grads(dense, torch.bfloat16, "cuda")
    meta = build_step_metadata(CPRuntime.single(), lens, device="cuda")
    idx, valid = meta.token_indices, meta.plan.local_valid

    def cp(qq, kk, vv, ss):
        with cp_step(meta):
            out = gqa_attention(qq[idx].contiguous(), kk[idx].contiguous(), vv[idx].contiguous(),
                                scale=scale, sinks=ss)  # fmt: skip
        return restore_tokens(out * valid[:, None, None], meta)

    got = grads(cp, torch.bfloat16, "cuda")
    for name, g, sm, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, same, want):
        err, bound = (g - w).abs().max(), 2 * (sm - w).abs().max() + 1e-3 * w.abs().max()
        assert err <= bound, (name, float(err), float(bound))
