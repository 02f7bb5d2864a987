"""``cp::mla_attention``: context-parallel DeepSeek-style MLA attention of one layer.

Shape letters: T = local tokens, N = new tokens of the batch, H = local query heads, Dn = nope
dim, Dr = rope dim, Dv = value head dim, Rk = kv_lora_rank, L = Rk + Dr (latent row).

Prefill and training gather the latent over PCP (not the up-projected K/V) and up-project it;
decode absorbs ``W_UK`` into the query and attends the latent cache directly. The backward
re-gathers the latent and reduce-scatters its gradient, or runs key-major
(:func:`mla_backward_path`). The step's plan: as in :mod:`cp_modules.ops.cp_attention`.
"""

from __future__ import annotations

import torch

from cp_modules.distributed.collectives import reduce_scatter
from cp_modules.kernels.prefill.attention_blocks import select_block_backend
from cp_modules.kernels.prefill.pcp_key_major import pcp_key_major_backward
from cp_modules.ops.cp_common import (
    CACHE_NEEDS_NO_GRAD,
    check_cache,
    check_local,
    check_trainable,
    decode_combined,
    gather_rows,
    gathered_rows_of,
    handle_fake,
    lse_dtype_of,
    read_prefix,
    scatter_grad,
)
from cp_modules.ops.kv_cache import write_mla_cache
from cp_modules.ops.paged_decode import paged_mla_attention
from cp_modules.ops.pcp_attention import pcp_prefill_attention
from cp_modules.ops.pcp_policy import pcp_policy_args
from cp_modules.step import CPStepMetadata, current_step, step_handle, step_of

__all__ = ["mla_attention", "mla_backward_path"]


# ----------------------------------------------------------------------------- MLA


def _up_project(
    latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, rk: int, num_heads: int
):
    """Per-head K [N, H, Dn + Dr] and V [N, H, Dv] from latent rows [N, Rk + Dr]."""
    kv_c, k_pe = latent[:, :rk], latent[:, rk:]
    k_nope = torch.einsum("nc,hdc->nhd", kv_c, w_uk)
    v = torch.einsum("nc,hdc->nhd", kv_c, w_uv)
    k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, num_heads, -1)), dim=-1)
    return k.contiguous(), v.contiguous()


def _mla_forward(q, latent, w_uk, w_uv, cache, scale, kv_lora_rank):
    meta = current_step()
    check_local(meta, q, latent)
    rk, h, dn = kv_lora_rank, q.shape[1], w_uk.shape[1]
    dv = w_uv.shape[1]
    has_cache = cache.numel() > 0
    if has_cache:
        check_cache(meta, latent, cache)
        if cache.shape[-1] != latent.shape[-1]:
            raise ValueError(
                f"MLA cache rows hold {cache.shape[-1]} values but the latent has {latent.shape[-1]}"
            )
    out_shape = (q.shape[0], h, dv)
    latent_full = latent if meta.all_decode else gather_rows(latent, meta)
    # Every local row a decode token, in batch order: the decode result is the output.
    only_decode = meta.all_decode and meta.has_decode
    if has_cache:
        if meta.slot_mapping is None:
            raise RuntimeError("a KV cache was given but the step has no block table")
        write_mla_cache(latent_full[:, :rk], latent_full[:, rk:], cache, meta.slot_mapping)
    if not meta.all_decode:
        k_full, v_full = _up_project(latent_full, w_uk, w_uv, rk, h)
        prefix = {}
        if meta.has_prefix:
            pk, pv = _up_project(read_prefix(cache, meta), w_uk, w_uv, rk, h)
            prefix = dict(prefix_k=pk, prefix_v=pv, prefix_cu_seqlens=meta.prefix_cu_seqlens)
        # Fresh outputs of the prefill op: decode rows are written into them in place.
        out, lse = pcp_prefill_attention(
            q, k_full, v_full, meta.plan, scale=scale, policy=meta.runtime.policy, **prefix
        )
        lse = lse.to(lse_dtype_of(q))
    elif not only_decode:
        out = q.new_zeros(out_shape)
        lse = torch.full(out_shape[:2], float("-inf"), dtype=lse_dtype_of(q), device=q.device)
    if meta.has_decode:
        if not has_cache:
            raise RuntimeError("decode requests need a KV cache")
        idx = meta.local_decode_idx
        q_dec = q if only_decode else q.index_select(0, idx)
        # Absorb W_UK into the query: attend the latent directly (q dim Rk + Dr).
        q_lat = torch.einsum("bhd,hdc->bhc", q_dec[..., :dn], w_uk)
        q_abs = torch.cat((q_lat, q_dec[..., dn:]), dim=-1).contiguous()
        o_lat, lse_d = decode_combined(
            q_abs,
            meta,
            lambda qq: paged_mla_attention(
                qq,
                cache,
                meta.block_table,
                meta.decode_seq_idx,
                meta.decode_kv_len,
                scale=scale,
                kv_lora_rank=rk,
                kernel=meta.runtime.policy.mla_decode,
            ),
        )
        o = torch.einsum("bhc,hdc->bhd", o_lat.to(w_uv.dtype), w_uv)
        if only_decode:
            out, lse = o.to(q.dtype).contiguous(), lse_d.to(lse_dtype_of(q)).contiguous()
        else:
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
    check_trainable(meta)
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
    return q.new_empty(shape), q.new_empty(q.shape[:2], dtype=lse_dtype_of(q))


_mla_attention.register_fake(
    lambda q, latent, w_uk, w_uv, scale, rk: (*_mla_fake(q, latent, w_uk, w_uv), handle_fake(q))
)
_mla_attention_with_cache.register_fake(_mla_fake)


# MLA's training backward, per step (:func:`mla_backward_path`):
# - "query_major": the block backward of the rank's queries against the re-gathered latent's
#   K / V, whose gradients go back through the up-projection for all N rows and are
#   reduce-scattered as latent gradients (Rk + Dr values a token);
# - "key_major": each rank takes the gradients of its own keys from every later query
#   (:mod:`cp_modules.kernels.prefill.pcp_key_major`); it all-gathers Q, O, dO and the LSE,
#   reduce-scatters dQ, and up-projects and back-propagates only its own T rows.
# "auto" takes key-major on CUDA where cuDNN serves the shape and the batch's chunks average
# at least ``policy.key_major_min_rows`` rows; measurements in docs/switch-points.md.
def mla_backward_path(meta: CPStepMetadata, q: torch.Tensor, out: torch.Tensor) -> str:
    """Which MLA backward this step runs: "key_major" or "query_major" (see above; the step's
    ``runtime.policy.mla_backward`` forces one)."""
    policy = meta.runtime.policy
    if policy.mla_backward != "auto":
        return policy.mla_backward
    if (
        not q.is_cuda
        or meta.runtime.pcp_size == 1
        or not _long_chunks(meta.plan, policy.key_major_min_rows)
    ):
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
    q_all, out_all, dout_all, lse_all = (
        gather_rows(x.contiguous(), meta) for x in (q, out, dout, lse)
    )
    k, v = _up_project(latent, w_uk, w_uv, rk, q.shape[1])
    args = (dout_all, q_all, out_all, lse_all, k, v, meta.plan.segments_host, scale)
    min_rows = meta.runtime.policy.direct_grad_min_rows_per_run
    if q_all.shape[0] >= min_rows * meta.plan.gather_runs_host.shape[0]:
        # dQ lands straight in the reduce-scatter's (all-gathered) layout, allocated once the
        # kernels are done.
        rt, held = meta.runtime, []

        def targets():
            held.append(q.new_empty((rt.pcp_size * meta.num_local_tokens, *q.shape[1:])))
            return gathered_rows_of(meta, held[0])

        _, dk, dv = pcp_key_major_backward(*args, dq_into=targets)
        pad = meta.plan.gather_pad_index
        if pad.numel():
            held[0].index_fill_(0, pad, 0.0)
        dq = reduce_scatter(held[0], rt.pcp_group, rt.pcp_size)
    else:
        dq_all, dk, dv = pcp_key_major_backward(*args)
        dq = scatter_grad(meta, dq_all)
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
    latent_full = gather_rows(latent, meta)
    k_full, v_full = _up_project(latent_full, w_uk, w_uv, rk, q.shape[1])
    dq, dk_full, dv_full, _, _ = torch.ops.cp.pcp_prefill_attention_backward(
        dout.contiguous(),
        q,
        k_full,
        v_full,
        out,
        lse,
        meta.plan.segments_host,
        None,
        None,
        None,
        scale,
        *pcp_policy_args(meta.runtime.policy, q.shape[2], v_full.shape[2]),
    )
    d_latent_full, dw_uk, dw_uv = _up_project_backward(
        dk_full, dv_full, latent_full, w_uk, w_uv, rk
    )
    # Each rank's weight gradient covers its own queries' share of the keys' gradient; the
    # gathered latent is identical on every PCP rank, so the weight gradients are partial sums.
    d_latent = scatter_grad(meta, d_latent_full)
    return dq, d_latent.contiguous(), dw_uk, dw_uv


@_mla_attention_backward.register_fake
def _(dout, q, latent, w_uk, w_uv, out, lse, handle, scale, kv_lora_rank):
    return (
        torch.empty_like(q),
        torch.empty_like(latent),
        torch.empty_like(w_uk),
        torch.empty_like(w_uv),
    )


def _mla_setup(ctx, inputs, output):
    q, latent, w_uk, w_uv, scale, rk = inputs
    out, lse, handle = output
    ctx.scale, ctx.rk = scale, rk
    ctx.mark_non_differentiable(lse, handle)
    # No zero gradients are made for the LSE and the handle (they have none).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, latent, w_uk, w_uv, out, lse, handle)


def _mla_backward(ctx, dout, _dlse, _dhandle):
    if dout is None:  # the output took no part in the loss
        return (None,) * 6
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
        raise RuntimeError(CACHE_NEEDS_NO_GRAD)
    else:
        out, _ = torch.ops.cp.mla_attention_with_cache(
            q, latent, w_uk, w_uv, cache, scale, kv_lora_rank
        )
    return out
