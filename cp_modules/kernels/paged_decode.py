"""Triton paged decode attention (GQA/MHA and absorbed MLA) with LSE; launchers only.

Shape letters: T = queries, Hq = query heads, Hkv = KV heads, G = Hq // Hkv, Dk = key dim,
Dpe = rope dim (MLA only), Dv = value dim, NB = physical blocks, BS = tokens per block,
R = block-table rows, M = entries per row, S = KV splits, Rk = MLA latent width
(kv_lora_rank; the MLA kernel's ``R``, with ``P`` = Dpe).

GQA/MHA: one program serves one (KV head, head tile) pair of one query over one split of its
KV range. All the query heads that share a KV head form the M dimension of ``tl.dot`` (padded
to 16), so each K/V tile is read from HBM once for the whole group. Keys are read
block-table-driven, tile by tile: 64 tokens when the KV range is split, 128 when it is not
(:func:`default_config`).

MLA has its own kernel: one program takes up to 64 of the query's heads over one split. Each
64-token latent tile [64, Rk + Dpe] is loaded once into shared memory and serves as the keys of
two score products (Rk and Dpe wide) and, through its first Rk columns, as the values; the
split count accounts for how many programs an SM holds (:func:`mla_programs_per_sm`). Tiles
and occupancy as measured: ``docs/switch-points.md``.

Split-KV (flash-decoding): the split count S is chosen on the host from static shapes only
(programs per split and the block table's capacity); each program takes an equal,
tile-aligned share of its own query's ``kv_len`` (read on the device). With S > 1 the programs
write fp32 partials that the LSE merge family's split merge
(:func:`~cp_modules.kernels.lse_merge.merge_splits_triton`) combines in a second launch (not
fused into this kernel). An empty range yields out = 0 and lse = -inf. Nothing here syncs with
the host, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cp_modules.kernels.lse_merge import merge_splits_triton

__all__ = [
    "DecodeConfig",
    "choose_mla_num_splits",
    "choose_num_splits",
    "default_config",
    "mla_default_config",
    "mla_programs_per_sm",
    "paged_attention_kernel",
    "paged_mla_attention_kernel",
]

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
# Splits are never shorter than this many tokens: shorter ones cost more in the merge than
# they win in parallelism.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64
# MLA with few heads per program is bandwidth-bound and wants every SM's program slots busy,
# which at B = 1 takes more splits than GQA's cap (the merge reads the partials in chunks).
_MLA_MAX_SPLITS = 256
# Fixed cost of one MLA split program (loading Q, writing and merging its fp32 partial
# output), in units of one 64-token latent tile.
_SPLIT_COST_TILES = 5


@triton.jit
def _paged_attn_kernel(
    Q,
    K,
    V,
    BT,
    SEQ_IDX,
    KV_LEN,
    OUT,
    LSE,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btr,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    max_kv_len,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_HEAD_TILES: tl.constexpr,
    PAGE: tl.constexpr,
    DK: tl.constexpr,
    DPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    V_IS_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Axis 0 enumerates (query, KV head, head tile) with head tiles fastest, so the tiles that
    # read the same K/V run side by side; it also has no 65535 limit on the query count.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_per_query = NUM_KV_HEADS * NUM_HEAD_TILES
    t = (pid // tiles_per_query).to(tl.int64)
    pid_h = pid % tiles_per_query
    kvh = pid_h // NUM_HEAD_TILES
    offs_h = (pid_h % NUM_HEAD_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h

    row = tl.load(SEQ_IDX + t).to(tl.int64)
    kv_len = tl.minimum(tl.load(KV_LEN + t).to(tl.int32), max_kv_len)
    kv_len = tl.maximum(kv_len, 0)
    # Equal tile-aligned shares of this query's range; tiles never straddle a block when
    # PAGE is a multiple of BLOCK_N because every tile start is a multiple of BLOCK_N.
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_dk = tl.arange(0, BLOCK_DK)
    dk_mask = offs_dk < DK
    q_rows = Q + t * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_dk[None, :], mask=h_mask[:, None] & dk_mask[None, :], other=0.0)
    if DPE > 0:
        offs_pe = tl.arange(0, BLOCK_DPE)
        pe_mask = offs_pe < DPE
        q_pe = tl.load(
            q_rows + DK + offs_pe[None, :], mask=h_mask[:, None] & pe_mask[None, :], other=0.0
        )
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bt_row = BT + row * stride_btr
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if PAGE % BLOCK_N == 0:
            blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
            in_page = (n0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_tok = blk * stride_kb + in_page * stride_ks
            v_tok = blk * stride_vb + in_page * stride_vs
        else:
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            in_page = (offs_n % PAGE).to(tl.int64)
            k_tok = blk * stride_kb + in_page * stride_ks
            v_tok = blk * stride_vb + in_page * stride_vs
        k_ptrs = K + k_tok[:, None] + kvh * stride_kh + offs_dk[None, :]
        k = tl.load(k_ptrs, mask=n_mask[:, None] & dk_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if DPE > 0:
            k_pe = tl.load(
                K + k_tok[:, None] + kvh * stride_kh + DK + offs_pe[None, :],
                mask=n_mask[:, None] & pe_mask[None, :],
                other=0.0,
            )
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K:
            v = k
        else:
            v = tl.load(
                V + v_tok[:, None] + kvh * stride_vh + offs_dv[None, :],
                mask=n_mask[:, None] & dv_mask[None, :],
                other=0.0,
            )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_ptrs = OUT + t * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
    l_ptrs = LSE + t * stride_lt + heads * stride_lh + split * stride_ls
    if NUM_SPLITS == 1:
        tl.store(l_ptrs, lse2 * 0.6931471805599453, mask=h_mask)
    else:
        tl.store(l_ptrs, lse2, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_mla_kernel(
    Q,
    C,
    BT,
    SEQ_IDX,
    KV_LEN,
    OUT,
    LSE,
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
    kv_len = tl.minimum(tl.load(KV_LEN + t).to(tl.int32), max_kv_len)
    kv_len = tl.maximum(kv_len, 0)
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_mask = offs_r < R
    p_mask = offs_p < P
    q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q = tl.load(q_rows + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    bt_row = BT + row * stride_btr
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if PAGE % BLOCK_N == 0:
            blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
            tok = blk * stride_cb + (n0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_cs
        else:
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            tok = blk * stride_cb + (offs_n % PAGE).to(tl.int64) * stride_cs
        # Rows past the range are zero-filled: their NaN/garbage must not reach P @ V.
        kv = tl.load(
            C + tok[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
        )
        k_pe = tl.load(
            C + tok[:, None] + R + offs_p[None, :],
            mask=n_mask[:, None] & p_mask[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
        if SPLIT_SCORES:
            # Two separate products (not one accumulating into the other) so that neither
            # score product feeds a later product directly; see below.
            s_pe = tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
            s = s * qk_scale + s_pe * qk_scale
        else:
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)
            s = s * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
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
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_ptrs = OUT + t * stride_ot + offs_h[:, None] * stride_oh + split * stride_os + offs_r[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=h_mask[:, None] & r_mask[None, :])
    l_ptrs = LSE + t * stride_lt + offs_h * stride_lh + split * stride_ls
    if PARTIAL:
        tl.store(l_ptrs, lse2, mask=h_mask)  # base 2, for the merge
    else:
        tl.store(l_ptrs, lse2 * 0.6931471805599453, mask=h_mask)


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes and launch parameters of the split kernel.

    ``split_scores`` (MLA only): spread the score tile over the warps by columns instead of
    computing it in every warp group; None picks it from the tile (64 heads on 8 warps).
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    split_scores: bool | None = None


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


@functools.lru_cache(maxsize=256)
def default_config(group: int, dk: int, dv: int, dpe: int, split: bool = True) -> DecodeConfig:
    """Tiles for a head group of ``group`` query heads per KV head and these head dims.

    A rope part (``dpe > 0``) means the MLA kernel: :func:`mla_default_config`. ``split``
    says whether the KV range is cut into several splits (see :func:`choose_num_splits`); the
    head tile does not depend on it, so the split count can be chosen first.

    Why these tiles (measured): ``docs/switch-points.md``.
    """
    if dpe > 0:
        return mla_default_config(group)
    block_h = min(64, max(16, _pow2(group)))
    if dk + dpe > 256 or dv > 256:
        # Wide rows: a [BLOCK_H, Dv] fp32 accumulator lives in registers, so keep the head
        # tile small and give it more warps.
        return DecodeConfig(block_h=min(block_h, 32), block_n=32, num_warps=8, num_stages=2)
    if max(dk, dv) > 128:
        return DecodeConfig(block_h=block_h, block_n=32, num_warps=4, num_stages=3)
    if not split:
        return DecodeConfig(block_h=block_h, block_n=128, num_warps=8, num_stages=2)
    return DecodeConfig(block_h=block_h, block_n=64, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=64)
def mla_default_config(heads: int) -> DecodeConfig:
    """MLA tiles (latent 576 in / 512 out) for ``heads`` query heads.

    The [BLOCK_H, 512] fp32 accumulator fills half the register file at 64 heads, so 64 heads
    take 8 warps (two warp groups, each holding half of the output columns; the tensor-core
    tile is 64 rows high). Q (72 KiB) and two 64-token latent tiles (2 x 72 KiB) fill shared
    memory. Measurements: ``docs/switch-points.md``.
    """
    block_h = min(64, max(16, _pow2(heads)))
    if block_h >= 64:
        return DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    return DecodeConfig(block_h=block_h, block_n=64, num_warps=4, num_stages=2)


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def choose_num_splits(num_programs: int, max_kv_len: int, num_sms: int) -> int:
    """KV splits for ``num_programs`` (query, head-tile) programs from static quantities only.

    Aims at about two waves of programs over the SMs, never cuts the longest addressable range
    (``max_kv_len``, from the block table's width) into pieces shorter than
    ``_MIN_SPLIT_TOKENS``, and caps the count at ``_MAX_SPLITS``.
    """
    if num_programs <= 0 or num_programs >= num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, num_programs)
    cap = max(1, triton.cdiv(max_kv_len, _MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, _MAX_SPLITS))


def mla_programs_per_sm(cfg: DecodeConfig) -> int:
    """How many MLA programs of these tiles one SM runs at a time (shared memory, registers).

    The default tiles: two of 16 or 32 heads on 4 warps fit in an H200's SM, one of 64 heads on
    8 warps (shared memory and registers as measured: ``docs/switch-points.md``).
    """
    return 1 if cfg.block_h >= 64 or cfg.num_warps >= 8 else 2


@functools.lru_cache(maxsize=1024)
def choose_mla_num_splits(
    num_programs: int,
    max_kv_len: int,
    num_sms: int,
    block_n: int = 64,
    programs_per_sm: int = 1,
) -> int:
    """KV splits for MLA's ``num_programs`` (query, head-tile) programs, static shapes only.

    ``programs_per_sm`` MLA programs run per SM at a time (:func:`mla_programs_per_sm`). The
    count is the fewest splits whose estimated makespan (waves x (tiles per split + a fixed
    cost per program)) is within 2 % of the best, splits no shorter than ``_MIN_SPLIT_TOKENS``
    and at most ``_MLA_MAX_SPLITS``. Memoised: it runs on every eager decode call.
    """
    if num_programs <= 0:
        return 1
    slots = num_sms * max(1, programs_per_sm)
    tiles = triton.cdiv(max(1, max_kv_len), block_n)
    cap = max(1, min(_MLA_MAX_SPLITS, triton.cdiv(max_kv_len, _MIN_SPLIT_TOKENS)))
    costs = []
    for s in range(1, cap + 1):
        waves = triton.cdiv(num_programs * s, slots)
        fixed = _SPLIT_COST_TILES if s > 1 else 1
        costs.append(waves * (triton.cdiv(tiles, s) + fixed))
    best = min(costs)
    return next(s for s, c in enumerate(costs, 1) if c <= best * 1.02)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    scale: float,
    *,
    num_kv_heads: int,
    dk: int,
    dpe: int,
    dv: int,
    page: int,
    stride_k: tuple[int, int, int],
    stride_v: tuple[int, int, int],
    v_is_k: bool,
    num_splits: int | None,
    config: DecodeConfig | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, hq, _ = q.shape
    group = hq // num_kv_heads
    out = q.new_empty(t, hq, dv)
    lse = q.new_empty(t, hq, dtype=torch.float32)
    if t == 0:
        return out, lse
    cfg = config or default_config(group, dk, dv, dpe)
    head_tiles = triton.cdiv(group, cfg.block_h)
    max_kv_len = block_table.shape[1] * page
    if not num_splits:
        num_splits = choose_num_splits(
            t * num_kv_heads * head_tiles, max_kv_len, _num_sms(q.device)
        )
    if config is None and num_splits == 1:
        cfg = default_config(group, dk, dv, dpe, split=False)  # same head tile
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (t * num_kv_heads * head_tiles, num_splits)
    o_buf, l_buf, so, sl = _split_buffers(out, lse, num_splits)
    _paged_attn_kernel[grid](
        q, k, v, block_table, query_seq_idx, query_kv_len, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        *stride_k, *stride_v,
        block_table.stride(0),
        *so, *sl,
        max_kv_len,
        GROUP=group, NUM_KV_HEADS=num_kv_heads, NUM_HEAD_TILES=head_tiles, PAGE=page,
        DK=dk, DPE=dpe, DV=dv,
        BLOCK_DK=_pow2(dk), BLOCK_DPE=_pow2(dpe) if dpe else 1, BLOCK_DV=_pow2(dv),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        V_IS_K=v_is_k, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse


def _split_buffers(
    out: torch.Tensor, lse: torch.Tensor, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], tuple[int, int, int]]:
    """Where the split programs write: ``out``/``lse`` themselves, or fp32 partials."""
    if num_splits == 1:
        return out, lse, (out.stride(0), out.stride(1), 0), (lse.stride(0), lse.stride(1), 0)
    t, hq, dv = out.shape
    o_buf = torch.empty(t, hq, num_splits, dv, dtype=torch.float32, device=out.device)
    l_buf = torch.empty(t, hq, num_splits, dtype=torch.float32, device=out.device)
    so = (o_buf.stride(0), o_buf.stride(1), o_buf.stride(2))
    sl = (l_buf.stride(0), l_buf.stride(1), l_buf.stride(2))
    return o_buf, l_buf, so, sl


def paged_attention_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA/MHA paged attention: q [T, Hq, D] vs [NB, BS, Hkv, D] caches -> (out, lse fp32).

    ``num_splits`` None or 0 picks the split count from static shapes; ``config`` overrides the
    tiles (for tuning). Last dims must be contiguous.
    """
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _, page, hkv, d = k_cache.shape
    return _launch(
        q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, scale,
        num_kv_heads=hkv, dk=d, dpe=0, dv=v_cache.shape[-1], page=page,
        stride_k=(k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
        stride_v=(v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
        v_is_k=False, num_splits=num_splits, config=config,
    )  # fmt: skip


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: q [T, H, R + P] vs latent cache [NB, BS, R + P] -> (out [T, H, R], lse).

    The value of a token is the first R elements of its latent row, which the kernel reuses
    from the key tile it already loaded. ``num_splits`` None or 0 picks the split count from
    static shapes (:func:`choose_mla_num_splits`); ``config`` overrides the tiles.
    """
    assert q.stride(-1) == 1 and cache.stride(-1) == 1
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
    _paged_mla_kernel[(t * head_tiles, num_splits)](
        q, cache, block_table, query_seq_idx, query_kv_len, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0),
        *so, *sl,
        max_kv_len, num_splits,
        H=h, NUM_HEAD_TILES=head_tiles, PAGE=page, R=kv_lora_rank, P=rope,
        BLOCK_R=_pow2(kv_lora_rank), BLOCK_P=_pow2(rope),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, PARTIAL=num_splits > 1,
        SPLIT_SCORES=bool(split_scores),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse
