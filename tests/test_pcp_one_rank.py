"""World size 1: the PCP attention paths without the data movement the one-rank layout does not
need, against the reference.

At pcp = 1 a request is one causal segment and the restore is the identity. The block path's
backward of one request (one causal square over every row) returns the kernel's gradients as
they are; the varlen backward reads the keys where they lie when the segments' keys are the
restored rows in order (``VarlenPack.keys_in_order``: one request, or no cached prefix). Both equal the reference (float64,
exact up to rounding), with several requests and cached prefixes next to them.
"""

from __future__ import annotations

import pytest
import torch

from cp_modules.kernels.prefill.attention_blocks import attention_block_backward
from cp_modules.kernels.prefill.pcp_blocks import pcp_blocks_backward, pcp_blocks_forward
from cp_modules.kernels.prefill.pcp_varlen import (
    pcp_prefill_attention_varlen,
    pcp_prefill_attention_varlen_backward,
    varlen_pack,
)
from cp_modules.partition import plan_pcp
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    pcp_prefill_attention_backward_reference,
    pcp_prefill_attention_reference,
)
from cp_modules.testing.numerics import max_abs_err

BATCHES = {
    "one-request": ([37], [0]),
    "one-token": ([1], [0]),
    "several-requests": ([13, 1, 24, 6], [0, 0, 0, 0]),
    "equal-lengths": ([16, 16], [0, 0]),
    "cached-prefix": ([19], [11]),
    "prefix-and-decodes": ([1, 9, 1, 4], [5, 0, 12, 3]),
}
DIMS = {"gqa": (4, 2, 16, 16), "mla-dims": (2, 2, 12, 8)}


def _inputs(batch, dims, dtype=torch.float64, device="cpu", seed=0):
    n, m = BATCHES[batch]
    hq, hkv, dqk, dv = dims
    g = torch.Generator().manual_seed(seed)
    N, C = sum(n), sum(m)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)

    plan = plan_pcp(n, m, 1, 0, device=device)
    q, k, v = rnd(N, hq, dqk), rnd(N, hkv, dqk), rnd(N, hkv, dv)
    prefix = (rnd(C, hkv, dqk), rnd(C, hkv, dv), plan.prefix_cu_seqlens_host) if C else (None,) * 3
    return plan, PrefillInputs(q, k, v, plan.segments_host, *prefix, dqk**-0.5)


def _contiguous_reference_backward(*args, **kwargs):
    # The reference block kernel, its gradients laid out as the fused kernels give them.
    return tuple(g.contiguous() for g in attention_block_backward(*args, **kwargs))


@pytest.mark.parametrize("dims", list(DIMS), ids=list(DIMS))
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
def test_blocks_at_one_rank_equal_the_reference(batch, dims):
    plan, inputs = _inputs(batch, DIMS[dims])
    want_out, want_lse = pcp_prefill_attention_reference(inputs)
    out, lse = pcp_blocks_forward(inputs)
    assert max_abs_err(out, want_out) < 1e-12 and max_abs_err(lse, want_lse) < 1e-12
    dout = torch.randn_like(want_out)
    want = pcp_prefill_attention_backward_reference(dout, want_out, want_lse, inputs)
    seen = []

    def block_backward(*args, **kwargs):
        res = _contiguous_reference_backward(*args, **kwargs)
        seen.append(res)
        return res

    got = pcp_blocks_backward(dout, want_out, want_lse, inputs, block_backward=block_backward)
    for name, a, b in zip(("dq", "dk", "dv", "dprefix_k", "dprefix_v"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
            assert max_abs_err(a, b) < 1e-12, name
    one_square = len(BATCHES[batch][0]) == 1 and not sum(BATCHES[batch][1])
    if one_square:
        # One call, and its gradients are the results themselves (no assembly copy).
        assert len(seen) == 1
        for a, g in zip(got[:3], seen[0]):
            assert a.data_ptr() == g.data_ptr() and a._base is None


def test_one_square_backward_keeps_the_assembly_when_the_kernel_dtype_differs():
    # Gradients in another dtype than the inputs (the reference kernel's fp32 for fp16
    # inputs) are rounded into fresh tensors of the inputs' dtype, as the assembly does.
    plan, inputs = _inputs("one-request", DIMS["gqa"], dtype=torch.float16)
    out, lse = pcp_prefill_attention_reference(inputs)
    dout = torch.randn_like(out)
    got = pcp_blocks_backward(dout, out, lse, inputs)
    want = pcp_prefill_attention_backward_reference(dout, out, lse, inputs)
    for a, b in zip(got[:3], want[:3]):
        assert a.dtype == torch.float16
        assert torch.equal(a, b)


@pytest.mark.parametrize("dims", list(DIMS), ids=list(DIMS))
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
def test_varlen_at_one_rank_reads_keys_in_place_and_equals_the_reference(batch, dims):
    plan, inputs = _inputs(batch, DIMS[dims], seed=1)
    cu = None if inputs.prefix_k is None else inputs.prefix_cu_seqlens.tolist()
    pack = varlen_pack(plan.segments_host, "cpu", cu, inputs.q.shape[0])
    # With cached prefixes the packing puts the requests that have one first (their
    # backward takes the packed rows); without, the keys are the restored rows in order.
    assert pack.keys_in_order or cu is not None
    want_out, want_lse = pcp_prefill_attention_reference(inputs)
    out, lse = pcp_prefill_attention_varlen(inputs, pack=pack)
    assert max_abs_err(out, want_out) < 1e-12 and max_abs_err(lse, want_lse) < 1e-12
    dout = torch.randn_like(want_out)
    want = pcp_prefill_attention_backward_reference(dout, want_out, want_lse, inputs)
    got = pcp_prefill_attention_varlen_backward(dout, want_out, want_lse, inputs, pack=pack)
    for name, a, b in zip(("dq", "dk", "dv", "dprefix_k", "dprefix_v"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        assert max_abs_err(a, b) < 1e-12, name


def test_keys_in_order_only_where_each_key_row_is_read_once():
    # P = 2: a request's head and tail segments both read its first keys.
    plan = plan_pcp([13, 6], [0, 0], 2, 0)
    assert not varlen_pack(
        plan.segments_host, "cpu", None, plan.num_local_tokens_padded
    ).keys_in_order
    plan = plan_pcp([13, 6], [0, 0], 1, 0)
    assert varlen_pack(plan.segments_host, "cpu", None, plan.num_local_tokens_padded).keys_in_order


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["blocks", "varlen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
def test_gpu_one_rank_paths_equal_the_reference(batch, dtype, path):
    # On the fused kernels, against the reference in fp32 on the same inputs: within a few
    # units of the inputs' precision (as test_pcp_varlen's GPU check).
    plan, inputs = _inputs(batch, (8, 2, 128, 128), dtype=dtype, device="cuda", seed=2)
    ref_inputs = inputs._replace(
        **{f: getattr(inputs, f).float() for f in ("q", "k", "v", "prefix_k", "prefix_v")
           if getattr(inputs, f) is not None}
    )  # fmt: skip
    if path == "blocks":
        out, lse = pcp_blocks_forward(inputs)
        dout = torch.randn_like(out)
        got = pcp_blocks_backward(dout, out, lse, inputs)
    else:
        cu = None if inputs.prefix_k is None else inputs.prefix_cu_seqlens.tolist()
        pack = varlen_pack(plan.segments_host, "cuda", cu, inputs.q.shape[0])
        assert pack.keys_in_order or cu is not None
        out, lse = pcp_prefill_attention_varlen(inputs, pack=pack)
        dout = torch.randn_like(out)
        got = pcp_prefill_attention_varlen_backward(dout, out, lse, inputs, pack=pack)
    want = pcp_prefill_attention_backward_reference(dout.float(), out.float(), lse, ref_inputs)
    eps = torch.finfo(dtype).eps
    # Rounding scales with the products the gradients are made of, not with a gradient that
    # is zero by cancellation (one token: dq = dk = 0 exactly, both sides leave rounding
    # noise): the bound is relative to the largest reference gradient.
    scale = max(b.abs().max().item() for b in want[:3])
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and a.is_contiguous(), name
        assert max_abs_err(a.float(), b) <= 16 * eps * scale, name
