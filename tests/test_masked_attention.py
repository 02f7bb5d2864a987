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
    PrefillInputs,
    pcp_prefill_attention_backward_reference,
    pcp_prefill_attention_reference,
)
from cp_modules.testing import run_distributed

H, HKV, D = 4, 2, 8
NEW, CACHED = [23, 4, 9], [0, 5, 0]


def _parallel(tp, pcp, dcp, backend="ag_rs"):
    from cp_modules.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                          decode_context_parallel_size=dcp, dcp_comm_backend=backend)  # fmt: skip


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    total = [n + c for n, c in zip(NEW, CACHED)]
    mk = lambda h: [torch.randn(t, h, D, generator=g, dtype=torch.float64) for t in total]  # noqa: E731
    return mk(H), mk(HKV), mk(HKV), mk(H)  # q, k, v, dout per request (prefix first)


@pytest.mark.parametrize("pcp", [1, 2, 3])
@pytest.mark.parametrize(
    "window, softcap", [(3, None), (7, None), (64, None), (None, 2.0), (5, 1.5)]
)
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
        inputs = PrefillInputs(
            q_all[idx], k_new, v_new, plan.segments_host, k_pre, v_pre, prefix_cu, scale
        )
        out, lse = pcp_prefill_attention_reference(inputs, window=window, softcap=softcap)
        torch.testing.assert_close(
            out[valid], torch.cat(want_out)[idx][valid], atol=1e-13, rtol=1e-12
        )
        torch.testing.assert_close(
            lse[valid], torch.cat(want_lse)[idx][valid], atol=1e-13, rtol=1e-12
        )
        gl = do_all[idx] * valid[:, None, None]
        gq, gk, gv, gpk, gpv = pcp_prefill_attention_backward_reference(
            gl, out, lse, inputs, window=window, softcap=softcap
        )
        dq.index_add_(0, idx[valid], gq[valid])
        dk += gk
        dv += gv
        dpk += gpk
        dpv += gpv
    wq = torch.cat([g[0][c:] for g, c in zip(grads, CACHED)])
    torch.testing.assert_close(dq, wq, atol=1e-12, rtol=1e-11)
    torch.testing.assert_close(
        dk, torch.cat([g[1][c:] for g, c in zip(grads, CACHED)]), atol=1e-12, rtol=1e-11
    )
    torch.testing.assert_close(
        dv, torch.cat([g[2][c:] for g, c in zip(grads, CACHED)]), atol=1e-12, rtol=1e-11
    )
    torch.testing.assert_close(
        dpk, torch.cat([g[1][:c] for g, c in zip(grads, CACHED)]), atol=1e-12, rtol=1e-11
    )
    torch.testing.assert_close(
        dpv, torch.cat([g[2][:c] for g, c in zip(grads, CACHED)]), atol=1e-12, rtol=1e-11
    )


def _cached_schedule():
    # (new tokens, cached tokens) per step: a prefill, decodes, then a chunked-prefill
    # continuation beside a decode.
    return [([11, 5], [0, 0]), ([1, 1], [11, 5]), ([1, 1], [12, 6]), ([4, 1], [13, 7])]


@pytest.mark.parametrize(
    "window, softcap, sinks",
    [(3, None, False), (6, 1.5, True), (None, 2.0, False), (40, None, True)],
)
def test_op_with_a_paged_cache_equals_dense(window, softcap, sinks):
    # cp::gqa_attention_with_cache on one process: prefill, decode and chunked prefill over the
    # paged cache, with windows, soft-cap and sinks, against the dense oracle of each sequence.
    from cp_modules.cache.paged import allocate_kv_cache
    from cp_modules.ops.cp_attention import gqa_attention
    from cp_modules.step import CPRuntime, build_step_metadata, cp_step

    steps = _cached_schedule()
    lengths = [sum(n[r] for n, _ in steps) for r in range(2)]
    g = torch.Generator().manual_seed(1)
    seqs = [[torch.randn(n, h, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV)]
            for n in lengths]  # fmt: skip
    s = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None
    scale = D**-0.5
    want = [dense_attention(q, k, v, scale=scale, sliding_window=window, softcap=softcap, sinks=s)[0]
            for q, k, v in seqs]  # fmt: skip
    block_size = 4
    table = torch.arange(1, 1 + 2 * 8, dtype=torch.int32).view(2, 8)
    # fp32: the paged decode op serves fp16/bf16/fp32 (the oracle stays fp64).
    kc, vc = allocate_kv_cache(1 + 2 * 8, block_size, HKV, D, dtype=torch.float32)
    s32 = None if s is None else s.float()
    rt = CPRuntime.single()
    for new, done in steps:
        meta = build_step_metadata(rt, new, done, block_table=table, block_size=block_size)
        rows = [torch.arange(c, c + n) for n, c in zip(new, done)]
        q, k, v = (torch.cat([seqs[r][i][rows[r]] for r in range(2)])[meta.token_indices].float()
                   for i in range(3))  # fmt: skip
        with cp_step(meta), torch.no_grad():
            out = gqa_attention(q, k, v, (kc, vc), scale=scale, sinks=s32, sliding_window=window,
                                softcap=softcap)  # fmt: skip
        valid = meta.plan.local_valid
        expect = torch.cat([want[r][rows[r]] for r in range(2)])[meta.token_indices]
        torch.testing.assert_close(out[valid].double(), expect[valid], atol=2e-6, rtol=1e-5)


def test_windows_and_softcap_are_validated():
    from cp_modules.modules import CPFlashAttention
    from cp_modules.verify import VerifyArgs, run_verify

    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        CPFlashAttention(32, 4, 2, sliding_window=0)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        CPFlashAttention(32, 4, 2, softcap=0.0)
    for bad, match in (
        (dict(sliding_window=0), "--sliding-window must be >= 1"),
        (dict(softcap=-1.0), "--softcap must be > 0"),
        (dict(attention="mla", sliding_window=4), "apply to --attention gqa only"),
    ):
        with pytest.raises(ValueError, match=match):
            run_verify(VerifyArgs(parallel=_parallel(1, 2, 1), **bad))


def _run_cases(rank, world_size, cases):
    from cp_modules.verify import verify_rank

    return [(repr((a.parallel.tp, a.parallel.pcp, a.parallel.dcp, a.parallel.dcp_comm_backend,
                   a.mode, a.sliding_window, a.softcap, a.sinks)),
             verify_rank(rank, world_size, a)["errors"]) for a in cases]  # fmt: skip


# Requests of 19, 3 and 8 tokens: at pcp 2 chunks of 5, 1 and 2 tokens, at pcp 4 of 3, 1, 1.
# Windows smaller than a chunk (2), spanning several chunks (7) and longer than any sequence
# (64), with and without soft-cap and sinks.
_FEATURES = [
    dict(sliding_window=2),
    dict(sliding_window=7, softcap=1.5, sinks=True),
    dict(sliding_window=64, sinks=True),
    dict(softcap=2.0),
]


def _cases(world_size, layouts, modes, features=_FEATURES):
    from cp_modules.verify import VerifyArgs

    return [
        VerifyArgs(parallel=_parallel(tp, pcp, dcp, backend),
                   mode=mode, seq_lens=[19, 3, 8], decode_steps=2, block_size=4, **f)
        for tp, pcp, dcp, backend in layouts
        for mode in modes
        for f in features
    ]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, layouts, modes",
    [
        (2, [(1, 2, 2, "a2a"), (2, 1, 2, "ag_rs")], ("prefill", "decode", "mixed", "train")),
        (4, [(2, 2, 2, "a2a"), (1, 4, 4, "ag_rs"), (2, 2, 4, "a2a")], ("mixed", "train")),
        (8, [(2, 4, 8, "a2a")], ("mixed", "train")),
    ],
    ids=["world2", "world4", "world8"],
)
def test_windows_softcap_and_sinks_on_gloo_ranks_equal_one_process(world_size, layouts, modes):
    from cp_modules.verify import TOLERANCE

    cases = _cases(world_size, layouts, modes)
    results = run_distributed(_run_cases, world_size, cases, timeout_s=1200)
    for per_rank in results:
        assert len(per_rank) == len(cases)
        for name, errors in per_rank:
            assert errors, name
            assert max(errors.values()) <= TOLERANCE["float32"], (name, errors)
