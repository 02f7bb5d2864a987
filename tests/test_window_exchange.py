"""The neighbour exchange of sliding-window layers under PCP.

Host plans (every rank's plan built on one process, the exchange simulated on token ids):
each rank receives exactly the keys its chunks' windows see, at most ``2 * (c + W)`` per
request, and the re-based segments address exactly the all-gather path's keys. Then gloo
ranks (world 2, 4, 8): ``cp::gqa_attention`` with the exchange equals the all-gather path and
the one-process run (outputs and q/k/v/sink gradients in training, fp64; outputs and the KV
cache over prefill, chunked prefill and mixed decode + prefill steps), and a tiny Mistral with
a window at pcp 2 gives the original model's logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_modules.partition import plan_pcp
from cp_modules.partition.window_exchange import plan_window_exchange
from cp_modules.testing import run_distributed

# ----------------------------------------------------------------------------- host plans


def _simulate(n, computed, is_decode, P, W, cache_shard=None):
    """Every rank's plan, and the token ids each rank ends up with after the exchange."""
    plans = [plan_pcp(n, computed, P, r) for r in range(P)]
    xs = [plan_window_exchange(n, computed, is_decode, P, r, W, cache_shard=cache_shard)
          for r in range(P)]  # fmt: skip
    if xs[0] is None:
        assert all(x is None for x in xs)
        return plans, xs, None
    sent = {}
    for s, (plan, x) in enumerate(zip(plans, xs)):
        rows = plan.token_indices.numpy()[x.send_rows.numpy()]
        bounds = np.cumsum([0, *x.send_counts])
        for d in range(P):
            sent[s, d] = rows[bounds[d] : bounds[d + 1]]
    got = []
    for r, x in enumerate(xs):
        assert [sent[s, r].size for s in range(P)] == list(x.recv_counts)
        buf = np.concatenate([sent[s, r] for s in range(P)])
        got.append(buf[x.recv_index.numpy()])
        assert np.array_equal(got[-1], x.token_ids.numpy())
    return plans, xs, got


def _check_keys(n, is_decode, P, W, plans, xs, got):
    key_offsets = np.concatenate([[0], np.cumsum(n)[:-1]])
    for plan, x, ids in zip(plans, xs, got):
        mine, theirs = x.segments_host.numpy(), plan.segments_host.numpy()
        assert np.array_equal(mine[:, :3], theirs[:, :3])  # same queries
        for (req, _, ql, k0, kl), (_, _, _, ok0, okl) in zip(mine, theirs):
            if ql == 0:
                assert kl == okl == 0
                continue
            # The all-gather path's keys [0, okl) of the request, of which the window sees
            # those from the chunk start minus W - 1 on.
            first = 0 if is_decode[req] else max(0, okl - ql - (W - 1))
            assert ok0 == key_offsets[req]
            assert np.array_equal(ids[k0 : k0 + kl], ok0 + np.arange(first, okl))


CASES = {
    # (new tokens, computed tokens) per request; decodes are 1 new token over a context.
    "prefill": ([37, 5, 16, 1], [0, 0, 0, 0]),
    "chunked": ([40, 9], [13, 0]),
    "mixed": ([1, 33, 1, 17], [12, 8, 3, 0]),
}


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_receives_exactly_its_windows_keys(P, case):
    n, computed = (np.array(x) for x in CASES[case])
    is_decode = (n <= 1) & (computed > 0)
    chunk = np.where(is_decode, n, -(-n // (2 * P)))
    # W smaller than a chunk, spanning several chunks, larger than every sequence.
    for W in (1, 2, int(chunk.max()) - 1, 3 * int(chunk.max()) + 1, 100):
        W = max(W, 1)
        plans, xs, got = _simulate(n, computed, is_decode, P, W)
        assert got is not None, (P, W)
        _check_keys(n, is_decode, P, W, plans, xs, got)
        req_of = np.repeat(np.arange(n.size), n)
        for x, ids in zip(xs, got):
            per_request = np.bincount(req_of[ids], minlength=n.size)
            assert (per_request <= np.where(is_decode, n, 2 * (chunk + W))).all()
            assert (per_request[~is_decode] <= n[~is_decode]).all()
            # Decode tokens come from this rank itself.
            from_self = x.recv_counts[x.pcp_rank]
            assert x.num_keys_from_peers == x.num_keys - from_self
        if W < int(chunk.min()):
            # Short windows: a rank receives from peers at most 2 (W - 1) keys per request.
            for x in xs:
                assert x.num_keys_from_peers <= 2 * (W - 1) * int((~is_decode).sum())


@pytest.mark.parametrize("P, dcp, tp_positions", [(2, 2, 1), (2, 4, 2), (4, 4, 1), (4, 8, 2)])
def test_a_cache_write_also_receives_the_tokens_of_the_ranks_shard(P, dcp, tp_positions):
    n, computed = (np.array(x) for x in CASES["mixed"])
    is_decode = (n <= 1) & (computed > 0)
    for interleave in (1, 2):
        for t in range(tp_positions):
            peers = tuple(j * tp_positions + t for j in range(P))
            shard = (dcp, peers, interleave)
            plans, xs, got = _simulate(n, computed, is_decode, P, 3, cache_shard=shard)
            _check_keys(n, is_decode, P, 3, plans, xs, got)
            req_of = np.repeat(np.arange(n.size), n)
            pos = computed[req_of] + np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
            for j, ids in enumerate(got):
                stored = np.flatnonzero(pos // interleave % dcp == peers[j])
                assert np.isin(stored, ids).all()


def test_no_exchange_when_every_rank_needs_every_token():
    n, computed = np.array([20, 7]), np.array([0, 4])
    dec = np.zeros(2, bool)
    # One DCP rank: every rank stores every token, so the all-gather is kept.
    assert plan_window_exchange(n, computed, dec, 2, 0, 3, cache_shard=(1, (0, 0), 1)) is None
    assert plan_window_exchange(n, computed, dec, 2, 0, 3) is not None
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        plan_window_exchange(n, computed, dec, 2, 0, 0)
    with pytest.raises(ValueError, match="a DCP rank per PCP rank"):
        plan_window_exchange(n, computed, dec, 2, 0, 3, cache_shard=(2, (0,), 1))


# ----------------------------------------------------------------------------- gloo ranks

H, D = 4, 8


def _sequences(lengths, dtype, seed, hkv):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(L, h, D, generator=g, dtype=torch.float64).to(dtype) for h in (H, hkv, hkv, H)]
            for L in lengths]  # fmt: skip


def _rows(seqs, i, new, done):
    return torch.cat([seqs[r][i][done[r] : done[r] + new[r]] for r in range(len(new))])


def _by_token(meta, x):
    """One process's local rows [T, ...] as [N, ...] in batch order (padding dropped)."""
    valid = meta.plan.local_valid
    full = x.new_zeros((meta.num_tokens, *x.shape[1:]))
    return full.index_copy_(0, meta.token_indices[valid], x[valid])


def _heads(rt, hkv):
    """This TP rank's query heads and the KV heads they use (one replicated KV head when
    there are fewer KV heads than TP ranks)."""
    if rt is None:
        return slice(None), slice(None)
    t, tp = rt.tp_rank, rt.tp_size
    first_kv = t * (H // tp) // (H // hkv)
    return slice(t * H // tp, (t + 1) * H // tp), slice(first_kv, first_kv + max(1, hkv // tp))


def _attend(rt, meta, q, k, v, cache, sinks, W, softcap):
    from cp_modules.ops.cp_attention import gqa_attention
    from cp_modules.step import cp_step

    with cp_step(meta):
        return gqa_attention(q, k, v, cache, scale=D**-0.5, sinks=sinks, sliding_window=W,
                             softcap=softcap)  # fmt: skip


def _train_case(rts, single, new, W, softcap, use_sinks, hkv):
    """Outputs and q/k/v/sink gradients of one training step, on this rank's rows."""
    from cp_modules.distributed.collectives import all_reduce
    from cp_modules.step import build_step_metadata

    seqs = _sequences(new, torch.float64, seed=3, hkv=hkv)
    g = torch.Generator().manual_seed(5)
    s_all = torch.randn(H, generator=g, dtype=torch.float64) if use_sinks else None
    zeros = [0] * len(new)
    results = {}
    for name, rt in (*rts.items(), ("single", single)):
        hq, hk = _heads(None if name == "single" else rt, hkv)
        meta = build_step_metadata(rt, new)
        idx = meta.token_indices
        q, k, v, do = (_rows(seqs, i, new, zeros)[idx][:, h].clone()
                       for i, h in enumerate((hq, hk, hk, hq)))  # fmt: skip
        leaves = [q, k, v] + ([s_all[hq].clone()] if use_sinks else [])
        for x in leaves:
            x.requires_grad_()
        out = _attend(rt, meta, q, k, v, None, leaves[3] if use_sinks else None, W, softcap)
        valid = meta.plan.local_valid
        grads = torch.autograd.grad((out * do * valid[:, None, None]).sum(), leaves)
        if name != "single":
            if hkv < rt.tp_size:  # a replicated KV head: every TP rank's heads add to it
                grads = (grads[0], *(all_reduce(g, rt.tp_group, rt.tp_size) for g in grads[1:3]),
                         *grads[3:])  # fmt: skip
            if use_sinks:
                grads = (*grads[:3], all_reduce(grads[3], rt.pcp_group, rt.pcp_size))
        results[name] = (meta, out.detach(), grads)
    return results


def _compare_train(rts, single, new, W, softcap, use_sinks, hkv):
    res = _train_case(rts, single, new, W, softcap, use_sinks, hkv)
    smeta, sout, sgrads = res.pop("single")
    for meta, out, grads in res.values():
        hq, hk = _heads(meta.runtime, hkv)
        idx, valid = meta.token_indices, meta.plan.local_valid

        def pick(x, h, idx=idx, valid=valid):
            # Single-process rows in batch order; this rank's tokens and heads of them.
            return _by_token(smeta, x)[idx][valid][:, h]

        torch.testing.assert_close(out[valid], pick(sout, hq), rtol=1e-12, atol=1e-12)
        for got, want, h in zip(grads[:3], sgrads[:3], (hq, hk, hk)):
            torch.testing.assert_close(got[valid], pick(want, h), rtol=1e-11, atol=1e-12)
            assert not got[~valid].any()  # padding rows get no gradient
        if use_sinks:
            torch.testing.assert_close(grads[3], sgrads[3][hq], rtol=1e-11, atol=1e-12)
    ex, ag = res["exchange"], res["all_gather"]
    assert ex[0].window_plans[W, False] is not None and not ag[0].window_plans
    torch.testing.assert_close(ex[1], ag[1], rtol=1e-13, atol=1e-13)
    for a, b in zip(ex[2], ag[2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def _cache_case(rts, single, steps, W, softcap, use_sinks, dtype, hkv):
    """Outputs per step and the final caches over a schedule of (new, done) steps."""
    from cp_modules.cache.paged import allocate_kv_cache
    from cp_modules.step import build_step_metadata

    R = len(steps[0][0])
    lengths = [sum(s[0][r] for s in steps) for r in range(R)]
    seqs = _sequences(lengths, dtype, seed=11, hkv=hkv)
    g = torch.Generator().manual_seed(6)
    s_all = torch.randn(H, generator=g, dtype=torch.float64).to(dtype) if use_sinks else None
    blocks = max(lengths) // 4 + 2
    table = torch.arange(1, 1 + R * blocks, dtype=torch.int32).view(R, blocks)
    results = {}
    for name, rt in (*rts.items(), ("single", single)):
        hq, hk = _heads(None if name == "single" else rt, hkv)
        kc, vc = allocate_kv_cache(1 + R * blocks, 4, max(1, hkv // rt.tp_size), D, dtype=dtype)
        kc.fill_(float("nan"))  # a slot the step should have written and did not shows
        vc.fill_(float("nan"))
        outs = []
        for new, done in steps:
            meta = build_step_metadata(rt, new, done, block_table=table, block_size=4)
            idx = meta.token_indices
            q, k, v = (_rows(seqs, i, new, done)[idx][:, h] for i, h in enumerate((hq, hk, hk)))
            sinks = None if s_all is None else s_all[hq]
            with torch.no_grad():
                out = _attend(rt, meta, q, k, v, (kc, vc), sinks, W, softcap)
            outs.append((meta, out))
        results[name] = (outs, kc, vc)
    return results


def _compare_cache(rts, single, steps, W, softcap, use_sinks, dtype, hkv):
    res = _cache_case(rts, single, steps, W, softcap, use_sinks, dtype, hkv)
    souts, _, _ = res.pop("single")
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=2e-6)
    for name, (outs, _, _) in res.items():
        for (meta, out), (smeta, sout) in zip(outs, souts):
            hq, _ = _heads(meta.runtime, hkv)
            idx, valid = meta.token_indices, meta.plan.local_valid
            want = _by_token(smeta, sout)[idx][valid][:, hq]
            assert not out[valid].isnan().any(), name
            torch.testing.assert_close(out[valid], want, **tol, msg=lambda m, n=name: f"{n}: {m}")
    (ex, kx, vx), (ag, ka, va) = res["exchange"], res["all_gather"]
    # With one DCP rank every rank stores every token: the all-gather is kept (also when a
    # step's windows and shard happen to cover every token); the prefill step exchanges.
    exchanged = [m.window_plans.get((W, True)) is not None for m, _ in ex if not m.all_decode]
    assert exchanged[0] == (ex[0][0].runtime.dcp_size > 1) and not ag[0][0].window_plans
    assert any(exchanged) or ex[0][0].runtime.dcp_size == 1
    same = dict(rtol=1e-13, atol=1e-13) if dtype == torch.float64 else tol
    for (_, a), (_, b) in zip(ex, ag):
        torch.testing.assert_close(a, b, **same)
    # The same cache on this rank, slot for slot (NaN where neither path writes).
    torch.testing.assert_close(kx, ka, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vx, va, rtol=0, atol=0, equal_nan=True)


# Training batches: ragged requests, some shorter than 2P (chunks of padding only).
TRAIN_NEW = [29, 3, 12]
# Cache schedules: a prefill; then a chunked-prefill continuation over the cached prefix
# (no decodes: fp64); then decodes beside continuations (fp32: the paged decode op).
CHUNKED = [([21, 9], [0, 0]), ([14, 11], [21, 9])]
MIXED = [([19, 6], [0, 0]), ([1, 13], [19, 6]), ([1, 1], [20, 19])]
# Windows smaller than a chunk (2), spanning several chunks (9), larger than the sequence.
FEATURES = [(2, None, False), (9, 1.5, True), (64, None, True)]


def _window_exchange_rank(rank, world_size, layouts):
    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.policy import CPPolicy
    from cp_modules.step import CPRuntime

    torch.set_num_threads(1)
    done = []
    single = CPRuntime.single()
    for tp, pcp, dcp, hkv in layouts:
        config = ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                                decode_context_parallel_size=dcp)  # fmt: skip
        config.validate_heads(H, hkv)
        groups = init_cp_groups(config)
        rts = {
            "exchange": CPRuntime.from_groups(groups, policy=CPPolicy(window_exchange=True)),
            "all_gather": CPRuntime.from_groups(groups, policy=CPPolicy(window_exchange=False)),
        }
        for W, softcap, sinks in FEATURES:
            where = (tp, pcp, dcp, W, softcap, sinks)
            _compare_train(rts, single, TRAIN_NEW, W, softcap, sinks, hkv)
            done.append(("train", *where))
            _compare_cache(rts, single, CHUNKED[:1], W, softcap, sinks, torch.float64, hkv)
            done.append(("prefill", *where))
            _compare_cache(rts, single, CHUNKED, W, softcap, sinks, torch.float64, hkv)
            done.append(("chunked", *where))
            _compare_cache(rts, single, MIXED, W, softcap, sinks, torch.float32, hkv)
            done.append(("mixed", *where))
        # The exchange moved fewer rows than the all-gather in the cache-less step.
        meta_rows = _rows_received(rts["exchange"], TRAIN_NEW, FEATURES[0][0])
        done.append(("rows", tp, pcp, dcp, meta_rows))
    return done


def _rows_received(rt, new, W):
    from cp_modules.step import build_step_metadata

    x = build_step_metadata(rt, new).window_exchange(W, False)
    assert x is not None and x.num_keys < sum(new)
    return x.num_keys


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, layouts",
    [
        # (tp, pcp, dcp, KV heads): a DCP group's ranks share their KV heads.
        (2, [(1, 2, 1, 2), (1, 2, 2, 2)]),
        (4, [(1, 4, 4, 2), (2, 2, 4, 1), (2, 2, 2, 2)]),
        (8, [(1, 8, 8, 2), (2, 4, 8, 1)]),
    ],
    ids=["world2", "world4", "world8"],
)
def test_exchange_equals_all_gather_and_one_process_on_gloo(world_size, layouts):
    results = run_distributed(_window_exchange_rank, world_size, layouts, timeout_s=1500)
    expected = len(layouts) * (len(FEATURES) * 4 + 1)
    for per_rank in results:
        assert len(per_rank) == expected


# ----------------------------------------------------------------------------- HF model

HF_LENS = [29, 6, 13]


def _mistral(window):
    from cp_modules.modules.hf_families import build_tiny

    return build_tiny("mistral", sliding_window=window)


def _hf_prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g) for n in HF_LENS]


def _hf_rank(rank, world_size, windows):
    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules import CPRuntime, build_step_metadata, cp_step, restore_tokens
    from cp_modules.modules.hf_swap import allocate_kv_caches, free_kv_caches, swap_attention
    from cp_modules.policy import CPPolicy

    torch.set_num_threads(1)
    prompts = _hf_prompts()
    checked = []
    for dcp in (1, 2):
        groups = init_cp_groups(ParallelConfig(prefill_context_parallel_size=2,
                                               decode_context_parallel_size=dcp))  # fmt: skip
        for window in windows:
            original = _mistral(window)
            with torch.no_grad():
                want = [original(input_ids=p[None]).logits[0] for p in prompts]
            model = swap_attention(_mistral(window), groups)
            for flag in (True, False):
                rt = CPRuntime.from_groups(groups, policy=CPPolicy(window_exchange=flag))

                def step(starts, ends, table=None, rt=rt, model=model):
                    new = [e - s for s, e in zip(starts, ends)]
                    meta = build_step_metadata(rt, new, starts, block_table=table, block_size=4)
                    flat = torch.cat([p[s:e] for p, s, e in zip(prompts, starts, ends)])
                    with torch.no_grad(), cp_step(meta):
                        logits = model(
                            input_ids=flat[meta.token_indices][None],
                            position_ids=meta.positions[None],
                            use_cache=False,
                        ).logits
                        exchanged = any(x is not None for x in meta.window_plans.values())
                        return restore_tokens(logits[0], meta), exchanged  # fmt: skip

                got, exchanged = step([0] * 3, HF_LENS)
                assert exchanged == flag
                torch.testing.assert_close(got, torch.cat(want))
                # Over a paged cache: the first part of each prompt, then the rest over its
                # prefix (with dcp 1 every rank stores every token: the all-gather is kept).
                allocate_kv_caches(model, 40, 4, dtype=torch.float32)
                table = torch.arange(1, 37, dtype=torch.int32).view(3, 12)
                split = [n // 2 for n in HF_LENS]
                _, exchanged = step([0] * 3, split, table)
                assert exchanged == (flag and dcp > 1)
                got, _ = step(split, HF_LENS, table)
                torch.testing.assert_close(got, torch.cat([w[s:] for w, s in zip(want, split)]))
                free_kv_caches(model)
                checked.append((dcp, window, flag))
    return checked


@pytest.mark.distributed
def test_mistral_with_a_window_at_pcp2_equals_the_original_model():
    # pcp 2 with dcp 1 and 2, with and without the exchange.
    windows = (3, 11, 64)  # within a chunk, over several chunks, beyond every prompt
    results = run_distributed(_hf_rank, 2, windows, timeout_s=900)
    for per_rank in results:
        assert per_rank == [(d, w, f) for d in (1, 2) for w in windows for f in (True, False)]
