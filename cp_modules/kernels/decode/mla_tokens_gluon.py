"""Gluon (Hopper) absorbed MLA paged decode on an fp8 (e4m3) latent cache with few heads, the
tokens on the warp-group MMA's M side, warp-specialised; launcher only.

Shape letters as in :mod:`cp_modules.kernels.decode.mla`. The Triton tokens-on-M kernel
(:mod:`~.mla_tokens`) runs one instruction stream a program: each 64-token tile goes bytes ->
registers -> conversion -> shared memory -> products in order, with two programs an SM, and
waits on each step's latency. Here each program (one query, ``BH`` = 16 or 32 heads, one KV
split) is split into partitions that work on different tiles at once:

- two conversion partitions (4 warps each; ``TOK_CONVERT_REGS`` registers): partition ``j``
  owns tile slot ``j`` and the tiles ``2k + j`` of the split. It loads a tile's 576 bytes a
  token from the paged cache straight into registers (16-byte loads; rows past the range are
  not read and become zeros), converts them by the hardware's ``cvt.rn.f16x2.e4m3x2`` (exact:
  the e4m3 value itself) and stores the fp16 tile ([64, 576] as 9 pieces of 64 columns,
  128-byte swizzle) into its slot once the products are done with the slot's last tile; then
  it loads its next tile's bytes while the products run.
- the product warp group (the default partition, 4 warps): Q into fp16 in shared memory (each
  head's row times the power of two that takes its largest element into ``[2**14, 2**15)``, as
  in :mod:`~.mla_gluon_fp8`), then per tile

      S^T [64, BH] = K [64, 576] @ Q^T [576, BH]       (9 wgmma, K from the slot)
      O^T [512, BH] += V^T [512, 64] @ P^T [64, BH]   (8 wgmma, V^T a transposed view of the
                                                       slot's latent pieces; P fp16)

  with the online softmax along the tokens (M): the max across the warp group per tile, the
  row sums kept per element and reduced once at the end. It frees the slot after the value
  products.

Each head's scores are multiplied by ``scale * log2(e) * kv_scale * 2**-shift``, the output by
``kv_scale / l``. Splits and their merge as in :mod:`~.mla` (base-2 LSEs for the merge).

Served (:func:`tokens_gluon_supported`): an sm_90 GPU with Gluon, bf16/fp16 queries, an fp8
(e4m3) cache, at most 32 heads, ``kv_lora_rank`` a multiple of 64 up to 512 and a rope width
of 64. Switch: :data:`FP8_TOKENS_GLUON` (read at every launch by the op's routing).
Notes: docs/experiments/2026-12-06-mla-tokens-gluon.md.
"""

from __future__ import annotations

import torch

from cp_modules.kernels.decode.paged import _LOG2E
from cp_modules.kernels.decode.tiles import _num_sms, _split_buffers, choose_mla_num_splits
from cp_modules.kernels.merge import merge_splits_triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

__all__ = [
    "FP8_TOKENS_GLUON",
    "TOK_CONVERT_REGS",
    "TOK_PIPELINE",
    "paged_mla_tokens_gluon",
    "tokens_gluon_supported",
]

# fp8 MLA caches with at most 32 heads on an sm_90 GPU: this kernel instead of the Triton
# tokens-on-M kernel (mla_tokens). Read at every launch by the op's routing. On since timed
# (2026-12-06, H100, DeepSeek's latent, B*ctx 131k-2M): fp8 1.32-1.66x of the bf16 kernel's
# speed at 16 heads and 1.38-1.55x at 32, where the Triton kernels give 0.88-0.89x and
# 0.57-0.74x (bench_fp8_kv rows "variant TOKENS_GLUON=...").
FP8_TOKENS_GLUON = True
# Registers of each conversion partition's threads (setmaxnreg; a multiple of 8).
TOK_CONVERT_REGS = 128
# The product warp group issues the next tile's scores before it waits for this tile's value
# products (both in flight at once). Read at every launch.
TOK_PIPELINE = False
_MAX_HEADS = 32
_TILE = 64  # tokens a tile (the wgmma's M)
_PIECE = 64  # columns a shared-memory piece (128 bytes of fp16)

if HAS_GLUON:
    _BN = gl.constexpr(_TILE)
    _BC = gl.constexpr(_PIECE)
    from cp_modules.kernels.decode.mla_gluon_fp8 import _CVT_ASM, _q_pow2
    from cp_modules.kernels.decode.mla_gluon_parts import _sync_warp_group as _sync

    @gluon.jit
    def _page_rows(C, BT, bt_row, n0, end, stride_cb, stride_cs, PAGE: gl.constexpr,
                   lay: gl.constexpr):  # fmt: skip
        # Each token row's address (in C's elements) of tile [n0, n0 + 64) of a paged cache,
        # and whether it is in range (``lay``: the row vector's layout).
        r = gl.arange(0, _BN, layout=lay)
        n = n0 + r
        ok = n < end
        if PAGE % _BN == 0:
            blk = gl.load(BT + bt_row + n0 // PAGE, mask=n0 < end, other=0).to(gl.int64)
            pos = (n0 % PAGE + r).to(gl.int64)
        else:
            blk = gl.load(BT + bt_row + n // PAGE, mask=ok, other=0).to(gl.int64)
            pos = (n % PAGE).to(gl.int64)
        return C + (blk * stride_cb + pos * stride_cs), ok

    @gluon.jit
    def _online_softmax(s, rows, valid, col_scale, m_i, l_acc):
        # One tile of the softmax along the tokens (S^T's rows; rows past ``valid`` masked):
        # P^T, the rescale of the running output, the new running max, and the row sums kept
        # per element.
        s = gl.where((rows < valid)[:, None], s * col_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp2(m_i - m_new)[None, :]
        p = gl.exp2(s - m_new[None, :])
        return p, alpha, m_new, l_acc * alpha + p

    @gluon.jit
    def _softmax_end(l_acc, m_i, kv_scale):
        # The output's factor (kv_scale / l, 1 for an empty row) and the base-2 LSE (-inf for
        # an empty row).
        l_i = gl.sum(l_acc, 0)
        nonempty = l_i > 0.0
        inv = (kv_scale / gl.where(nonempty, l_i, 1.0))[None, :]
        return inv, gl.where(nonempty, m_i + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))

    @gluon.jit
    def _tile_rows(C16, BT, bt_row, n0, end, stride_cb, stride_cs, PAGE: gl.constexpr,
                   lay: gl.constexpr):  # fmt: skip
        # Each token row's int16 address of tile [n0, n0 + 64) and whether it is in range.
        rows, ok = _page_rows(C16, BT, bt_row, n0, end, stride_cb, stride_cs, PAGE,
                              gl.SliceLayout(1, lay))  # fmt: skip
        return rows[:, None], ok[:, None]

    @gluon.jit
    def _load_piece(rows, ok, c: gl.constexpr, lay: gl.constexpr):
        # Piece c's 64 bytes of each row as 32 int16 pairs (rows past the range: zeros).
        cols = gl.arange(0, _BC // 2, layout=gl.SliceLayout(0, lay))
        return gl.load(rows + (c * (_BC // 2) + cols)[None, :], mask=ok, other=0)

    @gluon.jit
    def _load_tile(C16, BT, bt_row, n0, end, stride_cb, stride_cs, PAGE: gl.constexpr,
                   lay: gl.constexpr):  # fmt: skip
        rows, ok = _tile_rows(C16, BT, bt_row, n0, end, stride_cb, stride_cs, PAGE, lay)
        x0 = _load_piece(rows, ok, 0, lay)
        x1 = _load_piece(rows, ok, 1, lay)
        x2 = _load_piece(rows, ok, 2, lay)
        x3 = _load_piece(rows, ok, 3, lay)
        x4 = _load_piece(rows, ok, 4, lay)
        x5 = _load_piece(rows, ok, 5, lay)
        x6 = _load_piece(rows, ok, 6, lay)
        x7 = _load_piece(rows, ok, 7, lay)
        x8 = _load_piece(rows, ok, 8, lay)
        return x0, x1, x2, x3, x4, x5, x6, x7, x8

    @gluon.jit
    def _store_piece(x, k32, i):
        y = gl.inline_asm_elementwise(_CVT_ASM, "=r,=r,r", [x], dtype=gl.int32, is_pure=True,
                                      pack=2)  # fmt: skip
        k32.index(i).store(y)

    @gluon.jit
    def _tok_convert(k_smem, ready, free, C16, BT, bt_row, start, end, n_tiles, stride_cb,
                     stride_cs, PAGE: gl.constexpr, J: gl.constexpr):  # fmt: skip
        # Conversion partition J: tiles J, J + 2, ... of the split into slot J.
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
        lay32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                                   rank=2)  # fmt: skip
        k32 = k_smem._reinterpret(gl.int32, [k_smem.shape[0], _BN, _BC // 2], lay32)
        base = J * 9
        n_mine = (n_tiles - J + 1) // 2
        x0, x1, x2, x3, x4, x5, x6, x7, x8 = _load_tile(
            C16, BT, bt_row, start + J * _BN, end, stride_cb, stride_cs, PAGE, lay)  # fmt: skip
        for k in range(n_mine):
            if k > 0:
                mbarrier.wait(free.index(J), (k - 1) & 1)
            _store_piece(x0, k32, base + 0)
            _store_piece(x1, k32, base + 1)
            _store_piece(x2, k32, base + 2)
            _store_piece(x3, k32, base + 3)
            _store_piece(x4, k32, base + 4)
            _store_piece(x5, k32, base + 5)
            _store_piece(x6, k32, base + 6)
            _store_piece(x7, k32, base + 7)
            _store_piece(x8, k32, base + 8)
            fence_async_shared()
            _sync()
            mbarrier.arrive(ready.index(J))
            # The next tile's bytes while the products run (past the split: nothing read).
            n0 = start + (2 * (k + 1) + J) * _BN
            x0, x1, x2, x3, x4, x5, x6, x7, x8 = _load_tile(
                C16, BT, bt_row, n0, end, stride_cb, stride_cs, PAGE, lay)  # fmt: skip

    @gluon.jit
    def _q_fp16(Q, q_smem, q_base, stride_qh, H: gl.constexpr, BH: gl.constexpr,
                R: gl.constexpr):  # fmt: skip
        # Q's rows into fp16 in shared memory, each times 2**shift (its largest element to
        # [2**14, 2**15)); returns 2**-shift per head.
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        heads = gl.arange(0, BH, layout=gl.SliceLayout(1, lay))
        cols = gl.arange(0, _BC, layout=gl.SliceLayout(0, lay))
        ptrs = Q + q_base + heads[:, None].to(gl.int64) * stride_qh + cols[None, :]
        hm = (heads < H)[:, None]
        NP: gl.constexpr = R // _BC + 1
        amax = gl.zeros([BH], gl.float32, gl.SliceLayout(1, lay))
        for c in gl.static_range(NP):
            x = gl.load(ptrs + c * _BC, mask=hm, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(x), 1))
        mult, inv = _q_pow2(amax)
        for c in gl.static_range(NP):
            x = gl.load(ptrs + c * _BC, mask=hm, other=0.0).to(gl.float32)
            q_smem.index(c).store((x * mult[:, None]).to(gl.float16))
        return inv

    @gluon.jit
    def _scores(k_smem, q_smem, base, s, NL: gl.constexpr):
        # S^T = K Q^T over the rope piece and the NL latent pieces of the slot at base.
        s = warpgroup_mma(k_smem.index(base + NL), q_smem.index(NL).permute((1, 0)), s,
                          use_acc=False, is_async=True)  # fmt: skip
        for c in gl.static_range(NL):
            s = warpgroup_mma(k_smem.index(base + c), q_smem.index(c).permute((1, 0)), s,
                              is_async=True)  # fmt: skip
        return s

    @gluon.jit
    def _pv(k_smem, idx, p_smem, o):
        # O^T piece += V^T P^T: the latent piece transposed (a 16-bit A operand read MN-major).
        return warpgroup_mma(k_smem.index(idx).permute((1, 0)), p_smem, o, is_async=True)

    @gluon.jit
    def _tok_products(q_smem, k_smem, p_smem, ready, free, Q, q_base, stride_qh, KV_SCALE,
                      qk_scale, start, end, n_tiles, OUT, out_base, stride_oh, LSE, lse_base,
                      stride_lh, H: gl.constexpr, BH: gl.constexpr, R: gl.constexpr,
                      PARTIAL: gl.constexpr, PIPE: gl.constexpr):  # fmt: skip
        NL: gl.constexpr = R // _BC
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16]
        )
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        inv_q = _q_fp16(Q, q_smem, q_base, stride_qh, H, BH, R)
        fence_async_shared()
        _sync()
        kv_scale = gl.load(KV_SCALE)
        col_scale = gl.convert_layout(qk_scale * kv_scale * inv_q, col_l)[None, :]
        m_i = gl.full([BH], float("-inf"), gl.float32, col_l)
        l_acc = gl.zeros([_BN, BH], gl.float32, mma)
        o0 = gl.zeros([_BC, BH], gl.float32, mma)
        o1 = gl.zeros([_BC, BH], gl.float32, mma)
        o2 = gl.zeros([_BC, BH], gl.float32, mma)
        o3 = gl.zeros([_BC, BH], gl.float32, mma)
        o4 = gl.zeros([_BC, BH], gl.float32, mma)
        o5 = gl.zeros([_BC, BH], gl.float32, mma)
        o6 = gl.zeros([_BC, BH], gl.float32, mma)
        o7 = gl.zeros([_BC, BH], gl.float32, mma)
        rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, mma))
        s = gl.zeros([_BN, BH], gl.float32, mma)
        for i in range(n_tiles):
            j = i % 2
            base = j * 9
            if (not PIPE) or i == 0:  # (PIPE: later tiles' scores were issued last iteration)
                mbarrier.wait(ready.index(j), (i // 2) & 1)
                s = warpgroup_mma_wait(0, deps=(_scores(k_smem, q_smem, base, s, NL),))
            p, alpha, m_new, l_acc = _online_softmax(s, rows, end - (start + i * _BN),
                                                     col_scale, m_i, l_acc)  # fmt: skip
            p_smem.store(p.to(gl.float16))
            fence_async_shared()
            _sync()
            o0 = _pv(k_smem, base + 0, p_smem, o0 * alpha)
            o1 = _pv(k_smem, base + 1, p_smem, o1 * alpha)
            o2 = _pv(k_smem, base + 2, p_smem, o2 * alpha)
            o3 = _pv(k_smem, base + 3, p_smem, o3 * alpha)
            o4 = _pv(k_smem, base + 4, p_smem, o4 * alpha)
            o5 = _pv(k_smem, base + 5, p_smem, o5 * alpha)
            o6 = _pv(k_smem, base + 6, p_smem, o6 * alpha)
            o7 = _pv(k_smem, base + 7, p_smem, o7 * alpha)
            if PIPE:
                # The next tile's scores under this tile's value products: wait for all but
                # the 9 score groups just issued, free the slot, then wait for the scores.
                # (After the last tile the scores of the same slot again, not used: the wait
                # counts stay static. No tile of the split refills the slot after it.)
                nxt = 9 - base
                if i + 1 < n_tiles:
                    mbarrier.wait(ready.index(1 - j), ((i + 1) // 2) & 1)
                else:
                    nxt = base
                s_next = _scores(k_smem, q_smem, nxt, s, NL)
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
                    NL + 1, deps=(o0, o1, o2, o3, o4, o5, o6, o7))  # fmt: skip
                mbarrier.arrive(free.index(j))
                s = warpgroup_mma_wait(0, deps=(s_next,))
            else:
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
                    0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))  # fmt: skip
                mbarrier.arrive(free.index(j))
            m_i = m_new

        inv, lse2 = _softmax_end(l_acc, m_i, kv_scale)
        out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, gl.num_warps()], [0, 1])
        dims = gl.arange(0, _BC, layout=gl.SliceLayout(1, out_l))
        heads = gl.arange(0, BH, layout=gl.SliceLayout(0, out_l))
        optr = OUT + out_base + heads[None, :].to(gl.int64) * stride_oh + dims[:, None]
        hm = (heads < H)[None, :]
        dt: gl.constexpr = OUT.dtype.element_ty
        gl.store(optr, gl.convert_layout((o0 * inv).to(dt), out_l), mask=hm)
        gl.store(optr + _BC, gl.convert_layout((o1 * inv).to(dt), out_l), mask=hm)
        gl.store(optr + 2 * _BC, gl.convert_layout((o2 * inv).to(dt), out_l), mask=hm)
        gl.store(optr + 3 * _BC, gl.convert_layout((o3 * inv).to(dt), out_l), mask=hm)
        gl.store(optr + 4 * _BC, gl.convert_layout((o4 * inv).to(dt), out_l), mask=hm)
        gl.store(optr + 5 * _BC, gl.convert_layout((o5 * inv).to(dt), out_l), mask=hm)
        gl.store(optr + 6 * _BC, gl.convert_layout((o6 * inv).to(dt), out_l), mask=hm)
        gl.store(optr + 7 * _BC, gl.convert_layout((o7 * inv).to(dt), out_l), mask=hm)
        hl = gl.arange(0, BH, layout=col_l)
        if not PARTIAL:
            lse2 = lse2 * 0.6931471805599453
        gl.store(LSE + lse_base + hl.to(gl.int64) * stride_lh, lse2, mask=hl < H)

    @gluon.jit(do_not_specialize=["num_splits"])
    def _mla_tokens_gluon_kernel(Q, C16, BT, SEQ_IDX, KV_LEN, OUT, LSE, KV_SCALE, qk_scale,
                                 stride_qt, stride_qh, stride_cb, stride_cs, stride_btr,
                                 stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                                 stride_ls, max_kv_len, num_splits,
                                 H: gl.constexpr, BH: gl.constexpr,
                                 PAGE: gl.constexpr, R: gl.constexpr, PARTIAL: gl.constexpr,
                                 CONV_REGS: gl.constexpr, PIPE: gl.constexpr = False):  # fmt: skip
        gl.static_assert(R == 8 * _BC)
        t = gl.program_id(0)  # one program a query and split: BH covers every head
        split = gl.program_id(1)
        t64 = t.to(gl.int64)
        row = gl.load(SEQ_IDX + t).to(gl.int64)
        kv_len = gl.maximum(gl.minimum(gl.load(KV_LEN + t).to(gl.int32), max_kv_len), 0)
        chunk = gl.cdiv(gl.cdiv(kv_len, num_splits), _BN) * _BN
        start = split * chunk
        end = gl.minimum(start + chunk, kv_len)
        n_tiles = gl.maximum(gl.cdiv(end - start, _BN), 0)
        q_base = t64 * stride_qt
        out_base = t64 * stride_ot + split * stride_os
        lse_base = t64 * stride_lt + split * stride_ls

        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                    rank=2)  # fmt: skip
        p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BH,
                                                      element_bitwidth=16, rank=2)  # fmt: skip
        q_smem = gl.allocate_shared_memory(gl.float16, [9, BH, _BC], layout)
        k_smem = gl.allocate_shared_memory(gl.float16, [18, _BN, _BC], layout)
        p_smem = gl.allocate_shared_memory(gl.float16, [_BN, BH], p_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        for j in gl.static_range(2):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(free.index(j), count=1)
        bt_row = row * stride_btr
        gl.warp_specialize(
            [
                (_tok_products, (q_smem, k_smem, p_smem, ready, free, Q, q_base, stride_qh,
                                 KV_SCALE, qk_scale, start, end, n_tiles, OUT, out_base,
                                 stride_oh, LSE, lse_base, stride_lh, H, BH, R, PARTIAL, PIPE)),
                (_tok_convert, (k_smem, ready, free, C16, BT, bt_row, start, end, n_tiles,
                                stride_cb, stride_cs, PAGE, 0)),
                (_tok_convert, (k_smem, ready, free, C16, BT, bt_row, start, end, n_tiles,
                                stride_cb, stride_cs, PAGE, 1)),
            ],
            [4, 4],
            [CONV_REGS, CONV_REGS],
        )  # fmt: skip


def few_heads_fp8_refusal(
    q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int, kernel: str
) -> str | None:
    """Why the few-head fp8 Gluon MLA kernels (this one and :mod:`~.mla_regs_gluon`, named
    ``kernel`` in the message) cannot serve these inputs, or None."""
    if not HAS_GLUON:
        return f"{kernel} needs Triton's Gluon"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{kernel} takes bf16/fp16 queries, not {q.dtype}"
    if cache.dtype != torch.float8_e4m3fn:
        return f"{kernel} reads fp8 (e4m3) caches, not {cache.dtype}"
    if q.shape[1] > _MAX_HEADS:
        return f"{kernel} serves at most {_MAX_HEADS} heads, not {q.shape[1]}"
    if kv_lora_rank != 8 * _PIECE or cache.shape[-1] != kv_lora_rank + _PIECE:
        return (
            f"{kernel} serves kv_lora_rank 512 with a rope width of 64, not "
            f"{kv_lora_rank} and {cache.shape[-1] - kv_lora_rank}"
        )
    if cache.stride(-1) != 1 or cache.stride(1) % 16 or cache.stride(0) % 16:
        return f"{kernel} needs cache rows of 16-byte multiples, last dim contiguous"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"{kernel} needs an sm_90 GPU"
    return None


def few_heads_outputs(
    q: torch.Tensor, kv_lora_rank: int, why: str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The few-head fp8 Gluon MLA launchers' start: ``ValueError(why)`` for refused inputs,
    then ``q`` with a contiguous last dim, and the empty output and LSE."""
    if why:
        raise ValueError(why)
    if q.stride(-1) != 1:
        q = q.contiguous()
    t, h, _ = q.shape
    return q, q.new_empty(t, h, kv_lora_rank), q.new_empty(t, h, dtype=torch.float32)


def tokens_gluon_supported(q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """None when :func:`paged_mla_tokens_gluon` serves these inputs, else why not."""
    return few_heads_fp8_refusal(q, cache, kv_lora_rank, "the Gluon tokens-on-M kernel")


def paged_mla_tokens_gluon(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode on an fp8 latent cache, tokens on M, warp-specialised: the contract
    of :func:`~cp_modules.kernels.decode.mla.paged_mla_attention_kernel` (``kv_scale`` fp32 [1];
    None: 1.0).

    Raises:
        ValueError: for inputs :func:`tokens_gluon_supported` refuses, naming why.
    """
    q, out, lse = few_heads_outputs(q, kv_lora_rank, tokens_gluon_supported(q, cache, kv_lora_rank))
    t, h, _ = q.shape
    if t == 0:
        return out, lse
    page = cache.shape[1]
    max_kv_len = block_table.shape[1] * page
    if not num_splits:
        num_splits = choose_mla_num_splits(t, max_kv_len, _num_sms(q.device), _TILE, 1)
    o_buf, l_buf, so, sl = _split_buffers(out, lse, num_splits)
    if kv_scale is None:
        kv_scale = torch.ones(1, dtype=torch.float32, device=cache.device)
    c16 = cache.view(torch.int16)
    _mla_tokens_gluon_kernel[(t, num_splits)](
        q, c16, block_table, query_seq_idx, query_kv_len, o_buf, l_buf, kv_scale, scale * _LOG2E,
        q.stride(0), q.stride(1), c16.stride(0), c16.stride(1), block_table.stride(0),
        *so, *sl, max_kv_len, num_splits,
        H=h, BH=16 if h <= 16 else 32, PAGE=page, R=kv_lora_rank,
        PARTIAL=num_splits > 1, CONV_REGS=TOK_CONVERT_REGS, PIPE=TOK_PIPELINE, num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse
