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
producer warp group; each compute warp group the parts it used last), whether a latent half
lands as one copy (a rank-3 view of the cache) or as 4 pieces, when a buffer is refilled (once
both warp groups are done with it, or in parts: rope piece, then each latent half, with the
scores taking the pieces in that order),
who zeroes the rows past the range, whether a split's last pair is peeled off, and
(``scale_p``) whether warp group 1's softmax starts from tile A's max, with P_A rescaled by
warp group 0 (:mod:`cp_modules.kernels.decode.mla_gluon_scale_p`).

An fp8 (e4m3) cache (``FP8``): a producer warp copies its tiles as bytes and 2 more warps
convert them to fp16 tiles in place (:mod:`cp_modules.kernels.decode.mla_gluon_fp8`); the
warp groups above then run unchanged, with fp16 Q and P.

Needs Triton's Gluon (3.6 API) and an sm_90 GPU; bf16/fp16 queries, bf16/fp16 or fp8 caches.
"""

from __future__ import annotations

import torch

from cp_modules.kernels.decode import mla_gluon_config as _cfg
from cp_modules.kernels.decode.mla_gluon_config import (
    _HEADS,
    _PIECE,
    _TILE,
    GLUON_MLA_VARIANTS,
    GluonMLAConfig,
    check_trace_buffer,
    choose_gluon_mla_num_splits,
    default_gluon_mla_config,
    gluon_mla_fp8_supported,
    gluon_mla_supported,
    merge_counters,
    reserve_merge_counters,
)
from cp_modules.kernels.decode.paged import _LOG2E, _split_buffers
from cp_modules.kernels.merge import merge_splits_triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
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
    "gluon_mla_fp8_supported",
    "gluon_mla_supported",
    "half_tile_view",
    "merge_counters",
    "paged_mla_attention_gluon",
    "reserve_merge_counters",
]

if HAS_GLUON:
    from cp_modules.kernels.decode.mla_gluon_epilogue import (
        _HALF_STORED,
        _SPUN,
        _TICKET,
    )
    from cp_modules.kernels.decode.mla_gluon_fp8 import (
        _Q_LANDED,
        _ROPE_LANDED,
        _mla_fp8_convert,
        _mla_fp8_loader,
    )
    from cp_modules.kernels.decode.mla_gluon_halves import _mla_producer
    from cp_modules.kernels.decode.mla_gluon_parts import (
        _ASYNC_WARPS,
        _BC,
        _BH,
        _BN,
        _ISSUE_ASYNC,
        _ISSUE_LOADER,
        _ISSUE_WG,
        _LANDED,
        _LAT,
        _mla_loader,
    )
    from cp_modules.kernels.decode.mla_gluon_scale_p import _STATS_A
    from cp_modules.kernels.decode.mla_gluon_wg import _mla_wg0, _mla_wg1

    @gluon.jit(do_not_specialize=["num_splits"])
    def _paged_mla_gluon_kernel(q_desc, c_desc, h_desc, CACHE, BT, SEQ_IDX, KV_LEN, OUT, LSE, FOUT, FLSE, COUNTER, TRACE_BUF,
                                KV_SCALE, qk_scale, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                                stride_ls, stride_btr, max_kv_len, num_splits,
                                H: gl.constexpr, NUM_HEAD_TILES: gl.constexpr, PAGE: gl.constexpr,
                                BOX_ROWS: gl.constexpr, PARTIAL: gl.constexpr,
                                ISSUE: gl.constexpr = 0, PEEL: gl.constexpr = False,
                                WG1_REGS: gl.constexpr = 256, LOADER_REGS: gl.constexpr = 24,
                                FUSED: gl.constexpr = False, OWN_REGS: gl.constexpr = False,
                                EARLY: gl.constexpr = False,
                                SPREAD: gl.constexpr = False, TRACE: gl.constexpr = False,
                                PZERO: gl.constexpr = False,
                                SCALE_P: gl.constexpr = False, SP_REFILL: gl.constexpr = False,
                                FP8: gl.constexpr = False, CONV_WARPS: gl.constexpr = 2,
                                CONV_REGS: gl.constexpr = 24,
                                HALVES: gl.constexpr = False):  # fmt: skip
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

        if FP8:  # fp16 products (mla_gluon_fp8)
            dt: gl.constexpr = gl.float16
        else:
            dt: gl.constexpr = q_desc.dtype  # type: ignore[no-redef]
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
        if FP8:
            for b in gl.static_range(2):
                mbarrier.init(k_ready.index(b * 16 + _ROPE_LANDED), count=1)
            mbarrier.init(k_ready.index(_Q_LANDED), count=1)
        if SCALE_P:
            mbarrier.init(k_ready.index(_STATS_A), count=1)
        if FUSED or SPREAD:
            mbarrier.init(k_ready.index(_HALF_STORED), count=1)
            mbarrier.init(k_ready.index(_SPUN if SPREAD else _TICKET), count=1)

        bt_row = row * stride_btr
        # HALVES: one producer warp (which may zero the rows past the range) or the compute
        # warp groups (ISSUE = wg), with early release.
        gl.static_assert(not HALVES or (EARLY and not FP8 and not SCALE_P and (
            ISSUE == _ISSUE_LOADER or (ISSUE == _ISSUE_WG and not PZERO))))
        # Warp group 0 issues the copies (inline, hoist), or one producer warp (loader) or two
        # (loader2: each its share of every tile's pieces, the first also Q) do.
        if FP8:
            # The 16-bit tiles from fp8 bytes: a producer warp copies, CONV_WARPS convert (the
            # schedule of loader-r232-early-pz: the landed barriers are PZERO's).
            gl.static_assert(ISSUE == _ISSUE_LOADER and EARLY and PZERO and not SCALE_P)
            gl.static_assert(not FUSED and not SPREAD)
            gl.warp_specialize(
                [
                    (_mla_wg0, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, q_desc, c_desc, BT,
                                bt_row, q_row, FOUT, FLSE, COUNTER, stride_os, stride_ls,
                                num_splits, H, NUM_HEAD_TILES, PAGE, BOX_ROWS, PARTIAL, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO,
                                SCALE_P, KV_SCALE, True)),
                    (_mla_wg1, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, FOUT, FLSE,
                                COUNTER, stride_os, stride_ls, num_splits, _LAT * _BC // 2, H,
                                NUM_HEAD_TILES, ISSUE, PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE,
                                TRACE_BUF, PZERO, SCALE_P, KV_SCALE, True)),
                    (_mla_fp8_loader, (q_lat, q_pe, k_lat, k_pe, k_ready, k_free, start, end,
                                       n_pairs, q_desc, c_desc, BT, bt_row, q_row, PAGE,
                                       BOX_ROWS)),
                    (_mla_fp8_convert, (q_lat, q_pe, k_lat, k_pe, vec_smem, q_bar, k_ready,
                                        start, end, n_pairs, q_desc.dtype == gl.float16)),
                ],
                [4, 1, CONV_WARPS],
                [WG1_REGS, LOADER_REGS, CONV_REGS],
            )  # fmt: skip
        elif ISSUE == _ISSUE_LOADER + 1:
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
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P,
                                None, False, h_desc, HALVES)),
                    (_mla_wg1, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, FOUT, FLSE,
                                COUNTER, stride_os, stride_ls, num_splits, _LAT * _BC // 2, H,
                                NUM_HEAD_TILES, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P,
                                None, False, c_desc, BT, bt_row, PAGE, BOX_ROWS, h_desc, HALVES)),
                    (_mla_producer, (q_lat, q_pe, k_lat, k_pe, q_bar, k_ready, k_free, start,
                                     end, n_pairs, q_desc, c_desc, BT, bt_row, q_row, PAGE,
                                     BOX_ROWS, 0, 1, EARLY, CACHE, ISSUE == _ISSUE_ASYNC, PZERO,
                                     SP_REFILL, h_desc, HALVES)),
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
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P,
                                None, False, h_desc, HALVES)),
                    (_mla_wg1, (q_lat, q_pe, k_lat, k_pe, p_smem, vec_smem, stats_b, q_bar, k_ready,
                                k_free, pa_bar, pb_bar, start, end, n_pairs, qk_scale, OUT,
                                out_row, stride_oh, LSE, lse_row, stride_lh, FOUT, FLSE,
                                COUNTER, stride_os, stride_ls, num_splits, _LAT * _BC // 2, H,
                                NUM_HEAD_TILES, ISSUE,
                                PEEL, FUSED, OWN_REGS, EARLY, SPREAD, TRACE, TRACE_BUF, PZERO, SCALE_P,
                                None, False, c_desc, BT, bt_row, PAGE, BOX_ROWS, h_desc, HALVES)),
                ],
                [4],
                [WG1_REGS],
            )  # fmt: skip


def half_tile_view(rows: torch.Tensor) -> tuple[list[int], list[int]]:
    """Shape and strides (elements) of the cache rows ``rows`` [N, W] viewed as [piece, row,
    column] with pieces of 64 columns: the half copies' descriptor (``half_copies``), whose box
    [4, r, 64] at (c, n, 0) holds the pieces c .. c + 3 of rows n .. n + r - 1."""
    n, width = rows.shape
    if width % _PIECE or rows.stride(1) != 1:
        raise ValueError(f"cache rows of a multiple of {_PIECE} contiguous columns, got {width}")
    return [width // _PIECE, n, _PIECE], [_PIECE, rows.stride(0), 1]


def _smem_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _fp8_smem_layout():
    # An fp8 piece of 64 columns: 64-byte rows.
    return gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)


def _fp8_scale(kv_scale, device: torch.device) -> torch.Tensor:
    if isinstance(kv_scale, torch.Tensor):
        return kv_scale
    return torch.full((1,), 1.0 if kv_scale is None else float(kv_scale), dtype=torch.float32,
                      device=device)  # fmt: skip


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
    kv_scale: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode through the Gluon kernel; the contract of
    :func:`~cp_modules.kernels.decode.mla.paged_mla_attention_kernel`.

    ``config`` picks a schedule (:class:`GluonMLAConfig`; default
    :func:`default_gluon_mla_config` of the block size); all compute the same attention. A
    schedule with ``fused_merge`` merges the KV splits inside the kernel (arrival counters
    from :func:`merge_counters`); the others launch :func:`merge_splits_triton` after it.
    ``trace`` (int64, 8 per program, at (row * S + split) * 8; :func:`check_trace_buffer`):
    each program's timeline for a probe
    (:func:`~cp_modules.kernels.decode.mla_gluon_parts._stamp`). An fp8 (e4m3) cache is read
    as ``fp8 * kv_scale`` (fp32 [1] or a float; None: 1.0) by the fp8 path
    (:mod:`~cp_modules.kernels.decode.mla_gluon_fp8`).

    Raises:
        ValueError: when the kernel cannot serve these inputs (:func:`gluon_mla_supported`,
            :func:`gluon_mla_fp8_supported`).
    """
    from cp_modules.kernels.decode.paged import _num_sms

    fp8 = cache.dtype == torch.float8_e4m3fn
    if fp8:
        why = gluon_mla_fp8_supported(q, cache, kv_lora_rank, kv_scale, config)
    else:
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
    extra, ks = {}, block_table  # (the scale is read only with FP8)
    if fp8:
        # The tiles as bytes, 64-byte pieces (mla_gluon_fp8).
        cache = cache.view(torch.uint8)
        extra = {"FP8": True, "CONV_WARPS": _cfg.FP8_CONVERT_WARPS,
                 "CONV_REGS": _cfg.FP8_CONVERT_REGS}  # fmt: skip
        ks = _fp8_scale(kv_scale, q.device)
    c2 = cache.view(nb * page, width)
    c_layout = _fp8_smem_layout() if fp8 else layout
    c_desc = TensorDescriptor(c2, list(c2.shape), list(c2.stride()), [box_rows, _PIECE], c_layout)
    # (a constant unless a half lands as one copy: with half_copies and 64-row boxes; smaller
    # boxes copy each piece through c_desc)
    h_desc = None
    if config.half_copies and box_rows == _TILE:
        # The cache as [piece, row, column] (a piece: 64 columns): a latent half's 4 pieces
        # of a box of rows land as one copy in 4 consecutive [rows, 64] tiles.
        h_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        shape, strides = half_tile_view(c2)
        h_desc = TensorDescriptor(c2, shape, strides, [4, box_rows, _PIECE], h_layout)
    _paged_mla_gluon_kernel[(t * head_tiles, num_splits)](
        q_desc, c_desc, h_desc, cache, block_table, query_seq_idx, query_kv_len, o_buf, l_buf, out, lse,
        counters, block_table if trace is None else trace, ks, scale * _LOG2E, *so[:2], so[2],
        *sl[:2], sl[2], block_table.stride(0), max_kv_len, num_splits,
        H=h, NUM_HEAD_TILES=head_tiles, PAGE=page, BOX_ROWS=box_rows,
        PARTIAL=num_splits > 1, **config.constexprs(num_splits, spread), **extra,
        TRACE=trace is not None, num_warps=4, launch_cooperative_grid=spread,
    )  # fmt: skip
    if num_splits > 1 and not (fused or spread):
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse
