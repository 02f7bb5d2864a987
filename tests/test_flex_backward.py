"""FlexAttention's backward from the given output and LSE (no forward recompute) against the
dense twin's autograd gradients: on CPU the operator's eager dense implementation with the
same graphs, kernel options and log2 LSE the CUDA kernel gets (fp64, exact), and the compiled
route traced by dynamo (``aot_eager``) with one graph for new packed lengths; on the GPU the
Triton kernel in bf16 by the 2x rule, against the dense twin and the recompute path."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from cp_modules.kernels.masked.flex_backward import flex_backward_supported, recomputed_grads
from cp_modules.kernels.masked.prefill import (
    dense_twin_attention,
    flex_attention_call,
    flex_backward,
    masked_pack,
)
from cp_modules.ops.cp_attention import _apply_sinks

# (segments [request, q_start, q_len, k_start, k_len], new keys, prefix offsets or None)
PACKS = {
    # Two requests' head and tail chunks over cached prefixes (3 and 2 tokens).
    "prefix": (
        [[0, 0, 4, 0, 6], [1, 4, 3, 6, 5], [0, 7, 2, 0, 9], [1, 9, 2, 6, 8]],
        17,
        [0, 3, 5],
    ),
    "no-prefix": ([[0, 0, 9, 0, 9], [1, 9, 5, 9, 13]], 22, None),
    # Several 128-row blocks (GPU): a request without a prefix and one with 40 cached tokens.
    "long": ([[0, 0, 300, 0, 300], [1, 300, 200, 300, 450]], 750, [0, 0, 40]),
}
# window, soft-cap
FEATURES = {"causal": (None, None), "c2": (None, 2.0), "W3": (3, None), "W5-c1.5": (5, 1.5)}


def _packed(name, window, heads, dv, dtype, device, seed=0, d=8):
    # A pack and random packed rows: q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], dout.
    segs, num_new, prefix_cu = PACKS[name]
    pack = masked_pack(torch.tensor(segs), num_new, prefix_cu, window, device)
    tq, tk = pack.num_queries, pack.cu_k_host[-1]
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v, dout = mk(tq, h, d), mk(tk, hkv, d), mk(tk, hkv, dv), mk(tq, h, dv)
    return pack, [x.to(device, dtype) for x in (q, k, v, dout)]


def _reference(pack, q, k, v, dout, scale, softcap, sinks=None):
    """Out, LSE (sinks applied when given) and the q/k/v gradients by autograd through the
    dense twin."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = dense_twin_attention(*leaves, pack, scale=scale, softcap=softcap)
    if sinks is not None:
        out, lse = _apply_sinks(out, lse, sinks)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("pack_name", ["prefix", "no-prefix"])
def test_flex_backward_equals_the_dense_twin_gradients(pack_name, feature):
    # The operator's eager implementation (dense math) with the graphs, kernel options and
    # log2 LSE the CUDA path passes: GQA, Dv != Dqk, windows, soft-cap, document masks over
    # cached prefixes, and the output and LSE with sinks applied (the gradients of the
    # sink-normalised attention without any sigma correction). fp64: exact.
    window, softcap = FEATURES[feature]
    scale = 0.3
    for heads, dv in (((4, 2), 8), ((4, 4), 6)):
        pack, (q, k, v, dout) = _packed(pack_name, window, heads, dv, torch.float64, "cpu")
        sinks = torch.linspace(-1.0, 1.5, heads[0], dtype=torch.float64)
        for s in (None, sinks):
            out, lse, want = _reference(pack, q, k, v, dout, scale, softcap, s)
            got = flex_backward(dout, q, k, v, out, lse, pack, scale=scale, softcap=softcap,
                                backend=None)  # fmt: skip
            attend = functools.partial(dense_twin_attention, pack=pack, scale=scale,
                                       softcap=softcap)  # fmt: skip
            recomputed = recomputed_grads(attend, dout, q, k, v, out, lse)
            for name, a, b, c in zip(("dq", "dk", "dv"), got, want, recomputed):
                assert a.shape == b.shape and a.dtype == b.dtype, name
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=name)
                torch.testing.assert_close(c, b, atol=1e-12, rtol=1e-10, msg=name)


