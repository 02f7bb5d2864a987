"""DCP decode communication: the spec, query preparation and every combine strategy.

The distributed test shards a random KV sequence over each DCP group with the interleave, lets
every rank attend its gathered query heads to its shard (pure torch), prepares, reduces and
combines, and checks that every rank's own heads equal dense attention over the whole
sequence. One spawn per world size runs every accepted (tp, pcp, dcp) of that size.
"""

import math

import pytest
import torch

from cp_modules import ParallelConfig
from cp_modules.config import valid_dcp_sizes
from cp_modules.ops.dcp_comm import (
    DCPCommSpec,
    dcp_a2a_send_buffers,
    dcp_combine,
    dcp_prepare_query,
)
from cp_modules.ops.lse_combine import lse_combine, lse_combine_packed, unpack_partials
from cp_modules.reference.lse_merge import lse_combine_reference
from cp_modules.testing import run_distributed

INF = float("inf")

# --- the spec --------------------------------------------------------------------------------


def _spec(**kw):
    base = dict(
        dcp_group="dcp",
        dcp_size=4,
        dcp_rank=1,
        gather_group="tp",
        gather_size=2,
        gather_rank=1,
        reduce="all_reduce_slice",
        packed=False,
        peer_slots=(0, 1, 0, 1),
    )
    base.update(kw)
    return DCPCommSpec(**base)


def test_spec_is_hashable_and_normalises_slots():
    spec = _spec(peer_slots=[0, 1, 0, 1])
    assert spec.peer_slots == (0, 1, 0, 1)
    assert hash(spec) == hash(_spec())


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(reduce="ring"), "reduce must be one of"),
        (dict(dcp_rank=4), "dcp_rank must be in \\[0, 4\\)"),
        (dict(gather_size=0), "gather_size must be >= 1"),
        (dict(peer_slots=(0, 1, 0)), "peer_slots must hold dcp_size=4"),
        (dict(peer_slots=(0, 2, 0, 1)), "peer_slots must hold dcp_size=4"),
        (dict(peer_slots=(0, 0, 1, 1)), "must equal gather_rank=1"),
        (dict(reduce="none"), "use 'none' exactly when dcp_size == 1"),
        (dict(reduce="reduce_scatter"), "reduce='reduce_scatter' needs peer i to own"),
        (dict(reduce="all_reduce"), "reduce='all_reduce' needs peers that own the same heads"),
        (dict(packed=True), "packed=True applies to reduce='a2a' only"),
    ],
    ids=[
        "reduce",
        "dcp-rank",
        "gather-size",
        "slots-len",
        "slots-range",
        "own-slot",
        "none",
        "rs-order",
        "ar-heads",
        "packed",
    ],
)
def test_spec_rejects_inconsistent_values(kw, match):
    with pytest.raises(ValueError, match=match):
        _spec(**kw)


def test_no_dcp_is_identity_without_collectives():
    spec = DCPCommSpec("g", 1, 0, "t", 1, 0, "none", False, (0,))
    q = torch.randn(3, 4, 8)
    out, lse = torch.randn(3, 4, 6), torch.randn(3, 4)
    assert dcp_prepare_query(q, spec) is q
    got, got_lse = dcp_combine(out, lse, spec, return_lse=True)
    assert got is out and got_lse is lse


@pytest.mark.parametrize(
    "out_shape, lse_shape, lse_dtype, match",
    [
        ((3, 4), (3, 4), torch.float32, "out must be \\[B, Hg, Dv\\]"),
        ((3, 4, 8), (3, 2), torch.float32, "lse must be \\[B, Hg\\] = \\[3, 4\\]"),
        ((3, 4, 8), (3, 4), torch.bfloat16, "lse must be torch.float32"),
        ((3, 5, 8), (3, 5), torch.float32, "positive multiple of gather_size=2"),
    ],
    ids=["out-2d", "lse-shape", "lse-dtype", "heads-vs-gather"],
)
def test_shapes_are_checked_before_any_collective(out_shape, lse_shape, lse_dtype, match):
    # The group names do not exist: reaching a collective would fail differently.
    for spec in (_spec(), _spec(reduce="a2a", packed=True)):
        with pytest.raises(ValueError, match=match):
            dcp_combine(torch.randn(out_shape), torch.randn(lse_shape).to(lse_dtype), spec)
    with pytest.raises(ValueError, match="q must be \\[B, H_local, D\\]"):
        dcp_prepare_query(torch.randn(3, 8), _spec())


@pytest.mark.parametrize(
    "slots, dcp_rank",
    [((0, 1, 0, 1), 1), ((0, 1, 2, 3), 2), ((0, 0), 1), ((1, 0, 0, 1), 0)],
    ids=["pcp2-gather2", "gather4", "same-heads", "custom-order"],
)
def test_a2a_send_chunk_i_holds_peer_i_heads(slots, dcp_rank):
    gather_size = max(slots) + 1
    h, dv = 3, 8
    out = torch.randn(5, gather_size * h, dv, dtype=torch.bfloat16)
    lse = torch.randn(5, gather_size * h)
    specs = [
        DCPCommSpec(
            "dcp", len(slots), dcp_rank, "tp", gather_size, slots[dcp_rank], "a2a", packed, slots
        )
        for packed in (False, True)
    ]
    send_out, send_lse = dcp_a2a_send_buffers(out, lse, specs[0])
    (packed,) = dcp_a2a_send_buffers(out, lse, specs[1])
    assert send_out.is_contiguous() and packed.is_contiguous()
    for i, s in enumerate(slots):
        assert torch.equal(send_out[i], out[:, s * h : (s + 1) * h])
        assert torch.equal(send_lse[i], lse[:, s * h : (s + 1) * h])
    assert all(
        torch.equal(a, b) for a, b in zip(unpack_partials(packed, h, dv), (send_out, send_lse))
    )
    with pytest.raises(ValueError, match="needs spec.reduce='a2a'"):
        dcp_a2a_send_buffers(out, lse, _spec())


def test_a2a_local_path_compiles_with_inductor():
    """Send-buffer packing (a concatenation with an fp32 -> bf16 bit view) and both combines."""
    specs = [DCPCommSpec("dcp", 4, 1, "tp", 2, 1, "a2a", p, (0, 1, 0, 1)) for p in (False, True)]
    out = torch.randn(3, 8, 16, dtype=torch.bfloat16)
    lse = torch.randn(3, 8)
    lse[0, 1] = float("nan")

    def local_a2a(out, lse):
        # The all-to-all is left out: combine the send buffers as if they had been received.
        unpacked = lse_combine(*dcp_a2a_send_buffers(out, lse, specs[0]), return_lse=True)
        (packed,) = dcp_a2a_send_buffers(out, lse, specs[1])
        return unpacked, lse_combine_packed(packed, 4, 16, return_lse=True)

    got = torch.compile(local_a2a, fullgraph=True)(out, lse)
    want = local_a2a(out, lse)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(a, b)
    assert torch.equal(got[0][0], got[1][0])


# --- gloo: every accepted configuration, every strategy --------------------------------------

NUM_HEADS = 16  # query heads of the layer (all TP ranks)
HEAD_DIM, V_HEAD_DIM = 12, 8  # different q and v dims, as in absorbed MLA
SEQ_LENS = (1, 6, 23)  # a 1-token sequence leaves every rank but shard 0 empty
INTERLEAVES = (1, 2)


def _configs(world_size):
    out = []
    for pcp in (1, 2, 4, 8):
        if world_size % pcp:
            continue
        tp = world_size // pcp
        for dcp in valid_dcp_sizes(tp, pcp):
            out.append(
                ParallelConfig(
                    tensor_parallel_size=tp,
                    prefill_context_parallel_size=pcp,
                    decode_context_parallel_size=dcp,
                )
            )
    return out


def _gqa_kv_heads(config):
    """Largest KV-head count below the query heads that the configuration accepts."""
    for kv in (8, 4, 2, 1):
        try:
            config.validate_heads(NUM_HEADS, kv)
            return kv
        except ValueError:
            continue
    raise AssertionError(f"no KV-head count accepted by {config}")


