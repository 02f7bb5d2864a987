"""What the context-parallel attention ops share: PCP gathers and their gradients, the cached
prefix read, the DCP decode combine, and the checks every rank makes before a collective.

Shape letters: T = local tokens, N = new tokens of the batch, H = local query heads, Hkv =
local KV heads, D = head dim.
"""

from __future__ import annotations

import torch

from cp_modules.cache.kv_dtype import dequantize_fp8, is_fp8
from cp_modules.distributed.collectives import all_gather, reduce_scatter
from cp_modules.ops.dcp_comm import dcp_combine, dcp_prepare_query
from cp_modules.partition.window_exchange import (
    WindowExchangePlan,
    exchange_rows,
    exchange_rows_backward,
)
from cp_modules.step import CPStepMetadata, step_of

__all__ = [
    "CACHE_NEEDS_NO_GRAD",
    "check_cache",
    "check_local",
    "check_trainable",
    "decode_combined",
    "eager_step_of",
    "exchange_kv",
    "exchange_kv_backward",
    "gather_kv",
    "gather_rows",
    "gathered_rows_of",
    "handle_fake",
    "lse_dtype_of",
    "one_rank",
    "read_prefix",
    "scatter_grad",
]


CACHE_NEEDS_NO_GRAD = (
    "attention with a KV cache is inference-only (the cache write is not differentiable): run "
    "it under torch.no_grad() or torch.inference_mode(), or train without a cache"
)


def lse_dtype_of(q: torch.Tensor) -> torch.dtype:
    # fp32 LSEs, fp64 for fp64 inputs (the backward recomputes probabilities from them).
    return torch.promote_types(q.dtype, torch.float32)


def one_rank(meta: CPStepMetadata) -> bool:
    """Whether the step's PCP group is this rank alone: then the local tokens are the batch's
    new tokens in order without padding (the plan's restore is the identity), so nothing is
    gathered, reordered or reduce-scattered."""
    return meta.plan.pcp_size == 1


def eager_step_of(handle: torch.Tensor) -> CPStepMetadata | None:
    """The plan a saved handle names (:func:`~cp_modules.step.step_of`) when the backward runs
    eagerly on real tensors; None while it is traced (torch.compile, make_fx), where the
    backward keeps to the ops' fixed schemas."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if torch.compiler.is_compiling() or get_proxy_mode() is not None:
        return None
    if isinstance(handle, FakeTensor) or handle.device.type != "cpu":
        return None
    return step_of(handle)


def gather_rows(x: torch.Tensor, meta: CPStepMetadata) -> torch.Tensor:
    """All-gather local rows over PCP and restore the batch order ([T, ...] -> [N, ...]).

    At pcp = 1 the local rows are the batch's rows in order (:func:`one_rank`): ``x`` itself
    (contiguous), no copy.
    """
    rt = meta.runtime
    if one_rank(meta):
        return x.contiguous()
    gathered = all_gather(x, rt.pcp_group, rt.pcp_size)
    return gathered.index_select(0, meta.plan.gather_index)


def gather_kv(k: torch.Tensor, v: torch.Tensor, meta: CPStepMetadata):
    """:func:`gather_rows` of K and V [T, Hkv, D] in one collective; each result is contiguous.

    The local rows travel as one [T, 2, Hkv, D] block; the restore indexes the gathered rows
    of K and of V at once into a fresh [2, N, Hkv, D] tensor, so no further copy is needed.
    At pcp = 1 (:func:`one_rank`) K and V are returned as they are (contiguous): no stack, no
    gather, no restore.
    """
    rt = meta.runtime
    if one_rank(meta):
        return k.contiguous(), v.contiguous()
    local = torch.stack((k, v), dim=1)
    gathered = all_gather(local, rt.pcp_group, rt.pcp_size)
    kv = gathered.transpose(0, 1).index_select(1, meta.plan.gather_index)
    return kv[0], kv[1]


def exchange_kv(k: torch.Tensor, v: torch.Tensor, meta: CPStepMetadata, plan: WindowExchangePlan):
    """The K/V rows [K, Hkv, D] a windowed layer's queries on this rank see (``plan``), from
    the PCP ranks holding them, in one uneven all-to-all; each result is contiguous."""
    kv = exchange_rows(torch.stack((k, v), dim=1), plan, meta.runtime.pcp_group)
    kv = kv.transpose(0, 1).contiguous()
    return kv[0], kv[1]


def exchange_kv_backward(
    dk: torch.Tensor, dv: torch.Tensor, meta: CPStepMetadata, plan: WindowExchangePlan
) -> torch.Tensor:
    """Backward of :func:`exchange_kv`: [2, T, Hkv, D], dK then dV of this rank's local rows,
    summed over every rank that received them (padding rows 0)."""
    d = exchange_rows_backward(
        torch.stack((dk, dv), dim=1), plan, meta.runtime.pcp_group, meta.num_local_tokens
    )
    return d.transpose(0, 1).contiguous()


def scatter_grad(meta: CPStepMetadata, dx_full: torch.Tensor) -> torch.Tensor:
    """Backward of :func:`gather_rows`: put the rows back in all-gathered order and reduce-scatter
    them; returns [T, ...].

    Each restored row lands on its own gathered row (the restore is injective), so the rows are
    copied, not accumulated, and only the padding rows (none when N = P * T) are zeroed.
    At pcp = 1 (:func:`one_rank`) the rows are already this rank's: ``dx_full`` itself.
    """
    rt = meta.runtime
    if one_rank(meta):
        return dx_full
    buf = dx_full.new_empty((rt.pcp_size * meta.num_local_tokens, *dx_full.shape[1:]))
    buf.index_copy_(0, meta.plan.gather_index, dx_full)
    pad = meta.plan.gather_pad_index
    if pad.numel():
        buf.index_fill_(0, pad, 0.0)
    return reduce_scatter(buf, rt.pcp_group, rt.pcp_size)


def gathered_rows_of(meta: CPStepMetadata, buf: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Targets (:func:`sum_pieces_into`) that put restored rows [N, ...] at their all-gathered
    places in ``buf`` [P * T, ...] (the inverse of :func:`gather_rows`'s restore; padding places
    are left to the caller)."""
    runs = meta.plan.gather_runs_host.tolist()  # ok: host (CPU tensor)
    return [(first, buf[g : g + n]) for first, g, n in runs]


