"""The context-parallel attention ops: ``cp::gqa_attention`` and ``cp::mla_attention``.

Each (and its ``*_with_cache`` twin, which writes the KV cache in place and is not
differentiable) is the whole attention of one layer after its projections (and RoPE): PCP gather and
restore of the new K/V (or MLA latent), the KV-cache write, DualChunkSwap head/tail attention
over the new tokens plus the cached prefix (gathered from the DCP shards), and the paged decode
path with the DCP combine for decode tokens. The step's metadata comes from
:func:`cp_modules.step.current_step`, so traced code sees only q/k/v/caches: the op
is the single split point of piecewise compilation and a new batch composition never
recompiles.

Shape letters: T = local tokens, N = new tokens of the batch, H = local query heads,
Hkv = local KV heads, D = head dim, Dv = value head dim; MLA: Rk = kv_lora_rank, Dr = rope
dim, Dn = nope dim, L = Rk + Dr (latent row).

Training: both ops are differentiable w.r.t. their inputs (q, k, v; q, latent, w_uk, w_uv).
The backward re-gathers the local K/V (or latent) over PCP instead of saving the gathered
copy (a P-fold smaller activation footprint per layer), runs the head/tail attention backward
with the saved output and LSE, and reduce-scatters the K/V gradients back to their ranks.
MLA's backward can instead run key-major (:func:`mla_backward_path`): each rank takes the
gradients of its own keys from all-gathered Q, O, dO and LSE, and reduce-scatters dQ.
"""

from __future__ import annotations

import torch

from cp_modules.distributed.collectives import all_gather, reduce_scatter
from cp_modules.kernels.attention_blocks import select_block_backend
from cp_modules.kernels.pcp_key_major import pcp_key_major_backward
from cp_modules.ops.dcp_comm import dcp_combine, dcp_prepare_query
from cp_modules.ops.kv_cache import write_kv_cache, write_mla_cache
from cp_modules.ops.paged_decode import paged_attention, paged_mla_attention
from cp_modules.ops.pcp_attention import pcp_prefill_attention
from cp_modules.ops.pcp_policy import pcp_policy_args, pcp_prefill_attention_backward_cuda
from cp_modules.step import CPStepMetadata, current_step, step_handle, step_of

__all__ = ["gqa_attention", "mla_attention"]

_CACHE_NEEDS_NO_GRAD = (
    "attention with a KV cache is inference-only (the cache write is not differentiable): run "
    "it under torch.no_grad() or torch.inference_mode(), or train without a cache"
)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    # fp32 LSEs, fp64 for fp64 inputs (the backward recomputes probabilities from them).
    return torch.promote_types(q.dtype, torch.float32)


def _gather(x: torch.Tensor, meta: CPStepMetadata) -> torch.Tensor:
    """All-gather local rows over PCP and restore the batch order ([T, ...] -> [N, ...])."""
    rt = meta.runtime
    gathered = all_gather(x, rt.pcp_group, rt.pcp_size)
    return gathered.index_select(0, meta.plan.gather_index)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, meta: CPStepMetadata):
    """:func:`_gather` of K and V [T, Hkv, D] in one collective; each result is contiguous.

    The local rows travel as one [T, 2, Hkv, D] block; the restore indexes the gathered rows
    of K and of V at once into a fresh [2, N, Hkv, D] tensor, so no further copy is needed.
    """
    rt = meta.runtime
    local = torch.stack((k, v), dim=1)
    gathered = all_gather(local, rt.pcp_group, rt.pcp_size)
    kv = gathered.transpose(0, 1).index_select(1, meta.plan.gather_index)
    return kv[0], kv[1]


