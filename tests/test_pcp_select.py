"""Fused PCP head/tail select: Triton kernel (interpreter / GPU) == reference, op checks."""

from __future__ import annotations

import pytest
import torch

from cp_modules.kernels.pcp_select import pcp_select_triton
from cp_modules.ops.pcp_select import pcp_select
from cp_modules.partition import plan_pcp
from cp_modules.reference.pcp_select import pcp_select_reference

NAMES = ("q_head", "q_tail", "k_head", "v_head", "k_tail", "v_tail")


def _inputs(plan, hq, hkv, dqk, dv, dtype, device="cpu", token_stride=1):
    g = torch.Generator().manual_seed(3)
    t, n = plan.token_indices.numel(), plan.num_tokens
    # token_stride > 1 gives sources whose rows are contiguous but not adjacent.
    q = torch.randn(t * token_stride, hq, dqk, generator=g)[::token_stride]
    k = torch.randn(n * token_stride, hkv, dqk, generator=g)[::token_stride]
    v = torch.randn(n * token_stride, hkv, dv, generator=g)[::token_stride]
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def _indices(plan):
    return plan.q_head_index, plan.q_tail_index, plan.k_head_index, plan.k_tail_index


CASES = [
    # (num_scheduled, num_computed, pcp, rank, Hq, Hkv, Dqk, Dv, block_rows)
    pytest.param([13, 6, 1], [0, 0, 5], 2, 1, 4, 2, 8, 12, 4, id="P2r1-decode-GQA-DvNeDqk"),
    pytest.param([3, 9], [0, 0], 4, 3, 2, 2, 16, 16, 8, id="P4r3-empty-head-and-tail"),
    pytest.param([21], [4], 2, 0, 3, 1, 6, 6, 2, id="P2r0-MQA-odd-width"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n, m, pcp, rank, hq, hkv, dqk, dv, block_rows", CASES)
def test_triton_select_equals_reference(n, m, pcp, rank, hq, hkv, dqk, dv, block_rows, dtype):
    plan = plan_pcp(n, m, pcp, rank)
    q, k, v = _inputs(plan, hq, hkv, dqk, dv, dtype, token_stride=2)
    got = pcp_select_triton(q, k, v, *_indices(plan), block_rows=block_rows, block_cols=8)
    want = pcp_select_reference(q, k, v, *_indices(plan))
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape, name
        assert torch.equal(a, b), name


def test_select_op_opcheck_and_gradients():
    plan = plan_pcp([13, 6, 1], [0, 0, 5], 2, 1)
    q, k, v = (x.requires_grad_() for x in _inputs(plan, 4, 2, 8, 12, torch.float64))
    torch.library.opcheck(torch.ops.cp.pcp_select.default, (q, k, v, *_indices(plan)))
    outs = pcp_select(q, k, v, plan)
    weights = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), (q, k, v))
    ref = pcp_select_reference(q, k, v, *_indices(plan))
    want = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref, weights)), (q, k, v))
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


def test_select_compiles_fullgraph():
    plan = plan_pcp([13, 6, 1], [0, 0, 5], 2, 1)
    q, k, v = _inputs(plan, 4, 2, 8, 12, torch.float32)
    compiled = torch.compile(pcp_select, fullgraph=True)
    for a, b in zip(compiled(q, k, v, plan), pcp_select(q, k, v, plan)):
        assert torch.equal(a, b)


def test_select_rejects_wrong_token_counts():
    plan = plan_pcp([13, 6], [0, 0], 2, 0)
    q, k, v = _inputs(plan, 2, 2, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="q must hold"):
        pcp_select(q[1:], k, v, plan)
    with pytest.raises(ValueError, match="k and v must hold"):
        pcp_select(q, k, v[1:], plan)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "n, m, pcp, rank, hq, hkv, dqk, dv",
    [
        ([4000, 1, 1, 777], [0, 9, 3, 0], 4, 2, 32, 8, 128, 128),
        ([8192], [0], 8, 7, 16, 16, 192, 128),
        ([5, 3000], [0, 100], 2, 0, 8, 1, 576, 512),
    ],
    ids=["P4-GQA-D128", "P8-MLA-192-128", "P2-latent-576-512"],
)
def test_triton_select_on_gpu(n, m, pcp, rank, hq, hkv, dqk, dv, dtype):
    plan = plan_pcp(n, m, pcp, rank, device="cuda")
    q, k, v = _inputs(plan, hq, hkv, dqk, dv, dtype, device="cuda", token_stride=2)
    got = pcp_select(q, k, v, plan)
    want = pcp_select_reference(q, k, v, *_indices(plan))
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), name
