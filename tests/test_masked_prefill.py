"""The masked PCP prefill paths (sliding windows and soft-capping: FlashAttention-2's window
arguments and FlexAttention, one packed call per step) against the head/tail reference and
the dense masked-softmax oracle: outputs, LSEs and gradients through the op, for every rank
of plans of 1-3 ranks. On CPU the paths run their packing with the kernels' CPU twins (the
reference per packed sequence; eager FlexAttention forward and its dense twin backward);
the GPU tier runs the kernels themselves in bf16 against the fp64 oracle by the 2x rule."""

from __future__ import annotations

import pytest
import torch

from cp_modules.kernels.masked.prefill import masked_pack
from cp_modules.ops.cp_attention import gqa_attention
from cp_modules.ops.pcp_attention import pcp_prefill_attention
from cp_modules.ops.pcp_masked import choose_masked_path
from cp_modules.ops.pcp_policy import pcp_policy_args
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy
from cp_modules.reference.masked_attention import dense_attention
from cp_modules.step import CPRuntime, build_step_metadata, cp_step, restore_tokens

H, HKV, D = 4, 2, 8
NEW = [23, 4, 9]
# Per-request cached prefixes (chunked prefill), or None: no prefix at all.
CACHES = {"prefix": [0, 5, 3], "no-prefix": None}
# A window smaller than a chunk (3), spanning chunks (7), longer than every sequence (64);
# soft-cap alone and with a window.
FEATURES = {
    "W3": (3, None),
    "W7": (7, None),
    "W64": (64, None),
    "c2": (None, 2.0),
    "W5-c1.5": (5, 1.5),
}


def _parallel(tp, pcp, dcp, backend="ag_rs"):
    from cp_modules.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                          decode_context_parallel_size=dcp, dcp_comm_backend=backend)  # fmt: skip


def _sequences(new, cached, h, hkv, d, seed=0):
    # q, k, v, dout per request over its whole sequence (prefix first), fp64.
    g = torch.Generator().manual_seed(seed)
    cached = cached or [0] * len(new)
    mk = lambda heads: [  # noqa: E731
        torch.randn(n + c, heads, d, generator=g, dtype=torch.float64) for n, c in zip(new, cached)
    ]
    return mk(h), mk(hkv), mk(hkv), mk(h)


def _oracle(seqs, cached, scale, window, softcap):
    """Per request: out, lse of the new tokens' rows and the gradients (q, k, v over the
    whole sequence) of sum(out * dout) over those rows."""
    res = []
    cached = cached or [0] * len(seqs[0])
    for (q, k, v, do), c in zip(zip(*seqs), cached):
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        o, lse = dense_attention(q, k, v, scale=scale, sliding_window=window, softcap=softcap)
        grads = torch.autograd.grad(o[c:], (q, k, v), do[c:])
        res.append((o[c:].detach(), lse[c:].detach(), grads))
    return res


def _run_op(seqs, new, cached, pcp, rank, scale, window, softcap, policy, device, dtype):
    """One rank's op call with leaves; returns (plan, leaves, out, lse)."""
    qs, ks, vs, _ = seqs
    c = cached or [0] * len(new)
    cat_new = lambda xs: torch.cat([x[n:] for x, n in zip(xs, c)])  # noqa: E731
    cat_pre = lambda xs: torch.cat([x[:n] for x, n in zip(xs, c)])  # noqa: E731
    plan = plan_pcp(new, c, pcp, rank, decode_threshold=0)
    to = lambda x: x.to(device, dtype).requires_grad_()  # noqa: E731
    q = to(cat_new(qs)[plan.token_indices])
    k, v = to(cat_new(ks)), to(cat_new(vs))
    prefix = {}
    leaves = [q, k, v]
    if cached is not None:
        pk, pv = to(cat_pre(ks)), to(cat_pre(vs))
        prefix = dict(prefix_k=pk, prefix_v=pv)
        leaves += [pk, pv]
    out, lse = pcp_prefill_attention(
        q, k, v, plan, scale=scale, policy=policy, sliding_window=window, softcap=softcap,
        **prefix,
    )  # fmt: skip
    return plan, leaves, out, lse


def _gathered_oracle(oracle, plan, cached, n_req):
    c = cached or [0] * n_req
    out = torch.cat([o for o, _, _ in oracle])[plan.token_indices]
    lse = torch.cat([s for _, s, _ in oracle])[plan.token_indices]
    dq = torch.cat([g[0][n:] for (_, _, g), n in zip(oracle, c)])
    dk = torch.cat([g[1][n:] for (_, _, g), n in zip(oracle, c)])
    dv = torch.cat([g[2][n:] for (_, _, g), n in zip(oracle, c)])
    dpk = torch.cat([g[1][:n] for (_, _, g), n in zip(oracle, c)])
    dpv = torch.cat([g[2][:n] for (_, _, g), n in zip(oracle, c)])
    return out, lse, (dq, dk, dv, dpk, dpv)


@pytest.mark.parametrize("cache", list(CACHES), ids=list(CACHES))
@pytest.mark.parametrize("window, softcap", list(FEATURES.values()), ids=list(FEATURES))
def test_masked_paths_equal_the_reference_and_the_oracle(window, softcap, cache):
    cached = CACHES[cache]
    scale = D**-0.5
    seqs = _sequences(NEW, cached, H, HKV, D)
    oracle = _oracle(seqs, cached, scale, window, softcap)
    paths = ["flex", "reference"] + (["flash"] if softcap is None else [])
    for pcp in (1, 2, 3):
        sums = {p: None for p in paths}
        for rank in range(pcp):
            plan = plan_pcp(NEW, cached or [0] * 3, pcp, rank, decode_threshold=0)
            want_out, want_lse, want_grads = _gathered_oracle(oracle, plan, cached, 3)
            valid = plan.local_valid
            dout = torch.cat([do[n:] for do, n in zip(seqs[3], cached or [0] * 3)])
            dout = dout[plan.token_indices] * valid[:, None, None]
            results = {}
            for path in paths:
                policy = CPPolicy(pcp_masked=path)
                _, leaves, out, lse = _run_op(seqs, NEW, cached, pcp, rank, scale, window,
                                              softcap, policy, "cpu", torch.float64)  # fmt: skip
                grads = torch.autograd.grad(out, leaves, dout)
                results[path] = (out, lse, grads)
                # Padding rows: 0 and -inf.
                assert torch.equal(out[~valid], torch.zeros_like(out[~valid])), path
                assert bool(torch.isneginf(lse[~valid]).all()), path
                torch.testing.assert_close(out[valid], want_out[valid], atol=1e-13, rtol=1e-12)
                torch.testing.assert_close(lse[valid], want_lse[valid], atol=1e-13, rtol=1e-12)
                # Gradients summed over the ranks (each query lives on one rank).
                dq_full = torch.zeros_like(want_grads[0])
                dq_full.index_add_(0, plan.token_indices[valid], grads[0][valid])
                part = (dq_full, *grads[1:])
                sums[path] = (
                    part if sums[path] is None else [a + b for a, b in zip(sums[path], part)]
                )
            ref_out, ref_lse, ref_grads = results["reference"]
            for path in paths:
                out, lse, grads = results[path]
                torch.testing.assert_close(out, ref_out, atol=1e-13, rtol=1e-12, msg=path)
                torch.testing.assert_close(lse, ref_lse, atol=1e-13, rtol=1e-12, msg=path)
                for name, g, r in zip(("dq", "dk", "dv", "dpk", "dpv"), grads, ref_grads):
                    torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-11, msg=f"{path} {name}")
        n_grads = 5 if cached is not None else 3
        for path in paths:
            for name, g, w in zip(
                ("dq", "dk", "dv", "dpk", "dpv"), sums[path], want_grads[:n_grads]
            ):
                torch.testing.assert_close(
                    g, w, atol=1e-12, rtol=1e-11, msg=f"pcp{pcp} {path} {name}"
                )


