"""DCP decode end to end on gloo: every rank writes its shard of the same requests through the
real write path (slot mapping + cp write op), attends its shard, and the LSE combine of the
ranks' partial results equals dense attention over the whole sequence.

One spawn per DCP size runs every case inside the ranks.
"""

from __future__ import annotations

import pytest
import torch

from cp_modules.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

# (kind, block size, interleave, request lengths, new tokens per request)
CASES = [
    ("gqa", 4, 1, [1, 2, 37, 100], 1),
    ("gqa", 8, 8, [3, 64, 77], 3),
    ("gqa", 16, 4, [130], 5),
    ("mla", 8, 2, [1, 50, 97], 2),
    ("mla", 16, 16, [5, 200], 1),
]
HQ, HKV, DK = 8, 2, 16
RK, ROPE = 32, 8


def _dense(q, k, v, scale):
    """fp64 attention of q [Hq, Dk] on k [L, Hkv, Dk], v [L, Hkv, Dv]."""
    g = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), kk) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv), torch.logsumexp(s, -1)


def _run_case(seed, case, d, rank, groups, check_dcp_combine):
    """One case on this rank; returns its error numbers and storage counts."""
    import torch.distributed as dist

    from cp_modules.cache import (
        BlockAllocator,
        BlockTable,
        dcp_num_blocks,
        dcp_query_kv_len,
        dcp_slot_mapping,
        local_seq_len,
    )
    from cp_modules.ops.kv_cache import write_kv_cache, write_mla_cache
    from cp_modules.ops.lse_combine import lse_combine
    from cp_modules.ops.paged_decode import paged_attention, paged_mla_attention

    kind, bs, il, lengths, new = case
    gen = torch.Generator().manual_seed(seed)  # the same global data on every rank
    num_reqs = len(lengths)
    if kind == "gqa":
        ks = [torch.randn(n, HKV, DK, generator=gen) for n in lengths]
        vs = [torch.randn(n, HKV, DK, generator=gen) for n in lengths]
        q = torch.randn(num_reqs * new, HQ, DK, generator=gen)
        scale = DK**-0.5
    else:
        kv_c = [torch.randn(n, RK, generator=gen) for n in lengths]
        k_pe = [torch.randn(n, ROPE, generator=gen) for n in lengths]
        q = torch.randn(num_reqs * new, HQ, RK + ROPE, generator=gen)
        scale = 0.1

    # The scheduler's allocator and table run identically on every rank.
    max_len = max(lengths)
    num_blocks = sum(dcp_num_blocks(n, bs, d) for n in lengths)
    alloc = BlockAllocator(num_blocks + 2)
    alloc.free(alloc.allocate(num_blocks + 2)[::-1])
    table = BlockTable(num_reqs, max_len, bs, alloc, dcp_size=d)
    if kind == "gqa":
        k_cache = torch.full((num_blocks + 2, bs, HKV, DK), float("nan"))
        v_cache = torch.full_like(k_cache, float("nan"))
    else:
        cache = torch.full((num_blocks + 2, bs, RK + ROPE), float("nan"))

    def write(rows, positions):
        slots = dcp_slot_mapping(positions, rows, table.tensor, bs, d, rank, il)
        if kind == "gqa":
            k = torch.stack([ks[r][p] for r, p in zip(rows.tolist(), positions.tolist())])
            v = torch.stack([vs[r][p] for r, p in zip(rows.tolist(), positions.tolist())])
            write_kv_cache(k, v, k_cache, v_cache, slots)
        else:
            c = torch.stack([kv_c[r][p] for r, p in zip(rows.tolist(), positions.tolist())])
            pe = torch.stack([k_pe[r][p] for r, p in zip(rows.tolist(), positions.tolist())])
            write_mla_cache(c, pe, cache, slots)

    # Prefill every request's context in one batch, then the new tokens one step at a time
    # (as decode / speculative verification would write them), growing the table as needed.
    ctx = [max(0, n - new) for n in lengths]
    for r, n in enumerate(ctx):
        table.ensure_capacity(r, n)
    write(
        torch.cat([torch.full((n,), r) for r, n in enumerate(ctx)]),
        torch.cat([torch.arange(n) for n in ctx]),
    )
    for step in range(new):
        rows, positions = [], []
        for r, n in enumerate(lengths):
            if ctx[r] + step < n:
                table.ensure_capacity(r, ctx[r] + step + 1)
                rows.append(r)
                positions.append(ctx[r] + step)
        write(torch.tensor(rows), torch.tensor(positions))

    # Queries: the new tokens of every request, causal among themselves. A request shorter
    # than `new` repeats its last position so that T stays num_reqs * new.
    q_rows = torch.arange(num_reqs).repeat_interleave(new)
    q_pos = torch.tensor([min(n - 1, max(0, n - new) + j) for n in lengths for j in range(new)])
    kv_len = dcp_query_kv_len(q_pos, d, rank, il)
    if kind == "gqa":
        out, lse = paged_attention(q, k_cache, v_cache, table.tensor, q_rows, kv_len, scale=scale)
        written = int((~k_cache.isnan().any(-1).any(-1)).sum())
    else:
        out, lse = paged_mla_attention(
            q, cache, table.tensor, q_rows, kv_len, scale=scale, kv_lora_rank=RK
        )
        written = int((~cache.isnan().any(-1)).sum())

    outs = [torch.empty_like(out) for _ in range(d)]
    lses = [torch.empty_like(lse) for _ in range(d)]
    dist.all_gather(outs, out, group=groups.dcp)
    dist.all_gather(lses, lse, group=groups.dcp)
    combined, combined_lse = lse_combine(torch.stack(outs), torch.stack(lses), return_lse=True)

    err_out = err_lse = 0.0
    for t, (r, p) in enumerate(zip(q_rows.tolist(), q_pos.tolist())):
        if kind == "gqa":
            want, want_lse = _dense(q[t], ks[r][: p + 1], vs[r][: p + 1], scale)
        else:
            k = torch.cat([kv_c[r], k_pe[r]], -1)[: p + 1, None]
            want, want_lse = _dense(q[t], k, k[..., :RK], scale)
        err_out = max(err_out, float((combined[t].double() - want).abs().max()))
        err_lse = max(err_lse, float((combined_lse[t].double() - want_lse).abs().max()))

    res = {
        "err_out": err_out,
        "err_lse": err_lse,
        "stored": written,
        "want_stored": sum(local_seq_len(n, d, rank, il) for n in lengths),
        "blocks": alloc.num_used,
        "want_blocks": sum(dcp_num_blocks(n, bs, d) for n in lengths),
        "empty_queries": int((kv_len == 0).sum()),
        "empty_lse_ok": bool(
            torch.isneginf(lse[kv_len == 0]).all() and (out[kv_len == 0] == 0).all()
        ),
    }
    if check_dcp_combine:
        res.update(_dcp_combine_errors(out, lse, combined, groups))
    return res


