"""The context-parallel attention ops: ``cp::gqa_attention`` and ``cp::mla_attention``.

Each (and its ``*_with_cache`` twin, which writes the KV cache in place and is not
differentiable) is the whole attention of one layer after its projections (and RoPE): PCP gather and
restore of the new K/V (or MLA latent), the KV-cache write, DualChunkSwap head/tail attention
over the new tokens plus the cached prefix (gathered from the DCP shards), and the paged decode
path with the DCP combine for decode tokens. Layers with a sliding window receive only the new
K/V their windows see instead of the whole gather (``CPPolicy.window_exchange``,
:mod:`cp_modules.partition.window_exchange`; its backward sends dK/dV back the same routes).
The step's metadata comes from
:func:`cp_modules.step.current_step`, so traced code sees only q/k/v/caches: the op
is the single split point of piecewise compilation and a new batch composition never
recompiles.

Shape letters: T = local tokens, N = new tokens of the batch, H = local query heads,
Hkv = local KV heads, D = head dim, Dv = value head dim; MLA: Rk = kv_lora_rank, Dr = rope
dim, Dn = nope dim, L = Rk + Dr (latent row).

Training: both ops are differentiable w.r.t. their inputs (q, k, v; q, latent, w_kv).
The backward re-gathers the local K/V (or latent) over PCP instead of saving the gathered
copy (a P-fold smaller activation footprint per layer), runs the head/tail attention backward
with the saved output and LSE, and reduce-scatters the K/V gradients back to their ranks.
MLA's backward can instead run key-major (:func:`~cp_modules.ops.mla_attention.mla_backward_path`):
each rank takes the gradients of its own keys from all-gathered Q, O, dO and LSE, and
reduce-scatters dQ. This module holds GQA/MHA; MLA is :mod:`cp_modules.ops.mla_attention`,
their shared pieces :mod:`cp_modules.ops.cp_common`.

The plan travels with the graph: the trainable ops return a plan handle
(:func:`~cp_modules.step.step_handle`) saved for their backward.
"""

from __future__ import annotations

import torch

from cp_modules.distributed.collectives import reduce_scatter
from cp_modules.ops.cp_common import (
    CACHE_NEEDS_NO_GRAD,
    check_cache,
    check_local,
    check_trainable,
    eager_step_of,
    exchange_kv,
    exchange_kv_backward,
    gather_kv,
    handle_fake,
    lse_dtype_of,
    one_rank,
    read_prefix,
)
from cp_modules.ops.exact_window import check_window_args, write_step_window
from cp_modules.ops.exact_window import decode as window_decode
from cp_modules.ops.kv_cache import write_kv_cache
from cp_modules.ops.paged_decode import paged_attention
from cp_modules.ops.pcp_attention import check_masking, pcp_prefill_attention
from cp_modules.ops.pcp_policy import pcp_policy_args, pcp_prefill_attention_backward_cuda
from cp_modules.reference.paged_decode import paged_attention_ref
from cp_modules.reference.pcp_attention import PrefillInputs
from cp_modules.step import CPStepMetadata, current_step, step_handle, step_of

__all__ = ["gqa_attention"]

# ----------------------------------------------------------------------------- GQA / MHA


def _gqa_forward(
    q, k, v, k_cache, v_cache, scale, sinks=None, window=0, softcap=0.0, differentiable=False,
    k_scale=None, v_scale=None, window_buf=None, fp8_sink=0, fp8_recent=0,
):  # fmt: skip
    # A windowed layer's cache may be its layer group's own (it keeps only its window).
    meta = current_step().for_window(window)
    check_local(meta, q, k, v)
    has_cache = k_cache.numel() > 0
    exact = None
    if has_cache:
        check_cache(meta, k, k_cache, v_cache)
        if k_cache.shape[2:] != k.shape[1:]:
            raise ValueError(
                f"KV cache holds [heads, dim] = {list(k_cache.shape[2:])} per token but the layer "
                f"produces {list(k.shape[1:])} on this rank"
            )
        tail = (2, *k_cache.shape[2:])
        exact = check_window_args(window_buf, fp8_sink, fp8_recent, k_cache, tail, meta, k.dtype)
    out_shape = (q.shape[0], q.shape[1], v.shape[2])
    if has_cache and meta.slot_mapping is None:
        raise RuntimeError("a KV cache was given but the step has no block table")
    xplan = None if meta.all_decode else _window_plan(meta, window, has_cache)
    # Every local row a decode token, in batch order (local_decode_idx is 0..T-1): the decode
    # result is the output, with no zeroed buffer, gather or scatter around it.
    only_decode = meta.all_decode and meta.has_decode
    if not only_decode:
        # The prefill kernels take dense rows; the decode kernels and the cache write take any
        # row and head strides (HF's [1, H, T, D] views, transposed: a copy per layer saved).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    slots = meta.slot_mapping
    if meta.all_decode:
        # Decode tokens are replicated on every PCP rank in batch order: nothing to gather.
        k_full, v_full = k, v
    elif xplan is not None:
        # Only the keys this rank's windows see (and the tokens of its cache shard).
        k_full, v_full = exchange_kv(k, v, meta, xplan)
        if has_cache:
            assert slots is not None
            slots = slots.index_select(0, xplan.token_ids)
    else:
        k_full, v_full = gather_kv(k, v, meta)
    if has_cache:
        assert slots is not None
        write_kv_cache(k_full, v_full, k_cache, v_cache, slots, k_scale, v_scale)
        if exact is not None:
            ids = None if xplan is None else xplan.token_ids
            kv_new = torch.stack((k_full, v_full), 1)
            write_step_window(window_buf, exact, kv_new, slots, meta, ids, (window,))
    if not meta.all_decode:
        prefix = {}
        if meta.has_prefix:
            prefix = dict(
                prefix_k=read_prefix(k_cache, meta, k_scale, q.dtype),
                prefix_v=read_prefix(v_cache, meta, v_scale, q.dtype),
                prefix_cu_seqlens=meta.prefix_cu_seqlens,
            )
        # Fresh outputs of the prefill op: decode rows are written into them in place.
        if xplan is None:
            out, lse = pcp_prefill_attention(
                q, k_full, v_full, meta.plan, scale=scale, policy=meta.runtime.policy,
                sliding_window=window or None, softcap=softcap or None,
                differentiable=differentiable, **prefix,
            )  # fmt: skip
        else:
            # The wrapper's checks hold for the plan's restored K/V; the exchanged rows come
            # with their own segments.
            out, lse = torch.ops.cp.pcp_prefill_attention(
                q, k_full, v_full, xplan.segments_host, prefix.get("prefix_k"),
                prefix.get("prefix_v"), prefix.get("prefix_cu_seqlens"), scale,
                *pcp_policy_args(
                    meta.runtime.policy, q.shape[2], v.shape[2], differentiable=differentiable
                ),
                window, softcap,
            )  # fmt: skip
        lse = lse.to(lse_dtype_of(q))
    elif not only_decode:
        out = q.new_zeros(out_shape)
        lse = torch.full(out_shape[:2], float("-inf"), dtype=lse_dtype_of(q), device=q.device)
    if meta.has_decode:
        if not has_cache:
            raise RuntimeError("decode requests need a KV cache")
        idx = meta.local_decode_idx
        kv_start = meta.decode_kv_start(window)

        def attend(qq, kv_len=meta.decode_kv_len, start=kv_start, exact=None):
            if exact is not None:  # CPU, an fp8 cache's window: its rows in place (reference)
                return paged_attention_ref(
                    qq, k_cache, v_cache, meta.block_table, meta.decode_seq_idx, kv_len, scale,
                    query_kv_start=start, softcap=softcap or None, k_scale=k_scale,
                    v_scale=v_scale, exact=exact,
                )  # fmt: skip
            return paged_attention(
                qq, k_cache, v_cache, meta.block_table, meta.decode_seq_idx, kv_len,
                scale=scale, query_kv_start=start, softcap=softcap or None, k_scale=k_scale,
                v_scale=v_scale, query_len=meta.decode_query_len,
            )  # fmt: skip

        q_dec = q if only_decode else q.index_select(0, idx)
        o, lse_d = window_decode(
            q_dec, meta, attend, exact, window_buf, scale, window, softcap or None
        )
        if only_decode:
            out, lse = o.to(q.dtype).contiguous(), lse_d.to(lse_dtype_of(q)).contiguous()
        else:
            out.index_copy_(0, idx, o.to(out.dtype))
            lse.index_copy_(0, idx, lse_d.to(lse.dtype))
    if sinks is not None:
        out, lse = _apply_sinks(out, lse, sinks)
    return out, lse


