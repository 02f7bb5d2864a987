"""Gluon (Hopper) absorbed MLA paged decode with LSE: two warp groups taking turns; launcher only.

Shape letters: T = queries, H = query heads (a multiple of 64), R = latent width (512),
P = rope dim (64), NB = physical blocks, BS = tokens per block, S = KV splits.

One program serves 64 heads of one query over one split of its KV range (a query's head tiles
are grid neighbours: they share the split through L2). Two warp groups (``warp_specialize``):

- the copies (by warp group 0 or by producer warps, below): Q once ([64, 576] as 9 pieces of
  64 columns), then each 64-token latent tile as 9 pieces (one copy per block and piece), each
  piece with its own barrier. Two tile buffers: tile 2k in buffer 0, tile 2k+1 in buffer 1.
- warp group 0 owns output columns [0, 256), warp group 1 [256, 512). Per pair of tiles
  (A = 2k, B = 2k+1): WG0 computes S_A and its softmax, publishes P_A (bf16, shared memory)
  with its row statistics and adds P_A V_A to its half, while WG1 computes S_B; WG1 then adds
  P_A V_A, takes the softmax of S_B from WG0's running max, publishes P_B and adds P_B V_B;
  WG0 adds P_B V_B. So one tile's softmax runs under the other warp group's products.

The values are the first R columns of the latent tile in shared memory. A split with an odd
tile count ends with a phantom tile B (every key masked). Rows past the range are zeroed before
they meet P @ V (unwritten slots may hold NaN), by the warp groups or (``producer_zeroing``) by
the producer warps. Splits and their merge as in :mod:`cp_modules.kernels.decode.paged`.

In-kernel split merges (``GluonMLAConfig.fused_merge``: the program that draws a row's last
arrival ticket merges every split; ``spread_merge``: the row's programs each merge a share of
the columns) are in :mod:`cp_modules.kernels.decode.mla_gluon_epilogue`.

Schedules (:class:`GluonMLAConfig`, all exact): who issues the tile copies (warp group 0,
each block id looked up next to its copy or a tile's ids first; producer warps; a cp.async
producer warp group), when a buffer is refilled (once both warp groups are done with it, or in
parts: rope piece, then each latent half, with the scores taking the pieces in that order),
who zeroes the rows past the range, whether a split's last pair is peeled off, and
(``scale_p``) whether warp group 1's softmax starts from tile A's max, with P_A rescaled by
warp group 0 (:mod:`cp_modules.kernels.decode.mla_gluon_scale_p`).

Needs Triton's Gluon (3.6 API) and an sm_90 GPU; bf16/fp16 only.
"""

from __future__ import annotations

import torch

from cp_modules.kernels.decode.mla_gluon_config import (
    _HEADS,
    _PIECE,
    _TILE,
    GLUON_MLA_VARIANTS,
    GluonMLAConfig,
    check_trace_buffer,
    choose_gluon_mla_num_splits,
    default_gluon_mla_config,
    gluon_mla_supported,
    merge_counters,
    reserve_merge_counters,
)
from cp_modules.kernels.decode.paged import _LOG2E, _split_buffers
from cp_modules.kernels.merge import merge_splits_triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__ = [
    "GLUON_MLA_VARIANTS",
    "GluonMLAConfig",
    "HAS_GLUON",
    "choose_gluon_mla_num_splits",
    "default_gluon_mla_config",
    "gluon_mla_supported",
    "merge_counters",
    "paged_mla_attention_gluon",
    "reserve_merge_counters",
]

