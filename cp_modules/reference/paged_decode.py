"""Pure-PyTorch oracles of paged decode attention (the CPU implementation of the ``cp`` ops).

Shape letters: T = queries, Hq = query heads, Hkv = KV heads, G = Hq // Hkv, Dk = query/key dim,
Dv = value dim, NB = physical blocks, BS = tokens per block, R = block-table rows,
M = entries per row, L = M * BS (the most local tokens a row can address).

Query ``t`` attends the first ``query_kv_len[t]`` local tokens of block-table row
``query_seq_idx[t]``; local token ``j`` of a row lives in block ``block_table[row, j // BS]`` at
offset ``j % BS``. Causality within a request's new tokens and DCP sharding are both expressed
through ``query_kv_len`` alone; a sliding window through ``query_kv_start`` (the first local
token a query sees). An empty range gives ``out = 0`` and ``lse = -inf``.

An fp8 cache is read as ``fp8 * scale`` (``k_scale`` / ``v_scale`` fp32 [Hkv] or [1]; None:
1.0) in the compute dtype.
"""

from __future__ import annotations

import torch

from cp_modules.cache.kv_dtype import dequantize_fp8

__all__ = ["paged_attention_ref", "paged_mla_attention_ref"]

# Elements of gathered K per query chunk; bounds the reference's memory on long contexts.
_GATHER_BUDGET = 1 << 26


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    scale: float,
    *,
    upcast: bool = True,
    query_kv_start: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` against each query's paged KV range; returns ``(out, lse)``.

    Args:
        q: [T, Hq, Dk].
        k_cache: [NB, BS, Hkv, Dk]; v_cache: [NB, BS, Hkv, Dv] (may be views of one tensor).
        block_table: [R, M] integer block ids.
        query_seq_idx: [T] integer row of ``block_table``.
        query_kv_len: [T] integer number of local tokens the query sees (clamped to L).
        scale: softmax scale.
        upcast: compute in fp32 (fp64 for fp64 inputs: the oracle); ``False`` computes scores, softmax and the value
            product in ``q``'s dtype (the same-dtype baseline of the tolerance rule).
        query_kv_start: [T] first local token each query sees (sliding windows), or None (0).
        softcap: scores become ``softcap * tanh(scores / softcap)`` before masking, or None.
        k_scale, v_scale: fp8 caches: the fp32 dequantization scales ([Hkv] or [1]).
        exact: ``(pos, k, v, valid)``: for each query, the keys and values of its local
            positions ``pos`` [T, n] (where ``valid`` [T, n]) given unquantized
            (``k`` [T, n, Hkv, Dk], ``v`` [T, n, Hkv, Dv]) in place of the cache's (an fp8
            cache's bf16 window: :mod:`cp_modules.cache.exact_window`); positions outside a
            query's range are not read.

    Returns:
        out [T, Hq, Dv] in ``q``'s dtype and lse [T, Hq] fp32 (natural log).
    """
    t_total, hq, dk = q.shape
    nb, bs, hkv, _ = k_cache.shape
    dv = v_cache.shape[-1]
    g = hq // hkv
    length = block_table.shape[1] * bs
    out = torch.zeros(t_total, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((t_total, hq), float("-inf"), dtype=torch.float32, device=q.device)
    cdt = (torch.float64 if q.dtype == torch.float64 else torch.float32) if upcast else q.dtype
    j = torch.arange(length, device=q.device)
    chunk = max(1, _GATHER_BUDGET // max(1, length * hkv * max(dk, dv)))
    for t0 in range(0, t_total, chunk):
        t1 = min(t_total, t0 + chunk)
        rows = query_seq_idx[t0:t1].to(torch.int64)
        blocks = block_table[rows].to(torch.int64).clamp(0, nb - 1)
        blk = blocks[:, j // bs]
        visible = j[None, :] < query_kv_len[t0:t1, None].to(torch.int64)  # [t, L]
        if query_kv_start is not None:
            visible &= j[None, :] >= query_kv_start[t0:t1, None].to(torch.int64)
        # Slots past a query's range may hold anything (NaN included): zero them so that a
        # zero probability times garbage cannot leak into the sums.
        hidden = ~visible[:, :, None, None]
        k = dequantize_fp8(k_cache[blk, j % bs], k_scale, cdt).masked_fill(hidden, 0)
        v = dequantize_fp8(v_cache[blk, j % bs], v_scale, cdt).masked_fill(hidden, 0)
        if exact is not None:
            pos = exact[0][t0:t1].to(torch.int64).clamp(0, length - 1)
            tq = torch.arange(t1 - t0, device=q.device)[:, None].expand_as(pos)
            sel = exact[3][t0:t1] & visible[tq, pos]
            k[tq[sel], pos[sel]] = exact[1][t0:t1][sel].to(cdt)
            v[tq[sel], pos[sel]] = exact[2][t0:t1][sel].to(cdt)
        qc = q[t0:t1].to(cdt).view(t1 - t0, hkv, g, dk)
        s = torch.einsum("thgd,tlhd->thgl", qc, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        lse_c = torch.logsumexp(s if upcast else s.float(), dim=-1)  # -inf for an empty range
        if upcast:
            p = torch.exp(s - lse_c.nan_to_num(neginf=0.0)[..., None])
        else:
            p = torch.softmax(s, dim=-1)
        p = torch.where(
            visible[:, None, None, :], p, torch.zeros((), dtype=p.dtype, device=p.device)
        )
        o = torch.einsum("thgl,tlhd->thgd", p.to(cdt), v)
        out[t0:t1] = o.reshape(t1 - t0, hq, dv).to(q.dtype)
        lse[t0:t1] = lse_c.reshape(t1 - t0, hq)
    return out, lse


def paged_mla_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_idx: torch.Tensor,
    query_kv_len: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    upcast: bool = True,
    query_kv_start: torch.Tensor | None = None,
    softcap: float | None = None,
    kv_scale: torch.Tensor | None = None,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: ``q`` [T, H, R + P] against latent rows [NB, BS, R + P].

    Keys are whole latent rows, values their first ``kv_lora_rank`` (R) elements; an fp8 cache
    is read as ``fp8 * kv_scale`` (one fp32 value, [1]). ``exact``: ``(pos, rows, valid)``,
    latent rows [T, n, R + P] in place of the cache's at local positions ``pos`` [T, n]
    (:func:`paged_attention_ref`'s ``exact``).

    Returns:
        out [T, H, R] in ``q``'s dtype and lse [T, H] fp32 (natural log).
    """
    k = cache.unsqueeze(2)
    return paged_attention_ref(
        q,
        k,
        k[..., :kv_lora_rank],
        block_table,
        query_seq_idx,
        query_kv_len,
        scale,
        upcast=upcast,
        query_kv_start=query_kv_start,
        softcap=softcap,
        k_scale=kv_scale,
        v_scale=kv_scale,
        exact=None
        if exact is None
        else (exact[0], exact[1][:, :, None], exact[1][:, :, None, :kv_lora_rank], exact[2]),
    )
