"""Triton absorbed MLA paged decode with LSE; launcher only.

Shape letters: T = queries, H = query heads, R = latent width (kv_lora_rank), P = rope dim,
NB = physical blocks, BS = tokens per block, S = KV splits.

One program takes up to 64 of a query's heads over one split of its KV range. Each 64-token
latent tile [64, R + P] is loaded once into shared memory and serves as the keys of two score
products (R and P wide) and, through its first R columns, as the values; the split count
accounts for how many programs an SM holds (:func:`mla_programs_per_sm`). Tiles and occupancy
as measured: ``docs/switch-points.md``. Splits and their merge as in
:mod:`cp_modules.kernels.decode.paged`.

An fp8 (e4m3) cache: each latent tile is read as bytes and converted to ``q``'s dtype by
integer operations after its load (exact up to a power of two that the scales absorb, as in
:mod:`cp_modules.kernels.decode.paged`) and serves keys and values as before; its one scale
multiplies the softmax scale and the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_modules.kernels.decode import mla_regs_gluon, mla_tokens, mla_tokens_gluon
from cp_modules.kernels.decode.fp8 import fp8_e4m3_bits_to
from cp_modules.kernels.decode.paged import (
    _LOG2E,
    _NO_FP8,
    DecodeConfig,
    _num_sms,
    _pow2,
    _split_buffers,
    fp8_launch_args,
    fp8_scale_args,
    mla_default_config,
)
from cp_modules.kernels.decode.tiles import (  # noqa: F401 (re-exported)
    _MLA_MAX_SPLITS,
    _SPLIT_COST_TILES,
    choose_mla_num_splits,
    split_range,
    store_lse,
    tile_slots,
)
from cp_modules.kernels.merge import merge_splits_triton

__all__ = ["choose_mla_num_splits", "mla_programs_per_sm", "paged_mla_attention_kernel"]

# fp8 caches: load the latent tile a second time as [R, N] for the scores (no transpose);
# read at every launch (heads tiles under 64 only). Off by measurement (2026-12-06, H100, the
# kernel with today's conversion): without it fp8 ran 0.81-0.87x of bf16 against 0.66-0.72x at
# 16 heads and 0.51-0.69x against 0.39-0.51x at 32, equal at 48
# (benchmarks/results/fp8-kv-mla32-48-2026-12-06-h100.json). It had been on since the H200's
# 2026-12-02 rows (up to 8 % faster at 16 heads), measured before the conversion was rewritten.
FP8_K_TRANSPOSED = False


@triton.jit(do_not_specialize=["num_splits"])
def _paged_mla_kernel(
    Q,
    C,
    BT,
    SEQ_IDX,
    KV_LEN,
    OUT,
    LSE,
    KV_SCALE,
    q_mult,
    out_mult,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_btr,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    max_kv_len,
    num_splits,
    H: tl.constexpr,
    NUM_HEAD_TILES: tl.constexpr,
    PAGE: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr,
    SPLIT_SCORES: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    K_T: tl.constexpr = False,
    FP8_KIND: tl.constexpr = 1,
    FP8_ASM: tl.constexpr = False,
    P_SHIFT: tl.constexpr = 0,
):
    # One program: BLOCK_H heads of one query over one split of its KV range. A latent tile
    # [BLOCK_N, R + P] is loaded once and serves as the keys of both score products
    # (R wide and P wide) and, through its first R columns, as the values.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    t = (pid // NUM_HEAD_TILES).to(tl.int64)
    offs_h = (pid % NUM_HEAD_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H

    row = tl.load(SEQ_IDX + t).to(tl.int64)
    kv_len, start, end = split_range(KV_LEN, t, max_kv_len, num_splits, split, BLOCK_N)

    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_mask = offs_r < R
    p_mask = offs_p < P
    q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q = tl.load(q_rows + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    if KV_FP8:
        q = (q.to(tl.float32) * q_mult).to(q.dtype)
        q_pe = (q_pe.to(tl.float32) * q_mult).to(q_pe.dtype)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    bt_row = BT + row * stride_btr
    if KV_FP8:
        kv_scale = tl.load(KV_SCALE)
        qk_scale = qk_scale * kv_scale
    for n0 in range(start, end, BLOCK_N):
        n_mask, blk, pos = tile_slots(bt_row, n0, end, PAGE, BLOCK_N)
        tok = blk * stride_cb + pos * stride_cs
        # Rows past the range are zero-filled: their NaN/garbage must not reach P @ V.
        kv = tl.load(
            C + tok[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0
        )
        k_pe = tl.load(
            C + tok[:, None] + R + offs_p[None, :],
            mask=n_mask[:, None] & p_mask[None, :],
            other=0,
        )
        if KV_FP8:
            kv = fp8_e4m3_bits_to(kv, FP8_KIND, FP8_ASM, 8)
            k_pe = fp8_e4m3_bits_to(k_pe, FP8_KIND, FP8_ASM)
        if K_T:
            # The scores' keys loaded again as [R, N] (from L1/L2): no transpose of the tile.
            kvt = tl.load(
                C + tok[None, :] + offs_r[:, None],
                mask=n_mask[None, :] & r_mask[:, None],
                other=0,
            )
            kvt = fp8_e4m3_bits_to(kvt, FP8_KIND, FP8_ASM)
            k_pe = tl.trans(k_pe)
            s = tl.dot(q, kvt, input_precision=PRECISION)
        else:
            s = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
        if SPLIT_SCORES:
            # Two separate products (not one accumulating into the other) so that neither
            # score product feeds a later product directly; see below.
            s_pe = tl.dot(q_pe, k_pe if K_T else tl.trans(k_pe), input_precision=PRECISION)
            s = s * qk_scale + s_pe * qk_scale
        else:
            s = tl.dot(q_pe, k_pe if K_T else tl.trans(k_pe), s, input_precision=PRECISION)
            s = s * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if P_SHIFT > 0:
            p = tl.exp2(s - (m_new - P_SHIFT)[:, None])  # P times 2**P_SHIFT (fp8 values)
        else:
            p = tl.exp2(s - m_new[:, None])
        if SPLIT_SCORES:
            # The compiler gives a score product whose result flows into another product the
            # layout with every warp along the heads; with 64 heads and 8 warps that computes
            # the scores twice. Passing P and the rescale factor through a (never-false)
            # branch hides the chain, so the score tile is split over the warps by columns.
            if kv_len > 0:
                alpha = tl.exp2(m_i - m_new)
                pv = p.to(kv.dtype)
            else:
                alpha = tl.exp2(m_i - m_new)
                pv = p.to(kv.dtype)
        else:
            alpha = tl.exp2(m_i - m_new)
            pv = p.to(kv.dtype)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(pv, kv, acc, input_precision=PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    if KV_FP8:
        out = acc * (kv_scale * out_mult / tl.where(nonempty, l_i, 1.0))[:, None]
    else:
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)) - P_SHIFT, float("-inf"))
    o_ptrs = OUT + t * stride_ot + offs_h[:, None] * stride_oh + split * stride_os + offs_r[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=h_mask[:, None] & r_mask[None, :])
    store_lse(LSE + t * stride_lt + offs_h * stride_lh + split * stride_ls, lse2, h_mask, PARTIAL)


def mla_programs_per_sm(cfg: DecodeConfig) -> int:
    """How many MLA programs of these tiles one SM runs at a time (shared memory, registers).

    The default tiles: two of 16 or 32 heads on 4 warps fit in an H200's SM, one of 64 heads on
    8 warps (shared memory and registers as measured: ``docs/switch-points.md``).
    """
    return 1 if cfg.block_h >= 64 or cfg.num_warps >= 8 else 2


def paged_mla_attention_kernel(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    *,
    config: DecodeConfig | None = None,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: q [T, H, R + P] vs latent cache [NB, BS, R + P] -> (out [T, H, R], lse).

    The value of a token is the first R elements of its latent row, which the kernel reuses
    from the key tile it already loaded. ``num_splits`` None or 0 picks the split count from
    static shapes (:func:`choose_mla_num_splits`); ``config`` overrides the tiles. An fp8 cache
    is read as ``fp8 * kv_scale`` (fp32 [1]; None: 1.0). With few heads and no ``config`` the
    tokens-on-M kernel runs instead where its switch for the cache's dtype is on and it takes
    that many heads (:func:`~.mla_tokens.tokens_on_m_switched_on`: up to
    :data:`~.mla_tokens.ROUTE_MAX_HEADS`, fp8 with one wide head tile up to
    :data:`~.mla_tokens.MAX_HEADS`). Before both, an fp8 cache with at most 32 heads on an
    sm_90 GPU runs on the warp-specialised Gluon kernel where
    :data:`~.mla_tokens_gluon.FP8_TOKENS_GLUON` is on (:func:`~.mla_tokens_gluon.tokens_gluon_supported`),
    and before that on the register-operand Gluon kernel where
    :data:`~.mla_regs_gluon.FP8_REGS_GLUON` is on (:func:`~.mla_regs_gluon.regs_gluon_supported`).
    """
    assert q.stride(-1) == 1 and cache.stride(-1) == 1
    if (
        config is None
        and cache.dtype == torch.float8_e4m3fn
        and mla_regs_gluon.FP8_REGS_GLUON
        and q.shape[1] <= mla_regs_gluon.REGS_ROUTE_MAX_HEADS
        and mla_regs_gluon.regs_gluon_supported(q, cache, kv_lora_rank) is None
    ):
        return mla_regs_gluon.paged_mla_regs_gluon(
            q, cache, block_table, query_seq_idx, query_kv_len, scale, kv_lora_rank,
            num_splits, kv_scale=kv_scale,
        )  # fmt: skip
    if (
        config is None
        and cache.dtype == torch.float8_e4m3fn
        and mla_tokens_gluon.FP8_TOKENS_GLUON
        and mla_tokens_gluon.tokens_gluon_supported(q, cache, kv_lora_rank) is None
    ):
        return mla_tokens_gluon.paged_mla_tokens_gluon(
            q, cache, block_table, query_seq_idx, query_kv_len, scale, kv_lora_rank,
            num_splits, kv_scale=kv_scale,
        )  # fmt: skip
    if (
        config is None
        and mla_tokens.tokens_on_m_switched_on(cache, q.shape[1])
        and mla_tokens.tokens_on_m_supported(q, cache, kv_lora_rank) is None
    ):
        return mla_tokens.paged_mla_tokens_on_m(
            q, cache, block_table, query_seq_idx, query_kv_len, scale, kv_lora_rank,
            num_splits, kv_scale=kv_scale,
        )  # fmt: skip
    t, h, _ = q.shape
    _, page, width = cache.shape
    rope = width - kv_lora_rank
    out = q.new_empty(t, h, kv_lora_rank)
    lse = q.new_empty(t, h, dtype=torch.float32)
    if t == 0:
        return out, lse
    cfg = config or mla_default_config(h)
    if config is None and q.element_size() > 2:
        # fp32 tiles take twice the shared memory: fewer heads and tokens per program.
        cfg = DecodeConfig(block_h=min(cfg.block_h, 16), block_n=32, num_warps=4, num_stages=2)
    split_scores = cfg.split_scores
    if split_scores is None:
        split_scores = cfg.block_h >= 64 and cfg.num_warps >= 8
    head_tiles = triton.cdiv(h, cfg.block_h)
    max_kv_len = block_table.shape[1] * page
    if not num_splits:
        num_splits = choose_mla_num_splits(
            t * head_tiles, max_kv_len, _num_sms(q.device), cfg.block_n, mla_programs_per_sm(cfg)
        )
    o_buf, l_buf, so, sl = _split_buffers(out, lse, num_splits)
    ks = fp8_scale_args(cache, kv_scale, kv_scale)[0]
    kv_fp8 = cache.dtype == torch.float8_e4m3fn
    fp8 = fp8_launch_args(q.dtype, q.device) if kv_fp8 else _NO_FP8
    _paged_mla_kernel[(t * head_tiles, num_splits)](
        q, cache.view(torch.uint8) if kv_fp8 else cache, block_table, query_seq_idx,
        query_kv_len, o_buf, l_buf, ks, fp8.q_mult, fp8.out_mult,
        scale * _LOG2E * fp8.score_mult,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0),
        *so, *sl,
        max_kv_len, num_splits,
        H=h, NUM_HEAD_TILES=head_tiles, PAGE=page, R=kv_lora_rank, P=rope,
        BLOCK_R=_pow2(kv_lora_rank), BLOCK_P=_pow2(rope),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, PARTIAL=num_splits > 1,
        SPLIT_SCORES=bool(split_scores),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        # (The second, transposed tile does not fit shared memory beside a 64-head tile.)
        K_T=kv_fp8 and FP8_K_TRANSPOSED and cfg.block_h < 64,
        FP8_KIND=fp8.kind, FP8_ASM=fp8.asm, P_SHIFT=fp8.p_shift,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse
