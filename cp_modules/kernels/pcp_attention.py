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
dtypes neither serves). A rank's head and tail squares of equal size run as one batched call
(a strided view, no copy): small causal squares are the least efficient blocks. The backward
runs the same blocks with the *merged* output and LSE, so each block's probabilities are its
share of the full softmax and the block gradients sum to the gradient of the whole attention;
each gradient row is then written once (:func:`sum_pieces_into`). Lengths come from the host
copy of the plan's segments: nothing here reads device memory on the host.

Measured on an H200 (bf16, 32 heads): cuDNN's non-causal backward runs at ~300 TFLOP/s for
Dqk 192 / Dv 128 (MLA prefill) against ~470 for its causal one and ~550 at D = 128, so MLA's
rectangles make its PCP backward ~1.4-1.6x dense/P while MHA and GQA stay within ~1.1x.
Merging the head's and tail's rectangles into one call, folding a square into a tall causal
call, overlapping the squares on a second stream, one FlexAttention call per rank and
splitting rectangles into causal pairs were measured and are not faster for these shapes
(benchmarks/2026-11-30-pcp-block-variants.md).
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


def _cudnn_takes_gqa() -> bool:
    # PyTorch's private cuDNN attention entry takes fewer KV heads than query heads, forward
    # and backward (dk/dv come back per KV head), in 2.11 (checked on an H200 against the fp32
    # reference and FlashAttention-2: test_gpu_block_backends_forward_and_backward). Older
    # releases are not assumed to.
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 11)


CUDNN_GQA = _cudnn_takes_gqa()

BlockForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BlockBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def select_block_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """Fastest of :data:`BLOCK_BACKENDS` that serves this block ([L, H, D] or [B, L, H, D])."""
    if q.device.type != "cuda":
        return "reference"
    qt, kt, vt = (_bhld(x) for x in (q, k, v))
    gqa = q.shape[-2] != k.shape[-2]
    params = torch.backends.cuda.SDPAParams(qt, kt, vt, None, 0.0, causal, gqa)
    # cuDNN is the fastest on Hopper for these shapes (2x FlashAttention-2 at D=128); where
    # PyTorch's private cuDNN entry does not take grouped KV heads (CUDNN_GQA False),
    # FlashAttention-2 reads them natively but needs Dqk == Dv.
    if (CUDNN_GQA or not gqa) and torch.backends.cuda.can_use_cudnn_attention(params, False):
        return "cudnn"
    if q.shape[-1] == v.shape[-1] and torch.backends.cuda.can_use_flash_attention(params, False):
        return "flash"
    return "reference"


def _bhld(x: torch.Tensor) -> torch.Tensor:
    # [L, H, D] rows of a contiguous [T, H, D] tensor (or a [B, L, H, D] view of such rows) ->
    # [B, H, L, D] view; the kernels read the (B, L, H, D) memory layout directly.
    return (x.unsqueeze(0) if x.dim() == 3 else x).transpose(1, 2)


def _blhd(x: torch.Tensor, batched: bool) -> torch.Tensor:
    # A kernel's [B, H, L, D] result back to [B, L, H, D] (or [L, H, D] for one block).
    x = x.transpose(1, 2)
    return x if batched else x.squeeze(0)


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

    Blocks of equal shape may come batched: [B, L, H, D] in, [B, L, Hq, Dv] and [B, L, Hq]
    out. ``causal`` is only used for square blocks (L == M), where top-left and bottom-right
    alignment agree.
    """
    backend = backend or select_block_backend(q, k, v, causal)
    batched = q.dim() == 4
    if backend == "reference":
        if not batched:
            return attention_with_lse(q, k, v, scale=scale, causal=causal)
        res = [attention_with_lse(*x, scale=scale, causal=causal) for x in zip(q, k, v)]
        return torch.stack([o for o, _ in res]), torch.stack([s for _, s in res])
    if backend == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhld(q), _bhld(k), _bhld(v), None, True, 0.0, causal, False, scale=scale
        )
    else:
        assert backend == "flash", backend
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhld(q), _bhld(k), _bhld(v), 0.0, causal, False, scale=scale
        )
    out, lse = res[0], res[1]
    B, H, L = out.shape[:3]
    return _blhd(out, batched), _blhd(lse.reshape(B, H, L, 1), batched)[..., 0]


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
    """One block's (dq, dk, dv) from the merged ``out`` [L, Hq, Dv] and ``lse`` [L, Hq] fp32
    (or batched blocks: a leading B on every argument and result)."""
    backend = backend or select_block_backend(q, k, v, causal)
    batched = q.dim() == 4
    if backend == "reference":
        if not batched:
            return attention_with_lse_backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
        res = [
            attention_with_lse_backward(*x, scale=scale, causal=causal)
            for x in zip(dout, q, k, v, out, lse)
        ]
        return tuple(torch.stack(g) for g in zip(*res))
    L, M = q.shape[-3], k.shape[-3]
    # With dropout 0 the kernels never read the RNG state, but the schemas require tensors.
    lse_h = _bhld(lse.unsqueeze(-1)).squeeze(-1).contiguous()  # [B, H, L]
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
    return tuple(_blhd(g, batched) for g in grads)


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
    if len(outs) == 1:
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


def _host(segments: torch.Tensor) -> torch.Tensor:
    # The plan keeps a host copy (``segments_host``) so that this is free; a device copy works
    # but costs a synchronization.
    return segments if segments.device.type == "cpu" else segments.cpu()


def _rows(x: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """``length`` rows of ``x`` (contiguous [N, ...]) from each start.

    One start gives the slice; two give a [2, length, ...] view whose batch stride is the
    distance between the starts (no copy), which is how two equal squares share one call.
    """
    if len(starts) == 1:
        return x[starts[0] : starts[0] + length]
    a, b = starts
    assert b > a and x.is_contiguous()
    row = x.stride(0)
    return x.as_strided(
        (2, length, *x.shape[1:]),
        ((b - a) * row, *x.stride()),
        x.storage_offset() + a * row,
    )


def _square_groups(segs: list[list[int]]) -> list[list[int]]:
    """Indices of the segments whose causal squares run in one call.

    Two segments pair up when their squares have the same size and both their query rows and
    their square keys start later for the second (positive batch strides): a request's head
    and tail on a rank, in a training batch of equal-length sequences. Others run alone.
    """
    groups, i = [], 0
    while i < len(segs):
        a = segs[i]
        if i + 1 < len(segs):
            b = segs[i + 1]
            if b[2] == a[2] and b[1] > a[1] and _square_start(b) > _square_start(a):
                groups.append([i, i + 1])
                i += 2
                continue
        groups.append([i])
        i += 1
    return groups


def _square_start(seg: list[int]) -> int:
    _, _, ql, k0, kl = seg
    return k0 + kl - ql


def _other_blocks(
    seg: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu: list[int] | None,
) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """(where, first key row, keys, values) of a segment's unmasked blocks: the rectangle of
    new keys before its square, and its request's cached prefix."""
    req, _, ql, k0, kl = seg
    blocks = []
    if kl > ql:
        split = k0 + kl - ql
        blocks.append(("new", k0, k[k0:split], v[k0:split]))
    if prefix_cu is not None and prefix_cu[req + 1] > prefix_cu[req]:
        p0, p1 = prefix_cu[req], prefix_cu[req + 1]
        blocks.append(("prefix", p0, prefix_k[p0:p1], prefix_v[p0:p1]))
    return blocks


def _segments(segments: torch.Tensor) -> list[list[int]]:
    return [s for s in _host(segments).tolist() if s[2] > 0]  # ok: host (segments_host)


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
    segs = _segments(segments)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    has_prefix = prefix_k is not None and prefix_cu_seqlens is not None
    if has_prefix:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    prefix_cu = prefix_cu_seqlens.tolist() if has_prefix else None  # ok: host (CPU tensor)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    squares: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for group in _square_groups(segs):
        ql = segs[group[0]][2]
        ks = [_square_start(segs[i]) for i in group]
        o, s = block_forward(
            _rows(q, [segs[i][1] for i in group], ql),
            _rows(k, ks, ql),
            _rows(v, ks, ql),
            scale=scale,
            causal=True,
        )
        for j, i in enumerate(group):
            squares[i] = (o[j], s[j]) if len(group) > 1 else (o, s)
    for i, seg in enumerate(segs):
        r = slice(seg[1], seg[1] + seg[2])
        outs, lses = [squares[i][0]], [squares[i][1]]
        for _, _, kb, vb in _other_blocks(seg, k, v, prefix_k, prefix_v, prefix_cu):
            o, s = block_forward(q[r], kb, vb, scale=scale, causal=False)
            outs.append(o)
            lses.append(s)
        merge_partials_into(outs, lses, out[r], lse[r])
    return out, lse


def sum_pieces_into(dst: torch.Tensor, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Write into ``dst`` [N, ...] the sum of row ranges ``(first row, rows)``; 0 elsewhere.

    Each run of rows covered by the same pieces is written once: zero-filled, copied, or the
    sum of its pieces computed in fp32 and rounded once (what ``a + b`` of two half tensors
    does) — so no zeroed buffer is read back and each gradient block is read exactly once.
    """
    n = dst.shape[0]
    events: dict[int, list[int]] = {0: [], n: []}
    for idx, (first, x) in enumerate(pieces):
        if x.shape[0] == 0:
            continue
        assert 0 <= first and first + x.shape[0] <= n
        events.setdefault(first, []).append(idx)
        events.setdefault(first + x.shape[0], []).append(~idx)
    active: list[int] = []
    points = sorted(events)
    for a, b in zip(points, points[1:]):
        for e in events[a]:
            if e >= 0:
                active.append(e)
            else:
                active.remove(~e)
        rows = dst[a:b]
        parts = [pieces[i][1][a - pieces[i][0] : b - pieces[i][0]] for i in active]
        if not parts:
            rows.zero_()
        elif len(parts) == 1:
            rows.copy_(parts[0])
        elif len(parts) == 2 and dst.dtype == parts[0].dtype == parts[1].dtype:
            torch.add(parts[0], parts[1], out=rows)
        else:
            acc = parts[0].to(lse_dtype(dst.dtype))
            for p in parts[1:]:
                acc = acc + p
            rows.copy_(acc)
    return dst


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

    Every block (the paired squares, each rectangle and prefix) yields (dq, dk, dv) for its
    rows; :func:`sum_pieces_into` then writes each gradient once. A query gets up to three
    pieces (square, rectangle, prefix), a new key up to two (a request's head and tail), so
    the sums are exact fp32 sums of the kernels' outputs rounded once.

    Returns:
        dq [T, Hq, Dqk], dk [N, Hkv, Dqk], dv [N, Hkv, Dv], dprefix_k, dprefix_v (None
        without a prefix), each in its input's dtype.
    """
    segs = _segments(segments)
    dout, q, k, v, out = (x.contiguous() for x in (dout, q, k, v, out))
    lse = lse.contiguous()
    has_prefix = prefix_k is not None and prefix_cu_seqlens is not None
    if has_prefix:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    prefix_cu = prefix_cu_seqlens.tolist() if has_prefix else None  # ok: host (CPU tensor)
    dq_p: list[tuple[int, torch.Tensor]] = []
    dk_p: dict[str, list[tuple[int, torch.Tensor]]] = {"new": [], "prefix": []}
    dv_p: dict[str, list[tuple[int, torch.Tensor]]] = {"new": [], "prefix": []}
    for group in _square_groups(segs):
        ql = segs[group[0]][2]
        qs = [segs[i][1] for i in group]
        ks = [_square_start(segs[i]) for i in group]
        gq, gk, gv = block_backward(
            _rows(dout, qs, ql),
            _rows(q, qs, ql),
            _rows(k, ks, ql),
            _rows(v, ks, ql),
            _rows(out, qs, ql),
            _rows(lse, qs, ql),
            scale=scale,
            causal=True,
        )
        if len(group) == 1:
            gq, gk, gv = (x.unsqueeze(0) for x in (gq, gk, gv))
        for j in range(len(group)):
            dq_p.append((qs[j], gq[j]))
            dk_p["new"].append((ks[j], gk[j]))
            dv_p["new"].append((ks[j], gv[j]))
    for seg in segs:
        r = slice(seg[1], seg[1] + seg[2])
        for where, first, kb, vb in _other_blocks(seg, k, v, prefix_k, prefix_v, prefix_cu):
            gq, gk, gv = block_backward(
                dout[r], q[r], kb, vb, out[r], lse[r], scale=scale, causal=False
            )
            dq_p.append((seg[1], gq))
            dk_p[where].append((first, gk))
            dv_p[where].append((first, gv))
    dq = sum_pieces_into(torch.empty_like(q), dq_p)
    dk = sum_pieces_into(torch.empty_like(k), dk_p["new"])
    dv = sum_pieces_into(torch.empty_like(v), dv_p["new"])
    dpk = sum_pieces_into(torch.empty_like(prefix_k), dk_p["prefix"]) if has_prefix else None
    dpv = sum_pieces_into(torch.empty_like(prefix_v), dv_p["prefix"]) if has_prefix else None
    return dq, dk, dv, dpk, dpv