def read_prefix(
    cache: torch.Tensor,
    meta: CPStepMetadata,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Cached prefix rows of prefill requests, gathered from the DCP shards: [C, ...].

    An fp8 cache's rows travel as fp8 bytes and are dequantized (``* scale``, [heads] or [1])
    to ``dtype`` after the gather; other caches come back as they are."""
    assert meta.prefix_read_slots is not None and meta.prefix_gather_index is not None
    slots = meta.prefix_read_slots
    if cache.stride(0) == cache.shape[1] * cache.stride(1):
        local = cache.flatten(0, 1).index_select(0, slots)  # (a view: blocks of whole rows)
    else:
        # A token-minor cache (cache.paged.allocate_kv_cache): flattening would copy it all.
        bs = cache.shape[1]
        local = cache[torch.div(slots, bs, rounding_mode="floor"), slots % bs]
    fp8 = is_fp8(cache.dtype)
    dcp = meta.runtime.dcp
    if dcp is not None:
        # fp8 as bytes: every backend gathers uint8, not every one float8.
        local = all_gather(local.view(torch.uint8) if fp8 else local, dcp.dcp_group, dcp.dcp_size)
        local = local.view(cache.dtype) if fp8 else local
    rows = local.index_select(0, meta.prefix_gather_index)
    if fp8:
        rows = dequantize_fp8(rows, scale, dtype or torch.bfloat16)
    return rows


def decode_combined(q_dec, meta: CPStepMetadata, attend):
    """Paged attention of decode queries on this DCP shard, combined over the DCP group."""
    spec = meta.runtime.dcp
    if spec is None:
        return attend(q_dec)
    out, lse = attend(dcp_prepare_query(q_dec, spec))
    return dcp_combine(out, lse, spec, return_lse=True)


def check_cache(meta: CPStepMetadata, kv: torch.Tensor, *caches: torch.Tensor) -> None:
    """Host-side checks (no device sync) that every rank makes identically before any collective."""
    for c in caches:
        if c.dtype != kv.dtype and not is_fp8(c.dtype):
            raise ValueError(
                f"KV cache dtype {c.dtype} differs from the layer's K/V dtype {kv.dtype} "
                "(and is not fp8: kv_cache_dtype='fp8_e4m3')"
            )
        if c.device != kv.device:
            raise ValueError(f"KV cache is on {c.device} but the layer runs on {kv.device}")
        if meta.block_table is not None and meta.max_block_id >= c.shape[0]:
            raise ValueError(
                f"the step uses block id {meta.max_block_id} but the KV cache has only "
                f"{c.shape[0]} blocks: allocate more blocks or schedule fewer tokens"
            )


def check_trainable(meta: CPStepMetadata) -> None:
    """A cache-less forward attends new tokens only: refuse steps with cached prefixes or
    decode requests (they need the KV cache) before any collective."""
    if meta.has_prefix or meta.has_decode:
        raise ValueError(
            "attention without a KV cache covers new tokens only: this step has cached "
            "prefixes or decode requests; pass the layer's KV cache (inference) or train on "
            "batches of new tokens"
        )


def handle_fake(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device="cpu")


def check_local(meta: CPStepMetadata, q: torch.Tensor, *kv: torch.Tensor) -> None:
    t = meta.num_local_tokens
    for name, x in zip(("q", "k/latent", "v"), (q, *kv)):
        if x.shape[0] != t:
            raise ValueError(
                f"{name} has {x.shape[0]} tokens but this rank's step has {t} local tokens "
                "(feed the model meta.token_indices of the batch)"
            )
