"""Paged decode attention (GQA/MHA and absorbed MLA) on a DCP-sharded cache: reference vs dense,
Triton kernel vs reference (interpreter on CPU, dtype matrix on the GPU), ops, compile."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cp_modules.cache import (
    BlockAllocator,
    BlockTable,
    dcp_query_kv_len,
    dcp_slot_mapping,
    local_seq_len,
)
from cp_modules.kernels.decode.mla import (
    choose_mla_num_splits,
    mla_programs_per_sm,
    paged_mla_attention_kernel,
)
from cp_modules.kernels.decode.paged import (
    DecodeConfig,
    choose_num_splits,
    default_config,
    mla_default_config,
    paged_attention_kernel,
)
from cp_modules.ops.kv_cache import write_kv_cache, write_mla_cache
from cp_modules.ops.paged_decode import paged_attention, paged_mla_attention
from cp_modules.reference.paged_decode import paged_attention_ref, paged_mla_attention_ref
from cp_modules.testing.numerics import assert_close_to_reference

# ---------------------------------------------------------------------------------------------
# Building a rank's shard of a batch of requests through the real write path.


@dataclass
class Shard:
    """One DCP rank's cache for a batch, plus the global K/V it was cut from."""

    k: list[torch.Tensor]  # per request [L, Hkv, Dk] (GQA) or latent rows [L, Rk + P] (MLA)
    v: list[torch.Tensor]
    block_table: torch.Tensor
    caches: tuple[torch.Tensor, ...]


def build_shard(
    lengths, *, bs, d, rank, interleave, dtype, device="cpu", hkv=None, dk=None, mla=None, gen=None
) -> Shard:
    """Write every request's K/V with the rank's slot mapping into NaN-filled caches.

    ``mla=(rank_dim, rope_dim)`` builds a latent cache; otherwise ``hkv, dk`` a GQA cache.
    Blocks come from a shared allocator in a scrambled order, so block ids are not monotone.
    """
    max_len = max(lengths)
    table_width = -(-max_len // (bs * d))
    num_blocks = len(lengths) * table_width + 3
    alloc = BlockAllocator(num_blocks)
    alloc.free(alloc.allocate(num_blocks)[::-1])  # scramble the free order
    table = BlockTable(len(lengths), max_len, bs, alloc, dcp_size=d, device=device)
    for r, n in enumerate(lengths):
        table.ensure_capacity(r, n)
    ks, vs = [], []
    if mla is None:
        kc = torch.full((num_blocks, bs, hkv, dk), float("nan"), dtype=dtype, device=device)
        caches = (kc, torch.full_like(kc, float("nan")))
    else:
        caches = (torch.full((num_blocks, bs, sum(mla)), float("nan"), dtype=dtype, device=device),)
    for r, n in enumerate(lengths):
        positions = torch.arange(n, device=device)
        rows = torch.full((n,), r, device=device)
        slots = dcp_slot_mapping(positions, rows, table.tensor, bs, d, rank, interleave)
        if mla is None:
            k = torch.randn(n, hkv, dk, generator=gen, device=device).to(dtype)
            v = torch.randn(n, hkv, dk, generator=gen, device=device).to(dtype)
            write_kv_cache(k, v, caches[0], caches[1], slots)
        else:
            kv_c = torch.randn(n, mla[0], generator=gen, device=device).to(dtype)
            k_pe = torch.randn(n, mla[1], generator=gen, device=device).to(dtype)
            write_mla_cache(kv_c, k_pe, caches[0], slots)
            k = torch.cat([kv_c, k_pe], dim=-1)
            v = kv_c
        ks.append(k)
        vs.append(v)
    return Shard(ks, vs, table.tensor, caches)


def dense_attention(q, k, v, scale):
    """Plain fp64 attention of q [Tq, Hq, Dk] on k [L, Hkv, Dk], v [L, Hkv, Dv] (no mask)."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,lhd->hql", q.double(), kk) * scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hql,lhd->qhd", torch.softmax(s, dim=-1), vv)
    return out, lse.transpose(0, 1)


def check_against_reference(out, lse, ref, same=None, *, atol=1e-5, name=""):
    """fp32 reference: ``atol``; lower precision: the 2x rule against the same-dtype reference."""
    ref_out, ref_lse = ref
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{name}: empty rows differ"
    assert (out[empty] == 0).all(), f"{name}: empty rows must give out = 0"
    finite = ~empty
    assert_close_to_reference(
        out[finite], ref_out[finite].float(), None if same is None else same[0][finite],
        atol=atol, name=f"{name} out",
    )  # fmt: skip
    assert_close_to_reference(
        lse[finite], ref_lse[finite], None if same is None else same[1][finite],
        atol=atol, name=f"{name} lse",
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Tier 1: the reference against dense attention, sharded and merged.


def _merge(outs, lses):
    lse = torch.stack(lses)
    m = lse.amax(0).nan_to_num(neginf=0.0)
    w = torch.exp(lse - m)
    total = w.sum(0)
    out = (torch.stack(outs).double() * w[..., None]).sum(0) / total.clamp_min(1e-300)[..., None]
    return out, m + torch.log(total)


@pytest.mark.parametrize(
    ("d", "interleave", "bs"),
    [(1, 1, 8), (2, 1, 8), (4, 2, 8), (4, 8, 8), (3, 4, 4)],
    ids=["D1", "D2-I1", "D4-I2", "D4-I8", "D3-I4-BS4"],
)
def test_reference_sharded_then_merged_equals_dense(d, interleave, bs):
    """Decode and multi-token causal queries on every rank's shard, merged by LSE, equal dense
    causal attention over the whole sequence (fp64 math in the merge and the oracle)."""
    lengths = [1, 29, 70]
    hq, hkv, dk = 4, 2, 16
    scale = dk**-0.5
    gen = torch.Generator().manual_seed(1)
    # Queries: the last 3 positions of each request (causal among themselves), decode-style.
    q_pos = [torch.arange(max(0, n - 3), n) for n in lengths]
    rows = torch.cat([torch.full((len(p),), r) for r, p in enumerate(q_pos)])
    positions = torch.cat(q_pos)
    q = torch.randn(positions.numel(), hq, dk, generator=gen, dtype=torch.float64)
    outs, lses, shard = [], [], None
    for rank in range(d):
        shard = build_shard(
            lengths, bs=bs, d=d, rank=rank, interleave=interleave, dtype=torch.float64,
            hkv=hkv, dk=dk, gen=torch.Generator().manual_seed(2),
        )  # fmt: skip
        kv_len = dcp_query_kv_len(positions, d, rank, interleave)
        out, lse = paged_attention_ref(q, *shard.caches, shard.block_table, rows, kv_len, scale)
        outs.append(out)
        lses.append(lse)
    out, lse = _merge(outs, lses)
    for t, (r, p) in enumerate(zip(rows.tolist(), positions.tolist())):
        want_out, want_lse = dense_attention(
            q[t : t + 1], shard.k[r][: p + 1], shard.v[r][: p + 1], scale
        )
        # The LSEs are fp32 by contract, so the merge weights carry fp32 rounding.
        torch.testing.assert_close(out[t], want_out[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(lse[t].double(), want_lse[0], atol=1e-6, rtol=0)


def test_mla_reference_equals_dense_latent_attention():
    lengths = [5, 40]
    rk, p, h = 32, 8, 3
    shard = build_shard(lengths, bs=4, d=1, rank=0, interleave=1, dtype=torch.float64, mla=(rk, p))
    q = torch.randn(2, h, rk + p, dtype=torch.float64)
    rows = torch.tensor([0, 1])
    out, lse = paged_mla_attention_ref(q, shard.caches[0], shard.block_table, rows,
                                       torch.tensor([5, 40]), 0.3, rk)  # fmt: skip
    for t in range(2):
        k = shard.k[t][:, None]
        want_out, want_lse = dense_attention(q[t : t + 1], k, k[..., :rk], 0.3)
        torch.testing.assert_close(out[t], want_out[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[t].double(), want_lse[0], atol=1e-6, rtol=0)


def test_empty_range_gives_zero_and_neg_inf():
    shard = build_shard([4], bs=4, d=1, rank=0, interleave=1, dtype=torch.float32, hkv=1, dk=16)
    out, lse = paged_attention(
        torch.randn(2, 2, 16), *shard.caches, shard.block_table, torch.tensor([0, 0]),
        torch.tensor([0, 4]), scale=0.25,
    )  # fmt: skip
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


# ---------------------------------------------------------------------------------------------
# Tier 4: the Triton kernels against the reference under the interpreter (tiny grids).


@dataclass(frozen=True)
class GQACase:
    hq: int
    hkv: int
    dk: int
    bs: int
    block_n: int
    splits: int | None
    dtype: torch.dtype

    @property
    def id(self) -> str:
        return (
            f"H{self.hq}-KV{self.hkv}-D{self.dk}-BS{self.bs}-N{self.block_n}-S{self.splits or 'auto'}"
            f"-{str(self.dtype).split('.')[-1]}"
        )


GQA_CASES = [
    GQACase(4, 4, 16, 16, 16, 1, torch.float32),  # MHA, one block per tile
    GQACase(8, 2, 32, 8, 16, 3, torch.float32),  # GQA 4, tiles gather across blocks
    GQACase(6, 1, 64, 16, 32, 2, torch.float16),  # group of 6 (not a power of two)
    GQACase(2, 1, 128, 32, 32, None, torch.float32),  # head dim 128, split count chosen
    GQACase(4, 2, 16, 16, 16, 21, torch.float32),  # more splits than the merge's chunk of 16
]


def _dcp_queries(lengths, d, rank, interleave, extra_tokens=2):
    """Decode queries at each request's last position plus a few earlier (speculative-style)."""
    pos, rows = [], []
    for r, n in enumerate(lengths):
        for g in range(max(0, n - 1 - extra_tokens), n):
            pos.append(g)
            rows.append(r)
    positions = torch.tensor(pos)
    return torch.tensor(rows, dtype=torch.int32), dcp_query_kv_len(positions, d, rank, interleave)


@pytest.mark.parametrize("case", GQA_CASES, ids=[c.id for c in GQA_CASES])
def test_gqa_kernel_matches_reference_interpreted(case):
    # Rank 3 of DCP 4 with interleave 2: the 1-token request leaves this shard empty.
    lengths, d, rank, il = [1, 200], 4, 3, 2
    shard = build_shard(lengths, bs=case.bs, d=d, rank=rank, interleave=il, dtype=case.dtype,
                        hkv=case.hkv, dk=case.dk)  # fmt: skip
    rows, kv_len = _dcp_queries(lengths, d, rank, il, extra_tokens=1)
    assert kv_len[0] == 0 and kv_len[-1] == local_seq_len(200, d, rank, il) == 50
    q = torch.randn(rows.numel(), case.hq, case.dk).to(case.dtype)
    scale = case.dk**-0.5
    cfg = DecodeConfig(block_h=16, block_n=case.block_n, num_warps=4, num_stages=1)
    out, lse = paged_attention_kernel(q, *shard.caches, shard.block_table, rows, kv_len, scale,
                                      case.splits, config=cfg)  # fmt: skip
    args = (q, *shard.caches, shard.block_table, rows, kv_len, scale)
    ref = paged_attention_ref(*args)
    same = None if case.dtype == torch.float32 else paged_attention_ref(*args, upcast=False)
    check_against_reference(out, lse, ref, same, name=case.id)


def test_gqa_kernel_default_tiles_without_splits_interpreted():
    # One split: the kernel takes default_config(split=False), whose 128-token tile spans
    # several 16-token pages (tokens gathered one by one) and the shard's end.
    lengths, d, rank, il = [5, 300], 2, 1, 1
    shard = build_shard(lengths, bs=16, d=d, rank=rank, interleave=il, dtype=torch.float32,
                        hkv=2, dk=32)  # fmt: skip
    rows, kv_len = _dcp_queries(lengths, d, rank, il, extra_tokens=1)
    assert int(kv_len.max()) == local_seq_len(300, d, rank, il) == 150
    q = torch.randn(rows.numel(), 8, 32)
    args = (q, *shard.caches, shard.block_table, rows, kv_len, 32**-0.5)
    out, lse = paged_attention_kernel(*args, 1)
    check_against_reference(out, lse, paged_attention_ref(*args), None, name="unsplit")


MLA_CASES = [
    (64, 16, 20, 16, 16, 1, torch.float32, False),
    (64, 16, 20, 8, 16, 3, torch.float32, True),
    (512, 64, 16, 16, 16, 2, torch.float16, False),
    # More splits than tiles (most of them empty) and than the merge's chunk of 16.
    (64, 16, 20, 16, 16, 40, torch.float32, False),
]


@pytest.mark.parametrize(
    ("rk", "rope", "h", "bs", "block_n", "splits", "dtype", "split_scores"),
    MLA_CASES,
    ids=[
        f"R{c[0]}-P{c[1]}-H{c[2]}-BS{c[3]}-S{c[5]}-{str(c[6]).split('.')[-1]}"
        + ("-split" if c[7] else "")
        for c in MLA_CASES
    ],
)
def test_mla_kernel_matches_reference_interpreted(
    rk, rope, h, bs, block_n, splits, dtype, split_scores
):
    lengths, d, rank, il = [3, 120], 2, 1, 4  # rank 1 holds none of the first request
    shard = build_shard(lengths, bs=bs, d=d, rank=rank, interleave=il, dtype=dtype, mla=(rk, rope))
    rows, kv_len = _dcp_queries(lengths, d, rank, il, extra_tokens=0)
    assert kv_len.tolist() == [0, local_seq_len(120, d, rank, il)] == [0, 60]
    q = torch.randn(rows.numel(), h, rk + rope).to(dtype)
    scale = (128 + rope) ** -0.5
    cfg = DecodeConfig(block_h=16, block_n=block_n, num_warps=4, num_stages=1,
                       split_scores=split_scores)  # fmt: skip
    out, lse = paged_mla_attention_kernel(q, shard.caches[0], shard.block_table, rows, kv_len,
                                          scale, rk, splits, config=cfg)  # fmt: skip
    args = (q, shard.caches[0], shard.block_table, rows, kv_len, scale, rk)
    ref = paged_mla_attention_ref(*args)
    same = None if dtype == torch.float32 else paged_mla_attention_ref(*args, upcast=False)
    check_against_reference(out, lse, ref, same, name="mla")


def test_default_tiles():
    gqa = default_config(4, 128, 128, 0)
    assert (gqa.block_h, gqa.block_n) == (16, 64)
    assert default_config(1, 64, 64, 0).block_n == 64
    # Without KV splits the GQA tile grows to 128 tokens on 8 warps; the head tile stays, so
    # the split count chosen from it still holds.
    unsplit = default_config(4, 128, 128, 0, split=False)
    assert (unsplit.block_h, unsplit.block_n, unsplit.num_warps) == (16, 128, 8)
    assert default_config(4, 256, 256, 0, split=False).block_n == 32
    mla = default_config(128, 512, 512, 64)
    assert (mla.block_h, mla.block_n, mla.num_warps) == (64, 64, 8)
    assert default_config(16, 512, 512, 64).block_h == 16


def test_split_count_depends_on_static_shapes_only():
    # Enough programs already: no split. One query: about two waves, capped by the table width.
    assert choose_num_splits(264, 1 << 17, 132) == 1
    assert choose_num_splits(8, 1 << 17, 132) == 33
    assert choose_num_splits(8, 1024, 132) == 4
    assert choose_num_splits(1, 1 << 20, 132) == 64
    assert choose_num_splits(4, 100, 132) == 1
    # fp8 caches aim at 16 programs per SM, also past one wave.
    assert choose_num_splits(64, 1 << 17, 132, 16) == 33
    assert choose_num_splits(2048, 4096, 132, 16) == 2
    assert choose_num_splits(8, 1 << 17, 132, 16) == 64


def test_mla_split_count_minimises_the_waves_times_split_length():
    # One MLA program per SM: the fewest splits within 2 % of the best waves x split length.
    assert choose_mla_num_splits(2, 1 << 17, 132) == 64  # B=1: 128 programs of 32 tiles
    assert choose_mla_num_splits(16, 1 << 17, 132) == 8  # B=8: 128 programs
    assert choose_mla_num_splits(128, 1 << 17, 132) == 1
    assert choose_mla_num_splits(96, 1 << 17, 132) == 4  # 3 full waves
    assert choose_mla_num_splits(512, 1 << 17, 132) == 1
    assert choose_mla_num_splits(2, 4096, 132) == 16  # capped by 256-token splits
    assert choose_mla_num_splits(2, 100, 132) == 1
    assert choose_mla_num_splits(0, 4096, 132) == 1


def test_mla_split_count_fills_two_programs_per_sm_for_small_head_tiles():
    # 16 or 32 heads: one head tile per query, two programs per SM (264 slots on 132 SMs).
    cfg16, cfg128 = mla_default_config(16), mla_default_config(128)
    assert mla_programs_per_sm(cfg16) == mla_programs_per_sm(mla_default_config(32)) == 2
    assert mla_programs_per_sm(cfg128) == 1
    assert choose_mla_num_splits(1, 1 << 17, 132, 64, 2) == 256  # B=1: 256 splits of 8 tiles
    assert choose_mla_num_splits(8, 1 << 17, 132, 64, 2) == 32  # 256 programs, one wave
    assert choose_mla_num_splits(64, 1 << 15, 132, 64, 2) == 4
    assert choose_mla_num_splits(256, 1 << 14, 132, 64, 2) == 1
    # However long the table, one wave within the cap (the fewest splits within 2 %).
    assert 240 <= choose_mla_num_splits(1, 1 << 24, 132, 64, 2) <= 256


# ---------------------------------------------------------------------------------------------
# Tier 2: the ops.


def _small_gqa_args(dtype=torch.float32):
    shard = build_shard([3, 20], bs=4, d=2, rank=0, interleave=2, dtype=dtype, hkv=2, dk=16)
    for c in shard.caches:
        c.nan_to_num_(0.0)  # opcheck compares raw outputs; keep unwritten slots finite
    q = torch.randn(3, 4, 16, dtype=dtype)
    rows = torch.tensor([0, 1, 1], dtype=torch.int32)
    kv_len = dcp_query_kv_len(torch.tensor([2, 18, 19]), 2, 0, 2)
    return q, shard.caches, shard.block_table, rows, kv_len


def test_ops_opcheck():
    q, (kc, vc), bt, rows, kv_len = _small_gqa_args()
    torch.library.opcheck(
        torch.ops.cp.paged_attention.default, (q, kc, vc, bt, rows, kv_len, 0.25, 0)
    )
    shard = build_shard([9], bs=4, d=1, rank=0, interleave=1, dtype=torch.float32, mla=(32, 8))
    cache = shard.caches[0].nan_to_num(0.0)
    args = (
        torch.randn(1, 4, 40),
        cache,
        shard.block_table,
        torch.tensor([0]),
        torch.tensor([9]),
        0.2,
        32,
        0,
    )
    torch.library.opcheck(torch.ops.cp.paged_mla_attention.default, args)


def test_ops_compile_fullgraph_with_positions_on_device():
    def decode(q, kc, vc, bt, rows, positions, q_mla, cache):
        kv_len = dcp_query_kv_len(positions, 2, 0, 2)
        out, lse = paged_attention(q, kc, vc, bt, rows, kv_len, scale=0.25)
        out_m, lse_m = paged_mla_attention(
            q_mla, cache, bt, rows, kv_len, scale=0.2, kv_lora_rank=32
        )
        return out * 2, lse, out_m, lse_m

    q, (kc, vc), bt, rows, _ = _small_gqa_args()
    positions = torch.tensor([2, 18, 19])
    cache = torch.randn(kc.shape[0], 4, 40)
    q_mla = torch.randn(3, 4, 40)
    args = (q, kc, vc, bt, rows, positions, q_mla, cache)
    got = torch.compile(decode, fullgraph=True)(*args)
    want = decode(*args)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_op_errors_name_the_argument():
    q, (kc, vc), bt, rows, kv_len = _small_gqa_args()
    with pytest.raises(ValueError, match="query heads Hq=3 must be a multiple"):
        paged_attention(q[:, :3], kc, vc, bt, rows, kv_len, scale=1.0)
    with pytest.raises(
        ValueError, match=r"query_kv_len must be an int32/int64 tensor of shape \[T\]"
    ):
        paged_attention(q, kc, vc, bt, rows, kv_len.float(), scale=1.0)
    with pytest.raises(ValueError, match="cache dtype torch.float16 must equal"):
        paged_attention(q, kc.half(), vc.half(), bt, rows, kv_len, scale=1.0)
    with pytest.raises(ValueError, match="block_table must be an int32/int64"):
        paged_attention(q, kc, vc, bt.float(), rows, kv_len, scale=1.0)
    with pytest.raises(ValueError, match="kv_lora_rank must be an integer in"):
        paged_mla_attention(torch.randn(3, 4, 40), torch.zeros(4, 4, 40), bt, rows, kv_len,
                            scale=1.0, kv_lora_rank=40)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Tier 5: the GPU dtype matrix (skipped without CUDA).

GPU_DTYPES = [torch.bfloat16, torch.float16]
GPU_LENGTHS = [1, 2, 17, 300, 1025, 4097, 7000]


def _gluon_mla_shard_args(bs, interleave, heads, seed):
    # Ragged lengths on a DCP shard (rank 1 of 2: the 1-token request leaves it empty), three
    # tokens per request: the MLA decode arguments (q, cache, block table, rows, kv_len,
    # scale, latent width), with NaN in every unwritten slot.
    d, rank = 2, 1
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shard = build_shard(GPU_LENGTHS, bs=bs, d=d, rank=rank, interleave=interleave,
                        dtype=torch.bfloat16, device="cuda", mla=(512, 64), gen=gen)  # fmt: skip
    rows, kv_len = _dcp_queries(GPU_LENGTHS, d, rank, interleave, extra_tokens=2)
    rows, kv_len = rows.cuda(), kv_len.cuda()
    assert (kv_len == 0).any()
    q = torch.randn(rows.numel(), heads, 576, device="cuda", generator=gen).to(torch.bfloat16)
    return q, shard.caches[0], shard.block_table, rows, kv_len, 192**-0.5, 512


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("interleave", [1, 16], ids=["I1", "I16"])
@pytest.mark.parametrize("kind", ["gqa-32-8-128", "gqa-8-8-64", "mla-16-576"])
@pytest.mark.parametrize("splits", [None, 1, 7, 130], ids=["Sauto", "S1", "S7", "S130"])
def test_gpu_kernels_match_reference(dtype, bs, interleave, kind, splits):
    d, rank = 4, 3  # the short requests leave rank 3 empty
    gen = torch.Generator(device="cuda").manual_seed(0)
    if kind.startswith("gqa"):
        hq, hkv, dk = (int(x) for x in kind.split("-")[1:])
        shard = build_shard(GPU_LENGTHS, bs=bs, d=d, rank=rank, interleave=interleave, dtype=dtype,
                            device="cuda", hkv=hkv, dk=dk, gen=gen)  # fmt: skip
    else:
        hq, dk = 16, 576
        shard = build_shard(GPU_LENGTHS, bs=bs, d=d, rank=rank, interleave=interleave, dtype=dtype,
                            device="cuda", mla=(512, 64), gen=gen)  # fmt: skip
    rows, kv_len = _dcp_queries(GPU_LENGTHS, d, rank, interleave, extra_tokens=2)
    rows, kv_len = rows.cuda(), kv_len.cuda()
    assert (kv_len == 0).any()
    q = torch.randn(rows.numel(), hq, dk, device="cuda", generator=gen).to(dtype)
    scale = 192**-0.5 if kind.startswith("mla") else dk**-0.5
    if kind.startswith("gqa"):
        args = (q, *shard.caches, shard.block_table, rows, kv_len, scale)
        out, lse = paged_attention_kernel(*args, splits)
        ref, same = paged_attention_ref(*args), paged_attention_ref(*args, upcast=False)
    else:
        args = (q, shard.caches[0], shard.block_table, rows, kv_len, scale, 512)
        out, lse = paged_mla_attention_kernel(*args, splits)
        ref, same = paged_mla_attention_ref(*args), paged_mla_attention_ref(*args, upcast=False)
    check_against_reference(out, lse, ref, same, atol=1e-4, name=kind)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("splits", [None, 1, 7], ids=["Sauto", "S1", "S7"])
def test_gpu_mla_128_heads_matches_reference(dtype, bs, splits):
    """DeepSeek's shape: 128 heads in 64-head tiles, on a DCP shard with empty queries."""
    d, rank, interleave = 2, 1, 4
    gen = torch.Generator(device="cuda").manual_seed(1)
    shard = build_shard(GPU_LENGTHS, bs=bs, d=d, rank=rank, interleave=interleave, dtype=dtype,
                        device="cuda", mla=(512, 64), gen=gen)  # fmt: skip
    rows, kv_len = _dcp_queries(GPU_LENGTHS, d, rank, interleave, extra_tokens=1)
    rows, kv_len = rows.cuda(), kv_len.cuda()
    assert (kv_len == 0).any()
    q = torch.randn(rows.numel(), 128, 576, device="cuda", generator=gen).to(dtype)
    args = (q, shard.caches[0], shard.block_table, rows, kv_len, 192**-0.5, 512)
    out, lse = paged_mla_attention_kernel(*args, splits)
    ref, same = paged_mla_attention_ref(*args), paged_mla_attention_ref(*args, upcast=False)
    check_against_reference(out, lse, ref, same, atol=1e-4, name="mla-128")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_gpu_cuda_graph_replay_with_new_lengths(kind):
    """Capture once, then change lengths and cache contents in place: replays stay exact."""
    lengths = [100, 3000, 5]
    dtype = torch.bfloat16
    if kind == "gqa":
        shard = build_shard(lengths, bs=16, d=1, rank=0, interleave=1, dtype=dtype, device="cuda",
                            hkv=8, dk=128)  # fmt: skip
        q = torch.randn(3, 32, 128, device="cuda", dtype=dtype)

        def run(kv_len):
            return paged_attention(q, *shard.caches, shard.block_table, rows, kv_len, scale=0.088)
    else:
        shard = build_shard(lengths, bs=64, d=1, rank=0, interleave=1, dtype=dtype, device="cuda",
                            mla=(512, 64))  # fmt: skip
        q = torch.randn(3, 128, 576, device="cuda", dtype=dtype)

        def run(kv_len):
            return paged_mla_attention(q, shard.caches[0], shard.block_table, rows, kv_len,
                                       scale=0.072, kv_lora_rank=512)  # fmt: skip

    for c in shard.caches:
        c.nan_to_num_(0.0)
    rows = torch.arange(3, device="cuda", dtype=torch.int32)
    kv_len = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    run(kv_len)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run(kv_len)
    for new in ([1, 2999, 0], [100, 3000, 5], [64, 1, 4]):
        kv_len.copy_(torch.tensor(new))
        graph.replay()
        want_out, want_lse = run(kv_len)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# ---------------------------------------------------------------------------------------------
# Sliding windows (a per-query first local token) and logit soft-capping in the GQA kernel.

# (row, first visible local token, local length): a start inside a block, at a block boundary
# (32 is one for every block size below), 0, len - 1, start == len and length 0 (both empty),
# and a few consecutive tokens of one request under a window of 28 (multi-token queries).
WINDOW_QUERIES = [
    (0, 0, 70), (0, 21, 70), (0, 32, 70), (0, 69, 70), (0, 70, 70), (1, 0, 0),
    (1, 10, 38), (1, 11, 39), (1, 12, 40), (2, 50, 100), (2, 67, 98),
]  # fmt: skip
# Row 2's queries start at 50 or later: its blocks wholly before token 50 get out-of-range ids,
# which the kernel must never dereference.
_POISON_BEFORE = 50


def _window_shard(bs, dtype, hkv=2, dk=16):
    shard = build_shard([70, 40, 100], bs=bs, d=1, rank=0, interleave=1, dtype=dtype, hkv=hkv,
                        dk=dk)  # fmt: skip
    shard.block_table[2, : _POISON_BEFORE // bs] = 1 << 24
    rows, start, kv_len = (torch.tensor(c, dtype=torch.int32) for c in zip(*WINDOW_QUERIES))
    return shard, rows, start, kv_len


WINDOW_CASES = [
    # (block size, tile, splits, softcap, dtype)
    (16, 16, 1, None, torch.float32),  # tiles inside one block
    (8, 32, 1, None, torch.float32),  # tiles gather over 4 blocks, the first partly hidden
    (16, 16, 3, 1.5, torch.float32),  # split-KV over the window, soft-cap
    (32, 16, 7, None, torch.float32),  # more splits than some windows have tiles
    (8, 16, 2, 2.0, torch.float16),  # fp16: the 2x rule
    (16, 32, None, 1.5, torch.float32),  # split count chosen
]


@pytest.mark.parametrize(
    ("bs", "block_n", "splits", "softcap", "dtype"),
    WINDOW_CASES,
    ids=[
        f"BS{c[0]}-N{c[1]}-S{c[2] or 'auto'}-C{c[3] or 0}-{str(c[4]).split('.')[-1]}"
        for c in WINDOW_CASES
    ],
)
def test_gqa_kernel_window_and_softcap_match_reference_interpreted(
    bs, block_n, splits, softcap, dtype
):
    shard, rows, start, kv_len = _window_shard(bs, dtype)
    q = torch.randn(rows.numel(), 4, 16).to(dtype)
    cfg = DecodeConfig(block_h=16, block_n=block_n, num_warps=4, num_stages=1)
    out, lse = paged_attention_kernel(q, *shard.caches, shard.block_table, rows, kv_len, 0.25,
                                      splits, config=cfg, query_kv_start=start,
                                      softcap=softcap)  # fmt: skip
    args = (q, *shard.caches, shard.block_table, rows, kv_len, 0.25)
    kw = {"query_kv_start": start, "softcap": softcap}
    ref = paged_attention_ref(*args, **kw)
    same = None if dtype == torch.float32 else paged_attention_ref(*args, upcast=False, **kw)
    assert torch.isneginf(ref[1][4]).all() and torch.isneginf(ref[1][5]).all()
    check_against_reference(out, lse, ref, same, name="window")


def test_gqa_kernel_softcap_without_window_interpreted():
    # Soft-cap alone, on a DCP shard with an empty query, against the fp64 oracle of the
    # reference (the capped scores of the reference are the definition).
    lengths, d, rank, il = [1, 90], 2, 1, 1
    shard = build_shard(lengths, bs=16, d=d, rank=rank, interleave=il, dtype=torch.float32,
                        hkv=1, dk=32)  # fmt: skip
    rows, kv_len = _dcp_queries(lengths, d, rank, il, extra_tokens=1)
    q = 3 * torch.randn(rows.numel(), 2, 32)  # large scores: tanh far from linear
    args = (q, *shard.caches, shard.block_table, rows, kv_len, 32**-0.5)
    out, lse = paged_attention_kernel(*args, 2, softcap=2.5)
    ref = paged_attention_ref(*_double(args), softcap=2.5)
    ref = (ref[0].float(), ref[1])
    check_against_reference(out, lse, ref, None, name="softcap")
    plain = paged_attention_ref(*args)
    assert (lse[1:] - plain[1][1:]).abs().max() > 0.1  # the cap changed the result


def test_op_serves_window_and_softcap_and_checks_the_start():
    shard, rows, start, kv_len = _window_shard(16, torch.float32)
    q = torch.randn(rows.numel(), 4, 16)
    out, lse = paged_attention(q, *shard.caches, shard.block_table, rows, kv_len, scale=0.25,
                               query_kv_start=start, softcap=3.0)  # fmt: skip
    ref = paged_attention_ref(q, *shard.caches, shard.block_table, rows, kv_len, 0.25,
                              query_kv_start=start, softcap=3.0)  # fmt: skip
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    with pytest.raises(ValueError, match="query_kv_start must be an int32/int64 tensor"):
        paged_attention(q, *shard.caches, shard.block_table, rows, kv_len, scale=0.25,
                        query_kv_start=start.float())  # fmt: skip
    with pytest.raises(ValueError, match="softcap must be > 0"):
        paged_attention(q, *shard.caches, shard.block_table, rows, kv_len, scale=0.25,
                        softcap=-1.0)  # fmt: skip


def _double(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)  # fmt: skip


def _windowed_dcp_queries(lengths, d, rank, il, window, extra_tokens):
    """Decode queries (as :func:`_dcp_queries`) with the local bounds of a global window."""
    pos, rows = [], []
    for r, n in enumerate(lengths):
        for g in range(max(0, n - 1 - extra_tokens), n):
            pos.append(g)
            rows.append(r)
    positions = torch.tensor(pos)
    start = local_seq_len((positions - window + 1).clamp_min(0), d, rank, il).to(torch.int32)
    return (
        torch.tensor(rows, dtype=torch.int32),
        start,
        dcp_query_kv_len(positions, d, rank, il),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("window", [1, 100, 4096, None], ids=["W1", "W100", "W4096", "Wfull"])
@pytest.mark.parametrize("softcap", [None, 50.0, 5.0], ids=["C0", "C50", "C5"])
@pytest.mark.parametrize("splits", [None, 1, 7], ids=["Sauto", "S1", "S7"])
def test_gpu_gqa_window_and_softcap_two_x_rule(bs, window, softcap, splits):
    # bf16 on a DCP shard (rank 3 of 4, interleave 16: short requests leave it empty) against
    # the fp64 oracle: error at most twice the same-dtype reference's. Blocks wholly before
    # every query's window get out-of-range ids that the kernel must never read.
    d, rank, il = 4, 3, 16
    lengths = [1, 2, 17, 300, 1025, 4097, 9000]
    gen = torch.Generator(device="cuda").manual_seed(3)
    shard = build_shard(lengths, bs=bs, d=d, rank=rank, interleave=il, dtype=torch.bfloat16,
                        device="cuda", hkv=8, dk=128, gen=gen)  # fmt: skip
    w = window or 1 << 30
    rows, start, kv_len = _windowed_dcp_queries(lengths, d, rank, il, w, extra_tokens=2)
    rows, start, kv_len = rows.cuda(), start.cuda(), kv_len.cuda()
    for r in range(len(lengths)):
        first = int(start[rows == r].min()) if (rows == r).any() else 0
        shard.block_table[r, : first // bs] = 1 << 24
    q = torch.randn(rows.numel(), 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    args = (q, *shard.caches, shard.block_table, rows, kv_len, 128**-0.5)
    kw = {"query_kv_start": start if window else None, "softcap": softcap}
    out, lse = paged_attention_kernel(*args, splits, **kw)
    exact = paged_attention_ref(*_double(args), **kw)
    same = paged_attention_ref(*args, upcast=False, **kw)
    empty = torch.isneginf(exact[1])
    assert torch.equal(torch.isneginf(lse), empty) and (out[empty] == 0).all()
    assert_close_to_reference(out[~empty], exact[0][~empty], same[0][~empty], atol=1e-4,
                              name="out")  # fmt: skip
    assert_close_to_reference(lse[~empty], exact[1][~empty], same[1][~empty], atol=1e-4,
                              name="lse")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The Gluon MLA kernel (Hopper; not the default path).


def _require_gluon():
    from cp_modules.kernels.decode.mla_gluon import HAS_GLUON

    if not HAS_GLUON or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA kernel needs Triton's Gluon and an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("heads", [64, 128], ids=["H64", "H128"])
@pytest.mark.parametrize("splits", [None, 1, 7, 130], ids=["Sauto", "S1", "S7", "S130"])
@pytest.mark.parametrize("interleave", [1, 16], ids=["I1", "I16"])
def test_gpu_gluon_mla_matches_reference(bs, heads, splits, interleave):
    # Ragged lengths on a DCP shard (rank 1 of 2: the 1-token request leaves it empty), three
    # tokens per request (multi-token queries), NaN in every unwritten slot: the 2x rule.
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import paged_mla_attention_gluon

    args = _gluon_mla_shard_args(bs, interleave, heads, seed=2)
    out, lse = paged_mla_attention_gluon(*args, splits)
    ref, same = paged_mla_attention_ref(*args), paged_mla_attention_ref(*args, upcast=False)
    check_against_reference(out, lse, ref, same, atol=1e-4, name=f"gluon-mla-{heads}")


def _gluon_variant_names():
    from cp_modules.kernels.decode.mla_gluon import GLUON_MLA_VARIANTS

    return list(GLUON_MLA_VARIANTS)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _gluon_variant_names())
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("splits", [None, 1, 130], ids=["Sauto", "S1", "S130"])
def test_gpu_gluon_mla_variants_match_reference(variant, bs, splits):
    # Every schedule of the Gluon kernel on the ragged DCP shard of the test above (interleave
    # 16: an empty shard, ragged ends, odd tile counts; 3 tokens per request; NaN in every
    # unwritten slot; 130 splits leave most splits empty): the 2x rule.
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import (
        GLUON_MLA_VARIANTS,
        paged_mla_attention_gluon,
    )

    d, rank, il = 2, 1, 16
    gen = torch.Generator(device="cuda").manual_seed(4)
    shard = build_shard(GPU_LENGTHS, bs=bs, d=d, rank=rank, interleave=il,
                        dtype=torch.bfloat16, device="cuda", mla=(512, 64), gen=gen)  # fmt: skip
    rows, kv_len = _dcp_queries(GPU_LENGTHS, d, rank, il, extra_tokens=2)
    rows, kv_len = rows.cuda(), kv_len.cuda()
    q = torch.randn(rows.numel(), 128, 576, device="cuda", generator=gen).to(torch.bfloat16)
    args = (q, shard.caches[0], shard.block_table, rows, kv_len, 192**-0.5, 512)
    out, lse = paged_mla_attention_gluon(*args, splits, config=GLUON_MLA_VARIANTS[variant])
    ref, same = paged_mla_attention_ref(*args), paged_mla_attention_ref(*args, upcast=False)
    check_against_reference(out, lse, ref, same, atol=1e-4, name=f"gluon-mla-{variant}")


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [8, 32, 128], ids=["BS8", "BS32", "BS128"])
@pytest.mark.parametrize("splits", [None, 7], ids=["Sauto", "S7"])
def test_gpu_gluon_mla_cpasync_other_block_sizes(bs, splits):
    # The cp.async copies find each row's page themselves: pages of 8 (eight to a tile), 32
    # and 128 tokens (a tile in half a page) on the ragged DCP shard, NaN in unwritten slots.
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import (
        GLUON_MLA_VARIANTS,
        paged_mla_attention_gluon,
    )

    args = _gluon_mla_shard_args(bs, min(bs, 16), 128, seed=5)
    config = GLUON_MLA_VARIANTS["cpasync-r232-early"]
    out, lse = paged_mla_attention_gluon(*args, splits, config=config)
    ref, same = paged_mla_attention_ref(*args), paged_mla_attention_ref(*args, upcast=False)
    check_against_reference(out, lse, ref, same, atol=1e-4, name=f"gluon-mla-cpasync-bs{bs}")


@pytest.mark.gpu
def test_gpu_gluon_mla_trace_stamps_each_program_in_order():
    # The probe's trace: every program stamps its points in program order, on its own SM
    # slot, and tracing does not change the result.
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import paged_mla_attention_gluon

    args = _gluon_mla_shard_args(64, 16, 128, seed=6)
    trace = torch.zeros(args[0].shape[0] * 2 * 3 * 8, dtype=torch.int64, device="cuda")
    out, lse = paged_mla_attention_gluon(*args, 3, trace=trace)
    want_out, want_lse = paged_mla_attention_gluon(*args, 3)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    t = trace.view(-1, 8).cpu()
    assert (t[:, :6] > 0).all()
    assert (t[:, 0] <= t[:, 1]).all() and (t[:, 1] <= t[:, 2]).all() and (t[:, 2] <= t[:, 3]).all()
    assert (t[:, 1] <= t[:, 4]).all() and (t[:, 4] <= t[:, 5]).all()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert ((t[:, 6] >= 0) & (t[:, 6] < sms)).all()


def _mla_tile_edge_case(bs: int, seed: int):
    """128-head MLA decode inputs whose lengths end mid-tile, on a tile boundary and one row
    into a tile, with NaN in every unwritten slot: (args, fp32 reference, same-dtype one)."""
    lengths = [1, 63, 64, 65, 127, 640, 1000, 4033]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shard = build_shard(lengths, bs=bs, d=1, rank=0, interleave=1, dtype=torch.bfloat16,
                        device="cuda", mla=(512, 64), gen=gen)  # fmt: skip
    assert shard.caches[0].isnan().any()
    rows = torch.arange(len(lengths), device="cuda", dtype=torch.int32)
    kv_len = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    q = torch.randn(len(lengths), 128, 576, device="cuda", generator=gen).to(torch.bfloat16)
    args = (q, shard.caches[0], shard.block_table, rows, kv_len, 192**-0.5, 512)
    return args, paged_mla_attention_ref(*args), paged_mla_attention_ref(*args, upcast=False)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("variant", ["loader2-r232-early-pz", "loader-r232-early-pz"])
def test_gpu_gluon_mla_producer_zeroing_matches_consumer_zeroing(variant, bs):
    # The rows past the range zeroed by the producers give the very bits of the default
    # schedule (the same products on the same tiles): lengths that end mid-tile, on a tile
    # boundary, one row into a tile, with an odd tile count per split (a phantom tile B) and
    # splits left empty, with NaN in every unwritten slot; then the reference's 2x rule.
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import (
        GLUON_MLA_VARIANTS,
        paged_mla_attention_gluon,
    )

    args, ref, same = _mla_tile_edge_case(bs, seed=8)
    base = GLUON_MLA_VARIANTS["loader2-r232-early"]
    for splits in (None, 1, 3, 7, 40):
        out, lse = paged_mla_attention_gluon(*args, splits, config=GLUON_MLA_VARIANTS[variant])
        want = paged_mla_attention_gluon(*args, splits, config=base)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), f"splits={splits}"
        check_against_reference(out, lse, ref, same, atol=1e-4, name=f"gluon-{variant}")


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize(
    "variant",
    ["loader-r232-early-pz-sp", "loader2-r232-early-pz-sp", "loader-r232-early-pz-sp-refill",
     "wg-early", "loader-r232-early-halves", "wg-early-halves", "loader-r232-early-pz-halves"],
)  # fmt: skip
def test_gpu_gluon_mla_scale_p_matches_reference_at_tile_edges(variant, bs):
    # P_A rescaled to tile B's max by warp group 0 (scale_p), the copies issued by the
    # compute warp groups (wg-early), a latent half as one copy (-halves): lengths that end
    # mid-tile, on a tile boundary and one row into a tile, odd tile counts per split (a
    # phantom tile B whose keys are all masked), splits left empty, NaN in every unwritten
    # slot: the 2x rule, and the same result on a second launch (no state left in the
    # barriers).
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import (
        GLUON_MLA_VARIANTS,
        paged_mla_attention_gluon,
    )

    args, ref, same = _mla_tile_edge_case(bs, seed=9)
    config = GLUON_MLA_VARIANTS[variant]
    for splits in (None, 1, 3, 7, 40):
        out, lse = paged_mla_attention_gluon(*args, splits, config=config)
        check_against_reference(out, lse, ref, same, atol=1e-4, name=f"{variant} S={splits}")
        again = paged_mla_attention_gluon(*args, splits, config=config)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), f"splits={splits}"


def test_gluon_mla_trace_buffer_is_checked_before_the_launch():
    # The kernel writes 8 stamps a program unchecked: a short, mistyped or strided buffer is
    # refused on the host.
    from cp_modules.kernels.decode.mla_gluon_config import check_trace_buffer

    cpu = torch.device("cpu")
    check_trace_buffer(torch.zeros(48, dtype=torch.int64), cpu, 6)
    for bad in (torch.zeros(47, dtype=torch.int64), torch.zeros(48, dtype=torch.int32),
                torch.zeros(96, dtype=torch.int64)[::2]):  # fmt: skip
        with pytest.raises(ValueError, match="at least 48 elements"):
            check_trace_buffer(bad, cpu, 6)


def test_gluon_mla_half_tile_view_holds_four_pieces():
    # The half copies' descriptor views the cache as [piece, row, column]: its box [4, r, 64]
    # at (c, n, 0) must be pieces c .. c + 3 (64 columns each) of rows n .. n + r - 1, in the
    # order of the 4 pieces' tiles in shared memory.
    from cp_modules.kernels.decode.mla_gluon import half_tile_view

    rows = torch.arange(40 * 576, dtype=torch.float32).view(40, 576)
    shape, strides = half_tile_view(rows)
    view = rows.as_strided(shape, strides)
    for first, n, r in ((0, 0, 16), (4, 8, 32), (4, 24, 16)):
        box = view[first:first + 4, n:n + r, :]
        want = rows[n:n + r, first * 64:(first + 4) * 64].reshape(r, 4, 64).permute(1, 0, 2)
        assert torch.equal(box, want)
    with pytest.raises(ValueError, match="multiple of 64 contiguous columns"):
        half_tile_view(rows[:, :100])


def test_gluon_mla_config_is_validated():
    from cp_modules.kernels.decode.mla_gluon_config import (
        GluonMLAConfig,
        default_gluon_mla_config,
    )

    with pytest.raises(ValueError, match="issue must be one of"):
        GluonMLAConfig(issue="tma")
    with pytest.raises(ValueError, match="max_box_rows must be 8, 16, 32 or 64"):
        GluonMLAConfig(issue="loader", max_box_rows=48)
    with pytest.raises(ValueError, match="early_release needs producer warps"):
        GluonMLAConfig(issue="hoist", early_release=True)
    assert GluonMLAConfig(issue="loader2", early_release=True).constexprs()["EARLY"] is True
    assert GluonMLAConfig(issue="loader").constexprs()["EARLY"] is False
    with pytest.raises(ValueError, match="spread_merge and fused_merge exclude each other"):
        GluonMLAConfig(issue="loader", fused_merge=True, spread_merge=True)
    spread = GluonMLAConfig(issue="loader2", early_release=True, spread_merge=True)
    assert [spread.spreads_merge(s, 128, 132) for s in (1, 2, 8, 9)] == [False, True, True, False]
    assert not spread.spreads_merge(8, 133, 132)  # not all resident: the separate merge
    assert spread.constexprs(8, spread=True)["SPREAD"] and not spread.constexprs(8)["SPREAD"]
    with pytest.raises(ValueError, match="producer_zeroing needs TMA producer warps"):
        GluonMLAConfig(issue="loader2", producer_zeroing=True)
    with pytest.raises(ValueError, match="producer_zeroing needs TMA producer warps"):
        GluonMLAConfig(issue="cpasync", early_release=True, producer_zeroing=True)
    pz = GluonMLAConfig(issue="loader2", early_release=True, producer_zeroing=True)
    assert pz.constexprs()["PZERO"] and not GluonMLAConfig().constexprs()["PZERO"]
    with pytest.raises(ValueError, match="'cpasync' is built with early_release=True only"):
        GluonMLAConfig(issue="cpasync")
    assert GluonMLAConfig(issue="cpasync", early_release=True).constexprs()["ISSUE"] == 4
    with pytest.raises(ValueError, match="'wg' is built with early_release=True only"):
        GluonMLAConfig(issue="wg")
    with pytest.raises(ValueError, match="producer_zeroing needs TMA producer warps"):
        GluonMLAConfig(issue="wg", early_release=True, producer_zeroing=True)
    assert GluonMLAConfig(issue="wg", early_release=True).constexprs()["ISSUE"] == 5
    for bad in (dict(issue="loader2", early_release=True), dict(issue="loader"),
                dict(issue="loader", early_release=True, producer_zeroing=True, scale_p=True)):
        with pytest.raises(ValueError, match="half_copies needs early_release"):
            GluonMLAConfig(half_copies=True, **bad)
    halves = GluonMLAConfig(issue="wg", early_release=True, half_copies=True)
    assert halves.constexprs()["HALVES"] and not GluonMLAConfig().constexprs()["HALVES"]
    # One producer warp refilling each buffer in parts and zeroing the rows past the range
    # (measured fastest at both sizes).
    for bs in (16, 64):
        assert default_gluon_mla_config(bs).issue == "loader"
        assert default_gluon_mla_config(bs).early_release
        assert default_gluon_mla_config(bs).producer_zeroing
        assert not default_gluon_mla_config(bs).scale_p
    with pytest.raises(ValueError, match="scale_p needs producer_zeroing"):
        GluonMLAConfig(issue="loader", early_release=True, scale_p=True)
    with pytest.raises(ValueError, match="scale_p needs producer_zeroing"):
        GluonMLAConfig(issue="loader", early_release=True, producer_zeroing=True, peel=True,
                       scale_p=True)  # fmt: skip
    with pytest.raises(ValueError, match="scale_p needs producer_zeroing"):
        GluonMLAConfig(issue="loader", early_release=True, producer_zeroing=True,
                       fused_merge=True, scale_p=True)  # fmt: skip
    sp = GluonMLAConfig(issue="loader", early_release=True, producer_zeroing=True, scale_p=True)
    assert sp.constexprs()["SCALE_P"] and not pz.constexprs()["SCALE_P"]
    with pytest.raises(ValueError, match="sp_refill needs scale_p"):
        GluonMLAConfig(issue="loader", early_release=True, producer_zeroing=True, sp_refill=True)
    for bs in (8, 16, 64, 128):
        assert isinstance(default_gluon_mla_config(bs), GluonMLAConfig)


def _three_request_mla_case(bs):
    # Three requests of 100, 3000 and 5 tokens on one rank (no NaN slots): shard, cache, q
    # (128 heads), query rows and kv lengths for the MLA decode kernels.
    lengths = [100, 3000, 5]
    shard = build_shard(lengths, bs=bs, d=1, rank=0, interleave=1, dtype=torch.bfloat16,
                        device="cuda", mla=(512, 64))  # fmt: skip
    cache = shard.caches[0].nan_to_num_(0.0)
    q = torch.randn(3, 128, 576, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(3, device="cuda", dtype=torch.int32)
    kv_len = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    return shard, cache, q, rows, kv_len


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _gluon_variant_names())
def test_gpu_gluon_mla_cuda_graph_replay_and_refusals(variant):
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import (
        GLUON_MLA_VARIANTS,
        gluon_mla_supported,
        paged_mla_attention_gluon,
    )

    shard, cache, q, rows, kv_len = _three_request_mla_case(bs=64)

    def run():
        return paged_mla_attention_gluon(q, cache, shard.block_table, rows, kv_len, 0.072, 512,
                                         config=GLUON_MLA_VARIANTS[variant])  # fmt: skip

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for new in ([1, 2999, 0], [100, 3000, 5], [64, 1, 4]):
        kv_len.copy_(torch.tensor(new))
        graph.replay()
        ref = paged_mla_attention_ref(q, cache, shard.block_table, rows, kv_len, 0.072, 512)
        same = paged_mla_attention_ref(q, cache, shard.block_table, rows, kv_len, 0.072, 512,
                                       upcast=False)  # fmt: skip
        check_against_reference(out, lse, ref, same, atol=1e-4, name="gluon-graph")
    assert "heads" in gluon_mla_supported(q[:, :16], cache, 512)
    shifted = cache.new_empty(cache.numel() + 4).view(-1)[4:].view(cache.shape)
    assert "16-byte aligned" in gluon_mla_supported(q, shifted, 512)
    with pytest.raises(ValueError, match="bf16/fp16"):
        paged_mla_attention_gluon(q.float(), cache.float(), shard.block_table, rows, kv_len,
                                  0.072, 512)  # fmt: skip


def test_gluon_mla_fused_merge_config_and_split_counts():
    from cp_modules.kernels.decode.mla_gluon import (
        GLUON_MLA_VARIANTS,
        choose_gluon_mla_num_splits,
    )
    from cp_modules.kernels.decode.mla_gluon_config import GluonMLAConfig

    for bad in ({"fused_max_splits": 1}, {"fused_max_splits": 257}, {"split_cost_tiles": -1},
                {"merge_tiles_per_split": -0.5}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            GluonMLAConfig(**bad)
    fused = [n for n, c in GLUON_MLA_VARIANTS.items() if c.fused_merge]
    assert fused, "no fused-merge variant registered"
    for cfg in GLUON_MLA_VARIANTS.values():
        # One split never merges; the split-merging variants merge up to their limit.
        assert not cfg.constexprs(1)["FUSED"] and not cfg.constexprs(1)["OWN_REGS"]
        for n in (2, 7, 16, 17, 256):
            assert cfg.constexprs(n)["FUSED"] == (cfg.fused_merge and n <= cfg.fused_max_splits)
            assert cfg.constexprs(n)["OWN_REGS"] == (
                cfg.constexprs(n)["FUSED"] and cfg.merge_own_from_registers
            )
    # The variants without the fused merge keep the Triton kernel's split counts exactly.
    plain = GluonMLAConfig(issue="loader", wg1_regs=232)
    for rows, ctx in [(2, 1 << 17), (16, 1 << 17), (16, 4096), (96, 1 << 17), (2, 4096)]:
        assert choose_gluon_mla_num_splits(plain, rows, ctx, 132) == choose_mla_num_splits(
            rows, ctx, 132
        )
    # A merge tail per split makes one row's last program pay for many splits: fewer splits.
    assert choose_mla_num_splits(2, 1 << 17, 132, 64, 1, 5, 0.0) == 64
    assert choose_mla_num_splits(2, 1 << 17, 132, 64, 1, 5, 2.0) < 64
    # A lower fixed cost per split never asks for fewer splits.
    for rows, ctx in [(2, 1 << 17), (16, 1 << 15), (64, 1 << 14)]:
        assert choose_mla_num_splits(rows, ctx, 132, 64, 1, 3) >= choose_mla_num_splits(
            rows, ctx, 132, 64, 1, 5
        )
    # Past the fused merge's limit the count is the separate merge's.
    capped = GluonMLAConfig(issue="loader", fused_merge=True, fused_max_splits=16,
                            split_cost_tiles=3, merge_tiles_per_split=0.25)  # fmt: skip
    assert choose_gluon_mla_num_splits(capped, 2, 1 << 17, 132) == choose_mla_num_splits(
        2, 1 << 17, 132
    )
    assert choose_gluon_mla_num_splits(capped, 16, 1 << 15, 132) == choose_mla_num_splits(
        16, 1 << 15, 132, 64, 1, 3, 0.25
    )


def test_merge_counters_are_zeroed_grown_and_kept():
    from cp_modules.kernels.decode import arrival_counters as g
    from cp_modules.kernels.decode import mla_gluon_config

    # (the Gluon kernel's config module re-exports them)
    assert mla_gluon_config.merge_counters is g.merge_counters

    cpu = torch.device("cpu")
    old = g._counters.pop((cpu, 0), None)
    if old is not None:
        g._retired_counters.append(old)
    first = g.merge_counters(cpu, 10)
    assert first.dtype == torch.int32 and first.numel() == 1024 and not first.any()
    assert g.merge_counters(cpu, 1024).data_ptr() == first.data_ptr()  # reused, not regrown
    grown = g.merge_counters(cpu, 1025)
    assert grown.numel() == 2048 and not grown.any()
    # The outgrown buffer stays alive: a graph captured with it keeps its address.
    assert any(b is first for b in g._retired_counters)
    assert g.merge_counters(cpu, 7).data_ptr() == grown.data_ptr()


def _fused_variant_names():
    from cp_modules.kernels.decode.mla_gluon import GLUON_MLA_VARIANTS

    return [n for n, c in GLUON_MLA_VARIANTS.items() if c.fused_merge or c.spread_merge]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _fused_variant_names())
@pytest.mark.parametrize("bs", [16, 64], ids=["BS16", "BS64"])
@pytest.mark.parametrize("interleave", [1, 16], ids=["I1", "I16"])
@pytest.mark.parametrize("splits", [2, 3, 7, 64, 130], ids=lambda n: f"S{n}")
@pytest.mark.parametrize("heads", [128, 64], ids=["H128", "H64"])
def test_gpu_gluon_mla_fused_merge_matches_reference(variant, bs, interleave, splits, heads):
    # The split merge inside the kernel on a DCP shard (rank 1 of 2: interleaved runs, the
    # 1-token request leaves it empty), 3 tokens per request, NaN in every unwritten slot; 64
    # and 130 splits leave most of the short requests' splits empty (they still arrive). Past
    # a variant's fused_max_splits the separate merge runs. The counters are back at 0 after
    # the launch, and a second launch on them gives the same result (the same bits unless the
    # own split comes from registers).
    _require_gluon()
    from cp_modules.kernels.decode.mla_gluon import (
        GLUON_MLA_VARIANTS,
        merge_counters,
        paged_mla_attention_gluon,
    )

    config = GLUON_MLA_VARIANTS[variant]
    args = _gluon_mla_shard_args(bs, interleave, heads, seed=5)
    q, rows = args[0], args[3]
    ref, same = paged_mla_attention_ref(*args), paged_mla_attention_ref(*args, upcast=False)
    if config.fused_merge:
        assert config.fuses_merge(splits) == (splits <= config.fused_max_splits)
    else:
        # The spread merge: up to 8 splits and every program resident (rows x splits <= SMs).
        programs = rows.numel() * heads // 64 * splits
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        assert config.spreads_merge(splits, programs, sms) == (splits <= 8 and programs <= sms)
    out, lse = paged_mla_attention_gluon(*args, splits, config=config)
    check_against_reference(out, lse, ref, same, atol=1e-4, name=f"gluon-mla-{variant}")
    torch.cuda.synchronize()
    assert not merge_counters(q.device, rows.numel() * heads // 64).any()
    out2, lse2 = paged_mla_attention_gluon(*args, splits, config=config)
    if config.merge_own_from_registers and config.fuses_merge(splits):
        check_against_reference(out2, lse2, ref, same, atol=1e-4, name=f"gluon-mla-{variant}")
    else:
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _fused_variant_names())
@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "first-on-stream"])
def test_gpu_gluon_mla_fused_merge_cuda_graph_replays(variant, reserved):
    # Capture the fused merge once (7 splits: two head tiles x 3 queries x 7 programs), then
    # replay it with new lengths, each set twice in a row: every replay is exact (its counters
    # were left at 0 by the one before). The capture stream either has its counters reserved
    # beforehand (nothing allocated during the capture) or has none yet (allocated once into
    # the graph's pool and kept). Another stream gets counters of its own.
    _require_gluon()
    from cp_modules.kernels.decode import mla_gluon as g
    from cp_modules.kernels.decode import mla_gluon_config as gc

    config = g.GLUON_MLA_VARIANTS[variant]
    shard, cache, q, rows, kv_len = _three_request_mla_case(bs=16)

    def run():
        return g.paged_mla_attention_gluon(q, cache, shard.block_table, rows, kv_len, 0.072, 512,
                                           7, config=config)  # fmt: skip

    dev = q.device
    run()  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        old = gc._counters.pop(gc._stream_key(dev), None)
        if old is not None:
            gc._retired_counters.append(old)
        if reserved:
            g.reserve_merge_counters(dev, 6)
            before = g.merge_counters(dev, 6).data_ptr()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out, lse = run()
    with torch.cuda.stream(stream):
        counters = g.merge_counters(dev, 6)
    if reserved:
        assert counters.data_ptr() == before
    assert g.merge_counters(dev, 6).data_ptr() != counters.data_ptr()
    for new in ([1, 2999, 0], [1, 2999, 0], [100, 3000, 5], [64, 1, 4], [64, 1, 4]):
        kv_len.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any()
        ref = paged_mla_attention_ref(q, cache, shard.block_table, rows, kv_len, 0.072, 512)
        same = paged_mla_attention_ref(q, cache, shard.block_table, rows, kv_len, 0.072, 512,
                                       upcast=False)  # fmt: skip
        check_against_reference(out, lse, ref, same, atol=1e-4, name=f"graph-{variant}")
        if not config.merge_own_from_registers:
            want_out, want_lse = run()
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "gluon", "triton"])
def test_gpu_mla_op_kernel_choice_matches_reference(kernel):
    # The op's kernel choice (CPPolicy.mla_decode): each serves the DeepSeek shape exactly.
    if kernel == "gluon":
        _require_gluon()
    d, rank = 2, 1
    gen = torch.Generator(device="cuda").manual_seed(3)
    shard = build_shard(GPU_LENGTHS, bs=64, d=d, rank=rank, interleave=1,
                        dtype=torch.bfloat16, device="cuda", mla=(512, 64), gen=gen)  # fmt: skip
    rows, kv_len = _dcp_queries(GPU_LENGTHS, d, rank, 1, extra_tokens=0)
    rows, kv_len = rows.cuda(), kv_len.cuda()
    q = torch.randn(rows.numel(), 128, 576, device="cuda", generator=gen).to(torch.bfloat16)
    args = (q, shard.caches[0], shard.block_table, rows, kv_len)
    out, lse = paged_mla_attention(*args, scale=192**-0.5, kv_lora_rank=512, kernel=kernel)
    ref_args = (*args, 192**-0.5, 512)
    ref, same = paged_mla_attention_ref(*ref_args), paged_mla_attention_ref(*ref_args, upcast=False)
    check_against_reference(out, lse, ref, same, atol=1e-4, name=f"mla-op-{kernel}")


def test_mla_kernel_choice_is_validated():
    from cp_modules.policy import CPPolicy

    with pytest.raises(ValueError, match="mla_decode must be one of"):
        CPPolicy(mla_decode="fast")
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(2, 4, 8)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    idx = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="kernel must be one of"):
        paged_mla_attention(q, cache, bt, idx, idx + 1, scale=1.0, kv_lora_rank=6, kernel="x")
