"""The fp8 cache's bf16 window merged into the paged kernel's result in one launch.

Shape letters: T = decode queries, Hq / Hkv = query / KV heads (G = Hq // Hkv), Dk / Dv = key /
value dims, NA = window keys a query may read (sink + recent), NS = keys to remove (the sink's
fp8 copies an MLA kernel attended).

What :func:`cp_modules.cache.exact_window.merge_exact` computes (its pure-PyTorch reference),
one program a (query, query head): the window's scores from the buffer's rows, the removed
keys' scores, and the merged output and natural-log LSE, in fp32. The window buffer is read
through per-query flat slot indices (``[T, NA]``, from
:func:`~cp_modules.cache.exact_window.window_decode_ranges`): GQA rows hold K then V
(``[..., 2, Hkv, D]``), an MLA row is the latent (``[..., Rk + Dr]``: keys the whole row,
values its first Rk). Replaces about 25 small PyTorch kernels a layer with one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["window_merge_triton"]


@triton.jit
def _rows_f32(x, row_scale, FP8: tl.constexpr):
    # Loaded rows in fp32; an fp8 cache's bytes dequantized (e4m3 * scale, in fp32: the values
    # the paged kernel attended, not rounded to the query's dtype).
    if FP8:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * row_scale
    return x.to(tl.float32)


@triton.jit
def _scores(q_base, k_base, k_rows, row_ok, scale, softcap,
            DK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            SOFTCAP: tl.constexpr, FP8: tl.constexpr, row_scale):  # fmt: skip
    # [BLOCK_N] fp32 scores of one query head against rows at k_base + k_rows (element offsets).
    offs_d = tl.arange(0, BLOCK_D)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, DK, BLOCK_D):
        dm = d0 + offs_d < DK
        qv = tl.load(q_base + d0 + offs_d, mask=dm, other=0.0).to(tl.float32)
        kv = tl.load(
            k_base + k_rows[:, None] + d0 + offs_d[None, :],
            mask=row_ok[:, None] & dm[None, :],
            other=0,
        )
        kv = _rows_f32(kv, row_scale, FP8)
        s += tl.sum(kv * qv[None, :], axis=1)
    s = s * scale
    if SOFTCAP:
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # c * tanh(s / c)
    return s


@triton.jit
def _window_merge_kernel(
    q_ptr, out_ptr, lse_ptr, o_new_ptr, lse_new_ptr, buf_ptr, slots_ptr, valid_ptr,
    sub_ptr, sub_valid_ptr, sub_local_ptr, seq_idx_ptr, bt_ptr, sub_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_nt, stride_nh, stride_nlt,
    stride_slot, stride_bh, v_off, stride_sn, stride_bt, num_blocks,
    NA, NS, G, scale, softcap,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_SUB: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SCALE: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // G
    offs_n = tl.arange(0, BLOCK_N)
    n_ok = offs_n < NA
    slot = tl.load(slots_ptr + t * NA + offs_n, mask=n_ok, other=0).to(tl.int64)
    ok = tl.load(valid_ptr + t * NA + offs_n, mask=n_ok, other=0) != 0
    rows = slot * stride_slot + kvh * stride_bh
    q_base = q_ptr + t * stride_qt + h * stride_qh
    s_add = _scores(q_base, buf_ptr, rows, ok, scale, softcap, DK, BLOCK_N, BLOCK_D, SOFTCAP,
                    False, 1.0)  # fmt: skip
    s_add = tl.where(ok, s_add, float("-inf"))
    lse_k = tl.load(lse_ptr + t * stride_lt + h).to(tl.float32)
    lse_k = tl.where(lse_k != lse_k, float("-inf"), lse_k)
    m = tl.maximum(lse_k, tl.max(s_add, axis=0))
    m = tl.where(m == float("-inf"), 0.0, m)
    w_k = tl.exp(lse_k - m)
    w_add = tl.where(ok, tl.exp(s_add - m), 0.0)
    den_k = w_k
    if HAS_SUB:
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < NS
        sok = tl.load(sub_valid_ptr + t * NS + offs_s, mask=s_ok, other=0) != 0
        # The fp8 cache's rows of the query's local tokens sub_local (gather_cache_rows).
        local = tl.load(sub_local_ptr + t * NS + offs_s, mask=s_ok, other=0).to(tl.int64)
        req = tl.load(seq_idx_ptr + t).to(tl.int64)
        blk = tl.load(bt_ptr + req * stride_bt + local // PAGE, mask=s_ok, other=0)
        blk = tl.minimum(tl.maximum(blk.to(tl.int64), 0), num_blocks - 1)
        sub_rows = (blk * PAGE + local % PAGE) * stride_sn
        sub_scale = 1.0
        if HAS_SCALE:
            sub_scale = tl.load(sub_scale_ptr)
        s_sub = _scores(q_base, sub_ptr, sub_rows, sok, scale, softcap,
                        DK, BLOCK_S, BLOCK_D, SOFTCAP, True, sub_scale)  # fmt: skip
        w_sub = tl.where(sok, tl.exp(s_sub - m), 0.0)
        den_k = tl.maximum(den_k - tl.sum(w_sub, axis=0), 0.0)
    den = den_k + tl.sum(w_add, axis=0)
    empty = den <= 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, den))
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, DV, BLOCK_D):
        dm = d0 + offs_d < DV
        o = tl.load(out_ptr + t * stride_ot + h * stride_oh + d0 + offs_d, mask=dm, other=0.0)
        acc = o.to(tl.float32) * w_k
        v = tl.load(
            buf_ptr + rows[:, None] + v_off + d0 + offs_d[None, :],
            mask=ok[:, None] & dm[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(v * w_add[:, None], axis=0)
        if HAS_SUB:
            vs = tl.load(
                sub_ptr + sub_rows[:, None] + d0 + offs_d[None, :],
                mask=sok[:, None] & dm[None, :],
                other=0,
            )
            vs = _rows_f32(vs, sub_scale, True)
            acc -= tl.sum(vs * w_sub[:, None], axis=0)
        tl.store(
            o_new_ptr + t * stride_nt + h * stride_nh + d0 + offs_d,
            (acc * inv).to(o_new_ptr.dtype.element_ty),
            mask=dm,
        )
    lse_new = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, den)))
    tl.store(lse_new_ptr + t * stride_nlt + h, lse_new)


def _bytes(mask: torch.Tensor) -> torch.Tensor:
    # A bool mask read as its bytes (no copy; the per-step ranges are made contiguous).
    assert mask.is_contiguous()
    return mask.view(torch.int8) if mask.dtype == torch.bool else mask


def window_merge_triton(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    buf: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    *,
    value_dim: int,
    value_offset: int,
    sub_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
    | None = None,
    sub_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` merged with the window's keys (and with ``sub_cache``'s rows removed).

    Args:
        out, lse: [T, Hq, Dv] and [T, Hq] fp32 (natural log) of the paged kernel.
        q: [T, Hq, Dk].
        buf: the window buffer ``[rows + 1, slots, ...]`` whose flat slot rows hold, per KV
            head (stride ``buf.stride(-2)`` for GQA, none for MLA), the key at offset 0 and the
            value at ``value_offset`` (elements).
        slots, valid: [T, NA] flat slot indices and which of them each query reads.
        value_dim: Dv.
        sub_cache: rows to remove (keys; values their first Dv), read from an fp8 MLA cache:
            ``(cache [blocks, page, Dk] e4m3, block_table, seq_idx [T], local [T, NS],
            scale [1] fp32 or None)``, the rows of local tokens ``local`` of each query's
            request, dequantized in fp32 in the kernel
            (:func:`~cp_modules.cache.exact_window.gather_cache_rows` to fp32 is its reference).
        sub_valid: [T, NS] which of those rows each query removes.

    Returns:
        (out [T, Hq, Dv] in ``out``'s dtype, lse [T, Hq] fp32).
    """
    t, hq, dk = q.shape
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and slots.is_contiguous()
    gqa = buf.dim() == 5  # [rows + 1, slots, 2, Hkv, D]
    hkv = buf.shape[3] if gqa else 1
    flat = buf.view(-1, *buf.shape[2:])
    o_new = torch.empty_like(out)
    lse_new = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    if t == 0:
        return o_new, lse_new
    na = slots.shape[1]
    # Placeholders the kernel does not read without rows to remove.
    sub_t, sub_v, sub_local, seq_idx, table, c_scale = flat, valid, slots, slots, slots, None
    ns, stride_sn, page, num_blocks = 0, 0, 1, 1
    if sub_cache is not None:
        cache, table, seq_idx, sub_local, c_scale = sub_cache
        assert sub_valid is not None and sub_local.dim() == 2
        assert cache.dtype == torch.float8_e4m3fn and cache.stride(-1) == 1
        assert cache.stride(0) == cache.shape[1] * cache.stride(1)
        assert c_scale is None or c_scale.dtype == torch.float32
        ns, page, num_blocks = sub_local.shape[1], cache.shape[1], cache.shape[0]
        sub_t, sub_v, stride_sn = cache.view(torch.uint8), sub_valid, cache.stride(1)
        sub_local, seq_idx = sub_local.contiguous(), seq_idx.contiguous()
    block_d = min(128, triton.next_power_of_2(max(dk, value_dim)))
    _window_merge_kernel[(t, hq)](
        q, out, lse, o_new, lse_new, flat, slots, _bytes(valid), sub_t, _bytes(sub_v),
        sub_local, seq_idx, table, c_scale if c_scale is not None else slots,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        o_new.stride(0), o_new.stride(1), lse_new.stride(0),
        flat.stride(0), flat.stride(-2) if gqa else 0, value_offset,
        stride_sn, table.stride(0), num_blocks,
        na, ns, hq // hkv, float(scale), float(softcap or 0.0),
        DK=dk, DV=value_dim, BLOCK_N=max(16, triton.next_power_of_2(na)),
        BLOCK_S=max(16, triton.next_power_of_2(max(ns, 1))), BLOCK_D=block_d,
        HAS_SUB=ns > 0, SOFTCAP=bool(softcap), HAS_SCALE=c_scale is not None, PAGE=page,
    )  # fmt: skip
    return o_new, lse_new