def test_pack_keeps_the_keys_a_window_sees():
    # Sequence by sequence: its queries' local rows, and the last q_len + W - 1 keys of its
    # request's prefix + new keys (all of them when fewer), as rows of [k; prefix_k] with
    # their positions; queries at positions prefix + k_len - q_len + i.
    new, cached, window = [23, 4, 9], [0, 5, 3], 4
    plan = plan_pcp(new, cached, 2, 1, decode_threshold=0)
    cu = plan.prefix_cu_seqlens_host.tolist()
    num_new = sum(new)
    pack = masked_pack(plan.segments_host, num_new, cu, window, "cpu")
    segs = [s for s in plan.segments_host.tolist() if s[2]]
    want = {k: [] for k in ("q_index", "k_index", "q_pos", "k_pos", "q_seq", "k_seq")}
    for i, (req, qs, ql, ks, kl) in enumerate(segs):
        plen = cu[req + 1] - cu[req]
        total = plen + kl
        rows = [num_new + cu[req] + p for p in range(plen)] + list(range(ks, ks + kl))
        first = max(0, total - ql - window + 1)
        want["q_index"] += range(qs, qs + ql)
        want["q_pos"] += range(total - ql, total)
        want["q_seq"] += [i] * ql
        want["k_index"] += rows[first:]
        want["k_pos"] += range(first, total)
        want["k_seq"] += [i] * (total - first)
    for name, values in want.items():
        assert getattr(pack, name).tolist() == values, name
    assert pack.cu_q_host == [0, *torch.tensor([s[2] for s in segs]).cumsum(0).tolist()]
    assert pack.max_k == max(b - a for a, b in zip(pack.cu_k_host, pack.cu_k_host[1:]))
    # Without a window every key of the sequence stays.
    full = masked_pack(plan.segments_host, num_new, cu, None, "cpu")
    assert full.cu_k_host[-1] == sum(cu[s[0] + 1] - cu[s[0]] + s[4] for s in segs)


@pytest.mark.parametrize(
    "path, window, softcap", [("flex", 5, 1.5), ("flex", None, 2.0), ("flash", 3, None)]
)
def test_sinks_with_masked_paths_equal_the_oracle(path, window, softcap):
    # gqa_attention with sinks on a masked path: the sinks are applied after the attention,
    # and the backward is fed the sink-normalised output and LSE (FlexAttention's recompute
    # turns them into dO and dLSE). Output and every gradient, the sinks' too.
    lens = [13, 1, 6]
    g = torch.Generator().manual_seed(3)
    n = sum(lens)
    q0, k0, v0 = (torch.randn(n, h, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV))
    s0, dout = (
        torch.randn(H, generator=g, dtype=torch.float64),
        torch.randn(n, H, D, generator=g, dtype=torch.float64),
    )
    scale = D**-0.5
    leaves = [x.clone().requires_grad_() for x in (q0, k0, v0, s0)]
    outs, a = [], 0
    for m in lens:
        q, k, v = (x[a : a + m] for x in leaves[:3])
        outs.append(dense_attention(q, k, v, scale=scale, sliding_window=window, softcap=softcap,
                                    sinks=leaves[3])[0])  # fmt: skip
        a += m
    want = torch.cat(outs)
    want_grads = torch.autograd.grad(want, leaves, dout)
    rt = CPRuntime.single(policy=CPPolicy(pcp_masked=path))
    meta = build_step_metadata(rt, lens)
    idx = meta.token_indices
    leaves = [x.clone().requires_grad_() for x in (q0[idx], k0[idx], v0[idx], s0)]
    with cp_step(meta):
        out = gqa_attention(*leaves[:3], scale=scale, sinks=leaves[3], sliding_window=window,
                            softcap=softcap)  # fmt: skip
    torch.testing.assert_close(restore_tokens(out, meta), want, atol=1e-13, rtol=1e-12)
    grads = torch.autograd.grad(out, leaves, dout[idx] * meta.plan.local_valid[:, None, None])
    for name, gr, w in zip("qkv", grads[:3], want_grads[:3]):
        torch.testing.assert_close(restore_tokens(gr, meta), w, atol=1e-12, rtol=1e-11, msg=name)
    torch.testing.assert_close(grads[3], want_grads[3], atol=1e-12, rtol=1e-11, msg="sinks")


@pytest.mark.parametrize("path", ["flex", "flash"])
def test_a_rank_of_padding_only(path):
    # One token over 2 ranks: rank 1 holds padding only (0 / -inf, zero gradients), with a
    # cached prefix that its missing queries would have read.
    seqs = _sequences([1], [3], H, HKV, D)
    _, leaves, out, lse = _run_op(seqs, [1], [3], 2, 1, 0.3, 2, None,
                                  CPPolicy(pcp_masked=path), "cpu", torch.float64)  # fmt: skip
    assert out.shape[0] > 0 and not out.abs().any() and bool(torch.isneginf(lse).all())
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert len(grads) == 5 and not any(g.abs().any() for g in grads)


@pytest.mark.parametrize("window", [None, 1, 40, 300], ids=["no-window", "W1", "W40", "W300"])
def test_flex_block_tables_equal_the_mask(window):
    # The block sparsity built from the key ranges equals what FlexAttention derives from
    # the mask itself (create_block_mask): partial and full kv blocks of every query block.
    # Small blocks, so that sequences straddle blocks and full blocks occur.
    from torch.nn.attention.flex_attention import create_block_mask

    from cp_modules.kernels.masked.prefill import flex_block_tables

    new, cached = [230, 4, 90, 61], [0, 50, 3, 0]
    num_full = 0
    for pcp, rank in ((1, 0), (2, 1), (3, 0)):
        plan = plan_pcp(new, cached, pcp, rank, decode_threshold=0)
        pack = masked_pack(
            plan.segments_host, sum(new), plan.prefix_cu_seqlens_host.tolist(), window, "cpu"
        )
        tq, tk = pack.num_queries, pack.cu_k_host[-1]
        for block in (16, 32):
            want = create_block_mask(pack.mask_mod(), None, None, tq, tk, "cpu", BLOCK_SIZE=block)
            num, idx, fnum, fidx = flex_block_tables(pack, block)
            w_num, w_idx = want.kv_num_blocks[0, 0], want.kv_indices[0, 0]
            w_fnum, w_fidx = want.full_kv_num_blocks[0, 0], want.full_kv_indices[0, 0]
            assert len(num) == len(w_num)
            for i in range(len(num)):
                assert sorted(idx[i, : num[i]]) == sorted(w_idx[i, : w_num[i]].tolist()), i
                assert sorted(fidx[i, : fnum[i]]) == sorted(w_fidx[i, : w_fnum[i]].tolist()), i
            num_full += int(fnum.sum())
    assert num_full > 0 or window == 1  # the cases have full blocks to classify


def test_opcheck_of_the_masked_op():
    new, cached = [23, 4, 9], [0, 5, 3]
    seqs = _sequences(new, cached, H, HKV, D, seed=5)
    plan = plan_pcp(new, cached, 2, 0, decode_threshold=0)
    cat_new = lambda xs: torch.cat([x[n:] for x, n in zip(xs, cached)])  # noqa: E731
    cat_pre = lambda xs: torch.cat([x[:n] for x, n in zip(xs, cached)])  # noqa: E731
    q = cat_new(seqs[0])[plan.token_indices].requires_grad_()
    k, v = cat_new(seqs[1]).requires_grad_(), cat_new(seqs[2]).requires_grad_()
    pk, pv = cat_pre(seqs[1]).requires_grad_(), cat_pre(seqs[2]).requires_grad_()
    op = torch.ops.cp.pcp_prefill_attention.default
    tensors = (q, k, v, plan.segments_host, pk, pv, plan.prefix_cu_seqlens_host, 0.3)
    flash = pcp_policy_args(CPPolicy(pcp_masked="flash"), D, D)
    torch.library.opcheck(op, (*tensors, *flash, 5, 0.0))
    # Eager FlexAttention evaluates its mask under vmap, which does not run under opcheck's
    # dispatch modes (schema check, fake cross-check): the flex path's CPU twin is checked
    # for its autograd registration; the schema and fake are the op's, checked above.
    flex = pcp_policy_args(CPPolicy(pcp_masked="flex"), D, D)
    torch.library.opcheck(op, (*tensors, *flex, 5, 1.5), test_utils="test_autograd_registration")


def test_masked_path_choice_and_refusals():
    q, v = torch.zeros(4, H, D), torch.zeros(6, HKV, D)
    # CPU: auto is the reference; forced paths run their CPU twins.
    assert choose_masked_path("auto", q, v, 4, None) == "reference"
    assert choose_masked_path("flex", q, v, None, 2.0) == "flex"
    assert choose_masked_path("flash", q, v, 4, None) == "flash"
    assert choose_masked_path("reference", q, v, 4, 2.0) == "reference"
    with pytest.raises(ValueError, match="pcp_masked='flash'.*without soft-capping"):
        choose_masked_path("flash", q, v, 4, 2.0)
    with pytest.raises(ValueError, match="pcp_masked='flash'.*without soft-capping"):
        choose_masked_path("flash", q, v, None, 2.0)
    with pytest.raises(ValueError, match="pcp_masked must be one of"):
        CPPolicy(pcp_masked="triton")
    # Through the public function, before any kernel runs.
    plan = plan_pcp([5], [0], 1, 0)
    qq, kk = torch.zeros(plan.token_indices.shape[0], H, D), torch.zeros(5, HKV, D)
    with pytest.raises(ValueError, match="without soft-capping"):
        pcp_prefill_attention(qq, kk, kk, plan, scale=1.0, softcap=1.0,
                              policy=CPPolicy(pcp_masked="flash"))  # fmt: skip


# --------------------------------------------------------------------------- GPU tier

GPU_NEW, GPU_CACHED = [300, 1, 77, 1024], [0, 40, 17, 0]


def _two_x(got, same, want, name):
    err = (got - want).abs().max()
    bound = 2 * (same - want).abs().max() + 1e-3 * want.abs().max()
    assert err <= bound, (name, float(err), float(bound))


def _dense_rows(seqs, cached, scale, window, softcap, dtype, device):
    """Per-request dense attention in ``dtype`` on ``device``: (out rows of the new tokens,
    lse rows, grads of q/k/v) as fp64 CPU tensors."""
    res = []
    for (q, k, v, do), c in zip(zip(*seqs), cached):
        q, k, v = (x.to(device, dtype).requires_grad_() for x in (q, k, v))
        o, lse = dense_attention(q, k, v, scale=scale, sliding_window=window, softcap=softcap)
        grads = torch.autograd.grad(o[c:], (q, k, v), do[c:].to(device, dtype))
        res.append(
            (o[c:].double().cpu(), lse[c:].double().cpu(), [x.double().cpu() for x in grads])
        )
    return res


@pytest.mark.gpu
@pytest.mark.parametrize(
    "path, window, softcap",
    [("flash", 16, None), ("flash", 200, None), ("flash", 4096, None), ("flex", 16, None),
     ("flex", 200, 30.0), ("flex", None, 30.0), ("auto", 64, None), ("auto", 64, 20.0)],
)  # fmt: skip
def test_gpu_masked_paths_follow_the_two_x_rule(path, window, softcap):
    # bf16 on CUDA against the fp64 oracle: output, LSE and every gradient (q, k, v and the
    # cached prefix), summed over the ranks of a 2-rank plan, at most twice the error of the
    # same-dtype dense reference (plus a small floor).
    h, hkv, d = 8, 2, 64
    scale = d**-0.5
    seqs = _sequences(GPU_NEW, GPU_CACHED, h, hkv, d, seed=1)
    want = _dense_rows(seqs, GPU_CACHED, scale, window, softcap, torch.float64, "cpu")
    same = _dense_rows(seqs, GPU_CACHED, scale, window, softcap, torch.bfloat16, "cuda")
    policy = CPPolicy(pcp_masked=path)
    pcp = 2
    sums = None
    for rank in range(pcp):
        plan, leaves, out, lse = _run_op(seqs, GPU_NEW, GPU_CACHED, pcp, rank, scale, window,
                                         softcap, policy, "cuda", torch.bfloat16)  # fmt: skip
        valid = plan.local_valid
        idx = plan.token_indices
        for name, which, got in (("out", 0, out), ("lse", 1, lse)):
            w = torch.cat([r[which] for r in want])[idx][valid]
            s = torch.cat([r[which] for r in same])[idx][valid]
            _two_x(got.double().cpu()[valid], s, w, name)
        assert bool(torch.isneginf(lse[~valid.cuda()]).all())
        dout = torch.cat([do[c:] for do, c in zip(seqs[3], GPU_CACHED)])[idx]
        dout = (dout * valid[:, None, None]).to("cuda", torch.bfloat16)
        grads = [g.double().cpu() for g in torch.autograd.grad(out, leaves, dout)]
        dq = torch.zeros(sum(GPU_NEW), h, d, dtype=torch.float64)
        dq.index_add_(0, idx[valid], grads[0][valid])
        part = [dq, *grads[1:]]
        sums = part if sums is None else [a + b for a, b in zip(sums, part)]

    def split(res):
        c = GPU_CACHED
        return [
            torch.cat([r[2][0][n:] for r, n in zip(res, c)]),
            torch.cat([r[2][1][n:] for r, n in zip(res, c)]),
            torch.cat([r[2][2][n:] for r, n in zip(res, c)]),
            torch.cat([r[2][1][:n] for r, n in zip(res, c)]),
            torch.cat([r[2][2][:n] for r, n in zip(res, c)]),
        ]

    for name, g, s, w in zip(("dq", "dk", "dv", "dpk", "dpv"), sums, split(same), split(want)):
        _two_x(g, s, w, name)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "path, window, softcap", [("flex", 100, 20.0), ("flash", 100, None), ("auto", 100, None)]
)
def test_gpu_sinks_on_masked_paths_follow_the_two_x_rule(path, window, softcap):
    # Sinks after the attention on CUDA: the flash and flex backward kernels take the
    # sink-normalised output and LSE as they are.
    torch.manual_seed(0)
    lens = [300, 1, 77]
    h, hkv, d = 8, 2, 64
    n = sum(lens)
    q, k, v = (torch.randn(n, x, d, dtype=torch.float64) for x in (h, hkv, hkv))
    s, dout = torch.randn(h, dtype=torch.float64), torch.randn(n, h, d, dtype=torch.float64)
    scale = d**-0.5

    def dense(qq, kk, vv, ss):
        outs, a = [], 0
        for m in lens:
            outs.append(dense_attention(qq[a : a + m], kk[a : a + m], vv[a : a + m], scale=scale,
                                        sliding_window=window, softcap=softcap, sinks=ss)[0])  # fmt: skip
            a += m
        return torch.cat(outs)

    def grads(fn, dtype, device):
        xs = [t.to(device, dtype).requires_grad_() for t in (q, k, v, s)]
        out = fn(*xs)
        g = torch.autograd.grad(out, xs, dout.to(device, out.dtype))
        return [t.double().cpu() for t in (out, *g)]

    want = grads(dense, torch.float64, "cpu")
    same = grads(dense, torch.bfloat16, "cuda")
    rt = CPRuntime.single(policy=CPPolicy(pcp_masked=path))
    meta = build_step_metadata(rt, lens, device="cuda")
    idx, valid = meta.token_indices, meta.plan.local_valid

    def cp(qq, kk, vv, ss):
        with cp_step(meta):
            out = gqa_attention(qq[idx].contiguous(), kk[idx].contiguous(), vv[idx].contiguous(),
                                scale=scale, sinks=ss, sliding_window=window, softcap=softcap)  # fmt: skip
        return restore_tokens(out * valid[:, None, None], meta)

    got = grads(cp, torch.bfloat16, "cuda")
    for name, g, sm, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, same, want):
        _two_x(g, sm, w, name)


@pytest.mark.gpu
def test_gpu_masked_refusals_and_fp64():
    q = torch.zeros(4, H, D, device="cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match="pcp_masked='flex'.*float64"):
        choose_masked_path("flex", q, q, 4, None)
    with pytest.raises(ValueError, match="pcp_masked='flash'.*float16 / bfloat16"):
        choose_masked_path("flash", q, q, 4, None)
    half = q.to(torch.bfloat16)
    # Windows: FlexAttention both ways where its backward takes the given output and LSE,
    # else FlashAttention-2's backward (FlexAttention's would recompute the forward).
    from cp_modules.kernels.masked.flex_backward import flex_backward_supported

    assert choose_masked_path("auto", half, half, 4, None) == "flex"
    want_bwd = "flex" if flex_backward_supported() else "flash"
    assert choose_masked_path("auto", half, half, 4, None, "backward") == want_bwd
    assert choose_masked_path("auto", half, half, 4, 2.0, "backward") == "flex"
    assert choose_masked_path("auto", half, half, 4, 2.0) == "flex"
    assert choose_masked_path("auto", half, half[..., :4], 4, None) == "flex"  # Dv != Dqk
    assert choose_masked_path("auto", q, q, 4, 2.0) == "reference"
    # fp64 on CUDA (auto: the reference) equals the oracle exactly.
    scale = D**-0.5
    seqs = _sequences(NEW, CACHES["prefix"], H, HKV, D)
    oracle = _oracle(seqs, CACHES["prefix"], scale, 5, 1.5)
    plan, leaves, out, lse = _run_op(seqs, NEW, CACHES["prefix"], 2, 1, scale, 5, 1.5,
                                     CPPolicy(), "cuda", torch.float64)  # fmt: skip
    want_out, want_lse, _ = _gathered_oracle(oracle, plan, CACHES["prefix"], 3)
    valid = plan.local_valid
    torch.testing.assert_close(out.cpu()[valid], want_out[valid], atol=1e-12, rtol=1e-11)
    torch.testing.assert_close(lse.cpu()[valid], want_lse[valid], atol=1e-12, rtol=1e-11)


def _run_cases(rank, world_size, cases):
    from cp_modules.verify import verify_rank

    return [(repr((a.mode, a.sliding_window, a.softcap, a.sinks, a.policy_changes)),
              verify_rank(rank, world_size, a)["errors"]) for a in cases]  # fmt: skip


@pytest.mark.distributed
def test_masked_paths_on_gloo_ranks_equal_one_process():
    # The packed paths (CPU twins) inside the whole layer on 2 ranks (pcp 2, dcp 2): prefill
    # and decode steps and training (the backward runs inside cp::gqa_attention_backward),
    # against one process; windows smaller than a chunk and spanning chunks, soft-cap, sinks.
    from cp_modules.testing import run_distributed
    from cp_modules.verify import TOLERANCE, VerifyArgs

    features = [
        ("flex", dict(sliding_window=7, softcap=1.5, sinks=True)),
        ("flex", dict(softcap=2.0)),
        ("flash", dict(sliding_window=2, sinks=True)),
    ]
    cases = [
        VerifyArgs(parallel=_parallel(1, 2, 2, "a2a"), mode=mode,
                   seq_lens=[19, 3, 8], decode_steps=2, block_size=4,
                   policy_changes={"pcp_masked": path}, **f)
        for mode in ("mixed", "train")
        for path, f in features
    ]  # fmt: skip
    results = run_distributed(_run_cases, 2, cases, timeout_s=1200)
    for per_rank in results:
        assert len(per_rank) == len(cases)
        for name, errors in per_rank:
            assert errors, name
            assert max(errors.values()) <= TOLERANCE["float32"], (name, errors)


@pytest.mark.parametrize("kernel", ["flash", "flex"])
def test_pack_slices_and_single_contribution_sums_equal_the_gathers(kernel):
    # Where packed rows are a run of the inputs (slices, no copy) and each key row is packed
    # once (gradients copied in the inputs' dtype, or returned as the kernel gives them), the
    # results equal the general gathers with fp32-or-wider sums (fp64: exactly).
    import dataclasses
    import itertools

    from cp_modules.kernels.masked.prefill import masked_prefill_backward, masked_prefill_forward
    from cp_modules.reference.pcp_attention import PrefillInputs

    gen = torch.Generator().manual_seed(0)
    softcap = 2.0 if kernel == "flex" else None
    shortcuts = set()
    for pcp, lens, window, prefix in itertools.product(
        [1, 2], [[37], [20, 13]], [3, 100], [False, True]
    ):
        for rank in range(pcp):
            plan = plan_pcp(lens, [0] * len(lens), pcp, rank)
            t, n = plan.token_indices.shape[0], sum(lens)
            q, k, v = (torch.randn(m, h, 8, generator=gen, dtype=torch.float64)
                       for m, h in ((t, 4), (n, 2), (n, 2)))  # fmt: skip
            pk = pv = cu = None
            if prefix:
                cu = torch.tensor([0, *itertools.accumulate([3] * len(lens))])
                pk, pv = (torch.randn(int(cu[-1]), 2, 8, generator=gen, dtype=torch.float64)
                          for _ in range(2))  # fmt: skip
            inputs = PrefillInputs(q, k, v, plan.segments_host, pk, pv, cu, 0.3)
            pack = masked_pack(plan.segments_host, n, None if cu is None else cu.tolist(),
                               window, "cpu")  # fmt: skip
            general = dataclasses.replace(
                pack, q_range=None, k_range=None, k_unique=False, flex_cache={}
            )
            shortcuts |= {name for name in ("q_range", "k_range", "k_unique")
                          if getattr(pack, name)}  # fmt: skip
            kw = dict(kernel=kernel, softcap=softcap)
            fast, slow = (masked_prefill_forward(inputs, p, **kw) for p in (pack, general))
            for a, b in zip(fast, slow):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
            dout = torch.randn(fast[0].shape, generator=gen, dtype=torch.float64)
            for a, b in zip(
                masked_prefill_backward(dout, *fast, inputs, pack, **kw),
                masked_prefill_backward(dout, *slow, inputs, general, **kw),
            ):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.dtype == b.dtype
                    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert shortcuts == {"q_range", "k_range", "k_unique"}  # every shortcut was taken


def test_compiled_flex_keeps_many_variants_compiled_and_refuses_an_eager_fallback(monkeypatch):
    # Every soft-cap value (and grad mode, window, shape specialisation) is a compiled variant
    # of the FlexAttention entry. Past dynamo's default limit of 8 the frame would silently run
    # eagerly (the whole score grid: tens of GiB at long sequences); the entry's limit is
    # FLEX_RECOMPILE_LIMIT, and past it compiling raises.
    import torch._dynamo

    import cp_modules.kernels.masked.prefill as mp

    pack = masked_pack(torch.tensor([[0, 0, 24, 0, 24]]), 24, None, 8, "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, 2, 16, generator=gen) for _ in range(3))
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

    def call(fn, c):
        with mp.flex_compile_config():
            out, aux = fn(q4, k4, v4, mp.softcap_score_mod(c), mp._block_mask(pack, q.device),
                          0.25, False, mp.flex_lse_kwargs())  # fmt: skip
        return out[0].transpose(0, 1)

    torch._dynamo.reset()
    fn = torch.compile(mp._flex_entry, dynamic=True, backend="eager")
    # 12 variants: with dynamo's default limit of 8 the ninth would raise (the config makes
    # hitting the limit an error).
    for c in [1.0 + i for i in range(12)]:
        want, _ = mp.dense_twin_attention(q, k, v, pack, scale=0.25, softcap=c)
        torch.testing.assert_close(call(fn, c), want, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    monkeypatch.setattr(mp, "FLEX_RECOMPILE_LIMIT", 2)
    # (config.patch, not monkeypatch: the config module's entries are not plain attributes,
    # and monkeypatch's undo would delete the entry.)
    with torch._dynamo.config.patch(recompile_limit=2):
        fn = torch.compile(mp._flex_entry, dynamic=True, backend="eager")
        call(fn, 1.0), call(fn, 2.0)
        with pytest.raises(Exception, match="(?i)recompile"):
            call(fn, 3.0)
    torch._dynamo.reset()


def test_flash_window_twins_equal_the_dense_mask_grid():
    # The FlashAttention-2 path's CPU twins (the reference, sequence by sequence) against the
    # FlexAttention path's dense twin (the pack's mask evaluated on the whole score grid): two
    # independent forms of the same windowed attention over a pack with several sequences,
    # output, LSE and gradients (fp64).
    from cp_modules.kernels.masked.flash import (
        flash_window_backward_twin,
        flash_window_forward_twin,
    )
    from cp_modules.kernels.masked.prefill import dense_twin_attention

    segments = torch.tensor([[0, 0, 9, 0, 9], [1, 9, 5, 9, 12]])  # two requests, one a tail
    pack = masked_pack(segments, 21, None, 4, "cpu")
    gen = torch.Generator().manual_seed(3)
    tq, tk = pack.num_queries, pack.cu_k_host[-1]
    q, dout = (torch.randn(tq, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(tk, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out, lse = flash_window_forward_twin(q, k, v, pack, 0.3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want_out, want_lse = dense_twin_attention(*leaves, pack, scale=0.3, softcap=None)
    torch.testing.assert_close(out, want_out.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse.detach(), atol=1e-12, rtol=0)
    want = torch.autograd.grad(want_out, leaves, dout)
    for got, w in zip(flash_window_backward_twin(dout, q, k, v, out, lse, pack, 0.3), want):
        torch.testing.assert_close(got, w, atol=1e-12, rtol=0)
