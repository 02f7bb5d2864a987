"""Parts of the Gluon MLA decode kernel (:mod:`cp_modules.kernels.decode.mla_gluon`):
the kernel's tile constants; the score and P @ V products of a tile; how Q and each 64-token
latent tile reach shared memory (TMA copies of 64 columns, one per page and piece; the block
ids looked up next to each copy, a tile's ids looked up first, or one or two producer warps
that issue the copies: the kernel's ISSUE; with EARLY, a buffer's parts refilled as each is
freed). The epilogues (the partial stores and the in-kernel merges) are in
:mod:`cp_modules.kernels.decode.mla_gluon_epilogue`.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__: list[str] = []

if HAS_GLUON:
    _BH = gl.constexpr(64)
    _BN = gl.constexpr(64)
    _BC = gl.constexpr(64)
    # Triton 3.6 names the partition-wide barrier thread_barrier, later releases barrier.
    _sync_warp_group = getattr(gl, "thread_barrier", None) or gl.barrier
    _LAT = gl.constexpr(8)  # latent pieces: R = 512; the rope piece (P = 64) is the ninth
    # Who issues the tile copies (the kernel's ISSUE): warp group 0 looking each block id up
    # next to its copy, warp group 0 looking a tile's ids up first, or a producer warp.
    _ISSUE_INLINE = gl.constexpr(0)
    _ISSUE_HOIST = gl.constexpr(1)
    _ISSUE_LOADER = gl.constexpr(2)
    # 3: two producer warps, each issuing its share of every tile (loader2).
    # 4: a producer warp group copying the tiles row by row (cp.async, 16 bytes a thread).
    _ISSUE_ASYNC = gl.constexpr(4)
    # 5: no producer: each compute warp group refills the parts of a buffer it uses last,
    # right after its product on them completes (wg; FlashMLA's copies).
    _ISSUE_WG = gl.constexpr(5)
    _ASYNC_WARPS = gl.constexpr(4)  # its producer warp group; piece barriers count 128
    _ROW = gl.constexpr((_LAT + 1) * _BC)  # elements of one cache row: latent and rope
    # With producer zeroing (PZERO), the latent pieces of a tile that reaches past the range
    # land on barrier _LANDED + buf * _LAT + c of k_ready; the producer zeroes the rows past
    # the range and then completes the piece's own barrier (buf * 16 + c) itself.
    _LANDED = gl.constexpr(32)

    @gluon.jit
    def _zero_rows_past(bufs, first: gl.constexpr, count: gl.constexpr, valid):
        # Rows >= valid of pieces [first, first + count) become 0 (generic-proxy stores, then
        # a fence so that the warp group's next wgmma sees them).
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, blk))
        keep = (rows < valid)[:, None]
        for c in gl.static_range(count):
            x = bufs.index(first + c).load(blk)
            bufs.index(first + c).store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()
        _sync_warp_group()

    @gluon.jit
    def _stamp(TRACE_BUF, slot: gl.constexpr, num_splits, TRACE: gl.constexpr):
        # With TRACE, the global timer (ns) into the program's trace slot: 0 / 1 warp group 0
        # before / after Q landed, 2 its last pair done, 3 its half and the LSE stored; 4 / 5
        # warp group 1's last pair done / its half stored; 6 the SM.
        if TRACE:
            pid = gl.program_id(0)
            base = TRACE_BUF + (pid * num_splits + gl.program_id(1)).to(gl.int64) * 8
            now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid],
                                            dtype=gl.int64, is_pure=False, pack=1)  # fmt: skip
            gl.store(base + slot, now)
            if slot == 0:
                sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid],
                                               dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
                gl.store(base + 6, sm.to(gl.int64))

    @gluon.jit
    def _scores(q_lat, q_pe, k_lat, k_pe, k_ready, buf: gl.constexpr, phase, mma: gl.constexpr,
                EARLY: gl.constexpr = False, HALVES: gl.constexpr = False):  # fmt: skip
        # S = Q K^T over the 8 latent pieces and the rope piece, each as soon as it lands.
        # A runtime loop: the shared-memory descriptors of the pieces are computed per piece
        # instead of being hoisted out of the tile loop (18 of them do not fit in registers).
        # EARLY: in the order the producer refills them (_mla_loader_early): the rope piece,
        # then the latent half freed first (buffer 0: [0, 256), buffer 1: [256, 512)).
        # HALVES: a latent half lands as one copy on its first piece's barrier.
        s = gl.zeros([_BH, _BN], gl.float32, mma)
        if EARLY:
            mbarrier.wait(k_ready.index(buf * 16 + _LAT), phase)
            s = warpgroup_mma(q_pe, k_pe.index(buf).permute((1, 0)), s, use_acc=False,
                              is_async=True)  # fmt: skip
            for i in range(_LAT):
                c = (i + buf * (_LAT // 2)) % _LAT
                if HALVES:
                    if c % (_LAT // 2) == 0:
                        mbarrier.wait(k_ready.index(buf * 16 + c), phase)
                else:
                    mbarrier.wait(k_ready.index(buf * 16 + c), phase)
                s = warpgroup_mma(q_lat.index(c), k_lat.index(buf * _LAT + c).permute((1, 0)),
                                  s, is_async=True)  # fmt: skip
        else:
            mbarrier.wait(k_ready.index(buf * 16), phase)
            s = warpgroup_mma(q_lat.index(0), k_lat.index(buf * _LAT).permute((1, 0)), s,
                              use_acc=False, is_async=True)  # fmt: skip
            for c in range(1, _LAT):
                mbarrier.wait(k_ready.index(buf * 16 + c), phase)
                s = warpgroup_mma(q_lat.index(c), k_lat.index(buf * _LAT + c).permute((1, 0)),
                                  s, is_async=True)  # fmt: skip
            mbarrier.wait(k_ready.index(buf * 16 + _LAT), phase)
            s = warpgroup_mma(q_pe, k_pe.index(buf).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _pv4(p, k_smem, first: gl.constexpr, o0, o1, o2, o3):
        o0 = warpgroup_mma(p, k_smem.index(first), o0, is_async=True)
        o1 = warpgroup_mma(p, k_smem.index(first + 1), o1, is_async=True)
        o2 = warpgroup_mma(p, k_smem.index(first + 2), o2, is_async=True)
        o3 = warpgroup_mma(p, k_smem.index(first + 3), o3, is_async=True)
        return o0, o1, o2, o3

    # EARLY release (``GluonMLAConfig.early_release``): a buffer is freed in parts, each by
    # the one warp group that uses it last, so that its refill starts as soon as each is done:
    # the rope piece after the tile's scores, each latent half after its P @ V. Free barrier
    # buf * 16 + slot: slot 8 the rope piece, 0 / 4 the halves [0, 256) (warp group 0's) and
    # [256, 512).
    _FREE_ROPE = gl.constexpr(_LAT)
    _FREE_LO = gl.constexpr(0)
    _FREE_HI = gl.constexpr(_LAT // 2)

    @gluon.jit
    def _release_pv(o0, o1, o2, o3, k_free, slot: gl.constexpr):
        # Wait for a latent half's P @ V (its 4 products) and free that half.
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        mbarrier.arrive(k_free.index(slot))
        return o0, o1, o2, o3

    @gluon.jit
    def _issue_tile_early(c_desc, k_lat, k_pe, k_ready, k_free, buf: gl.constexpr, rows,
                          BOX_ROWS: gl.constexpr, phase, WAIT: gl.constexpr, PART: gl.constexpr,
                          PARTS: gl.constexpr, valid=_BN, PZERO: gl.constexpr = False):  # fmt: skip
        # A tile's pieces that producer PART of PARTS owns (the rope piece: the first one;
        # latent piece c: producer (c % 4) * PARTS // 4), in the order its scores take them
        # (_scores with EARLY). WAIT: each once its part's free barrier says the previous tile
        # is done with it (a half's barrier before the producer's first piece in that half).
        # PZERO: when only ``valid`` < 64 of the tile's rows lie in the range, its latent
        # pieces land on their _LANDED barriers (_zero_tail_pieces completes them).
        if PART == 0:
            if WAIT:
                mbarrier.wait(k_free.index(buf * 16 + _FREE_ROPE), phase)
            _issue_rows(c_desc, k_lat, k_pe, k_ready, buf, rows, BOX_ROWS, _LAT, _LAT + 1)
        first: gl.constexpr = buf * (_LAT // 2)
        second: gl.constexpr = _LAT // 2 - first
        for c in gl.static_range(first, first + _LAT // 2):
            _issue_piece_early(c_desc, k_lat, k_pe, k_ready, k_free, buf, rows, BOX_ROWS, phase,
                               WAIT, PART, PARTS, c, valid, PZERO)  # fmt: skip
        for c in gl.static_range(second, second + _LAT // 2):
            _issue_piece_early(c_desc, k_lat, k_pe, k_ready, k_free, buf, rows, BOX_ROWS, phase,
                               WAIT, PART, PARTS, c, valid, PZERO)  # fmt: skip

    @gluon.jit
    def _issue_piece_early(c_desc, k_lat, k_pe, k_ready, k_free, buf: gl.constexpr, rows,
                           BOX_ROWS: gl.constexpr, phase, WAIT: gl.constexpr,
                           PART: gl.constexpr, PARTS: gl.constexpr, c: gl.constexpr,
                           valid=_BN, PZERO: gl.constexpr = False):  # fmt: skip
        if (c % 4) * PARTS // 4 == PART:
            if WAIT:
                if c % 4 == PART * 4 // PARTS:
                    mbarrier.wait(k_free.index(buf * 16 + c - c % 4), phase)
            if PZERO:
                if valid < _BN:
                    _issue_rows(c_desc, k_lat, k_pe, k_ready, buf, rows, BOX_ROWS, c, c + 1,
                                True)  # fmt: skip
                else:
                    _issue_rows(c_desc, k_lat, k_pe, k_ready, buf, rows, BOX_ROWS, c, c + 1)
            else:
                _issue_rows(c_desc, k_lat, k_pe, k_ready, buf, rows, BOX_ROWS, c, c + 1)

    @gluon.jit
    def _zero_tail_pieces(k_lat, k_ready, buf: gl.constexpr, valid, PART: gl.constexpr,
                          PARTS: gl.constexpr):  # fmt: skip
        # PZERO, for a tile with only ``valid`` < 64 rows in the range: once each latent piece
        # this producer owns has landed, its rows >= valid become 0 (unwritten cache slots may
        # hold NaN, and P = 0 does not cancel NaN in P @ V), 8 rows at a time by generic-proxy
        # stores; then a proxy fence, and the piece's own barrier completes, so the consumers
        # never branch on the range. The rope piece only meets the scores, whose columns past
        # the range are masked. Runtime loops: this runs once a split at most.
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        # The pieces as 8-row groups (one 128-byte swizzle atom each: 1 KB, contiguous).
        groups = k_lat._reinterpret(k_lat.dtype, [2 * _LAT * (_BN // 8), 8, _BC], k_lat.layout)
        first_g = gl.maximum(valid, 0) // 8
        r = gl.arange(0, 8, layout=gl.SliceLayout(1, lay))
        for i in range(_LAT // PARTS):
            c = _owned_piece(i, PART, PARTS)
            mbarrier.wait(k_ready.index(_LANDED + buf * _LAT + c), 0)
            for g in range(first_g, _BN // 8):
                rows8 = groups.index((buf * _LAT + c) * (_BN // 8) + g)
                x = rows8.load(lay)
                rows8.store(gl.where((g * 8 + r < valid)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
        _sync_warp_group()
        for i in range(_LAT // PARTS):
            mbarrier.arrive(k_ready.index(buf * 16 + _owned_piece(i, PART, PARTS)))

    @gluon.jit
    def _owned_piece(i, PART: gl.constexpr, PARTS: gl.constexpr):
        # The i-th latent piece that producer PART of PARTS owns under _issue_piece_early's
        # rule ((c % 4) * PARTS // 4 == PART): all 8 for one producer; for two,
        # {0, 1, 4, 5} and {2, 3, 6, 7}.
        per: gl.constexpr = 4 // PARTS
        return (i // per) * 4 + PART * per + i % per

    @gluon.jit
    def _issue_pair_sp(c_desc, k_lat, k_pe, k_ready, k_free, rows_a, rows_b,
                       BOX_ROWS: gl.constexpr, phase, PART: gl.constexpr, PARTS: gl.constexpr,
                       valid_a, PZERO: gl.constexpr):  # fmt: skip
        # A pair's parts in the order the scale_p schedule frees them: A's rope, B's rope,
        # A's half [0, 256), B's [256, 512), A's [256, 512), B's [0, 256).
        if PART == 0:
            mbarrier.wait(k_free.index(_FREE_ROPE), phase)
            _issue_rows(c_desc, k_lat, k_pe, k_ready, 0, rows_a, BOX_ROWS, _LAT, _LAT + 1)
            mbarrier.wait(k_free.index(16 + _FREE_ROPE), phase)
            _issue_rows(c_desc, k_lat, k_pe, k_ready, 1, rows_b, BOX_ROWS, _LAT, _LAT + 1)
        for c in gl.static_range(0, _LAT // 2):
            _issue_piece_early(c_desc, k_lat, k_pe, k_ready, k_free, 0, rows_a, BOX_ROWS, phase,
                               True, PART, PARTS, c, valid_a, PZERO)  # fmt: skip
        for c in gl.static_range(_LAT // 2, _LAT):
            _issue_piece_early(c_desc, k_lat, k_pe, k_ready, k_free, 1, rows_b, BOX_ROWS, phase,
                               True, PART, PARTS, c, valid_a - _BN, PZERO)  # fmt: skip
        for c in gl.static_range(_LAT // 2, _LAT):
            _issue_piece_early(c_desc, k_lat, k_pe, k_ready, k_free, 0, rows_a, BOX_ROWS, phase,
                               True, PART, PARTS, c, valid_a, PZERO)  # fmt: skip
        for c in gl.static_range(0, _LAT // 2):
            _issue_piece_early(c_desc, k_lat, k_pe, k_ready, k_free, 1, rows_b, BOX_ROWS, phase,
                               True, PART, PARTS, c, valid_a - _BN, PZERO)  # fmt: skip

    @gluon.jit
    def _mla_loader_early(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end, n_pairs,
                          q_desc, c_desc, BT, bt_row, q_row, PAGE: gl.constexpr,
                          BOX_ROWS: gl.constexpr, PART: gl.constexpr = 0,
                          PARTS: gl.constexpr = 1, PZERO: gl.constexpr = False,
                          SP_REFILL: gl.constexpr = False):  # fmt: skip
        # _mla_loader with EARLY release: tile 2k + 2's parts go into buffer 0 as tile 2k's
        # are freed, then tile 2k + 3's into buffer 1 (SP_REFILL: the two tiles' parts in the
        # order scale_p frees them, _issue_pair_sp). PZERO: a tile reaching past the range
        # (only the last pair's) is zeroed past it once both tiles of its pair are issued.
        if PART == 0:
            _issue_q(q_desc, q_lat, q_pe, q_bar, q_row)
        last_page = gl.maximum(end - 1, 0) // PAGE
        if n_pairs > 0:
            rows = _tile_rows(BT, bt_row, start, last_page, PAGE, BOX_ROWS)
            _issue_tile_early(c_desc, k_lat, k_pe, k_ready, k_free, 0, rows, BOX_ROWS, 0, False,
                              PART, PARTS, end - start, PZERO)  # fmt: skip
            rows = _tile_rows(BT, bt_row, start + _BN, last_page, PAGE, BOX_ROWS)
            _issue_tile_early(c_desc, k_lat, k_pe, k_ready, k_free, 1, rows, BOX_ROWS, 0, False,
                              PART, PARTS, end - start - _BN, PZERO)  # fmt: skip
            if PZERO:
                _zero_tail_pair(k_lat, k_ready, end - start, PART, PARTS)
        for k in range(1, n_pairs):
            n0 = start + 2 * k * _BN
            phase = (k - 1) & 1
            rows_a = _tile_rows(BT, bt_row, n0, last_page, PAGE, BOX_ROWS)
            rows_b = _tile_rows(BT, bt_row, n0 + _BN, last_page, PAGE, BOX_ROWS)
            if SP_REFILL:
                _issue_pair_sp(c_desc, k_lat, k_pe, k_ready, k_free, rows_a, rows_b, BOX_ROWS,
                               phase, PART, PARTS, end - n0, PZERO)  # fmt: skip
            else:
                _issue_tile_early(c_desc, k_lat, k_pe, k_ready, k_free, 0, rows_a, BOX_ROWS,
                                  phase, True, PART, PARTS, end - n0, PZERO)  # fmt: skip
                _issue_tile_early(c_desc, k_lat, k_pe, k_ready, k_free, 1, rows_b, BOX_ROWS,
                                  phase, True, PART, PARTS, end - n0 - _BN, PZERO)  # fmt: skip
            if PZERO:
                _zero_tail_pair(k_lat, k_ready, end - n0, PART, PARTS)

    @gluon.jit
    def _zero_tail_pair(k_lat, k_ready, valid_a, PART: gl.constexpr, PARTS: gl.constexpr):
        # PZERO: the pair's tiles A (``valid_a`` rows in the range) and B (64 fewer) that
        # reach past the range (_zero_tail_pieces).
        if valid_a < _BN:
            _zero_tail_pieces(k_lat, k_ready, 0, valid_a, PART, PARTS)
        if valid_a - _BN < _BN:
            _zero_tail_pieces(k_lat, k_ready, 1, valid_a - _BN, PART, PARTS)

    @gluon.jit
    def _mla_loader(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end, n_pairs, q_desc,
                    c_desc, BT, bt_row, q_row, PAGE: gl.constexpr, BOX_ROWS: gl.constexpr,
                    PART: gl.constexpr = 0, PARTS: gl.constexpr = 1,
                    EARLY: gl.constexpr = False, CACHE=None,
                    ASYNC: gl.constexpr = False, PZERO: gl.constexpr = False,
                    SP_REFILL: gl.constexpr = False):  # fmt: skip
        # A producer warp (ISSUE = loader): Q, then every tile as soon as its buffer is free
        # (both warp groups done with it: k_free counts two arrivals). The block ids of a tile
        # are looked up before waiting for its buffer. With PARTS producers (loader2), producer
        # PART issues its share of each tile's pieces and the first one issues Q. EARLY: each
        # part of a buffer as soon as it is free (_mla_loader_early). ASYNC: the producer warp
        # group of ISSUE = cpasync (_mla_loader_async: cp.async copies from CACHE).
        if ASYNC:
            _mla_loader_async(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end,
                              n_pairs, q_desc, CACHE, BT, bt_row, q_row, PAGE)  # fmt: skip
        elif EARLY:
            _mla_loader_early(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end,
                              n_pairs, q_desc, c_desc, BT, bt_row, q_row, PAGE, BOX_ROWS, PART,
                              PARTS, PZERO, SP_REFILL)  # fmt: skip
        else:
            _mla_loader_tiles(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end,
                              n_pairs, q_desc, c_desc, BT, bt_row, q_row, PAGE, BOX_ROWS, PART,
                              PARTS)  # fmt: skip

    @gluon.jit
    def _mla_loader_tiles(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end, n_pairs,
                          q_desc, c_desc, BT, bt_row, q_row, PAGE: gl.constexpr,
                          BOX_ROWS: gl.constexpr, PART: gl.constexpr, PARTS: gl.constexpr):  # fmt: skip
        # Whole tiles: a buffer's copies once both warp groups are done with it.
        per: gl.constexpr = (_LAT + 1 + PARTS - 1) // PARTS
        c_lo: gl.constexpr = PART * per
        c_hi: gl.constexpr = min(c_lo + per, _LAT + 1)
        if PART == 0:
            _issue_q(q_desc, q_lat, q_pe, q_bar, q_row)
        last_page = gl.maximum(end - 1, 0) // PAGE
        if n_pairs > 0:
            rows = _tile_rows(BT, bt_row, start, last_page, PAGE, BOX_ROWS)
            _issue_rows(c_desc, k_lat, k_pe, k_ready, 0, rows, BOX_ROWS, c_lo, c_hi)
            rows = _tile_rows(BT, bt_row, start + _BN, last_page, PAGE, BOX_ROWS)
            _issue_rows(c_desc, k_lat, k_pe, k_ready, 1, rows, BOX_ROWS, c_lo, c_hi)
        for k in range(1, n_pairs):
            n0 = start + 2 * k * _BN
            phase = (k - 1) & 1
            rows_a = _tile_rows(BT, bt_row, n0, last_page, PAGE, BOX_ROWS)
            rows_b = _tile_rows(BT, bt_row, n0 + _BN, last_page, PAGE, BOX_ROWS)
            mbarrier.wait(k_free.index(0), phase)
            _issue_rows(c_desc, k_lat, k_pe, k_ready, 0, rows_a, BOX_ROWS, c_lo, c_hi)
            mbarrier.wait(k_free.index(1), phase)
            _issue_rows(c_desc, k_lat, k_pe, k_ready, 1, rows_b, BOX_ROWS, c_lo, c_hi)

    # ISSUE = cpasync: the tiles reach shared memory through cp.async, each of the producer
    # warp group's 128 threads copying 16 bytes of 4 rows per piece. A tile is then 9 copy
    # instructions a thread whatever the block size (TMA takes one copy per page and piece:
    # 36 a tile at block size 16). Each thread arrives on a piece's barrier once its copies
    # have landed (cp.async.mbarrier.arrive.noinc; the barriers count 128 arrivals).
    @gluon.jit
    def _async_row_offsets(BT, bt_row, n0, last_page, PAGE: gl.constexpr, lay: gl.constexpr):
        # Where each of a tile's 64 rows starts in the cache (elements); rows past the range
        # read the last real page, as the TMA copies do.
        tok = n0 + gl.arange(0, _BN, layout=gl.SliceLayout(1, lay))
        page = gl.minimum(tok // PAGE, last_page)
        blk = gl.load(BT + bt_row + page).to(gl.int64)
        return (blk * PAGE + tok % PAGE) * _ROW

    @gluon.jit
    def _async_piece(CACHE, offs, k_lat, k_pe, k_ready, buf: gl.constexpr, c: gl.constexpr,
                     lay: gl.constexpr):  # fmt: skip
        cols = gl.arange(0, _BC, layout=gl.SliceLayout(0, lay))
        src = CACHE + offs[:, None] + (c * _BC + cols)[None, :]
        if c < _LAT:
            async_copy.async_copy_global_to_shared(k_lat.index(buf * _LAT + c), src)
        else:
            async_copy.async_copy_global_to_shared(k_pe.index(buf), src)
        async_copy.mbarrier_arrive(k_ready.index(buf * 16 + c), increment_count=False)

    @gluon.jit
    def _async_tile_early(CACHE, BT, bt_row, n0, last_page, k_lat, k_pe, k_ready, k_free,
                          buf: gl.constexpr, phase, WAIT: gl.constexpr, PAGE: gl.constexpr,
                          lay: gl.constexpr):  # fmt: skip
        # One tile in the order of _issue_tile_early (rope piece, then the half freed first),
        # each part once its free barrier says the previous tile is done with it (WAIT).
        offs = _async_row_offsets(BT, bt_row, n0, last_page, PAGE, lay)
        if WAIT:
            mbarrier.wait(k_free.index(buf * 16 + _FREE_ROPE), phase)
        _async_piece(CACHE, offs, k_lat, k_pe, k_ready, buf, _LAT, lay)
        first: gl.constexpr = buf * (_LAT // 2)
        second: gl.constexpr = _LAT // 2 - first
        if WAIT:
            mbarrier.wait(k_free.index(buf * 16 + first), phase)
        for c in gl.static_range(first, first + _LAT // 2):
            _async_piece(CACHE, offs, k_lat, k_pe, k_ready, buf, c, lay)
        if WAIT:
            mbarrier.wait(k_free.index(buf * 16 + second), phase)
        for c in gl.static_range(second, second + _LAT // 2):
            _async_piece(CACHE, offs, k_lat, k_pe, k_ready, buf, c, lay)

    @gluon.jit
    def _mla_loader_async(q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start, end, n_pairs,
                          q_desc, CACHE, BT, bt_row, q_row, PAGE: gl.constexpr):  # fmt: skip
        # The producer warp group of ISSUE = cpasync (early release only): Q by TMA, then
        # tile 2k + 2 into buffer 0 part by part as tile 2k's parts are freed, and so on.
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        _issue_q(q_desc, q_lat, q_pe, q_bar, q_row)
        last_page = gl.maximum(end - 1, 0) // PAGE
        if n_pairs > 0:
            _async_tile_early(CACHE, BT, bt_row, start, last_page, k_lat, k_pe, k_ready, k_free,
                              0, 0, False, PAGE, lay)  # fmt: skip
            _async_tile_early(CACHE, BT, bt_row, start + _BN, last_page, k_lat, k_pe, k_ready,
                              k_free, 1, 0, False, PAGE, lay)  # fmt: skip
        for k in range(1, n_pairs):
            n0 = start + 2 * k * _BN
            phase = (k - 1) & 1
            _async_tile_early(CACHE, BT, bt_row, n0, last_page, k_lat, k_pe, k_ready, k_free, 0,
                              phase, True, PAGE, lay)  # fmt: skip
            _async_tile_early(CACHE, BT, bt_row, n0 + _BN, last_page, k_lat, k_pe, k_ready,
                              k_free, 1, phase, True, PAGE, lay)  # fmt: skip

    @gluon.jit
    def _issue_q(q_desc, q_lat, q_pe, q_bar, q_row):
        # Q of the program's 64 heads: 9 pieces of 64 columns on one barrier.
        mbarrier.expect(q_bar, (_LAT + 1) * q_desc.block_type.nbytes)
        for c in gl.static_range(_LAT):
            tma.async_copy_global_to_shared(q_desc, [q_row, c * _BC], q_bar, q_lat.index(c))
        tma.async_copy_global_to_shared(q_desc, [q_row, _LAT * _BC], q_bar, q_pe)

    @gluon.jit
    def _piece_dst(k_lat, k_pe, buf: gl.constexpr, c: gl.constexpr, g: gl.constexpr,
                   BOX_ROWS: gl.constexpr):  # fmt: skip
        # Where copy g of piece c of buffer buf's tile lands (latent pieces, then the rope one).
        if c < _LAT:
            dst = k_lat.index(buf * _LAT + c)
        else:
            dst = k_pe.index(buf)
        if BOX_ROWS < _BN:
            dst = dst.slice(g * BOX_ROWS, BOX_ROWS, dim=0)
        return dst

    @gluon.jit
    def _issue_tile(c_desc, k_lat, k_pe, k_ready, BT, bt_row, buf: gl.constexpr, n0, last_page,
                    PAGE: gl.constexpr, BOX_ROWS: gl.constexpr):  # fmt: skip
        # One 64-token latent tile into buffer ``buf``: 9 pieces of 64 columns, one barrier
        # each; pages past the range are never looked up (their copies read the last real one).
        # The block id is looked up next to each copy (ISSUE = inline).
        for c in gl.static_range(_LAT + 1):
            bar = k_ready.index(buf * 16 + c)
            mbarrier.expect(bar, _BN * _BC * 2)
            for g in gl.static_range(_BN // BOX_ROWS):
                tok = n0 + g * BOX_ROWS
                page = gl.minimum(tok // PAGE, last_page)
                blk = gl.load(BT + bt_row + page).to(gl.int32)
                row = blk * PAGE + tok % PAGE
                dst = _piece_dst(k_lat, k_pe, buf, c, g, BOX_ROWS)
                tma.async_copy_global_to_shared(c_desc, [row, c * _BC], bar, dst)

    @gluon.jit
    def _box_row(BT, bt_row, tok, last_page, PAGE: gl.constexpr):
        page = gl.minimum(tok // PAGE, last_page)
        blk = gl.load(BT + bt_row + page).to(gl.int32)
        return blk * PAGE + tok % PAGE

    @gluon.jit
    def _tile_rows(BT, bt_row, n0, last_page, PAGE: gl.constexpr, BOX_ROWS: gl.constexpr):
        # The first cache row of each of a tile's boxes (64 // BOX_ROWS <= 8 of them; unused
        # entries repeat the first), all looked up before any copy is issued.
        ng: gl.constexpr = _BN // BOX_ROWS
        r0 = _box_row(BT, bt_row, n0, last_page, PAGE)
        r1 = r0
        r2 = r0
        r3 = r0
        r4 = r0
        r5 = r0
        r6 = r0
        r7 = r0
        if ng > 1:
            r1 = _box_row(BT, bt_row, n0 + BOX_ROWS, last_page, PAGE)
        if ng > 2:
            r2 = _box_row(BT, bt_row, n0 + 2 * BOX_ROWS, last_page, PAGE)
            r3 = _box_row(BT, bt_row, n0 + 3 * BOX_ROWS, last_page, PAGE)
        if ng > 4:
            r4 = _box_row(BT, bt_row, n0 + 4 * BOX_ROWS, last_page, PAGE)
            r5 = _box_row(BT, bt_row, n0 + 5 * BOX_ROWS, last_page, PAGE)
            r6 = _box_row(BT, bt_row, n0 + 6 * BOX_ROWS, last_page, PAGE)
            r7 = _box_row(BT, bt_row, n0 + 7 * BOX_ROWS, last_page, PAGE)
        return (r0, r1, r2, r3, r4, r5, r6, r7)

    @gluon.jit
    def _issue_rows(c_desc, k_lat, k_pe, k_ready, buf: gl.constexpr, rows,
                    BOX_ROWS: gl.constexpr, c_lo: gl.constexpr = 0,
                    c_hi: gl.constexpr = _LAT + 1, LANDED: gl.constexpr = False):  # fmt: skip
        # The copies of pieces [c_lo, c_hi) of one tile whose box rows are already known
        # (_tile_rows); LANDED: onto the latent pieces' _LANDED barriers (PZERO).
        for c in gl.static_range(c_lo, c_hi):
            if LANDED:
                bar = k_ready.index(_LANDED + buf * _LAT + c)
            else:
                bar = k_ready.index(buf * 16 + c)
            mbarrier.expect(bar, _BN * _BC * 2)
            for g in gl.static_range(_BN // BOX_ROWS):
                dst = _piece_dst(k_lat, k_pe, buf, c, g, BOX_ROWS)
                tma.async_copy_global_to_shared(c_desc, [rows[g], c * _BC], bar, dst)

    @gluon.jit
    def _issue_tile_by(ISSUE: gl.constexpr, c_desc, k_lat, k_pe, k_ready, BT, bt_row,
                       buf: gl.constexpr, n0, last_page, PAGE: gl.constexpr,
                       BOX_ROWS: gl.constexpr):  # fmt: skip
        if ISSUE == _ISSUE_INLINE:
            _issue_tile(c_desc, k_lat, k_pe, k_ready, BT, bt_row, buf, n0, last_page, PAGE,
                        BOX_ROWS)  # fmt: skip
        else:
            rows = _tile_rows(BT, bt_row, n0, last_page, PAGE, BOX_ROWS)
            _issue_rows(c_desc, k_lat, k_pe, k_ready, buf, rows, BOX_ROWS)
