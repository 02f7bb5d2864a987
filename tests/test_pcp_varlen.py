"""One varlen call for all segments == the head/tail reference (batches without a prefix)."""

from __future__ import annotations

import pytest
import torch

from cp_modules.kernels.pcp_attention import segment_flop
from cp_modules.kernels.pcp_varlen import (
    pcp_prefill_attention_varlen,
    pcp_prefill_attention_varlen_backward,
    varlen_pack,
    varlen_pack_cached,
)
from cp_modules.partition import plan_pcp
from cp_modules.reference.pcp_attention import (
    pcp_prefill_attention_backward_reference,
    pcp_prefill_attention_reference,
)
from cp_modules.testing.numerics import max_abs_err

BATCHES = {
    "odd-lengths": [37, 5, 3, 20],
    "one-request": [64],
    "shorter-than-2P": [3, 1, 2, 40],
    "many-requests": [9, 17, 4, 30, 1, 12, 25, 8, 3, 16],
}
# Cached-prefix lengths per request (chunked prefill; a request of one new token after a
# prefix is a decode, replicated on every rank). None: no prefix.
PREFIXES = {
    "no-prefix": None,
    "prefix": {
        "odd-lengths": [0, 11, 6, 0],
        "one-request": [23],
        "shorter-than-2P": [5, 9, 0, 2],
        "many-requests": [0, 4, 0, 7, 30, 0, 1, 0, 12, 3],
    },
}


def _tensors(n, hq, hkv, d, dtype, device, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    N = sum(n)
    return tuple(
        torch.randn(N, h, dd, generator=g).to(device=device, dtype=dtype)
        for h, dd in ((hq, d), (hkv, d), (hkv, dv or d))
    )


@pytest.mark.parametrize("prefix", [None, [4, 0, 7, 2]], ids=["no-prefix", "prefix"])
def test_pack_spells_out_every_segment(prefix):
    plan = plan_pcp([37, 5, 3, 20], prefix or [0] * 4, 4, 1)
    cu = plan.prefix_cu_seqlens_host.tolist() if prefix else None
    pack = varlen_pack(plan.segments_host, "cpu", cu)
    q_rows, k_rows = [], []
    for req, qs, ql, ks, kl in plan.segments_host.tolist():
        if ql:
            q_rows += range(qs, qs + ql)
            if cu:  # the request's prefix rows, then its new rows after all C prefix rows
                k_rows += range(cu[req], cu[req + 1])
                ks += cu[-1]
            k_rows += range(ks, ks + kl)
    assert pack.q_index.tolist() == q_rows and pack.k_index.tolist() == k_rows
    assert pack.cu_q.dtype == pack.cu_k.dtype == torch.int32
    assert pack.cu_q.tolist() == pack.cu_q_host and pack.cu_k.tolist() == pack.cu_k_host
    assert pack.cu_q_host[-1] == len(q_rows) and pack.cu_k_host[-1] == len(k_rows)


def test_pack_is_built_once_per_segments_tensor():
    plan = plan_pcp([37, 5, 3, 20], [0] * 4, 2, 0)
    first = varlen_pack_cached(plan.segments_host, "cpu")
    assert varlen_pack_cached(plan.segments_host, "cpu") is first
    # An equal but distinct tensor, or the same one modified in place, gets its own packing.
    other = plan.segments_host.clone()
    assert varlen_pack_cached(other, "cpu") is not first
    other[0, 2] = 0
    rebuilt = varlen_pack_cached(other, "cpu")
    assert rebuilt.cu_q_host[-1] == first.cu_q_host[-1] - int(plan.segments_host[0, 2])
    # Another prefix is another packing.
    with_prefix = varlen_pack_cached(plan.segments_host, "cpu", [0, 3, 3, 3, 9])
    assert with_prefix.cu_k_host[-1] > first.cu_k_host[-1]


@pytest.mark.parametrize("prefix_cu", [None, [0, 4, 4, 10]], ids=["no-prefix", "prefix"])
def test_segment_flop_counts_bottom_right_causal_pairs(prefix_cu):
    segs = [[0, 0, 3, 0, 7], [0, 3, 0, 0, 0], [1, 3, 5, 2, 5], [2, 8, 1, 0, 9]]
    for got, (req, _, ql, _, kl) in zip(segment_flop(segs, 4, 6, 2, prefix_cu), segs):
        if prefix_cu:
            kl += prefix_cu[req + 1] - prefix_cu[req]
        pairs = sum(kl - ql + i + 1 for i in range(ql))  # query i sees kl - ql + i + 1 keys
        assert got == 2 * pairs * 4 * (6 + 2)


@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
@pytest.mark.parametrize("pcp", [1, 2, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("dims", [(8, 8), (12, 8)], ids=["gqa", "mla-dims"])
@pytest.mark.parametrize("prefix", list(PREFIXES), ids=list(PREFIXES))
def test_varlen_equals_reference_forward_and_backward(pcp, batch, dims, prefix):
    n = BATCHES[batch]
    m = PREFIXES[prefix][batch] if PREFIXES[prefix] else [0] * len(n)
    q, k, v = _tensors(n, 4, 2, dims[0], torch.float64, "cpu", dv=dims[1])
    pk, pv = _tensors([sum(m)], 4, 2, dims[0], torch.float64, "cpu", seed=7, dv=dims[1])[1:]
    for r in range(pcp):
        plan = plan_pcp(n, m, pcp, r)
        ql = q[plan.token_indices]
        cu = plan.prefix_cu_seqlens_host if sum(m) else None
        pre = (pk, pv, cu) if sum(m) else (None, None, None)
        args = (plan.segments_host, *pre, 0.3)
        want_out, want_lse = pcp_prefill_attention_reference(ql, k, v, *args)
        out, lse = pcp_prefill_attention_varlen(
            ql, k, v, plan.segments_host, 0.3, *pre[:2], None if cu is None else cu.tolist()
        )
        assert max_abs_err(out, want_out) < 1e-12
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
        fin = torch.isfinite(want_lse)
        assert max_abs_err(lse[fin], want_lse[fin]) < 1e-12
        dout = torch.randn_like(out)
        want = pcp_prefill_attention_backward_reference(dout, ql, k, v, want_out, want_lse, *args)
        got = pcp_prefill_attention_varlen_backward(
            dout, ql, k, v, want_out, want_lse, plan.segments_host, 0.3,
            *pre[:2], None if cu is None else cu.tolist(),
        )  # fmt: skip
        assert len(got) == (5 if sum(m) else 3)
        for name, a, b in zip(("dq", "dk", "dv", "dprefix_k", "dprefix_v"), got, want):
            assert max_abs_err(a, b) < 1e-12, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pcp", [2, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize(
    "shape", [(8, 2, 128, 128), (8, 8, 192, 128)], ids=["gqa-128", "mla-192-128"]
)
def test_gpu_varlen_flash_equals_reference(pcp, dtype, shape):
    # FlashAttention-2's varlen call against the packed reference on the same packing, in fp32
    # from the same low-precision inputs: within a few units of the inputs' precision. MLA's
    # narrower values go through the zero-padding.
    from cp_modules.kernels.pcp_varlen import (
        varlen_backward_flash,
        varlen_backward_reference,
        varlen_forward_flash,
        varlen_forward_reference,
    )

    hq, hkv, d, dv = shape
    n = BATCHES["many-requests"] + [700, 1000]
    q, k, v = _tensors(n, hq, hkv, d, dtype, "cuda", seed=3, dv=dv)
    eps = torch.finfo(dtype).eps
    for r in range(pcp):
        plan = plan_pcp(n, [0] * len(n), pcp, r, device="cuda")
        pack = varlen_pack(plan.segments_host, "cuda")
        qp = q[plan.token_indices].index_select(0, pack.q_index)
        kp, vp = k.index_select(0, pack.k_index), v.index_select(0, pack.k_index)
        o, s = varlen_forward_flash(qp, kp, vp, pack, 0.1)
        o_ref, s_ref = varlen_forward_reference(qp, kp, vp, pack, 0.1)
        assert max_abs_err(o, o_ref) <= 8 * eps * o_ref.abs().max().item()
        assert max_abs_err(s, s_ref) <= 1e-3
        do = torch.randn_like(o)
        got = varlen_backward_flash(do, qp, kp, vp, o, s, pack, 0.1)
        want = varlen_backward_reference(
            do.float(), qp.float(), kp.float(), vp.float(), o.float(), s, pack, 0.1
        )
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert max_abs_err(a, b) <= 16 * eps * b.abs().max().item(), name


@pytest.mark.parametrize("pcp", [2, 4], ids=lambda p: f"P{p}")
def test_cuda_entry_points_take_the_varlen_path_on_request(pcp):
    # varlen=True routes pcp_prefill_attention_cuda and its backward through the varlen call
    # (reference kernels on CPU).
    from cp_modules.kernels.pcp_attention import (
        attention_block_backward,
        pcp_prefill_attention_backward_cuda,
        pcp_prefill_attention_cuda,
    )

    n = BATCHES["many-requests"]
    q, k, v = _tensors(n, 4, 2, 8, torch.float64, "cpu", seed=2)
    for r in range(pcp):
        plan = plan_pcp(n, [0] * len(n), pcp, r)
        ql = q[plan.token_indices]
        args = (plan.segments_host, None, None, None, 0.3)
        want_out, want_lse = pcp_prefill_attention_reference(ql, k, v, *args)
        out, lse = pcp_prefill_attention_cuda(ql, k, v, *args, varlen=True)
        assert max_abs_err(out, want_out) < 1e-12
        dout = torch.randn_like(out)
        want = pcp_prefill_attention_backward_reference(dout, ql, k, v, want_out, want_lse, *args)
        calls = []

        def counting(*a, calls=calls, **kw):
            calls.append(1)
            return attention_block_backward(*a, **kw)

        got = pcp_prefill_attention_backward_cuda(
            dout, ql, k, v, want_out, want_lse, *args, varlen=True, block_backward=counting
        )
        assert not calls
        for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
            assert max_abs_err(a, b) < 1e-12, name
        # Into targets (the training layout): two halves of a buffer, in order.
        buf = torch.full((2, k.shape[0], *k.shape[1:]), float("nan"), dtype=k.dtype)
        half = k.shape[0] // 2
        into = [[(0, buf[j, :half]), (half, buf[j, half:])] for j in range(2)]
        got = pcp_prefill_attention_backward_cuda(
            dout, ql, k, v, want_out, want_lse, *args, varlen=True, dk_into=into[0], dv_into=into[1]
        )
        assert got[1] is None and got[2] is None
        assert max_abs_err(buf[0], want[1]) < 1e-12 and max_abs_err(buf[1], want[2]) < 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)], ids=["gqa-128", "mla-192-128"])
def test_gpu_automatic_choice_follows_segment_size(dims):
    # Many short requests take the varlen call, one long request the blocks; either way the
    # result equals the block path's (bf16, same tolerance as the kernel test above).
    from cp_modules.kernels.pcp_attention import (
        _use_varlen,
        pcp_prefill_attention_backward_cuda,
        pcp_prefill_attention_cuda,
    )

    d, dv = dims
    for n, want_varlen in (([512] * 16, True), ([16384], False)):
        q, k, v = _tensors(n, 8, 8, d, torch.bfloat16, "cuda", seed=4, dv=dv)
        plan = plan_pcp(n, [0] * len(n), 2, 1, device="cuda")
        ql = q[plan.token_indices]
        segs = plan.segments_host.tolist()
        for direction in ("forward", "backward"):
            assert _use_varlen(None, segs, ql, v, None, direction) is want_varlen, direction
        args = (plan.segments_host, None, None, None, d**-0.5)
        out, lse = pcp_prefill_attention_cuda(ql, k, v, *args)
        ref_out, ref_lse = pcp_prefill_attention_cuda(ql, k, v, *args, varlen=not want_varlen)
        valid = plan.local_valid
        eps = torch.finfo(torch.bfloat16).eps
        assert max_abs_err(out[valid], ref_out[valid]) <= 8 * eps * ref_out.abs().max().item()
        assert max_abs_err(lse[valid], ref_lse[valid]) <= 1e-3
        dout = torch.randn_like(out)
        got = pcp_prefill_attention_backward_cuda(dout, ql, k, v, out, lse, *args)
        want = pcp_prefill_attention_backward_cuda(
            dout, ql, k, v, out, lse, *args, varlen=not want_varlen
        )
        for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
            assert max_abs_err(a, b) <= 16 * eps * b.abs().max().item(), name
