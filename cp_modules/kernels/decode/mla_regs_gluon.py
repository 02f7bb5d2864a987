"""Gluon (Hopper) absorbed MLA paged decode on an fp8 (e4m3) latent cache with few heads: the
cache tile's bytes converted straight into the warp-group MMA's register operand; launcher only.

Shape letters as in :mod:`cp_modules.kernels.decode.mla`. The warp-specialised kernel of
:mod:`~.mla_tokens_gluon` converts each tile into an fp16 copy in shared memory that both
products read as their A operand; per 64-token tile that moves about 280 KB through the SM's
shared-memory path (the fp16 stores, both A reads, the B re-reads, the loads), and that path,
not DRAM, bounds it. Here the products take A from registers:

    S^T [64, BH] = K [64, 576] @ Q^T [576, BH]       (A = K, 9 pieces of 64 columns)
    O^T [512, BH] += V^T [512, 64] @ P^T [64, BH]   (A = V^T, 8 blocks of 64 rows, 4 steps of
                                                     16 tokens)

One warp group a program (one query, a tile of ``BH`` heads: :data:`REGS_HEAD_TILE` = 16, or
32; one KV split), two programs an SM. With more heads than a tile, the head tiles of one query
and split are neighbouring programs and read the same bytes (the second read mostly from L2). The tile's fp8 bytes come into a shared-memory ring by ``cp.async`` (16-byte copies, rows
past the range zero-filled, ``STAGES`` tiles, refilled ``STAGES - 1`` tiles ahead); each thread
reads its operand bytes back with 16-byte shared loads, converts them by the hardware's
``cvt.rn.f16x2.e4m3x2`` (exact: the e4m3 value itself) and hands the fp16 values to the MMA in
registers. Shared-memory traffic per tile: the copies' 37 KB, two reads of them (37 + 32 KB) and
the B operands (Q^T 18 KB, P^T 16 KB at 16 heads): about 140 KB.

A register operand fixes which elements each thread holds (for a 64 x 16 A block: rows
``r, r + 8`` of its warp's 16 and columns ``2q, 2q + 1, 2q + 8, 2q + 9``, ``q`` = lane mod 4).
So that every thread's bytes are 16 contiguous bytes of the cache, the products' inner and
outer indices are permuted; sums and per-row results do not depend on the order:

- the scores' inner index: piece ``c`` (0-7 latent, 8 rope) column ``16 s + 8 h + 2 q + e``
  holds latent column ``128 (c // 2) + 32 q + 16 (c % 2) + 4 s + 2 h + e`` (rope:
  ``512 + 16 q + 4 s + 2 h + e``); Q^T is stored with the same permutation
  (:mod:`~.mla_regs_query`; with :data:`REGS_Q_ONE_PASS` Q is read once, in its own order, and
  permuted in registers);
- the output's rows: block ``b`` row ``16 w + 8 i + l`` is latent dimension
  ``128 w + 16 l + 2 b + i``, undone when the output is stored (so a thread holds 16
  consecutive dimensions of each of its heads: with :data:`REGS_VECTOR_STORE` they are stored
  as 16-byte vectors from the registers);
- the tokens keep their order (P^T rows as S^T's).

The shared-memory tile is 4 planes of [64 tokens, 128 bytes] (latent) with the 128-byte
swizzle and one [64, 64] plane (rope); both read patterns are free of bank conflicts.

Each head's scores are multiplied by ``scale * log2(e) * kv_scale * 2**-shift`` (Q's rows
scaled by a power of two as in :mod:`~.mla_gluon_fp8`), the output by ``kv_scale / l``. Splits
and their merge as in :mod:`~.mla` (base-2 LSEs for the merge); with :data:`REGS_SPREAD_MERGE`
the merge runs inside the kernel, spread over each row's programs (:mod:`~.mla_regs_spread`).

Served (:func:`regs_gluon_supported`): an sm_90 GPU with Gluon, bf16/fp16 queries, an fp8
(e4m3) cache, at most 32 heads, ``kv_lora_rank`` 512 with a rope width of 64, cache rows of
16-byte multiples. Switch: :data:`FP8_REGS_GLUON` (read at every launch by the op's routing,
which sends it at most :data:`REGS_ROUTE_MAX_HEADS` heads).
Notes: docs/experiments/2026-12-07-mla-regs-gluon.md.
"""

