"""The two key layouts of the masked (window / soft-cap) packing: "runs" (FlexAttention: every
restored key once, in place) against "varlen" (every segment its own copy of its keys), on
the CPU in fp64: the same keys seen by every query, the same outputs and gradients."""

from __future__ import annotations

import itertools

import pytest
import torch

from cp_modules.kernels.masked.pack import masked_pack
from cp_modules.kernels.masked.prefill import masked_prefill_backward, masked_prefill_forward
from cp_modules.partition import plan_pcp
from cp_modules.reference.pcp_attention import PrefillInputs


def _seen(pack) -> list[list[int]]:
    # The rows of [k; prefix_k] each packed query sees, query by query.
    rows = pack.k_index.tolist()
    return [rows[a:b] for a, b in pack.key_ranges_host.tolist()]


@pytest.mark.parametrize("window", [None, 1, 3, 100])
def test_runs_layout_sees_the_same_keys_in_place(window):
    lens = [37, 5, 20]
    for pcp in (1, 2, 3):
        for rank in range(pcp):
            plan = plan_pcp(lens, [0] * len(lens), pcp, rank, decode_threshold=0)
            n = sum(lens)
            runs = masked_pack(plan.segments_host, n, None, window, "cpu", "runs")
            var = masked_pack(plan.segments_host, n, None, window, "cpu", "varlen")
            assert (runs.layout, var.layout) == ("runs", "varlen")
            # Every new key once, in place: the packed keys are a slice of the inputs.
            assert runs.k_range == (0, n) and runs.k_unique and runs.cu_k_host == [0, n]
            assert runs.q_index.tolist() == var.q_index.tolist()
            assert _seen(runs) == _seen(var), (pcp, rank)
            assert runs.q_lo.tolist() == runs.key_ranges_host[:, 0].tolist()
            assert runs.q_hi.tolist() == runs.key_ranges_host[:, 1].tolist()


def test_runs_layout_with_a_cached_prefix_stays_varlen():
    plan = plan_pcp([9, 4], [3, 2], 2, 1, decode_threshold=0)
    cu = plan.prefix_cu_seqlens_host.tolist()
    pack = masked_pack(plan.segments_host, 13, cu, 4, "cpu", "runs")
    want = masked_pack(plan.segments_host, 13, cu, 4, "cpu", "varlen")
    assert pack.layout == "varlen" and _seen(pack) == _seen(want)


def _layouts_case(lens, pcp, rank, window, dim, scale, **like):
    # A rank's inputs (queries 4 heads, keys 2) and its packs in both layouts.
    plan = plan_pcp(lens, [0] * len(lens), pcp, rank, decode_threshold=0)
    t, n = plan.token_indices.shape[0], sum(lens)
    gen = like.pop("generator")
    q, k, v = (torch.randn(m, h, dim, generator=gen, **like) for m, h in ((t, 4), (n, 2), (n, 2)))
    inputs = PrefillInputs(q, k, v, plan.segments_host, None, None, None, scale)
    device = like.get("device", "cpu")
    packs = [
        masked_pack(plan.segments_host, n, None, window, device, layout)
        for layout in ("runs", "varlen")
    ]
    return inputs, packs


def test_runs_layout_gives_the_varlen_outputs_and_gradients():
    # FlexAttention's CPU twin (eager forward, dense twin backward) on both layouts: outputs,
    # LSE and every gradient agree; the runs layout's key gradients need no accumulation.
    gen = torch.Generator().manual_seed(0)
    for pcp, lens, window, softcap in itertools.product(
        [1, 2], [[29], [17, 11, 3]], [None, 4, 50], [None, 2.0]
    ):
        if window is None and softcap is None:
            continue
        for rank in range(pcp):
            inputs, packs = _layouts_case(
                lens, pcp, rank, window, 8, 0.3, generator=gen, dtype=torch.float64
            )
            kw = dict(kernel="flex", softcap=softcap)
            outs = [masked_prefill_forward(inputs, p, **kw) for p in packs]
            for a, b in zip(*outs):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
            dout = torch.randn(outs[0][0].shape, generator=gen, dtype=torch.float64)
            grads = [
                masked_prefill_backward(dout, *o, inputs, p, **kw) for o, p in zip(outs, packs)
            ]
            for a, b in zip(*grads):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.dtype == b.dtype
                    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_flash_refuses_a_runs_pack():
    plan = plan_pcp([12], [0], 2, 0, decode_threshold=0)
    pack = masked_pack(plan.segments_host, 12, None, 3, "cpu", "runs")
    q = torch.randn(plan.token_indices.shape[0], 2, 8, dtype=torch.float64)
    k = torch.randn(12, 2, 8, dtype=torch.float64)
    inputs = PrefillInputs(q, k, k, plan.segments_host, None, None, None, 0.3)
    with pytest.raises(AssertionError, match="varlen"):
        masked_prefill_forward(inputs, pack, kernel="flash", softcap=None)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[256, 128], [301, 77]], ids=["divisible", "ragged"])
def test_gpu_runs_layout_follows_the_two_x_rule_on_flex_kernels(lens):
    # Compiled FlexAttention on the runs layout (in-place keys; lengths multiples of 128 in the
    # first case, so the divisibility flag is set), forward and backward, against an fp64
    # dense twin: its error at most twice the error of the varlen layout on the same kernels.
    from cp_modules.kernels.masked.prefill import dense_twin_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    for pcp, window, softcap in ((1, None, 30.0), (2, 100, 30.0), (2, 64, None)):
        for rank in range(pcp):
            inputs, packs = _layouts_case(
                lens, pcp, rank, window, 64, 0.125, generator=gen, device="cuda",
                dtype=torch.bfloat16,
            )  # fmt: skip
            q, k, v = inputs.q, inputs.k, inputs.v
            kw = dict(kernel="flex", softcap=softcap)
            outs = [masked_prefill_forward(inputs, p, **kw) for p in packs]
            dout = torch.randn(outs[0][0].shape, generator=gen, device="cuda", dtype=q.dtype)
            grads = [
                masked_prefill_backward(dout, *o, inputs, p, **kw)[:3] for o, p in zip(outs, packs)
            ]
            # The fp64 twin: the runs pack's keys are the inputs' rows in place.
            leaves = [x.double().requires_grad_() for x in (q, k, v)]
            qi = packs[0].q_index
            o64, _ = dense_twin_attention(
                leaves[0][qi], leaves[1], leaves[2], packs[0], scale=0.125, softcap=softcap
            )
            ref_out = torch.zeros(outs[0][0].shape, dtype=torch.float64, device="cuda")
            ref_out[qi] = o64
            ref_grads = torch.autograd.grad(o64, leaves, dout[qi].double())
            pairs = [("out", outs[0][0], outs[1][0], ref_out)]
            pairs += [(name, a, b, r) for name, a, b, r in zip("qkv", *grads, ref_grads)]
            for name, got, same, want in pairs:
                err = (got.double() - want).abs().max().item()
                base = (same.double() - want).abs().max().item()
                assert err <= 2 * base + 1e-6, (name, pcp, rank, err, base)
