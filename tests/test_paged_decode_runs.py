"""The GQA paged decode kernel serving runs of consecutive queries of one request (a
speculative verification's ``k + 1`` tokens) in one program: against the per-query reference
(interpreter on CPU, bf16 on the GPU), with DCP shards, windows, soft-cap, fp8 caches, splits,
padding and empty rows, ranges with gaps; the op and the step metadata that carry the run."""

from __future__ import annotations

import pytest
import torch
from test_paged_decode import build_shard, check_against_reference

from cp_modules.cache import dcp_query_kv_len, local_seq_len
from cp_modules.cache.kv_dtype import kv_scale
from cp_modules.kernels.decode.paged import DecodeConfig, paged_attention_kernel
from cp_modules.ops.kv_cache import write_kv_cache
from cp_modules.ops.paged_decode import paged_attention
from cp_modules.reference.paged_decode import paged_attention_ref
from cp_modules.step import CPRuntime, build_step_metadata


def run_queries(lengths, q_len, d, rank, il, window=None):
    """``q_len`` queries per request, at its last ``q_len`` positions (a verification at the
    request's end); positions before 0 are padding (position -1: an empty range). Returns
    (rows, start or None, kv_len, positions)."""
    pos, rows = [], []
    for r, n in enumerate(lengths):
        for g in range(n - q_len, n):
            pos.append(g if g >= 0 else -1)
            rows.append(r)
    positions = torch.tensor(pos)
    kv_len = dcp_query_kv_len(positions, d, rank, il)
    start = None
    if window is not None:
        first = (positions - window + 1).clamp_min(0)
        start = local_seq_len(first, d, rank, il).to(torch.int32)
    return torch.tensor(rows, dtype=torch.int32), start, kv_len, positions


# (hq, hkv, dk, bs, block_h, block_n, splits, q_len, window, softcap, dtype)
RUN_CASES = [
    (4, 2, 16, 8, 16, 16, 1, 3, None, None, torch.float32),  # 6 rows of a 16-row tile
    (8, 2, 32, 8, 16, 32, 3, 5, None, None, torch.float32),  # 20 rows: two row tiles, split
    (6, 1, 16, 16, 16, 16, 2, 3, 5, 2.0, torch.float32),  # group 6 cut by the tile, window
    (4, 1, 16, 8, 32, 16, 4, 4, 2, None, torch.float16),  # window shorter than the run
    (4, 4, 16, 16, 16, 16, None, 2, None, 1.5, torch.float32),  # MHA, split count chosen
]


def _case_id(c):
    return (
        f"H{c[0]}-KV{c[1]}-D{c[2]}-BS{c[3]}-M{c[4]}-N{c[5]}-S{c[6] or 'auto'}-Q{c[7]}"
        f"-W{c[8] or 0}-C{c[9] or 0}-{str(c[10]).split('.')[-1]}"
    )


@pytest.mark.parametrize("case", RUN_CASES, ids=[_case_id(c) for c in RUN_CASES])
def test_runs_match_the_per_query_reference_interpreted(case):
    # DCP rank 1 of 2, interleave 2: the 1-token request is padding but for its last query
    # (which sees nothing on this rank), the 2-token one partly padding; 7 runs, the last
    # one cut short (the queries are not a multiple of q_len).
    hq, hkv, dk, bs, block_h, block_n, splits, q_len, window, softcap, dtype = case
    lengths, d, rank, il = [1, 2, 37, 90], 2, 1, 2
    shard = build_shard(lengths, bs=bs, d=d, rank=rank, interleave=il, dtype=dtype, hkv=hkv,
                        dk=dk)  # fmt: skip
    rows, start, kv_len, _ = run_queries(lengths, q_len, d, rank, il, window)
    rows, kv_len = rows[:-1], kv_len[:-1]
    start = None if start is None else start[:-1]
    assert rows.numel() % q_len and (kv_len == 0).any()
    q = torch.randn(rows.numel(), hq, dk).to(dtype)
    cfg = DecodeConfig(block_h=block_h, block_n=block_n, num_warps=4, num_stages=1)
    kw = {"query_kv_start": start, "softcap": softcap}
    out, lse = paged_attention_kernel(q, *shard.caches, shard.block_table, rows, kv_len,
                                      dk**-0.5, splits, config=cfg, query_len=q_len,
                                      **kw)  # fmt: skip
    args = (q, *shard.caches, shard.block_table, rows, kv_len, dk**-0.5)
    ref = paged_attention_ref(*args, **kw)
    same = None if dtype == torch.float32 else paged_attention_ref(*args, upcast=False, **kw)
    check_against_reference(out, lse, ref, same, name=_case_id(case))


@pytest.mark.parametrize("q_len, splits", [(1, 3), (3, 1)], ids=["Q1-S3", "Q3-S1"])
def test_bf16_block_table_ahead_loop_matches_the_default_interpreted(monkeypatch, q_len, splits):
    # BF16_BT_AHEAD forced on (by default on only for few programs) runs float caches through
    # the loop that loads each tile's block-table entries one tile ahead (needs num_stages
    # >= 3): the default loop's values, within the 2x rule of the reference.
    from cp_modules.kernels.decode import paged

    lengths, d, rank, il = [2, 37, 90], 2, 1, 2
    shard = build_shard(lengths, bs=8, d=d, rank=rank, interleave=il, dtype=torch.float16,
                        hkv=2, dk=16)  # fmt: skip
    rows, _, kv_len, _ = run_queries(lengths, q_len, d, rank, il)
    q = torch.randn(rows.numel(), 4, 16).to(torch.float16)
    cfg = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=3)
    args = (q, *shard.caches, shard.block_table, rows, kv_len, 16**-0.5)
    outs = {}
    for ahead in (False, True):
        monkeypatch.setattr(paged, "BF16_BT_AHEAD", ahead)
        outs[ahead] = paged_attention_kernel(*args, splits, config=cfg, query_len=q_len)
    # Only the order of the address loads differs: the same bits.
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    ref, same = paged_attention_ref(*args), paged_attention_ref(*args, upcast=False)
    check_against_reference(*outs[True], ref, same, name=f"ahead-Q{q_len}-S{splits}")


def test_runs_with_disjoint_ranges_read_no_slot_between_them_interpreted():
    # One run of three queries of row 0 with ranges [0, 6), [40, 52) and [20, 21) (starts
    # past other rows' ends, out of order): the slots no query sees are NaN.
    bs = 8
    shard = build_shard([64], bs=bs, d=1, rank=0, interleave=1, dtype=torch.float32, hkv=2, dk=16)
    kc, vc = shard.caches
    hidden = torch.tensor([j for j in range(64) if not (j < 6 or 40 <= j < 52 or j == 20)])
    blocks = shard.block_table[0, hidden // bs].long()
    for c in (kc, vc):
        c[blocks, hidden % bs] = float("nan")
    rows = torch.zeros(3, dtype=torch.int32)
    start = torch.tensor([0, 40, 20], dtype=torch.int32)
    kv_len = torch.tensor([6, 52, 21], dtype=torch.int32)
    q = torch.randn(3, 4, 16)
    for splits in (1, 3):
        cfg = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
        out, lse = paged_attention_kernel(q, kc, vc, shard.block_table, rows, kv_len, 0.25,
                                          splits, config=cfg, query_kv_start=start,
                                          query_len=3)  # fmt: skip
        ref = paged_attention_ref(q, kc, vc, shard.block_table, rows, kv_len, 0.25,
                                  query_kv_start=start)  # fmt: skip
        assert torch.isfinite(out).all()
        check_against_reference(out, lse, ref, None, name=f"gaps-S{splits}")


@pytest.fixture(params=[False, True], ids=["K-NxD", "K-DxN"])
def k_transposed(request, monkeypatch):
    """Both key-tile loads of the fp8 kernel (FP8_K_TRANSPOSED)."""
    import cp_modules.kernels.decode.paged as gqa_kernels

    monkeypatch.setattr(gqa_kernels, "FP8_K_TRANSPOSED", request.param)
    return request.param


def test_runs_on_an_fp8_cache_match_reference_interpreted(k_transposed):
    g = torch.Generator().manual_seed(1)
    hkv, d, bs, nb, q_len = 2, 32, 8, 24, 3
    lengths = [50, 9]
    kc = torch.zeros(nb, bs, hkv, d, dtype=torch.float8_e4m3fn)
    vc = kc.clone()
    ks, vs = kv_scale(torch.tensor([0.5, 1.5]), hkv), kv_scale(0.8, hkv)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    bt = torch.stack([perm[:7], perm[7:14]])
    for r, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = bt[r, pos // bs].to(torch.int64) * bs + pos % bs
        k = torch.randn(n, hkv, d, generator=g)
        write_kv_cache(k, torch.randn(n, hkv, d, generator=g), kc, vc, slots, ks, vs)
    rows, start, kv_len, _ = run_queries(lengths, q_len, 1, 0, 1, window=20)
    q = torch.randn(rows.numel(), 8, d, generator=g)
    # 3 stages: the fp8 loop with block-table entries one tile ahead (BT_AHEAD); the
    # interpreter has no software pipeline.
    cfg = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=3)
    kw = {"query_kv_start": start, "softcap": 5.0, "k_scale": ks, "v_scale": vs}
    out, lse = paged_attention_kernel(q, kc, vc, bt, rows, kv_len, d**-0.5, 2, config=cfg,
                                      query_len=q_len, **kw)  # fmt: skip
    ref = paged_attention_ref(q, kc, vc, bt, rows, kv_len, d**-0.5, **kw)
    check_against_reference(out, lse, ref, None, name="fp8-runs")


def test_op_takes_query_len_and_checks_it():
    shard = build_shard([20, 9], bs=4, d=1, rank=0, interleave=1, dtype=torch.float32, hkv=2,
                        dk=16)  # fmt: skip
    rows, _, kv_len, _ = run_queries([20, 9], 3, 1, 0, 1)
    q = torch.randn(rows.numel(), 4, 16)
    args = (q, *shard.caches, shard.block_table, rows, kv_len)
    out, lse = paged_attention(*args, scale=0.25, query_len=3)
    ref = paged_attention_ref(*args, 0.25)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="query_len must be an integer >= 1"):
            paged_attention(*args, scale=0.25, query_len=bad)


def test_step_metadata_names_the_decode_run_length():
    rt = CPRuntime.single()
    bt = torch.zeros(3, 4, dtype=torch.int32)

    def run_len(num_new, num_comp, threshold):
        meta = build_step_metadata(rt, num_new, num_comp, block_table=bt, block_size=4,
                                   decode_threshold=threshold)  # fmt: skip
        return meta.decode_query_len

    assert run_len([1, 1, 1], [3, 5, 2], 1) == 1
    assert run_len([4, 4, 4], [3, 5, 2], 4) == 4  # a verification of 3 drafts each
    assert run_len([4, 2, 4], [3, 5, 2], 4) == 1  # unequal: each query on its own
    assert run_len([3, 3, 9], [3, 5, 0], 3) == 3  # a prompt beside two decodes of 3


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1, 100], ids=["Wfull", "W1", "W100"])
@pytest.mark.parametrize("splits", [None, 1, 7], ids=["Sauto", "S1", "S7"])
@pytest.mark.parametrize("q_len", [2, 5, 8], ids=lambda n: f"Q{n}")
def test_gpu_runs_two_x_rule(window, splits, q_len):
    # Llama-3-8B's heads (32 on 8 KV heads, D 128) in bf16 on a DCP shard (rank 1 of 2,
    # interleave 16: the short requests leave it empty or padded), against the fp32 reference:
    # at most twice the same-dtype reference's error. Blocks wholly before every query's
    # window get out-of-range ids that the kernel must never read.
    d, rank, il, bs = 2, 1, 16, 64
    lengths = [1, 3, 17, 300, 2053, 4097, 6000]
    gen = torch.Generator(device="cuda").manual_seed(4)
    shard = build_shard(lengths, bs=bs, d=d, rank=rank, interleave=il, dtype=torch.bfloat16,
                        device="cuda", hkv=8, dk=128, gen=gen)  # fmt: skip
    rows, start, kv_len, _ = run_queries(lengths, q_len, d, rank, il, window)
    rows, kv_len = rows.cuda(), kv_len.cuda()
    if start is not None:
        start = start.cuda()
        for r in range(len(lengths)):
            shard.block_table[r, : int(start[rows == r].min()) // bs] = 1 << 24
    q = torch.randn(rows.numel(), 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    args = (q, *shard.caches, shard.block_table, rows, kv_len, 128**-0.5)
    out, lse = paged_attention_kernel(*args, splits, query_kv_start=start, query_len=q_len)
    ref = paged_attention_ref(*args, query_kv_start=start)
    same = paged_attention_ref(*args, upcast=False, query_kv_start=start)
    check_against_reference(out, lse, ref, same, atol=1e-4, name=f"runs-Q{q_len}")


@pytest.mark.gpu
def test_gpu_runs_in_a_cuda_graph_replay_with_new_lengths():
    # Capture a run of 5 queries per request once, then move the lengths: every replay equals
    # an eager launch bit for bit, and the 2x rule against the reference.
    lengths, q_len = [100, 3000, 5], 5
    shard = build_shard(lengths, bs=16, d=1, rank=0, interleave=1, dtype=torch.bfloat16,
                        device="cuda", hkv=8, dk=128)  # fmt: skip
    for c in shard.caches:
        c.nan_to_num_(0.0)
    rows = torch.arange(3, device="cuda", dtype=torch.int32).repeat_interleave(q_len)
    q = torch.randn(rows.numel(), 32, 128, device="cuda", dtype=torch.bfloat16)
    kv_len = torch.zeros(rows.numel(), device="cuda", dtype=torch.int32)

    def run():
        return paged_attention(q, *shard.caches, shard.block_table, rows, kv_len, scale=0.088,
                               query_len=q_len)  # fmt: skip

    def lengths_of(ends):
        steps = torch.arange(q_len) - q_len + 1
        return (torch.tensor(ends)[:, None] + steps).clamp_min(0).flatten()

    kv_len.copy_(lengths_of(lengths))
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for ends in ([1, 2999, 0], [100, 3000, 5], [64, 1, 4]):
        kv_len.copy_(lengths_of(ends))
        graph.replay()
        want_out, want_lse = run()
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
        args = (q, *shard.caches, shard.block_table, rows, kv_len, 0.088)
        ref, same = paged_attention_ref(*args), paged_attention_ref(*args, upcast=False)
        check_against_reference(out, lse, ref, same, atol=1e-4, name="graph-runs")
