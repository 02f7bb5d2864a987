"""CUDA launchers of PCP head/tail prefill attention: causal square + rectangle + LSE merge.

Shape letters: T = this rank's local queries (padding included), N = restored new tokens, C =
cached-prefix tokens, L / M = queries / keys of one block, Hq / Hkv = query / KV heads,
Dqk / Dv = head dims, S = segments (``cp_modules.partition.plan.SEGMENT_FIELDS``).

A segment's bottom-right causal attention over ``k_len`` keys is split into blocks that every
fused attention kernel serves at full speed:

* the causal *square*: the segment's ``q_len`` queries against its last ``q_len`` keys;
* the *rectangle*: the same queries against the ``k_len - q_len`` keys before them, no mask;
* the *prefix*: the same queries against the request's cached prefix, no mask;

merged exactly by their LSEs in one Triton pass that writes the segment's rows of the result.
On the H200 this beats bottom-right-causal kernels by ~1.7x (see the PCP table of the
toolchain notes). Each block runs on the fastest kernel PyTorch
ships for its shape (cuDNN, else FlashAttention-2, else the fp32 reference for shapes and
dtypes neither serves). The backward runs the same blocks with the *merged* output and LSE,
so each block's probabilities are its share of the full softmax and the block gradients sum to
the gradient of the whole attention. Lengths come from the host copy of the plan's segments:
nothing here reads device memory on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from cp_modules.reference.pcp_attention import (
    attention_with_lse,
    attention_with_lse_backward,
    lse_dtype,
    merge_partials_reference,
)

__all__ = [
    "BLOCK_BACKENDS",
    "attention_block_backward",
    "attention_block_forward",
    "merge_partials_into",
    "merge_partials_triton",
    "pcp_prefill_attention_backward_cuda",
    "pcp_prefill_attention_cuda",
    "select_block_backend",
]

BLOCK_BACKENDS = ("cudnn", "flash", "reference")

BlockForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BlockBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def select_block_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """Fastest of :data:`BLOCK_BACKENDS` that serves this block ([L, H, D] tensors)."""
    if q.device.type != "cuda":
        return "reference"
    qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    params = torch.backends.cuda.SDPAParams(qt, kt, vt, None, 0.0, causal, gqa)
    # cuDNN is the fastest on Hopper for these shapes, but PyTorch's private cuDNN entry takes
    # no GQA; FlashAttention-2 reads grouped KV heads natively but needs Dqk == Dv.
    if not gqa and torch.backends.cuda.can_use_cudnn_attention(params, False):
        return "cudnn"
    if q.shape[-1] == v.shape[-1] and torch.backends.cuda.can_use_flash_attention(params, False):
        return "flash"
    return "reference"


def _bhld(x: torch.Tensor) -> torch.Tensor:
    # [L, H, D] rows of a contiguous [T, H, D] tensor -> [1, H, L, D] view; the kernels read the
    # (B, L, H, D) memory layout directly.
    return x.unsqueeze(0).transpose(1, 2)


def attention_block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention and LSE: out [L, Hq, Dv] (q's dtype), lse [L, Hq] fp32.

    ``causal`` is only used for square blocks (L == M), where top-left and bottom-right
    alignment agree.
    """
    backend = backend or select_block_backend(q, k, v, causal)
    L, H = q.shape[0], q.shape[1]
    if backend == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhld(q), _bhld(k), _bhld(v), None, True, 0.0, causal, False, scale=scale
        )
    elif backend == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhld(q), _bhld(k), _bhld(v), 0.0, causal, False, scale=scale
        )
    else:
        assert backend == "reference", backend
        return attention_with_lse(q, k, v, scale=scale, causal=causal)
    out, lse = res[0], res[1]
    return out.squeeze(0).transpose(0, 1), lse.reshape(H, L).transpose(0, 1)


def attention_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv) from the merged ``out`` [L, Hq, Dv] and ``lse`` [L, Hq] fp32."""
    backend = backend or select_block_backend(q, k, v, causal)
    L, M = q.shape[0], k.shape[0]
    if backend == "reference":
        return attention_with_lse_backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
    # With dropout 0 the kernels never read the RNG state, but the schemas require tensors.
    lse_h = lse.transpose(0, 1).contiguous().unsqueeze(0)
    if backend == "cudnn":
        seed = torch.empty((), dtype=torch.long, device=q.device)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhld(dout), _bhld(q), _bhld(k), _bhld(v), _bhld(out), lse_h.unsqueeze(-1),
            seed, seed, None, None, None, L, M, 0.0, causal, scale=scale,
        )  # fmt: skip
    else:
        assert backend == "flash", backend
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bhld(dout), _bhld(q), _bhld(k), _bhld(v), _bhld(out), lse_h,
            None, None, L, M, 0.0, causal, seed, offset, scale=scale,
        )  # fmt: skip
    return tuple(g.squeeze(0).transpose(0, 1) for g in grads)


@triton.jit
def _merge_kernel(
    o0, o1, o2, l0, l1, l2, dst, dst_lse,
    num_rows, num_heads, head_dim,
    so0_t, so0_h, so1_t, so1_h, so2_t, so2_h,
    sl0_t, sl0_h, sl1_t, sl1_h, sl2_t, sl2_h,
    sd_t, sd_h, sdl_t, sdl_h,
    NUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_R (token, head) rows x BLOCK_D columns of the merged output.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    t = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (cols < head_dim)[None, :]
    a0 = tl.load(l0 + t * sl0_t + h * sl0_h, mask=row_mask, other=0.0)
    a1 = tl.load(l1 + t * sl1_t + h * sl1_h, mask=row_mask, other=0.0)
    m = tl.maximum(a0, a1)
    if NUM == 3:
        a2 = tl.load(l2 + t * sl2_t + h * sl2_h, mask=row_mask, other=0.0)
        m = tl.maximum(m, a2)
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
    acc = acc / total[:, None]
    out_ptr = dst + (t * sd_t + h * sd_h)[:, None] + cols[None, :]
    tl.store(out_ptr, acc.to(dst.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(dst_lse + t * sdl_t + h * sdl_h, m + tl.log(total), mask=row_mask)


def merge_partials_triton(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_rows: int = 32,
) -> None:
    """Merge 2 or 3 partials into ``out`` [L, H, D] and ``lse`` [L, H] fp32 (written in place).

    Same math as :func:`~cp_modules.reference.pcp_attention.merge_partials_reference`, in one
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
    o = list(outs) + [outs[0]] * (3 - num)
    s = list(lses) + [lses[0]] * (3 - num)
    block_d = min(triton.next_power_of_2(D), 128)
    grid = (triton.cdiv(L * H, block_rows), triton.cdiv(D, block_d))
    _merge_kernel[grid](
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
    fused = out.is_cuda and len(outs) in (2, 3) and lse.dtype == torch.float32
    if fused:
        merge_partials_triton(outs, [x.float() for x in lses], out, lse)
        return
    o, s = merge_partials_reference(outs, lses, out.dtype)
    out.copy_(o)
    lse.copy_(s)


def _host(segments: torch.Tensor) -> torch.Tensor:
    # The plan keeps a host copy (``segments_host``) so that this is free; a device copy works
    # but costs a synchronization.
    return segments if segments.device.type == "cpu" else segments.cpu()


def _segment_blocks(
    seg: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu: list[int] | None,
) -> list[tuple[str, int, torch.Tensor, torch.Tensor, bool]]:
    """(where, first key row, keys, values, causal) of each block of one segment."""
    req, _, ql, k0, kl = seg
    split = k0 + kl - ql
    blocks = [("new", split, k[split : k0 + kl], v[split : k0 + kl], True)]
    if kl > ql:
        blocks.append(("new", k0, k[k0:split], v[k0:split], False))
    if prefix_cu is not None and prefix_cu[req + 1] > prefix_cu[req]:
        p0, p1 = prefix_cu[req], prefix_cu[req + 1]
        blocks.append(("prefix", p0, prefix_k[p0:p1], prefix_v[p0:p1], False))
    return blocks


def pcp_prefill_attention_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu_seqlens: torch.Tensor | None,
    scale: float,
    *,
    block_forward: BlockForward = attention_block_forward,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention of the local queries by blocks; same contract as the reference.

    Args:
        q: [T, Hq, Dqk]; k: [N, Hkv, Dqk]; v: [N, Hkv, Dv]; segments: [S, 5] int64 on the host;
        prefix_k: [C, Hkv, Dqk]; prefix_v: [C, Hkv, Dv]; prefix_cu_seqlens: [R + 1] int64 on the
        host (or the three None); scale: softmax scale.
        block_forward: the per-block kernel (tests pass the reference to check the
            decomposition on CPU).

    Returns:
        out [T, Hq, Dv] in q's dtype (0 on padding rows), lse [T, Hq] fp32 (-inf on padding).
    """
    segments = _host(segments)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    has_prefix = prefix_k is not None and prefix_cu_seqlens is not None
    if has_prefix:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    prefix_cu = prefix_cu_seqlens.tolist() if has_prefix else None  # ok: host (CPU tensor)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    for seg in segments.tolist():  # ok: host (segments_host)
        q0, ql = seg[1], seg[2]
        if ql == 0:
            continue
        rows = q[q0 : q0 + ql]
        outs, lses = [], []
        for _, _, kb, vb, causal in _segment_blocks(seg, k, v, prefix_k, prefix_v, prefix_cu):
            o, s = block_forward(rows, kb, vb, scale=scale, causal=causal)
            outs.append(o)
            lses.append(s)
        merge_partials_into(outs, lses, out[q0 : q0 + ql], lse[q0 : q0 + ql])
    return out, lse


def pcp_prefill_attention_backward_cuda(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu_seqlens: torch.Tensor | None,
    scale: float,
    *,
    block_backward: BlockBackward = attention_block_backward,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`pcp_prefill_attention_cuda`, block by block.

    Returns:
        dq [T, Hq, Dqk], dk [N, Hkv, Dqk], dv [N, Hkv, Dv], dprefix_k, dprefix_v (None
        without a prefix), each in its input's dtype.
    """
    segments = _host(segments)
    dout, q, k, v, out = (x.contiguous() for x in (dout, q, k, v, out))
    has_prefix = prefix_k is not None and prefix_cu_seqlens is not None
    if has_prefix:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    prefix_cu = prefix_cu_seqlens.tolist() if has_prefix else None  # ok: host (CPU tensor)
    # A query gets up to three block gradients (square, rectangle, prefix): dq is accumulated
    # in fp32 and rounded once. A key gets at most two (a request's head and tail blocks), and
    # adding two kernel outputs in place computes in fp32 and rounds once, so dk/dv stay in
    # the input dtype at no cost in accuracy, and half the memory traffic.
    dq = torch.zeros(q.shape, dtype=lse_dtype(q.dtype), device=q.device)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dpk = torch.zeros_like(prefix_k) if has_prefix else None
    dpv = torch.zeros_like(prefix_v) if has_prefix else None
    for seg in segments.tolist():  # ok: host (segments_host)
        q0, ql = seg[1], seg[2]
        if ql == 0:
            continue
        r = slice(q0, q0 + ql)
        for where, first, kb, vb, causal in _segment_blocks(
            seg, k, v, prefix_k, prefix_v, prefix_cu
        ):
            gq, gk, gv = block_backward(
                dout[r], q[r], kb, vb, out[r], lse[r], scale=scale, causal=causal
            )
            dk_acc, dv_acc = (dk, dv) if where == "new" else (dpk, dpv)
            dq[r] += gq
            dk_acc[first : first + kb.shape[0]] += gk
            dv_acc[first : first + kb.shape[0]] += gv
    return (
        dq.to(q.dtype),
        dk,
        dv,
        dpk,
        dpv,
    )
