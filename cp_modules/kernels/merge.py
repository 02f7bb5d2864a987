"""The LSE merge family: every Triton kernel that merges partial attentions by their LSEs.

Shape legend:
    N: partials (KV shards, ranks or blocks)    B / L / T: tokens    H: heads    D: value dim
    K: head blocks of a corrected output        S: KV splits of the decode kernel
    R: rows, one per (token, head), R = B * H

For partial outputs ``o_n`` with LSEs ``l_n`` over disjoint key sets: ``m = max_n l_n``,
``w_n = exp(l_n - m) / sum_k exp(l_k - m)``, ``out = sum_n w_n o_n``, ``lse = m + log sum_k
exp(l_k - m)``; NaN and +inf LSEs count as -inf, a row of empty partials gives 0 and -inf
(base-2 LSEs with ``exp2`` / ``log2``). One oracle for all of them:
:mod:`cp_modules.reference.lse_merge`. The forms, by who calls them:

* full combine, :func:`lse_combine_triton`: ``[N, B, H, D]`` strided partials to a fresh
  result (the DCP ``a2a`` combine, ``cp::lse_combine``);
* weights only, :func:`correct_attn_out_triton`: one rank's partial scaled by its weight among
  all ranks' LSEs, laid out head-block-major for a reduce-scatter (the DCP ``ag_rs`` combine,
  ``cp::correct_attn_out``);
* in-place partials, :func:`merge_partials_into`: 2-3 partials lying anywhere (a PCP causal
  square, its rectangle and its cached prefix) merged into the caller's rows, which may be
  the first partial's own memory;
* split partials, :func:`merge_splits_triton`: the paged decode kernel's fp32 split-KV
  partials ``[T, H, S, D]`` (base-2 LSEs, up to 256 splits, read in chunks: S is a run-time
  loop here, not an unrolled one) into its natural-log result.

The full combine and the weights-only form share one per-row maximum / sum helper, the
in-place form its empty-partial rule; all accumulate in fp32. Each is memory-bound; launch
parameters as measured: ``docs/switch-points.md``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_modules.reference.lse_merge import merge_partials_reference

__all__ = [
    "correct_attn_out_triton",
    "lse_combine_launch_config",
    "lse_combine_tile",
    "lse_combine_triton",
    "merge_partials_into",
    "merge_partials_triton",
    "merge_splits_launch_config",
    "merge_splits_triton",
]


@triton.jit
def _sanitize_lse(lse):
    # NaN and +inf mark an empty shard: treat them as -inf so the shard's weight is 0.
    return tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)


@triton.jit
def _exp(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.log2(x)
    else:
        return tl.log(x)


@triton.jit
def _row_max_and_sum(l_ptrs, s_ln, row_ok, N: tl.constexpr, BASE2: tl.constexpr):
    """Per row: max of the sanitized LSEs (0 when all are -inf) and sum of exp(lse - max)."""
    m = tl.full(row_ok.shape, float("-inf"), tl.float32)
    for i in tl.static_range(N):
        lse = _sanitize_lse(tl.load(l_ptrs + i * s_ln, mask=row_ok, other=float("-inf")))
        m = tl.maximum(m, lse)
    m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.zeros(row_ok.shape, tl.float32)
    for i in tl.static_range(N):
        lse = _sanitize_lse(tl.load(l_ptrs + i * s_ln, mask=row_ok, other=float("-inf")))
        s += _exp(lse - m, BASE2)
    return m, s


@triton.jit
def _lse_combine_kernel(
    x_ptr,  # [N, B, H, D] partial outputs, D contiguous
    l_ptr,  # [N, B, H] fp32 partial LSEs
    y_ptr,  # [B, H, D] combined output, D contiguous
    z_ptr,  # [B, H] fp32 combined LSE
    num_rows,
    num_heads,
    s_xn,
    s_xb,
    s_xh,
    s_ln,
    s_lb,
    s_lh,
    s_yb,
    s_yh,
    s_zb,
    s_zh,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BASE2: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    # int64 row offsets: N * B * H * D can exceed 2**31 for long prefill-context combines.
    b = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)

    l_ptrs = l_ptr + b * s_lb + h * s_lh
    m, s = _row_max_and_sum(l_ptrs, s_ln, row_ok, N, BASE2)
    nonempty = s > 0.0
    inv_s = 1.0 / tl.where(nonempty, s, 1.0)

    x_ptrs = x_ptr + (b * s_xb + h * s_xh)[:, None] + d[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for _ in tl.static_range(N):
        lse = _sanitize_lse(tl.load(l_ptrs, mask=row_ok, other=float("-inf")))
        w = _exp(lse - m, BASE2) * inv_s
        # Each partial is read exactly once: keep it from evicting the LSEs and the output.
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        # where(), not a product alone: an empty shard's output may be NaN and 0 * NaN is NaN.
        acc += tl.where(w[:, None] > 0.0, x * w[:, None], 0.0)
        l_ptrs += s_ln
        x_ptrs += s_xn

    y_ptrs = y_ptr + (b * s_yb + h * s_yh)[:, None] + d[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    out_lse = tl.where(nonempty, m + _log(tl.where(nonempty, s, 1.0), BASE2), float("-inf"))
    tl.store(z_ptr + b * s_zb + h * s_zh, out_lse, mask=row_ok & (pid_d == 0))


@triton.jit
def _correct_attn_out_kernel(
    x_ptr,  # [B, H, D] this rank's partial output, D contiguous
    l_ptr,  # [N, B, H] fp32 LSEs of every rank
    y_ptr,  # [K, B, H/K, D] corrected output
    z_ptr,  # [B, H] fp32 combined LSE
    rank,
    num_rows,
    num_heads,
    heads_per_block,
    s_xb,
    s_xh,
    s_ln,
    s_lb,
    s_lh,
    s_yk,
    s_yb,
    s_yh,
    s_zb,
    s_zh,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BASE2: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    b = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)

    l_ptrs = l_ptr + b * s_lb + h * s_lh
    m, s = _row_max_and_sum(l_ptrs, s_ln, row_ok, N, BASE2)
    nonempty = s > 0.0
    own = _sanitize_lse(tl.load(l_ptrs + rank * s_ln, mask=row_ok, other=float("-inf")))
    w = _exp(own - m, BASE2) / tl.where(nonempty, s, 1.0)

    x = tl.load(x_ptr + (b * s_xb + h * s_xh)[:, None] + d[None, :], mask=mask, other=0.0)
    # where(), not a product alone: an empty shard's output may be NaN and 0 * NaN is NaN.
    y = tl.where(w[:, None] > 0.0, x.to(tl.float32) * w[:, None], 0.0)
    blk = h // heads_per_block
    y_off = blk * s_yk + b * s_yb + (h - blk * heads_per_block) * s_yh
    tl.store(y_ptr + y_off[:, None] + d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    out_lse = tl.where(nonempty, m + _log(tl.where(nonempty, s, 1.0), BASE2), float("-inf"))
    tl.store(z_ptr + b * s_zb + h * s_zh, out_lse, mask=row_ok & (pid_d == 0))


@triton.jit
def _merge_partials_kernel(
    o0, o1, o2, l0, l1, l2, dst, dst_lse,
    num_rows, num_heads, head_dim,
    so0_t, so0_h, so1_t, so1_h, so2_t, so2_h,
    sl0_t, sl0_h, sl1_t, sl1_h, sl2_t, sl2_h,
    sd_t, sd_h, sdl_t, sdl_h,
    NUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_R (token, head) rows x BLOCK_D columns of the merged output. Each
    # output element is read and written by the same program, so dst may be o0's own memory;
    # dst_lse may be an input LSE's only with one column block (the launcher sees to it).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    t = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (cols < head_dim)[None, :]
    a0 = _sanitize_lse(tl.load(l0 + t * sl0_t + h * sl0_h, mask=row_mask, other=0.0))
    a1 = _sanitize_lse(tl.load(l1 + t * sl1_t + h * sl1_h, mask=row_mask, other=0.0))
    m = tl.maximum(a0, a1)
    if NUM == 3:
        a2 = _sanitize_lse(tl.load(l2 + t * sl2_t + h * sl2_h, mask=row_mask, other=0.0))
        m = tl.maximum(m, a2)
    # All partials empty: subtract 0 so that the weights stay 0 instead of NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w0 = tl.exp(a0 - m)
    w1 = tl.exp(a1 - m)
    x0 = tl.load(o0 + (t * so0_t + h * so0_h)[:, None] + cols[None, :], mask=mask, other=0.0)
    x1 = tl.load(o1 + (t * so1_t + h * so1_h)[:, None] + cols[None, :], mask=mask, other=0.0)
    acc = w0[:, None] * x0.to(tl.float32) + w1[:, None] * x1.to(tl.float32)
    total = w0 + w1
    if NUM == 3:
        w2 = tl.exp(a2 - m)
        x2 = tl.load(o2 + (t * so2_t + h * so2_h)[:, None] + cols[None, :], mask=mask, other=0.0)
        acc += w2[:, None] * x2.to(tl.float32)
        total += w2
    nonempty = total > 0.0
    acc = acc / tl.where(nonempty, total, 1.0)[:, None]
    out_ptr = dst + (t * sd_t + h * sd_h)[:, None] + cols[None, :]
    tl.store(out_ptr, acc.to(dst.dtype.element_ty), mask=mask)
    out_lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
    if tl.program_id(1) == 0:
        tl.store(dst_lse + t * sdl_t + h * sdl_h, out_lse, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    PO,
    PLSE,
    OUT,
    LSE,
    num_rows,
    num_heads,
    stride_pot,
    stride_poh,
    stride_pos,
    stride_plt,
    stride_plh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # One program: BLOCK_DV output columns of BLOCK_R (query, head) rows, r = t * H + h. Rows
    # of few splits are taken several at a time and long split lists by several programs
    # (column blocks), so every program reads tens of KB whatever the split count. The split
    # LSEs (base 2) are read at once; the fp32 partials CHUNK_S splits at a time.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    t = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    dv_block = tl.program_id(1)
    lse_rows = PLSE + t * stride_plt + h * stride_plh
    offs_s = tl.arange(0, BLOCK_S)
    lse2 = tl.load(
        lse_rows[:, None] + offs_s[None, :],
        mask=row_ok[:, None] & (offs_s < NUM_SPLITS)[None, :],
        other=float("-inf"),
    )
    m = tl.max(lse2, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse2 - m_safe[:, None]), 1)
    offs_dv = dv_block * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    po_rows = PO + t * stride_pot + h * stride_poh
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, CHUNK_S):
        offs_c = s0 + tl.arange(0, CHUNK_S)
        rc_mask = row_ok[:, None] & (offs_c < NUM_SPLITS)[None, :]
        w = tl.exp2(
            tl.load(lse_rows[:, None] + offs_c[None, :], mask=rc_mask, other=float("-inf"))
            - m_safe[:, None]
        )
        po = tl.load(
            po_rows[:, None, None] + offs_c[None, :, None] * stride_pos + offs_dv[None, None, :],
            mask=rc_mask[:, :, None] & dv_mask[None, None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        acc += tl.sum(po * w[:, :, None], 1)
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    o_rows = OUT + t * stride_ot + h * stride_oh
    tl.store(
        o_rows[:, None] + offs_dv[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & dv_mask[None, :],
    )
    if dv_block == 0:
        lse = tl.where(
            total > 0.0, (m_safe + tl.log2(tl.where(total > 0.0, total, 1.0))), float("-inf")
        )
        tl.store(LSE + t * stride_lt + h * stride_lh, lse * 0.6931471805599453, mask=row_ok)


@functools.cache
def lse_combine_launch_config(head_dim: int, elem_size: int) -> tuple[int, int, int]:
    """Default ``(BLOCK_R, BLOCK_D, num_warps)`` for a value head dim and element size.

    About 8 KiB of each partial per program of 4 warps (four 16-byte loads per thread and
    partial); D up to 512 stays in one tile so each row's weights are computed once.
    The combine itself takes :func:`lse_combine_tile` (measured tiles first; the sweep:
    ``docs/experiments/2026-12-02-peers.md``, ``tools/probes/probe_combine_tiles.py``).
    """
    block_d = min(triton.next_power_of_2(head_dim), 512)
    block_r = triton.next_power_of_2(max(1, min(64, 8192 // (block_d * elem_size))))
    return block_r, block_d, 4


# Tiles measured fastest for the combine on an H200 (16-bit partials, B * H = 32 * 128 and
# 64 * 128 rows, N = 2/4/8; `tools/probes/probe_combine_tiles.py`,
# `benchmarks/results/combine-tiles-2026-12-03.json`): small programs of 8 elements a thread.
# D = 128: 8 rows of 4 warps (the formula above gives 32 rows: up to 8 % slower); D = 512: one
# row of 256 columns on one warp, two programs a row (the formula's 8 rows x 512: 9-23 %
# slower). Other head dims and element sizes keep the formula.
_COMBINE_TILES = {(128, 2): (8, 128, 4), (512, 2): (1, 256, 1)}


def lse_combine_tile(head_dim: int, elem_size: int) -> tuple[int, int, int]:
    """The combine's ``(BLOCK_R, BLOCK_D, num_warps)``: a measured tile, else the formula."""
    return _COMBINE_TILES.get((head_dim, elem_size)) or lse_combine_launch_config(
        head_dim, elem_size
    )


def lse_combine_triton(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    base2: bool = False,
    block_rows: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the combine: ``[N, B, H, D]`` + ``[N, B, H]`` fp32 -> ``[B, H, D]`` + ``[B, H]`` fp32.

    ``partial_out`` may be any strided view whose last dim is contiguous; ``partial_lse`` any
    strided fp32 view. The block sizes and warps default to the tiles measured fastest (16-bit
    partials at D = 128 and 512), else :func:`lse_combine_launch_config`.
    """
    n, b, h, d = partial_out.shape
    assert partial_out.stride(-1) == 1, "the head dim of partial_out must be contiguous"
    assert partial_lse.shape == (n, b, h) and partial_lse.dtype == torch.float32
    out = partial_out.new_empty((b, h, d))
    out_lse = partial_lse.new_empty((b, h))
    rows = b * h
    if rows == 0:
        return out, out_lse
    cfg_r, cfg_d, cfg_w = lse_combine_tile(d, partial_out.element_size())
    block_r = block_rows or cfg_r
    block_d = block_d or cfg_d
    grid = (triton.cdiv(rows, block_r), triton.cdiv(d, block_d))
    _lse_combine_kernel[grid](
        partial_out,
        partial_lse,
        out,
        out_lse,
        rows,
        h,
        *partial_out.stride()[:3],
        *partial_lse.stride(),
        *out.stride()[:2],
        *out_lse.stride(),
        N=n,
        HEAD_DIM=d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        BASE2=base2,
        num_warps=num_warps or cfg_w,
    )
    return out, out_lse


def correct_attn_out_triton(
    out: torch.Tensor,
    all_lse: torch.Tensor,
    rank: int,
    *,
    num_blocks: int = 1,
    base2: bool = False,
    block_rows: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the correction: ``[B, H, D]`` + ``[N, B, H]`` fp32 -> ``[K, B, H/K, D]`` + ``[B, H]``.

    ``out`` may be strided with a contiguous last dim; ``all_lse`` any strided fp32 view.
    """
    b, h, d = out.shape
    n = all_lse.shape[0]
    assert out.stride(-1) == 1, "the head dim of out must be contiguous"
    assert all_lse.shape == (n, b, h) and all_lse.dtype == torch.float32
    assert 0 <= rank < n and h % num_blocks == 0
    y = out.new_empty((num_blocks, b, h // num_blocks, d))
    out_lse = all_lse.new_empty((b, h))
    rows = b * h
    if rows == 0:
        return y, out_lse
    cfg_r, cfg_d, cfg_w = lse_combine_launch_config(d, out.element_size())
    block_r = block_rows or cfg_r
    block_d = block_d or cfg_d
    grid = (triton.cdiv(rows, block_r), triton.cdiv(d, block_d))
    _correct_attn_out_kernel[grid](
        out,
        all_lse,
        y,
        out_lse,
        rank,
        rows,
        h,
        h // num_blocks,
        *out.stride()[:2],
        *all_lse.stride(),
        *y.stride()[:3],
        *out_lse.stride(),
        N=n,
        HEAD_DIM=d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        BASE2=base2,
        num_warps=num_warps or cfg_w,
    )
    return y, out_lse


def merge_partials_triton(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_rows: int = 32,
) -> None:
    """Merge 2 or 3 partials into ``out`` [L, H, D] and ``lse`` [L, H] fp32 (written in place).

    Same math as :func:`~cp_modules.reference.lse_merge.merge_partials_reference`, in one
    pass: each partial is read once where they lie (any strides with a contiguous D) and the
    result lands in the caller's rows, so no stacked copy is made.
    """
    num = len(outs)
    assert num in (2, 3) and len(lses) == num
    L, H, D = out.shape
    assert out.stride(2) == 1 and all(o.stride(2) == 1 and o.shape == out.shape for o in outs)
    assert lse.dtype == torch.float32 and all(x.dtype == torch.float32 for x in lses)
    if L * H == 0:
        return
    block_d = min(triton.next_power_of_2(D), 128)
    grid = (triton.cdiv(L * H, block_rows), triton.cdiv(D, block_d))
    if grid[1] > 1:
        # Column blocks after the first read the LSEs that the first may already have
        # overwritten: an input LSE on ``lse``'s storage is read from a copy.
        lses = [x.clone() if _shares_memory(x, lse) else x for x in lses]
    o = list(outs) + [outs[0]] * (3 - num)
    s = list(lses) + [lses[0]] * (3 - num)
    _merge_partials_kernel[grid](
        *o, *s, out, lse, L * H, H, D,
        *(x for t in o for x in t.stride()[:2]),
        *(x for t in s for x in t.stride()),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        NUM=num, BLOCK_R=block_rows, BLOCK_D=block_d,
    )  # fmt: skip


def merge_partials_into(
    outs: list[torch.Tensor], lses: list[torch.Tensor], out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Write the exact LSE merge of the partials into ``out`` / ``lse`` (views of the result).

    The Triton kernel on CUDA for 2-3 partials of a half or fp32 output; the reference
    otherwise (and a plain copy for a single partial).
    """
    if len(outs) == 1:
        if not _same_view(out, outs[0]):
            out.copy_(outs[0])
        lse.copy_(lses[0])
        return
    fused = out.is_cuda and len(outs) in (2, 3) and lse.dtype == torch.float32
    if fused:
        merge_partials_triton(outs, [x.float() for x in lses], out, lse)
        return
    o, s = merge_partials_reference(outs, lses, out.dtype)
    out.copy_(o)
    lse.copy_(s)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Same storage (conservative: overlapping or not).
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


# Launch parameters of the split merge (swept on the H200 over MLA's and GQA's split counts,
# docs/experiments/2026-12-02-split-merge.md): about 16 KB of fp32 partials per program (one
# that reads 2 KB spends its time starting, not loading: 0.9 TB/s at B = 8), 64 columns, so a
# long split list at B = 1 is still read by many SMs, and at most 4096 partial values a load.
_MERGE_SPLITS_BYTES = 16384
_MERGE_SPLITS_MAX_DV = 64
_MERGE_SPLITS_MAX_ROWS = 16
_MERGE_SPLITS_TILE = 4096


# Cached: every split decode launch (a layer of a decode step) asks for it.
@functools.cache
def merge_splits_launch_config(num_splits: int, dv: int) -> tuple[int, int, int, int]:
    """(BLOCK_R rows, BLOCK_DV columns, CHUNK_S splits per load, warps) of the split merge."""
    block_dv = min(_MERGE_SPLITS_MAX_DV, triton.next_power_of_2(dv))
    block_s = triton.next_power_of_2(num_splits)
    per_row = block_s * block_dv * 4
    block_r = 1
    while block_r < _MERGE_SPLITS_MAX_ROWS and 2 * block_r * per_row <= _MERGE_SPLITS_BYTES:
        block_r *= 2
    chunk_s = max(1, min(block_s, _MERGE_SPLITS_TILE // (block_r * block_dv)))
    return block_r, block_dv, chunk_s, 4


def merge_splits_triton(
    o_buf: torch.Tensor,
    l_buf: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    config: tuple[int, int, int, int] | None = None,
) -> None:
    """Merge split-KV partials ``o_buf`` [T, H, S, Dv] fp32 with base-2 LSEs ``l_buf``
    [T, H, S] into ``out`` [T, H, Dv] and natural-log ``lse`` [T, H] fp32 (written in place).
    ``config``: (rows, columns, splits per load, warps) per program instead of
    :func:`merge_splits_launch_config`'s (powers of two; for tuning)."""
    t, hq, num_splits, dv = o_buf.shape
    if o_buf.stride(3) != 1 or l_buf.stride(2) != 1:
        raise ValueError("merge_splits_triton needs contiguous columns and split LSEs")
    block_r, block_dv, chunk_s, warps = config or merge_splits_launch_config(num_splits, dv)
    rows = t * hq
    _merge_splits_kernel[(triton.cdiv(rows, block_r), triton.cdiv(dv, block_dv))](
        o_buf, l_buf, out, lse, rows, hq,
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2),
        l_buf.stride(0), l_buf.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        CHUNK_S=min(chunk_s, triton.next_power_of_2(num_splits)),
        DV=dv, BLOCK_DV=block_dv, BLOCK_R=block_r,
        num_warps=warps,
    )  # fmt: skip