def _dcp_combine_errors(out, lse, combined, groups):
    """The project's DCP combine backends give this rank's heads of the same combined result."""
    from cp_modules.ops.dcp_comm import DCPCommSpec, dcp_combine

    res = {}
    h = out.shape[1] // groups.config.tp
    own = combined[:, groups.tp_rank * h : (groups.tp_rank + 1) * h]
    for reduce in ("reduce_scatter", "a2a"):
        spec = DCPCommSpec.from_groups(groups, reduce=reduce)
        got = dcp_combine(out, lse, spec)
        res[f"err_{reduce}"] = float((got - own).abs().max())
    return res


def _dcp_decode_rank(rank, world_size, cases, check_dcp_combine):
    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups

    config = ParallelConfig(
        tensor_parallel_size=world_size, decode_context_parallel_size=world_size
    )
    groups = init_cp_groups(config)
    assert groups.dcp_rank == rank
    return [
        _run_case(i, case, world_size, groups.dcp_rank, groups, check_dcp_combine)
        for i, case in enumerate(cases)
    ]


@pytest.mark.parametrize("dcp", [2, 4, 8], ids=["dcp2", "dcp4", "dcp8"])
def test_sharded_decode_combines_to_dense_attention(dcp):
    # The functional collectives behind dcp_combine import torch._dynamo in every rank (seconds
    # each on a small CPU machine), so the combine backends are checked at the smallest size.
    per_rank = run_distributed(_dcp_decode_rank, dcp, CASES, dcp == 2, timeout_s=240.0)
    checked_backends = set()
    for case_idx, case in enumerate(CASES):
        name = f"{case[0]}-BS{case[1]}-I{case[2]}-L{case[3]}"
        results = [per_rank[r][case_idx] for r in range(dcp)]
        for rank, res in enumerate(results):
            assert res["err_out"] < 1e-5, (name, rank, res)
            assert res["err_lse"] < 1e-5, (name, rank, res)
            assert res["stored"] == res["want_stored"], (name, rank, res)
            assert res["blocks"] == res["want_blocks"], (name, rank, res)
            assert res["empty_lse_ok"], (name, rank, res)
            for key in ("err_reduce_scatter", "err_a2a"):
                if key in res:
                    assert res[key] < 1e-6, (name, rank, key, res)
                    checked_backends.add(key)
        # Every token is stored exactly once across the group.
        assert sum(r["stored"] for r in results) == sum(case[3]), name
        if min(case[3]) < dcp * case[2]:
            assert sum(r["empty_queries"] for r in results) > 0, name
    if dcp == 2:
        assert checked_backends == {"err_reduce_scatter", "err_a2a"}
