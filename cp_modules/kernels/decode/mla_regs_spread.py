"""The register-operand fp8 MLA decode kernel's split merge inside the kernel
(``kernels/decode/mla_regs_gluon.py``, switch ``REGS_SPREAD_MERGE``): when every program of a
launch is resident at once (a cooperative launch of at most one program an SM), each program
stores its fp32 partial, takes a ticket for its (query, head tile) row, waits until the row's
S splits have theirs, then merges the row's column blocks ``c = split (mod S)`` of
``512 / S_P2`` columns (S_P2: S rounded up to a power of two) from every split's partial. Each
program reads as many bytes as it stored (32 KB at 16 heads), and the separate merge launch
goes away. A second round of tickets resets the row's counter once every program is past its
wait, so eager launches and CUDA-graph replays need no memset.

Every split is read in split order: the same bits on every run, and the same weights as
:func:`~cp_modules.kernels.merge.merge_splits_triton`.
"""

from __future__ import annotations

import functools

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__ = ["SPREAD_MAX_SPLITS", "spread_block_columns"]

SPREAD_MAX_SPLITS = 128  # a block of 512 / 128 = 4 columns: 16-byte loads
_COLS = 512  # the latent's columns (kv_lora_rank; the kernel serves 512 only)


def spread_block_columns(num_splits: int) -> tuple[int, int]:
    """(S_P2, columns a block) of the merge for ``num_splits`` splits: S_P2 x columns = 512."""
    if not 2 <= num_splits <= SPREAD_MAX_SPLITS:
        raise ValueError(f"the spread merge serves 2 to {SPREAD_MAX_SPLITS} splits, got {num_splits}")
    s_p2 = 1 << (num_splits - 1).bit_length()
    return s_p2, _COLS // s_p2


@functools.lru_cache(maxsize=64)
def _merge_layout(s_p2: int, cb: int, bh: int) -> gl.BlockedLayout:
    """[S_P2 splits, bh heads, cb columns] over 4 warps: 4 consecutive columns (16 bytes) a
    thread, a warp's lanes over columns, then heads, then splits; 64 values a thread."""
    vec = min(cb, 4)
    tc = min(cb // vec, 32)
    th = min(bh, 32 // tc)
    ts = 32 // (tc * th)
    return gl.BlockedLayout([1, 1, vec], [ts, th, tc], [4, 1, 1], [2, 1, 0])


if HAS_GLUON:
    from cp_modules.kernels.decode.mla_gluon_parts import _sync_warp_group as _sync

    _COLS_C = gl.constexpr(_COLS)

    @gluon.jit
    def _wait_row(COUNTER, row, num_splits):
        # Until the row's S splits have taken their tickets (acquire: their partials, stored
        # before their release, are visible).
        n = gl.atomic_add(COUNTER + row, 0, sem="acquire", scope="gpu")
        while n < num_splits:
            n = gl.atomic_add(COUNTER + row, 0, sem="acquire", scope="gpu")

    @gluon.jit
    def _merge_columns(PO, po_base, PL, pl_base, stride_oh, stride_os, stride_lh, stride_ls,
                       num_splits, n_heads, FOUT, fo_base, stride_foh, col0, BH: gl.constexpr,
                       CB: gl.constexpr, S_P2: gl.constexpr, L3: gl.constexpr):  # fmt: skip
        # Columns [col0, col0 + CB) of the row's BH heads from every split's partial and
        # base-2 LSE (read from L2: other SMs wrote them); returns the row's LSE parts.
        w_l: gl.constexpr = gl.SliceLayout(2, L3)  # [splits, heads]
        o_l: gl.constexpr = gl.SliceLayout(0, L3)  # [heads, columns]
        sp = gl.arange(0, S_P2, layout=gl.SliceLayout(1, w_l))
        hd = gl.arange(0, BH, layout=gl.SliceLayout(0, w_l))
        live = (sp < num_splits)[:, None] & (hd < n_heads)[None, :]
        lse = gl.load(PL + pl_base + sp[:, None] * stride_ls + hd.to(gl.int64)[None, :] * stride_lh,
                      mask=live, other=float("-inf"), cache_modifier=".cg")  # fmt: skip
        m = gl.max(lse, 0)
        m = gl.where(m == float("-inf"), 0.0, m)
        w = gl.exp2(lse - m[None, :])
        total = gl.sum(w, 0)
        cols3 = gl.arange(0, CB, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        src = (PO + po_base + (sp[:, None] * stride_os
                               + hd.to(gl.int64)[None, :] * stride_oh)[:, :, None]
               + (col0 + cols3)[None, None, :])  # fmt: skip
        p = gl.load(src, mask=live[:, :, None], other=0.0, cache_modifier=".cg")
        o = gl.sum(w[:, :, None] * p, 0)
        nonempty = total > 0.0
        inv = gl.convert_layout(1.0 / gl.where(nonempty, total, 1.0), gl.SliceLayout(1, o_l))
        h_o = gl.arange(0, BH, layout=gl.SliceLayout(1, o_l))
        cols = gl.arange(0, CB, layout=gl.SliceLayout(0, o_l))
        dst = FOUT + fo_base + h_o.to(gl.int64)[:, None] * stride_foh + (col0 + cols)[None, :]
        gl.store(dst, (o * inv[:, None]).to(FOUT.dtype.element_ty),
                 mask=(h_o < n_heads)[:, None])  # fmt: skip
        return m, total, hd

    @gluon.jit
    def _regs_spread_merge(COUNTER, row, split, num_splits, PO, po_base, PL, pl_base, stride_oh,
                           stride_os, stride_lh, stride_ls, n_heads, FOUT, fo_base, stride_foh,
                           FLSE, fl_base, stride_flh, BH: gl.constexpr, CB: gl.constexpr,
                           S_P2: gl.constexpr, L3: gl.constexpr):  # fmt: skip
        # This program's partial and LSE are stored (the barrier: by every thread) before its
        # ticket (release); once the row's S tickets are in (acquire), their partials are
        # visible. Block c = split, split + S, ... of 512 / CB; block 0's program writes the LSE.
        _sync()
        gl.atomic_add(COUNTER + row, 1, sem="release", scope="gpu")
        _wait_row(COUNTER, row, num_splits)
        _sync()
        for c in range(split, _COLS_C // CB, num_splits):
            m, total, hd = _merge_columns(PO, po_base, PL, pl_base, stride_oh, stride_os,
                                          stride_lh, stride_ls, num_splits, n_heads, FOUT,
                                          fo_base, stride_foh, c * CB, BH, CB, S_P2, L3)  # fmt: skip
            if c == 0:
                nonempty = total > 0.0
                lse2 = gl.where(nonempty, m + gl.log2(gl.where(nonempty, total, 1.0)),
                                float("-inf"))  # fmt: skip
                gl.store(FLSE + fl_base + hd.to(gl.int64) * stride_flh, lse2 * 0.6931471805599453,
                         mask=hd < n_heads)  # fmt: skip
        # Past the wait: the row's last second ticket resets the counter for the next launch.
        _sync()
        ticket = gl.atomic_add(COUNTER + row, 1, sem="relaxed", scope="gpu")
        if ticket == 2 * num_splits - 1:
            gl.atomic_xchg(COUNTER + row, 0, sem="relaxed", scope="gpu")
