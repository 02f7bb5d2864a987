"""The paged KV caches of a model's cp attention layers: allocation (bf16 or fp8, with an fp8
cache's bf16 window), their bytes, and the tensors to mark for ``torch.compile``.

Interface-served layers keep their caches in the model's shared
:class:`~cp_modules.modules.hf_attention.CPKVCaches` by ``layer_idx``; MLA adapters
(:class:`~cp_modules.modules.attention.CPMLAAttention`) hold theirs as attributes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cp_modules.cache.exact_window import (
    allocate_window_buffer,
    check_window_option,
)
from cp_modules.cache.kv_dtype import is_fp8, kv_cache_storage_dtype, kv_scale
from cp_modules.cache.paged import allocate_kv_cache, allocate_mla_cache, kv_cache_bytes_per_block
from cp_modules.modules.attention import CPMLAAttention

__all__ = [
    "allocate_kv_caches",
    "cp_attention_layers",
    "free_kv_caches",
    "kv_cache_bytes_per_block_of",
    "kv_cache_scale_tensors",
    "kv_cache_tensors",
    "kv_window_bytes",
    "kv_window_tensors",
    "mark_kv_caches_static",
]


def cp_attention_layers(model: nn.Module) -> list[Any]:
    """The attention modules of ``model`` that cp serves, in module order: the model's own
    modules bound to the ``cp`` interface (``module.cp_binding``) and MLA adapters."""
    return [
        m
        for m in model.modules()
        if getattr(m, "cp_binding", None) is not None or isinstance(m, CPMLAAttention)
    ]


def allocate_kv_caches(
    model: nn.Module,
    num_blocks: int,
    block_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    window_num_blocks: dict[int, int] | None = None,
    kv_cache_dtype: str = "bf16",
    fp8_sink_tokens: int = 0,
    fp8_recent_tokens: int = 0,
    max_num_seqs: int | None = None,
    max_query_len: int = 1,
) -> int:
    """Give every cp layer of ``model`` a paged KV cache of ``num_blocks`` blocks on this rank;
    return the bytes one block takes over all layers.

    ``kv_cache_dtype``: ``"bf16"`` stores ``dtype`` (the model's); ``"fp8_e4m3"`` stores
    ``torch.float8_e4m3fn`` with static scales: the attention module's ``k_scale`` /
    ``v_scale`` where it has them (quantized checkpoints ship them; a scalar or one value per
    local KV head; MLA layers use ``k_scale`` for the latent), else 1.0.

    Interface-served layers get ``(k_cache, v_cache)`` ``[NB, BS, Hkv_local, D]`` in
    ``model.cp_kv_caches`` by ``layer_idx`` (an fp8 ``v_cache`` token-minor:
    :func:`~cp_modules.cache.paged.allocate_kv_cache`); MLA layers a latent cache
    ``[NB, BS, Rk + Dr]``.
    ``window_num_blocks`` (window W -> blocks) sizes the caches of the layers of window W
    instead (a layer group whose cache keeps only its window).

    ``fp8_sink_tokens`` / ``fp8_recent_tokens`` (an fp8 cache): each decode query reads its
    request's first ``fp8_sink_tokens`` and its own ``fp8_recent_tokens`` newest tokens
    unquantized, from a window buffer in ``dtype`` per layer with one row per request
    (``max_num_seqs`` rows, the step's ``cache_rows``), sized for decode runs of up to
    ``max_query_len`` tokens (:mod:`cp_modules.cache.exact_window`). The window's bytes are
    not part of the returned per-block bytes (they do not grow with the blocks).

    Raises:
        ValueError: for a model :func:`swap_attention` has not prepared, an unknown
            ``kv_cache_dtype``, fp8 on a GPU without fp8 conversions, a module scale that is
            not a positive finite scalar or per-head vector, or a bf16 window without an fp8
            cache or without ``max_num_seqs``.
    """
    layers = cp_attention_layers(model)
    if not layers:
        raise ValueError(
            "model has no context-parallel attention: call swap_attention(model, ...) first"
        )
    store = kv_cache_storage_dtype(kv_cache_dtype, dtype, device)
    fp8 = is_fp8(store)
    exact = check_window_option(
        kv_cache_dtype, fp8_sink_tokens, fp8_recent_tokens, max_query_len=max_query_len
    )
    if exact is not None and (
        isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1
    ):
        raise ValueError(
            f"a bf16 window needs max_num_seqs (its request rows, >= 1), got {max_num_seqs!r}"
        )
    scales = [_module_scales(layer, fp8, device) for layer in layers]  # checked before allocating
    free_kv_caches(model)  # the old caches go before the new ones are allocated

    def window_of(tail: tuple[int, ...]):
        if exact is None:
            return None
        assert max_num_seqs is not None
        buf = allocate_window_buffer(max_num_seqs, exact, tail, dtype=dtype, device=device)
        return buf, exact.sink, exact.recent

    for layer, sc in zip(layers, scales):
        b = getattr(layer, "cp_binding", None)
        if b is not None:
            n = (window_num_blocks or {}).get(b.sliding_window, num_blocks)
            b.caches.caches[b.layer_idx] = allocate_kv_cache(
                n, block_size, b.num_kv_heads, b.head_dim, dtype=store, device=device
            )
            if sc is not None:
                b.caches.scales[b.layer_idx] = sc
            win = window_of((2, b.num_kv_heads, b.head_dim))
            if win is not None:
                b.caches.windows[b.layer_idx] = win
        else:
            layer.kv_cache = allocate_mla_cache(
                num_blocks,
                block_size,
                layer.kv_lora_rank,
                layer.qk_rope_head_dim,
                dtype=store,
                device=device,
            )
            layer.kv_cache_scale = None if sc is None else sc[0]
            layer.fp8_window = window_of((layer.kv_lora_rank + layer.qk_rope_head_dim,))
    return kv_cache_bytes_per_block_of(model, block_size, store)


def kv_cache_bytes_per_block_of(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV-cache block of ``block_size`` tokens in ``dtype`` takes over all the cp
    layers of ``model`` on this rank (the unit the engine sizes its pool in)."""
    per_block = 0
    for layer in cp_attention_layers(model):
        b = getattr(layer, "cp_binding", None)
        if b is not None:
            per_block += kv_cache_bytes_per_block(
                block_size, dtype=dtype, num_kv_heads=b.num_kv_heads, head_dim=b.head_dim
            )
        else:
            per_block += kv_cache_bytes_per_block(
                block_size,
                dtype=dtype,
                kv_lora_rank=layer.kv_lora_rank,
                rope_dim=layer.qk_rope_head_dim,
            )
    return per_block


def _module_scales(layer, fp8: bool, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An fp8 cache's checked (k_scale, v_scale) of one layer (the module's, else 1.0)."""
    if not fp8:
        return None
    b = getattr(layer, "cp_binding", None)
    heads = b.num_kv_heads if b is not None else 1
    name = getattr(b, "layer_name", type(layer).__name__)
    ks = kv_scale(getattr(layer, "k_scale", None), heads, name=f"{name}.k_scale", device=device)
    if b is None:
        return ks, ks  # one latent cache: one scale
    vs = kv_scale(getattr(layer, "v_scale", None), heads, name=f"{name}.v_scale", device=device)
    return ks, vs


def free_kv_caches(model: nn.Module) -> None:
    """Drop every cp layer's KV cache (the layers then run cache-less, e.g. for training)."""
    for layer in cp_attention_layers(model):
        b = getattr(layer, "cp_binding", None)
        if b is not None:
            b.caches.caches.pop(b.layer_idx, None)
            b.caches.scales.pop(b.layer_idx, None)
            b.caches.windows.pop(b.layer_idx, None)
        else:
            layer.kv_cache = None
            layer.kv_cache_scale = None
            layer.fp8_window = None


def kv_cache_scale_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every fp8 KV-cache scale tensor of ``model``'s cp layers (to mark for torch.compile)."""
    out: list[torch.Tensor] = []
    for layer in cp_attention_layers(model):
        b = getattr(layer, "cp_binding", None)
        scales = b.caches.scales.get(b.layer_idx) if b is not None else layer.kv_cache_scale
        if scales is not None:
            out.extend(scales if isinstance(scales, tuple) else (scales,))
    return out


def kv_cache_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every KV-cache tensor of ``model``'s cp layers (e.g. to mark them for torch.compile)."""
    out: list[torch.Tensor] = []
    for layer in cp_attention_layers(model):
        b = getattr(layer, "cp_binding", None)
        cache = b.caches.get(b.layer_idx) if b is not None else layer.kv_cache
        if cache is not None:
            out.extend(cache if isinstance(cache, tuple) else (cache,))
    return out


def kv_window_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every fp8 cache's bf16 window buffer of ``model``'s cp layers
    (:mod:`cp_modules.cache.exact_window`)."""
    out: list[torch.Tensor] = []
    for layer in cp_attention_layers(model):
        b = getattr(layer, "cp_binding", None)
        win = b.caches.windows.get(b.layer_idx) if b is not None else layer.fp8_window
        if win is not None:
            out.append(win[0])
    return out


def kv_window_bytes(model: nn.Module) -> int:
    """Bytes of the fp8 caches' bf16 window buffers of ``model`` on this rank."""
    return sum(t.numel() * t.element_size() for t in kv_window_tensors(model))


def mark_kv_caches_static(model: nn.Module) -> None:
    """Mark ``model``'s caches for ``torch.compile``: block size and head sizes never change
    (static); the block count grows with the batch (unbacked, so a larger cache reuses the
    graphs and duck sizing never ties it to a token count that happens to be equal)."""
    for c in kv_cache_tensors(model):
        # A token-minor cache is a view: its storage is an input of the graphs too.
        for t in (c,) if c._base is None else (c, c._base):
            torch._dynamo.mark_static(t)
            torch._dynamo.decorators.mark_unbacked(t, 0)
    for s in (*kv_cache_scale_tensors(model), *kv_window_tensors(model)):
        torch._dynamo.mark_static(s)  # (else duck sizing ties a head count to a token count)
