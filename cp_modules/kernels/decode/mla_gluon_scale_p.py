"""The pair of tiles of the Gluon MLA decode kernel (:mod:`cp_modules.kernels.decode.mla_gluon`)
under ``GluonMLAConfig.scale_p``: warp group 1 takes its softmax from tile A's running max as
soon as warp group 0 has published it, and warp group 0 rescales its probabilities P_A to tile
B's max before handing them over, so that each warp group's output half is rescaled only when
no product of its own is in flight.

Per pair (A = 2k in buffer 0, B = 2k + 1 in buffer 1), with early release and producer zeroing:

- warp group 0: S_A; its softmax; publishes tile A's statistics (row max m_A and row sum:
  barrier ``_STATS_A``; each side derives the factors from the maxima); O_lo *= alpha_A and P_A V_A[:, :256) with P_A from registers. Then,
  once warp group 1 has published P_B and tile B's statistics (``pb_bar``), it loads P_B into
  registers, stores P_A * alpha_B (P_A relative to m_B) in its place (``pa_bar``), and adds
  P_B V_B[:, :256) to O_lo * alpha_B.
- warp group 1: S_B; its softmax from m_A (m_B = max(m_A, row max)); publishes P_B and its
  statistics; O_hi *= alpha_A alpha_B once (nothing in flight); P_B V_B[:, 256:) from
  registers, then P_A V_A[:, 256:) from shared memory.

So warp group 1's softmax runs under warp group 0's first P @ V, and warp group 0's hand-off
of P_A under warp group 1's first P @ V; only tile A's softmax is exposed, where the default
schedule exposes both tiles' (FlashMLA's order of work, its sm90 dense decode). The latent half
[256, 512) of tile B is freed as soon as its product is done, before P_A V_A's.

Measured on the H200 (2026-12-03) 0-11 % slower than the default schedule; not the default
(docs/experiments/2026-12-02-peers.md, last section).
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
    from cp_modules.kernels.decode.mla_gluon_parts import (
        _BH,
        _BN,
        _FREE_HI,
        _FREE_LO,
        _FREE_ROPE,
        _LAT,
        _pv4,
        _release_pv,
        _scores,
        _sync_warp_group,
    )

    # Warp group 0 -> 1: tile A's statistics are in stats_a (a k_ready slot that neither the
    # tiles nor the epilogues use).
    _STATS_A = gl.constexpr(_LAT + 4)

    @gluon.jit
    def _scaled_scores(s, n0, end, qk_scale, MASK: gl.constexpr, mma: gl.constexpr):
        # Base-2 scaled scores; MASK: the columns past the range become -inf, behind a branch
        # on the tile (only a split's last pair reaches past it; no product is in flight here).
        if MASK:
            if n0 + _BN > end:
                cols = n0 + gl.arange(0, _BN, layout=gl.SliceLayout(0, mma))
                s = gl.where((cols < end)[None, :], s * qk_scale, float("-inf"))
            else:
                s = s * qk_scale
        else:
            s = s * qk_scale
        return s

    @gluon.jit
    def _wg0_pair_sp(k, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat,
                     k_pe, p_smem, stats_a, stats_b, k_ready, k_free, pa_bar, pb_bar,
                     MASK: gl.constexpr, mma: gl.constexpr):  # fmt: skip
        # stats_a / stats_b: [m, row sum] of tiles A / B (64 each); each warp group derives
        # both tiles' factors from the maxima itself (the same bits on both sides).
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dt: gl.constexpr = q_lat.dtype
        phase = k & 1
        n0 = start + 2 * k * _BN
        s = _scores(q_lat, q_pe, k_lat, k_pe, k_ready, 0, phase, mma, True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_free.index(_FREE_ROPE))
        s = _scaled_scores(s, n0, end, qk_scale, MASK, mma)
        m_a = gl.maximum(m_i, gl.max(s, 1))
        alpha_a = gl.exp2(m_i - m_a)
        p_a = gl.exp2(s - m_a[:, None])
        rs_a = gl.sum(p_a, 1)
        stats_a.slice(0, _BH).store(m_a)
        stats_a.slice(_BH, _BH).store(rs_a)
        _sync_warp_group()
        mbarrier.arrive(k_ready.index(_STATS_A))
        o0, o1, o2, o3 = _pv4(gl.convert_layout(p_a.to(dt), p_op), k_lat, 0,
                              o0 * alpha_a[:, None], o1 * alpha_a[:, None],
                              o2 * alpha_a[:, None], o3 * alpha_a[:, None])  # fmt: skip
        o0, o1, o2, o3 = _release_pv(o0, o1, o2, o3, k_free, _FREE_LO)
        # P_B and tile B's statistics; P_A, rescaled to m_B, takes P_B's place.
        mbarrier.wait(pb_bar, phase)
        m_i = stats_b.slice(0, _BH).load(row_l)
        alpha_b = gl.exp2(m_a - m_i)
        l_i = (l_i * alpha_a + rs_a) * alpha_b + stats_b.slice(_BH, _BH).load(row_l)
        p_b = p_smem.load(p_op)
        p_a = (p_a * alpha_b[:, None]).to(dt)
        _sync_warp_group()  # every thread has read P_B
        p_smem.store(p_a)
        fence_async_shared()
        _sync_warp_group()
        mbarrier.arrive(pa_bar)
        o0, o1, o2, o3 = _pv4(p_b, k_lat, _LAT,
                              o0 * alpha_b[:, None], o1 * alpha_b[:, None],
                              o2 * alpha_b[:, None], o3 * alpha_b[:, None])  # fmt: skip
        o0, o1, o2, o3 = _release_pv(o0, o1, o2, o3, k_free, 16 + _FREE_LO)
        return m_i, l_i, o0, o1, o2, o3

    @gluon.jit
    def _wg1_pair_sp(k, start, end, qk_scale, m_i, l_i, o0, o1, o2, o3, q_lat, q_pe, k_lat,
                     k_pe, p_smem, stats_a, stats_b, k_ready, k_free, pa_bar, pb_bar,
                     MASK: gl.constexpr, mma: gl.constexpr):  # fmt: skip
        # m_i: the last pair's m_B (warp group 0's running max at the start of this pair).
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dt: gl.constexpr = q_lat.dtype
        phase = k & 1
        n0 = start + (2 * k + 1) * _BN
        s = _scores(q_lat, q_pe, k_lat, k_pe, k_ready, 1, phase, mma, True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_free.index(16 + _FREE_ROPE))
        s = _scaled_scores(s, n0, end, qk_scale, MASK, mma)
        mbarrier.wait(k_ready.index(_STATS_A), phase)
        m_a = stats_a.slice(0, _BH).load(row_l)
        rs_a = stats_a.slice(_BH, _BH).load(row_l)
        alpha_a = gl.exp2(m_i - m_a)
        m_i = gl.maximum(m_a, gl.max(s, 1))
        alpha_b = gl.exp2(m_a - m_i)
        p_b = gl.exp2(s - m_i[:, None])
        rs_b = gl.sum(p_b, 1)
        l_i = (l_i * alpha_a + rs_a) * alpha_b + rs_b
        pv = p_b.to(dt)
        # P_A of the last pair has been read (its product was waited for): P_B takes its place.
        p_smem.store(pv)
        stats_b.slice(0, _BH).store(m_i)
        stats_b.slice(_BH, _BH).store(rs_b)
        _sync_warp_group()
        mbarrier.arrive(pb_bar)
        scale = alpha_a * alpha_b
        pv_op = gl.convert_layout(pv, p_op)
        o0, o1, o2, o3 = _pv4(pv_op, k_lat, _LAT + 4,
                              o0 * scale[:, None], o1 * scale[:, None],
                              o2 * scale[:, None], o3 * scale[:, None])  # fmt: skip
        mbarrier.wait(pa_bar, phase)
        o0, o1, o2, o3 = _pv4(p_smem, k_lat, 4, o0, o1, o2, o3)
        # Tile B's half [256, 512) is done once 4 products (P_A V_A's) are left in flight.
        pv_op = warpgroup_mma_wait(4, deps=(pv_op,))
        mbarrier.arrive(k_free.index(16 + _FREE_HI))
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        mbarrier.arrive(k_free.index(_FREE_HI))
        return m_i, l_i, o0, o1, o2, o3
