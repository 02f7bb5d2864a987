"""Triton GQA/MHA paged decode on bf16/fp16 caches with the tokens on the tensor-core tile's M
side; launcher only.

Shape letters as in :mod:`cp_modules.kernels.decode.paged`. The heads-on-M kernel there puts a
KV head's query heads (4 for Llama-3-8B, 7 for Qwen2.5-7B) on the 16 rows of the legacy MMA.
Here one program takes one (query, KV head) pair over one split and computes the transposed
products

    S^T [N, Gb] = K [N, D] @ Q^T [D, Gb]        O^T [D, Gb] += V^T [D, N] @ P^T [N, Gb]

(Gb: the group's heads padded to 16, N = 64 tokens): both have a cache tile on the A side of
Hopper's warp-group MMA, whose operands then come straight from the copies' shared-memory
buffers (the value product reads a transposed view), with :data:`TILE`'s stages of copies in
flight. Served (:func:`gqa_tokens_on_m_supported`): one query a run, no window or soft-cap,
bf16/fp16 caches of the query's dtype with token-major rows, equal key and value dims that are
powers of two >= 16, at most 32 query heads a KV head. Switch: :data:`GQA_TOKENS_ON_M` (off
until timed). Splits and their merge as in :mod:`~.paged`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_modules.kernels.decode.paged import _LOG2E
from cp_modules.kernels.decode.tiles import (
    _num_sms,
    _pow2,
    _split_buffers,
    choose_num_splits,
    split_range,
    store_lse,
    tile_slots,
)
from cp_modules.kernels.merge import merge_splits_triton

__all__ = ["GQA_TOKENS_ON_M", "TILE", "gqa_tokens_on_m_supported", "paged_gqa_tokens_on_m"]

# bf16/fp16 GQA decode (one query a run, no window, no soft-cap): this kernel instead of the
# heads-on-M kernel. Read at every launch. Off: timed on an H100 (2026-12-06, bench_peers
# --cp-only entry cp-tokens-on-m) it was no faster on the memory-bound shapes (heads-on-M /
# tokens-on-M time 0.89-1.00, both at 2.5-3.1 TB/s).
GQA_TOKENS_ON_M = False
# (tokens a tile, warps, stages of copies). Read at every launch.
TILE = (64, 4, 3)
MAX_GROUP = 32


def gqa_tokens_on_m_supported(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_kv_start: torch.Tensor | None = None,
    softcap: float | None = None,
    query_len: int = 1,
) -> str | None:
    """None when :func:`paged_gqa_tokens_on_m` serves these inputs, else why not."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the tokens-on-M GQA kernel takes bf16/fp16 queries, not {q.dtype}"
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return "the tokens-on-M GQA kernel reads caches of the query's dtype"
    if query_kv_start is not None or softcap or query_len != 1:
        return "the tokens-on-M GQA kernel serves no window, no soft-cap, one query a run"
    d = k_cache.shape[-1]
    if v_cache.shape[-1] != d or d < 16 or _pow2(d) != d:
        return (
            f"the tokens-on-M GQA kernel needs equal key and value dims that are powers of two "
            f">= 16, not {d} and {v_cache.shape[-1]}"
        )
    if v_cache.stride(-1) != 1 or k_cache.stride(-1) != 1:
        return "the tokens-on-M GQA kernel reads token-major caches"
    hkv = k_cache.shape[2]
    if q.shape[1] % hkv or q.shape[1] // hkv > MAX_GROUP:
        return f"the tokens-on-M GQA kernel serves at most {MAX_GROUP} query heads a KV head"
    return None


@triton.jit(do_not_specialize=["num_splits"])
def _gqa_tokens_on_m_kernel(
    Q, K, V, BT, SEQ_IDX, KV_LEN, OUT, LSE, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_btr, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls,
    max_kv_len, num_splits,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    t = (pid // NUM_KV_HEADS).to(tl.int64)
    kvh = pid % NUM_KV_HEADS
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    row = tl.load(SEQ_IDX + t).to(tl.int64)
    _, start, end = split_range(KV_LEN, t, max_kv_len, num_splits, split, BLOCK_N)

    offs_d = tl.arange(0, D)
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)  # fmt: skip
    q_t = tl.trans(q)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([D, BLOCK_G], dtype=tl.float32)
    bt_row = BT + row * stride_btr
    K_h = K + kvh.to(tl.int64) * stride_kh
    V_h = V + kvh.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        n_mask, blk, pos = tile_slots(bt_row, n0, end, PAGE, BLOCK_N)
        k_tok = blk * stride_kb + pos * stride_ks
        v_tok = blk * stride_vb + pos * stride_vs
        # Rows past the range load as zeros: unwritten slots may hold NaN.
        k = tl.load(K_h + k_tok[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(V_h + v_tok[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        s = tl.dot(k, q_t)
        s = tl.where(n_mask[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = tl.dot(tl.trans(v), p.to(Q.dtype.element_ty), acc * alpha[None, :])
        m_i = m_new

    nonempty = l_i > 0.0
    out = tl.trans(acc) / tl.where(nonempty, l_i, 1.0)[:, None]
    lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_ptrs = OUT + t * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=g_mask[:, None])
    store_lse(LSE + t * stride_lt + heads * stride_lh + split * stride_ls, lse2, g_mask, PARTIAL)


def paged_gqa_tokens_on_m(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA/MHA paged decode, tokens on M: q [T, Hq, D] vs [NB, BS, Hkv, D] caches of q's dtype
    -> (out [T, Hq, D], lse fp32 [T, Hq]), the contract of
    :func:`~cp_modules.kernels.decode.paged.paged_attention_kernel` without its window,
    soft-cap, fp8 and run options.

    Raises:
        ValueError: for inputs :func:`gqa_tokens_on_m_supported` refuses, naming why.
    """
    why = gqa_tokens_on_m_supported(q, k_cache, v_cache)
    if why:
        raise ValueError(why)
    t, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    out = q.new_empty(t, hq, d)
    lse = q.new_empty(t, hq, dtype=torch.float32)
    if t == 0:
        return out, lse
    block_n, warps, stages = TILE
    programs = t * hkv
    max_kv_len = block_table.shape[1] * page
    if not num_splits:
        num_splits = choose_num_splits(programs, max_kv_len, _num_sms(q.device))
    o_buf, l_buf, so, sl = _split_buffers(out, lse, num_splits)
    group = hq // hkv
    _gqa_tokens_on_m_kernel[(programs, num_splits)](
        q, k_cache, v_cache, block_table, query_seq_idx, query_kv_len, o_buf, l_buf,
        scale * _LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), *so, *sl, max_kv_len, num_splits,
        GROUP=group, NUM_KV_HEADS=hkv, PAGE=page, D=d, BLOCK_G=max(16, _pow2(group)),
        BLOCK_N=block_n, PARTIAL=num_splits > 1, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_triton(o_buf, l_buf, out, lse)
    return out, lse
