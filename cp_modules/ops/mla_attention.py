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
    gather_rows,
    gathered_rows_of,
    handle_fake,
    lse_dtype_of,
    one_rank,
    read_prefix,
    scatter_grad,
)
from cp_modules.ops.exact_window import check_window_args, write_step_window
from cp_modules.ops.exact_window import decode as window_decode
from cp_modules.ops.kv_cache import write_mla_cache
from cp_modules.ops.paged_decode import paged_mla_attention
from cp_modules.ops.pcp_attention import pcp_prefill_attention
from cp_modules.ops.pcp_policy import pcp_policy_args
from cp_modules.reference.paged_decode import paged_mla_attention_ref
from cp_modules.step import CPStepMetadata, current_step, step_handle, step_of

__all__ = ["mla_attention", "mla_backward_path"]


# ----------------------------------------------------------------------------- MLA

# How the per-head keys [N, H, Dn + Dr] are built from their parts (the up-projected k_nope
# and the shared rope key broadcast over the heads): False, one concatenation; True, an empty
# tensor and two copies into its columns (as newer transformers builds DeepSeek's keys). The
# same values either way, gradients too. Read at every call; tools/probes/probe_mla_local_prep.py
# times both at DeepSeek-V3's shape.
KEYS_BY_COPIES = False


def _join_keys(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """K [N, H, Dn + Dr] from k_nope [N, H, Dn] (any strides) and k_pe [N, Dr]."""
    h = k_nope.shape[1]
    if not KEYS_BY_COPIES:
        return torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)), dim=-1)
    dn = k_nope.shape[-1]
    k = k_nope.new_empty(k_nope.shape[0], h, dn + k_pe.shape[-1])
    k[..., :dn].copy_(k_nope)
    k[..., dn:].copy_(k_pe.unsqueeze(1))
    return k


def _up_project(latent: torch.Tensor, w_kv: torch.Tensor, rk: int, dn: int):
    """Per-head K [N, H, Dn + Dr] and V [N, H, Dv] from latent rows [N, Rk + Dr]: one GEMM
    with the whole up-projection ``w_kv`` [H, Dn + Dv, Rk] (kv_b_proj's weight, as HF's
    DeepSeek attention runs it), the shared rope key broadcast over the heads."""
    kv_c, k_pe = latent[:, :rk], latent[:, rk:]
    h = w_kv.shape[0]
    kv = torch.mm(kv_c, w_kv.reshape(-1, rk).t()).view(-1, h, w_kv.shape[1])
    return _join_keys(kv[..., :dn], k_pe), kv[..., dn:].contiguous()


def _nope_dim(q: torch.Tensor, latent: torch.Tensor, rk: int) -> int:
    """Dn: the query's head dim less the rope dim (the latent row's values past Rk)."""
    return q.shape[-1] - (latent.shape[-1] - rk)


