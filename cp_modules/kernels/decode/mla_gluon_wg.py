"""The two compute warp groups of the Gluon MLA decode kernel
(:mod:`cp_modules.kernels.decode.mla_gluon`, whose docstring describes their schedule): each
one's share of a pair of latent tiles (``_wg0_pair``, ``_wg1_pair``) and its whole program
(``_mla_wg0``, ``_mla_wg1``: the loop over pairs, then its half of the result and the LSE).
With ``FP8`` (:mod:`cp_modules.kernels.decode.mla_gluon_fp8`) the tiles are fp16 converted
from fp8 bytes, each row's scores take their own scale and the output the cache's scale.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma_wait,
    )

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__: list[str] = []

if HAS_GLUON:
    from cp_modules.kernels.decode.mla_gluon_epilogue import (
        _store_half,
        _wg0_fused,
        _wg0_spread,
        _wg1_fused,
        _wg1_spread,
    )
    from cp_modules.kernels.decode.mla_gluon_fp8 import (
        _fp8_out_sums,
        _fp8_row_scale,
    )
    from cp_modules.kernels.decode.mla_gluon_halves import _issue_tile_halves, _refill
    from cp_modules.kernels.decode.mla_gluon_parts import (
        _BC,
        _BH,
        _BN,
        _FREE_HI,
        _FREE_LO,
        _FREE_ROPE,
        _ISSUE_LOADER,
        _ISSUE_WG,
        _LAT,
        _issue_q,
        _issue_tile_by,
        _pv4,
        _release_pv,
        _scores,
        _stamp,
        _sync_warp_group,
        _tile_rows,
        _zero_rows_past,
    )
    from cp_modules.kernels.decode.mla_gluon_scale_p import _wg0_pair_sp, _wg1_pair_sp

    @gluon.jit
    def _wg0_pair(k, n_pairs, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat,
                  k_pe, p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, c_desc, BT, bt_row,
                  last_page, PAGE: gl.constexpr, BOX_ROWS: gl.constexpr, ISSUE: gl.constexpr,
                  MASK: gl.constexpr, mma: gl.constexpr, EARLY: gl.constexpr,
                  PZERO: gl.constexpr = False, h_desc=None,
                  HALVES: gl.constexpr = False):  # fmt: skip
        # Warp group 0's share of pair k (tiles A = 2k in buffer 0, B = 2k + 1 in buffer 1).
        # MASK: the pair may reach past the range (the last pair); else no masks, no zeroing.
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dt: gl.constexpr = q_lat.dtype
        phase = k & 1
        n0 = start + 2 * k * _BN
        if ISSUE == _ISSUE_WG:
            # The next pair's tiles (2k + 2 into buffer 0, 2k + 3 into buffer 1), looked up
            # while this pair's scores run; this warp group refills what it uses last.
            more = k + 1 < n_pairs
            rows_a = _tile_rows(BT, bt_row, n0 + 2 * _BN, last_page, PAGE, BOX_ROWS)
            rows_b = _tile_rows(BT, bt_row, n0 + 3 * _BN, last_page, PAGE, BOX_ROWS)
        s = _scores(q_lat, q_pe, k_lat, k_pe, k_ready, 0, phase, mma, EARLY, HALVES)
        if ISSUE < _ISSUE_LOADER:
            if k > 0:
                # Buffer 1 is free once warp group 1 has finished P_B V_B of the last pair.
                mbarrier.wait(k_free.index(1), phase ^ 1)
                _issue_tile_by(ISSUE, c_desc, k_lat, k_pe, k_ready, BT, bt_row, 1, n0 + _BN,
                               last_page, PAGE, BOX_ROWS)  # fmt: skip
        s = warpgroup_mma_wait(0, deps=(s,))
        if EARLY:
            if ISSUE == _ISSUE_WG:
                _refill(c_desc, k_lat, k_pe, k_ready, 0, rows_a, BOX_ROWS, _LAT, _LAT + 1, more,
                        h_desc, HALVES)  # fmt: skip
            else:
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
            if ISSUE == _ISSUE_WG:
                o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
                _refill(c_desc, k_lat, k_pe, k_ready, 0, rows_a, BOX_ROWS, 0, _LAT // 2, more,
                        h_desc, HALVES)  # fmt: skip
            else:
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
            if ISSUE == _ISSUE_WG:
                o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
                _refill(c_desc, k_lat, k_pe, k_ready, 1, rows_b, BOX_ROWS, 0, _LAT // 2, more,
                        h_desc, HALVES)  # fmt: skip
            else:
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
                 SCALE_P: gl.constexpr = False, KV_SCALE=None, FP8: gl.constexpr = False,
                 h_desc=None, HALVES: gl.constexpr = False):  # fmt: skip
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
        if ISSUE < _ISSUE_LOADER or ISSUE == _ISSUE_WG:
            # Warp group 0 also issues the copies: Q, then the first two tiles.
            _issue_q(q_desc, q_lat, q_pe, q_bar, q_row)
            if n_pairs > 0:
                if HALVES:
                    rows = _tile_rows(BT, bt_row, start, last_page, PAGE, BOX_ROWS)
                    _issue_tile_halves(c_desc, h_desc, k_lat, k_pe, k_ready, k_free, 0, rows,
                                       BOX_ROWS, 0, False)  # fmt: skip
                    rows = _tile_rows(BT, bt_row, start + _BN, last_page, PAGE, BOX_ROWS)
                    _issue_tile_halves(c_desc, h_desc, k_lat, k_pe, k_ready, k_free, 1, rows,
                                       BOX_ROWS, 0, False)  # fmt: skip
                else:
                    _issue_tile_by(ISSUE, c_desc, k_lat, k_pe, k_ready, BT, bt_row, 0, start,
                                   last_page, PAGE, BOX_ROWS)  # fmt: skip
                    _issue_tile_by(ISSUE, c_desc, k_lat, k_pe, k_ready, BT, bt_row, 1,
                                   start + _BN, last_page, PAGE, BOX_ROWS)  # fmt: skip
        _stamp(TRACE_BUF, 0, num_splits, TRACE)
        mbarrier.wait(q_bar, 0)
        if FP8:
            qk_scale = _fp8_row_scale(qk_scale, KV_SCALE, vec_smem, row_l)
        _stamp(TRACE_BUF, 1, num_splits, TRACE)
        n_full = 0
        if PEEL:
            # Every pair but the last lies wholly inside the range: no masks, no zeroing.
            n_full = gl.maximum(n_pairs - 1, 0)
            for k in range(n_full):
                m_i, l_i, o0, o1, o2, o3 = _wg0_pair(
                    k, n_pairs, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe,
                    k_lat, k_pe, p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, c_desc, BT,
                    bt_row, last_page, PAGE, BOX_ROWS, ISSUE, False, mma, EARLY, PZERO, h_desc,
                    HALVES)  # fmt: skip
        for k in range(n_full, n_pairs):
            if SCALE_P:
                m_i, l_i, o0, o1, o2, o3 = _wg0_pair_sp(
                    k, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe,
                    p_smem, vec_smem, stats_b, k_ready, k_free, pa_bar, pb_bar, True, mma)  # fmt: skip
            else:
                m_i, l_i, o0, o1, o2, o3 = _wg0_pair(
                    k, n_pairs, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe,
                    k_lat, k_pe, p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, c_desc, BT,
                    bt_row, last_page, PAGE, BOX_ROWS, ISSUE, True, mma, EARLY, PZERO, h_desc,
                    HALVES)  # fmt: skip
        _stamp(TRACE_BUF, 2, num_splits, TRACE)
        _store_half(o0, o1, o2, o3, _fp8_out_sums(l_i, KV_SCALE, FP8), OUT, out_row, 0,
                    stride_oh, mma)  # fmt: skip
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
                  PZERO: gl.constexpr = False, n_pairs=0, c_desc=None, BT=None, bt_row=0,
                  last_page=0, PAGE: gl.constexpr = 64, BOX_ROWS: gl.constexpr = 64, h_desc=None,
                  HALVES: gl.constexpr = False):  # fmt: skip
        # Warp group 1's share of pair k; MASK as in _wg0_pair. ISSUE = wg: the copies of
        # the parts it uses last (the next pair's tile into the block-table's rows).
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dt: gl.constexpr = q_lat.dtype
        phase = k & 1
        n0 = start + (2 * k + 1) * _BN
        if ISSUE == _ISSUE_WG:
            more = k + 1 < n_pairs
            rows_a = _tile_rows(BT, bt_row, n0 + _BN, last_page, PAGE, BOX_ROWS)
            rows_b = _tile_rows(BT, bt_row, n0 + 2 * _BN, last_page, PAGE, BOX_ROWS)
        s = _scores(q_lat, q_pe, k_lat, k_pe, k_ready, 1, phase, mma, EARLY, HALVES)
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
            if ISSUE == _ISSUE_WG:
                # Tile B's rope piece first (its scores take it first), then A's half.
                _refill(c_desc, k_lat, k_pe, k_ready, 1, rows_b, BOX_ROWS, _LAT, _LAT + 1, more,
                        h_desc, HALVES)  # fmt: skip
                _refill(c_desc, k_lat, k_pe, k_ready, 0, rows_a, BOX_ROWS, _LAT // 2, _LAT, more,
                        h_desc, HALVES)  # fmt: skip
            else:
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
            if ISSUE == _ISSUE_WG:
                o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
                _refill(c_desc, k_lat, k_pe, k_ready, 1, rows_b, BOX_ROWS, _LAT // 2, _LAT, more,
                        h_desc, HALVES)  # fmt: skip
            else:
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
                 TRACE_BUF, PZERO: gl.constexpr = False, SCALE_P: gl.constexpr = False,
                 KV_SCALE=None, FP8: gl.constexpr = False, c_desc=None, BT=None, bt_row=0,
                 PAGE: gl.constexpr = 64, BOX_ROWS: gl.constexpr = 64, h_desc=None,
                 HALVES: gl.constexpr = False):  # fmt: skip
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BN, 16]
        )
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        last_page = gl.maximum(end - 1, 0) // PAGE  # (ISSUE = wg: the copies' last page)
        m_i = gl.full([_BH], float("-inf"), gl.float32, row_l)  # SCALE_P: the last pair's max
        l_i = gl.zeros([_BH], gl.float32, row_l)
        o0 = gl.zeros([_BH, _BC], gl.float32, mma)
        o1 = gl.zeros([_BH, _BC], gl.float32, mma)
        o2 = gl.zeros([_BH, _BC], gl.float32, mma)
        o3 = gl.zeros([_BH, _BC], gl.float32, mma)
        mbarrier.wait(q_bar, 0)
        if FP8:
            qk_scale = _fp8_row_scale(qk_scale, KV_SCALE, vec_smem, row_l)
        n_full = 0
        if PEEL:
            n_full = gl.maximum(n_pairs - 1, 0)
            for k in range(n_full):
                l_i, o0, o1, o2, o3 = _wg1_pair(
                    k, start, end, qk_scale, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe,
                    p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, ISSUE, False, mma, EARLY,
                    PZERO, n_pairs, c_desc, BT, bt_row, last_page, PAGE, BOX_ROWS, h_desc,
                    HALVES)  # fmt: skip
        for k in range(n_full, n_pairs):
            if SCALE_P:
                m_i, l_i, o0, o1, o2, o3 = _wg1_pair_sp(
                    k, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe,
                    p_smem, vec_smem, stats_b, k_ready, k_free, pa_bar, pb_bar, True, mma)  # fmt: skip
            else:
                l_i, o0, o1, o2, o3 = _wg1_pair(
                    k, start, end, qk_scale, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat, k_pe,
                    p_smem, vec_smem, k_ready, k_free, pa_bar, pb_bar, ISSUE, True, mma, EARLY,
                    PZERO, n_pairs, c_desc, BT, bt_row, last_page, PAGE, BOX_ROWS, h_desc,
                    HALVES)  # fmt: skip
        _stamp(TRACE_BUF, 4, num_splits, TRACE)
        _store_half(o0, o1, o2, o3, _fp8_out_sums(l_i, KV_SCALE, FP8), OUT, out_row, HALF_COL,
                    stride_oh, mma)  # fmt: skip
        _stamp(TRACE_BUF, 5, num_splits, TRACE)
        if FUSED:
            _wg1_fused(o0, o1, o2, o3, l_i, vec_smem, k_ready, OUT, out_row, stride_oh,
                       stride_os, LSE, lse_row, stride_lh, stride_ls, num_splits, FOUT,
                       HALF_COL, H, NUM_HEAD_TILES, OWN_REGS, mma)  # fmt: skip
        if SPREAD:
            _wg1_spread(COUNTER, num_splits, k_ready, OUT, out_row, stride_oh, stride_os, LSE,
                        lse_row, stride_lh, stride_ls, FOUT, FLSE, H, NUM_HEAD_TILES)  # fmt: skip