def _window_plan(meta: CPStepMetadata, window: int, with_cache: bool):
    """The step's K/V exchange for a windowed layer, or None (all-gather): no window, one PCP
    rank, the policy's ``window_exchange`` off, or every rank needing every token."""
    rt = meta.runtime
    if not window or rt.pcp_size == 1 or not rt.policy.window_exchange:
        return None
    return meta.window_exchange(window, with_cache)


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[1]):
        raise ValueError(
            f"sinks must hold one logit per local query head, [{q.shape[1]}], got "
            f"{tuple(sinks.shape)}"
        )


def _apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """Attention sinks on the merged result: softmax over the scores and one logit ``s_h``
    per head, the sink column dropped. With ``L`` the merged LSE: ``O' = O * sigmoid(L - s)``
    and ``L' = logaddexp(L, s)``. Applied once per query token after every PCP/DCP merge, so
    each rank's partial results stay sink-free. Rows without keys (``L = -inf``) stay 0."""
    s = sinks.to(lse.dtype)[None, :]
    lse_s = torch.logaddexp(lse, s)
    return out * torch.exp(lse - lse_s).unsqueeze(-1).to(out.dtype), lse_s


def _sinks_grad(dout, out, lse, sinks, valid):
    """Gradient of the sink logits from the output with sinks ``out`` and its LSE ``lse``:
    ``ds_h = -sum_t exp(s_h - L'_t) * (dO'_t . O'_t)`` over this rank's real tokens (a partial
    sum, like a weight gradient)."""
    acc = lse.dtype
    d = (dout.to(acc) * out.to(acc)).sum(-1)  # [T, H]
    p_sink = torch.exp(sinks.to(acc)[None, :] - lse)
    return -(p_sink * d * valid[:, None].to(acc)).sum(0).to(sinks.dtype)


@torch.library.custom_op("cp::gqa_attention", mutates_args=())
def _gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    window: int,
    softcap: float,
    differentiable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, handle): ``handle`` names the step's plan for the backward (:func:`step_handle`);
    with ``sinks`` [H], ``out`` and ``lse`` include the sink (see :func:`_apply_sinks`).
    ``differentiable``: autograd will differentiate ``out`` (training: the forward runs on
    cuDNN at once, :func:`~cp_modules.ops.pcp_policy.pcp_policy_args`)."""
    empty = q.new_empty(0)
    meta = current_step()
    check_trainable(meta)
    out, lse = _gqa_forward(q, k, v, empty, empty, scale, sinks, window, softcap, differentiable)
    return out, lse, step_handle(meta)


@torch.library.custom_op(
    "cp::gqa_attention_with_cache", mutates_args=("k_cache", "v_cache", "window_buf")
)
def _gqa_attention_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    window_buf: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    window: int,
    softcap: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fp8_sink: int = 0,
    fp8_recent: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``window_buf`` with ``fp8_sink`` / ``fp8_recent``: an fp8 cache's bf16 window
    (:mod:`cp_modules.cache.exact_window`), written in place and read by the decode queries;
    an empty tensor without one. (A mutated argument comes before any with a default: a
    boxed call may drop trailing defaults, and the in-place bookkeeping indexes by position.)"""
    return _gqa_forward(
        q, k, v, k_cache, v_cache, scale, sinks, window, softcap, k_scale=k_scale,
        v_scale=v_scale, window_buf=window_buf, fp8_sink=fp8_sink, fp8_recent=fp8_recent,
    )  # fmt: skip


def _gqa_fake(q, k, v, *args):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty(
        q.shape[:2], dtype=lse_dtype_of(q)
    )


_gqa_attention.register_fake(lambda q, k, v, *_: (*_gqa_fake(q, k, v), handle_fake(q)))
_gqa_attention_with_cache.register_fake(_gqa_fake)


@torch.library.custom_op("cp::gqa_attention_backward", mutates_args=())
def _gqa_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    handle: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dkv, dsinks): dkv [2, T, Hkv, D] holds dK then dV (one reduce-scatter result; an
    op's outputs may not alias, so autograd splits it); dsinks [H] (empty without sinks).
    ``handle``: the forward's plan. ``out`` and ``lse`` are the forward's, sinks included:
    the probabilities recomputed from them are the sink-normalised ones, so the attention
    backward needs nothing else for sinks."""
    meta = step_of(handle)
    rt = meta.runtime
    t = meta.num_local_tokens
    if one_rank(meta):
        dq, dk, dv, dsinks = _gqa_backward_one_rank(
            dout, q, k, v, out, lse, meta, sinks, scale, window, softcap
        )
        # The op's one output for dK and dV (eager autograd skips this op: _gqa_backward).
        return dq, torch.stack((dk, dv)), dsinks
    xplan = _window_plan(meta, window, False)
    if xplan is not None:
        k_x, v_x = exchange_kv(k, v, meta, xplan)
        dq, dk_x, dv_x, _, _ = torch.ops.cp.pcp_prefill_attention_backward(
            dout.contiguous(), q, k_x, v_x, out, lse, xplan.segments_host, None, None, None,
            scale, *pcp_policy_args(rt.policy, q.shape[2], v.shape[2]), window, softcap,
        )  # fmt: skip
        dkv = exchange_kv_backward(dk_x, dv_x, meta, xplan)
        dsinks = (
            q.new_empty(0)
            if sinks is None
            else _sinks_grad(dout, out, lse, sinks, meta.plan.local_valid)
        )
        return dq, dkv, dsinks
    k_full, v_full = gather_kv(k, v, meta)
    # The reduce-scatter input: per rank, its dK rows then its dV rows, so the result splits
    # into contiguous dK and dV without a copy.
    buf = k.new_empty((rt.pcp_size, 2, t, *k.shape[1:]))
    dout = dout.contiguous()
    runs = meta.plan.gather_runs_host
    min_rows = rt.policy.direct_grad_min_rows_per_run
    if q.is_cuda and not (window or softcap) and k_full.shape[0] >= min_rows * runs.shape[0]:
        # The kernels' gradient blocks are summed straight into the gathered layout.
        dk_into, dv_into = _gathered_targets(meta, buf)
        inputs = PrefillInputs(q, k_full, v_full, meta.plan.segments_host, None, None, None, scale)
        dq, *_ = pcp_prefill_attention_backward_cuda(
            dout, out, lse, inputs, policy=rt.policy, dk_into=dk_into, dv_into=dv_into
        )
    else:
        dq, dk_full, dv_full, _, _ = torch.ops.cp.pcp_prefill_attention_backward(
            dout, q, k_full, v_full, out, lse, meta.plan.segments_host, None, None, None, scale,
            *pcp_policy_args(rt.policy, q.shape[2], v.shape[2]), window, softcap,
        )  # fmt: skip
        rows = _gathered_rows(meta.plan.gather_index, t)
        flat = buf.view(-1, *k.shape[1:])
        flat.index_copy_(0, rows, dk_full)
        flat.index_copy_(0, rows + t, dv_full)
        _zero_padding(meta, buf)
    dkv = reduce_scatter(buf.view(-1, *k.shape[1:]), rt.pcp_group, rt.pcp_size)
    dsinks = (
        q.new_empty(0)
        if sinks is None
        else _sinks_grad(dout, out, lse, sinks, meta.plan.local_valid)
    )
    return dq, dkv.view(2, t, *k.shape[1:]), dsinks


def _gqa_backward_one_rank(dout, q, k, v, out, lse, meta, sinks, scale, window, softcap):
    """(dq, dk, dv, dsinks) at pcp = 1: the local K/V are the step's restored K/V and their
    gradients are complete on this rank, so the attention backward's results are returned as
    they are (no gather, no gradient buffer, no reduce-scatter)."""
    dq, dk, dv, _, _ = torch.ops.cp.pcp_prefill_attention_backward(
        dout.contiguous(), q, k.contiguous(), v.contiguous(), out, lse,
        meta.plan.segments_host, None, None, None, scale,
        *pcp_policy_args(meta.runtime.policy, q.shape[2], v.shape[2]), window, softcap,
    )  # fmt: skip
    dsinks = (
        q.new_empty(0)
        if sinks is None
        else _sinks_grad(dout, out, lse, sinks, meta.plan.local_valid)
    )
    return dq, dk, dv, dsinks


def _gathered_rows(index: torch.Tensor, t: int) -> torch.Tensor:
    # All-gathered rows (rank p, local row l) -> their dK rows p * 2T + l in a flat
    # [P, 2, T] buffer (their dV rows follow T later).
    return (index // t) * (2 * t) + index % t


def _zero_padding(meta: CPStepMetadata, buf: torch.Tensor) -> None:
    # The rows of ``buf`` [P, 2, T, ...] that no restored row lands on; on the device (no host
    # round trip, unlike an advanced-index assignment of a Python scalar).
    pad = meta.plan.gather_pad_index
    if pad.numel():
        rows = _gathered_rows(pad, meta.num_local_tokens)
        flat = buf.view(-1, *buf.shape[3:])
        flat.index_fill_(0, torch.cat((rows, rows + meta.num_local_tokens)), 0.0)


def _gathered_targets(meta: CPStepMetadata, buf: torch.Tensor):
    """Targets (:func:`sum_pieces_into`) that put restored dK / dV rows into ``buf``
    [P, 2, T, ...] at their all-gathered places; the padding places are zero-filled here."""
    t = meta.num_local_tokens
    dk_into, dv_into = [], []
    for first, g, n in meta.plan.gather_runs_host.tolist():  # ok: host (CPU tensor)
        p, row = divmod(g, t)
        dk_into.append((first, buf[p, 0, row : row + n]))
        dv_into.append((first, buf[p, 1, row : row + n]))
    _zero_padding(meta, buf)
    return dk_into, dv_into


@_gqa_attention_backward.register_fake
def _(dout, q, k, v, out, lse, handle, sinks, scale, window, softcap):
    ds = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), k.new_empty((2, *k.shape)), ds


def _gqa_setup(ctx, inputs, output):
    q, k, v, sinks, scale, window, softcap, *_ = inputs
    out, lse, handle = output
    ctx.scale, ctx.window, ctx.softcap = scale, window, softcap
    ctx.has_sinks = sinks is not None
    ctx.mark_non_differentiable(lse, handle)
    # No zero gradients are made for the LSE and the handle (they have none).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, handle, sinks)


def _gqa_backward(ctx, dout, _dlse, _dhandle):
    if dout is None:  # the output took no part in the loss
        return (None,) * 8
    q, k, v, out, lse, handle, sinks = ctx.saved_tensors
    sinks = sinks if ctx.has_sinks else None
    meta = eager_step_of(handle)
    if meta is not None and one_rank(meta):
        # Eager at pcp = 1: dK and dV come separately from the attention backward, without
        # the copy into the op's one [2, T] output.
        dq, dk, dv, dsinks = _gqa_backward_one_rank(
            dout, q, k, v, out, lse, meta, sinks, ctx.scale, ctx.window, ctx.softcap
        )
    else:
        dq, dkv, dsinks = torch.ops.cp.gqa_attention_backward(
            dout, q, k, v, out, lse, handle, sinks, ctx.scale, ctx.window, ctx.softcap
        )
        dk, dv = dkv[0], dkv[1]
    return dq, dk, dv, dsinks if ctx.has_sinks else None, None, None, None, None


_gqa_attention.register_autograd(_gqa_backward, setup_context=_gqa_setup)


def gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_window: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """Context-parallel GQA/MHA attention of this rank's local tokens for the current step.

    Args:
        q: [T, H, D] local queries (after RoPE), in ``meta.token_indices`` order (q, k and v:
            any row and head strides, last dim contiguous).
        k, v: [T, Hkv, D] local keys (after RoPE) and values; H a multiple of Hkv.
        kv_cache: ``(k_cache, v_cache)`` [NB, BS, Hkv, D] of this layer, written in place, or
            None (training, cache-less forward).
        scale: softmax scale.
        sinks: [H] per-head sink logits of the local heads (gpt-oss), or None: softmax over
            the scores and the sink, which takes probability but adds no value; differentiable.
        sliding_window: W >= 1: a query at position i attends keys at positions
            ``i - W < j <= i`` (transformers' convention), or None (full causal).
        softcap: c > 0: scores become ``c * tanh(scores / c)`` after scaling, before masking
            and softmax (Gemma 2), or None. Prefill and training serve both on every device
            (:mod:`cp_modules.ops.pcp_masked`); decode tokens through the paged decode
            kernel's per-query first key and soft-cap.
        kv_scales: an fp8 (e4m3) ``kv_cache``: its ``(k_scale, v_scale)``, fp32 [Hkv] or [1]
            (:func:`cp_modules.cache.kv_dtype.kv_scale`); None: 1.0. Written K/V are divided by
            them and quantized, cached K/V read back times them.
        fp8_window: an fp8 ``kv_cache``'s bf16 window ``(buffer, sink, recent)``
            (:mod:`cp_modules.cache.exact_window`): decode queries read the first ``sink`` and
            their ``recent`` newest tokens unquantized; None: none.

    Returns:
        [T, H, D] attention output of the local tokens (padding rows are 0).

    Raises:
        ValueError: for ``sinks`` that are not one logit per local head, a window < 1, a
            soft-cap <= 0, a masked path the step's policy forces and that does not serve
            the call, or a window or soft-cap for decode tokens on CUDA.
    """
    _check_sinks(sinks, q)
    check_masking(sliding_window, softcap)
    masking = (int(sliding_window or 0), float(softcap or 0.0))
    grads = (q, k, v) + (() if sinks is None else (sinks,))
    if kv_cache is None:
        # Dense rows for the forward and for the backward, which gets the saved inputs.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in grads)
        out, _, _ = torch.ops.cp.gqa_attention(q, k, v, sinks, scale, *masking, differentiable)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in grads):
        raise RuntimeError(CACHE_NEEDS_NO_GRAD)
    else:
        ks, vs = kv_scales if kv_scales is not None else (None, None)
        buf, sink, recent = fp8_window if fp8_window is not None else (q.new_empty(0), 0, 0)
        out, _ = torch.ops.cp.gqa_attention_with_cache(
            q, k, v, kv_cache[0], kv_cache[1], buf, sinks, scale, *masking, ks, vs, sink, recent
        )
    return out
