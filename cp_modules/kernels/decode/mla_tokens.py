"""Triton absorbed MLA paged decode with few heads per program, the tokens on the tensor-core
tile's M side, for fp8 (e4m3) latent caches and caches of the query's dtype; launcher only.

Shape letters as in :mod:`cp_modules.kernels.decode.mla`. With 16 heads (DeepSeek's 128 split
8 ways by tensor parallelism) the heads-on-M kernel (:mod:`~.mla`) runs the legacy 16-row MMA,
and on an fp8 cache feeds ``P @ V`` its values, contracted along the tokens, one byte at a
time. Here each program computes the transposed products

    S^T [N, Hb] = K [N, R + P] @ Q^T [R + P, Hb]        O^T [R, Hb] += V^T [R, N] @ P^T [N, Hb]

(Hb = 16 heads, N = 64 tokens, :data:`FP8_TILE`): both have the cache tile on the A side, so Hopper's warp-group
MMA takes M = 64 tokens (or 128 value columns) and N = 16 heads with no padding, and the
value tile enters as the transposed A operand of 16-bit elements. Each 64-token tile is loaded
once, in four column chunks of R / 4 and the rope part (so that each product's A operand is
small); O^T is held as four [R / 4, Hb] accumulators.

An fp8 tile is loaded as bytes and converted to fp16 by the hardware (``cvt.rn.f16x2.e4m3x2``,
exact) in the load's layout, for each product. The query rows are then brought into fp16 by a
power of two each (their largest element to ``[2**14, 2**15)``; exact but for elements under
``2**-31`` of the row's largest, which round to fp16's subnormal steps, as in
:mod:`cp_modules.kernels.decode.paged`'s fp8 path); each head's scores are multiplied by
``scale * log2(e) * kv_scale * 2**-shift``, P is fp16 and the output is ``acc * kv_scale / l``.
Under the interpreter the same fp16 values come from integer operations. A 16-bit tile goes
to the products as it is, with the query and P in the query's dtype.

Served (:func:`tokens_on_m_supported`): bf16/fp16 queries with an fp8 cache or one of their
dtype, at most :data:`MAX_HEADS` heads, ``R / 4`` and ``P`` powers of two of at least 16.
Switches: :data:`FP8_TOKENS_ON_M`, :data:`BF16_TOKENS_ON_M`. Splits and their merge as in
:mod:`~.mla`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_modules.kernels.decode.fp8 import HW_FP16, fp8_e4m3_bits_to
from cp_modules.kernels.decode.paged import _LOG2E
from cp_modules.kernels.decode.tiles import (
    _num_sms,
    _pow2,
    _split_buffers,
    choose_mla_num_splits,
    split_range,
    store_lse,
    tile_slots,
)
from cp_modules.kernels.merge import merge_splits_triton

__all__ = [
    "BF16_TILE",
    "BF16_TOKENS_ON_M",
    "FP8_TILE",
    "FP8_TOKENS_ON_M",
    "MAX_HEADS",
    "ROUTE_MAX_HEADS",
    "paged_mla_tokens_on_m",
    "tokens_on_m_supported",
    "tokens_on_m_switched_on",
]

# fp8 MLA caches with at most MAX_HEADS heads: this kernel instead of the heads-on-M Triton
# kernel. Read at every launch. On since timed (2026-12-06, H100, DeepSeek's latent at 16 heads,
# B*ctx 131k-2M): 0.85-0.88x of the bf16 kernel's time where the heads-on-M kernel gives
# 0.66-0.72x (bench_fp8_kv rows "variant TOKENS_ON_M=False ..."), 0.81-0.87x with its
# FP8_K_TRANSPOSED off (rows "variant K_T=False ...", now its default).
FP8_TOKENS_ON_M = True
# The same for bf16/fp16 caches (the tiles then go from the copies straight to the products, no
# conversion), against the heads-on-M kernel. Off: 2-6 % slower than it on an H100 (2026-12-06,
# rows "variant BF16_TOKENS_ON_M", the heads-on-M kernel already at 2.8-2.9 TB/s).
BF16_TOKENS_ON_M = False
MAX_HEADS = 32
# Heads the op routes here (one head tile; fp8 caches with FP8_WIDE_HEADS: up to MAX_HEADS): with
# two 16-head tiles (32 heads) each program reads the whole cache and the heads-on-M kernel was
# faster on an H100 (2026-12-06, fp8 0.51-0.69x of bf16 against 0.45-0.64x here). MAX_HEADS is
# what this kernel serves when called directly.
ROUTE_MAX_HEADS = 16
_BLOCK_H = 16
# (tokens a tile, warps, programs an SM) for fp8 and for 16-bit caches; the last is the split
# count's assumption. fp8, 64 x 4: 72 KiB of shared memory and up to 255 registers of 128
# threads, so two; 128 x 8 (a bench variant): 126 KiB, one. 16-bit, 64 x 4: the copies' two
# stages of 72 KiB, one. Read at every launch.
FP8_TILE = (64, 4, 2)
BF16_TILE = (64, 4, 1)
# fp8 caches with 17-32 heads: one 32-head tile on FP8_WIDE_TILE (each program reads the cache
# once; compiled for sm_90a: 94 KiB, no spills, 802 instructions a warp and 64-token tile on 8
# warps) instead of two 16-head tiles, and the op routes them here. On since timed (2026-12-06,
# H200, 32 heads: fp8 0.66 / 0.58 / 0.51 / 0.50x of bf16 against the heads-on-M kernel's
# 0.63 / 0.55 / 0.49 / 0.47x; bench rows "variant FP8_WIDE_HEADS=False ..."). Read at every launch.
FP8_WIDE_HEADS = True
FP8_WIDE_TILE = (64, 8, 1)
_HW16 = tl.constexpr(HW_FP16)  # the hardware e4m3 -> fp16 conversion (kernels.decode.fp8)


def tokens_on_m_supported(q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """None when :func:`paged_mla_tokens_on_m` serves these inputs, else why not."""
    h, width = q.shape[1], cache.shape[-1]
    rope = width - kv_lora_rank
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the tokens-on-M kernel takes bf16/fp16 queries, not {q.dtype}"
    if cache.dtype != torch.float8_e4m3fn and cache.dtype != q.dtype:
        return (
            f"the tokens-on-M kernel reads fp8 (e4m3) caches or caches of the query's dtype, "
            f"not {cache.dtype} with {q.dtype} queries"
        )
    if h > MAX_HEADS:
        return f"the tokens-on-M kernel serves at most {MAX_HEADS} heads, not {h}"
    chunk = kv_lora_rank // 4
    if kv_lora_rank % 4 or chunk < 16 or _pow2(chunk) != chunk:
        return f"the tokens-on-M kernel needs kv_lora_rank / 4 a power of two >= 16, not {kv_lora_rank}"
    if rope < 16 or _pow2(rope) != rope:
        return f"the tokens-on-M kernel needs a rope width that is a power of two >= 16, not {rope}"
    return None


def tokens_on_m_switched_on(cache: torch.Tensor, heads: int | None = None) -> bool:
    """Whether the switch for this cache's dtype is on (:data:`FP8_TOKENS_ON_M` for fp8,
    :data:`BF16_TOKENS_ON_M` for bf16/fp16; read at every launch) and, given ``heads``, whether
    the op routes that many here (at most :data:`ROUTE_MAX_HEADS`; fp8 with
    :data:`FP8_WIDE_HEADS`: :data:`MAX_HEADS`)."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    limit = MAX_HEADS if fp8 and FP8_WIDE_HEADS else ROUTE_MAX_HEADS
    if heads is not None and heads > limit:
        return False
    return FP8_TOKENS_ON_M if fp8 else BF16_TOKENS_ON_M


@triton.jit
def _chunk_t(q_rows, off, offs_c, h_mask, mult, KV_FP8: tl.constexpr):
    """One column chunk of the query rows transposed, [C, Hb]: for an fp8 cache times their
    powers of two as fp16, else as they are."""
    qc = tl.load(q_rows + off + offs_c[None, :], mask=h_mask[:, None], other=0.0)
    if KV_FP8:
        return tl.trans((qc.to(tl.float32) * mult[:, None]).to(tl.float16))
    else:
        return tl.trans(qc)


@triton.jit
def _operand(b, KV_FP8: tl.constexpr, FP8_ASM: tl.constexpr):
    """A cache tile as a product's operand: e4m3 bytes -> fp16 (exact), converted in the load's
    layout (PACK 8, not pure); a 16-bit tile as it is."""
    if KV_FP8:
        return fp8_e4m3_bits_to(b, _HW16, FP8_ASM, 8)
    else:
        return b


@triton.jit
def _row_amax(q_rows, off, offs_c, h_mask):
    qc = tl.load(q_rows + off + offs_c[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
    return tl.max(tl.abs(qc), 1)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_tokens_on_m_kernel(
    Q, C, BT, SEQ_IDX, KV_LEN, OUT, LSE, KV_SCALE, qk_scale,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_btr,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls,
    max_kv_len, num_splits,
    H: tl.constexpr, NUM_HEAD_TILES: tl.constexpr, PAGE: tl.constexpr, R: tl.constexpr,
    P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_ASM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    t = (pid // NUM_HEAD_TILES).to(tl.int64)
    offs_h = (pid % NUM_HEAD_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    row = tl.load(SEQ_IDX + t).to(tl.int64)
    _, start, end = split_range(KV_LEN, t, max_kv_len, num_splits, split, BLOCK_N)

    RC: tl.constexpr = R // 4
    offs_c = tl.arange(0, RC)
    offs_p = tl.arange(0, P)
    q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
    if KV_FP8:
        # Each head's row into fp16 exactly: times 2**sh, its largest |q| to [2**14, 2**15).
        amax = tl.maximum(_row_amax(q_rows, 0, offs_c, h_mask),
                          _row_amax(q_rows, RC, offs_c, h_mask))  # fmt: skip
        amax = tl.maximum(amax, _row_amax(q_rows, 2 * RC, offs_c, h_mask))
        amax = tl.maximum(amax, _row_amax(q_rows, 3 * RC, offs_c, h_mask))
        amax = tl.maximum(amax, _row_amax(q_rows, R, offs_p, h_mask))
        ex = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        sh = tl.minimum(tl.maximum(14 - ex, -126), 126)
    else:
        sh = tl.zeros([BLOCK_H], dtype=tl.int32)
    mult = ((sh + 127) << 23).to(tl.float32, bitcast=True)
    q_t0 = _chunk_t(q_rows, 0, offs_c, h_mask, mult, KV_FP8)
    q_t1 = _chunk_t(q_rows, RC, offs_c, h_mask, mult, KV_FP8)
    q_t2 = _chunk_t(q_rows, 2 * RC, offs_c, h_mask, mult, KV_FP8)
    q_t3 = _chunk_t(q_rows, 3 * RC, offs_c, h_mask, mult, KV_FP8)
    q_pe_t = _chunk_t(q_rows, R, offs_p, h_mask, mult, KV_FP8)
    if KV_FP8:
        kv_scale = tl.load(KV_SCALE)
        # Per head (a column of S^T): the softmax scale in base 2, the latent's scale, 2**-sh.
        col_scale = qk_scale * kv_scale * ((127 - sh) << 23).to(tl.float32, bitcast=True)
    else:
        kv_scale = 1.0
        col_scale = tl.full([BLOCK_H], 1.0, tl.float32) * qk_scale

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([RC, BLOCK_H], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    bt_row = BT + row * stride_btr
    for n0 in range(start, end, BLOCK_N):
        n_mask, blk, pos = tile_slots(bt_row, n0, end, PAGE, BLOCK_N)
        tok = blk * stride_cb + pos * stride_cs
        # Rows past the range load as zeros: unwritten slots may hold NaN.
        rows = C + tok[:, None] + offs_c[None, :]
        b0 = tl.load(rows, mask=n_mask[:, None], other=0)
        b1 = tl.load(rows + RC, mask=n_mask[:, None], other=0)
        b2 = tl.load(rows + 2 * RC, mask=n_mask[:, None], other=0)
        b3 = tl.load(rows + 3 * RC, mask=n_mask[:, None], other=0)
        b_pe = tl.load(C + tok[:, None] + R + offs_p[None, :], mask=n_mask[:, None], other=0)
        s = tl.dot(_operand(b_pe, KV_FP8, FP8_ASM), q_pe_t)
        s = tl.dot(_operand(b0, KV_FP8, FP8_ASM), q_t0, s)
        s = tl.dot(_operand(b1, KV_FP8, FP8_ASM), q_t1, s)
        s = tl.dot(_operand(b2, KV_FP8, FP8_ASM), q_t2, s)
        s = tl.dot(_operand(b3, KV_FP8, FP8_ASM), q_t3, s)
        s = tl.where(n_mask[:, None], s * col_scale[None, :], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        pv = p.to(tl.float16) if KV_FP8 else p.to(Q.dtype.element_ty)
        # The values converted again (from the same bytes): the compiler then stages each
        # product's operand only while that product needs it (72 KiB of shared memory, where
        # converting once kept the value operands staged across the softmax: 126 KiB).
        acc0 = tl.dot(tl.trans(_operand(b0, KV_FP8, FP8_ASM)), pv, acc0 * alpha[None, :])
        acc1 = tl.dot(tl.trans(_operand(b1, KV_FP8, FP8_ASM)), pv, acc1 * alpha[None, :])
        acc2 = tl.dot(tl.trans(_operand(b2, KV_FP8, FP8_ASM)), pv, acc2 * alpha[None, :])
        acc3 = tl.dot(tl.trans(_operand(b3, KV_FP8, FP8_ASM)), pv, acc3 * alpha[None, :])
        m_i = m_new

    nonempty = l_i > 0.0
    inv = (kv_scale / tl.where(nonempty, l_i, 1.0))[:, None]
    lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_ptrs = OUT + t * stride_ot + offs_h[:, None] * stride_oh + split * stride_os + offs_c[None, :]
    dt = OUT.dtype.element_ty
    tl.store(o_ptrs, (tl.trans(acc0) * inv).to(dt), mask=h_mask[:, None])
    tl.store(o_ptrs + RC, (tl.trans(acc1) * inv).to(dt), mask=h_mask[:, None])
    tl.store(o_ptrs + 2 * RC, (tl.trans(acc2) * inv).to(dt), mask=h_mask[:, None])
    tl.store(o_ptrs + 3 * RC, (tl.trans(acc3) * inv).to(dt), mask=h_mask[:, None])
    store_lse(LSE + t * stride_lt + offs_h * stride_lh + split * stride_ls, lse2, h_mask, PARTIAL)


def paged_mla_tokens_on_m(
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
    """Absorbed MLA decode, tokens on M, on an fp8 latent cache or one of the query's dtype: the
    contract of :func:`~cp_modules.kernels.decode.mla.paged_mla_attention_kernel` (an fp8
    cache's ``kv_scale`` fp32 [1]; None: 1.0).

    Raises:
        ValueError: for inputs :func:`tokens_on_m_supported` refuses, naming why.
    """
    why = tokens_on_m_supported(q, cache, kv_lora_rank)
    if why:
        raise ValueError(why)
    assert q.stride(-1) == 1 and cache.stride(-1) == 1
    t, h, _ = q.shape
    _, page, width = cache.shape
    out = q.new_empty(t, h, kv_lora_rank)
    lse = q.new_empty(t, h, dtype=torch.float32)
    if t == 0:
        return out, lse
    max_kv_len = block_table.shape[1] * page
    kv_fp8 = cache.dtype == torch.float8_e4m3fn
    block_n, warps, per_sm = FP8_TILE if kv_fp8 else BF16_TILE
    block_h = _BLOCK_H
    if kv_fp8 and FP8_WIDE_HEADS and h > _BLOCK_H:
        block_h = 2 * _BLOCK_H
        block_n, warps, per_sm = FP8_WIDE_TILE
    head_tiles = triton.cdiv(h, block_h)
    if not num_splits:
        num_splits = choose_mla_num_splits(
            t * head_tiles, max_kv_len, _num_sms(q.device), block_n, per_sm
        )
    o_buf, l_buf, so, sl = _split_buffers(out, lse, num_splits)
    if kv_scale is None or not kv_fp8:
        kv_scale = torch.ones(1, dtype=torch.float32, device=cache.device)
    _mla_tokens_on_m_kernel[(t * head_tiles, num_splits)](
        q, cache.view(torch.uint8) if kv_fp8 else cache, block_table, query_seq_idx, query_kv_len, o_buf, l_buf,
        kv_scale, scale * _LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0),
        *so, *sl, max_kv_len, num_splits,
        H=h, NUM_HEAD_TILES=head_tiles, PAGE=page, R=kv_lora_rank, P=width - kv_lora_rank,
        BLOCK_H=block_h, BLOCK_N=block_n, PARTIAL=num_splits > 1,
        KV_FP8=kv_fp8, FP8_ASM=q.device.type == "cuda", num_warps=warps, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse
