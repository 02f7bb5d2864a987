"""The register-operand fp8 MLA decode kernel's query load (``kernels/decode/mla_regs_gluon.py``):
the query rows of a program's heads into fp16 in shared memory, in the column order of the
scores' A operand, each row times a power of two that takes its largest element into
[2**14, 2**15) (the kernel's module docstring says why).

Two versions: :func:`_q_perm` reads Q twice in that permuted order (its largest elements, then
the scaled values; 4-byte loads), :func:`_q_perm1` once in Q's own order with 16-byte loads,
then scales and permutes the values in registers (``REGS_Q_ONE_PASS``).
"""

from __future__ import annotations

import functools

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__: list[str] = []


@functools.cache
def _q_layout(bh: int) -> gl.DistributedLinearLayout:
    """[bh, 128] query columns for :func:`_q_perm1`: each thread holds two runs of 8
    consecutive columns (two 16-byte loads) 16 apart, so that column bit 4 (which of a latent
    group's two pieces) is a register index and the pieces split without moving data."""
    heads = [[16 << k, 0] for k in range((bh // 16).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 16]] + heads,
        lane_bases=[[0, 8], [0, 32], [0, 64], [1, 0], [2, 0]],
        warp_bases=[[4, 0], [8, 0]],
        block_bases=[],
        shape=[bh, 128],
    )


if HAS_GLUON:
    from cp_modules.kernels.decode.mla_gluon_fp8 import _q_pow2

    @gluon.jit
    def _q_piece(rows, hm, lat, pe, c: gl.constexpr):
        # Piece c of the query rows in the permuted column order, fp32.
        if c < 8:
            col = lat + (128 * (c // 2) + 16 * (c % 2))
        else:
            col = pe
        return gl.load(rows + col[None, :], mask=hm, other=0.0).to(gl.float32)

    @gluon.jit
    def _q_perm(Q, q_smem, q_base, stride_qh, n_heads, BH: gl.constexpr):
        # Q's rows into fp16 in shared memory in the scores' permuted column order
        # (mla_regs_gluon's docstring), each times 2**shift (its largest element to
        # [2**14, 2**15)); returns 2**-shift per head.
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        heads = gl.arange(0, BH, layout=gl.SliceLayout(1, lay))
        j = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
        # column j = 16 s + 8 h + 2 q + e of a piece -> 32 q + 4 s + 2 h + e (latent, plus
        # 128 (c // 2) + 16 (c % 2)), 16 q + 4 s + 2 h + e (rope, plus 512)
        s_ = j // 16
        h_ = (j // 8) % 2
        q_ = (j // 2) % 4
        e_ = j % 2
        inner = 4 * s_ + 2 * h_ + e_
        lat = 32 * q_ + inner
        pe = 512 + 16 * q_ + inner
        rows = Q + q_base + heads[:, None].to(gl.int64) * stride_qh
        hm = (heads < n_heads)[:, None]
        amax = gl.zeros([BH], gl.float32, gl.SliceLayout(1, lay))
        for c in gl.static_range(9):
            x = _q_piece(rows, hm, lat, pe, c)
            amax = gl.maximum(amax, gl.max(gl.abs(x), 1))
        mult, inv = _q_pow2(amax)
        for c in gl.static_range(9):
            q_smem.index(c).store((_q_piece(rows, hm, lat, pe, c) * mult[:, None]).to(gl.float16))
        return inv

    @gluon.jit
    def _q_group(q_smem, x, mult, c0: gl.constexpr, BH: gl.constexpr):
        # Latent columns [128 g, 128 g + 128) of the rows, natural order, into pieces c0 and
        # c0 + 1 (c0 = 2 g): column 32 q + 16 c' + 4 s + 2 h + e is column 16 s + 8 h + 2 q + e
        # of piece c0 + c' (registers renamed, then one store of both pieces).
        y = gl.reshape((x * mult[:, None]).to(gl.float16), [BH, 4, 2, 4, 2, 2])
        y = gl.permute(y, [0, 3, 4, 1, 5, 2])  # [head, s, h, q, e, c']
        ya, yb = gl.split(gl.reshape(y, [BH, 64, 2]))
        q_smem.index(c0).store(ya)
        q_smem.index(c0 + 1).store(yb)

    @gluon.jit
    def _q_perm1(Q, q_smem, q_base, stride_qh, n_heads, BH: gl.constexpr, lay: gl.constexpr):
        # :func:`_q_perm` with Q read once, in its own order (16-byte loads, ``lay``:
        # :func:`_q_layout`): the rows' largest elements from the values in registers, which
        # are then scaled, permuted and stored.
        heads = gl.arange(0, BH, layout=gl.SliceLayout(1, lay))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
        ptr = Q + q_base + heads[:, None].to(gl.int64) * stride_qh + cols[None, :]
        hm = (heads < n_heads)[:, None]
        x0 = gl.load(ptr, mask=hm, other=0.0).to(gl.float32)
        x1 = gl.load(ptr + 128, mask=hm, other=0.0).to(gl.float32)
        x2 = gl.load(ptr + 256, mask=hm, other=0.0).to(gl.float32)
        x3 = gl.load(ptr + 384, mask=hm, other=0.0).to(gl.float32)
        pe_lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        heads2 = gl.arange(0, BH, layout=gl.SliceLayout(1, pe_lay))
        cols2 = gl.arange(0, 64, layout=gl.SliceLayout(0, pe_lay))
        ptr2 = Q + q_base + heads2[:, None].to(gl.int64) * stride_qh + (512 + cols2)[None, :]
        xp = gl.load(ptr2, mask=(heads2 < n_heads)[:, None], other=0.0).to(gl.float32)
        amax = gl.maximum(gl.maximum(gl.max(gl.abs(x0), 1), gl.max(gl.abs(x1), 1)),
                          gl.maximum(gl.max(gl.abs(x2), 1), gl.max(gl.abs(x3), 1)))  # fmt: skip
        amax = gl.maximum(amax, gl.convert_layout(gl.max(gl.abs(xp), 1), amax.type.layout))
        mult, inv = _q_pow2(amax)
        _q_group(q_smem, x0, mult, 0, BH)
        _q_group(q_smem, x1, mult, 2, BH)
        _q_group(q_smem, x2, mult, 4, BH)
        _q_group(q_smem, x3, mult, 6, BH)
        # rope column 16 q + 4 s + 2 h + e -> 16 s + 8 h + 2 q + e of piece 8
        multp = gl.convert_layout(mult, gl.SliceLayout(1, pe_lay))
        y = gl.reshape((xp * multp[:, None]).to(gl.float16), [BH, 4, 4, 2, 2])
        q_smem.index(8).store(gl.reshape(gl.permute(y, [0, 2, 3, 1, 4]), [BH, 64]))
        return inv
