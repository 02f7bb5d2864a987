"""Two copy schedules of the Gluon MLA decode kernel (:mod:`cp_modules.kernels.decode.mla_gluon`),
both variants built to be timed against FlashMLA (docs/experiments/2026-12-02-peers.md):

- ``issue="wg"``: no producer; each compute warp group copies the next tile's parts that it
  used last, right after its product on them (``_refill``, called by
  :mod:`~cp_modules.kernels.decode.mla_gluon_wg`);
- ``half_copies`` (``HALVES``): a 256-column latent half of a tile lands as one copy of a
  rank-3 view of the cache ([piece, row, column]) on one barrier, so a 64-token tile takes 3
  copies and 3 barrier waits instead of 9 (the producer warp: ``_mla_loader_halves``; with
  ``producer_zeroing`` it zeroes the rows past the range a half at a time).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
    )

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__: list[str] = []

if HAS_GLUON:
    from cp_modules.kernels.decode.mla_gluon_parts import (
        _BC,
        _BN,
        _FREE_ROPE,
        _LANDED,
        _LAT,
        _issue_q,
        _issue_rows,
        _mla_loader,
        _sync_warp_group,
        _tile_rows,
    )

    @gluon.jit
    def _refill(c_desc, k_lat, k_pe, k_ready, buf: gl.constexpr, rows, BOX_ROWS: gl.constexpr,
                c_lo: gl.constexpr, c_hi: gl.constexpr, more, h_desc=None,
                HALVES: gl.constexpr = False):  # fmt: skip
        # ISSUE = wg: pieces [c_lo, c_hi) of buffer ``buf`` (rows: the next tile's box rows)
        # copied by the warp group that used them last, once its product on them is done;
        # ``more``: that tile exists (the split has a next pair). No free barrier: each part
        # has one last user, ordered after every other use by the P hand-offs. HALVES: a
        # latent half as one copy (_issue_half).
        if more:
            if HALVES and c_lo < _LAT:
                _issue_half(c_desc, h_desc, k_lat, k_ready, buf, rows, BOX_ROWS, c_lo)
            else:
                _issue_rows(c_desc, k_lat, k_pe, k_ready, buf, rows, BOX_ROWS, c_lo, c_hi)

    @gluon.jit
    def _issue_half(c_desc, h_desc, k_lat, k_ready, buf: gl.constexpr, rows,
                    BOX_ROWS: gl.constexpr, first: gl.constexpr, LANDED=False):  # fmt: skip
        # HALVES: latent pieces [first, first + 4) of one tile on piece first's barrier (LANDED:
        # on its _LANDED barrier, for PZERO's zeroing): one copy of [4, 64, 64] of the cache
        # viewed as [piece, row, column] for a 64-row box; for smaller boxes (pages under 64
        # tokens) a box of each piece (a box's 4 pieces are not contiguous in shared memory).
        # The pieces as one rank-3 view: the same bytes and 128-byte swizzle as their tiles.
        h_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                      element_bitwidth=16, rank=3)  # fmt: skip
        bar = k_ready.index(buf * 16 + first)
        if LANDED:
            bar = k_ready.index(_LANDED + buf * _LAT + first)
        mbarrier.expect(bar, (_LAT // 2) * _BN * _BC * 2)
        if BOX_ROWS < _BN:  # (h_desc is then None)
            for c in gl.static_range(first, first + _LAT // 2):
                for g in gl.static_range(_BN // BOX_ROWS):
                    dst = k_lat.index(buf * _LAT + c).slice(g * BOX_ROWS, BOX_ROWS, dim=0)
                    tma.async_copy_global_to_shared(c_desc, [rows[g], c * _BC], bar, dst)
        else:
            halves = k_lat._reinterpret(k_lat.dtype, [2 * _LAT, _BN, _BC], h_layout)
            dst = halves.slice(buf * _LAT + first, _LAT // 2, dim=0)
            tma.async_copy_global_to_shared(h_desc, [first, rows[0], 0], bar, dst)

    @gluon.jit
    def _issue_tile_halves(c_desc, h_desc, k_lat, k_pe, k_ready, k_free, buf: gl.constexpr,
                           rows, BOX_ROWS: gl.constexpr, phase, WAIT: gl.constexpr, valid=_BN,
                           PZERO: gl.constexpr = False):  # fmt: skip
        # HALVES, one producer: a tile's rope piece, then its two latent halves in the order
        # _scores takes them, each (WAIT) once its free barrier says the last tile is done.
        # PZERO: a tile with only ``valid`` < 64 rows in the range lands its halves on their
        # _LANDED barriers (_zero_tail_halves completes them).
        if WAIT:
            mbarrier.wait(k_free.index(buf * 16 + _FREE_ROPE), phase)
        _issue_rows(c_desc, k_lat, k_pe, k_ready, buf, rows, BOX_ROWS, _LAT, _LAT + 1)
        first: gl.constexpr = buf * (_LAT // 2)
        for h in gl.static_range(2):
            # (first + 4 h) mod 8: buffer 0's halves [0, 256) then [256, 512), buffer 1's the
            # other way round
            if WAIT:
                mbarrier.wait(k_free.index(buf * 16 + (first + h * (_LAT // 2)) % _LAT), phase)
            _issue_half(c_desc, h_desc, k_lat, k_ready, buf, rows, BOX_ROWS,
                        (first + h * (_LAT // 2)) % _LAT, PZERO and valid < _BN)  # fmt: skip

    @gluon.jit
    def _zero_tail_halves(k_lat, k_ready, valid_a):
        # PZERO with HALVES: as _zero_tail_pieces, for the pair's tiles that reach past the
        # range (tile A: ``valid_a`` rows in it, tile B 64 fewer), a half at a time.
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        groups = k_lat._reinterpret(k_lat.dtype, [2 * _LAT * (_BN // 8), 8, _BC], k_lat.layout)
        r = gl.arange(0, 8, layout=gl.SliceLayout(1, lay))
        for buf in gl.static_range(2):
            valid = valid_a - buf * _BN
            if valid < _BN:
                first_g = gl.maximum(valid, 0) // 8
                for h in gl.static_range(2):
                    mbarrier.wait(k_ready.index(_LANDED + buf * _LAT + h * (_LAT // 2)), 0)
                    for c in range(h * (_LAT // 2), (h + 1) * (_LAT // 2)):
                        for g in range(first_g, _BN // 8):
                            rows8 = groups.index((buf * _LAT + c) * (_BN // 8) + g)
                            x = rows8.load(lay)
                            rows8.store(gl.where((g * 8 + r < valid)[:, None], x,
                                                 gl.zeros_like(x)))  # fmt: skip
                fence_async_shared()
                _sync_warp_group()
                mbarrier.arrive(k_ready.index(buf * 16))
                mbarrier.arrive(k_ready.index(buf * 16 + _LAT // 2))


    @gluon.jit
    def _mla_loader_halves(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end,
                           n_pairs, q_desc, c_desc, h_desc, BT, bt_row, q_row,
                           PAGE: gl.constexpr, BOX_ROWS: gl.constexpr,
                           PZERO: gl.constexpr = False):  # fmt: skip
        # The producer warp with HALVES (early release): Q, then tile 2k + 2's parts into
        # buffer 0 as tile 2k's are freed and tile 2k + 3's into buffer 1 (_issue_tile_halves);
        # PZERO: a pair reaching past the range is zeroed past it once both tiles are issued.
        _issue_q(q_desc, q_lat, q_pe, q_bar, q_row)
        last_page = gl.maximum(end - 1, 0) // PAGE
        if n_pairs > 0:
            rows = _tile_rows(BT, bt_row, start, last_page, PAGE, BOX_ROWS)
            _issue_tile_halves(c_desc, h_desc, k_lat, k_pe, k_ready, k_free, 0, rows, BOX_ROWS,
                               0, False, end - start, PZERO)  # fmt: skip
            rows = _tile_rows(BT, bt_row, start + _BN, last_page, PAGE, BOX_ROWS)
            _issue_tile_halves(c_desc, h_desc, k_lat, k_pe, k_ready, k_free, 1, rows, BOX_ROWS,
                               0, False, end - start - _BN, PZERO)  # fmt: skip
            if PZERO:
                _zero_tail_halves(k_lat, k_ready, end - start)
        for k in range(1, n_pairs):
            n0 = start + 2 * k * _BN
            rows_a = _tile_rows(BT, bt_row, n0, last_page, PAGE, BOX_ROWS)
            rows_b = _tile_rows(BT, bt_row, n0 + _BN, last_page, PAGE, BOX_ROWS)
            _issue_tile_halves(c_desc, h_desc, k_lat, k_pe, k_ready, k_free, 0, rows_a,
                               BOX_ROWS, (k - 1) & 1, True, end - n0, PZERO)  # fmt: skip
            _issue_tile_halves(c_desc, h_desc, k_lat, k_pe, k_ready, k_free, 1, rows_b,
                               BOX_ROWS, (k - 1) & 1, True, end - n0 - _BN, PZERO)  # fmt: skip
            if PZERO:
                _zero_tail_halves(k_lat, k_ready, end - n0)

    @gluon.jit
    def _mla_producer(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end, n_pairs,
                      q_desc, c_desc, BT, bt_row, q_row, PAGE: gl.constexpr,
                      BOX_ROWS: gl.constexpr, PART: gl.constexpr, PARTS: gl.constexpr,
                      EARLY: gl.constexpr, CACHE, ASYNC: gl.constexpr, PZERO: gl.constexpr,
                      SP_REFILL: gl.constexpr, h_desc, HALVES: gl.constexpr):  # fmt: skip
        # The producer warps' partition: with HALVES, _mla_loader_halves; else _mla_loader.
        if HALVES:
            _mla_loader_halves(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end,
                               n_pairs, q_desc, c_desc, h_desc, BT, bt_row, q_row, PAGE,
                               BOX_ROWS, PZERO)  # fmt: skip
        else:
            _mla_loader(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end, n_pairs,
                        q_desc, c_desc, BT, bt_row, q_row, PAGE, BOX_ROWS, PART, PARTS, EARLY,
                        CACHE, ASYNC, PZERO, SP_REFILL)  # fmt: skip
