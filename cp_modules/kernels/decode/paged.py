"""Triton paged decode attention for GQA/MHA with LSE, and the tiles and split counts that the
decode kernels share; launchers only (absorbed MLA: :mod:`cp_modules.kernels.decode.mla`).

Shape letters: T = queries, Hq = query heads, Hkv = KV heads, G = Hq // Hkv, Dk = key dim,
Dpe = rope dim, Dv = value dim, NB = physical blocks, BS = tokens per block, R = block-table
rows, M = entries per row, S = KV splits.

One program serves one (KV head, row tile) pair of a *run* of ``query_len`` consecutive queries
over one split of their KV range. The rows of ``tl.dot``'s M dimension are (query of the run,
query head of the KV head's group) pairs, heads fastest, padded to 16: each K/V tile is read
from HBM once for the whole group of every query of the run. A run is one request's tokens (a
speculative verification's ``k + 1`` queries; ``query_len = 1``: every query on its own): its
queries share their block-table row, and each row keeps its own visible range. Keys are read
block-table-driven, tile by tile: 64 tokens when the KV range is split, 128 when it is not
(:func:`default_config`).

Query ``t`` sees the local tokens ``query_kv_start[t] <= j < query_kv_len[t]`` (the start is 0
without a sliding window). A program's loop covers the union of its rows' ranges, from the tile
of the first key any row sees: tiles wholly before it are never read, nor are their block-table
entries (a windowed cache may have returned those blocks); a key no row sees is not loaded, and
each row's scores are masked to its own range. With a soft-cap ``c`` the scaled scores become
``c * tanh(s / c)`` before the softmax.

Split-KV (flash-decoding): the split count S is chosen on the host from static shapes only
(programs per split and the block table's capacity); each program takes an equal,
tile-aligned share of its run's visible range (read on the device). With S > 1 the
programs write fp32 partials that the LSE merge family's split merge
(:func:`~cp_modules.kernels.merge.merge_splits_triton`) combines in a second launch (not
fused into this kernel). An empty range yields out = 0 and lse = -inf. Nothing here syncs with
the host, so the launch is CUDA-graph safe.

fp8 (e4m3) caches: each K/V tile is read as bytes and converted right after its load, for
bf16/fp16 queries to fp16 by the hardware (the query rows brought into fp16 by powers of two,
:data:`FP8_HW_FP16`), else to the query's type by integer operations (exact up to a power of
two that the scales absorb: :mod:`cp_modules.kernels.decode.fp8`), and the products run as
for a half-precision cache; the key scale of the KV head is folded into the softmax scale and
the value scale into the output (fp32 scales [Hkv], or [1] with a head stride of 0).

The fp8 loop: each tile's block-table entries are loaded one tile ahead (:data:`BT_AHEAD`), so
the software pipeline keeps two tiles in flight per program, and the tiles wholly in the
visible range run without masks (:data:`UNMASKED_MAIN`). A token-minor value cache (token
stride 1, fp8's default layout) is read along the tokens: :mod:`~.token_minor`."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cp_modules.kernels.decode.fp8 import (
    NO_FP8,
    Fp8LaunchArgs,
    fp8_e4m3_bits_to,
    fp8_scale_args,
)
from cp_modules.kernels.decode.fp8 import fp8_launch_args as _fp8_launch_args
from cp_modules.kernels.decode.tiles import (  # noqa: F401 (re-exported)
    _MIN_SPLIT_TOKENS,
    DecodeConfig,
    _num_sms,
    _pow2,
    _split_buffers,
    choose_num_splits,
    default_config,
    mla_default_config,
)
from cp_modules.kernels.decode.token_minor import sub_entries, token_minor_value_tile
from cp_modules.kernels.merge import merge_splits_triton

__all__ = [
    "DecodeConfig",
    "choose_num_splits",
    "default_config",
    "mla_default_config",
    "paged_attention_kernel",
]

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
# fp8 caches: load each key tile as [Dk, N] (vLLM's Triton decode does) instead of [N, Dk] and
# a transpose; read at every launch. On by measurement: 1-6 % faster on the H200 on all five
# bench_fp8_kv shapes (benchmarks/results/fp8-kv-2026-12-02.txt).
FP8_K_TRANSPOSED = True
# fp8 caches on CUDA: the e4m3 -> bf16/fp16 conversion as packed permute-and-mask PTX
# (kernels.decode.fp8); off: the same bit operations in Triton. Read at every launch.
FP8_DEQUANT_ASM = True
# fp8 caches: split counts aim at this many programs per SM (a bf16 cache: about two waves),
# and the default tiles are FP8_BLOCK_N tokens on 4 warps. An fp8 program moves half a bf16 one's
# bytes per tile at about the same latency, so it takes more of them in flight: on the H200
# (Llama-3-8B heads, B=8 ctx=128k) 5 splits read 2.0 TB/s, 10: 2.3, 20: 2.5, 40: 2.6
# (tools/probes/probe_fp8_decode.py, benchmarks/results/fp8-decode-probe-2026-12-03.json).
FP8_PROGRAMS_PER_SM = 16
# fp8 caches with bf16/fp16 queries: e4m3 -> fp16 by the hardware (one instruction per two
# bytes) and the products in fp16 (kernels.decode.fp8's kind 3; the kernel brings each query
# row into fp16 by a power of two); off: the integer conversion to the query's type. Read at
# every launch.
FP8_HW_FP16 = True
# Each tile's block-table entries loaded one tile ahead (a loop-carried value), so that the
# software pipeline can keep two K/V tiles in flight per program: with the entry loaded in the
# tile's own iteration it keeps one (num_stages >= 3). bf16: 4-7 % faster at B=1 ctx=128k, 0.5-1.5 %
# slower at B=8 (gqa-decode-tiles-2026-12-04.json), so None: where programs <= SMs / 8.
BT_AHEAD = True  # fp8 caches; read per launch
BF16_BT_AHEAD: bool | None = None  # bf16/fp16 caches (True/False: forced); read per launch
# fp8 caches, one query a run: the tiles wholly inside the visible range loaded and scored
# without masks (the first and the last tile of a split with them, unpipelined). Not for bf16
# caches: the unpipelined masked tiles cost a bf16 tile registers (the unsplit 8-warp tile
# went from 128 to 172, half the programs per SM) and it saves no instructions there. Read at
# every launch.
UNMASKED_MAIN = True
# fp8 caches on the hardware conversion: the key ([Dk, N] loads) and value tiles converted in
# their load's layout and staged in shared memory as fp16, so the products read 16-bit
# operands by ldmatrix (the values otherwise come one byte at a time); a staging buffer more.
FP8_STAGED = False
# fp8 caches: tokens per tile, default launch (results/fp8-kv-gqa-sweep-2026-12-04.json).
FP8_BLOCK_N = 64


@triton.jit
def _tanh(x):
    # Odd-symmetric through exp2 of a non-positive argument: no overflow, |error| ~ 1 ulp of 1
    # (the interpreter has no libdevice, and tl.tanh is not in every Triton release).
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    y = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -y, y)


@triton.jit
def _tiles(
    q, q_pe, K, V, bt_row, kvh, kv_start, kv_len, has_gap, first, p_lo, p_hi, m_i, l_i, acc,
    qk_scale, softcap, offs_dk, dk_mask, offs_pe, pe_mask, offs_dv, dv_mask,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
    PAGE: tl.constexpr, DK: tl.constexpr, DPE: tl.constexpr, BLOCK_N: tl.constexpr,
    V_IS_K: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr, K_T: tl.constexpr,
    FP8_KIND: tl.constexpr, FP8_ASM: tl.constexpr, P_SHIFT: tl.constexpr,
    QUERY_LEN: tl.constexpr, MASKED: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr,
    STAGED: tl.constexpr, V_T: tl.constexpr,
):  # fmt: skip
    """The tiles of ``[p_lo, p_hi)`` into the running (m, l, acc); ``MASKED`` False: every
    key of each tile lies in every row's range. ``AHEAD``: block-table entries one tile ahead.
    ``STAGES``: the loop's software-pipeline depth. ``V_T``: a token-minor V cache (tiles
    of ``SUBS`` whole blocks loaded by their entries: kernels.decode.token_minor)."""
    SUBS: tl.constexpr = BLOCK_N // PAGE if V_T and PAGE < BLOCK_N and BLOCK_N % PAGE == 0 else 1
    blk_next, vblk_next = p_lo, p_lo  # (replaced before use)
    if AHEAD:
        # The first tile's entries (none past the range, nor before the first visible key).
        offs_a = p_lo + tl.arange(0, BLOCK_N)
        if PAGE % BLOCK_N == 0:
            blk_next = tl.load(bt_row + p_lo // PAGE, mask=p_lo < p_hi, other=0)
        else:
            blk_next = tl.load(bt_row + offs_a // PAGE, mask=(offs_a < p_hi) & (offs_a >= first),
                               other=0)  # fmt: skip
        if SUBS > 1:
            vblk_next = sub_entries(bt_row, p_lo, p_hi, first, PAGE, SUBS)
    for n0 in tl.range(p_lo, p_hi, BLOCK_N, num_stages=STAGES):
        if AHEAD:
            # This tile's entries were loaded one iteration ago; load the next tile's now.
            blk_cur = blk_next.to(tl.int64)
            offs_a = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            if PAGE % BLOCK_N == 0:
                blk_next = tl.load(bt_row + (n0 + BLOCK_N) // PAGE, mask=n0 + BLOCK_N < p_hi,
                                   other=0)  # fmt: skip
            else:
                blk_next = tl.load(bt_row + offs_a // PAGE,
                                   mask=(offs_a < p_hi) & (offs_a >= first), other=0)  # fmt: skip
        vblk = n0  # (replaced when used)
        if SUBS > 1 and AHEAD:
            vblk = vblk_next.to(tl.int64)
            vblk_next = sub_entries(bt_row, n0 + BLOCK_N, p_hi, first, PAGE, SUBS)
        elif SUBS > 1:
            vblk = sub_entries(bt_row, n0, p_hi, first, PAGE, SUBS).to(tl.int64)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = (offs_n < p_hi) & (offs_n >= first)
        else:
            n_mask = tl.full([BLOCK_N], 1, tl.int1)
        if QUERY_LEN > 1:
            # Each row's own range; with a gap only the keys some row sees are loaded (a key
            # between two rows' ranges may be a slot nobody wrote).
            s_mask = (
                n_mask[None, :]
                & (offs_n[None, :] >= kv_start[:, None])
                & (offs_n[None, :] < kv_len[:, None])
            )
            if has_gap:
                n_mask = tl.max(s_mask.to(tl.int32), 0) > 0
        else:
            s_mask = n_mask[None, :]
        if PAGE % BLOCK_N == 0:
            # The tile lies in one block, which holds a visible key.
            if AHEAD:
                blk = blk_cur
            else:
                blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
            in_page = (n0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_tok = blk * stride_kb + in_page * stride_ks
            if V_T:  # (tile starts are multiples of BLOCK_N: aligned runs of tokens)
                in_page = (tl.multiple_of(n0 % PAGE, BLOCK_N) + tl.arange(0, BLOCK_N)).to(tl.int64)
            v_tok = blk * stride_vb + in_page * stride_vs
        else:
            if AHEAD:
                blk = blk_cur
            else:
                blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            in_page = (offs_n % PAGE).to(tl.int64)
            k_tok = blk * stride_kb + in_page * stride_ks
            v_tok = blk * stride_vb + in_page * stride_vs
        if K_T:
            # The key tile loaded as [Dk, N] (the product's B operand as it is, no transpose).
            kt_ptrs = K + k_tok[None, :] + kvh * stride_kh + offs_dk[:, None]
            kt = tl.load(kt_ptrs, mask=n_mask[None, :] & dk_mask[:, None], other=0)
            if KV_FP8:
                kt = fp8_e4m3_bits_to(kt, FP8_KIND, FP8_ASM, 8 if STAGED else 4)
            s = tl.dot(q, kt, input_precision=PRECISION)
        else:
            k_ptrs = K + k_tok[:, None] + kvh * stride_kh + offs_dk[None, :]
            k = tl.load(k_ptrs, mask=n_mask[:, None] & dk_mask[None, :], other=0)
            if KV_FP8:
                k = fp8_e4m3_bits_to(k, FP8_KIND, FP8_ASM)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if DPE > 0:
            k_pe = tl.load(
                K + k_tok[:, None] + kvh * stride_kh + DK + offs_pe[None, :],
                mask=n_mask[:, None] & pe_mask[None, :],
                other=0,
            )
            if KV_FP8:
                k_pe = fp8_e4m3_bits_to(k_pe, FP8_KIND, FP8_ASM)
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        if SOFTCAP:
            # qk_scale is scale / c here and softcap is c * log2(e): c * tanh(s / c) in base 2.
            s = _tanh(s * qk_scale) * softcap
        else:
            s = s * qk_scale
        if MASKED:
            s = tl.where(s_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if QUERY_LEN > 1:
            # A row that has seen no key yet (its range starts later) keeps m = -inf: shift by
            # 0 instead, so that its alpha and p are 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new  # every visited tile holds a key of the one query
        alpha = tl.exp2(m_i - m_use)
        if P_SHIFT > 0:
            # P times 2**P_SHIFT, so that P @ v_bits stays clear of fp32's subnormals.
            p = tl.exp2(s - (m_use - P_SHIFT)[:, None])
        else:
            p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K:
            v = k
        elif V_T:
            v = token_minor_value_tile(
                V + kvh * stride_vh, v_tok, vblk, n_mask, offs_dv, dv_mask, stride_vb, stride_vd,
                PAGE, BLOCK_N, SUBS, KV_FP8, FP8_KIND, FP8_ASM, MASKED or QUERY_LEN > 1,
            )  # fmt: skip
        else:
            v = tl.load(
                V + v_tok[:, None] + kvh * stride_vh + offs_dv[None, :] * stride_vd,
                mask=n_mask[:, None] & dv_mask[None, :],
                other=0,
            )
            if KV_FP8 and FP8_KIND == 3 and not STAGED:
                v = fp8_e4m3_bits_to(v, FP8_KIND, FP8_ASM, 4)
            elif KV_FP8:
                v = fp8_e4m3_bits_to(v, FP8_KIND, FP8_ASM, 8)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attn_kernel(
    Q,
    K,
    V,
    BT,
    SEQ_IDX,
    KV_LEN,
    KV_START,
    OUT,
    LSE,
    K_SCALE,
    V_SCALE,
    stride_ksh,
    stride_vsh,
    q_mult,
    out_mult,
    qk_scale,
    softcap,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_btr,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    max_kv_len,
    num_queries,
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
    HAS_START: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    K_T: tl.constexpr = False,
    FP8_KIND: tl.constexpr = 1,
    FP8_ASM: tl.constexpr = False,
    P_SHIFT: tl.constexpr = 0,
    QUERY_LEN: tl.constexpr = 1,
    BT_AHEAD: tl.constexpr = False,
    UNMASKED_MAIN: tl.constexpr = False,
    NUM_STAGES: tl.constexpr = 3,
    STAGED: tl.constexpr = False,
    V_T: tl.constexpr = False,
):
    # Axis 0 enumerates (run, KV head, row tile) with row tiles fastest, so the tiles that
    # read the same K/V run side by side; it also has no 65535 limit on the query count.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_per_run = NUM_KV_HEADS * NUM_HEAD_TILES
    run = (pid // tiles_per_run).to(tl.int64)
    pid_h = pid % tiles_per_run
    kvh = pid_h // NUM_HEAD_TILES
    # Row r of the tile: query r // GROUP of the run, head r % GROUP of the KV head's group.
    offs_r = (pid_h % NUM_HEAD_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = run * QUERY_LEN + offs_r // GROUP
    h_mask = (offs_r < QUERY_LEN * GROUP) & (t < num_queries)
    heads = kvh * GROUP + offs_r % GROUP

    row = tl.load(SEQ_IDX + run * QUERY_LEN).to(tl.int64)  # the run's block-table row
    kv_len = tl.minimum(tl.load(KV_LEN + t, mask=h_mask, other=0).to(tl.int32), max_kv_len)
    kv_len = tl.maximum(kv_len, 0)
    if HAS_START:
        kv_start = tl.maximum(tl.load(KV_START + t, mask=h_mask, other=0).to(tl.int32), 0)
    else:
        kv_start = tl.zeros([BLOCK_H], dtype=tl.int32)
    # The loop covers the rows' non-empty ranges from the tile of the first key any row sees;
    # no row seeing a key visits no tile (so no tile reads a block before every row's start).
    live = kv_start < kv_len
    first = tl.min(tl.where(live, kv_start, max_kv_len), 0)
    last = tl.max(tl.where(live, kv_len, 0), 0)
    lo = (first // BLOCK_N) * BLOCK_N
    hi = tl.where(first < max_kv_len, last, lo)
    has_gap = False
    if QUERY_LEN > 1:
        # Do the rows' ranges leave a gap in [first, last)? Its first key would be a row's end
        # that no row covers (s <= end < len). Consecutive positions of one request leave
        # none: the loads are then masked to the union's bounds alone, no reduction a tile.
        ends = kv_len[:, None]
        covers = live[None, :] & (kv_start[None, :] <= ends) & (ends < kv_len[None, :])
        uncovered = live & (kv_len < last) & (tl.max(covers.to(tl.int32), 1) == 0)
        has_gap = tl.max(uncovered.to(tl.int32), 0) > 0
    # Equal tile-aligned shares of the run's range; tiles never straddle a block when
    # PAGE is a multiple of BLOCK_N because every tile start is a multiple of BLOCK_N.
    chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)

    offs_dk = tl.arange(0, BLOCK_DK)
    dk_mask = offs_dk < DK
    q_rows = Q + t[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_dk[None, :], mask=h_mask[:, None] & dk_mask[None, :], other=0.0)
    offs_pe = tl.arange(0, BLOCK_DPE)
    pe_mask = offs_pe < DPE
    q_pe = q
    if DPE > 0:
        q_pe = tl.load(
            q_rows + DK + offs_pe[None, :], mask=h_mask[:, None] & pe_mask[None, :], other=0.0
        )
    if KV_FP8 and FP8_KIND == 3:
        # Each row into fp16 exactly: times 2**sh, which brings its largest |q| to
        # [2**14, 2**15) (kernels.decode.fp8); the row's scores are divided by it.
        tl.static_assert(DPE == 0)
        qf = q.to(tl.float32)
        ex = ((tl.max(tl.abs(qf), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        sh = tl.minimum(tl.maximum(14 - ex, -126), 126)
        q = (qf * ((sh + 127) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        row_scale = ((127 - sh) << 23).to(tl.float32, bitcast=True)[:, None]
    elif KV_FP8:
        # The keys' 2**-bias (see kernels.decode.fp8): part of it onto the query, exactly.
        q = (q.to(tl.float32) * q_mult).to(q.dtype)
        if DPE > 0:
            q_pe = (q_pe.to(tl.float32) * q_mult).to(q_pe.dtype)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bt_row = BT + row * stride_btr
    if KV_FP8:
        # Dequantization: the key scale multiplies the scores, the value scale the output.
        qk_scale = qk_scale * tl.load(K_SCALE + kvh * stride_ksh)
        if FP8_KIND == 3:
            qk_scale = qk_scale * row_scale
    # With one query a run, the tiles wholly inside [first, end) take no masks: the loop runs
    # in three parts, the first tile when it starts before the first key, the unmasked tiles,
    # and the last tile when it ends past the range (each masked part at most one tile).
    parts: tl.constexpr = 3 if QUERY_LEN == 1 and UNMASKED_MAIN else 1
    mid_lo = start + tl.where(start < first, BLOCK_N, 0)
    mid_hi = mid_lo + tl.maximum(end - mid_lo, 0) // BLOCK_N * BLOCK_N
    for part in tl.static_range(parts):
        if parts == 1:
            p_lo, p_hi = start, end
        elif part == 0:
            p_lo, p_hi = start, tl.minimum(mid_lo, end)
        elif part == 1:
            p_lo, p_hi = mid_lo, mid_hi
        else:
            p_lo, p_hi = mid_hi, end
        m_i, l_i, acc = _tiles(
            q, q_pe, K, V, bt_row, kvh, kv_start, kv_len, has_gap, first, p_lo, p_hi, m_i,
            l_i, acc, qk_scale, softcap, offs_dk, dk_mask, offs_pe, pe_mask, offs_dv, dv_mask,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
            PAGE, DK, DPE, BLOCK_N, V_IS_K, SOFTCAP, PRECISION, KV_FP8, K_T, FP8_KIND, FP8_ASM,
            P_SHIFT, QUERY_LEN, (parts == 1) | (part != 1), BT_AHEAD & ((parts == 1) | (part == 1)),
            NUM_STAGES if (parts == 1) | (part == 1) else 1, STAGED, V_T,
        )  # fmt: skip

    nonempty = l_i > 0.0
    if KV_FP8:
        # The values' scale and 2**bias, divided by l (which holds P's 2**P_SHIFT) first.
        inv = tl.load(V_SCALE + kvh * stride_vsh) * out_mult / tl.where(nonempty, l_i, 1.0)
        out = acc * inv[:, None]
    else:
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)) - P_SHIFT, float("-inf"))
    o_rows = OUT + t[:, None] * stride_ot + heads[:, None] * stride_oh
    o_ptrs = o_rows + split * stride_os + offs_dv[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
    l_ptrs = LSE + t * stride_lt + heads * stride_lh + split * stride_ls
    if NUM_SPLITS == 1:
        tl.store(l_ptrs, lse2 * 0.6931471805599453, mask=h_mask)
    else:
        tl.store(l_ptrs, lse2, mask=h_mask)


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
    stride_v: tuple[int, int, int, int],
    v_is_k: bool,
    num_splits: int | None,
    config: DecodeConfig | None,
    query_kv_start: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, hq, _ = q.shape
    group = hq // num_kv_heads
    out = q.new_empty(t, hq, dv)
    lse = q.new_empty(t, hq, dtype=torch.float32)
    if t == 0:
        return out, lse
    kv_fp8 = k.dtype == torch.float8_e4m3fn
    query_len = max(1, min(query_len, t))
    rows = query_len * group  # rows per (run, KV head)
    cfg = config or default_config(rows, dk, dv, dpe)
    head_tiles = triton.cdiv(rows, cfg.block_h)
    max_kv_len = block_table.shape[1] * page
    programs = triton.cdiv(t, query_len) * num_kv_heads * head_tiles
    few = programs * 8 <= _num_sms(q.device) if BF16_BT_AHEAD is None else BF16_BT_AHEAD
    if not num_splits:
        num_splits = choose_num_splits(
            programs, max_kv_len, _num_sms(q.device), FP8_PROGRAMS_PER_SM if kv_fp8 else None
        )
    if config is None and kv_fp8 and dpe == 0 and max(dk, dv) <= 128:
        cfg = DecodeConfig(block_h=cfg.block_h, block_n=FP8_BLOCK_N, num_warps=4, num_stages=3)
    elif config is None and num_splits == 1:
        cfg = default_config(rows, dk, dv, dpe, split=False)  # same head tile
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (programs, num_splits)
    o_buf, l_buf, so, sl = _split_buffers(out, lse, num_splits)
    has_start = query_kv_start is not None
    k_t = kv_fp8 and FP8_K_TRANSPOSED and not v_is_k and dpe == 0
    v_t = not v_is_k and stride_v[1] == 1 and page > 1  # a token-minor V cache
    ks, vs, sks, svs = fp8_scale_args(k, k_scale, v_scale)
    hw16 = FP8_HW_FP16 and dpe == 0
    fp8 = fp8_launch_args(q.dtype, q.device, hw16) if kv_fp8 else _NO_FP8
    if kv_fp8:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    qk_scale = scale / softcap if softcap else scale * _LOG2E
    _paged_attn_kernel[grid](
        q, k, v, block_table, query_seq_idx, query_kv_len,
        query_kv_start if has_start else query_kv_len, o_buf, l_buf,
        ks, vs, sks, svs, fp8.q_mult, fp8.out_mult,
        qk_scale * fp8.score_mult,
        softcap * _LOG2E if softcap else 1.0,
        q.stride(0), q.stride(1),
        *stride_k, *stride_v,
        block_table.stride(0),
        *so, *sl,
        max_kv_len, t,
        GROUP=group, NUM_KV_HEADS=num_kv_heads, NUM_HEAD_TILES=head_tiles, PAGE=page,
        DK=dk, DPE=dpe, DV=dv,
        BLOCK_DK=_pow2(dk), BLOCK_DPE=_pow2(dpe) if dpe else 1, BLOCK_DV=_pow2(dv),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        V_IS_K=v_is_k, HAS_START=has_start, SOFTCAP=bool(softcap), PRECISION=precision,
        KV_FP8=kv_fp8, K_T=k_t, FP8_KIND=fp8.kind, FP8_ASM=fp8.asm, P_SHIFT=fp8.p_shift,
        QUERY_LEN=query_len,
        BT_AHEAD=(BT_AHEAD if kv_fp8 else few) and cfg.num_stages >= 3,
        UNMASKED_MAIN=UNMASKED_MAIN and kv_fp8,
        NUM_STAGES=cfg.num_stages, STAGED=FP8_STAGED and fp8.kind == 3 and not v_t, V_T=v_t,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse


_NO_FP8 = NO_FP8


def fp8_launch_args(
    q_dtype: torch.dtype, device: torch.device, hw_fp16: bool = False
) -> Fp8LaunchArgs:
    """The fp8 conversion's launch arguments (:func:`~cp_modules.kernels.decode.fp8.
    fp8_launch_args`) with the PTX as :data:`FP8_DEQUANT_ASM` says."""
    return _fp8_launch_args(q_dtype, device, asm=FP8_DEQUANT_ASM, hw_fp16=hw_fp16)


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
    query_kv_start: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA/MHA paged attention: q [T, Hq, D] vs [NB, BS, Hkv, D] caches -> (out, lse fp32).

    ``num_splits`` None or 0 picks the split count from static shapes; ``config`` overrides the
    tiles (for tuning). ``query_kv_start`` [T] (int32/int64): the first local token each query
    sees (a sliding window), None for 0; ``softcap`` c > 0: scores become ``c * tanh(s / c)``
    after scaling, None or 0 for none. fp8 caches: ``k_scale``, ``v_scale`` fp32 [Hkv] or [1]
    (None: 1.0). ``query_len`` Q: queries ``[i * Q, (i + 1) * Q)`` form a run that one program
    serves (its K/V read once for them); they must share ``query_seq_idx`` (the result is the
    per-query result whatever their ranges; the last run may be shorter). Last dims must be
    contiguous, but ``v_cache``'s may be token-minor instead (a token stride of 1: its tiles
    are then loaded along the tokens).
    """
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert v_cache.stride(-1) == 1 or v_cache.stride(1) == 1
    _, page, hkv, d = k_cache.shape
    return _launch(
        q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, scale,
        num_kv_heads=hkv, dk=d, dpe=0, dv=v_cache.shape[-1], page=page,
        stride_k=(k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
        stride_v=(v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3)),
        v_is_k=False, num_splits=num_splits, config=config,
        query_kv_start=query_kv_start, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        query_len=query_len,
    )  # fmt: skip