@pytest.mark.parametrize("feature", ["causal", "c2"])
def test_flex_backward_with_split_rows_equals_the_whole_rows(feature, monkeypatch):
    # Long key runs cut in pieces for the backward (each piece a row of its own, dq summed):
    # the same gradients as the whole rows and the dense twin, fp64. The "long" pack's second
    # request spans up to 490 keys per 128-row block; with the key floor lifted, blocks over
    # 1.5 x the mean run are cut.
    from cp_modules.kernels.masked import pack as mp

    monkeypatch.setattr(mp, "SPLIT_MIN_KEYS", 0)
    window, softcap = FEATURES[feature]
    pack, (q, k, v, dout) = _packed("long", window, (4, 2), 6, torch.float64, "cpu")
    split = mp.row_split(pack, "cpu")
    assert split is not None and split.num_queries > pack.num_queries
    assert mp.row_split(pack, "cpu") is split  # cached in the pack
    # The pieces of every row are disjoint and cover its run; cuts on 128-key boundaries.
    ranges, src = split.key_ranges_host, split.src.numpy()
    tq = pack.num_queries
    covered = np.zeros((tq, pack.cu_k_host[-1]), dtype=np.int64)
    for row in range(split.num_queries):
        lo, hi = ranges[row]
        if hi > lo:
            covered[src[row], lo:hi] += 1
            if row >= tq:
                assert lo % 128 == 0 or lo == pack.key_ranges_host[src[row], 0]
    want_cover = np.zeros_like(covered)
    for row, (lo, hi) in enumerate(pack.key_ranges_host):
        want_cover[row, lo:hi] = 1
    np.testing.assert_array_equal(covered, want_cover)
    assert split.extra_pos.numel() > 0 and split.num_queries % 128 == 0
    out, lse, want = _reference(pack, q, k, v, dout, 0.3, softcap)
    whole = flex_backward(dout, q, k, v, out, lse, pack, scale=0.3, softcap=softcap,
                          backend=None)  # fmt: skip
    got = flex_backward(dout, q, k, v, out, lse, pack, scale=0.3, softcap=softcap,
                        backend=None, split=split)  # fmt: skip
    for name, a, b, c in zip(("dq", "dk", "dv"), got, whole, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=name)
        torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-10, msg=name)


def test_row_split_leaves_short_and_even_runs_whole():
    # Windowed rows (every run about W keys) and short packs are never cut; neither is the
    # "long" pack under the default floor of 4096 keys.
    from cp_modules.kernels.masked import pack as mp

    for name, window in (("long", None), ("long", 64), ("no-prefix", None)):
        pack, _ = _packed(name, window, (4, 2), 6, torch.float64, "cpu")
        assert mp.row_split(pack, "cpu") is None, (name, window)
    segs = torch.tensor([[0, 0, 8192, 0, 8192]])
    pack = masked_pack(segs, 8192, None, 1024, "cpu", layout="runs")
    assert mp.row_split(pack, "cpu") is None  # W = 1024: every run <= 1024 keys
    # A PCP rank's head and tail chunks of one 32k request (chunk 0 and chunk 15 of 16):
    # the tail chunk's blocks span ~2x the mean and are cut in two.
    segs = torch.tensor([[0, 0, 2048, 0, 2048], [0, 2048, 2048, 0, 32768]])
    pack = masked_pack(segs, 32768, None, None, "cpu", layout="runs")
    split = mp.row_split(pack, "cpu")
    assert split is not None
    assert split.num_queries == 4096 + 2048  # the tail chunk's 16 blocks, once more
    lens = split.key_ranges_host[:, 1] - split.key_ranges_host[:, 0]
    assert lens.max() <= 16384 + 128
    # The whole sequence in one pack (one rank): a long kernel, whose longest blocks are a
    # small share of its work (0.8 %): left whole.
    pack = masked_pack(torch.tensor([[0, 0, 32768, 0, 32768]]), 32768, None, None, "cpu",
                       layout="runs")  # fmt: skip
    assert mp.row_split(pack, "cpu") is None


def test_compiled_flex_backward_traces_once_for_new_packed_lengths():
    # The compiled route (dynamo proxies the pre-traced graphs; AOT autograd traces the
    # operator) on CPU with the aot_eager backend: the same gradients as the dense twin, and
    # one compiled graph for three packs of different lengths (dynamic shapes), under the
    # FlexAttention dynamo settings.
    import torch._dynamo
    from torch._dynamo.utils import counters

    assert flex_backward_supported()
    torch._dynamo.reset()
    counters.clear()
    scale, softcap = 0.3, 2.0
    cases = [("prefix", 5, 0), ("no-prefix", 5, 1), ("no-prefix", 5, 2)]
    lengths = set()
    for name, window, seed in cases:
        pack, (q, k, v, dout) = _packed(name, window, (4, 2), 8, torch.float32, "cpu", seed)
        if seed == 2:  # a third length: the same sequences without their last query
            q, dout = q[:-1], dout[:-1]
            pack = masked_pack(torch.tensor([[0, 0, 9, 0, 9], [1, 9, 4, 9, 13]]), 22, None,
                               window, "cpu")  # fmt: skip
            k, v = k[: pack.cu_k_host[-1]], v[: pack.cu_k_host[-1]]
        lengths.add((pack.num_queries, pack.cu_k_host[-1]))
        out, lse, want = _reference(pack, q, k, v, dout, scale, softcap)
        got = flex_backward(dout, q, k, v, out, lse, pack, scale=scale, softcap=softcap,
                            backend="aot_eager")  # fmt: skip
        for label, a, b in zip(("dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=label)
    assert len(lengths) == 3, lengths
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_compiled_flex_backward_states_divisibility_either_way():
    # Dynamo guards only the kernel-option keys a compiled variant saw: were the divisibility
    # flag present only when true, a call of lengths divisible by 128 would reuse a variant
    # compiled for ragged lengths (bounds-checked loads, the flag lost). Each compiled graph's
    # operator call is read for its flag: after two ragged lengths, a divisible one compiles
    # a variant of its own, with the flag set.
    import torch._dynamo
    from torch._higher_order_ops import flex_attention_backward

    flags = []

    def spy(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is flex_attention_backward:
                flags.append(node.args[11]["IS_DIVISIBLE"])
        return gm.forward

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    for n in (120, 136, 128):
        pack = masked_pack(torch.tensor([[0, 0, n, 0, n]]), n, None, None, "cpu")
        q, k, v, dout, out = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64)
                              for _ in range(5))  # fmt: skip
        lse = torch.randn(n, 2, generator=g, dtype=torch.float64)
        flex_backward(dout, q, k, v, out, lse, pack, scale=0.3, softcap=None, backend=spy)
    torch._dynamo.reset()
    assert flags and flags[-1] is True and not any(flags[:-1]), flags


def test_block_sizes_are_set_only_where_they_were_measured():
    # The soft-cap block sizes apply on sm_90 at head dim 128 in 16-bit only; under 128
    # queries (FlexAttention's decoding kernel forward, which sizes its own query block) only
    # the backward's are set.
    from cp_modules.kernels.masked.prefill import (
        SOFTCAP_SM90_BLOCKS,
        block_options_for,
        flex_block_options,
    )

    bf16, sm90 = torch.bfloat16, (9, 0)
    assert block_options_for(50.0, 4096, 128, bf16, sm90) == SOFTCAP_SM90_BLOCKS
    assert block_options_for(50.0, 4096, 128, torch.float16, sm90) == SOFTCAP_SM90_BLOCKS
    for args in [
        (None, 4096, 128, bf16, sm90),  # no soft-cap
        (50.0, 4096, 64, bf16, sm90),  # another head dim
        (50.0, 4096, 128, torch.float32, sm90),
        (50.0, 4096, 128, bf16, (8, 0)),
        (50.0, 4096, 128, bf16, (10, 0)),
    ]:
        assert block_options_for(*args) == {}, args
    short = block_options_for(50.0, 127, 128, bf16, sm90)
    assert short and all(k.startswith("bwd_") for k in short), short
    assert block_options_for(50.0, 128, 128, bf16, sm90) == SOFTCAP_SM90_BLOCKS
    assert flex_block_options(torch.zeros(256, 2, 128, dtype=torch.bfloat16), 50.0) == {}  # CPU


def _same_dtype_grads(pack, q, k, v, dout, scale, softcap):
    # The dense attention over the pack's mask in the inputs' dtype throughout (the 2x rule's
    # same-dtype reference; the dense twin accumulates in fp32), q/k/v gradients by autograd.
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    qq, kk, vv = leaves
    rep = qq.shape[1] // kk.shape[1]
    s = torch.einsum("ihd,jhd->hij", qq, kk.repeat_interleave(rep, dim=1)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(qq.shape[0], device=q.device)[None, :, None]
    j = torch.arange(kk.shape[0], device=q.device)[None, None, :]
    s = s.masked_fill(~pack.mask_mod()(0, 0, i, j), float("-inf"))
    p = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))
    out = torch.einsum("hij,jhd->ihd", p, vv.repeat_interleave(rep, dim=1))
    return torch.autograd.grad(out, leaves, dout)


def _two_x(got, same, want, name):
    err = (got - want).abs().max()
    bound = 2 * (same - want).abs().max() + 1e-3 * want.abs().max()
    assert err <= bound, (name, float(err), float(bound))


def _backward_variants() -> int:
    # Compiled variants of the backward entry (its own code object: forward compiles and
    # other frames are not counted).
    from cp_modules.kernels.masked import flex_backward as fb

    code = fb._backward_entry.__code__
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))


@pytest.mark.gpu
def test_gpu_flex_backward_follows_the_two_x_rule(monkeypatch):
    # bf16 on CUDA: FlexAttention's backward kernel from the forward's output and LSE, the
    # recompute it replaces, and the kernel over split rows (long key runs cut in pieces),
    # each within twice the error of the bf16 dense attention against the fp64 dense twin;
    # GQA, soft-cap with and without a window, cached prefixes.
    from cp_modules.kernels.masked import pack as mp

    assert flex_backward_supported()
    mp_floor, splits = mp.SPLIT_MIN_KEYS, 0
    d = 64  # Triton's dot needs 16 or more
    scale = d**-0.5
    for name, window, softcap in (("prefix", 5, 30.0), ("no-prefix", None, 20.0),
                                  ("long", 100, 50.0), ("long", None, 30.0),
                                  ("long", 64, None)):  # fmt: skip
        pack64, xs64 = _packed(name, window, (8, 2), d, torch.float64, "cpu", d=d)
        pack, xs = _packed(name, window, (8, 2), d, torch.bfloat16, "cuda", d=d)
        q, k, v, dout = xs
        _, _, want = _reference(pack64, *xs64, scale, softcap)
        same = _same_dtype_grads(pack, *xs, scale, softcap)
        with torch.no_grad():
            out, lse = flex_attention_call(q, k, v, pack, scale=scale, softcap=softcap)
        got = flex_backward(dout, q, k, v, out, lse, pack, scale=scale, softcap=softcap)
        attend = functools.partial(flex_attention_call, pack=pack, scale=scale, softcap=softcap)
        old = recomputed_grads(attend, dout, q, k, v, out, lse)
        # The same kernel over rows with their long key runs cut in pieces (the floor lifted
        # so that these small packs are cut where their spans allow).
        monkeypatch.setattr(mp, "SPLIT_MIN_KEYS", 0)
        split = mp.row_split(pack, q.device)
        monkeypatch.setattr(mp, "SPLIT_MIN_KEYS", mp_floor)
        cut = () if split is None else flex_backward(dout, q, k, v, out, lse, pack, scale=scale,
                                                     softcap=softcap, split=split)  # fmt: skip
        splits += split is not None
        for label, a, b, s, w in zip(("dq", "dk", "dv"), got, old, same, want):
            assert a.dtype == torch.bfloat16 and a.shape == w.shape, label
            _two_x(a.double().cpu(), s.double().cpu(), w, f"{name} {label} new")
            _two_x(b.double().cpu(), s.double().cpu(), w, f"{name} {label} recompute")
        for label, c, s, w in zip(("dq", "dk", "dv"), cut, same, want):
            assert c.dtype == torch.bfloat16 and c.shape == w.shape, label
            _two_x(c.double().cpu(), s.double().cpu(), w, f"{name} {label} split rows")
    assert splits >= 2  # the causal "long" packs were cut


@pytest.mark.gpu
def test_gpu_flex_backward_compiles_once_for_new_packed_lengths():
    # Two packs of different lengths (same soft-cap): at most one compiled variant of the
    # backward entry beyond the first.
    import torch._dynamo

    torch._dynamo.reset()
    d = 64
    scale, softcap = d**-0.5, 30.0
    counts, lengths = [], set()
    for name in ("long", "prefix"):
        pack, (q, k, v, dout) = _packed(name, 5, (8, 2), d, torch.bfloat16, "cuda", d=d)
        lengths.add((pack.num_queries, pack.cu_k_host[-1]))
        with torch.no_grad():
            out, lse = flex_attention_call(q, k, v, pack, scale=scale, softcap=softcap)
        flex_backward(dout, q, k, v, out, lse, pack, scale=scale, softcap=softcap)
        counts.append(_backward_variants())
    assert len(lengths) == 2, lengths
    assert counts[0] == 1 and counts[1] <= 2, counts
    torch._dynamo.reset()