def _mla_forward(
    q, latent, w_kv, cache, scale, kv_lora_rank, differentiable=False, cache_scale=None,
    window_buf=None, fp8_sink=0, fp8_recent=0,
):  # fmt: skip
    meta = current_step()
    check_local(meta, q, latent)
    rk, h, dn = kv_lora_rank, q.shape[1], _nope_dim(q, latent, kv_lora_rank)
    dv = w_kv.shape[1] - dn
    has_cache = cache.numel() > 0
    exact = None
    if has_cache:
        check_cache(meta, latent, cache)
        if cache.shape[-1] != latent.shape[-1]:
            raise ValueError(
                f"MLA cache rows hold {cache.shape[-1]} values but the latent has {latent.shape[-1]}"
            )
        tail = (cache.shape[-1],)
        exact = check_window_args(window_buf, fp8_sink, fp8_recent, cache, tail, meta, latent.dtype)
    out_shape = (q.shape[0], h, dv)
    latent_full = latent if meta.all_decode else gather_rows(latent, meta)
    # Every local row a decode token, in batch order: the decode result is the output.
    only_decode = meta.all_decode and meta.has_decode
    if has_cache:
        if meta.slot_mapping is None:
            raise RuntimeError("a KV cache was given but the step has no block table")
        write_mla_cache(
            latent_full[:, :rk], latent_full[:, rk:], cache, meta.slot_mapping, cache_scale
        )
        if exact is not None:
            write_step_window(window_buf, exact, latent_full, meta.slot_mapping, meta)
    if not meta.all_decode:
        k_full, v_full = _up_project(latent_full, w_kv, rk, dn)
        prefix = {}
        if meta.has_prefix:
            rows = read_prefix(cache, meta, cache_scale, latent.dtype)
            pk, pv = _up_project(rows, w_kv, rk, dn)
            prefix = dict(prefix_k=pk, prefix_v=pv, prefix_cu_seqlens=meta.prefix_cu_seqlens)
        # Fresh outputs of the prefill op: decode rows are written into them in place.
        out, lse = pcp_prefill_attention(
            q, k_full, v_full, meta.plan, scale=scale, policy=meta.runtime.policy,
            differentiable=differentiable, **prefix,
        )  # fmt: skip
        lse = lse.to(lse_dtype_of(q))
    elif not only_decode:
        out = q.new_zeros(out_shape)
        lse = torch.full(out_shape[:2], float("-inf"), dtype=lse_dtype_of(q), device=q.device)
    if meta.has_decode:
        if not has_cache:
            raise RuntimeError("decode requests need a KV cache")
        idx = meta.local_decode_idx
        q_dec = q if only_decode else q.index_select(0, idx)
        w_uk, w_uv = w_kv[:, :dn].contiguous(), w_kv[:, dn:].contiguous()
        # Absorb W_UK into the query: attend the latent directly (q dim Rk + Dr).
        q_lat = torch.einsum("bhd,hdc->bhc", q_dec[..., :dn], w_uk)
        q_abs = torch.cat((q_lat, q_dec[..., dn:]), dim=-1).contiguous()

        def attend(qq, kv_len=meta.decode_kv_len, start=None, exact=None):
            if exact is not None:  # CPU, an fp8 cache's window: its rows in place (reference)
                return paged_mla_attention_ref(
                    qq, cache, meta.block_table, meta.decode_seq_idx, kv_len, scale, rk,
                    kv_scale=cache_scale, exact=exact,
                )  # fmt: skip
            return paged_mla_attention(
                qq, cache, meta.block_table, meta.decode_seq_idx, kv_len, scale=scale,
                kv_lora_rank=rk, kernel=meta.runtime.policy.mla_decode, kv_scale=cache_scale,
            )  # fmt: skip

        o_lat, lse_d = window_decode(
            q_abs, meta, attend, exact, window_buf, scale, mla=(cache, rk, cache_scale)
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
    w_kv: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    differentiable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, handle): ``handle`` names the step's plan for the backward (:func:`step_handle`).
    ``differentiable``: autograd will differentiate ``out`` (training: the forward runs on
    cuDNN at once, :func:`~cp_modules.ops.pcp_policy.pcp_policy_args`)."""
    meta = current_step()
    check_trainable(meta)
    out, lse = _mla_forward(q, latent, w_kv, q.new_empty(0), scale, kv_lora_rank, differentiable)
    return out, lse, step_handle(meta)


@torch.library.custom_op("cp::mla_attention_with_cache", mutates_args=("cache", "window_buf"))
def _mla_attention_with_cache(
    q: torch.Tensor,
    latent: torch.Tensor,
    w_kv: torch.Tensor,
    cache: torch.Tensor,
    window_buf: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    cache_scale: torch.Tensor | None = None,
    fp8_sink: int = 0,
    fp8_recent: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``window_buf`` with ``fp8_sink`` / ``fp8_recent``: an fp8 cache's bf16 window
    (:mod:`cp_modules.cache.exact_window`), written in place and read by the decode queries;
    an empty tensor without one (before the defaulted arguments, as in the GQA op)."""
    return _mla_forward(
        q, latent, w_kv, cache, scale, kv_lora_rank, cache_scale=cache_scale,
        window_buf=window_buf, fp8_sink=fp8_sink, fp8_recent=fp8_recent,
    )  # fmt: skip


def _mla_fake(q, latent, w_kv, cache, window_buf, scale, rk, *_):
    shape = (q.shape[0], q.shape[1], w_kv.shape[1] - _nope_dim(q, latent, rk))
    return q.new_empty(shape), q.new_empty(q.shape[:2], dtype=lse_dtype_of(q))


_mla_attention.register_fake(
    lambda q, latent, w_kv, scale, rk, *_: (
        *_mla_fake(q, latent, w_kv, None, None, scale, rk),
        handle_fake(q),
    )
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


def _up_project_backward(dk, dv, latent, w_kv, rk):
    """Backward of :func:`_up_project` (kv = kv_c W_KV^T split into K's nope part and V, k_pe
    shared by heads) for the rows of ``latent``: (d_latent, dw_kv), one GEMM each (as the
    backward of HF's kv_b_proj)."""
    kv_c, h = latent[:, :rk], w_kv.shape[0]
    dn = w_kv.shape[1] - dv.shape[-1]
    dkv = torch.cat((dk[..., :dn], dv), dim=-1).view(dk.shape[0], -1)  # [N, H (Dn + Dv)]
    d_kv_c = torch.mm(dkv, w_kv.reshape(-1, rk))
    d_latent = torch.cat((d_kv_c, dk[..., dn:].sum(1)), dim=-1)
    dw_kv = torch.mm(dkv.t(), kv_c).view(h, -1, rk)
    return d_latent, dw_kv


def _mla_backward_key_major(meta, dout, q, latent, w_kv, out, lse, scale, rk):
    """MLA's backward by key chunks (see :func:`mla_backward_path`): (dq, d_latent, dw_kv)."""
    q_all, out_all, dout_all, lse_all = (
        gather_rows(x.contiguous(), meta) for x in (q, out, dout, lse)
    )
    k, v = _up_project(latent, w_kv, rk, _nope_dim(q, latent, rk))
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
    d_latent, dw_kv = _up_project_backward(dk, dv, latent, w_kv, rk)
    return dq, d_latent.contiguous(), dw_kv


@torch.library.custom_op("cp::mla_attention_backward", mutates_args=())
def _mla_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    latent: torch.Tensor,
    w_kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    handle: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    meta = step_of(handle)
    rk = kv_lora_rank
    if mla_backward_path(meta, q, out) == "key_major":
        return _mla_backward_key_major(meta, dout, q, latent, w_kv, out, lse, scale, rk)
    latent_full = gather_rows(latent, meta)
    # The K / V are up-projected again (one GEMM) rather than saved: a P-fold smaller
    # activation per layer (at pcp = 1 eager layers take _mla_local instead, which saves them).
    k_full, v_full = _up_project(latent_full, w_kv, rk, _nope_dim(q, latent, rk))
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
    d_latent_full, dw_kv = _up_project_backward(dk_full, dv_full, latent_full, w_kv, rk)
    # Each rank's weight gradient covers its own queries' share of the keys' gradient; the
    # gathered latent is identical on every PCP rank, so the weight gradients are partial sums.
    d_latent = scatter_grad(meta, d_latent_full)
    return dq, d_latent.contiguous(), dw_kv


@_mla_attention_backward.register_fake
def _(dout, q, latent, w_kv, out, lse, handle, scale, kv_lora_rank):
    return torch.empty_like(q), torch.empty_like(latent), torch.empty_like(w_kv)


def _mla_setup(ctx, inputs, output):
    q, latent, w_kv, scale, rk, *_ = inputs
    out, lse, handle = output
    ctx.scale, ctx.rk = scale, rk
    ctx.mark_non_differentiable(lse, handle)
    # No zero gradients are made for the LSE and the handle (they have none).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, latent, w_kv, out, lse, handle)


def _mla_backward(ctx, dout, _dlse, _dhandle):
    if dout is None:  # the output took no part in the loss
        return (None,) * 6
    q, latent, w_kv, out, lse, handle = ctx.saved_tensors
    dq, dlat, dw = torch.ops.cp.mla_attention_backward(
        dout, q, latent, w_kv, out, lse, handle, ctx.scale, ctx.rk
    )
    return dq, dlat, dw, None, None, None


_mla_attention.register_autograd(_mla_backward, setup_context=_mla_setup)


def _mla_local(
    q: torch.Tensor,
    latent: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    w_kv: torch.Tensor,
    scale: float,
    rk: int,
) -> torch.Tensor:
    """Cache-less MLA of an eager step at pcp = 1 (nothing to gather): the up-projection as
    HF's DeepSeek attention runs it (one GEMM, its K / V saved by autograd, so the backward
    runs one GEMM for the latent's gradient and one for the weight's and never up-projects
    again), then the attention of the up-projected heads (:func:`gqa_attention` with
    Hkv = H)."""
    from cp_modules.ops.gqa_attention import gqa_attention

    if isinstance(latent, tuple):
        kv_c, k_pe = latent
    else:
        kv_c, k_pe = latent.split([rk, latent.shape[-1] - rk], dim=-1)
    h, dn = w_kv.shape[0], q.shape[-1] - k_pe.shape[-1]
    kv = torch.nn.functional.linear(kv_c, w_kv.reshape(-1, rk)).view(-1, h, w_kv.shape[1])
    k_nope, v = kv.split([dn, w_kv.shape[1] - dn], dim=-1)
    return gqa_attention(q, _join_keys(k_nope, k_pe), v, scale=scale)


def _takes_local_path(meta: CPStepMetadata | None) -> bool:
    # Eager only: traced code keeps to the op (one schema for every PCP size, no guard on the
    # step), and a policy that forces the key-major backward keeps it too.
    return (
        meta is not None
        and one_rank(meta)
        and meta.runtime.policy.mla_backward != "key_major"
        and not meta.has_prefix
        and not meta.has_decode
    )


def mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    w_uk: torch.Tensor,
    w_uv: torch.Tensor | None = None,
    cache: torch.Tensor | None = None,
    *,
    scale: float,
    kv_lora_rank: int,
    cache_scale: torch.Tensor | None = None,
    fp8_window: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """Context-parallel MLA attention of this rank's local tokens for the current step.

    Prefill/training tokens gather the latent over PCP (not the up-projected K/V: 576 values a
    token instead of H * 320) and up-project it with one GEMM; decode tokens absorb ``W_UK``
    into the query and attend the latent cache directly, then apply ``W_UV``. An eager
    cache-less step at pcp = 1 (nothing to gather) runs the up-projection outside the op, as
    HF's DeepSeek attention does, so that autograd keeps its K / V and the backward does not
    up-project again (:func:`_mla_local`); a policy forcing the key-major backward keeps the
    op.

    Args:
        q: [T, H, Dn + Dr] local queries (rope part rotated).
        latent: [T, Rk + Dr] local compressed KV (normalised) and rotated rope key, or
            the pair of them (kv_c [T, Rk], k_pe [T, Dr]): joined only where the op needs
            the latent rows (the local path up-projects kv_c as it is).
        w_uk: [H, Dn, Rk] and w_uv: [H, Dv, Rk] this rank's heads of the KV up-projection;
            or, with ``w_uv`` None, the whole up-projection ``w_kv`` [H, Dn + Dv, Rk]
            (kv_b_proj's weight viewed per head: nothing is copied).
        cache: [NB, BS, Rk + Dr] this layer's latent cache, written in place, or None.
        scale: softmax scale.
        kv_lora_rank: Rk.
        cache_scale: an fp8 (e4m3) ``cache``: its fp32 [1] scale (None: 1.0); rows are stored
            as ``latent / scale`` and read back as ``fp8 * scale``.
        fp8_window: an fp8 ``cache``'s bf16 window ``(buffer, sink, recent)``
            (:mod:`cp_modules.cache.exact_window`): decode queries read the first ``sink`` and
            their ``recent`` newest tokens unquantized; None: none.

    Returns:
        [T, H, Dv] attention output of the local tokens.
    """
    w_kv = w_uk if w_uv is None else torch.cat((w_uk, w_uv), dim=1)
    if w_kv.dim() != 3 or w_kv.shape[0] != q.shape[1] or w_kv.shape[2] != kv_lora_rank:
        raise ValueError(
            f"the up-projection must be [{q.shape[1]} heads, Dn + Dv, {kv_lora_rank}], got "
            f"{tuple(w_kv.shape)}"
        )
    w_kv = w_kv.contiguous()
    local = cache is None and not torch.compiler.is_compiling()
    if local and _takes_local_path(_active_step()):
        return _mla_local(q, latent, w_kv, scale, kv_lora_rank)
    if isinstance(latent, tuple):
        latent = torch.cat(latent, dim=-1)
    if cache is None:
        differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, latent, w_kv))
        out, _, _ = torch.ops.cp.mla_attention(q, latent, w_kv, scale, kv_lora_rank, differentiable)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, latent, w_kv)):
        raise RuntimeError(CACHE_NEEDS_NO_GRAD)
    else:
        buf, sink, recent = fp8_window if fp8_window is not None else (q.new_empty(0), 0, 0)
        out, _ = torch.ops.cp.mla_attention_with_cache(
            q, latent, w_kv, cache, buf, scale, kv_lora_rank, cache_scale, sink, recent
        )
    return out


def _active_step() -> CPStepMetadata | None:
    """The current step, or None outside of one (the op then raises its own error)."""
    try:
        return current_step()
    except RuntimeError:
        return None
