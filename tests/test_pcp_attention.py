"""PCP head/tail prefill attention: every rank's share == dense causal attention.

Single process: every PCP rank of a batch is simulated in turn against the same gathered K/V
(the multi-process version with real all-gathers is test_pcp_distributed.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cp_modules.kernels.merge import merge_partials_triton
from cp_modules.kernels.prefill.attention_blocks import (
    BLOCK_BACKENDS,
    CUDNN_GQA,
    attention_block_backward,
    attention_block_forward,
)
from cp_modules.kernels.prefill.grad_assembly import sum_pieces_into, sum_rows_triton
from cp_modules.kernels.prefill.pcp_blocks import (
    _rows,
    _square_groups,
    _still_needed,
    pcp_blocks_backward,
    pcp_blocks_forward,
    rectangle_backward_causal_pairs,
)
from cp_modules.ops.cp_attention import _gathered_targets
from cp_modules.ops.pcp_attention import pcp_prefill_attention
from cp_modules.ops.pcp_policy import (
    pcp_policy_args,
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
)
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy
from cp_modules.reference.lse_merge import merge_partials_reference
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    attention_with_lse,
    attention_with_lse_backward,
    pcp_prefill_attention_backward_reference,
    pcp_prefill_attention_reference,
)
from cp_modules.testing.numerics import assert_close_to_reference, max_abs_err
from cp_modules.testing.pcp import dense_prefill_attention

BATCHES = {
    "odd-lengths": ([37, 5, 3, 20], [0, 0, 0, 0]),
    "decodes-in-front": ([1, 1, 19, 4], [7, 3, 0, 0]),
    "chunked-prefill": ([29, 2, 6], [13, 5, 0]),
    "equal-lengths": ([24, 24, 24], [0, 0, 0]),
}
HEADS = {
    "GQA-4-2-D16": (4, 2, 16, 16),
    "MLA-192-128": (2, 2, 192, 128),
}


def _tensors(n, m, hq, hkv, dqk, dv, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    N, C = sum(n), sum(m)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = rnd(N, hq, dqk), rnd(N, hkv, dqk), rnd(N, hkv, dv)
    pk, pv = (rnd(C, hkv, dqk), rnd(C, hkv, dv)) if C else (None, None)
    return q, k, v, pk, pv


def _owned(plan, rank):
    # Decode tokens are replicated: count each once (on rank 0) when summing over ranks.
    is_decode = plan.is_decode[
        torch.searchsorted(plan.key_offsets, plan.token_indices, right=True) - 1
    ]
    return plan.local_valid & (~is_decode | (rank == 0))


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
@pytest.mark.parametrize("pcp", [1, 2, 3, 4, 8], ids=lambda p: f"P{p}")
def test_all_ranks_equal_dense_forward_and_backward(pcp, batch, heads):
    n, m = BATCHES[batch]
    hq, hkv, dqk, dv = HEADS[heads]
    scale = dqk**-0.5
    q, k, v, pk, pv = _tensors(n, m, hq, hkv, dqk, dv, torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v, pk, pv) if x is not None]
    want_out, want_lse = dense_prefill_attention(
        q, k, v, n, scale=scale, prefix_k=pk, prefix_v=pv, prefix_lens=m
    )
    w = torch.randn_like(want_out)
    want_grads = torch.autograd.grad((want_out * w).sum(), leaves)

    loss = 0
    for r in range(pcp):
        plan = plan_pcp(n, m, pcp, r)
        out, lse = pcp_prefill_attention(
            q[plan.token_indices], k, v, plan, scale=scale, prefix_k=pk, prefix_v=pv
        )
        valid, rows = plan.local_valid, plan.token_indices[plan.local_valid]
        assert max_abs_err(out[valid].detach(), want_out[rows].detach()) < 1e-12
        assert max_abs_err(lse[valid], want_lse[rows].detach()) < 1e-12
        assert torch.all(out[~valid] == 0) and torch.all(lse[~valid] == float("-inf"))
        assert not lse.requires_grad
        owned = _owned(plan, r)
        loss = loss + (out[owned] * w[plan.token_indices[owned]]).sum()
    grads = torch.autograd.grad(loss, leaves)
    for name, a, b in zip(["q", "k", "v", "prefix_k", "prefix_v"], grads, want_grads):
        assert max_abs_err(a, b) < 1e-12, name


@pytest.mark.parametrize("pairs", [None, True], ids=["auto", "causal-pairs"])
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
@pytest.mark.parametrize("pcp", [2, 4], ids=lambda p: f"P{p}")
def test_block_decomposition_equals_reference(pcp, batch, pairs):
    # The CUDA path (causal square + rectangle + prefix, merged by LSE; block backward with the
    # merged output and LSE) run with the reference as its block kernel; "causal-pairs" runs
    # every unmasked block with at least as many keys as queries as causal pairs.
    n, m = BATCHES[batch]
    q, k, v, pk, pv = _tensors(n, m, 4, 2, 16, 8, torch.float64, seed=1)
    for r in range(pcp):
        plan = plan_pcp(n, m, pcp, r)
        args = (
            plan.segments_host,
            pk,
            pv,
            plan.prefix_cu_seqlens_host if pk is not None else None,
            0.3,
        )
        inputs = PrefillInputs(q[plan.token_indices], k, v, *args)
        out, lse = pcp_prefill_attention_cuda(inputs)
        ref_out, ref_lse = pcp_prefill_attention_reference(inputs)
        assert max_abs_err(out, ref_out) < 1e-12
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert max_abs_err(lse[finite], ref_lse[finite]) < 1e-12
        dout = torch.randn_like(out)
        got = pcp_blocks_backward(dout, ref_out, ref_lse, inputs, causal_pairs=pairs)
        want = pcp_prefill_attention_backward_reference(dout, ref_out, ref_lse, inputs)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                assert max_abs_err(a, b) < 1e-12


@pytest.mark.parametrize("dims", [(4, 2, 12, 8), (2, 2, 8, 8)], ids=["GQA-Dqk12-Dv8", "MHA-D8"])
@pytest.mark.parametrize("L,M", [(5, 5), (5, 15), (4, 11), (2, 7)], ids=lambda x: str(x))
def test_rectangle_causal_pairs_equal_unmasked_backward(L, M, dims):
    # Lower triangles plus reversed strict upper triangles (plus the keys past the last whole
    # tile) give the unmasked block's gradients; each key row gets its pieces exactly once.
    hq, hkv, dqk, dv = dims
    g = torch.Generator().manual_seed(L * 100 + M)
    q = torch.randn(L, hq, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(M, hkv, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(M, hkv, dv, generator=g, dtype=torch.float64)
    out, lse = attention_with_lse(q, k, v, scale=0.4, causal=False)
    dout = torch.randn_like(out)
    want = attention_with_lse_backward(dout, q, k, v, out, lse, scale=0.4, causal=False)
    calls = []

    def block_backward(*args, causal, **kw):
        calls.append((args[1].shape[0], args[2].shape[0], causal))
        return attention_block_backward(*args, causal=causal, **kw)

    pq, pk, pv = rectangle_backward_causal_pairs(
        dout, q, k, v, out, lse, scale=0.4, block_backward=block_backward
    )
    got = [sum_pieces_into(torch.empty_like(x), p) for x, p in ((q, pq), (k, pk), (v, pv))]
    for name, a, b in zip("qkv", got, want):
        assert max_abs_err(a, b) < 1e-12, name
    tiles = M // L
    assert calls.count((L, L, True)) == tiles and calls.count((L - 1, L - 1, True)) == tiles
    assert len(calls) == 2 * tiles + (M % L > 0)


def test_head_and_tail_squares_share_one_call():
    # Equal-length requests: every rank's head and tail squares pair up (one batched call
    # whose second batch entry is a strided view: no copy), and the pair equals two calls.
    n, m = BATCHES["equal-lengths"]
    q, k, v, _, _ = _tensors(n, m, 4, 2, 16, 8, torch.float64, seed=5)
    for pcp in (2, 4):
        for r in range(pcp):
            plan = plan_pcp(n, m, pcp, r)
            segs = [s for s in plan.segments_host.tolist() if s[2] > 0]
            groups = _square_groups(segs)
            assert [len(g) for g in groups] == [2] * len(n)
            ql = q[plan.token_indices].contiguous()
            for a, b in groups:
                L = segs[a][2]
                qs = [segs[a][1], segs[b][1]]
                ks = [s[3] + s[4] - L for s in (segs[a], segs[b])]
                pair_q, pair_k = _rows(ql, qs, L), _rows(k, ks, L)
                assert pair_q.data_ptr() == ql[qs[0]].data_ptr()
                assert pair_k.data_ptr() == k[ks[0]].data_ptr()
                assert torch.equal(pair_q[1], ql[qs[1] : qs[1] + L])
                assert torch.equal(pair_k[1], k[ks[1] : ks[1] + L])
                both = attention_block_forward(
                    pair_q, pair_k, _rows(v, ks, L), scale=0.3, causal=True
                )
                for j in range(2):
                    one = attention_block_forward(
                        ql[qs[j] : qs[j] + L], k[ks[j] : ks[j] + L], v[ks[j] : ks[j] + L],
                        scale=0.3, causal=True,
                    )  # fmt: skip
                    assert torch.equal(both[0][j], one[0]) and torch.equal(both[1][j], one[1])
    # Unequal squares, or a second segment that does not start later, run alone.
    assert _square_groups([[0, 0, 5, 0, 5], [0, 5, 4, 0, 20]]) == [[0], [1]]
    assert _square_groups([[0, 0, 5, 10, 5], [1, 5, 5, 0, 5]]) == [[0], [1]]


@pytest.mark.parametrize("length", [48, 45], ids=["no-padding", "padded"])
def test_forward_merges_into_the_squares_output(length):
    # One request: a rank's head and tail squares are its rows in order, so without padding
    # the forward merges the rectangle into the squares' output in place (the result shares
    # its storage, as a plain tensor, not a view); with padding it falls back to a fresh
    # result whose padding rows are 0 / -inf.
    q, k, v, _, _ = _tensors([length], [0], 4, 2, 16, 8, torch.float64, seed=3)
    padded_ranks = 0
    for pcp in (2, 4):
        for r in range(pcp):
            plan = plan_pcp([length], [0], pcp, r)
            args = (plan.segments_host, None, None, None, 0.3)
            ql = q[plan.token_indices].contiguous()
            firsts = []

            def block_forward(q_, k_, v_, *, scale, causal, firsts=firsts):
                o, s = attention_block_forward(q_, k_, v_, scale=scale, causal=causal)
                if causal:
                    firsts.append(o.data_ptr())
                return o, s

            inputs = PrefillInputs(ql, k, v, *args)
            out, lse = pcp_blocks_forward(inputs, block_forward=block_forward)
            ref_out, ref_lse = pcp_prefill_attention_reference(inputs)
            assert max_abs_err(out, ref_out) < 1e-12
            valid = plan.local_valid
            assert max_abs_err(lse[valid], ref_lse[valid]) < 1e-12
            assert out._base is None and out.is_contiguous()
            assert (out.data_ptr() == firsts[0]) == bool(valid.all())
            assert torch.all(out[~valid] == 0) and torch.all(lse[~valid] == float("-inf"))
            padded_ranks += int(not valid.all())
    assert padded_ranks == (0 if length % 8 == 0 else 2)


def _check_sum_pieces(dtype, device):
    g = torch.Generator().manual_seed(7)
    n = 40
    # Overlaps of 1 to 4 pieces, uncovered rows, an empty piece, a piece ending at n; every
    # other piece stored last-row-first and marked reversed.
    spans = [(0, 10), (5, 12), (8, 3), (30, 10), (20, 0), (6, 4)]
    pieces = [(a, torch.randn(m, 3, 4, generator=g).to(dtype)) for a, m in spans]
    stored = [
        (a, x.flip(0).to(device), True) if i % 2 else (a, x.to(device))
        for i, (a, x) in enumerate(pieces)
    ]
    dst = torch.full((n, 3, 4), float("nan"), dtype=dtype, device=device)
    sum_pieces_into(dst, stored)
    dst = dst.cpu()
    want = torch.zeros(n, 3, 4, dtype=torch.float64)
    count = torch.zeros(n, dtype=torch.long)
    for a, x in pieces:
        want[a : a + x.shape[0]] += x.double()
        count[a : a + x.shape[0]] += 1
    assert count.max() == 4 and (count == 0).any()
    if dtype == torch.float64:
        assert max_abs_err(dst, want) < 1e-13
    else:
        # Rounded once from the fp32 sum: within half a bf16 ulp of the exact sum (for
        # two pieces the fp32 sum of two bf16 values is exact).
        exact = want.to(dtype).double()
        assert torch.equal(dst.double()[count <= 2], exact[count <= 2])
        ulp = want.abs().clamp_min(1e-30) * 2**-8
        assert ((dst.double() - want).abs() <= ulp).all()
    assert torch.all(dst[count == 0] == 0)
    # In two calls: the first without the pieces of some ranges (skip leaves the rows they
    # touch as they are), the second with all of them writing only those rows; into tiling
    # targets, as the training path passes them. Same rows as the one call, bit for bit.
    late = [1, 5]
    ranges = [(stored[i][0], stored[i][1].shape[0]) for i in late]
    early = [x for i, x in enumerate(stored) if i not in late]
    two = torch.full((n, 3, 4), float("nan"), dtype=dtype, device=device)
    targets = [(0, two[:17]), (17, two[17:])]
    sum_pieces_into(targets, early, skip=ranges)
    written = ~two.isnan().all(-1).all(-1).cpu()
    touched = torch.zeros(n, dtype=torch.bool)
    for a, m in ranges:
        touched[a : a + m] = True
    assert torch.equal(written, ~touched)
    sum_pieces_into(targets, stored, only=ranges)
    assert torch.equal(two.cpu(), dst)
    sum_pieces_into(targets, stored, only=[])  # nothing to write
    assert torch.equal(two.cpu(), dst)


def test_backward_keeps_only_pieces_written_after_the_squares():
    # Pieces whose rows meet a range written after the squares stay; the rest are dropped
    # (on CUDA their memory goes to the second stream's allocator first).
    pieces = [(0, torch.zeros(4, 1)), (4, torch.zeros(3, 1)), (9, torch.zeros(2, 1), True)]
    assert [p[0] for p in _still_needed(pieces, [(6, 3)], None)] == [4]
    assert [p[0] for p in _still_needed(pieces, [(3, 7)], None)] == [0, 4, 9]
    assert _still_needed(pieces, [], None) == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_sum_pieces_writes_each_row_once(dtype):
    _check_sum_pieces(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_sum_pieces_fused(dtype):
    # On CUDA runs of 2-4 pieces (and single reversed ones) go through sum_rows_triton.
    _check_sum_pieces(dtype, "cuda")


def _check_backward_into_gathered_rows(pcp, batch, dtype, device):
    # dK / dV summed straight into an all-gathered layout (the training path's reduce-scatter
    # buffer, per rank dK rows then dV rows) equal the restored-order result placed there;
    # the buffer's padding rows are zero.
    n, m = BATCHES[batch]
    q, k, v, _, _ = _tensors(n, m, 4, 2, 64, 64, dtype, device, seed=5)
    for r in range(pcp):
        plan = plan_pcp(n, m, pcp, r, device=device)
        t = plan.num_local_tokens_padded
        ql = q[plan.token_indices]
        # The block path's writes (the varlen path has a test).
        blocks = dict(policy=CPPolicy(pcp_varlen="never"))
        inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, 0.3)
        out, lse = pcp_prefill_attention_cuda(inputs, **blocks)
        dout = torch.randn_like(out)
        args = (dout, out, lse, inputs)
        dq, dk, dv, _, _ = pcp_prefill_attention_backward_cuda(*args, **blocks)
        buf = torch.full((pcp, 2, t, *k.shape[1:]), float("nan"), dtype=dtype, device=device)
        meta = SimpleNamespace(plan=plan, num_local_tokens=t)
        dk_into, dv_into = _gathered_targets(meta, buf)
        got = pcp_prefill_attention_backward_cuda(*args, dk_into=dk_into, dv_into=dv_into, **blocks)
        assert got[1] is None and got[2] is None
        if device == "cuda":
            # cuDNN accumulates dQ with atomics in no fixed order: two calls differ by roundings.
            assert max_abs_err(got[0], dq) <= 4 * torch.finfo(dtype).eps * dq.abs().max().item()
        else:
            assert torch.equal(got[0], dq)
        flat = buf.transpose(0, 1).reshape(2, pcp * t, *k.shape[1:])
        assert torch.equal(flat[0][plan.gather_index], dk)
        assert torch.equal(flat[1][plan.gather_index], dv)
        pad = torch.ones(pcp * t, dtype=torch.bool, device=device)
        pad[plan.gather_index] = False
        assert bool(pad.any()) == (batch != "equal-lengths")
        assert torch.all(flat[:, pad] == 0)


@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
@pytest.mark.parametrize("pcp", [2, 4], ids=lambda p: f"P{p}")
def test_backward_into_gathered_rows(pcp, batch):
    _check_backward_into_gathered_rows(pcp, batch, torch.float64, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("pcp", [2, 4], ids=lambda p: f"P{p}")
def test_gpu_backward_into_gathered_rows(pcp, dtype):
    # dK / dV bit-identical to the restored-order result: the same kernels, sums and roundings.
    for batch in BATCHES:
        _check_backward_into_gathered_rows(pcp, batch, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("pairs", [None, True], ids=["auto", "causal-pairs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_overlapped_gradient_writes_equal_inline(dtype, pairs):
    # The block backward writes the rows no square touches (zeros included) on a second stream
    # while the squares run: bit-identical to writing every row on one stream after all
    # blocks, with deterministic block kernels (the reference on the GPU); padding rows,
    # cached prefixes, reversed pieces (causal pairs) and gathered targets included.
    def block_backward(*args, **kw):
        return attention_block_backward(*args, **kw, backend="reference")

    for batch in BATCHES:
        n, m = BATCHES[batch]
        q, k, v, pk, pv = _tensors(n, m, 4, 2, 16, 8, dtype, "cuda", seed=3)
        for r in range(4):
            plan = plan_pcp(n, m, 4, r, device="cuda")
            pcu = plan.prefix_cu_seqlens_host if pk is not None else None
            args = (plan.segments_host, pk, pv, pcu, 0.3)
            inputs = PrefillInputs(q[plan.token_indices], k, v, *args)
            out, lse = pcp_blocks_forward(inputs)
            dout = torch.randn_like(out)
            results = []
            for overlap in (False, True):
                bk, bv = (torch.full_like(x, float("nan")) for x in (k, v))
                into = [(0, bk[:5]), (5, bk[5:])], [(0, bv[:7]), (7, bv[7:])]
                res = pcp_blocks_backward(
                    dout, out, lse, inputs, block_backward=block_backward,
                    causal_pairs=pairs, overlap_gradient_sums=overlap,
                )  # fmt: skip
                res_into = pcp_blocks_backward(
                    dout, out, lse, inputs, block_backward=block_backward,
                    causal_pairs=pairs, overlap_gradient_sums=overlap,
                    dk_into=into[0], dv_into=into[1],
                )  # fmt: skip
                results.append([*res, res_into[0], bk, bv])
            for a, b in zip(*results):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a, b), batch
            assert torch.equal(results[1][-2], results[1][1])
            assert torch.equal(results[1][-1], results[1][2])


def test_sum_rows_triton_reads_reversed_parts():
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(m, 2, 5, generator=g) for m in (9, 6, 12))
    rows = torch.full((8, 2, 5), float("nan"))
    # rows[i] = a[1 + i] + b[5 - i] (b read backwards) + c[11 - i]; rows 1..6 of the buffer.
    sum_rows_triton(rows[1:7], [(a, 1, 1), (b, 5, -1), (c, 11, -1)])
    want = a[1:7] + b.flip(0) + c.flip(0)[:6]
    assert max_abs_err(rows[1:7], want) < 1e-6
    assert torch.isnan(rows[0]).all() and torch.isnan(rows[7]).all()


def _partials(num, L, H, D, dtype, device="cpu"):
    g = torch.Generator().manual_seed(num)
    outs, lses = [], []
    for i in range(num):
        # Alternate layouts: [L, H, D] contiguous, and a [H, L, D] buffer seen as [L, H, D].
        o = (
            torch.randn(H, L, D, generator=g).transpose(0, 1)
            if i % 2
            else torch.randn(L, H, D, generator=g)
        )
        lse = (
            torch.randn(H, L, generator=g).t() * 4 if i % 2 else torch.randn(L, H, generator=g) * 4
        )
        outs.append(o.to(device=device, dtype=dtype))
        lses.append(lse.to(device))
    return outs, lses


# The interpreter's fp32 -> bf16 cast does not round to nearest: bf16 is tested on the GPU.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("num", [2, 3])
def test_triton_merge_equals_reference(num, dtype):
    outs, lses = _partials(num, 7, 3, 20, dtype)
    # The destination is a row range of a larger result: rows outside it must stay untouched.
    out = torch.full((11, 3, 20), float("nan"), dtype=dtype)
    lse = torch.full((11, 3), float("nan"))
    merge_partials_triton(outs, lses, out[2:9], lse[2:9], block_rows=8)
    want_out, want_lse = merge_partials_reference(outs, lses, dtype)
    same = merge_partials_reference([o.float() for o in outs], lses, torch.float32)[0]
    assert_close_to_reference(out[2:9], same, want_out, atol=1e-6, name="out")
    assert max_abs_err(lse[2:9], want_lse) < 1e-5
    assert torch.isnan(out[:2]).all() and torch.isnan(out[9:]).all() and torch.isnan(lse[9:]).all()


def test_block_functions_bottom_right_causal():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, 2, 8, generator=g, dtype=torch.float64) for s in (3, 7, 7))
    out, lse = attention_with_lse(q, k, v, scale=0.5, causal=True)
    # Query i of 3 sees keys 0 .. i + 4: the last query sees every key.
    for i in range(3):
        o, s = attention_with_lse(q[i : i + 1], k[: i + 5], v[: i + 5], scale=0.5, causal=False)
        assert max_abs_err(out[i], o[0]) < 1e-14 and max_abs_err(lse[i], s[0]) < 1e-6
    assert attention_block_forward(q, k, v, scale=0.5, causal=True)[0].equal(out)
    dout = torch.randn_like(out)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o, _ = attention_with_lse(qq, kk, vv, scale=0.5, causal=True)
    want = torch.autograd.grad((o * dout).sum(), (qq, kk, vv))
    got = attention_with_lse_backward(dout, q, k, v, out, lse, scale=0.5, causal=True)
    got2 = attention_block_backward(dout, q, k, v, out, lse, scale=0.5, causal=True)
    for a, b, c in zip(got, want, got2):
        assert max_abs_err(a, b) < 1e-12 and torch.equal(a, c)


def _op_args(n, m, pcp, rank, dtype=torch.float64, requires_grad=True):
    plan = plan_pcp(n, m, pcp, rank)
    q, k, v, pk, pv = _tensors(n, m, 4, 2, 8, 8, dtype, seed=4)
    ql = q[plan.token_indices].clone()
    tensors = [ql, k, v, pk, pv]
    if requires_grad:
        tensors = [None if x is None else x.requires_grad_() for x in tensors]
    ql, k, v, pk, pv = tensors
    cu = plan.prefix_cu_seqlens_host if pk is not None else None
    policy = pcp_policy_args(CPPolicy(), 8, 8)
    return plan, (ql, k, v, plan.segments_host, pk, pv, cu, 0.35, *policy)


@pytest.mark.parametrize("batch", ["odd-lengths", "chunked-prefill"])
def test_opcheck(batch):
    _, args = _op_args(*BATCHES[batch], 2, 1)
    torch.library.opcheck(torch.ops.cp.pcp_prefill_attention.default, args)
    out, lse = torch.ops.cp.pcp_prefill_attention(*args)
    ql, k, v, seg, pk, pv, cu, scale, *policy = args
    dout = torch.randn_like(out)
    bwd_args = (dout, ql.detach(), k.detach(), v.detach(), out.detach(), lse, seg)
    bwd_args += (
        None if pk is None else pk.detach(),
        None if pv is None else pv.detach(),
        cu,
        scale,
        *policy,
    )
    torch.library.opcheck(torch.ops.cp.pcp_prefill_attention_backward.default, bwd_args)


def _attend(q, k, v, plan, pk, pv):
    return pcp_prefill_attention(q, k, v, plan, scale=0.35, prefix_k=pk, prefix_v=pv)


def _mark_dynamic(plan, *tensors):
    # Token and request counts change from step to step; heads and dims do not.
    for x in (*tensors, plan.token_indices, plan.gather_index, plan.segments_host):
        torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(plan.prefix_cu_seqlens_host, 0)


def test_compiles_fullgraph_without_recompiling_for_new_batches():
    torch._dynamo.reset()
    compiled = torch.compile(_attend, fullgraph=True)
    batches = [([29, 2, 6], [13, 5, 0]), ([40, 7, 1, 1, 9], [3, 0, 8, 2, 1]), ([5, 77], [2, 30])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, (n, m) in enumerate(batches):
            plan, (ql, k, v, _, pk, pv, *_) = _op_args(n, m, 2, 1, torch.float32, False)
            if i == 0:
                _mark_dynamic(plan, ql, k, v, pk, pv)
            out, lse = compiled(ql, k, v, plan, pk, pv)
            want_out, want_lse = _attend(ql, k, v, plan, pk, pv)
            assert max_abs_err(out, want_out) < 1e-6
            assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
            assert max_abs_err(lse[~torch.isinf(lse)], want_lse[~torch.isinf(want_lse)]) < 1e-5


def test_compiled_backward_equals_eager():
    torch._dynamo.reset()
    plan, (ql, k, v, _, pk, pv, *_) = _op_args([29, 2, 6], [13, 5, 0], 2, 0, torch.float32)
    compiled = torch.compile(_attend, fullgraph=True)
    leaves = (ql, k, v, pk, pv)
    out = compiled(*leaves[:3], plan, pk, pv)[0]
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), leaves)
    want = torch.autograd.grad((_attend(*leaves[:3], plan, pk, pv)[0] * w).sum(), leaves)
    for a, b in zip(got, want):
        assert max_abs_err(a, b) < 1e-6


def test_invalid_arguments_raise_value_error():
    plan, (ql, k, v, _, pk, pv, *_) = _op_args([29, 2, 6], [13, 5, 0], 2, 0, torch.float32, False)
    bad = {
        "q must hold": dict(q=ql[1:]),
        "k_full and v_full must hold": dict(k_full=k[1:]),
        "multiple of the KV heads": dict(
            k_full=k[:, :1].expand(-1, 3, -1).contiguous(),
            v_full=v[:, :1].expand(-1, 3, -1).contiguous(),
        ),
        "head dims must match": dict(k_full=k[..., :4]),
        "share a dtype": dict(v_full=v.double()),
        "given together": dict(prefix_v=None),
        "prefix_k must be": dict(prefix_k=pk[:, :1]),
        "one entry per request": dict(prefix_cu_seqlens=torch.tensor([0, 13])),
        "rise from 0": dict(prefix_cu_seqlens=torch.tensor([0, 13, 12, 18])),
        "3-D": dict(q=ql[0]),
    }
    for match, override in bad.items():
        kwargs = dict(q=ql, k_full=k, v_full=v, plan=plan, prefix_k=pk, prefix_v=pv)
        kwargs.update(override)
        with pytest.raises(ValueError, match=match):
            pcp_prefill_attention(scale=0.3, **kwargs)


# ---------------------------------------------------------------- GPU

GPU_CASES = {
    # name: (num_scheduled, num_computed, Hq, Hkv, Dqk, Dv)
    "MHA-D128-prefix": ([700, 1, 1, 333, 64], [0, 90, 40, 250, 0], 4, 4, 128, 128),
    "GQA-8-2-D128": ([1000, 17, 3], [0, 0, 0], 8, 2, 128, 128),
    "MLA-192-128-prefix": ([513, 1, 900], [0, 30, 128], 4, 4, 192, 128),
    # One request without padding: the result is the squares' output, merged in place.
    "GQA-one-request": ([1536], [0], 8, 2, 128, 128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["blocks", "varlen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("pcp", [2, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_gpu_all_ranks_equal_dense(case, pcp, dtype, path):
    # "varlen": every batch through the one-call path (FlashAttention-2 serves 16-bit dtypes).
    if path == "varlen" and dtype == torch.float32:
        pytest.skip("FlashAttention-2 takes 16-bit inputs only")
    limits = dict.fromkeys(CPPolicy().varlen_max_flop_per_segment, float("inf"))
    policy = CPPolicy(varlen_max_flop_per_segment=limits if path == "varlen" else {})
    n, m, hq, hkv, dqk, dv = GPU_CASES[case]
    scale = dqk**-0.5
    t32 = _tensors(n, m, hq, hkv, dqk, dv, torch.float32, "cuda")
    leaves32 = [x.requires_grad_() for x in t32 if x is not None]
    leaves = [x.detach().to(dtype).requires_grad_() for x in leaves32]
    q, k, v, pk, pv = (leaves + [None, None])[:5]
    prefix32 = dict(prefix_k=t32[3], prefix_v=t32[4], prefix_lens=m if sum(m) else None)
    want32, _ = dense_prefill_attention(*leaves32[:3], n, scale=scale, **prefix32)
    same, _ = dense_prefill_attention(
        q, k, v, n, scale=scale, prefix_k=pk, prefix_v=pv, prefix_lens=prefix32["prefix_lens"],
        upcast=False,
    )  # fmt: skip
    w = torch.randn_like(want32)
    g32 = torch.autograd.grad((want32 * w).sum(), leaves32)
    gsame = torch.autograd.grad((same.float() * w).sum(), leaves)
    want32 = want32.detach()
    base = same.detach() if dtype != torch.float32 else None
    # Sum the ranks' gradients in fp32, as a check of each rank's kernels (in training the
    # reduce-scatter adds them in the wire dtype).
    totals = [torch.zeros(x.shape, device="cuda") for x in leaves]
    for r in range(pcp):
        plan = plan_pcp(n, m, pcp, r, device="cuda")
        out, _ = pcp_prefill_attention(
            q[plan.token_indices], k, v, plan, scale=scale, prefix_k=pk, prefix_v=pv, policy=policy
        )
        valid, rows = plan.local_valid, plan.token_indices[plan.local_valid]
        assert_close_to_reference(
            out[valid].detach(),
            want32[rows],
            None if base is None else base[rows],
            atol=1e-4,
            name=f"out rank {r}",
        )
        assert torch.all(out[~valid] == 0)
        owned = _owned(plan, r)
        loss = (out[owned].float() * w[plan.token_indices[owned]]).sum()
        for t, g in zip(totals, torch.autograd.grad(loss, leaves)):
            t += g.float()
    for name, a, b, c in zip(["dq", "dk", "dv", "dprefix_k", "dprefix_v"], totals, g32, gsame):
        c = c if dtype != torch.float32 else None
        assert_close_to_reference(a, b, c, atol=1e-3 if c is not None else 1e-4, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dims", [(8, 8, 128, 128), (8, 2, 64, 64), (4, 4, 192, 128)], ids=["MHA", "GQA", "MLA"]
)
def test_gpu_rectangle_causal_pairs_equal_unmasked_backward(dims):
    # On the GPU kernels (cuDNN where it serves the shape): 2 whole tiles and a remainder.
    hq, hkv, dqk, dv = dims
    L, M = 320, 777
    q, k, v = (
        torch.randn(s, h, d, device="cuda", dtype=torch.bfloat16)
        for s, h, d in ((L, hq, dqk), (M, hkv, dqk), (M, hkv, dv))
    )
    q32, k32, v32 = (x.float() for x in (q, k, v))
    out32, lse32 = attention_with_lse(q32, k32, v32, scale=0.1, causal=False)
    out, lse = attention_block_forward(q, k, v, scale=0.1, causal=False)
    dout = torch.randn_like(out)
    pieces = rectangle_backward_causal_pairs(dout, q, k, v, out, lse, scale=0.1)
    got = [sum_pieces_into(torch.empty_like(x), p) for x, p in zip((q, k, v), pieces)]
    want = attention_with_lse_backward(
        dout.float(), q32, k32, v32, out32, lse32, scale=0.1, causal=False
    )
    lp = [x.clone().requires_grad_() for x in (q, k, v)]
    same = _low_precision_attention(*lp, scale=0.1, causal=False)
    base = torch.autograd.grad(same, lp, dout)
    for name, a, b, c in zip(["dq", "dk", "dv"], got, want, base):
        assert_close_to_reference(a, b, c, atol=1e-5, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BLOCK_BACKENDS, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["square-causal", "rectangle"])
@pytest.mark.parametrize(
    "dims", [(8, 8, 128, 128), (8, 2, 64, 64), (4, 4, 192, 128)], ids=["MHA", "GQA", "MLA"]
)
def test_gpu_block_backends_forward_and_backward(backend, causal, dims):
    hq, hkv, dqk, dv = dims
    L, M = (300, 300) if causal else (300, 777)
    q, k, v = (
        torch.randn(s, h, d, device="cuda", dtype=torch.bfloat16)
        for s, h, d in ((L, hq, dqk), (M, hkv, dqk), (M, hkv, dv))
    )
    qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
    params = torch.backends.cuda.SDPAParams(qt, kt, vt, None, 0.0, causal, hq != hkv)
    usable = {
        "cudnn": (hq == hkv or CUDNN_GQA)
        and torch.backends.cuda.can_use_cudnn_attention(params, False),
        "flash": dqk == dv and torch.backends.cuda.can_use_flash_attention(params, False),
        "reference": True,
    }
    if not usable[backend]:
        pytest.skip(f"{backend} does not serve this shape here")
    # fp32 reference on the same (bf16-valued) inputs; bf16 PyTorch attention as the 2x base.
    q32, k32, v32 = (x.float() for x in (q, k, v))
    out32, lse32 = attention_with_lse(q32, k32, v32, scale=0.1, causal=causal)
    lp = [x.clone().requires_grad_() for x in (q, k, v)]
    same = _low_precision_attention(*lp, scale=0.1, causal=causal)

    out, lse = attention_block_forward(q, k, v, scale=0.1, causal=causal, backend=backend)
    assert_close_to_reference(out, out32, same.detach(), atol=1e-5, name="out")
    assert max_abs_err(lse, lse32) < 1e-3
    dout = torch.randn_like(out)
    got = attention_block_backward(
        dout, q, k, v, out, lse, scale=0.1, causal=causal, backend=backend
    )
    want = attention_with_lse_backward(
        dout.float(), q32, k32, v32, out32, lse32, scale=0.1, causal=causal
    )
    base = torch.autograd.grad(same, lp, dout)
    for name, a, b, c in zip(["dq", "dk", "dv"], got, want, base):
        assert_close_to_reference(a, b, c, atol=1e-5, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("dims", [(8, 8, 128), (8, 2, 128)], ids=["MHA", "GQA"])
def test_gpu_paired_squares_equal_separate_calls(backend, dims):
    # Two squares read through one strided [2, L, H, D] view (batch stride = distance between
    # the blocks) give what two separate calls give, forward and backward.
    hq, hkv, d = dims
    T, N, L = 700, 1500, 256
    q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(N, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
    qs, ks = [10, 400], [100, 1111]
    pair = [_rows(x, s, L) for x, s in ((q, qs), (k, ks), (v, ks))]
    if backend == "cudnn" and hq != hkv and not CUDNN_GQA:
        pytest.skip("this PyTorch's cuDNN entry takes no GQA")
    out, lse = attention_block_forward(*pair, scale=0.1, causal=True, backend=backend)
    grads = attention_block_backward(
        _rows(dout, qs, L), *pair, out, lse, scale=0.1, causal=True, backend=backend
    )
    for j, (a, b) in enumerate(zip(qs, ks)):
        one = (q[a : a + L], k[b : b + L], v[b : b + L])
        o, s = attention_block_forward(*one, scale=0.1, causal=True, backend=backend)
        g = attention_block_backward(
            dout[a : a + L], *one, out[j], lse[j], scale=0.1, causal=True, backend=backend
        )
        assert max_abs_err(out[j], o) == 0 and max_abs_err(lse[j], s) < 1e-6
        # Kernels may accumulate in a different order between calls: within 2 bf16 ulps.
        for name, x, y in zip(("dq", "dk", "dv"), (t[j] for t in grads), g):
            assert max_abs_err(x, y) <= 2**-7 * y.abs().max().item(), name


def _low_precision_attention(q, k, v, *, scale, causal):
    """Attention computed by plain PyTorch in the inputs' dtype (the tolerance rule's base)."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("lhd,mhd->hlm", q, k.repeat_interleave(group, 1)) * scale
    if causal:
        L, M = q.shape[0], k.shape[0]
        i = torch.arange(L, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(M, device=q.device)[None, :] > i + M - L, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hlm,mhd->lhd", p, v.repeat_interleave(group, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num", [2, 3])