def _scatter_grad(meta: CPStepMetadata, dx_full: torch.Tensor) -> torch.Tensor:
    """Backward of :func:`_gather`: put the rows back in all-gathered order and reduce-scatter
    them; returns [T, ...].

    Each restored row lands on its own gathered row (the restore is injective), so the rows are
    copied, not accumulated, and only the padding rows (none when N = P * T) are zeroed.
    """
    rt = meta.runtime
    buf = dx_full.new_empty((rt.pcp_size * meta.num_local_tokens, *dx_full.shape[1:]))
    buf.index_copy_(0, meta.plan.gather_index, dx_full)
    pad = meta.plan.gather_pad_index
    if pad.numel():
        buf.index_fill_(0, pad, 0.0)
    return reduce_scatter(buf, rt.pcp_group, rt.pcp_size)


def _gathered_rows_of(meta: CPStepMetadata, buf: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Targets (:func:`sum_pieces_into`) that put restored rows [N, ...] at their all-gathered
    places in ``buf`` [P * T, ...] (the inverse of :func:`_gather`'s restore; padding places
    are left to the caller)."""
    runs = meta.plan.gather_runs_host.tolist()  # ok: host (CPU tensor)
    return [(first, buf[g : g + n]) for first, g, n in runs]


def _read_prefix(cache: torch.Tensor, meta: CPStepMetadata) -> torch.Tensor:
    """Cached prefix rows of prefill requests, gathered from the DCP shards: [C, ...]."""
    flat = cache.flatten(0, 1)
    local = flat.index_select(0, meta.prefix_read_slots)
    dcp = meta.runtime.dcp
    if dcp is not None:
        local = all_gather(local, dcp.dcp_group, dcp.dcp_size)
    return local.index_select(0, meta.prefix_gather_index)


def _decode(q_dec, meta: CPStepMetadata, attend):
    """Paged attention of decode queries on this DCP shard, combined over the DCP group."""
    spec = meta.runtime.dcp
    if spec is None:
        return attend(q_dec)
    out, lse = attend(dcp_prepare_query(q_dec, spec))
    return dcp_combine(out, lse, spec, return_lse=True)


def _check_cache(meta: CPStepMetadata, kv: torch.Tensor, *caches: torch.Tensor) -> None:
    """Host-side checks (no device sync) that every rank makes identically before any collective."""
    for c in caches:
        if c.dtype != kv.dtype:
            raise ValueError(f"KV cache dtype {c.dtype} differs from the layer's K/V dtype {kv.dtype}")
        if c.device != kv.device:
            raise ValueError(f"KV cache is on {c.device} but the layer runs on {kv.device}")
        if meta.block_table is not None and meta.max_block_id >= c.shape[0]:
            raise ValueError(
                f"the step uses block id {meta.max_block_id} but the KV cache has only "
                f"{c.shape[0]} blocks: allocate more blocks or schedule fewer tokens"
            )


def _check_trainable(meta: CPStepMetadata) -> None:
    """A cache-less forward attends new tokens only: refuse steps with cached prefixes or
    decode requests (they need the KV cache) before any collective."""
    if meta.has_prefix or meta.has_decode:
        raise ValueError(
            "attention without a KV cache covers new tokens only: this step has cached "
            "prefixes or decode requests; pass the layer's KV cache (inference) or train on "
            "batches of new tokens"
        )


# ----------------------------------------------------------------------------- GQA / MHA


def _gqa_forward(q, k, v, k_cache, v_cache, scale, sinks=None):
    meta = current_step()
    _check_local(meta, q, k, v)
    has_cache = k_cache.numel() > 0
    if has_cache:
        _check_cache(meta, k, k_cache, v_cache)
        if k_cache.shape[2:] != k.shape[1:]:
            raise ValueError(
                f"KV cache holds [heads, dim] = {list(k_cache.shape[2:])} per token but the layer "
                f"produces {list(k.shape[1:])} on this rank"
            )
    out_shape = (q.shape[0], q.shape[1], v.shape[2])
    if meta.all_decode:
        # Decode tokens are replicated on every PCP rank in batch order: nothing to gather.
        k_full, v_full = k, v
    else:
        k_full, v_full = _gather_kv(k, v, meta)
    if has_cache:
        if meta.slot_mapping is None:
            raise RuntimeError("a KV cache was given but the step has no block table")
        write_kv_cache(k_full, v_full, k_cache, v_cache, meta.slot_mapping)
    if not meta.all_decode:
        prefix = {}
        if meta.has_prefix:
            prefix = dict(
                prefix_k=_read_prefix(k_cache, meta),
                prefix_v=_read_prefix(v_cache, meta),
                prefix_cu_seqlens=meta.prefix_cu_seqlens,
            )
        # Fresh outputs of the prefill op: decode rows are written into them in place.
        out, lse = pcp_prefill_attention(
            q, k_full, v_full, meta.plan, scale=scale, policy=meta.runtime.policy, **prefix
        )
        lse = lse.to(_lse_dtype(q))
    else:
        out = q.new_zeros(out_shape)
        lse = torch.full(out_shape[:2], float("-inf"), dtype=_lse_dtype(q), device=q.device)
    if meta.has_decode:
        if not has_cache:
            raise RuntimeError("decode requests need a KV cache")
        idx = meta.local_decode_idx
        o, lse_d = _decode(
            q.index_select(0, idx),
            meta,
            lambda qq: paged_attention(
                qq, k_cache, v_cache, meta.block_table, meta.decode_seq_idx,
                meta.decode_kv_len, scale=scale,
            ),
        )
        out.index_copy_(0, idx, o.to(out.dtype))
        lse.index_copy_(0, idx, lse_d.to(lse.dtype))
    if sinks is not None:
        out, lse = _apply_sinks(out, lse, sinks)
    return out, lse


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, handle): ``handle`` names the step's plan for the backward (:func:`step_handle`);
    with ``sinks`` [H], ``out`` and ``lse`` include the sink (see :func:`_apply_sinks`)."""
    empty = q.new_empty(0)
    meta = current_step()
    _check_trainable(meta)
    out, lse = _gqa_forward(q, k, v, empty, empty, scale, sinks)
    return out, lse, step_handle(meta)


@torch.library.custom_op("cp::gqa_attention_with_cache", mutates_args=("k_cache", "v_cache"))
def _gqa_attention_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _gqa_forward(q, k, v, k_cache, v_cache, scale, sinks)


def _gqa_fake(q, k, v, *args):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty(q.shape[:2], dtype=_lse_dtype(q))


def _handle_fake(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device="cpu")


_gqa_attention.register_fake(lambda q, k, v, sinks, scale: (*_gqa_fake(q, k, v), _handle_fake(q)))
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dkv, dsinks): dkv [2, T, Hkv, D] holds dK then dV (one reduce-scatter result; an
    op's outputs may not alias, so autograd splits it); dsinks [H] (empty without sinks).
    ``handle``: the forward's plan. ``out`` and ``lse`` are the forward's, sinks included:
    the probabilities recomputed from them are the sink-normalised ones, so the attention
    backward needs nothing else for sinks."""
    meta = step_of(handle)
    k_full, v_full = _gather_kv(k, v, meta)
    rt = meta.runtime
    t = meta.num_local_tokens
    # The reduce-scatter input: per rank, its dK rows then its dV rows, so the result splits
    # into contiguous dK and dV without a copy.
    buf = k.new_empty((rt.pcp_size, 2, t, *k.shape[1:]))
    args = (dout.contiguous(), q, k_full, v_full, out, lse, meta.plan.segments_host)
    runs = meta.plan.gather_runs_host
    min_rows = rt.policy.direct_grad_min_rows_per_run
    if q.is_cuda and k_full.shape[0] >= min_rows * runs.shape[0]:
        # The kernels' gradient blocks are summed straight into the gathered layout.
        dk_into, dv_into = _gathered_targets(meta, buf)
        dq, *_ = pcp_prefill_attention_backward_cuda(
            *args, None, None, None, scale, policy=rt.policy, dk_into=dk_into, dv_into=dv_into
        )
    else:
        dq, dk_full, dv_full, _, _ = torch.ops.cp.pcp_prefill_attention_backward(
            *args, None, None, None, scale, *pcp_policy_args(rt.policy, q.shape[2], v.shape[2])
        )
        rows = _gathered_rows(meta.plan.gather_index, t)
        flat = buf.view(-1, *k.shape[1:])
        flat.index_copy_(0, rows, dk_full)
        flat.index_copy_(0, rows + t, dv_full)
        _zero_padding(meta, buf)
    dkv = reduce_scatter(buf.view(-1, *k.shape[1:]), rt.pcp_group, rt.pcp_size)
    dsinks = q.new_empty(0) if sinks is None else _sinks_grad(dout, out, lse, sinks, meta.plan.local_valid)
    return dq, dkv.view(2, t, *k.shape[1:]), dsinks


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
def _(dout, q, k, v, out, lse, handle, sinks, scale):
    ds = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), k.new_empty((2, *k.shape)), ds


def _gqa_setup(ctx, inputs, output):
    q, k, v, sinks, scale = inputs
    out, lse, handle = output
    ctx.scale = scale
    ctx.has_sinks = sinks is not None
    ctx.mark_non_differentiable(lse, handle)
    ctx.save_for_backward(q, k, v, out, lse, handle, sinks)


def _gqa_backward(ctx, dout, _dlse, _dhandle):
    q, k, v, out, lse, handle, sinks = ctx.saved_tensors
    dq, dkv, dsinks = torch.ops.cp.gqa_attention_backward(
        dout, q, k, v, out, lse, handle, sinks if ctx.has_sinks else None, ctx.scale
    )
    return dq, dkv[0], dkv[1], dsinks if ctx.has_sinks else None, None


_gqa_attention.register_autograd(_gqa_backward, setup_context=_gqa_setup)


def _check_local(meta: CPStepMetadata, q: torch.Tensor, *kv: torch.Tensor) -> None:
    t = meta.num_local_tokens
    for name, x in zip(("q", "k/latent", "v"), (q, *kv)):
        if x.shape[0] != t:
            raise ValueError(
                f"{name} has {x.shape[0]} tokens but this rank's step has {t} local tokens "
                "(feed the model meta.token_indices of the batch)"
            )


def gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Context-parallel GQA/MHA attention of this rank's local tokens for the current step.

    Args:
        q: [T, H, D] local queries (after RoPE), in ``meta.token_indices`` order.
        k, v: [T, Hkv, D] local keys (after RoPE) and values; H a multiple of Hkv.
        kv_cache: ``(k_cache, v_cache)`` [NB, BS, Hkv, D] of this layer, written in place, or
            None (training, cache-less forward).
        scale: softmax scale.
        sinks: [H] per-head sink logits of the local heads (gpt-oss), or None: softmax over
            the scores and the sink, which takes probability but adds no value; differentiable.

    Returns:
        [T, H, D] attention output of the local tokens (padding rows are 0).

    Raises:
        ValueError: for ``sinks`` that are not one logit per local head.
    """
    _check_sinks(sinks, q)
    grads = (q, k, v) + (() if sinks is None else (sinks,))
    if kv_cache is None:
        out, _, _ = torch.ops.cp.gqa_attention(q, k, v, sinks, scale)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in grads):
        raise RuntimeError(_CACHE_NEEDS_NO_GRAD)
    else:
        out, _ = torch.ops.cp.gqa_attention_with_cache(q, k, v, kv_cache[0], kv_cache[1], sinks, scale)
    return out


# ----------------------------------------------------------------------------- MLA


def _up_project(latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, rk: int, num_heads: int):
    """Per-head K [N, H, Dn + Dr] and V [N, H, Dv] from latent rows [N, Rk + Dr]."""
    kv_c, k_pe = latent[:, :rk], latent[:, rk:]
    k_nope = torch.einsum("nc,hdc->nhd", kv_c, w_uk)
    v = torch.einsum("nc,hdc->nhd", kv_c, w_uv)
    k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, num_heads, -1)), dim=-1)
    return k.contiguous(), v.contiguous()


def _mla_forward(q, latent, w_uk, w_uv, cache, scale, kv_lora_rank):
    meta = current_step()
    _check_local(meta, q, latent)
    rk, h, dn = kv_lora_rank, q.shape[1], w_uk.shape[1]
    dv = w_uv.shape[1]
    has_cache = cache.numel() > 0
    if has_cache:
        _check_cache(meta, latent, cache)
        if cache.shape[-1] != latent.shape[-1]:
            raise ValueError(
                f"MLA cache rows hold {cache.shape[-1]} values but the latent has {latent.shape[-1]}"
            )
    out_shape = (q.shape[0], h, dv)
    latent_full = latent if meta.all_decode else _gather(latent, meta)
    if has_cache:
        if meta.slot_mapping is None:
            raise RuntimeError("a KV cache was given but the step has no block table")
        write_mla_cache(latent_full[:, :rk], latent_full[:, rk:], cache, meta.slot_mapping)
    if not meta.all_decode:
        k_full, v_full = _up_project(latent_full, w_uk, w_uv, rk, h)
        prefix = {}
        if meta.has_prefix:
            pk, pv = _up_project(_read_prefix(cache, meta), w_uk, w_uv, rk, h)
            prefix = dict(prefix_k=pk, prefix_v=pv, prefix_cu_seqlens=meta.prefix_cu_seqlens)
        # Fresh outputs of the prefill op: decode rows are written into them in place.
        out, lse = pcp_prefill_attention(
            q, k_full, v_full, meta.plan, scale=scale, policy=meta.runtime.policy, **prefix
        )
        lse = lse.to(_lse_dtype(q))
    else:
        out = q.new_zeros(out_shape)
        lse = torch.full(out_shape[:2], float("-inf"), dtype=_lse_dtype(q), device=q.device)
    if meta.has_decode:
        if not has_cache:
            raise RuntimeError("decode requests need a KV cache")
        idx = meta.local_decode_idx
        q_dec = q.index_select(0, idx)
        # Absorb W_UK into the query: attend the latent directly (q dim Rk + Dr).
        q_lat = torch.einsum("bhd,hdc->bhc", q_dec[..., :dn], w_uk)
        q_abs = torch.cat((q_lat, q_dec[..., dn:]), dim=-1).contiguous()
        o_lat, lse_d = _decode(
            q_abs,
            meta,
            lambda qq: paged_mla_attention(
                qq, cache, meta.block_table, meta.decode_seq_idx, meta.decode_kv_len,
                scale=scale, kv_lora_rank=rk,
            ),
        )
        o = torch.einsum("bhc,hdc->bhd", o_lat.to(w_uv.dtype), w_uv)
        out.index_copy_(0, idx, o.to(out.dtype))
        lse.index_copy_(0, idx, lse_d.to(lse.dtype))
    return out, lse


@torch.library.custom_op("cp::mla_attention", mutates_args=())
def _mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, handle): ``handle`` names the step's plan for the backward (:func:`step_handle`)."""
    meta = current_step()
    _check_trainable(meta)
    out, lse = _mla_forward(q, latent, w_uk, w_uv, q.new_empty(0), scale, kv_lora_rank)
    return out, lse, step_handle(meta)


@torch.library.custom_op("cp::mla_attention_with_cache", mutates_args=("cache",))
def _mla_attention_with_cache(
    q: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cache: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _mla_forward(q, latent, w_uk, w_uv, cache, scale, kv_lora_rank)


def _mla_fake(q, latent, w_uk, w_uv, *args):
    shape = (q.shape[0], q.shape[1], w_uv.shape[1])
    return q.new_empty(shape), q.new_empty(q.shape[:2], dtype=_lse_dtype(q))


_mla_attention.register_fake(lambda q, latent, w_uk, w_uv, scale, rk: (*_mla_fake(q, latent, w_uk, w_uv), _handle_fake(q)))
_mla_attention_with_cache.register_fake(_mla_fake)


# MLA's training backward, per step (:func:`mla_backward_path`):
# - "query_major": the block backward of the rank's queries against the re-gathered latent's
#   K / V, whose gradients go back through the up-projection for all N rows and are
#   reduce-scattered as latent gradients (Rk + Dr values a token);
# - "key_major": each rank takes the gradients of its own keys from every later query
#   (:mod:`cp_modules.kernels.pcp_key_major`); it all-gathers Q, O, dO and the LSE,
#   reduce-scatters dQ, and up-projects and back-propagates only its own T rows.
# "auto" takes key-major on CUDA where cuDNN serves the shape and the batch's chunks average
# at least ``policy.key_major_min_rows`` rows; measurements in docs/switch-points.md.
def mla_backward_path(meta: CPStepMetadata, q: torch.Tensor, out: torch.Tensor) -> str:
    """Which MLA backward this step runs: "key_major" or "query_major" (see above; the step's
    ``runtime.policy.mla_backward`` forces one)."""
    policy = meta.runtime.policy
    if policy.mla_backward != "auto":
        return policy.mla_backward
    if not q.is_cuda or meta.runtime.pcp_size == 1 or not _long_chunks(meta.plan, policy.key_major_min_rows):
        return "query_major"
    # The tall calls' backend: one cuDNN call each; other kernels split them in two. (q and out
    # have the same shapes, strides and dtype on every rank, so the answer is the same too.)
    cudnn = select_block_backend(q, q, out, True) == "cudnn"
    return "key_major" if cudnn else "query_major"


def _long_chunks(plan, min_rows: int) -> bool:
    """Whether the batch's chunks average at least ``min_rows`` rows. Counted from the batch
    alone, not from this rank's rows: the two paths run different collectives, so every rank
    of the group must choose alike."""
    return plan.num_tokens >= min_rows * 2 * plan.pcp_size * max(plan.num_reqs, 1)


def _up_project_backward(dk, dv, latent, w_uk, w_uv, rk):
    """Backward of :func:`_up_project` (k_nope = kv_c W_UK^T, v = kv_c W_UV^T, k_pe shared by
    heads) for the rows of ``latent``: (d_latent, dw_uk, dw_uv)."""
    kv_c, dn = latent[:, :rk], w_uk.shape[1]
    dk_nope = dk[..., :dn]
    d_kv_c = torch.einsum("nhd,hdc->nc", dk_nope, w_uk) + torch.einsum("nhd,hdc->nc", dv, w_uv)
    d_latent = torch.cat((d_kv_c, dk[..., dn:].sum(1)), dim=-1)
    dw_uk = torch.einsum("nhd,nc->hdc", dk_nope, kv_c)
    dw_uv = torch.einsum("nhd,nc->hdc", dv, kv_c)
    return d_latent, dw_uk, dw_uv


def _mla_backward_key_major(meta, dout, q, latent, w_uk, w_uv, out, lse, scale, rk):
    """MLA's backward by key chunks (see :func:`mla_backward_path`): (dq, d_latent, dw_uk, dw_uv)."""
    q_all, out_all, dout_all, lse_all = (_gather(x.contiguous(), meta) for x in (q, out, dout, lse))
    k, v = _up_project(latent, w_uk, w_uv, rk, q.shape[1])
    args = (dout_all, q_all, out_all, lse_all, k, v, meta.plan.segments_host, scale)
    min_rows = meta.runtime.policy.direct_grad_min_rows_per_run
    if q_all.shape[0] >= min_rows * meta.plan.gather_runs_host.shape[0]:
        # dQ lands straight in the reduce-scatter's (all-gathered) layout, allocated once the
        # kernels are done.
        rt, held = meta.runtime, []

        def targets():
            held.append(q.new_empty((rt.pcp_size * meta.num_local_tokens, *q.shape[1:])))
            return _gathered_rows_of(meta, held[0])

        _, dk, dv = pcp_key_major_backward(*args, dq_into=targets)
        pad = meta.plan.gather_pad_index
        if pad.numel():
            held[0].index_fill_(0, pad, 0.0)
        dq = reduce_scatter(held[0], rt.pcp_group, rt.pcp_size)
    else:
        dq_all, dk, dv = pcp_key_major_backward(*args)
        dq = _scatter_grad(meta, dq_all)
    # The rank's own keys' gradients are complete: its latent rows' gradient needs no
    # collective; each rank's weight gradients cover its own keys (partial sums).
    d_latent, dw_uk, dw_uv = _up_project_backward(dk, dv, latent, w_uk, w_uv, rk)
    return dq, d_latent.contiguous(), dw_uk, dw_uv


@torch.library.custom_op("cp::mla_attention_backward", mutates_args=())
def _mla_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    handle: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    meta = step_of(handle)
    rk = kv_lora_rank
    if mla_backward_path(meta, q, out) == "key_major":
        return _mla_backward_key_major(meta, dout, q, latent, w_uk, w_uv, out, lse, scale, rk)
    latent_full = _gather(latent, meta)
    k_full, v_full = _up_project(latent_full, w_uk, w_uv, rk, q.shape[1])
    dq, dk_full, dv_full, _, _ = torch.ops.cp.pcp_prefill_attention_backward(
        dout.contiguous(), q, k_full, v_full, out, lse, meta.plan.segments_host, None, None, None, scale,
        *pcp_policy_args(meta.runtime.policy, q.shape[2], v_full.shape[2]),
    )
    d_latent_full, dw_uk, dw_uv = _up_project_backward(dk_full, dv_full, latent_full, w_uk, w_uv, rk)
    # Each rank's weight gradient covers its own queries' share of the keys' gradient; the
    # gathered latent is identical on every PCP rank, so the weight gradients are partial sums.
    d_latent = _scatter_grad(meta, d_latent_full)
    return dq, d_latent.contiguous(), dw_uk, dw_uv


@_mla_attention_backward.register_fake
def _(dout, q, latent, w_uk, w_uv, out, lse, handle, scale, kv_lora_rank):
    return torch.empty_like(q), torch.empty_like(latent), torch.empty_like(w_uk), torch.empty_like(w_uv)


def _mla_setup(ctx, inputs, output):
    q, latent, w_uk, w_uv, scale, rk = inputs
    out, lse, handle = output
    ctx.scale, ctx.rk = scale, rk
    ctx.mark_non_differentiable(lse, handle)
    ctx.save_for_backward(q, latent, w_uk, w_uv, out, lse, handle)


def _mla_backward(ctx, dout, _dlse, _dhandle):
    q, latent, w_uk, w_uv, out, lse, handle = ctx.saved_tensors
    dq, dlat, dwk, dwv = torch.ops.cp.mla_attention_backward(
        dout, q, latent, w_uk, w_uv, out, lse, handle, ctx.scale, ctx.rk
    )
    return dq, dlat, dwk, dwv, None, None


_mla_attention.register_autograd(_mla_backward, setup_context=_mla_setup)


def mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cache: torch.Tensor | None = None,
    *,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Context-parallel MLA attention of this rank's local tokens for the current step.

    Prefill/training tokens gather the latent over PCP (not the up-projected K/V: 576 values a
    token instead of H * 320) and up-project it; decode tokens absorb ``w_uk`` into the query
    and attend the latent cache directly, then apply ``w_uv``.

    Args:
        q: [T, H, Dn + Dr] local queries (rope part rotated).
        latent: [T, Rk + Dr] local compressed KV (normalised) and rotated rope key.
        w_uk: [H, Dn, Rk] and w_uv: [H, Dv, Rk] this rank's heads of the KV up-projection.
        cache: [NB, BS, Rk + Dr] this layer's latent cache, written in place, or None.
        scale: softmax scale.
        kv_lora_rank: Rk.

    Returns:
        [T, H, Dv] attention output of the local tokens.
    """
    if cache is None:
        out, _, _ = torch.ops.cp.mla_attention(q, latent, w_uk, w_uv, scale, kv_lora_rank)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, latent, w_uk, w_uv)):
        raise RuntimeError(_CACHE_NEEDS_NO_GRAD)
    else:
        out, _ = torch.ops.cp.mla_attention_with_cache(q, latent, w_uk, w_uv, cache, scale, kv_lora_rank)
    return out