from __future__ import annotations

import functools

import torch

from cp_modules.kernels.decode.arrival_counters import merge_counters
from cp_modules.kernels.decode.mla_regs_query import _q_layout
from cp_modules.kernels.decode.mla_regs_spread import (
    SPREAD_MAX_SPLITS,
    _merge_layout,
    spread_block_columns,
)
from cp_modules.kernels.decode.mla_tokens_gluon import few_heads_fp8_refusal, few_heads_outputs
from cp_modules.kernels.decode.paged import _LOG2E
from cp_modules.kernels.decode.tiles import _num_sms, _split_buffers, choose_mla_num_splits
from cp_modules.kernels.merge import merge_splits_triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__ = [
    "FP8_REGS_GLUON",
    "REGS_Q_ONE_PASS",
    "REGS_VECTOR_STORE",
    "REGS_HEAD_TILE",
    "REGS_PROGRAMS_PER_SM",
    "REGS_ROUTE_MAX_HEADS",
    "REGS_SPREAD_MERGE",
    "REGS_STAGES",
    "choose_regs_splits",
    "paged_mla_regs_gluon",
    "regs_gluon_supported",
]

# fp8 MLA caches with at most REGS_ROUTE_MAX_HEADS heads on an sm_90 GPU: this kernel before
# the warp-specialised one (mla_tokens_gluon). Read at every launch by the op's routing. On:
# on an H100 on 2026-12-07 at 16 heads, 1.49-1.87x of bf16 with the two switches below (the
# warp-specialised kernel, the default before: 1.29-1.63x in the same run).
FP8_REGS_GLUON = True
# The output stored as 16-byte vectors straight from the accumulators (_store_out) instead of
# 8 blocks converted through shared memory into scalar stores (_store_block): the epilogue
# 7.25 -> 2.25 µs a program on an H100 (B=1 128k, with REGS_Q_ONE_PASS).
REGS_VECTOR_STORE = True
# The query read once with 16-byte loads (mla_regs_query._q_perm1), in place of two passes of
# 4-byte loads (_q_perm: 68 a thread): the query 3.0 -> 2.0 µs a program on an H100. Both
# switches on: 73 GPU tests of the kernel against the reference passed on an H100.
REGS_Q_ONE_PASS = True
# Tiles in each program's shared-memory ring (2: two programs an SM).
REGS_STAGES = 2
# Heads a program (16 or 32; 32 takes 128 accumulator registers a thread and spills).
REGS_HEAD_TILE = 16
# Programs an SM that the automatic split count plans for: 1, 2, or 0 for the cheaper of both
# by :func:`choose_regs_splits`'s cost model.
REGS_PROGRAMS_PER_SM = 0
# The cost model's (µs a tile a program, µs fixed a program) at one and at two programs an SM:
# a fit of the kernel's own times on an H100 (16 heads; B=1 128k at 128 / 256 splits, B=8 32k
# at 16 / 32, B=8 128k at 32, B=64 32k at 4; each within 4 % of the fit), made before the two
# switches above cut ~6 µs of a program's fixed cost. With them its choice was still the
# fastest of half, the same and twice the splits at those four shapes, or within 2 % of it.
_REGS_COST = {1: (1.8, 16.0), 2: (3.3, 25.0)}
# The op's routing sends at most this many heads here (more: the warp-specialised kernel, which
# was faster at 32 heads on an H100 than two 16-head programs or one 32-head program).
REGS_ROUTE_MAX_HEADS = 16
# Several splits and at most one program an SM (B=1 128k, B=8 32k at 16 heads): the split merge
# inside the kernel, spread over the row's programs (a cooperative launch; mla_regs_spread),
# instead of the merge launch. Off until timed (built 2026-12-07, not yet run on a GPU).
REGS_SPREAD_MERGE = False
_TILE = 64  # tokens a tile (the wgmma's M for the scores)