def test_gpu_triton_merge_equals_reference(num, dtype):
    outs, lses = _partials(num, 3000, 32, 128, dtype, "cuda")
    out = torch.full((3100, 32, 128), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((3100, 32), float("nan"), device="cuda")
    merge_partials_triton(outs, lses, out[50:3050], lse[50:3050])
    want_out, want_lse = merge_partials_reference(outs, lses, dtype)
    same = merge_partials_reference([o.float() for o in outs], lses, torch.float32)[0]
    assert_close_to_reference(out[50:3050], same, want_out, atol=1e-6, name="out")
    assert max_abs_err(lse[50:3050], want_lse) < 1e-5
    assert torch.isnan(out[:50]).all() and torch.isnan(out[3050:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", ["odd-lengths", "chunked-prefill"])
def test_gpu_opcheck(batch):
    plan, args = _op_args(*BATCHES[batch], 2, 1, torch.bfloat16)
    args = tuple(
        x.cuda().detach().requires_grad_()
        if isinstance(x, torch.Tensor) and x.is_floating_point()
        else x
        for x in args
    )
    torch.library.opcheck(torch.ops.cp.pcp_prefill_attention.default, args)


@pytest.mark.gpu
def test_gpu_compiles_without_recompiling():
    torch._dynamo.reset()
    compiled = torch.compile(_attend, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, (n, m) in enumerate(
            [([300, 2, 60], [13, 5, 0]), ([400, 70, 1, 1, 90], [3, 0, 8, 2, 1])]
        ):
            plan = plan_pcp(n, m, 2, 1, device="cuda")
            q, k, v, pk, pv = _tensors(n, m, 4, 2, 64, 64, torch.bfloat16, "cuda")
            ql = q[plan.token_indices]
            if i == 0:
                _mark_dynamic(plan, ql, k, v, pk, pv)
            out, _ = compiled(ql, k, v, plan, pk, pv)
            want, _ = _attend(ql, k, v, plan, pk, pv)
            assert max_abs_err(out, want) == 0.0


def test_triton_merge_into_its_first_partial_with_wide_rows():
    # The in-place form writes into the first partial's own output and LSE; with more columns
    # than one block (D = 200: two column blocks) every block still reads the input LSEs.
    outs, lses = _partials(2, 5, 2, 200, torch.float32)
    want_out, want_lse = merge_partials_reference(outs, lses, torch.float32)
    out, lse = outs[0].clone(), lses[0].clone()
    merge_partials_triton([out, outs[1]], [lse, lses[1]], out, lse)
    assert max_abs_err(out, want_out) < 1e-5 and max_abs_err(lse, want_lse) < 1e-5
