"""The fp8 (e4m3) latent cache in the Gluon MLA decode kernel
(:mod:`cp_modules.kernels.decode.mla_gluon`, ``FP8``): its two producer partitions.

- the copies (one producer warp, ``_mla_fp8_loader``): Q (bf16/fp16) as in the 16-bit kernel,
  then each 64-token tile's 9 pieces as fp8 bytes (half the bytes of bf16), each piece landing
  in the second half of the 16-bit piece it will become, in the order the consumers free them
  (early release: the rope piece, then the latent half freed first, then the other).
- the conversion (``_mla_fp8_convert``: ``mla_gluon_config.FP8_CONVERT_WARPS`` /
  ``FP8_CONVERT_REGS``, by default a warp group of its own, 4 warps at 32 registers; 2 warps
  share the producer warp's slot and leave the compute warp groups the 16-bit kernel's
  registers, measured slower): once a piece has landed, its bytes become fp16 by the hardware conversion (``cvt.rn.f16x2.e4m3x2``: exact, the e4m3
  value itself), rows past the range become 0 (unwritten slots may hold NaN), and the fp16
  piece overwrites the bytes in place; then the piece's ready barrier completes, so the
  consumer warp groups' products (wgmma from shared memory) read 16-bit tiles as before. Q is
  brought into fp16 first, in place: each head's row times the power of two that takes its
  largest element into [2**14, 2**15) (exact: bf16's 8-bit significands fit fp16's 11, but
  for elements under 2**-28 of the row's largest), the inverse kept for the consumers.

The consumers multiply each row's scores by ``scale * kv_scale`` over that power of two and
the output by ``kv_scale``; P is fp16, the sums fp32. The shared memory is the 16-bit kernel's:
no staging buffer (the 16-bit kernel leaves under 100 bytes of the H200's 227 KB free).
Notes and compile results: docs/experiments/2026-12-04-mla-fp8-gluon.md.

Barriers (slots of the kernel's ``k_ready``, 48 with ``PZERO``): a latent piece c of buffer b
lands on ``_LANDED + b * 8 + c``, the rope piece on ``b * 16 + _ROPE_LANDED``, Q on
``_Q_LANDED``; the converter completes the piece's own ``b * 16 + c`` and ``q_bar``.
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
        _BH,
        _BN,
        _FREE_ROPE,
        _LANDED,
        _LAT,
        _sync_warp_group,
        _tile_rows,
    )

    _ROPE_LANDED = gl.constexpr(_LAT + 5)  # k_ready slot b * 16 + 13: buffer b's rope piece
    _Q_LANDED = gl.constexpr(_LAT + 6)  # k_ready slot 14: Q (16-bit, unscaled) has landed
    _Q_SCALE = gl.constexpr(6)  # vec_smem slot (of 64 floats): each row's 2**-shift

    # Two pairs of e4m3 bytes in $2 (16 bits each) -> two pairs of fp16 in $0 and $1 (the
    # hardware conversion reads each 16-bit half as it is: no byte moves).
    _CVT_ASM = gl.constexpr("""
    {
    .reg .b16 lo, hi;
    mov.b32 {lo, hi}, $2;
    cvt.rn.f16x2.e4m3x2 $0, lo;
    cvt.rn.f16x2.e4m3x2 $1, hi;
    }
    """)

    @gluon.jit
    def _conv_views(k_lat, k_pe):
        # The tile pieces for the conversion: the bytes as 16-bit pairs (each 16-bit piece as
        # two 64 x 32 pieces of 64-byte rows) and the fp16 as 32-bit pairs (64 x 32 words),
        # the same bytes as the 8-bit and 16-bit views (the swizzles are of 16-byte chunks).
        lay16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16,
                                                   rank=2)  # fmt: skip
        lay32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                                   rank=2)  # fmt: skip
        k16 = k_lat._reinterpret(gl.int16, [4 * _LAT, _BN, _BC // 2], lay16)
        pe16 = k_pe._reinterpret(gl.int16, [4, _BN, _BC // 2], lay16)
        k32 = k_lat._reinterpret(gl.int32, [2 * _LAT, _BN, _BC // 2], lay32)
        pe32 = k_pe._reinterpret(gl.int32, [2, _BN, _BC // 2], lay32)
        return k16, pe16, k32, pe32

    @gluon.jit
    def _landed(k_ready, buf: gl.constexpr, c: gl.constexpr):
        if c < _LAT:
            bar = k_ready.index(_LANDED + buf * _LAT + c)
        else:
            bar = k_ready.index(buf * 16 + _ROPE_LANDED)
        return bar

    @gluon.jit
    def _bytes_of(k8, pe8, buf: gl.constexpr, c: gl.constexpr):
        # Where piece c of buffer buf lands as fp8: the second half of its 16-bit piece
        # (k8 / pe8: the 16-bit pieces as two 64 x 64 byte pieces each).
        if c < _LAT:
            dst = k8.index(2 * (buf * _LAT + c) + 1)
        else:
            dst = pe8.index(2 * buf + 1)
        return dst

    @gluon.jit
    def _fp8_issue_piece(c_desc, k8, pe8, k_ready, buf: gl.constexpr, rows,
                         BOX_ROWS: gl.constexpr, c: gl.constexpr):  # fmt: skip
        bar = _landed(k_ready, buf, c)
        mbarrier.expect(bar, _BN * _BC)
        for g in gl.static_range(_BN // BOX_ROWS):
            dst = _bytes_of(k8, pe8, buf, c)
            if BOX_ROWS < _BN:
                dst = dst.slice(g * BOX_ROWS, BOX_ROWS, dim=0)
            tma.async_copy_global_to_shared(c_desc, [rows[g], c * _BC], bar, dst)

    @gluon.jit
    def _fp8_issue_tile(c_desc, k8, pe8, k_ready, k_free, buf: gl.constexpr, rows,
                        BOX_ROWS: gl.constexpr, phase, WAIT: gl.constexpr):  # fmt: skip
        # One tile's pieces in the order of _issue_tile_early: the rope piece, then the
        # latent half freed first (buffer 0: [0, 256), buffer 1: [256, 512)), then the other;
        # WAIT: each part once the consumers have freed it (early release).
        if WAIT:
            mbarrier.wait(k_free.index(buf * 16 + _FREE_ROPE), phase)
        _fp8_issue_piece(c_desc, k8, pe8, k_ready, buf, rows, BOX_ROWS, _LAT)
        first: gl.constexpr = buf * (_LAT // 2)
        second: gl.constexpr = _LAT // 2 - first
        if WAIT:
            mbarrier.wait(k_free.index(buf * 16 + first), phase)
        for c in gl.static_range(first, first + _LAT // 2):
            _fp8_issue_piece(c_desc, k8, pe8, k_ready, buf, rows, BOX_ROWS, c)
        if WAIT:
            mbarrier.wait(k_free.index(buf * 16 + second), phase)
        for c in gl.static_range(second, second + _LAT // 2):
            _fp8_issue_piece(c_desc, k8, pe8, k_ready, buf, rows, BOX_ROWS, c)

    @gluon.jit
    def _views(q_lat, q_pe, k_lat, k_pe, Q_FP16: gl.constexpr):
        # Q's pieces in its own dtype (as it lands), and the tile pieces as fp8 bytes: each
        # 16-bit piece as two 64 x 64 byte pieces (the layout of the launcher's descriptor).
        if Q_FP16:
            qdt: gl.constexpr = gl.float16
        else:
            qdt: gl.constexpr = gl.bfloat16  # type: ignore[no-redef]
        lay8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8,
                                                  rank=2)  # fmt: skip
        q_in = q_lat._reinterpret(qdt, [_LAT, _BH, _BC], q_lat.layout)
        qpe_in = q_pe._reinterpret(qdt, [_BH, _BC], q_pe.layout)
        k8 = k_lat._reinterpret(gl.uint8, [4 * _LAT, _BN, _BC], lay8)
        pe8 = k_pe._reinterpret(gl.uint8, [4, _BN, _BC], lay8)
        return q_in, qpe_in, k8, pe8

    @gluon.jit
    def _mla_fp8_loader(q_lat, q_pe, k_lat, k_pe, k_ready, k_free, start, end, n_pairs, q_desc,
                        c_desc, BT, bt_row, q_row, PAGE: gl.constexpr,
                        BOX_ROWS: gl.constexpr):  # fmt: skip
        # The producer warp: Q onto _Q_LANDED, then tile 2k + 2's pieces into buffer 0 as
        # tile 2k's parts are freed, tile 2k + 3's into buffer 1 (as _mla_loader_early).
        q_in, qpe_in, k8, pe8 = _views(q_lat, q_pe, k_lat, k_pe, q_desc.dtype == gl.float16)
        q_land = k_ready.index(_Q_LANDED)
        mbarrier.expect(q_land, (_LAT + 1) * q_desc.block_type.nbytes)
        for c in gl.static_range(_LAT):
            tma.async_copy_global_to_shared(q_desc, [q_row, c * _BC], q_land, q_in.index(c))
        tma.async_copy_global_to_shared(q_desc, [q_row, _LAT * _BC], q_land, qpe_in)
        last_page = gl.maximum(end - 1, 0) // PAGE
        if n_pairs > 0:
            rows = _tile_rows(BT, bt_row, start, last_page, PAGE, BOX_ROWS)
            _fp8_issue_tile(c_desc, k8, pe8, k_ready, k_free, 0, rows, BOX_ROWS, 0, False)
            rows = _tile_rows(BT, bt_row, start + _BN, last_page, PAGE, BOX_ROWS)
            _fp8_issue_tile(c_desc, k8, pe8, k_ready, k_free, 1, rows, BOX_ROWS, 0, False)
        for k in range(1, n_pairs):
            n0 = start + 2 * k * _BN
            phase = (k - 1) & 1
            rows_a = _tile_rows(BT, bt_row, n0, last_page, PAGE, BOX_ROWS)
            rows_b = _tile_rows(BT, bt_row, n0 + _BN, last_page, PAGE, BOX_ROWS)
            _fp8_issue_tile(c_desc, k8, pe8, k_ready, k_free, 0, rows_a, BOX_ROWS, phase, True)
            _fp8_issue_tile(c_desc, k8, pe8, k_ready, k_free, 1, rows_b, BOX_ROWS, phase, True)

    @gluon.jit
    def _fp8_convert_bytes(src16, dst32, valid, lay: gl.constexpr, MASK: gl.constexpr):
        # A piece's bytes (as 16-bit pairs: 16-byte loads, 8 rows a warp at a time) -> fp16
        # pairs as 32-bit words (16-byte stores), rows >= valid 0 with MASK (a select a word).
        # One load and one store of the whole piece: fp16 rows [32, 64) overwrite every byte
        # of the piece, so one barrier between them (the compiler puts one between any two
        # accesses of the buffer that are not both reads: more, smaller steps cost more).
        x = src16.load(lay)
        y = gl.inline_asm_elementwise(_CVT_ASM, "=r,=r,r", [x], dtype=gl.int32, is_pure=True,
                                      pack=2)  # fmt: skip
        if MASK:
            rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, lay))
            y = gl.where((rows < valid)[:, None], y, gl.zeros_like(y))
        _sync_warp_group()
        dst32.store(y)

    @gluon.jit
    def _fp8_convert_piece(src16, dst32, landed, phase, valid, lay: gl.constexpr,
                           MASK: gl.constexpr):  # fmt: skip
        # Once the piece's bytes have landed (the second half of dst's memory), its fp16 over
        # them in place.
        mbarrier.wait(landed, phase)
        _fp8_convert_bytes(src16, dst32, valid, lay, MASK)

    @gluon.jit
    def _fp8_convert_half_tile(k16, k32, k_ready, buf: gl.constexpr, first: gl.constexpr,
                               phase, valid, lay: gl.constexpr, MASK: gl.constexpr):  # fmt: skip
        # Latent pieces [first, first + 4) of buffer buf (a part the consumers free at once),
        # then one proxy fence and barrier for all four before they are ready. A runtime
        # loop: the pieces' addresses are computed per piece, not hoisted out of the tile loop.
        for i in range(_LAT // 2):
            c = first + i
            _fp8_convert_piece(k16.index(2 * (buf * _LAT + c) + 1), k32.index(buf * _LAT + c),
                               k_ready.index(_LANDED + buf * _LAT + c), phase, valid, lay, MASK)  # fmt: skip
        fence_async_shared()
        _sync_warp_group()
        for i in gl.static_range(_LAT // 2):
            mbarrier.arrive(k_ready.index(buf * 16 + first + i))

    @gluon.jit
    def _fp8_convert_tile(k16, pe16, k32, pe32, k_ready, buf: gl.constexpr, phase, valid,
                          lay: gl.constexpr, MASK: gl.constexpr):  # fmt: skip
        # The parts in the order they are issued and the scores take them: the rope piece,
        # then the latent half freed first, then the other.
        _fp8_convert_piece(pe16.index(2 * buf + 1), pe32.index(buf),
                           k_ready.index(buf * 16 + _ROPE_LANDED), phase, valid, lay, MASK)  # fmt: skip
        fence_async_shared()
        _sync_warp_group()
        mbarrier.arrive(k_ready.index(buf * 16 + _LAT))
        first: gl.constexpr = buf * (_LAT // 2)
        _fp8_convert_half_tile(k16, k32, k_ready, buf, first, phase, valid, lay, MASK)
        _fp8_convert_half_tile(k16, k32, k_ready, buf, _LAT // 2 - first, phase, valid, lay,
                               MASK)  # fmt: skip

    @gluon.jit
    def _q_pow2(amax):
        # Per query row with largest |element| amax: 2**shift taking amax into [2**14, 2**15)
        # (shift within [-126, 126]; a row of zeros keeps shift 0), and 2**-shift.
        e = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        shift = gl.where(e == 0, 0, gl.minimum(gl.maximum(141 - e, -126), 126))
        mult = ((shift + 127) << 23).to(gl.float32, bitcast=True)
        return mult, ((127 - shift) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _fp8_query(q_lat, q_pe, q_in, qpe_in, vec_smem, q_bar, k_ready, lay: gl.constexpr):
        # Q into fp16 in place: row h times 2**shift_h, its largest element in [2**14, 2**15)
        # (shift within [-126, 126]; a row of zeros keeps shift 0); 2**-shift_h to vec_smem.
        # RC rows at a time (8 elements a thread); each thread stores over the very elements
        # it loaded.
        RC: gl.constexpr = 4 * gl.num_warps()
        mbarrier.wait(k_ready.index(_Q_LANDED), 0)
        for h in gl.static_range(_BN // RC):
            x = qpe_in.slice(h * RC, RC, dim=0).load(lay).to(gl.float32)
            amax = gl.max(gl.abs(x), 1)
            for c in range(_LAT):
                x = q_in.index(c).slice(h * RC, RC, dim=0).load(lay).to(gl.float32)
                amax = gl.maximum(amax, gl.max(gl.abs(x), 1))
            mult, inv = _q_pow2(amax)
            mult = mult[:, None]
            x = qpe_in.slice(h * RC, RC, dim=0).load(lay).to(gl.float32)
            q_pe.slice(h * RC, RC, dim=0).store((x * mult).to(gl.float16))
            for c in range(_LAT):
                x = q_in.index(c).slice(h * RC, RC, dim=0).load(lay).to(gl.float32)
                q_lat.index(c).slice(h * RC, RC, dim=0).store((x * mult).to(gl.float16))
            vec_smem.slice(_Q_SCALE * _BH + h * RC, RC).store(inv)
        fence_async_shared()
        _sync_warp_group()
        mbarrier.arrive(q_bar)

    @gluon.jit
    def _mla_fp8_convert(q_lat, q_pe, k_lat, k_pe, vec_smem, q_bar, k_ready, start, end,
                         n_pairs, Q_FP16: gl.constexpr):  # fmt: skip
        # The conversion warp group: Q, then every tile as its pieces land (pair k: tile 2k in
        # buffer 0, 2k + 1 in buffer 1; a phantom tile past the range becomes zeros).
        # Q: 8 elements a thread; the tiles: 8 pairs (16 bytes) a thread, 8 rows a warp.
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        lay_c: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
        q_in, qpe_in, _, _ = _views(q_lat, q_pe, k_lat, k_pe, Q_FP16)
        k16, pe16, k32, pe32 = _conv_views(k_lat, k_pe)
        _fp8_query(q_lat, q_pe, q_in, qpe_in, vec_smem, q_bar, k_ready, lay)
        for k in range(n_pairs):
            phase = k & 1
            n0 = start + 2 * k * _BN
            # A uniform branch a tile: only one reaching past the range is masked.
            for b in gl.static_range(2):
                valid = end - n0 - b * _BN
                if valid >= _BN:
                    _fp8_convert_tile(k16, pe16, k32, pe32, k_ready, b, phase, valid, lay_c,
                                      False)  # fmt: skip
                else:
                    _fp8_convert_tile(k16, pe16, k32, pe32, k_ready, b, phase, valid, lay_c,
                                      True)  # fmt: skip

    @gluon.jit
    def _fp8_row_scale(qk_scale, KV_SCALE, vec_smem, row_l: gl.constexpr):
        # The consumers' scale of the scores, per row ([64, 1]): scale * log2(e) * kv_scale
        # over the row's power of two (_fp8_query).
        inv = vec_smem.slice(_Q_SCALE * _BH, _BH).load(row_l)
        return (qk_scale * gl.load(KV_SCALE) * inv)[:, None]

    @gluon.jit
    def _fp8_out_sums(l_i, KV_SCALE, FP8: gl.constexpr):
        # The row sums the output is divided by: with FP8, over kv_scale (the values' scale).
        if FP8:
            l_i = l_i / gl.load(KV_SCALE)
        return l_i