if HAS_GLUON:
    _BN = gl.constexpr(_TILE)
    from cp_modules.kernels.decode.mla_gluon_fp8 import _CVT_ASM
    from cp_modules.kernels.decode.mla_gluon_parts import _stamp
    from cp_modules.kernels.decode.mla_gluon_parts import _sync_warp_group as _sync
    from cp_modules.kernels.decode.mla_regs_query import _q_perm, _q_perm1
    from cp_modules.kernels.decode.mla_regs_spread import _regs_spread_merge
    from cp_modules.kernels.decode.mla_tokens_gluon import (
        _online_softmax,
        _page_rows,
        _softmax_end,
    )

    @gluon.jit
    def _cvt(x):
        # e4m3 bytes -> fp16, four at a time (exact).
        return gl.inline_asm_elementwise(_CVT_ASM, "=r,=r,r", [x], dtype=gl.float16,
                                         is_pure=True, pack=4)  # fmt: skip

    @gluon.jit
    def _issue(k_lat, k_pe, slot, C8, BT, bt_row, n0, end, stride_cb, stride_cs,
               PAGE: gl.constexpr):  # fmt: skip
        # cp.async of tile [n0, n0 + 64) into ring slot ``slot``: the latent as 4 planes of
        # [64, 128] bytes, the rope as [64, 64]; rows past ``end`` are zero-filled, not read.
        lat_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 4, 8], [4, 1, 1], [2, 1, 0])
        pl = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, lat_l)))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, lat_l)))
        rows, ok = _page_rows(C8, BT, bt_row, n0, end, stride_cb, stride_cs, PAGE,
                             gl.SliceLayout(0, gl.SliceLayout(2, lat_l)))  # fmt: skip
        ptr = rows[None, :, None] + (pl[:, None, None] * 128 + cols[None, None, :])
        async_copy.async_copy_global_to_shared(k_lat.index(slot), ptr, mask=ok[None, :, None])
        pe_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        cols2 = gl.arange(0, 64, layout=gl.SliceLayout(0, pe_l))
        rows2, ok2 = _page_rows(C8, BT, bt_row, n0, end, stride_cb, stride_cs, PAGE,
                               gl.SliceLayout(1, pe_l))  # fmt: skip
        ptr2 = rows2[:, None] + (512 + cols2)[None, :]
        async_copy.async_copy_global_to_shared(k_pe.index(slot), ptr2, mask=ok2[:, None])

    @gluon.jit
    def _k_operand(y, a_op: gl.constexpr):
        # [64, 4 (q), 16 bytes] fp16 -> the A operand [64, 64]: byte 4 s + 2 h + e of lane
        # group q is column 16 s + 8 h + 2 q + e (registers renamed, no data moved).
        y = gl.reshape(y, [_BN, 4, 4, 2, 2])
        y = gl.permute(y, [0, 2, 3, 1, 4])
        return gl.convert_layout(gl.reshape(y, [_BN, 64]), a_op)

    @gluon.jit
    def _scores(k_lat, k_pe, slot, q_smem, s, mma: gl.constexpr):
        # S^T = K Q^T, K from the slot's bytes through registers (``k_lat``: the ring as
        # [STAGES * 4, 64, 128] planes).
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        # A latent plane [64, 128] as [64, 4 (q), 2 (piece), 16]: thread (warp w, lane
        # 4 l + q) holds rows 16 w + l and + 8, bytes 32 q + 16 c + [0, 16) of each.
        lat_ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[
                [0, 0, 0, 1],
                [0, 0, 0, 2],
                [0, 0, 0, 4],
                [0, 0, 0, 8],
                [0, 0, 1, 0],
                [8, 0, 0, 0],
            ],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]],
            block_bases=[],
            shape=[_BN, 4, 2, 16],
        )
        pe_ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [8, 0, 0]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]],
            block_bases=[],
            shape=[_BN, 4, 16],
        )
        x = _cvt(k_pe.index(slot).reshape([_BN, 4, 16]).load(pe_ld))
        s = warpgroup_mma(_k_operand(x, a_op), q_smem.index(8).permute((1, 0)), s,
                          use_acc=False, is_async=True)  # fmt: skip
        # (At most one piece in flight while the next is converted: an operand's registers
        # are held until its product completes.)
        for p in gl.static_range(4):
            y = _cvt(k_lat.index(4 * slot + p).reshape([_BN, 4, 2, 16]).load(lat_ld))
            y0, y1 = gl.split(gl.permute(y, [0, 1, 3, 2]))
            s = warpgroup_mma_wait(1, deps=(s,))
            s = warpgroup_mma(_k_operand(y0, a_op), q_smem.index(2 * p).permute((1, 0)), s,
                              is_async=True)  # fmt: skip
            s = warpgroup_mma_wait(1, deps=(s,))
            s = warpgroup_mma(_k_operand(y1, a_op), q_smem.index(2 * p + 1).permute((1, 0)),
                              s, is_async=True)  # fmt: skip
        return s

    @gluon.jit
    def _v_blocks(y):
        # [64 rows, 16 tokens, b2, b1, b0] -> the 8 blocks b = 4 b2 + 2 b1 + b0 in order.
        x0, x1 = gl.split(y)
        x00, x01 = gl.split(x0)
        x10, x11 = gl.split(x1)
        b0, b4 = gl.split(x00)
        b2, b6 = gl.split(x01)
        b1, b5 = gl.split(x10)
        b3, b7 = gl.split(x11)
        return b0, b1, b2, b3, b4, b5, b6, b7

    @gluon.jit
    def _pv(v, pp, o, a_op: gl.constexpr):
        return warpgroup_mma(gl.convert_layout(v, a_op), pp, o, is_async=True)

    @gluon.jit
    def _values(k_lat, slot, p_smem, o0, o1, o2, o3, o4, o5, o6, o7, mma: gl.constexpr):
        # O^T += V^T P^T, V^T from the slot's latent bytes through registers, 16 tokens a step.
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        # [4 planes, 16 tokens, 128 bytes]: thread (warp w, lane 4 l + q) holds plane w, bytes
        # 16 l + [0, 16) of tokens 2 q + {0, 1, 8, 9}.
        v_ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]],
            lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
            warp_bases=[[1, 0, 0], [2, 0, 0]],
            block_bases=[],
            shape=[4, 16, 128],
        )
        for st in gl.static_range(4):
            y = _cvt(k_lat.index(slot).slice(16 * st, 16, dim=1).load(v_ld))
            # byte 16 l + 2 b + i of plane w -> block b, row 16 w + 8 i + l
            y = gl.reshape(y, [4, 16, 8, 2, 2, 2, 2])  # [w, token, l, b2, b1, b0, i]
            y = gl.permute(y, [0, 6, 2, 1, 3, 4, 5])  # [w, i, l, token, b2, b1, b0]
            v0, v1, v2, v3, v4, v5, v6, v7 = _v_blocks(gl.reshape(y, [64, 16, 2, 2, 2]))
            pp = p_smem.slice(16 * st, 16, dim=0)
            # (the previous step's 8 products complete before this step's are issued: their
            # operands' registers are held until then)
            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
                0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))  # fmt: skip
            o0 = _pv(v0, pp, o0, a_op)
            o1 = _pv(v1, pp, o1, a_op)
            o2 = _pv(v2, pp, o2, a_op)
            o3 = _pv(v3, pp, o3, a_op)
            o4 = _pv(v4, pp, o4, a_op)
            o5 = _pv(v5, pp, o5, a_op)
            o6 = _pv(v6, pp, o6, a_op)
            o7 = _pv(v7, pp, o7, a_op)
        return o0, o1, o2, o3, o4, o5, o6, o7

    @gluon.jit
    def _store_block(o, b: gl.constexpr, inv, OUT, out_base, stride_oh, n_heads,
                     BH: gl.constexpr, out_l: gl.constexpr):  # fmt: skip
        # Block b's rows 16 w + 8 i + l are latent dimensions 128 w + 16 l + 2 b + i.
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
        dims = 128 * (r // 16) + 16 * (r % 8) + 2 * b + (r // 8) % 2
        heads = gl.arange(0, BH, layout=gl.SliceLayout(0, out_l))
        ptr = OUT + out_base + heads[None, :].to(gl.int64) * stride_oh + dims[:, None]
        dt: gl.constexpr = OUT.dtype.element_ty
        gl.store(ptr, gl.convert_layout((o * inv).to(dt), out_l), mask=(heads < n_heads)[None, :])

    @gluon.jit
    def _store_out(o0, o1, o2, o3, o4, o5, o6, o7, inv, OUT, out_base, stride_oh, n_heads,
                   BH: gl.constexpr, OUT_L: gl.constexpr):  # fmt: skip
        # Block b's rows 16 w + 8 i + l are latent dimensions 128 w + 16 l + 2 b + i, so each
        # thread holds 16 consecutive dimensions of each of its heads: the blocks joined and
        # their rows permuted (registers renamed) give OUT_L, whose stores are 16-byte vectors.
        y = gl.join(gl.join(gl.join(o0 * inv, o1 * inv), gl.join(o2 * inv, o3 * inv)),
                    gl.join(gl.join(o4 * inv, o5 * inv), gl.join(o6 * inv, o7 * inv)))  # fmt: skip
        y = gl.reshape(y, [4, 2, 8, BH, 2, 2, 2])  # [w, i, l, head, b0, b1, b2]
        y = gl.permute(y, [0, 2, 6, 5, 4, 1, 3])  # [w, l, b2, b1, b0, i, head]
        dt: gl.constexpr = OUT.dtype.element_ty
        y = gl.convert_layout(gl.reshape(y, [512, BH]).to(dt), OUT_L)
        dims = gl.arange(0, 512, layout=gl.SliceLayout(1, OUT_L))
        heads = gl.arange(0, BH, layout=gl.SliceLayout(0, OUT_L))
        ptr = OUT + out_base + heads[None, :].to(gl.int64) * stride_oh + dims[:, None]
        gl.store(ptr, y, mask=(heads < n_heads)[None, :])

    @gluon.jit(do_not_specialize=["num_splits"])
    def _mla_regs_gluon_kernel(Q, C8, BT, SEQ_IDX, KV_LEN, OUT, LSE, KV_SCALE, qk_scale,
                               stride_qt, stride_qh, stride_cb, stride_cs, stride_btr,
                               stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                               stride_ls, max_kv_len, num_splits, TRACE_BUF, COUNTER, FOUT, FLSE,
                               stride_fot, stride_foh, stride_flt, stride_flh,
                               H: gl.constexpr, BH: gl.constexpr, PAGE: gl.constexpr,
                               PARTIAL: gl.constexpr, STAGES: gl.constexpr,
                               VEC_STORE: gl.constexpr, OUT_L: gl.constexpr,
                               Q_ONE_PASS: gl.constexpr = False, Q_L: gl.constexpr = None,
                               TRACE: gl.constexpr = False, SPREAD: gl.constexpr = False,
                               CB: gl.constexpr = 4, S_P2: gl.constexpr = 128,
                               MERGE_L: gl.constexpr = None):  # fmt: skip
        # TRACE: the global timer into the program's 8 trace slots (head tile 0's programs): 0 at
        # the start, 1 the query stored, 2 the first tile landed, 3 the loop done, 4 the end; 6
        # the SM.
        _stamp(TRACE_BUF, 0, num_splits, TRACE)
        t = gl.program_id(0)  # one program a query, KV split and tile of BH heads
        split = gl.program_id(1)
        h0 = gl.program_id(2) * BH
        n_heads = H - h0
        t64 = t.to(gl.int64)
        row = gl.load(SEQ_IDX + t).to(gl.int64)
        kv_len = gl.maximum(gl.minimum(gl.load(KV_LEN + t).to(gl.int32), max_kv_len), 0)
        chunk = gl.cdiv(gl.cdiv(kv_len, num_splits), _BN) * _BN
        start = split * chunk
        end = gl.minimum(start + chunk, kv_len)
        n_tiles = gl.maximum(gl.cdiv(end - start, _BN), 0)
        bt_row = row * stride_btr

        lat_sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                    rank=3)  # fmt: skip
        pe_sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8,
                                                   rank=2)  # fmt: skip
        q_sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                  rank=2)  # fmt: skip
        p_sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BH, element_bitwidth=16,
                                                  rank=2)  # fmt: skip
        k_lat = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, _BN, 128], lat_sh)
        plane_sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                      element_bitwidth=8, rank=2)  # fmt: skip
        k_planes = k_lat._reinterpret(gl.uint8, [STAGES * 4, _BN, 128], plane_sh)
        k_pe = gl.allocate_shared_memory(gl.uint8, [STAGES, _BN, 64], pe_sh)
        q_smem = gl.allocate_shared_memory(gl.float16, [9, BH, 64], q_sh)
        p_smem = gl.allocate_shared_memory(gl.float16, [_BN, BH], p_sh)

        # The ring's first STAGES - 1 tiles (a group each, empty past the split).
        for i in gl.static_range(STAGES - 1):
            _issue(k_lat, k_pe, i, C8, BT, bt_row, start + i * _BN, end, stride_cb, stride_cs,
                   PAGE)  # fmt: skip
            async_copy.commit_group()

        if Q_ONE_PASS:
            inv_q = _q_perm1(Q, q_smem, t64 * stride_qt + h0 * stride_qh, stride_qh, n_heads,
                             BH, Q_L)  # fmt: skip
        else:
            inv_q = _q_perm(Q, q_smem, t64 * stride_qt + h0 * stride_qh, stride_qh, n_heads,
                            BH)  # fmt: skip
        fence_async_shared()
        _stamp(TRACE_BUF, 1, num_splits, TRACE)
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16]
        )
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        kv_scale = gl.load(KV_SCALE)
        col_scale = gl.convert_layout(qk_scale * kv_scale * inv_q, col_l)[None, :]
        m_i = gl.full([BH], float("-inf"), gl.float32, col_l)
        l_acc = gl.zeros([_BN, BH], gl.float32, mma)
        o0 = gl.zeros([64, BH], gl.float32, mma)
        o1 = gl.zeros([64, BH], gl.float32, mma)
        o2 = gl.zeros([64, BH], gl.float32, mma)
        o3 = gl.zeros([64, BH], gl.float32, mma)
        o4 = gl.zeros([64, BH], gl.float32, mma)
        o5 = gl.zeros([64, BH], gl.float32, mma)
        o6 = gl.zeros([64, BH], gl.float32, mma)
        o7 = gl.zeros([64, BH], gl.float32, mma)
        rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, mma))
        s = gl.zeros([_BN, BH], gl.float32, mma)
        for i in range(n_tiles):
            slot = i % STAGES
            # Tile i has landed (this thread's copies; the barrier: everyone's), and every
            # thread is done with the slot that the refill below overwrites (tile i - 1's).
            async_copy.wait_group(STAGES - 2)
            _sync()
            if TRACE:
                if i == 0:
                    _stamp(TRACE_BUF, 2, num_splits, TRACE)
            _issue(k_lat, k_pe, (i + STAGES - 1) % STAGES, C8, BT, bt_row,
                   start + (i + STAGES - 1) * _BN, end, stride_cb, stride_cs, PAGE)  # fmt: skip
            async_copy.commit_group()
            s = _scores(k_planes, k_pe, slot, q_smem, s, mma)
            s = warpgroup_mma_wait(0, deps=(s,))
            p, alpha, m_new, l_acc = _online_softmax(s, rows, end - (start + i * _BN),
                                                     col_scale, m_i, l_acc)  # fmt: skip
            p_smem.store(p.to(gl.float16))
            fence_async_shared()
            _sync()
            o0, o1, o2, o3, o4, o5, o6, o7 = _values(
                k_lat, slot, p_smem, o0 * alpha, o1 * alpha, o2 * alpha, o3 * alpha,
                o4 * alpha, o5 * alpha, o6 * alpha, o7 * alpha, mma)  # fmt: skip
            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
                0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))  # fmt: skip
            m_i = m_new
        async_copy.wait_group(0)
        _stamp(TRACE_BUF, 3, num_splits, TRACE)

        inv, lse2 = _softmax_end(l_acc, m_i, kv_scale)
        out_base = t64 * stride_ot + split * stride_os + h0 * stride_oh
        if VEC_STORE:
            _store_out(o0, o1, o2, o3, o4, o5, o6, o7, inv, OUT, out_base, stride_oh, n_heads,
                       BH, OUT_L)  # fmt: skip
        else:
            out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
            _store_block(o0, 0, inv, OUT, out_base, stride_oh, n_heads, BH, out_l)
            _store_block(o1, 1, inv, OUT, out_base, stride_oh, n_heads, BH, out_l)
            _store_block(o2, 2, inv, OUT, out_base, stride_oh, n_heads, BH, out_l)
            _store_block(o3, 3, inv, OUT, out_base, stride_oh, n_heads, BH, out_l)
            _store_block(o4, 4, inv, OUT, out_base, stride_oh, n_heads, BH, out_l)
            _store_block(o5, 5, inv, OUT, out_base, stride_oh, n_heads, BH, out_l)
            _store_block(o6, 6, inv, OUT, out_base, stride_oh, n_heads, BH, out_l)
            _store_block(o7, 7, inv, OUT, out_base, stride_oh, n_heads, BH, out_l)
        hl = gl.arange(0, BH, layout=col_l)
        if not PARTIAL:
            lse2 = lse2 * 0.6931471805599453
        lse_base = t64 * stride_lt + split * stride_ls + h0 * stride_lh
        gl.store(LSE + lse_base + hl.to(gl.int64) * stride_lh, lse2, mask=hl < n_heads)
        if SPREAD:
            # The row's splits merged here, spread over its programs (mla_regs_spread).
            _regs_spread_merge(COUNTER, t * gl.num_programs(2) + gl.program_id(2), split,
                               num_splits, OUT, t64 * stride_ot + h0 * stride_oh, LSE,
                               t64 * stride_lt + h0 * stride_lh, stride_oh, stride_os,
                               stride_lh, stride_ls, n_heads, FOUT,
                               t64 * stride_fot + h0 * stride_foh, stride_foh, FLSE,
                               t64 * stride_flt + h0 * stride_flh, stride_flh, BH, CB, S_P2,
                               MERGE_L)  # fmt: skip
        _stamp(TRACE_BUF, 4, num_splits, TRACE)


@functools.lru_cache(maxsize=4)
def _out_layout(bh: int):
    """The output's [512 latent dims, bh heads] layout: the products' accumulator layout with its
    rows permuted as :func:`_store_out` does (thread (warp w, lane 4 l + q) holds dims
    128 w + 16 l + [0, 16) of heads 2 q + {0, 1} + 8 j), its 16 dims first in the registers."""
    heads = [[0, 1]] + [[0, 8 << k] for k in range((bh // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0]] + heads,
        lane_bases=[[0, 2], [0, 4], [16, 0], [32, 0], [64, 0]],
        warp_bases=[[128, 0], [256, 0]],
        block_bases=[],
        shape=[512, bh],
    )


@functools.lru_cache(maxsize=1024)
def choose_regs_splits(programs: int, max_kv_len: int, num_sms: int, per_sm: int = 0) -> int:
    """KV splits for ``programs`` (query, head-tile) programs of up to ``max_kv_len`` tokens.

    For each of one and two programs an SM (``per_sm`` 0: both; else that one), the split count
    of :func:`~.tiles.choose_mla_num_splits` with the fixed cost of :data:`_REGS_COST` in tiles;
    then the one whose modelled time (waves x (tiles a split x µs a tile + fixed µs)) is lower.
    One program an SM runs each tile faster, two hide more of the fixed cost: the first wins at
    few tiles a program (B=1 128k, B=8 32k at 16 heads), the second at many. Memoised: it runs
    on every eager decode call.
    """
    tiles = -(-max(1, max_kv_len) // _TILE)
    best: tuple[float, int] | None = None
    for pps in (1, 2) if per_sm == 0 else (per_sm,):
        tile_us, fixed_us = _REGS_COST[pps]
        s = choose_mla_num_splits(
            programs, max_kv_len, num_sms, _TILE, pps, split_cost_tiles=fixed_us / tile_us
        )
        waves = -(-programs * s // (num_sms * pps))
        cost = waves * (-(-tiles // s) * tile_us + fixed_us)
        if best is None or cost < best[0]:
            best = (cost, s)
    assert best is not None
    return best[1]


def regs_gluon_supported(q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """None when :func:`paged_mla_regs_gluon` serves these inputs, else why not (the same
    inputs as :func:`~.mla_tokens_gluon.tokens_gluon_supported`)."""
    return few_heads_fp8_refusal(q, cache, kv_lora_rank, "the Gluon register-operand kernel")


def paged_mla_regs_gluon(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    *,
    kv_scale: torch.Tensor | None = None,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode on an fp8 latent cache, the products' A operand converted in
    registers: the contract of :func:`~cp_modules.kernels.decode.mla.paged_mla_attention_kernel`
    (``kv_scale`` fp32 [1]; None: 1.0). ``trace``: an int64 [queries x splits x 8] buffer for
    each program's timeline (a probe's; the kernel's TRACE slots).

    Raises:
        ValueError: for inputs :func:`regs_gluon_supported` refuses, naming why.
    """
    q, out, lse = few_heads_outputs(q, kv_lora_rank, regs_gluon_supported(q, cache, kv_lora_rank))
    t, h, _ = q.shape
    if t == 0:
        return out, lse
    page = cache.shape[1]
    max_kv_len = block_table.shape[1] * page
    bh = 16 if h <= 16 else REGS_HEAD_TILE
    head_tiles = -(-h // bh)
    if not num_splits:
        num_splits = choose_regs_splits(
            t * head_tiles, max_kv_len, _num_sms(q.device), REGS_PROGRAMS_PER_SM
        )
    o_buf, l_buf, so, sl = _split_buffers(out, lse, num_splits)
    if kv_scale is None:
        kv_scale = torch.ones(1, dtype=torch.float32, device=cache.device)
    c8 = cache.view(torch.uint8)
    programs = t * num_splits * head_tiles
    spread = (REGS_SPREAD_MERGE and 1 < num_splits <= SPREAD_MAX_SPLITS
              and programs <= _num_sms(q.device))  # fmt: skip
    s_p2, cb = spread_block_columns(num_splits) if spread else (1, 4)
    counters = merge_counters(q.device, t * head_tiles) if spread else block_table
    _mla_regs_gluon_kernel[(t, num_splits, head_tiles)](
        q, c8, block_table, query_seq_idx, query_kv_len, o_buf, l_buf, kv_scale, scale * _LOG2E,
        q.stride(0), q.stride(1), c8.stride(0), c8.stride(1), block_table.stride(0),
        *so, *sl, max_kv_len, num_splits, kv_scale if trace is None else trace, counters, out,
        lse, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        H=h, BH=bh, PAGE=page, PARTIAL=num_splits > 1, STAGES=REGS_STAGES,
        VEC_STORE=REGS_VECTOR_STORE, OUT_L=_out_layout(bh), Q_ONE_PASS=REGS_Q_ONE_PASS,
        Q_L=_q_layout(bh) if REGS_Q_ONE_PASS else None, TRACE=trace is not None,
        SPREAD=spread, CB=cb, S_P2=s_p2, MERGE_L=_merge_layout(s_p2, cb, bh) if spread else None,
        num_warps=4, launch_cooperative_grid=spread,
    )  # fmt: skip
    if num_splits > 1 and not spread:
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse
