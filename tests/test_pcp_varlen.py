"""One varlen call for all segments == the head/tail reference (batches without a prefix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_modules.kernels.prefill.pcp_varlen import (
    pcp_prefill_attention_varlen,
    pcp_prefill_attention_varlen_backward,
    varlen_pack,
)
from cp_modules.ops import pcp_policy
from cp_modules.ops.pcp_policy import CudnnRental, plan_state, segment_flop
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    pcp_prefill_attention_backward_reference,
    pcp_prefill_attention_reference,
)
from cp_modules.testing.numerics import max_abs_err

BATCHES = {
    "odd-lengths": [37, 5, 3, 20],
    "one-request": [64],
    "shorter-than-2P": [3, 1, 2, 40],
    "many-requests": [9, 17, 4, 30, 1, 12, 25, 8, 3, 16],
    # P = 2: every segment one query (FlashAttention-2 takes max_q == 1 its own way with GQA).
    "one-query-segments": [4, 4, 4],
    # P >= 2: ranks with padding rows only.
    "one-token": [1],
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
        "one-query-segments": [3, 0, 2],
        "one-token": [0],
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
    segs = [s for s in plan.segments_host.tolist() if s[2]]
    if prefix:  # requests with a prefix first
        segs.sort(key=lambda s: (cu[s[0] + 1] == cu[s[0]], s[0]))
    q_rows, k_rows, q_of = [], [], [0] * 4
    for req, qs, ql, ks, kl in segs:
        q_rows += range(qs, qs + ql)
        k_rows += range(ks, ks + kl)
        q_of[req] += ql
    assert pack.q_index.tolist() == q_rows and pack.k_index.tolist() == k_rows
    new = pack.new
    assert new.causal and new.cu_q.dtype == new.cu_k.dtype == torch.int32
    assert new.cu_q.tolist() == new.cu_q_host == [0, *np.cumsum([s[2] for s in segs])]
    assert new.cu_k.tolist() == new.cu_k_host == [0, *np.cumsum([s[4] for s in segs])]
    if not prefix:
        assert pack.prefix is None
        return
    # One unmasked sequence per request: its queries here (if it has a prefix) over its prefix.
    pre = pack.prefix
    assert not pre.causal and pre.cu_k_host == cu and pre.cu_k.tolist() == cu
    rows = [q_of[r] if prefix[r] else 0 for r in range(4)]
    assert pre.cu_q_host == [0, *np.cumsum(rows)] and pre.cu_q.tolist() == pre.cu_q_host
    # Those queries are the leading packed rows, request by request.
    lead = [s for s in segs if prefix[s[0]]]
    assert q_rows[: pre.cu_q_host[-1]] == [i for s in lead for i in range(s[1], s[1] + s[2])]


@pytest.mark.parametrize("prefix", [None, [4, 0, 7, 2]], ids=["no-prefix", "prefix"])
def test_in_place_calls_tile_the_local_rows(prefix):
    # One sequence per segment at its own rows, one without keys per run of padding rows; the
    # new keys and the prefix read where they lie, the backward's keys packed.
    plan = plan_pcp([37, 5, 3, 20], prefix or [0] * 4, 4, 1)
    cu = plan.prefix_cu_seqlens_host.tolist() if prefix else None
    T = plan.segments_host[:, 1:3].sum(1).max().item() + 3  # three padding rows at the end
    pack = varlen_pack(plan.segments_host, "cpu", cu, T)
    calls = pack.in_place
    segs = sorted((s for s in plan.segments_host.tolist() if s[2]), key=lambda s: s[1])
    covered = {i for s in segs for i in range(s[1], s[1] + s[2])}
    new = calls.new
    assert new.cu_q_host[0] == 0 and new.cu_q_host[-1] == T
    assert calls.pad_rows.tolist() == [i for i in range(T) if i not in covered]
    seen, packed = 0, 0
    for i in range(len(new.cu_q_host) - 1):
        rows = range(new.cu_q_host[i], new.cu_q_host[i + 1])
        seg = [s for s in segs if s[1] == rows.start and s[2] == len(rows)]
        keys = new.key_range(i)
        if not seg:  # padding
            assert not set(rows) & covered and keys.start == keys.stop
            assert calls.backward is None or calls.backward.key_range(i) == slice(packed, packed)
            continue
        req, _, _, ks, kl = seg[0]
        seen += 1
        assert keys == slice(ks, ks + kl) and new.causal
        if calls.backward is not None:
            assert calls.backward.key_range(i) == slice(packed, packed + kl)
        packed += kl
    assert seen == len(segs)
    assert (calls.backward is None) == bool(prefix)
    if not prefix:
        return
    # The prefix call: one sequence per request, over all its rows here, against its prefix.
    pre, empty = calls.prefix, []
    assert not pre.causal and pre.cu_q_host[0] == 0 and pre.cu_q_host[-1] == T
    for i in range(len(pre.cu_q_host) - 1):
        rows = range(pre.cu_q_host[i], pre.cu_q_host[i + 1])
        reqs = {s[0] for s in segs if s[1] in rows}
        assert len(reqs) <= 1
        if not reqs:
            assert not set(rows) & covered and pre.key_range(i).start == pre.key_range(i).stop
            continue
        req = reqs.pop()
        assert all(s[1] in rows and s[1] + s[2] <= rows.stop for s in segs if s[0] == req)
        assert pre.key_range(i) == slice(cu[req], cu[req + 1])
        if not prefix[req]:
            empty += rows
    assert calls.no_prefix_rows.tolist() == empty
    # Overlapping segments have no in-place form.
    bad = plan.segments_host.clone()
    bad[1, 1] = bad[0, 1]
    assert varlen_pack(bad, "cpu", cu, T).in_place is None


def test_interleaved_requests_take_one_prefix_sequence_per_segment():
    # Rows of requests 0 and 1 interleave (not a plan's layout, but a valid segment list):
    # the prefix call falls back to a sequence per segment; results still equal the reference.
    segs = torch.tensor([[0, 0, 3, 0, 3], [1, 3, 2, 5, 2], [0, 6, 2, 0, 5], [1, 8, 1, 5, 3]])
    cu = [0, 4, 6]
    q, k, v = _tensors([10], 4, 2, 8, torch.float64, "cpu", seed=9)
    pk, pv = _tensors([6], 4, 2, 8, torch.float64, "cpu", seed=10)[1:]
    pack = varlen_pack(segs, "cpu", cu, 10)
    assert len(pack.in_place.prefix.cu_q_host) - 1 == len(pack.in_place.new.cu_q_host) - 1
    inputs = PrefillInputs(q, k, v, segs, pk, pv, torch.tensor(cu), 0.3)
    want_out, want_lse = pcp_prefill_attention_reference(inputs)
    out, lse = pcp_prefill_attention_varlen(inputs, pack=pack)
    assert max_abs_err(out, want_out) < 1e-12
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and max_abs_err(lse[fin], want_lse[fin]) < 1e-12


def test_pack_is_built_once_per_segments_tensor():
    def pack(segments, prefix_cu=None, rows=None):
        cpu = torch.device("cpu")
        return plan_state(segments).varlen_pack(segments, cpu, prefix_cu, rows)

    plan = plan_pcp([37, 5, 3, 20], [0] * 4, 2, 0)
    first = pack(plan.segments_host)
    assert pack(plan.segments_host) is first
    # An equal but distinct tensor, or the same one modified in place, gets its own packing.
    other = plan.segments_host.clone()
    assert pack(other) is not first
    other[0, 2] = 0
    rebuilt = pack(other)
    assert rebuilt.new.cu_q_host[-1] == first.new.cu_q_host[-1] - int(plan.segments_host[0, 2])
    # Another prefix is another packing.
    with_prefix = pack(plan.segments_host, [0, 3, 3, 3, 9])
    assert first.prefix is None and with_prefix.prefix.cu_k_host == [0, 3, 3, 3, 9]
    # And another row count.
    rows = pack(plan.segments_host, None, 40)
    assert rows is not first and rows.in_place.num_rows == 40 and first.in_place is None


@pytest.mark.parametrize("prefix_cu", [None, [0, 4, 4, 10]], ids=["no-prefix", "prefix"])
def test_segment_flop_counts_bottom_right_causal_pairs(prefix_cu):
    segs = [[0, 0, 3, 0, 7], [0, 3, 0, 0, 0], [1, 3, 5, 2, 5], [2, 8, 1, 0, 9]]
    for got, (req, _, ql, _, kl) in zip(segment_flop(segs, 4, 6, 2, prefix_cu), segs):
        if prefix_cu:
            kl += prefix_cu[req + 1] - prefix_cu[req]
        pairs = sum(kl - ql + i + 1 for i in range(ql))  # query i sees kl - ql + i + 1 keys
        assert got == 2 * pairs * 4 * (6 + 2)


def test_switch_points_by_direction_and_head_dims():
    # MLA's narrower (zero-padded) values take the "_padded" switch, in both directions.
    policy = CPPolicy()
    limits, varlen_limit = policy.varlen_max_flop_per_segment, policy.varlen_limit

    for direction in ("forward", "backward"):
        assert varlen_limit(direction, 128, 128) == limits[direction]
        assert varlen_limit(direction, 192, 128) == limits[direction + "_padded"]

    # The measured whole layers (one rank, P = 1, forward): the varlen call was faster for 64
    # prompts of 512 tokens in the Llama-3-8B layer and the 32-head DeepSeek-V3 one, blocks for
    # 8 x 4096 (Llama) and 16 x 2048 (DeepSeek, 32 heads).
    def mean_flop(batch, length, heads, dqk, dv):
        plan = plan_pcp([length] * batch, [0] * batch, 1, 0)
        flop = segment_flop([s for s in plan.segments_host.tolist() if s[2]], heads, dqk, dv)
        return sum(flop) / len(flop)

    assert mean_flop(64, 512, 32, 128, 128) < varlen_limit("forward", 128, 128)
    assert mean_flop(8, 4096, 32, 128, 128) >= varlen_limit("forward", 128, 128)
    assert mean_flop(64, 512, 32, 192, 128) < varlen_limit("forward", 192, 128)
    assert mean_flop(16, 2048, 32, 192, 128) >= varlen_limit("forward", 192, 128)


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
        inputs = PrefillInputs(ql, k, v, plan.segments_host, *pre, 0.3)
        want_out, want_lse = pcp_prefill_attention_reference(inputs)
        dout = torch.randn_like(want_out)
        dout[~plan.local_valid] = 100.0  # nothing may flow from the padding rows' gradient
        want = pcp_prefill_attention_backward_reference(dout, want_out, want_lse, inputs)
        cu_host = None if cu is None else cu.tolist()
        # The calls over the rows as they lie (the default), and the packed rows.
        packs = {
            "in-place": varlen_pack(plan.segments_host, "cpu", cu_host, ql.shape[0]),
            "packed": varlen_pack(plan.segments_host, "cpu", cu_host),
        }
        has_queries = bool(plan.segments_host[:, 2].sum())  # else all padding: no calls
        assert (packs["in-place"].in_place is not None) == has_queries
        assert packs["packed"].in_place is None
        for layout, pack in packs.items():
            out, lse = pcp_prefill_attention_varlen(inputs, pack=pack)
            assert max_abs_err(out, want_out) < 1e-12, layout
            assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), layout
            fin = torch.isfinite(want_lse)
            assert max_abs_err(lse[fin], want_lse[fin]) < 1e-12, layout
            got = pcp_prefill_attention_varlen_backward(dout, want_out, want_lse, inputs, pack=pack)
            assert len(got) == (5 if sum(m) else 3)
            for name, a, b in zip(("dq", "dk", "dv", "dprefix_k", "dprefix_v"), got, want):
                assert max_abs_err(a, b) < 1e-12, (layout, name)


GPU_BATCHES = {
    # name: (num_scheduled, num_computed); the P = 4 ranks of "short-with-prefix" include ones
    # where a request with a prefix has no queries (a sequence of no queries in the call).
    "many-requests": (BATCHES["many-requests"] + [700, 1000], [0] * 12),
    "many-with-prefix": (
        BATCHES["many-requests"] + [700, 1000],
        [0, 4, 0, 7, 30, 0, 1, 0, 12, 3, 500, 0],
    ),
    "short-with-prefix": ([3, 1, 2, 40, 300], [5, 9, 0, 2, 129]),
    # P = 2: one query a segment, no padding (max_q == 1).
    "one-query-segments": ([4] * 6, [0] * 6),
    "one-query-segments-with-prefix": ([4] * 6, [0, 7, 0, 130, 1, 0]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pcp", [2, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize(
    "shape", [(8, 2, 128, 128), (8, 8, 192, 128)], ids=["gqa-128", "mla-192-128"]
)
@pytest.mark.parametrize("batch", list(GPU_BATCHES), ids=list(GPU_BATCHES))
def test_gpu_varlen_flash_equals_reference(batch, shape, pcp, dtype):
    # The varlen path on FlashAttention-2 against the head/tail reference in fp32 on the same
    # (low-precision) inputs: within a few units of the inputs' precision. MLA's narrower
    # values go through the zero-padding; a prefix through the second, unmasked call.
    hq, hkv, d, dv = shape
    n, m = GPU_BATCHES[batch]
    if batch == "one-query-segments" and pcp != 2:
        # At P = 4 these requests' real tokens fill chunks 0-3 alone: rank 0's queries each
        # see one key, so their dq is 0 up to rounding and no relative error is defined.
        # (With prefixes they see more; that batch runs at P = 4, where the packed prefix call
        # has sequences without queries next to ones with one.)
        pytest.skip("one query a segment is the P = 2 layout of this batch")
    q, k, v = _tensors(n, hq, hkv, d, dtype, "cuda", seed=3, dv=dv)
    pk, pv = _tensors([sum(m)], hq, hkv, d, dtype, "cuda", seed=5, dv=dv)[1:]
    eps = torch.finfo(dtype).eps
    for r in range(pcp):
        plan = plan_pcp(n, m, pcp, r, device="cuda")
        ql = q[plan.token_indices]
        cu = plan.prefix_cu_seqlens_host if sum(m) else None
        pre = (pk, pv, cu) if sum(m) else (None, None, None)
        cu_host = None if cu is None else cu.tolist()
        inputs = PrefillInputs(ql, k, v, plan.segments_host, *pre, 0.1)
        f32 = [None if x is None or x.dtype == torch.int64 else x.float() for x in (ql, k, v, *pre)]
        inputs32 = PrefillInputs(*f32[:3], plan.segments_host, f32[3], f32[4], cu, 0.1)
        o_ref, s_ref = pcp_prefill_attention_reference(inputs32)
        valid = plan.local_valid
        do = torch.randn_like(o_ref).to(dtype)
        do[~valid] = 100.0  # nothing may flow from the padding rows' gradient
        want = pcp_prefill_attention_backward_reference(do.float(), o_ref, s_ref, inputs32)
        # Over the rows as they lie (the default: padding rows are sequences without keys,
        # whatever the kernel leaves there is overwritten), and over packed rows.
        packs = {
            "in-place": varlen_pack(plan.segments_host, "cuda", cu_host, ql.shape[0]),
            "packed": varlen_pack(plan.segments_host, "cuda", cu_host),
        }
        for layout, pack in packs.items():
            out, lse = pcp_prefill_attention_varlen(inputs, pack=pack)
            assert out.is_contiguous() and lse.is_contiguous() and out._base is None, layout
            assert max_abs_err(out[valid], o_ref[valid]) <= 8 * eps * o_ref.abs().max().item()
            assert max_abs_err(lse[valid], s_ref[valid]) <= 1e-3, layout
            assert torch.all(out[~valid] == 0) and torch.all(lse[~valid] == float("-inf"))
            got = pcp_prefill_attention_varlen_backward(do, out, lse, inputs, pack=pack)
            names = ("dq", "dk", "dv", "dprefix_k", "dprefix_v")
            assert len(got) == (5 if sum(m) else 3)
            for name, a, b in zip(names, got, want):
                assert a.dtype == dtype, (layout, name)
                assert max_abs_err(a, b) <= 16 * eps * b.abs().max().item(), (layout, name)


@pytest.mark.parametrize("pcp", [2, 4], ids=lambda p: f"P{p}")
def test_cuda_entry_points_take_the_varlen_path_on_request(pcp):
    # A policy of pcp_varlen="always" routes pcp_prefill_attention_cuda and its backward
    # through the varlen call (reference kernels on CPU).
    from cp_modules.kernels.prefill.attention_blocks import attention_block_backward
    from cp_modules.ops.pcp_policy import (
        pcp_prefill_attention_backward_cuda,
        pcp_prefill_attention_cuda,
    )

    always = CPPolicy(pcp_varlen="always")

    n = BATCHES["many-requests"]
    q, k, v = _tensors(n, 4, 2, 8, torch.float64, "cpu", seed=2)
    for r in range(pcp):
        plan = plan_pcp(n, [0] * len(n), pcp, r)
        ql = q[plan.token_indices]
        inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, 0.3)
        want_out, want_lse = pcp_prefill_attention_reference(inputs)
        out, lse = pcp_prefill_attention_cuda(inputs, policy=always)
        assert max_abs_err(out, want_out) < 1e-12
        dout = torch.randn_like(out)
        want = pcp_prefill_attention_backward_reference(dout, want_out, want_lse, inputs)
        calls = []

        def counting(*a, calls=calls, **kw):
            calls.append(1)
            return attention_block_backward(*a, **kw)

        got = pcp_prefill_attention_backward_cuda(
            dout, want_out, want_lse, inputs, policy=always, block_backward=counting
        )
        assert not calls
        for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
            assert max_abs_err(a, b) < 1e-12, name
        # Into targets (the training layout): two halves of a buffer, in order.
        buf = torch.full((2, k.shape[0], *k.shape[1:]), float("nan"), dtype=k.dtype)
        half = k.shape[0] // 2
        into = [[(0, buf[j, :half]), (half, buf[j, half:])] for j in range(2)]
        got = pcp_prefill_attention_backward_cuda(
            dout, want_out, want_lse, inputs, policy=always, dk_into=into[0], dv_into=into[1]
        )
        assert got[1] is None and got[2] is None
        assert max_abs_err(buf[0], want[1]) < 1e-12 and max_abs_err(buf[1], want[2]) < 1e-12


def test_new_block_shapes_rent_the_varlen_path_first():
    # As if the blocks ran on cuDNN: a plan of new shapes takes the varlen forward for as many
    # calls as its estimated extra time needs to add up to one round of plan builds, then the
    # blocks; a later plan with the same segments, and the backward, take the blocks at once.
    extra = dict.fromkeys(pcp_policy.VARLEN_EXTRA_S_PER_FLOP, 1.0)  # 1 s a FLOP
    rental = CudnnRental(extra_s_per_flop=extra, min_rent_calls=2)
    policy = CPPolicy(cudnn_build_s=2.5e6)  # a build: 2.5 calls of 1e6 FLOP
    q, k, v = _tensors([300, 200], 4, 2, 8, torch.float32, "cpu")
    backend = "cudnn"

    def ready(plan, direction="forward", kk=k):
        segs = [s for s in plan.segments_host.tolist() if s[2]]
        return rental.blocks_ready(
            plan_state(plan.segments_host), segs, q, kk, v, None, direction, 1e6,
            cudnn_build_s=policy.cudnn_build_s, backend=backend,
        )  # fmt: skip

    first = plan_pcp([300, 200], [0, 0], 2, 1)
    assert [ready(first) for _ in range(5)] == [False, False, False, True, True]
    assert ready(first, "backward")  # training's backward builds at once
    second = plan_pcp([300, 200], [0, 0], 2, 1)
    assert ready(second) and ready(second, "backward")
    assert not ready(plan_pcp([301, 200], [0, 0], 2, 1))  # another length
    assert not ready(plan_pcp([300, 200], [0, 0], 2, 0))  # another rank's segments
    assert not ready(second, kk=k[:, :1].contiguous())  # other KV heads: other kernels
    # A plan's segments modified in place are judged again.
    changed = plan_pcp([300, 200], [0, 0], 2, 1)
    assert ready(changed)
    changed.segments_host[0, 4] -= 1  # other shapes now
    assert not ready(changed)
    # The oldest shapes are forgotten.
    rental.shapes_kept = 2
    plans = [plan_pcp([100 + i, 50], [0, 0], 2, 0) for i in range(3)]
    assert not any(ready(p) for p in plans)
    assert not ready(plan_pcp([100, 50], [0, 0], 2, 0))  # dropped: three plans since
    assert ready(plan_pcp([102, 50], [0, 0], 2, 0))
    # A build worth fewer varlen calls than min_rent_calls is made at once.
    rental.min_rent_calls = 3
    assert ready(plan_pcp([555, 5], [0, 0], 2, 0))
    # Blocks that would not run on cuDNN have nothing to build.
    backend = "flash"
    assert ready(plan_pcp([777, 5], [0, 0], 2, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)], ids=["gqa-128", "mla-192-128"])
def test_gpu_automatic_choice_follows_segment_size(dims):
    # Many short requests take the varlen call; one long request the blocks on cuDNN, its
    # forward once an earlier plan had its shapes (before that, varlen: no cuDNN plan builds
    # for a one-off length). Either way the result equals the other path's (bf16, tolerances
    # as above).
    from cp_modules.ops.pcp_policy import (
        choose_varlen,
        pcp_prefill_attention_backward_cuda,
        pcp_prefill_attention_cuda,
    )

    rental = CudnnRental()  # whatever other tests ran
    auto = CPPolicy()
    forced = {True: CPPolicy(pcp_varlen="always"), False: CPPolicy(pcp_varlen="never")}
    d, dv = dims
    # (forward, backward) of a first plan, then of another with the same shapes.
    for n, want_varlen in (
        ([512] * 16, [(True, True), (True, True)]),
        ([16384], [(True, False), (False, False)]),
    ):
        q, k, v = _tensors(n, 8, 8, d, torch.bfloat16, "cuda", seed=4, dv=dv)
        for want, want_bwd in want_varlen:
            plan = plan_pcp(n, [0] * len(n), 2, 1, device="cuda")
            ql = q[plan.token_indices]
            segs = plan.segments_host.tolist()
            for direction, w in (("forward", want), ("backward", want_bwd)):
                got = choose_varlen(
                    auto, direction, plan.segments_host, segs, ql, k, v, None, rental=rental
                )
                assert got is w, (n, direction)
            inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, d**-0.5)
            out, lse = pcp_prefill_attention_cuda(inputs, policy=forced[want])
            ref_out, ref_lse = pcp_prefill_attention_cuda(inputs, policy=forced[not want])
            valid = plan.local_valid
            eps = torch.finfo(torch.bfloat16).eps
            assert max_abs_err(out[valid], ref_out[valid]) <= 8 * eps * ref_out.abs().max().item()
            assert max_abs_err(lse[valid], ref_lse[valid]) <= 1e-3
            dout = torch.randn_like(out)
            got = pcp_prefill_attention_backward_cuda(
                dout, out, lse, inputs, policy=forced[want_bwd]
            )
            other = pcp_prefill_attention_backward_cuda(
                dout, out, lse, inputs, policy=forced[not want_bwd]
            )
            for name, a, b in zip(("dq", "dk", "dv"), got[:3], other[:3]):
                assert max_abs_err(a, b) <= 16 * eps * b.abs().max().item(), name


def test_policy_forces_the_varlen_path_through_the_op(monkeypatch):
    # A policy of pcp_varlen="always" sends the CPU op (forward and backward, with a prefix)
    # through the varlen packing on the reference kernels; the results equal the reference's.
    n, m = [37, 5, 1, 20], [0, 6, 9, 3]
    q, k, v = _tensors(n, 4, 2, 8, torch.float64, "cpu", seed=6)
    pk, pv = _tensors([sum(m)], 4, 2, 8, torch.float64, "cpu", seed=8)[1:]
    plan = plan_pcp(n, m, 2, 1)
    args = (q[plan.token_indices], k, v, plan.segments_host, pk, pv)
    args = (*args, plan.prefix_cu_seqlens_host, 0.3)
    policy = pcp_policy.pcp_policy_args(CPPolicy(pcp_varlen="always"), 8, 8)
    calls = []
    for name in ("pcp_prefill_attention_varlen", "pcp_prefill_attention_varlen_backward"):
        fn = getattr(pcp_policy, name)
        counting = lambda *a, fn=fn, **kw: calls.append(fn) or fn(*a, **kw)  # noqa: E731
        monkeypatch.setattr(pcp_policy, name, counting)
    out, lse = torch.ops.cp.pcp_prefill_attention(*args, *policy)
    want_out, want_lse = pcp_prefill_attention_reference(PrefillInputs(*args))
    assert max_abs_err(out, want_out) < 1e-12 and torch.equal(lse.isinf(), want_lse.isinf())
    dout = torch.randn_like(out)
    got = torch.ops.cp.pcp_prefill_attention_backward(dout, *args[:3], out, lse, *args[3:], *policy)
    want = pcp_prefill_attention_backward_reference(dout, out, lse, PrefillInputs(*args))
    for name, a, b in zip(("dq", "dk", "dv", "dprefix_k", "dprefix_v"), got, want):
        assert max_abs_err(a, b) < 1e-12, name
    assert len(calls) == 2
    with pytest.raises(ValueError, match="pcp_varlen must be one of.*'sometimes'"):
        CPPolicy(pcp_varlen="sometimes")


def test_public_function_threads_the_policy_to_its_backward(monkeypatch):
    # pcp_prefill_attention(policy=...) hands the policy to the op, whose autograd backward
    # runs with the forward's policy: both directions take the varlen packing here (CPU), and
    # the gradients equal the reference's; the default policy runs the reference (no calls).
    from cp_modules.ops.pcp_attention import pcp_prefill_attention

    n, m = [37, 5, 1, 20], [0, 6, 9, 3]
    q, k, v = _tensors(n, 4, 2, 8, torch.float64, "cpu", seed=6)
    pk, pv = _tensors([sum(m)], 4, 2, 8, torch.float64, "cpu", seed=8)[1:]
    plan = plan_pcp(n, m, 2, 1)
    calls = []
    for name in ("pcp_prefill_attention_varlen", "pcp_prefill_attention_varlen_backward"):
        fn = getattr(pcp_policy, name)
        counting = lambda *a, fn=fn, **kw: calls.append(fn.__name__) or fn(*a, **kw)  # noqa: E731
        monkeypatch.setattr(pcp_policy, name, counting)
    grads = {}
    for choice in ("always", None):
        leaves = [x.clone().requires_grad_() for x in (q[plan.token_indices], k, v, pk, pv)]
        policy = None if choice is None else CPPolicy(pcp_varlen=choice)
        out, _ = pcp_prefill_attention(
            *leaves[:3], plan, scale=0.3, prefix_k=leaves[3], prefix_v=leaves[4], policy=policy
        )
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        grads[choice] = (out.detach(), torch.autograd.grad((out * w).sum(), leaves))
    assert calls == ["pcp_prefill_attention_varlen", "pcp_prefill_attention_varlen_backward"]
    assert max_abs_err(grads["always"][0], grads[None][0]) < 1e-12
    for a, b in zip(grads["always"][1], grads[None][1]):
        assert max_abs_err(a, b) < 1e-12
