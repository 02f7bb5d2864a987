"""Paged KV cache with DCP sharding: slot math (exact, brute force), allocator, cache writes."""

from __future__ import annotations

import itertools

import pytest
import torch

from cp_modules.cache import (
    BlockAllocator,
    BlockTable,
    NoFreeBlocksError,
    allocate_kv_cache,
    allocate_mla_cache,
    dcp_local_offset,
    dcp_max_local_len,
    dcp_num_blocks,
    dcp_query_kv_len,
    dcp_rank_of,
    dcp_scheduler_block_size,
    dcp_slot_mapping,
    dcp_token_capacity,
    kv_cache_bytes_per_block,
    local_seq_len,
    num_blocks_for_memory,
)
from cp_modules.kernels.cache import write_kv_cache_kernel, write_mla_cache_kernel
from cp_modules.ops.kv_cache import write_kv_cache, write_mla_cache
from cp_modules.reference.kv_cache import write_kv_cache_ref, write_mla_cache_ref

LAYOUTS = [(d, i) for d in (1, 2, 3, 4, 8) for i in (1, 2, 4, 16)]


def _ids(layouts):
    return [f"D{d}-I{i}" for d, i in layouts]


def _seed_local_seq_lens(seq_lens: torch.Tensor, d: int, rank: int, i: int) -> torch.Tensor:
    """The upstream tensor formula: base rounds plus a clipped remainder."""
    base = seq_lens // i // d * i
    rem = seq_lens - base * d
    return base + torch.clip(rem - rank * i, 0, i)


def _brute_local_len(length: int, d: int, rank: int, i: int) -> int:
    return sum(1 for p in range(length) if (p // i) % d == rank)


# ---------------------------------------------------------------------------------------------
# local_seq_len and friends: exact against the seed formula and brute-force enumeration.


@pytest.mark.parametrize(("d", "i"), LAYOUTS, ids=_ids(LAYOUTS))
def test_local_seq_len_matches_seed_formula_and_enumeration(d, i):
    lens = torch.arange(0, 3 * d * i + 7)
    total = torch.zeros_like(lens)
    for rank in range(d):
        got = local_seq_len(lens, d, rank, i)
        assert got.dtype == lens.dtype
        assert torch.equal(got, _seed_local_seq_lens(lens, d, rank, i))
        brute = torch.tensor([_brute_local_len(int(n), d, rank, i) for n in lens])
        assert torch.equal(got, brute)
        assert [local_seq_len(int(n), d, rank, i) for n in lens] == brute.tolist()
        total += got
    assert torch.equal(total, lens)


@pytest.mark.parametrize(("d", "i"), LAYOUTS, ids=_ids(LAYOUTS))
def test_max_local_len_bounds_every_rank(d, i):
    for length in range(0, 2 * d * i + 5):
        most = max(local_seq_len(length, d, r, i) for r in range(d))
        bound = dcp_max_local_len(length, d, i)
        assert bound == -(-length // (d * i)) * i
        assert most <= bound < most + i or (most == bound == 0)
        assert most == local_seq_len(length, d, 0, i)


def test_query_kv_len_counts_visible_local_tokens():
    d, i = 4, 2
    positions = torch.arange(0, 40, dtype=torch.int64)
    for rank in range(d):
        got = dcp_query_kv_len(positions, d, rank, i)
        assert got.dtype == torch.int32
        want = [_brute_local_len(int(g) + 1, d, rank, i) for g in positions]
        assert got.tolist() == want
    # Why the helper exists: the local length does not shift with the global one.
    big, k = 17, 2
    assert local_seq_len(big - k, d, 0, i) == 4 != local_seq_len(big, d, 0, i) - k


def test_rank_of_and_local_offset_formulas():
    bs, d, i = 8, 4, 2
    p = torch.arange(200)
    assert torch.equal(dcp_rank_of(p, d, i), (p // i) % d)
    want = (p % (bs * d)) // (d * i) * i + p % i
    assert torch.equal(dcp_local_offset(p, bs, d, i), want)
    assert dcp_rank_of(13, d, i) == 2 and dcp_local_offset(13, bs, d, i) == 3
    assert dcp_scheduler_block_size(bs, d) == 32
    assert dcp_num_blocks(33, bs, d) == 2 and dcp_num_blocks(0, bs, d) == 0


SLOT_CASES = [(bs, d, i) for bs in (4, 16) for d in (1, 2, 4, 8) for i in (1, 2, 4) if i <= bs]


@pytest.mark.parametrize(
    ("bs", "d", "i"), SLOT_CASES, ids=[f"BS{b}-D{d}-I{i}" for b, d, i in SLOT_CASES]
)
def test_slot_mapping_matches_enumeration(bs, d, i):
    """The j-th token a rank holds of a request sits at entry j // bs, offset j % bs."""
    lengths = [1, bs * d - 1, 3 * bs * d + 5]
    m = dcp_num_blocks(max(lengths), bs, d)
    block_table = torch.randperm(len(lengths) * m, dtype=torch.int32).view(len(lengths), m)
    positions = torch.cat([torch.arange(n) for n in lengths])
    rows = torch.cat([torch.full((n,), r) for r, n in enumerate(lengths)])
    seen_slots = []
    for rank in range(d):
        slots = dcp_slot_mapping(positions, rows, block_table, bs, d, rank, i)
        assert slots.dtype == torch.int64
        want = []
        for r, n in enumerate(lengths):
            j = 0
            for p in range(n):
                if (p // i) % d == rank:
                    want.append(int(block_table[r, j // bs]) * bs + j % bs)
                    j += 1
                else:
                    want.append(-1)
            assert j == local_seq_len(n, d, rank, i)
        assert slots.tolist() == want
        mine = slots[slots >= 0]
        assert mine.unique().numel() == mine.numel()
        seen_slots.append(mine)
    # Every token is stored by exactly one rank.
    owners = torch.stack(
        [dcp_slot_mapping(positions, rows, block_table, bs, d, r, i) >= 0 for r in range(d)]
    )
    assert torch.equal(owners.sum(0), torch.ones_like(positions))


def test_slot_mapping_drops_padding_and_out_of_table_positions():
    block_table = torch.tensor([[5, 6]], dtype=torch.int32)
    positions = torch.tensor([-1, 0, 1, 15, 16, 100])
    rows = torch.zeros_like(positions)
    slots = dcp_slot_mapping(positions, rows, block_table, 4, 2, 0, 1)
    # Virtual block = 8 positions, so the table covers positions [0, 16).
    assert slots.tolist() == [-1, 20, -1, -1, -1, -1]
    assert dcp_slot_mapping(positions, rows, block_table, 4, 2, 1, 1).tolist() == [
        -1,
        -1,
        20,
        27,
        -1,
        -1,
    ]


def test_dcp_layout_errors_name_the_argument():
    with pytest.raises(ValueError, match="dcp_rank"):
        local_seq_len(4, 2, 2, 1)
    with pytest.raises(ValueError, match="dcp_size"):
        local_seq_len(4, 0, 0, 1)
    with pytest.raises(ValueError, match="interleave=3 must be <= block_size=8 and divide it"):
        dcp_slot_mapping(torch.arange(2), torch.zeros(2), torch.zeros(1, 1), 8, 2, 0, 3)
    with pytest.raises(ValueError, match="positions and block_table_rows"):
        dcp_slot_mapping(torch.arange(2), torch.zeros(3), torch.zeros(1, 1), 8, 2, 0, 1)


# ---------------------------------------------------------------------------------------------
# Allocator, block table, memory accounting.


def test_allocator_is_deterministic_and_checks_frees():
    a, b = BlockAllocator(6), BlockAllocator(6)
    for alloc in (a, b):
        x = alloc.allocate(2)
        alloc.allocate(3)
        alloc.free(x)
    assert a.allocate(3) == b.allocate(3) == [5, 0, 1]
    assert a.num_free == 0 and a.num_used == 6
    with pytest.raises(NoFreeBlocksError, match="only 0 of 6"):
        a.allocate(1)
    with pytest.raises(ValueError, match="cannot free"):
        BlockAllocator(4).free([0])
    c = BlockAllocator(4)
    ids = c.allocate(2)
    c.free(ids)
    with pytest.raises(ValueError, match="cannot free"):
        c.free(ids)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def test_block_table_grows_frees_and_rolls_back_nothing_on_oom():
    alloc = BlockAllocator(5)
    table = BlockTable(2, 64, 4, alloc, dcp_size=2)
    assert table.max_blocks_per_req == 8 and table.tensor.shape == (2, 8)
    assert table.ensure_capacity(0, 9) == [0, 1]  # 9 tokens / (4 * 2) per entry
    assert table.ensure_capacity(0, 16) == []
    assert table.ensure_capacity(1, 1) == [2]
    assert table.tensor[0, :2].tolist() == [0, 1] and table.tensor[1, 0] == 2
    with pytest.raises(NoFreeBlocksError):
        table.ensure_capacity(1, 64)
    assert table.blocks(1) == [2] and alloc.num_free == 2
    table.free_row(0)
    assert alloc.num_free == 4 and table.blocks(0) == [] and table.tensor[0].abs().sum() == 0
    with pytest.raises(ValueError, match="seq_len must be in"):
        table.ensure_capacity(0, 65)


@pytest.mark.parametrize(
    ("d", "i"),
    [(1, 1), (2, 1), (4, 4), (8, 16), (8, 1)],
    ids=_ids([(1, 1), (2, 1), (4, 4), (8, 16), (8, 1)]),
)
def test_blocks_per_rank_shrink_by_dcp(d, i):
    """SPEC §6: a rank stores at most ceil(L/(D*I))*I tokens and allocates ceil(L/(bs*D)) blocks."""
    bs = 16
    for length in (1, 15, 16, 17, 1000, 4096, 4097, 131072):
        alloc = BlockAllocator(dcp_num_blocks(131072, bs, 1))
        table = BlockTable(1, 131072, bs, alloc, dcp_size=d)
        table.ensure_capacity(0, length)
        blocks = alloc.num_used
        assert blocks == -(-length // (bs * d))
        stored = [local_seq_len(length, d, r, i) for r in range(d)]
        assert max(stored) <= dcp_max_local_len(length, d, i) <= -(-length // d) + i
        # The allocation holds the largest shard with less than one block to spare.
        assert max(stored) <= blocks * bs < max(stored) + bs
        if length >= 4096:
            assert blocks * d <= -(-length // bs) + d - 1


def test_memory_accounting_and_allocation_helpers():
    per_block = kv_cache_bytes_per_block(16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert per_block == 16 * 2 * 8 * 128 * 2
    mla = kv_cache_bytes_per_block(64, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    assert mla == 64 * 576 * 2
    blocks = num_blocks_for_memory(10 * per_block + 5, per_block)
    assert blocks == 10
    assert dcp_token_capacity(blocks, 16, 4) == 4 * dcp_token_capacity(blocks, 16, 1) == 640
    with pytest.raises(ValueError, match="either num_kv_heads"):
        kv_cache_bytes_per_block(16, dtype=torch.float16)
    k, v = allocate_kv_cache(3, 16, 2, 64, dtype=torch.float16)
    assert k.shape == v.shape == (3, 16, 2, 64) and k.dtype == torch.float16 and not k.any()
    c = allocate_mla_cache(3, 64, dtype=torch.float32)
    assert c.shape == (3, 64, 576)
    with pytest.raises(ValueError, match="head_dim"):
        allocate_kv_cache(3, 16, 2, 0)


# ---------------------------------------------------------------------------------------------
# cp::write_kv_cache / cp::write_mla_cache.


def _gqa_write_inputs(dtype=torch.float32, cache_dtype=None, t=7, h=2, d=16, nb=4, bs=4):
    k = torch.randn(t, h, d, dtype=dtype)
    v = torch.randn(t, h, d, dtype=dtype)
    kc = torch.full((nb, bs, h, d), float("nan"), dtype=cache_dtype or dtype)
    vc = torch.full_like(kc, float("nan"))
    slots = torch.tensor([3, -1, 0, 15, -1, 9, 6], dtype=torch.int64)[:t]
    return k, v, kc, vc, slots


def test_write_kv_cache_writes_slots_and_skips_minus_one():
    k, v, kc, vc, slots = _gqa_write_inputs()
    write_kv_cache(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t])
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_write_mla_cache_stores_latent_then_rope_key():
    kv_c, k_pe = torch.randn(3, 32), torch.randn(3, 8)
    cache = torch.full((2, 4, 40), float("nan"))
    write_mla_cache(kv_c, k_pe, cache, torch.tensor([5, -1, 0], dtype=torch.int32))
    flat = cache.view(-1, 40)
    assert torch.equal(flat[5], torch.cat([kv_c[0], k_pe[0]]))
    assert torch.equal(flat[0], torch.cat([kv_c[2], k_pe[2]]))
    assert torch.isnan(flat[[1, 2, 3, 4, 6, 7]]).all()


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=["fp32", "fp32-to-fp16", "bf16"],
)
def test_write_kernels_match_reference_exactly(dtype, cache_dtype):
    k, v, kc, vc, slots = _gqa_write_inputs(dtype, cache_dtype, h=3, d=24)
    kr, vr = kc.clone(), vc.clone()
    write_kv_cache_kernel(k, v, kc, vc, slots.to(torch.int32))
    write_kv_cache_ref(k, v, kr, vr, slots)
    assert torch.equal(kc.nan_to_num(7.0), kr.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vr.nan_to_num(7.0))

    kv_c, k_pe = torch.randn(4, 48, dtype=dtype), torch.randn(4, 16, dtype=dtype)
    cache = torch.full((2, 4, 64), float("nan"), dtype=cache_dtype)
    ref = cache.clone()
    slots = torch.tensor([7, -1, 2, 4])
    write_mla_cache_kernel(kv_c, k_pe, cache, slots)
    write_mla_cache_ref(kv_c, k_pe, ref, slots)
    assert torch.equal(cache.nan_to_num(7.0), ref.nan_to_num(7.0))


def test_write_kernel_reads_strided_sources():
    qkv = torch.randn(5, 3, 2, 16)  # a fused projection: K and V are strided views
    k, v = qkv[:, 1], qkv[:, 2]
    kc = torch.zeros(2, 4, 2, 16)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([0, 1, -1, 6, 7])
    write_kv_cache_kernel(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    write_kv_cache_ref(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_write_ops_opcheck():
    k, v, kc, vc, slots = _gqa_write_inputs(cache_dtype=torch.float32)
    kc.zero_(), vc.zero_()
    torch.library.opcheck(torch.ops.cp.write_kv_cache.default, (k, v, kc, vc, slots))
    cache = torch.zeros(2, 4, 40)
    args = (torch.randn(3, 32), torch.randn(3, 8), cache, torch.tensor([5, -1, 0]))
    torch.library.opcheck(torch.ops.cp.write_mla_cache.default, args)


def test_write_ops_compile_fullgraph():
    def step(k, v, kc, vc, positions, rows, block_table):
        slots = dcp_slot_mapping(positions, rows, block_table, 4, 2, 1, 2)
        write_kv_cache(k * 2, v, kc, vc, slots)
        return kc.sum()

    k, v, kc, vc, _ = _gqa_write_inputs()
    kc.zero_(), vc.zero_()
    positions, rows = torch.tensor([0, 2, 3, 5, 6, 9, 10]), torch.zeros(7, dtype=torch.int64)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    kr, vr = kc.clone(), vc.clone()
    torch.compile(step, fullgraph=True)(k, v, kc, vc, positions, rows, table)
    step(k, v, kr, vr, positions, rows, table)
    assert torch.equal(kc, kr) and torch.equal(vc, vr) and kc.abs().sum() > 0


def test_write_errors_name_the_argument():
    k, v, kc, vc, slots = _gqa_write_inputs()
    with pytest.raises(ValueError, match="slot_mapping must be an int32/int64 tensor of shape"):
        write_kv_cache(k, v, kc, vc, slots.float())
    with pytest.raises(ValueError, match=r"k has \[Hkv, D\]"):
        write_kv_cache(k[:, :1], v[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match=r"cache must be \[NB, BS, R \+ P\]"):
        write_mla_cache(torch.randn(3, 32), torch.randn(3, 8), torch.zeros(2, 4, 41), slots[:3])


def test_every_layout_round_trips_through_the_real_write_path():
    """Writing a sequence on every rank then reading rank r's local tokens in order gives back
    exactly the tokens at positions p with (p // I) % D == r, for several block sizes."""
    for bs, d, i in itertools.product((4, 8), (2, 4), (1, 4)):
        n = 3 * bs * d + 3
        m = dcp_num_blocks(n, bs, d)
        table = torch.arange(m, dtype=torch.int32)[None].flip(-1)
        x = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, 1, 16).contiguous()
        positions = torch.arange(n)
        for rank in range(d):
            kc = torch.full((m, bs, 1, 16), -1.0)
            vc = torch.full_like(kc, -1.0)
            slots = dcp_slot_mapping(positions, torch.zeros_like(positions), table, bs, d, rank, i)
            write_kv_cache(x, x, kc, vc, slots)
            j = torch.arange(local_seq_len(n, d, rank, i))
            local = kc[table[0, j // bs].long(), j % bs, 0, 0]
            want = positions[(positions // i) % d == rank].float()
            assert torch.equal(local, want), (bs, d, i, rank)
