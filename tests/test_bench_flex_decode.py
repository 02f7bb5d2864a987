"""The decode benchmark's FlexAttention comparison: its paged block mask and KV views, on CPU.

Eager flex_attention applies the mask_mod densely and ignores the block lists, so the numbers
below check the mask_mod, the views and the call; the block lists (what the compiled kernels
read) are checked against the block table directly.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from benchmarks import bench_decode as bench
from cp_modules.reference.paged_decode import paged_attention_ref, paged_mla_attention_ref

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

PAGE, NUM_BLOCKS, WIDTH = 16, 11, 4


def _table():
    """Three rows of a scrambled table (row 2 shares page 3 with another row) and four queries:
    a partial tail page, whole pages, an empty range, and a second query on row 0."""
    g = torch.Generator().manual_seed(1)
    bt = torch.randperm(NUM_BLOCKS, generator=g)[:8].view(2, WIDTH)
    bt = torch.cat([bt, torch.tensor([[3, 9, 0, 0]])]).to(torch.int32)
    seq = torch.tensor([0, 1, 2, 0])
    lens = torch.tensor([37, 64, 0, 20], dtype=torch.int32)
    return bt, seq, lens


@pytest.mark.parametrize("full_blocks", [False, True])
def test_flex_paged_gqa_matches_reference(full_blocks):
    bt, seq, lens = _table()
    hq, hkv, d, scale = 4, 2, 16, 0.3
    k = torch.randn(NUM_BLOCKS, PAGE, hkv, d)
    v = torch.randn(NUM_BLOCKS, PAGE, hkv, d)
    q = torch.randn(len(seq), hq, d)
    mask = bench.flex_paged_block_mask(
        bt[seq], lens, PAGE, NUM_BLOCKS, "cpu", full_blocks=full_blocks
    )
    key, value = bench.flex_paged_kv((k, v))
    assert key.data_ptr() == k.data_ptr() and value.data_ptr() == v.data_ptr()  # views, no copy
    out, lse = bench.flex_paged_decode(flex_attention, q, key, value, mask, scale)
    ref_out, ref_lse = paged_attention_ref(q, k, v, bt, seq, lens, scale)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)  # -inf rows included
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()


@pytest.mark.parametrize("full_blocks", [False, True])
def test_flex_paged_mla_matches_reference(full_blocks):
    bt, seq, lens = _table()
    heads, rank, rope, scale = 8, 32, 16, 0.2
    latent = torch.randn(NUM_BLOCKS, PAGE, rank + rope)
    q = torch.randn(len(seq), heads, rank + rope)
    mask = bench.flex_paged_block_mask(
        bt[seq], lens, PAGE, NUM_BLOCKS, "cpu", full_blocks=full_blocks
    )
    key, value = bench.flex_paged_kv((latent,), rank)
    assert key.data_ptr() == value.data_ptr() == latent.data_ptr()
    out, lse = bench.flex_paged_decode(flex_attention, q, key, value, mask, scale)
    ref_out, ref_lse = paged_mla_attention_ref(q, latent, bt, seq, lens, scale, rank)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("full_blocks", [False, True])
def test_flex_paged_block_lists_follow_the_table(full_blocks):
    bt, seq, lens = _table()
    rows = bt[seq]
    mask = bench.flex_paged_block_mask(rows, lens, PAGE, NUM_BLOCKS, "cpu", full_blocks=full_blocks)
    assert mask.BLOCK_SIZE == (bench.FLEX_Q_BLOCK, PAGE)
    assert mask.seq_lengths == (1, NUM_BLOCKS * PAGE)

    # The mask_mod, densely: query b sees physical token p*PAGE+o iff p = rows[b, j] and
    # j*PAGE + o < lens[b].
    kv = torch.arange(NUM_BLOCKS * PAGE, dtype=torch.int32)
    b = torch.arange(len(seq), dtype=torch.int32)
    zero = torch.zeros((), dtype=torch.int32)
    dense = mask.mask_mod(b[:, None], zero, zero, kv[None, :])
    expected = torch.zeros_like(dense)
    for i in range(len(seq)):
        for pos in range(int(lens[i])):
            expected[i, int(rows[i, pos // PAGE]) * PAGE + pos % PAGE] = True
    assert torch.equal(dense, expected)

    def listed(num, idx, i):
        return [] if num is None else idx[i, 0, 0, : int(num[i, 0, 0])].tolist()

    per_page = dense.view(len(seq), NUM_BLOCKS, PAGE)
    for i in range(len(seq)):
        part = listed(mask.kv_num_blocks, mask.kv_indices, i)
        full = listed(mask.full_kv_num_blocks, mask.full_kv_indices, i)
        pages = -(-int(lens[i]) // PAGE)
        assert full + part == rows[i, :pages].tolist()  # every page once, in logical order
        assert all(per_page[i, p].all() for p in full)  # full blocks skip the mask_mod
        if full_blocks:
            assert len(part) == (1 if lens[i] % PAGE else 0)
        else:
            assert full == []
