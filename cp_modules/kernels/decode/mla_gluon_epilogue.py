"""Epilogues of the Gluon MLA decode kernel (:mod:`cp_modules.kernels.decode.mla_gluon`):
each warp group's store of its half of the result or partial, and the two split merges inside
the kernel: the last program of a (query, head tile) row merging every split (fused), or the
row's programs, resident together, each merging its share of the columns (spread).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__: list[str] = []

if HAS_GLUON:
    from cp_modules.kernels.decode.mla_gluon_config import _SPREAD_MAX_SPLITS
    from cp_modules.kernels.decode.mla_gluon_parts import _BC, _BH, _LAT, _sync_warp_group

    @gluon.jit
    def _store_half(o0, o1, o2, o3, l_i, OUT, out_row, col0: gl.constexpr, stride_oh,
                    mma: gl.constexpr):  # fmt: skip
        inv = 1.0 / gl.where(l_i > 0.0, l_i, 1.0)
        heads = gl.arange(0, _BH, layout=gl.SliceLayout(1, mma))
        cols = gl.arange(0, _BC, layout=gl.SliceLayout(0, mma))
        base = OUT + out_row + heads.to(gl.int64)[:, None] * stride_oh + col0 + cols[None, :]
        dt = OUT.dtype.element_ty
        gl.store(base, (o0 * inv[:, None]).to(dt))
        gl.store(base + _BC, (o1 * inv[:, None]).to(dt))
        gl.store(base + 2 * _BC, (o2 * inv[:, None]).to(dt))
        gl.store(base + 3 * _BC, (o3 * inv[:, None]).to(dt))

    # The split merge's hand-offs between the warp groups, in barrier slots the tile copies
    # leave unused (a buffer's pieces take slots buf * 16 + [0, 9)).
    _HALF_STORED = gl.constexpr(_LAT + 1)  # warp group 1 -> 0: its partial half is stored
    _TICKET = gl.constexpr(_LAT + 2)  # fused: warp group 0 -> 1, vec_smem[6 * 64] holds "last"
    _SPUN = gl.constexpr(_LAT + 3)  # spread: warp group 1 -> 0, it is past its wait

    # SPREAD merge (``GluonMLAConfig.spread_merge``): the row's programs, all resident at once
    # (a cooperative launch), wait until every split has stored its partial; program s then
    # merges the row's 64-column blocks c = s (mod S), warp group 0 those of [0, 256) and
    # warp group 1 those of [256, 512), so the merge is spread over the row's S SMs.
    @gluon.jit
    def _wait_splits(COUNTER, pid, num_splits):
        # Until every split of the row has taken its ticket (acquire: their partials, stored
        # before their release, are visible).
        n = gl.atomic_add(COUNTER + pid, 0, sem="acquire", scope="gpu")
        while n < num_splits:
            n = gl.atomic_add(COUNTER + pid, 0, sem="acquire", scope="gpu")

    _SPREAD_SPLITS = gl.constexpr(_SPREAD_MAX_SPLITS)  # splits the spread merge serves at most

    @gluon.jit
    def _merge_block(PO, po_row, stride_oh, stride_os, PL, pl_row, stride_lh, stride_ls,
                     num_splits, FOUT, fout_row, col0, FLSE, flse_row, write_lse):  # fmt: skip
        # Columns [col0, col0 + 64) of the row's result from every split's fp32 partial and
        # base-2 LSE (merge_splits_triton's weights; the same bits on every run); write_lse:
        # its LSE too. A thread holds all (up to 8) splits of its heads and columns, so every
        # split's loads are in flight at once and the sum over splits stays in the thread.
        l3: gl.constexpr = gl.BlockedLayout([1, _SPREAD_SPLITS, 4], [8, 1, 4],
                                            [gl.num_warps(), 1, 1], [2, 1, 0])  # fmt: skip
        w_l: gl.constexpr = gl.SliceLayout(2, l3)  # [heads, splits]
        o_l: gl.constexpr = gl.SliceLayout(1, l3)  # [heads, columns]
        heads = gl.arange(0, _BH, layout=gl.SliceLayout(1, w_l)).to(gl.int64)
        splits = gl.arange(0, _SPREAD_SPLITS, layout=gl.SliceLayout(0, w_l))
        live = (splits < num_splits)[None, :]
        lse = gl.load(PL + pl_row + heads[:, None] * stride_lh + splits[None, :] * stride_ls,
                      mask=live, other=float("-inf"), cache_modifier=".cg")  # fmt: skip
        m = gl.max(lse, 1)
        m = gl.where(m == float("-inf"), 0.0, m)
        w = gl.exp2(lse - m[:, None])
        total = gl.sum(w, 1)
        nonempty = total > 0.0
        inv = gl.convert_layout(1.0 / gl.where(nonempty, total, 1.0), gl.SliceLayout(1, o_l))
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, o_l))
        src = (PO + po_row + (heads[:, None] * stride_oh + splits[None, :] * stride_os)[:, :, None]
               + (col0 + cols)[None, None, :])  # fmt: skip
        h_o = gl.arange(0, _BH, layout=gl.SliceLayout(1, o_l)).to(gl.int64)
        dst = FOUT + fout_row + h_o[:, None] * (_LAT * _BC) + col0 + cols[None, :]
        for j in gl.static_range(_BC // 16):
            p = gl.load(src + j * 16, mask=live[:, :, None], other=0.0, cache_modifier=".cg")
            o = gl.sum(w[:, :, None] * p, 1)
            gl.store(dst + j * 16, (o * inv[:, None]).to(FOUT.dtype.element_ty))
        if write_lse:
            lse2 = gl.where(nonempty, m + gl.log2(gl.where(nonempty, total, 1.0)), float("-inf"))
            gl.store(FLSE + flse_row + heads, lse2 * 0.6931471805599453)

    @gluon.jit
    def _spread_merge(COUNTER, num_splits, lo: gl.constexpr, PO, out_row, stride_oh, stride_os,
                      PL, lse_row, stride_lh, stride_ls, FOUT, FLSE, H: gl.constexpr,
                      NUM_HEAD_TILES: gl.constexpr):  # fmt: skip
        # This warp group's blocks of the merge: c in [lo, lo + 4) with c = split (mod S),
        # after waiting for every split (only if it has one). Block 0 also writes the LSE.
        pid = gl.program_id(0)
        split = gl.program_id(1)
        first = split + gl.maximum(lo - split + num_splits - 1, 0) // num_splits * num_splits
        if first < lo + 4:
            _wait_splits(COUNTER, pid, num_splits)
            t64 = (pid // NUM_HEAD_TILES).to(gl.int64)
            head0 = ((pid % NUM_HEAD_TILES) * _BH).to(gl.int64)
            for c in range(first, lo + 4, num_splits):
                _merge_block(PO, out_row - split * stride_os, stride_oh, stride_os, PL,
                             lse_row - split * stride_ls, stride_lh, stride_ls, num_splits, FOUT,
                             (t64 * H + head0) * (_LAT * _BC), c * _BC, FLSE, t64 * H + head0,
                             c == 0)  # fmt: skip

    @gluon.jit
    def _wg0_spread(COUNTER, num_splits, k_ready, PO, out_row, stride_oh, stride_os, PL, lse_row,
                    stride_lh, stride_ls, FOUT, FLSE, H: gl.constexpr,
                    NUM_HEAD_TILES: gl.constexpr):  # fmt: skip
        # Warp group 0 takes the program's ticket once both halves are stored (acq_rel), merges
        # its blocks, then (warp group 1 past its wait too) takes a second ticket: the row's
        # last one resets the counter to 0 for the next launch, every wait being over.
        _sync_warp_group()
        mbarrier.wait(k_ready.index(_HALF_STORED), 0)
        pid = gl.program_id(0)
        gl.atomic_add(COUNTER + pid, 1, sem="acq_rel", scope="gpu")
        _spread_merge(COUNTER, num_splits, 0, PO, out_row, stride_oh, stride_os, PL, lse_row,
                      stride_lh, stride_ls, FOUT, FLSE, H, NUM_HEAD_TILES)  # fmt: skip
        mbarrier.wait(k_ready.index(_SPUN), 0)
        ticket = gl.atomic_add(COUNTER + pid, 1, sem="relaxed", scope="gpu")
        if ticket == 2 * num_splits - 1:
            gl.atomic_xchg(COUNTER + pid, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _wg1_spread(COUNTER, num_splits, k_ready, PO, out_row, stride_oh, stride_os, PL, lse_row,
                    stride_lh, stride_ls, FOUT, FLSE, H: gl.constexpr,
                    NUM_HEAD_TILES: gl.constexpr):  # fmt: skip
        _sync_warp_group()
        mbarrier.arrive(k_ready.index(_HALF_STORED))
        _spread_merge(COUNTER, num_splits, _LAT // 2, PO, out_row, stride_oh, stride_os, PL,
                      lse_row, stride_lh, stride_ls, FOUT, FLSE, H, NUM_HEAD_TILES)  # fmt: skip
        _sync_warp_group()
        mbarrier.arrive(k_ready.index(_SPUN))

    @gluon.jit
    def _wg0_fused(o0, o1, o2, o3, l_i, vec_smem, k_ready, COUNTER, OUT, out_row, stride_oh,
                   stride_os, LSE, lse_row, stride_lh, stride_ls, num_splits, FOUT, FLSE,
                   H: gl.constexpr, NUM_HEAD_TILES: gl.constexpr, OWN_REGS: gl.constexpr,
                   mma: gl.constexpr):  # fmt: skip
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        # Arrive once warp group 1's half is stored too; the last of the row's splits
        # merges (acq_rel: the others' partials are visible to it).
        _sync_warp_group()
        mbarrier.wait(k_ready.index(_HALF_STORED), 0)
        pid = gl.program_id(0)
        split = gl.program_id(1)
        ticket = gl.atomic_add(COUNTER + pid, 1, sem="acq_rel", scope="gpu")
        last = ticket == num_splits - 1
        vec_smem.slice(6 * _BH, _BH).store(gl.full([_BH], last.to(gl.float32), gl.float32,
                                                    row_l))  # fmt: skip
        _sync_warp_group()
        mbarrier.arrive(k_ready.index(_TICKET))
        if last:
            # Every split has arrived: reset the counter for the next launch.
            gl.atomic_xchg(COUNTER + pid, 0, sem="relaxed", scope="gpu")
            t64 = (pid // NUM_HEAD_TILES).to(gl.int64)
            head0 = ((pid % NUM_HEAD_TILES) * _BH).to(gl.int64)
            _merge_half(o0, o1, o2, o3, l_i, OUT, out_row - split * stride_os, stride_oh,
                        stride_os, LSE, lse_row - split * stride_ls, stride_lh, stride_ls,
                        split, num_splits, FOUT, (t64 * H + head0) * (_LAT * _BC), 0, FLSE,
                        t64 * H + head0, True, OWN_REGS, mma)  # fmt: skip

    @gluon.jit
    def _wg1_fused(o0, o1, o2, o3, l_i, vec_smem, k_ready, OUT, out_row, stride_oh, stride_os, LSE,
                   lse_row, stride_lh, stride_ls, num_splits, FOUT, HALF_COL: gl.constexpr,
                   H: gl.constexpr, NUM_HEAD_TILES: gl.constexpr, OWN_REGS: gl.constexpr,
                   mma: gl.constexpr):  # fmt: skip
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        # Tell warp group 0 this half is stored, then learn whether this program is the
        # last of its row (warp group 0 takes the ticket) and if so merge this half.
        _sync_warp_group()
        mbarrier.arrive(k_ready.index(_HALF_STORED))
        mbarrier.wait(k_ready.index(_TICKET), 0)
        last = gl.max(vec_smem.slice(6 * _BH, _BH).load(row_l), 0)
        if last > 0.0:
            pid = gl.program_id(0)
            split = gl.program_id(1)
            t64 = (pid // NUM_HEAD_TILES).to(gl.int64)
            head0 = ((pid % NUM_HEAD_TILES) * _BH).to(gl.int64)
            _merge_half(o0, o1, o2, o3, l_i, OUT, out_row - split * stride_os, stride_oh,
                        stride_os, LSE, lse_row - split * stride_ls, stride_lh, stride_ls,
                        split, num_splits, FOUT, (t64 * H + head0) * (_LAT * _BC), HALF_COL,
                        LSE, 0, False, OWN_REGS, mma)  # fmt: skip

    @gluon.jit
    def _merge_split(s, o0, o1, o2, o3, total, m, lse_ptr, stride_ls, base, stride_os):
        # Adds split s (its fp32 partial and base-2 LSE, read from L2: other SMs wrote them).
        w = gl.exp2(gl.load(lse_ptr + s * stride_ls, cache_modifier=".cg") - m)
        src = base + s * stride_os
        o0 += w[:, None] * gl.load(src, cache_modifier=".cg")
        o1 += w[:, None] * gl.load(src + _BC, cache_modifier=".cg")
        o2 += w[:, None] * gl.load(src + 2 * _BC, cache_modifier=".cg")
        o3 += w[:, None] * gl.load(src + 3 * _BC, cache_modifier=".cg")
        return o0, o1, o2, o3, total + w

    @gluon.jit
    def _merge_half(o0, o1, o2, o3, l_i, PO, po_row, stride_oh, stride_os, PL, pl_row, stride_lh,
                    stride_ls, split, num_splits, FOUT, fout_row, col0: gl.constexpr, FLSE,
                    flse_row, WRITE_LSE: gl.constexpr, OWN_REGS: gl.constexpr,
                    mma: gl.constexpr):  # fmt: skip
        # The last program of a (query, head tile) merges every split into the result, for one
        # column half (po_row / pl_row: split 0's row of the partials), with the weights of
        # merge_splits_triton. OWN_REGS: its own split from its registers (o = unnormalised
        # sums, l_i = row sums) added first; the sum's order then depends on which split came
        # last. Else every split's partial is read back in split order: the same bits whichever
        # program merges.
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        heads = gl.arange(0, _BH, layout=row_l)
        lse_ptr = PL + pl_row + heads.to(gl.int64) * stride_lh
        m = gl.full([_BH], float("-inf"), gl.float32, row_l)
        for s in range(num_splits):
            m = gl.maximum(m, gl.load(lse_ptr + s * stride_ls, cache_modifier=".cg"))
        m = gl.where(m == float("-inf"), 0.0, m)
        cols = gl.arange(0, _BC, layout=gl.SliceLayout(0, mma))
        base = PO + po_row + heads.to(gl.int64)[:, None] * stride_oh + col0 + cols[None, :]
        if OWN_REGS:
            total = gl.exp2(gl.load(lse_ptr + split * stride_ls, cache_modifier=".cg") - m)
            own = total / gl.where(l_i > 0.0, l_i, 1.0)
            o0 = o0 * own[:, None]
            o1 = o1 * own[:, None]
            o2 = o2 * own[:, None]
            o3 = o3 * own[:, None]
            for s in range(num_splits):
                if s != split:
                    o0, o1, o2, o3, total = _merge_split(s, o0, o1, o2, o3, total, m, lse_ptr,
                                                         stride_ls, base, stride_os)  # fmt: skip
        else:
            total = gl.zeros([_BH], gl.float32, row_l)
            o0 = gl.zeros([_BH, _BC], gl.float32, mma)
            o1 = gl.zeros([_BH, _BC], gl.float32, mma)
            o2 = gl.zeros([_BH, _BC], gl.float32, mma)
            o3 = gl.zeros([_BH, _BC], gl.float32, mma)
            for s in range(num_splits):
                o0, o1, o2, o3, total = _merge_split(s, o0, o1, o2, o3, total, m, lse_ptr,
                                                     stride_ls, base, stride_os)  # fmt: skip
        nonempty = total > 0.0
        inv = 1.0 / gl.where(nonempty, total, 1.0)
        dst = FOUT + fout_row + heads.to(gl.int64)[:, None] * (_LAT * _BC) + col0 + cols[None, :]
        dt = FOUT.dtype.element_ty
        gl.store(dst, (o0 * inv[:, None]).to(dt))
        gl.store(dst + _BC, (o1 * inv[:, None]).to(dt))
        gl.store(dst + 2 * _BC, (o2 * inv[:, None]).to(dt))
        gl.store(dst + 3 * _BC, (o3 * inv[:, None]).to(dt))
        if WRITE_LSE:
            lse2 = gl.where(nonempty, m + gl.log2(gl.where(nonempty, total, 1.0)), float("-inf"))
            gl.store(FLSE + flse_row + heads, lse2 * 0.6931471805599453)
