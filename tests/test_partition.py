"""DualChunkSwap plan: exact examples, an independent loop oracle, and property tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_modules.partition import SEGMENT_FIELDS, plan_pcp


def _plans(n, m, pcp_size, threshold=1):
    return [plan_pcp(n, m, pcp_size, r, decode_threshold=threshold) for r in range(pcp_size)]


def _gathered(plans, field="token_indices"):
    return torch.cat([getattr(p, field) for p in plans])


def _oracle(n, m, pcp_size, rank, threshold=1):
    """Token-by-token DualChunkSwap for one rank: (token index, position, valid) per slot."""
    out = []
    start = 0
    for ni, mi in zip(n, m):
        if (ni <= threshold and mi > 0) or pcp_size == 1:
            idx = list(range(ni))  # decodes, and every request at P = 1: unsplit, unpadded
        else:
            c = -(-ni // (2 * pcp_size))
            head = [rank * c + o for o in range(c)]
            tail = [(2 * pcp_size - 1 - rank) * c + o for o in range(c)]
            idx = head + tail
        for i in idx:
            real = i < ni
            out.append((start + (i if real else 0), mi + (i if real else 0), real))
        start += ni
    return out


# ---------------------------------------------------------------- exact examples


def test_eight_tokens_two_ranks_matches_the_design_example():
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    p0, p1 = _plans([8], [0], 2)
    assert p0.token_indices.tolist() == [0, 1, 6, 7]
    assert p1.token_indices.tolist() == [2, 3, 4, 5]
    assert p0.positions.tolist() == [0, 1, 6, 7]
    assert p0.restore_index.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    assert p0.unpad_mask.all()
    # Head queries see c·(r+1) keys, tail queries c·(2P-r).
    assert p0.segments_host.tolist() == [[0, 0, 2, 0, 2], [0, 2, 2, 0, 8]]
    assert p1.segments_host.tolist() == [[0, 0, 2, 0, 4], [0, 2, 2, 0, 6]]


def test_one_rank_keeps_each_request_whole():
    # P = 1: no head/tail cut, no padding; the head segment is the whole causal request.
    (p,) = _plans([5, 3, 1], [0, 2, 4], 1)
    assert p.token_indices.tolist() == list(range(9))
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 4]
    assert p.local_valid.all() and p.num_local_tokens_padded == 9
    assert p.restore_index.tolist() == list(range(9)) and p.unpad_mask.all()
    assert p.segments_host.tolist() == [
        [0, 0, 5, 0, 5],
        [0, 5, 0, 0, 0],
        [1, 5, 3, 5, 3],
        [1, 8, 0, 5, 0],
        [2, 8, 1, 8, 1],
        [2, 9, 0, 8, 0],
    ]


def test_sixteen_tokens_four_ranks():
    plans = _plans([16], [0], 4)
    for r, p in enumerate(plans):
        assert p.token_indices.tolist() == [2 * r, 2 * r + 1, 14 - 2 * r, 15 - 2 * r]
        assert p.head_k_len.tolist() == [2 * (r + 1)]
        assert p.tail_k_len.tolist() == [2 * (8 - r)]


def test_padding_copies_the_first_token_and_is_dropped():
    p0, p1 = _plans([5], [3], 2)
    # c = 2: rank 0 holds [0, 1 | 6, 7] and rank 1 [2, 3 | 4, 5]; 5, 6, 7 are padding.
    assert p0.token_indices.tolist() == [0, 1, 0, 0]
    assert p1.token_indices.tolist() == [2, 3, 4, 0]
    assert p0.positions.tolist() == [3, 4, 3, 3]
    assert p1.positions.tolist() == [5, 6, 7, 3]
    assert p0.local_valid.tolist() == [True, True, False, False]
    assert p1.local_valid.tolist() == [True, True, True, False]
    assert p0.restore_index.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    assert p0.unpad_mask.tolist() == [True] * 5 + [False] * 3
    assert p0.gather_index.tolist() == [0, 1, 4, 5, 6]
    # Rank 0's tail is all padding: no queries, no keys. Rank 1's tail has one real query.
    assert p0.segments_host.tolist() == [[0, 0, 2, 0, 2], [0, 2, 0, 0, 0]]
    assert p1.segments_host.tolist() == [[0, 0, 2, 0, 4], [0, 2, 1, 0, 5]]


def test_decodes_in_front_are_replicated_not_split():
    p0, p1 = _plans([1, 1, 6], [10, 4, 0], 2)
    assert p0.is_decode.tolist() == [True, True, False]
    assert p0.token_indices.tolist() == [0, 1, 2, 3, 2, 2]
    assert p1.token_indices.tolist() == [0, 1, 4, 5, 6, 7]
    assert p0.positions.tolist() == [10, 4, 0, 1, 0, 0]
    assert p1.positions.tolist() == [10, 4, 2, 3, 4, 5]
    assert p0.restore_index.tolist() == [0, 6, 1, 7, 2, 3, 8, 9, 10, 11, 4, 5]
    assert p0.unpad_mask.tolist() == [1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    assert p0.gather_index.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    # A decode is one head segment over its own new keys; its cached context is the prefix.
    assert p1.segments_host[:4].tolist() == [
        [0, 0, 1, 0, 1],
        [0, 1, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 2, 0, 1, 0],
    ]
    assert p1.prefix_cu_seqlens_host.tolist() == [0, 10, 14, 14]


def test_decode_threshold_needs_a_context():
    # Two tokens under threshold 2 with context: a decode; without context: a prefill.
    plans = _plans([2, 2], [7, 0], 2, threshold=2)
    assert plans[0].is_decode.tolist() == [True, False]
    assert plans[0].num_local_tokens.tolist() == [2, 2]
    assert plans[1].token_indices.tolist() == [0, 1, 3, 2]


def test_plan_tensors_and_host_copies():
    p = plan_pcp([9, 1], [0, 3], 2, 1, device="cpu")
    assert p.segments_host.device.type == "cpu" and p.prefix_cu_seqlens_host.device.type == "cpu"
    assert p.token_indices.dtype == torch.int64 and p.local_valid.dtype == torch.bool
    assert torch.equal(p.segments, p.segments_host)
    assert p.segments_host.shape == (2 * p.num_reqs, len(SEGMENT_FIELDS))
    assert (p.num_tokens, p.num_local_tokens_padded) == (10, 7)


def test_packed_device_copy_keeps_every_field():
    # Off the CPU the plan's fields travel as two packed buffers; unpacking must be exact.
    from cp_modules.partition.plan import _packed_to_device

    arrays = {
        "a": np.arange(5, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "seg": np.arange(12, dtype=np.int64).reshape(6, 2),
        "empty": np.zeros(0, dtype=np.int64),
        "mask2": np.array([False]),
    }
    out = _packed_to_device(arrays, torch.device("cpu"))
    for name, a in arrays.items():
        assert out[name].dtype == (torch.bool if a.dtype == np.bool_ else torch.int64), name
        assert torch.equal(out[name], torch.from_numpy(a)), name


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pcp_size=0, pcp_rank=0), "pcp_size"),
        (dict(pcp_size=2, pcp_rank=2), "pcp_rank"),
        (dict(pcp_size=2, pcp_rank=-1), "pcp_rank"),
        (dict(pcp_size=2, pcp_rank=0, decode_threshold=-1), "decode_threshold"),
        (dict(num_scheduled_tokens=[3, 0]), "num_scheduled_tokens"),
        (dict(num_computed_tokens=[0, -1]), "num_computed_tokens"),
        (dict(num_computed_tokens=[0]), "one entry per request"),
        (dict(num_scheduled_tokens=[1.5, 2]), "integers"),
    ],
    ids=[
        "size0",
        "rank-too-big",
        "rank-negative",
        "threshold",
        "zero-tokens",
        "neg-computed",
        "lengths",
        "floats",
    ],
)
def test_invalid_arguments_raise_value_error(kwargs, match):
    args = dict(num_scheduled_tokens=[3, 4], num_computed_tokens=[0, 0], pcp_size=2, pcp_rank=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_pcp(**args)


# ---------------------------------------------------------------- properties

batches = st.integers(1, 8).flatmap(
    lambda pcp: st.tuples(
        st.just(pcp),
        st.lists(
            st.tuples(st.one_of(st.integers(1, 3), st.integers(1, 600)), st.integers(0, 40)),
            min_size=1,
            max_size=6,
        ),
        st.integers(0, 3),
    )
)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_plan_matches_the_token_by_token_oracle(case):
    pcp, reqs, threshold = case
    n, m = [x[0] for x in reqs], [x[1] for x in reqs]
    for r, p in enumerate(_plans(n, m, pcp, threshold)):
        ref = _oracle(n, m, pcp, r, threshold)
        assert p.token_indices.tolist() == [x[0] for x in ref]
        assert p.positions.tolist() == [x[1] for x in ref]
        assert p.local_valid.tolist() == [x[2] for x in ref]


@settings(max_examples=80, deadline=None)
@given(batches)
def test_restore_contract_and_balance(case):
    pcp, reqs, threshold = case
    n = np.array([x[0] for x in reqs])
    m = np.array([x[1] for x in reqs])
    plans = _plans(n.tolist(), m.tolist(), pcp, threshold)
    total = int(n.sum())
    is_decode = (n <= threshold) & (m > 0)
    # Equal local token count on every rank (the all-gather size).
    assert len({p.token_indices.numel() for p in plans}) == 1
    gathered = _gathered(plans)
    restored = gathered[plans[0].restore_index][plans[0].unpad_mask]
    assert torch.equal(restored, torch.arange(total))
    assert torch.equal(gathered[plans[0].gather_index], torch.arange(total))
    assert torch.equal(plans[0].restore_index.sort().values, torch.arange(gathered.numel()))
    # The runs spell gather_index out, in restored order, never crossing a rank's block.
    t = plans[0].num_local_tokens_padded
    runs = plans[0].gather_runs_host
    assert runs.device.type == "cpu" and bool((runs[:, 2] > 0).all())
    assert torch.equal(runs[:, 0], torch.cumsum(runs[:, 2], 0) - runs[:, 2])
    spelled = [torch.arange(g, g + k) for _, g, k in runs.tolist()]
    assert torch.equal(
        torch.cat(spelled + [torch.zeros(0, dtype=torch.long)]), plans[0].gather_index
    )
    assert all(g // t == (g + k - 1) // t for _, g, k in runs.tolist())
    every = torch.cat((plans[0].gather_index, plans[0].gather_pad_index))
    assert torch.equal(every.sort().values, torch.arange(pcp * t))

    # Every real prefill token is on exactly one rank; decode tokens on every rank.
    starts = np.concatenate([[0], np.cumsum(n)[:-1]])
    dec_tokens = np.concatenate(
        [np.arange(s, s + k) for s, k, d in zip(starts, n, is_decode) if d] + [[]]
    )
    counts = np.bincount(
        torch.cat([p.token_indices[p.local_valid] for p in plans]).numpy(), minlength=total
    )
    expected = np.ones(total, dtype=np.int64)
    expected[dec_tokens.astype(np.int64)] = pcp
    assert np.array_equal(counts, expected)

    # Equal causal work: slot j of the padded request order attends j + 1 padded keys; the
    # sum over each rank's prefill slots is the same on every rank.
    padded_len = np.where(is_decode | (pcp == 1), pcp * n, 2 * pcp * -(-n // (2 * pcp)))
    preq = np.repeat(np.arange(n.size), padded_len)
    pidx = np.arange(preq.size) - np.repeat(
        np.concatenate([[0], np.cumsum(padded_len)[:-1]]), padded_len
    )
    work = np.where(is_decode[preq], 0, pidx + 1)
    owner = plans[0].restore_index.numpy() // plans[0].token_indices.numel()
    per_rank = np.bincount(owner, weights=work, minlength=pcp)
    assert np.all(per_rank == per_rank[0])

    for r, p in enumerate(plans):
        # Positions are true positions: context + index within the request.
        req = np.searchsorted(starts, p.token_indices.numpy(), side="right") - 1
        assert np.array_equal(p.positions.numpy(), m[req] + p.token_indices.numpy() - starts[req])
        # Segments: bottom-right alignment puts each query on its own key.
        seg = p.segments_host.numpy()
        assert seg[:, 2].sum() == int(p.local_valid.sum())
        for _, q0, ql, k0, kl in seg:
            assert kl >= ql
            if ql:
                rows = p.token_indices[q0 : q0 + ql].numpy()
                assert p.local_valid[q0 : q0 + ql].all()
                assert np.array_equal(rows, np.arange(k0 + kl - ql, k0 + kl))
        c = p.chunk_size.numpy()
        pre = ~is_decode & (p.head_q_len.numpy() > 0)
        assert np.array_equal(p.head_k_len.numpy()[pre], np.minimum(c * (r + 1), n)[pre])
        pre = ~is_decode & (p.tail_q_len.numpy() > 0)
        assert np.array_equal(p.tail_k_len.numpy()[pre], np.minimum(c * (2 * pcp - r), n)[pre])


@pytest.mark.gpu
def test_gpu_one_rank_plans_are_kept_per_batch():
    """At pcp = 1 on a GPU with autograd on (training), the same batch gets the same (read-only)
    plan, another batch its own, and a kept plan's fields equal a fresh build's; without
    autograd (inference, whose cuDNN rental counts calls per plan) every call plans anew."""
    from cp_modules.partition.plan import _plan_one_rank

    a = plan_pcp([5, 3], [0, 2], 1, 0, device="cuda")
    assert plan_pcp([5, 3], [0, 2], 1, 0, device="cuda") is a
    assert plan_pcp([5, 4], [0, 2], 1, 0, device="cuda") is not a
    with torch.no_grad():
        b = plan_pcp([5, 3], [0, 2], 1, 0, device="cuda")
        assert b is not a and plan_pcp([5, 3], [0, 2], 1, 0, device="cuda") is not b
    with torch.inference_mode():
        assert plan_pcp([5, 3], [0, 2], 1, 0, device="cuda") is not a
    n, c = np.array([5, 3]), np.array([0, 2])
    fresh = _plan_one_rank(n, c, (n <= 1) & (c > 0), torch.device("cuda"))
    for f in ("token_indices", "positions", "local_valid", "restore_index", "num_local_tokens"):
        assert torch.equal(getattr(a, f), getattr(fresh, f)), f