if HAS_GLUON:
    from cp_modules.kernels.decode.mla_gluon_epilogue import (
        _HALF_STORED,
        _SPUN,
        _TICKET,
        _store_half,
        _wg0_fused,
        _wg0_spread,
        _wg1_fused,
        _wg1_spread,
    )
    from cp_modules.kernels.decode.mla_gluon_parts import (
        _ASYNC_WARPS,
        _BC,
        _BH,
        _BN,
        _FREE_HI,
        _FREE_LO,
        _FREE_ROPE,
        _ISSUE_ASYNC,
        _ISSUE_LOADER,
        _LANDED,
        _LAT,
        _issue_q,
        _issue_tile_by,
        _mla_loader,
        _pv4,
        _release_pv,
        _scores,
        _stamp,
        _sync_warp_group,
        _zero_rows_past,
    )
    from cp_modules.kernels.decode.mla_gluon_scale_p import _STATS_A, _wg0_pair_sp, _wg1_pair_sp

    @gluon.jit
    def _wg0_pair(k, n_pairs, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat,
                  k_pe, p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, c_desc, BT, bt_row,
                  last_page, PAGE: gl.constexpr, BOX_ROWS: gl.constexpr, ISSUE: gl.constexpr,
                  MASK: gl.constexpr, mma: gl.constexpr, EARLY: gl.constexpr,
                  PZERO: gl.constexpr = False):  # fmt: skip
        # Warp group 0's share of pair k (tiles A = 2k in buffer 0, B = 2k + 1 in buffer 1).
        # MASK: the pair may reach past the range (the last pair); else no masks, no zeroing.
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dt: gl.constexpr = q_lat.dtype
        phase = k & 1
        n0 = start + 2 * k * _BN
        s = _scores(q_lat, q_pe, k_lat, k_pe, k_ready, 0, phase, mma, EARLY)
        if ISSUE < _ISSUE_LOADER:
            if k > 0:
                # Buffer 1 is free once warp group 1 has finished P_B V_B of the last pair.
                mbarrier.wait(k_free.index(1), phase ^ 1)
                _issue_tile_by(ISSUE, c_desc, k_lat, k_pe, k_ready, BT, bt_row, 1, n0 + _BN,
                               last_page, PAGE, BOX_ROWS)  # fmt: skip
        s = warpgroup_mma_wait(0, deps=(s,))
        if EARLY:
            mbarrier.arrive(k_free.index(_FREE_ROPE))
        if MASK:
            cols = n0 + gl.arange(0, _BN, layout=gl.SliceLayout(0, mma))
            s = gl.where((cols < end)[None, :], s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        rs = gl.sum(p, 1)
        l_i = l_i * alpha + rs
        m_i = m_new
        pv = p.to(dt)
        # Publish P_A and its row statistics for warp group 1.
        p_smem.store(pv)
        vec_smem.slice(0 * _BH, _BH).store(alpha)
        vec_smem.slice(1 * _BH, _BH).store(m_new)
        vec_smem.slice(2 * _BH, _BH).store(rs)
        fence_async_shared()
        _sync_warp_group()
        mbarrier.arrive(pa_bar)
        if MASK and not PZERO:
            if n0 + _BN > end:
                _zero_rows_past(k_lat, 0, 4, end - n0)
        o0, o1, o2, o3 = _pv4(gl.convert_layout(pv, p_op), k_lat, 0,
                              o0 * alpha[:, None], o1 * alpha[:, None],
                              o2 * alpha[:, None], o3 * alpha[:, None])  # fmt: skip
        if EARLY:
            o0, o1, o2, o3 = _release_pv(o0, o1, o2, o3, k_free, _FREE_LO)
        else:
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
            if ISSUE >= _ISSUE_LOADER:
                mbarrier.arrive(k_free.index(0))
        # Tile B: warp group 1's probabilities, rescaled to its running max. P_B being
        # published means warp group 1 is done with buffer 0: the next tile A goes there.
        mbarrier.wait(pb_bar, phase)
        if ISSUE < _ISSUE_LOADER:
            if k + 1 < n_pairs:
                _issue_tile_by(ISSUE, c_desc, k_lat, k_pe, k_ready, BT, bt_row, 0, n0 + 2 * _BN,
                               last_page, PAGE, BOX_ROWS)  # fmt: skip
        alpha_b = vec_smem.slice(3 * _BH, _BH).load(row_l)
        m_i = vec_smem.slice(4 * _BH, _BH).load(row_l)
        l_i = l_i * alpha_b + vec_smem.slice(5 * _BH, _BH).load(row_l)
        if MASK and not PZERO:
            if n0 + 2 * _BN > end:
                _zero_rows_past(k_lat, _LAT, 4, end - n0 - _BN)
        o0, o1, o2, o3 = _pv4(p_smem, k_lat, _LAT,
                              o0 * alpha_b[:, None], o1 * alpha_b[:, None],
                              o2 * alpha_b[:, None], o3 * alpha_b[:, None])  # fmt: skip
        if EARLY:
            o0, o1, o2, o3 = _release_pv(o0, o1, o2, o3, k_free, 16 + _FREE_LO)
        else:
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
            if ISSUE >= _ISSUE_LOADER:
                mbarrier.arrive(k_free.index(1))
        return m_i, l_i, o0, o1, o2, o3

    @gluon.jit
    def _mla_wg0(q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready, k_free, pa_bar, pb_bar,
                 start, end, n_pairs, qk_scale, OUT, out_row, stride_oh, LSE, lse_row,
                 stride_lh, q_desc, c_desc, BT, bt_row, q_row, FOUT, FLSE, COUNTER, stride_os,
                 stride_ls, num_splits, H: gl.constexpr, NUM_HEAD_TILES: gl.constexpr,
                 PAGE: gl.constexpr, BOX_ROWS: gl.constexpr, PARTIAL: gl.constexpr,
                 ISSUE: gl.constexpr, PEEL: gl.constexpr, FUSED: gl.constexpr,
                 OWN_REGS: gl.constexpr, EARLY: gl.constexpr, SPREAD: gl.constexpr,
                 TRACE: gl.constexpr, TRACE_BUF, PZERO: gl.constexpr = False,
                 SCALE_P: gl.constexpr = False):  # fmt: skip
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BN, 16]
        )
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        m_i = gl.full([_BH], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([_BH], gl.float32, row_l)
        o0 = gl.zeros([_BH, _BC], gl.float32, mma)
        o1 = gl.zeros([_BH, _BC], gl.float32, mma)
        o2 = gl.zeros([_BH, _BC], gl.float32, mma)
        o3 = gl.zeros([_BH, _BC], gl.float32, mma)
        last_page = gl.maximum(end - 1, 0) // PAGE
        if ISSUE < _ISSUE_LOADER:
            # Warp group 0 also issues the copies: Q, then the first two tiles.
            _issue_q(q_desc, q_lat, q_pe, q_bar, q_row)
            if n_pairs > 0:
                _issue_tile_by(ISSUE, c_desc, k_lat, k_pe, k_ready, BT, bt_row, 0, start,
                               last_page, PAGE, BOX_ROWS)  # fmt: skip
                _issue_tile_by(ISSUE, c_desc, k_lat, k_pe, k_ready, BT, bt_row, 1, start + _BN,
                               last_page, PAGE, BOX_ROWS)  # fmt: skip
        _stamp(TRACE_BUF, 0, num_splits, TRACE)
        mbarrier.wait(q_bar, 0)
        _stamp(TRACE_BUF, 1, num_splits, TRACE)
        n_full = 0
        if PEEL:
            # Every pair but the last lies wholly inside the range: no masks, no zeroing.
            n_full = gl.maximum(n_pairs - 1, 0)
            for k in range(n_full):
                m_i, l_i, o0, o1, o2, o3 = _wg0_pair(
                    k, n_pairs, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe,
                    k_lat, k_pe, p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, c_desc, BT,
                    bt_row, last_page, PAGE, BOX_ROWS, ISSUE, False, mma, EARLY, PZERO)  # fmt: skip
        for k in range(n_full, n_pairs):
            if SCALE_P:
                m_i, l_i, o0, o1, o2, o3 = _wg0_pair_sp(
                    k, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe,
                    p_smem, vec_smem, stats_b, k_ready, k_free, pa_bar, pb_bar, True, mma)  # fmt: skip
            else:
                m_i, l_i, o0, o1, o2, o3 = _wg0_pair(
                    k, n_pairs, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe,
                    k_lat, k_pe, p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, c_desc, BT,
                    bt_row, last_page, PAGE, BOX_ROWS, ISSUE, True, mma, EARLY, PZERO)  # fmt: skip
        _stamp(TRACE_BUF, 2, num_splits, TRACE)
        _store_half(o0, o1, o2, o3, l_i, OUT, out_row, 0, stride_oh, mma)
        nonempty = l_i > 0.0
        lse2 = gl.where(nonempty, m_i + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))
        if not PARTIAL:
            lse2 = lse2 * 0.6931471805599453
        heads = gl.arange(0, _BH, layout=row_l)
        gl.store(LSE + lse_row + heads.to(gl.int64) * stride_lh, lse2)
        _stamp(TRACE_BUF, 3, num_splits, TRACE)
        if FUSED:
            _wg0_fused(o0, o1, o2, o3, l_i, vec_smem, k_ready, COUNTER, OUT, out_row, stride_oh,
                       stride_os, LSE, lse_row, stride_lh, stride_ls, num_splits, FOUT, FLSE, H,
                       NUM_HEAD_TILES, OWN_REGS, mma)  # fmt: skip
        if SPREAD:
            _wg0_spread(COUNTER, num_splits, k_ready, OUT, out_row, stride_oh, stride_os, LSE,
                        lse_row, stride_lh, stride_ls, FOUT, FLSE, H, NUM_HEAD_TILES)  # fmt: skip

    @gluon.jit
    def _wg1_pair(k, start, end, qk_scale, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe, p_smem,
                  vec_smem, k_ready, k_free, pa_bar, pb_bar, ISSUE: gl.constexpr,
                  MASK: gl.constexpr, mma: gl.constexpr, EARLY: gl.constexpr,
                  PZERO: gl.constexpr = False):  # fmt: skip
        # Warp group 1's share of pair k; MASK as in _wg0_pair.
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dt: gl.constexpr = q_lat.dtype
        phase = k & 1
        n0 = start + (2 * k + 1) * _BN
        s = _scores(q_lat, q_pe, k_lat, k_pe, k_ready, 1, phase, mma, EARLY)
        # Tile A with warp group 0's probabilities while S_B is in flight.
        mbarrier.wait(pa_bar, phase)
        alpha_a = vec_smem.slice(0 * _BH, _BH).load(row_l)
        m_a = vec_smem.slice(1 * _BH, _BH).load(row_l)
        l_i = l_i * alpha_a + vec_smem.slice(2 * _BH, _BH).load(row_l)
        if MASK and not PZERO:
            if n0 > end:
                _zero_rows_past(k_lat, 4, 4, end - n0 + _BN)
        o0, o1, o2, o3 = _pv4(p_smem, k_lat, 4,
                              o0 * alpha_a[:, None], o1 * alpha_a[:, None],
                              o2 * alpha_a[:, None], o3 * alpha_a[:, None])  # fmt: skip
        if EARLY:
            s, o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(s, o0, o1, o2, o3))
            mbarrier.arrive(k_free.index(_FREE_HI))
            mbarrier.arrive(k_free.index(16 + _FREE_ROPE))
        else:
            s, o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(s, o0, o1, o2, o3))
            if ISSUE >= _ISSUE_LOADER:
                mbarrier.arrive(k_free.index(0))
        if MASK:
            cols = n0 + gl.arange(0, _BN, layout=gl.SliceLayout(0, mma))
            s = gl.where((cols < end)[None, :], s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        m_new = gl.maximum(m_a, gl.max(s, 1))
        alpha = gl.exp2(m_a - m_new)
        p = gl.exp2(s - m_new[:, None])
        rs = gl.sum(p, 1)
        l_i = l_i * alpha + rs
        pv = p.to(dt)
        # P_A has been read (the wait above): P_B may take its place.
        p_smem.store(pv)
        vec_smem.slice(3 * _BH, _BH).store(alpha)
        vec_smem.slice(4 * _BH, _BH).store(m_new)
        vec_smem.slice(5 * _BH, _BH).store(rs)
        fence_async_shared()
        _sync_warp_group()
        mbarrier.arrive(pb_bar)
        if MASK and not PZERO:
            if n0 + _BN > end:
                _zero_rows_past(k_lat, _LAT + 4, 4, end - n0)
        o0, o1, o2, o3 = _pv4(gl.convert_layout(pv, p_op), k_lat, _LAT + 4,
                              o0 * alpha[:, None], o1 * alpha[:, None],
                              o2 * alpha[:, None], o3 * alpha[:, None])  # fmt: skip
        if EARLY:
            o0, o1, o2, o3 = _release_pv(o0, o1, o2, o3, k_free, 16 + _FREE_HI)
        else:
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
            mbarrier.arrive(k_free.index(1))
        return l_i, o0, o1, o2, o3

    @gluon.jit
    def _mla_wg1(q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready, k_free, pa_bar, pb_bar,
                 start, end, n_pairs, qk_scale, OUT, out_row, stride_oh, LSE, lse_row, stride_lh,
                 FOUT, FLSE, COUNTER, stride_os, stride_ls, num_splits, HALF_COL: gl.constexpr,
                 H: gl.constexpr, NUM_HEAD_TILES: gl.constexpr, ISSUE: gl.constexpr,
                 PEEL: gl.constexpr, FUSED: gl.constexpr, OWN_REGS: gl.constexpr,
                 EARLY: gl.constexpr, SPREAD: gl.constexpr, TRACE: gl.constexpr,
                 TRACE_BUF, PZERO: gl.constexpr = False, SCALE_P: gl.constexpr = False):  # fmt: skip
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BN, 16]
        )
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        m_i = gl.full([_BH], float("-inf"), gl.float32, row_l)  # SCALE_P: the last pair's max
        l_i = gl.zeros([_BH], gl.float32, row_l)
        o0 = gl.zeros([_BH, _BC], gl.float32, mma)
        o1 = gl.zeros([_BH, _BC], gl.float32, mma)
        o2 = gl.zeros([_BH, _BC], gl.float32, mma)
        o3 = gl.zeros([_BH, _BC], gl.float32, mma)
        mbarrier.wait(q_bar, 0)
        n_full = 0
        if PEEL:
            n_full = gl.maximum(n_pairs - 1, 0)
            for k in range(n_full):
                l_i, o0, o1, o2, o3 = _wg1_pair(
                    k, start, end, qk_scale, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe,
                    p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, ISSUE, False, mma, EARLY, PZERO)  # fmt: skip
        for k in range(n_full, n_pairs):
            if SCALE_P:
                m_i, l_i, o0, o1, o2, o3 = _wg1_pair_sp(
                    k, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe,
                    p_smem, vec_smem, stats_b, k_ready, k_free, pa_bar, pb_bar, True, mma)  # fmt: skip
            else:
                l_i, o0, o1, o2, o3 = _wg1_pair(
                    k, start, end, qk_scale, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe,
                    p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, ISSUE, True, mma, EARLY,
                    PZERO)  # fmt: skip
        _stamp(TRACE_BUF, 4, num_splits, TRACE)
        _store_half(o0, o1, o2, o3, l_i, OUT, out_row, HALF_COL, stride_oh, mma)
        _stamp(TRACE_BUF, 5, num_splits, TRACE)
        if FUSED:
            _wg1_fused(o0, o1, o2, o3, l_i, vec_smem, k_ready, OUT, out_row, stride_oh,
                       stride_os, LSE, lse_row, stride_lh, stride_ls, num_splits, FOUT,
                       HALF_COL, H, NUM_HEAD_TILES, OWN_REGS, mma)  # fmt: skip
        if SPREAD:
            _wg1_spread(COUNTER, num_splits, k_ready, OUT, out_row, stride_oh, stride_os, LSE,
                        lse_row, stride_lh, stride_ls, FOUT, FLSE, H, NUM_HEAD_TILES)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_splits"])
    def _paged_mla_gluon_kernel(q_desc, c_desc, CACHE, BT, SEQ_IDX, KV_LEN, OUT, LSE, FOUT, FLSE, COUNTER, TRACE_BUF,
                                qk_scale, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                                stride_ls, stride_btr, max_kv_len, num_splits,
                                H: gl.constexpr, NUM_HEAD_TILES: gl.constexpr, PAGE: gl.constexpr,
                                BOX_ROWS: gl.constexpr, PARTIAL: gl.constexpr,
                                ISSUE: gl.constexpr = 0, PEEL: gl.constexpr = False,
                                WG1_REGS: gl.constexpr = 256, LOADER_REGS: gl.constexpr = 24,
                                FUSED: gl.constexpr = False, OWN_REGS: gl.constexpr = False,
                                EARLY: gl.constexpr = False,
                                SPREAD: gl.constexpr = False, TRACE: gl.constexpr = False,
                                PZERO: gl.constexpr = False,
                                SCALE_P: gl.constexpr = False, SP_REFILL: gl.constexpr = False):  # fmt: skip
        pid = gl.program_id(0)
        split = gl.program_id(1)
        t = pid // NUM_HEAD_TILES
        tile = pid % NUM_HEAD_TILES
        row = gl.load(SEQ_IDX + t).to(gl.int64)
        kv_len = gl.maximum(gl.minimum(gl.load(KV_LEN + t).to(gl.int32), max_kv_len), 0)
        chunk = gl.cdiv(gl.cdiv(kv_len, num_splits), _BN) * _BN
        start = split * chunk
        end = gl.minimum(start + chunk, kv_len)
        n_tiles = gl.maximum(gl.cdiv(end - start, _BN), 0)
        n_pairs = (n_tiles + 1) // 2
        q_row = t * H + tile * _BH
        t64 = t.to(gl.int64)
        out_row = t64 * stride_ot + (tile * _BH).to(gl.int64) * stride_oh + split * stride_os
        lse_row = t64 * stride_lt + (tile * _BH).to(gl.int64) * stride_lh + split * stride_ls

        dt: gl.constexpr = q_desc.dtype
        layout: gl.constexpr = q_desc.layout
        q_lat = gl.allocate_shared_memory(dt, [_LAT, _BH, _BC], layout)
        q_pe = gl.allocate_shared_memory(dt, [_BH, _BC], layout)
        k_lat = gl.allocate_shared_memory(dt, [2 * _LAT, _BN, _BC], layout)
        k_pe = gl.allocate_shared_memory(dt, [2, _BN, _BC], layout)
        p_smem = gl.allocate_shared_memory(dt, [_BH, _BN], layout)
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        if SCALE_P:
            # Tile A's row statistics (warp group 0 -> 1) and tile B's (1 -> 0) apart, so
            # that neither warp group's stores wait behind its own loads of the other's.
            vec_smem = gl.allocate_shared_memory(gl.float32, [2 * _BH], vec_layout)
            stats_b = gl.allocate_shared_memory(gl.float32, [2 * _BH], vec_layout)
        else:
            vec_smem = gl.allocate_shared_memory(gl.float32, [8 * _BH], vec_layout)
            stats_b = vec_smem
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        pa_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        pb_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        # PZERO: 16 more barriers, on which the latent pieces of a tile reaching past the
        # range land (_LANDED + buf * 8 + c).
        k_ready = gl.allocate_shared_memory(gl.int64, [48 if PZERO else 32, 1], bar_layout)
        k_free = gl.allocate_shared_memory(gl.int64, [32 if EARLY else 2, 1], bar_layout)
        mbarrier.init(q_bar, count=1)
        mbarrier.init(pa_bar, count=1)
        mbarrier.init(pb_bar, count=1)
        for b in gl.static_range(2):
            for c in gl.static_range(_LAT + 1):
                # cpasync: each producer thread arrives once its copies of the piece land.
                mbarrier.init(k_ready.index(b * 16 + c),
                              count=_ASYNC_WARPS * 32 if ISSUE == _ISSUE_ASYNC else 1)  # fmt: skip
            # With the producer warp a buffer is free once both warp groups are done with it.
            if EARLY:
                # Early release: each part of a buffer is freed by the one warp group that
                # uses it last (slots _FREE_ROPE, _FREE_LO and _FREE_HI).
                for slot in gl.static_range(3):
                    mbarrier.init(k_free.index(b * 16 + slot * (_LAT // 2)), count=1)
            else:
                mbarrier.init(k_free.index(b), count=2 if ISSUE >= _ISSUE_LOADER else 1)
        if PZERO:
            for b in gl.static_range(2 * _LAT):
                mbarrier.init(k_ready.index(_LANDED + b), count=1)
        if SCALE_P:
            mbarrier.init(k_ready.index(_STATS_A), count=1)
        if FUSED or SPREAD:
            mbarrier.init(k_ready.index(_HALF_STORED), count=1)
            mbarrier.init(k_ready.index(_SPUN if SPREAD else _TICKET), count=1)

        bt_row = row * stride_btr
        # Warp group 0 issues the copies (inline, hoist), or one producer warp (loader) or two
        # (loader2: each its share of every tile's pieces, the first also Q) do.
        if ISSUE == _ISSUE_LOADER + 1:
            gl.warp_specialize(
                [
                    (_mla_wg0, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, q_desc, c_desc, BT,
                                bt_row, q_row, FOUT, FLSE, COUNTER, stride_os, stride_ls,
                                num_splits, H, NUM_HEAD_TILES, PAGE, BOX_ROWS, PARTIAL, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P)),
                    (_mla_wg1, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, FOUT, FLSE,
                                COUNTER, stride_os, stride_ls, num_splits, _LAT * _BC // 2, H,
                                NUM_HEAD_TILES, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P)),
                    (_mla_loader, (q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end,
                                   n_pairs, q_desc, c_desc, BT, bt_row, q_row, PAGE, BOX_ROWS, 0,
                                   2, EARLY, None, False, PZERO, SP_REFILL)),
                    (_mla_loader, (q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end,
                                   n_pairs, q_desc, c_desc, BT, bt_row, q_row, PAGE, BOX_ROWS, 1,
                                   2, EARLY, None, False, PZERO, SP_REFILL)),
                ],
                [4, 1, 1],
                [WG1_REGS, LOADER_REGS, LOADER_REGS],
            )  # fmt: skip
        elif ISSUE == _ISSUE_LOADER or ISSUE == _ISSUE_ASYNC:
            gl.warp_specialize(
                [
                    (_mla_wg0, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, q_desc, c_desc, BT,
                                bt_row, q_row, FOUT, FLSE, COUNTER, stride_os, stride_ls,
                                num_splits, H, NUM_HEAD_TILES, PAGE, BOX_ROWS, PARTIAL, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P)),
                    (_mla_wg1, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, FOUT, FLSE,
                                COUNTER, stride_os, stride_ls, num_splits, _LAT * _BC // 2, H,
                                NUM_HEAD_TILES, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P)),
                    (_mla_loader, (q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end,
                                   n_pairs, q_desc, c_desc, BT, bt_row, q_row, PAGE, BOX_ROWS, 0,
                                   1, EARLY, CACHE, ISSUE == _ISSUE_ASYNC, PZERO,
                                   SP_REFILL)),
                ],
                [4, _ASYNC_WARPS if ISSUE == _ISSUE_ASYNC else 1],
                [WG1_REGS, LOADER_REGS],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [
                    (_mla_wg0, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, q_desc, c_desc, BT,
                                bt_row, q_row, FOUT, FLSE, COUNTER, stride_os, stride_ls,
                                num_splits, H, NUM_HEAD_TILES, PAGE, BOX_ROWS, PARTIAL, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P)),
                    (_mla_wg1, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, FOUT, FLSE,
                                COUNTER, stride_os, stride_ls, num_splits, _LAT * _BC // 2, H,
                                NUM_HEAD_TILES, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P)),
                ],
                [4],
                [WG1_REGS],
            )  # fmt: skip


def _smem_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def paged_mla_attention_gluon(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    *,
    config: GluonMLAConfig | None = None,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode through the Gluon kernel; the contract of
    :func:`~cp_modules.kernels.decode.mla.paged_mla_attention_kernel`.

    ``config`` picks a schedule (:class:`GluonMLAConfig`; default
    :func:`default_gluon_mla_config` of the block size); all compute the same attention. A
    schedule with ``fused_merge`` merges the KV splits inside the kernel (arrival counters
    from :func:`merge_counters`); the others launch :func:`merge_splits_triton` after it.
    ``trace`` (int64, 8 per program, at (row * S + split) * 8; :func:`check_trace_buffer`):
    each program's timeline for a probe
    (:func:`~cp_modules.kernels.decode.mla_gluon_parts._stamp`).

    Raises:
        ValueError: when the kernel cannot serve these inputs (:func:`gluon_mla_supported`).
    """
    from cp_modules.kernels.decode.paged import _num_sms

    why = gluon_mla_supported(q, cache, kv_lora_rank)
    if why is not None:
        raise ValueError(why)
    t, h, width = q.shape
    nb, page, _ = cache.shape
    out = q.new_empty(t, h, kv_lora_rank)
    lse = q.new_empty(t, h, dtype=torch.float32)
    if t == 0:
        return out, lse
    if config is None:
        config = default_gluon_mla_config(page)
    head_tiles = h // _HEADS
    max_kv_len = block_table.shape[1] * page
    if not num_splits:
        num_splits = choose_gluon_mla_num_splits(config, t * head_tiles, max_kv_len,
                                                 _num_sms(q.device))  # fmt: skip
    o_buf, l_buf, so, sl = _split_buffers(out, lse, num_splits)
    if trace is not None:
        check_trace_buffer(trace, q.device, t * head_tiles * num_splits)
    fused = config.fuses_merge(num_splits)
    spread = config.spreads_merge(num_splits, t * head_tiles * num_splits, _num_sms(q.device))
    # Without an in-kernel merge the kernel never touches the counters (any int32 tensor will do).
    counters = merge_counters(q.device, t * head_tiles) if fused or spread else block_table
    layout = _smem_layout()
    q2 = q.reshape(t * h, width)
    if q2.stride(0) != width:
        q2 = q2.contiguous()
    box_rows = min(page, _TILE, config.max_box_rows)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [_HEADS, _PIECE], layout)
    c2 = cache.view(nb * page, width)
    c_desc = TensorDescriptor(c2, list(c2.shape), list(c2.stride()), [box_rows, _PIECE], layout)
    _paged_mla_gluon_kernel[(t * head_tiles, num_splits)](
        q_desc, c_desc, cache, block_table, query_seq_idx, query_kv_len, o_buf, l_buf, out, lse,
        counters, block_table if trace is None else trace, scale * _LOG2E, *so[:2], so[2],
        *sl[:2], sl[2], block_table.stride(0), max_kv_len, num_splits,
        H=h, NUM_HEAD_TILES=head_tiles, PAGE=page, BOX_ROWS=box_rows,
        PARTIAL=num_splits > 1, **config.constexprs(num_splits, spread),
        TRACE=trace is not None, num_warps=4, launch_cooperative_grid=spread,
    )  # fmt: skip
    if num_splits > 1 and not (fused or spread):
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse
