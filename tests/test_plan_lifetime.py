"""The step plan travels with the autograd graph.

A backward uses the plan its own forward saved, whatever step is scoped when it runs: forward
on batch A, forward on batch B (same token count, another composition), backward of A equals A
alone, and backward of B afterwards equals B alone. Activation checkpointing (reentrant and
not) and gradient accumulation over micro-batches of different compositions give the plain
run's gradients. float64, GQA and MLA (both MLA backward paths), one process and gloo ranks.
"""

from __future__ import annotations

import gc

import pytest
import torch

from cp_modules.config import ParallelConfig
from cp_modules.modules import CPFlashAttention, CPMLAAttention
from cp_modules.policy import CPPolicy
from cp_modules.step import CPRuntime, build_step_metadata, cp_step, restore_tokens
from cp_modules.testing import run_distributed
from cp_modules.training import checkpoint_with_step

HIDDEN = 32
# Two batches of 24 tokens each, composed differently; and a third (micro-batch) split.
BATCH_A = [13, 7, 4]
BATCH_B = [3, 21]
KINDS = ("gqa", "mla-query_major", "mla-key_major")


def _layer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gqa":
        m = CPFlashAttention(HIDDEN, 4, 2)
    else:
        m = CPMLAAttention(HIDDEN, 4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                           qk_rope_head_dim=4, v_head_dim=8)  # fmt: skip
    return m.double()


def _policy(kind: str) -> CPPolicy:
    return CPPolicy(mla_backward=kind.split("-")[1]) if kind.startswith("mla") else CPPolicy()


def _data(lens, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return (torch.randn(n, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(n, HIDDEN, generator=g, dtype=torch.float64))  # fmt: skip


def _forward(layer, runtime, lens, x, w, wrap=None):
    """This rank's loss share of one batch (its real tokens) and the leaf it was computed from."""
    meta = build_step_metadata(runtime, lens)
    xl = x[meta.token_indices].clone().requires_grad_()
    with cp_step(meta):
        y = layer(xl, meta.positions) if wrap is None else wrap(layer, xl, meta.positions)
    loss = (y * (w[meta.token_indices] * meta.plan.local_valid[:, None])).sum()
    return loss, xl, meta


def _grads(layer, xl, meta, group=None):
    """(input grad [N, hidden] in batch order, parameter grads summed over the ranks)."""
    gx = restore_tokens(xl.grad, meta)
    gp = [p.grad.clone() for p in layer.parameters()]
    if group is not None:
        for g in gp:
            torch.distributed.all_reduce(g, group=group)
    return gx, gp


def _reference(kind, lens, seed):
    layer = _layer(kind)
    x, w = _data(lens, seed)
    loss, xl, meta = _forward(layer, CPRuntime.single(policy=_policy(kind)), lens, x, w)
    loss.backward()
    return _grads(layer, xl, meta)


def _assert_equal_grads(got, want, what):
    (gx, gp), (wx, wp) = got, want
    torch.testing.assert_close(gx, wx, atol=1e-10, rtol=1e-9, msg=lambda m: f"{what} input: {m}")
    for i, (a, b) in enumerate(zip(gp, wp)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=f"{what} param {i}")


def _interleaved(kind, runtime, group=None):
    """fwd(A), fwd(B), bwd(A), bwd(B): the gradients of each backward, taken separately."""
    layer = _layer(kind)
    xa, wa = _data(BATCH_A, 1)
    xb, wb = _data(BATCH_B, 2)
    loss_a, xla, meta_a = _forward(layer, runtime, BATCH_A, xa, wa)
    loss_b, xlb, meta_b = _forward(layer, runtime, BATCH_B, xb, wb)
    # Another step is scoped while A's backward runs: it must not be used.
    with cp_step(meta_b):
        loss_a.backward()
    got_a = _grads(layer, xla, meta_a, group)
    layer.zero_grad()
    del meta_a
    gc.collect()
    loss_b.backward()
    got_b = _grads(layer, xlb, meta_b, group)
    return got_a, got_b


def _checkpointed(kind, runtime, reentrant, group=None):
    """The layer under activation checkpointing, backward outside the step."""
    layer = _layer(kind)
    x, w = _data(BATCH_A, 1)

    def wrap(m, xl, pos):
        return checkpoint_with_step(m, xl, pos, use_reentrant=reentrant)

    loss, xl, meta = _forward(layer, runtime, BATCH_A, x, w, wrap=wrap)
    loss.backward()
    return _grads(layer, xl, meta, group)


def _accumulated(kind, runtime, group=None):
    """Gradients accumulated over the micro-batches A and B (different compositions) equal
    those of one batch holding both."""
    layer = _layer(kind)
    xa, wa = _data(BATCH_A, 1)
    xb, wb = _data(BATCH_B, 2)
    for lens, x, w in ((BATCH_A, xa, wa), (BATCH_B, xb, wb)):
        loss, _, _ = _forward(layer, runtime, lens, x, w)
        loss.backward()
    acc = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    loss, _, _ = _forward(
        layer, runtime, BATCH_A + BATCH_B, torch.cat([xa, xb]), torch.cat([wa, wb])
    )
    loss.backward()
    whole = [p.grad.clone() for p in layer.parameters()]
    if group is not None:
        for g in (*acc, *whole):
            torch.distributed.all_reduce(g, group=group)
    return acc, whole


# ------------------------------------------------------------------------- one process


@pytest.mark.parametrize("kind", KINDS)
def test_backward_uses_its_own_forwards_plan(kind):
    got_a, got_b = _interleaved(kind, CPRuntime.single(policy=_policy(kind)))
    _assert_equal_grads(got_a, _reference(kind, BATCH_A, 1), "bwd(A) after fwd(B)")
    _assert_equal_grads(got_b, _reference(kind, BATCH_B, 2), "bwd(B) after bwd(A)")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["gqa", "mla-query_major"])
def test_activation_checkpointing_equals_the_plain_run(kind, reentrant):
    got = _checkpointed(kind, CPRuntime.single(policy=_policy(kind)), reentrant)
    _assert_equal_grads(got, _reference(kind, BATCH_A, 1), "checkpointed")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_plain_torch_checkpoint_with_the_backward_inside_the_step(reentrant):
    # torch.utils.checkpoint itself: its recompute reads the scoped step, so the backward runs
    # inside the step's cp_step.
    layer = _layer("gqa")
    x, w = _data(BATCH_A, 1)
    meta = build_step_metadata(CPRuntime.single(), BATCH_A)
    xl = x[meta.token_indices].clone().requires_grad_()
    with cp_step(meta):
        y = torch.utils.checkpoint.checkpoint(layer, xl, meta.positions, use_reentrant=reentrant)
        (y * (w[meta.token_indices] * meta.plan.local_valid[:, None])).sum().backward()
    _assert_equal_grads(_grads(layer, xl, meta), _reference("gqa", BATCH_A, 1), "torch checkpoint")


def test_plain_checkpoint_recompute_outside_the_step_is_a_clear_error():
    layer = _layer("gqa")
    x, w = _data(BATCH_A, 1)
    loss, _, _ = _forward(
        layer, CPRuntime.single(), BATCH_A, x, w,
        wrap=lambda m, xl, pos: torch.utils.checkpoint.checkpoint(m, xl, pos, use_reentrant=False),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="checkpoint_with_step"):
        loss.backward()


@pytest.mark.parametrize("kind", ["gqa", "mla-key_major"])
def test_gradient_accumulation_over_compositions(kind):
    acc, whole = _accumulated(kind, CPRuntime.single(policy=_policy(kind)))
    for a, b in zip(acc, whole):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_plans_are_released_with_their_graphs():
    from cp_modules.step import _PLANS

    gc.collect()
    before = len(_PLANS)
    layer = _layer("gqa")
    x, w = _data(BATCH_A, 1)
    loss, _, meta = _forward(layer, CPRuntime.single(), BATCH_A, x, w)
    assert len(_PLANS) == before + 1 and meta.serial in _PLANS
    del loss, meta
    gc.collect()
    assert len(_PLANS) == before
    with torch.no_grad():  # inference keeps nothing
        _forward(layer, CPRuntime.single(), BATCH_A, x, w)
    gc.collect()
    assert len(_PLANS) == before


def test_cp_step_is_scoped():
    from cp_modules.step import current_step

    a = build_step_metadata(CPRuntime.single(), BATCH_A)
    b = build_step_metadata(CPRuntime.single(), BATCH_B)
    with cp_step(a):
        with cp_step(b):
            assert current_step() is b
        assert current_step() is a
    with pytest.raises(RuntimeError, match="no context-parallel step is active"):
        current_step()


def test_compiled_interleaved_backward_without_recompiles():
    # fullgraph compile: fwd(A), fwd(B), bwd(A), bwd(B) with the compiled layer equals eager,
    # and the second composition does not recompile.
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    layer = _layer("gqa")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    want_a, want_b = _reference("gqa", BATCH_A, 1), _reference("gqa", BATCH_B, 2)
    for _ in range(2):
        xa, wa = _data(BATCH_A, 1)
        xb, wb = _data(BATCH_B, 2)
        rt = CPRuntime.single()
        loss_a, xla, meta_a = _forward(compiled, rt, BATCH_A, xa, wa)
        loss_b, xlb, meta_b = _forward(compiled, rt, BATCH_B, xb, wb)
        loss_a.backward()
        got_a = _grads(layer, xla, meta_a)
        layer.zero_grad()
        loss_b.backward()
        got_b = _grads(layer, xlb, meta_b)
        layer.zero_grad()
        _assert_equal_grads(got_a, want_a, "compiled bwd(A)")
        _assert_equal_grads(got_b, want_b, "compiled bwd(B)")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


# ------------------------------------------------------------------------- gloo ranks


def _rank_body(rank, world_size):
    from cp_modules.distributed.groups import init_cp_groups

    groups = init_cp_groups(ParallelConfig(prefill_context_parallel_size=world_size))
    group = groups.pcp
    failures = []

    def check(name, fn, *args):
        try:
            fn(*args)
        except AssertionError as e:
            failures.append(f"{name}: {e}")

    def same(acc, whole):
        for a, b in zip(acc, whole):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)

    for kind in KINDS:
        rt = CPRuntime.from_groups(groups, policy=_policy(kind))
        ref_a, ref_b = _reference(kind, BATCH_A, 1), _reference(kind, BATCH_B, 2)
        got_a, got_b = _interleaved(kind, rt, group)
        check(f"{kind} bwd(A)", _assert_equal_grads, got_a, ref_a, "bwd(A)")
        check(f"{kind} bwd(B)", _assert_equal_grads, got_b, ref_b, "bwd(B)")
        for reentrant in (False, True):
            got = _checkpointed(kind, rt, reentrant, group)
            check(
                f"{kind} checkpoint reentrant={reentrant}", _assert_equal_grads, got, ref_a, "ckpt"
            )
        check(f"{kind} accumulation", same, *_accumulated(kind, rt, group))
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("pcp", [2, 4])
def test_plan_lifetime_on_gloo_ranks(pcp):
    results = run_distributed(_rank_body, pcp, timeout_s=600)
    assert results == [[]] * pcp, results