def _strategies(config, groups):
    """(label, spec) pairs: the plan's reduce, both a2a variants, and reduce-scatter where legal."""
    plan = DCPCommSpec.from_groups(groups)
    if config.dcp == 1:
        return [("none", plan)]
    out = [
        (plan.reduce, plan),
        ("a2a", DCPCommSpec.from_groups(groups, reduce="a2a", packed=False)),
        ("a2a-packed", DCPCommSpec.from_groups(groups, reduce="a2a", packed=True)),
    ]
    if plan.reduce != "reduce_scatter" and plan.peer_slots == tuple(range(config.dcp)):
        out.append(("reduce_scatter", DCPCommSpec.from_groups(groups, reduce="reduce_scatter")))
    return out


def _problem(seed, num_kv_heads):
    g = torch.Generator().manual_seed(seed)
    b, s = len(SEQ_LENS), max(SEQ_LENS)
    q = torch.randn(b, NUM_HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, num_kv_heads, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, num_kv_heads, V_HEAD_DIM, generator=g, dtype=torch.float64)
    return q, k, v


def _attention(q, k, v, heads, keep):
    """Attention of query heads ``heads`` to the keys where ``keep [B, S]``: out, lse (fp64)."""
    group = NUM_HEADS // k.shape[2]
    kv = torch.arange(heads.start, heads.stop) // group  # GQA: query head -> KV head
    scores = torch.einsum("bhd,bshd->bhs", q[:, heads], k[:, :, kv]) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(~keep[:, None, :], -INF)
    lse = torch.logsumexp(scores, -1)
    # An empty shard gives NaN here (exp(-inf - -inf)), as attention kernels may.
    out = torch.einsum("bhs,bshd->bhd", torch.exp(scores - lse[..., None]), v[:, :, kv])
    return out, lse


def _check_config(rank, config, seed, counts):
    from cp_modules.distributed.groups import init_cp_groups

    groups = init_cp_groups(config, timeout_s=60)
    num_kv = _gqa_kv_heads(config)
    h_local = NUM_HEADS // config.tp
    own = slice(groups.tp_rank * h_local, (groups.tp_rank + 1) * h_local)
    q, k, v = _problem(seed, num_kv)
    positions = torch.arange(k.shape[1])
    valid = positions[None, :] < torch.tensor(SEQ_LENS)[:, None]
    dense_out, dense_lse = _attention(q, k, v, own, valid)
    strategies = _strategies(config, groups)
    gather_rank, gather_size = strategies[0][1].gather_rank, strategies[0][1].gather_size
    first = (groups.tp_rank - gather_rank) * h_local
    gathered = slice(first, first + gather_size * h_local)
    own_in_gathered = slice(gather_rank * h_local, (gather_rank + 1) * h_local)

    for interleave in INTERLEAVES:
        # Every shard's partial result, so that a rank can also predict the exact a2a result.
        shard_out, shard_lse = [], []
        for r in range(config.dcp):
            on_r = (positions // interleave) % config.dcp == r
            out, lse = _attention(q, k, v, gathered, valid & on_r[None, :])
            # Empty shards report -inf, NaN or +inf depending on the kernel: all must work.
            shard_out.append(out)
            shard_lse.append(
                torch.where(torch.isneginf(lse), (-INF, float("nan"), INF)[r % 3], lse)
            )
        for label, spec in strategies:
            if interleave == INTERLEAVES[0]:
                q_g = dcp_prepare_query(q[:, own].float(), spec)
                assert torch.equal(q_g, q[:, gathered].float()), (config, label)
            out, lse = shard_out[spec.dcp_rank], shard_lse[spec.dcp_rank]
            # Natural LSEs with interleave 1, base-2 LSEs (and bf16 for a2a) with interleave 2.
            base = "e" if interleave == 1 else "2"
            scale = 1.0 if base == "e" else 1 / math.log(2.0)
            what = (config, label, interleave, base)
            res, res_lse = dcp_combine(
                out.float(), (lse * scale).float(), spec, return_lse=True, base=base
            )
            assert res.shape == (len(SEQ_LENS), h_local, V_HEAD_DIM), what
            assert res.dtype == torch.float32 and res_lse.dtype == torch.float32, what
            torch.testing.assert_close(res, dense_out.float(), rtol=0, atol=1e-5, msg=str(what))
            torch.testing.assert_close(
                res_lse, (dense_lse * scale).float(), rtol=0, atol=1e-5, msg=str(what)
            )
            counts[label] = counts.get(label, 0) + 1
            if base == "e" or not label.startswith("a2a"):
                continue
            # bf16: the all-to-all only moves bits (LSE bits inside bf16 rows when packed), so
            # the result is exactly the local combine of every shard's bf16 partials.
            res, res_lse = dcp_combine(
                out.bfloat16(), (lse * scale).float(), spec, return_lse=True, base=base
            )
            want, want_lse = lse_combine_reference(
                torch.stack([o[:, own_in_gathered] for o in shard_out]).bfloat16(),
                (torch.stack([lg[:, own_in_gathered] for lg in shard_lse]) * scale).float(),
                base2=True,
            )
            assert torch.equal(res, want) and torch.equal(res_lse, want_lse), what
            counts[label + "-bf16"] = counts.get(label + "-bf16", 0) + 1
    return groups


def _compile_check(rank, groups, labels):
    """Strategies ``labels`` of one configuration trace with fullgraph=True and match eager.

    ``aot_eager`` checks tracing through the functional collectives and the ops' fakes;
    inductor's lowering of the packing is checked in a single process (no collective needed).
    """
    checked = []
    for label, spec in _strategies(groups.config, groups):
        if label not in labels:
            continue
        g = torch.Generator().manual_seed(rank)
        hg = NUM_HEADS // groups.config.tp * spec.gather_size
        q = torch.randn(2, NUM_HEADS // groups.config.tp, HEAD_DIM, generator=g)
        out = torch.randn(2, hg, V_HEAD_DIM, generator=g)
        lse = torch.randn(2, hg, generator=g)

        def step(q, out, lse, spec=spec):
            return dcp_prepare_query(q, spec), dcp_combine(out, lse, spec, return_lse=True)

        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, out, lse)
        want = step(q, out, lse)
        for a, b in zip(
            torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
        ):
            assert torch.equal(a, b), (groups.config, label)
        checked.append(label)
    return checked


def _run_world(rank, world_size):
    counts, compiled = {}, []
    for i, config in enumerate(_configs(world_size)):
        groups = _check_config(rank, config, seed=100 * world_size + i, counts=counts)
        # Compile every strategy once: reduce-scatter and both a2a at world 2, all-reduce
        # (dcp=2) and all-reduce + slice (dcp=4) on world 4's (tp=2, pcp=2) slice.
        if world_size == 2 and config.tp == 2 and config.dcp == 2:
            compiled += _compile_check(rank, groups, ("reduce_scatter", "a2a", "a2a-packed"))
        if world_size == 4 and config.tp == 2 and config.dcp > 1:
            compiled += _compile_check(rank, groups, ("all_reduce", "all_reduce_slice"))
    return counts, compiled


def _expected_counts(world_size):
    counts = {}
    for config in _configs(world_size):
        for label in _labels(config):
            counts[label] = counts.get(label, 0) + len(INTERLEAVES)
            if label.startswith("a2a"):
                counts[label + "-bf16"] = counts.get(label + "-bf16", 0) + 1
    return counts


def _labels(config):
    from cp_modules.distributed.layout import comm_plan

    if config.dcp == 1:
        return ["none"]
    plan = comm_plan(config).reduce
    labels = [plan, "a2a", "a2a-packed"]
    k = config.tp_positions_per_dcp_group
    if plan != "reduce_scatter" and config.pcp == 1 and k == config.dcp:
        labels.append("reduce_scatter")
    return labels


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_config_matches_dense_attention(world_size):
    results = run_distributed(_run_world, world_size, timeout_s=600, collective_timeout_s=120)
    counts, compiled = results[0]
    assert all(r == results[0] for r in results)
    assert counts == _expected_counts(world_size)
    # Every reduce strategy of the table is exercised somewhere.
    if world_size == 8:
        assert set(counts) == {
            "none",
            "reduce_scatter",
            "all_reduce",
            "all_reduce_slice",
            "a2a",
            "a2a-packed",
            "a2a-bf16",
            "a2a-packed-bf16",
        }
    if world_size == 2:
        assert compiled == ["reduce_scatter", "a2a", "a2a-packed"]
    if world_size == 4:
        assert compiled == ["all_reduce", "all_reduce_slice"]
