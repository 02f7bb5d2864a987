"""transformers' attention interface served by context-parallel attention: the ``"cp"`` backend.

:func:`cp_attention_forward` is registered with ``AttentionInterface.register("cp", ...)`` and
:func:`cp_attention_mask` with ``AttentionMaskInterface.register("cp", ...)``. A model whose
``config._attn_implementation`` is ``"cp"`` keeps its own projections, q/k norms, rope variant
(partial, interleaved, scaled) and scaling; what reaches the function is this rank's local
queries, keys and values after all of them, and the function runs the whole attention of the
step set by :func:`~cp_modules.step.cp_step` (PCP gather, head/tail attention, the paged KV
cache of the layer, DCP decode and combine, or the trainable cache-less path) through
:func:`cp_modules.ops.cp_attention.gqa_attention`.

Shapes (transformers' convention): query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` with
``T`` this rank's local tokens (``meta.token_indices``, one row); returns ``[1, T, H, D]``.

Whatever changes attention and is not implemented here is refused with a ``ValueError`` that
names the model class, the layer and the feature, never dropped: keyword arguments are checked
against :data:`_FEATURES` (each entry says when it is active) and :data:`_INERT_KWARGS`
(arguments known not to change attention); anything else is refused as unknown. The masks
HF asks for are classified by :func:`cp_attention_mask`: plain causal attention over the step's
requests is served (the causal structure comes from the step metadata, so no mask is built);
windows, chunks, bidirectional or custom masks and padding masks come back as a
:class:`RefusedMask` that the attention function turns into the error for its layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cp_modules.distributed.collectives import copy_to_group
from cp_modules.ops.cp_attention import gqa_attention

__all__ = [
    "CP_ATTN_IMPLEMENTATION",
    "CPKVCaches",
    "CPLayerBinding",
    "RefusedMask",
    "cp_attention_forward",
    "cp_attention_mask",
    "layer_window",
    "register_cp_attention",
]

CP_ATTN_IMPLEMENTATION = "cp"


@dataclass
class CPKVCaches:
    """The paged KV caches of a model's interface-served layers, by ``layer_idx``.

    ``caches[layer_idx] = (k_cache, v_cache)`` ``[NB, BS, Hkv_local, D]``; a layer without an
    entry (or with None) runs cache-less (training, or a forward without a KV cache).
    """

    caches: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)
    # fp8 caches: (k_scale, v_scale) fp32 [Hkv_local] or [1] by layer_idx.
    scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # fp8 caches with a bf16 window: (buffer, sink, recent) by layer_idx
    # (cp_modules.cache.exact_window).
    windows: dict[int, tuple[torch.Tensor, int, int]] = field(default_factory=dict)

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.caches.get(layer_idx)


@dataclass
class CPLayerBinding:
    """What :func:`cp_attention_forward` needs to know about one attention module.

    Set as ``module.cp_binding`` by :func:`~cp_modules.modules.hf_swap.swap_attention`.

    Attributes:
        model_name: the model's class name (for error messages).
        layer_name: the module's qualified name in the model.
        layer_idx: the module's ``layer_idx`` (its KV-cache slot in ``caches``).
        caches: the model's :class:`CPKVCaches` (shared by every layer).
        num_kv_heads: KV heads of this rank (the cache's head count).
        head_dim: per-head dim of keys; v_head_dim: of values.
        kv_replica_index: with fewer KV heads than TP ranks, the KV head this TP position's
            query heads use (keys/values arrive with every KV head); else None.
        tp_group: (name, size) of the TP group (replicated-KV gradients are summed over it).
        heads_replicated: every TP rank holds all heads (the model's TP plan gathers q/k/v).
        sinks_slice: (TP rank, TP size) when the module's sinks hold every head and this rank
            attends with its heads' slice; else None.
        sliding_window: the layer's window (None: full attention), which groups its KV cache:
            a windowed layer group's cache may keep only the window (see
            :mod:`cp_modules.engine.block_groups`), so a call with a KV cache and another window
            is refused.
    """

    model_name: str
    layer_name: str
    layer_idx: int
    caches: CPKVCaches
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_replica_index: int | None = None
    tp_group: tuple[str, int] = ("", 1)
    heads_replicated: bool = False
    sinks_slice: tuple[int, int] | None = None
    sliding_window: int | None = None

    def where(self) -> str:
        return f"{self.model_name} layer {self.layer_name!r} (layer_idx={self.layer_idx})"


class _WholeMask:
    """Indexing a cp mask marker: whole rows and columns only (Gemma 4 slices its masks with
    ``[:, :, slice(-logits_to_keep, None), :]``, the whole mask for ``logits_to_keep=0``)."""

    def __getitem__(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        whole = all(
            p is Ellipsis
            or (
                isinstance(p, slice)
                and p.start in (None, 0)
                and p.stop is None
                and p.step in (None, 1)
            )
            for p in parts
        )
        if not whole:
            raise ValueError(
                f"the model indexes its attention mask with {index!r}, keeping only some query "
                "rows or keys: cp attends every local token of the step (call the model "
                "without logits_to_keep)"
            )
        return self


@dataclass(frozen=True)
class RefusedMask(_WholeMask):
    """The mask HF asked the ``cp`` mask function for, when cp does not implement it."""

    feature: str


@dataclass(frozen=True)
class WindowMask(_WholeMask):
    """A sliding-window causal mask of ``size`` keys (served: passed on as the window)."""

    size: int


def _active(value) -> bool:
    return (
        value is not None
        and value is not False
        and not (isinstance(value, (int, float)) and value == 0)
    )


# Keyword arguments that change attention and that cp serves (taken by cp_attention_forward):
# the sliding window, the logit soft-cap and the attention sinks.
_SERVED_KWARGS = frozenset({"sliding_window", "softcap", "s_aux"})

# Keyword arguments that change attention, with when they are active: an active one is refused.
_FEATURES: dict[str, tuple[Callable[[object], bool], str]] = {
    "sinks": (lambda v: v is not None, "attention sinks passed as 'sinks' (cp takes s_aux)"),
    "is_causal": (lambda v: v is not None and not v, "non-causal attention (is_causal={value})"),
    "attention_chunk_size": (_active, "chunked attention (attention_chunk_size={value})"),
    "cu_seq_lens_q": (lambda v: v is not None, "packed varlen sequences (cu_seq_lens_q)"),
    "cu_seq_lens_k": (lambda v: v is not None, "packed varlen sequences (cu_seq_lens_k)"),
    "output_attentions": (_active, "returning attention weights (output_attentions=True)"),
}

# Keyword arguments that carry non-text inputs into a multimodal model (InternVL passes
# image_sizes=None down to its layers): absent ones are inert; present ones are refused at the
# model's forward (swap_attention's hook), since cp serves text-only inputs.
MEDIA_KWARGS = ("pixel_values", "image_", "video", "audio", "input_features", "mm_encoder_outputs")

# Keyword arguments the models pass that do not change attention.
_INERT_KWARGS = frozenset(
    {
        "position_ids",  # rope is applied before the call; cp takes positions from the step
        "use_cache",
        "cache_position",
        "output_router_logits",
        "max_length_q",
        "max_length_k",
        "labels",  # Gemma 4's multimodal model passes its loss targets down to every layer
    }
)


def _module_features(module) -> list[str]:
    """Module properties that change attention and that cp does not implement."""
    found = []
    if getattr(module, "is_causal", True) is False:
        found.append("non-causal attention (module.is_causal=False)")
    return found


def refusal(binding: CPLayerBinding | None, module, feature: str) -> ValueError:
    where = binding.where() if binding is not None else f"{type(module).__name__}"
    return ValueError(
        f"{where}: {feature} is not implemented by context-parallel attention, so cp cannot "
        "serve this layer exactly; use a model (or config) without it"
    )


def check_call(binding: CPLayerBinding, module, attention_mask, dropout, kwargs) -> None:
    """Raise for anything in this call that changes attention and that cp does not implement."""
    for feature in _module_features(module):
        raise refusal(binding, module, feature)
    if _active(dropout) and module.training:
        raise refusal(binding, module, f"attention dropout in training (dropout={dropout})")
    for name, value in kwargs.items():
        if name in _SERVED_KWARGS or (value is None and name.startswith(MEDIA_KWARGS)):
            continue
        if name in _FEATURES:
            is_active, text = _FEATURES[name]
            if is_active(value):
                raise refusal(binding, module, text.format(value=value))
        elif name not in _INERT_KWARGS:
            raise refusal(
                binding,
                module,
                f"the keyword argument {name!r} (its effect on attention is unknown)",
            )
    if isinstance(attention_mask, RefusedMask):
        raise refusal(binding, module, attention_mask.feature)
    if attention_mask is not None and not isinstance(attention_mask, WindowMask):
        raise refusal(
            binding,
            module,
            f"an explicit attention mask ({type(attention_mask).__name__}; cp attends causally "
            "within each request of the step: call the model without attention_mask)",
        )


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call, served by :func:`gqa_attention` for the current step.

    Args:
        module: the model's attention module (``module.cp_binding`` set by swap_attention).
        query: [1, H, T, D]; key, value: [1, Hkv, T, D] (after the model's norms and rope).
        attention_mask: what :func:`cp_attention_mask` returned (None when served).
        scaling: softmax scale (default ``module.scaling``, else ``D ** -0.5``).
        dropout: attention dropout (refused when active in training).

    Returns:
        (out [1, T, H, Dv], None).

    Raises:
        ValueError: for a module swap_attention did not prepare, a batch of more than one row,
            keys from HF's own cache, or any feature cp does not implement (see the module doc).
    """
    binding: CPLayerBinding | None = getattr(module, "cp_binding", None)
    if binding is None:
        raise refusal(
            None,
            module,
            f"attn_implementation {CP_ATTN_IMPLEMENTATION!r} on a module swap_attention did not "
            "prepare (call swap_attention(model, ...) on the whole model)",
        )
    check_call(binding, module, attention_mask, dropout, kwargs)
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"{binding.where()}: context-parallel attention takes one row of the step's local "
            f"tokens, got query {tuple(query.shape)}; feed the model "
            "input_ids[meta.token_indices][None] and position_ids=meta.positions[None]"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{binding.where()}: {key.shape[2]} keys for {query.shape[2]} queries: HF's own KV "
            "cache (past_key_values) is not used by cp; call the model with use_cache=False "
            "(the paged cache lives in the cp layers)"
        )
    # Views whose backward is a view too (indexing [0] would make the gradient a zero-filled
    # [1, H, T, D] tensor and a copy into it).
    q = query.squeeze(0).transpose(0, 1)  # [T, H, D]
    k = key.squeeze(0).transpose(0, 1)
    v = value.squeeze(0).transpose(0, 1)
    if binding.kv_replica_index is not None:
        # KV heads replicated over TP: every position's query heads add to the KV gradient.
        i = binding.kv_replica_index
        k = copy_to_group(k, *binding.tp_group)[:, i : i + 1]
        v = copy_to_group(v, *binding.tp_group)[:, i : i + 1]
    if scaling is None:
        scaling = getattr(module, "scaling", None) or q.shape[-1] ** -0.5
    window = _window(binding, module, attention_mask, kwargs.get("sliding_window"))
    cache = binding.caches.get(binding.layer_idx)
    if cache is not None and window != binding.sliding_window:
        raise refusal(
            binding,
            module,
            f"a sliding window of {window} keys in a layer whose KV cache is laid out for "
            f"window={binding.sliding_window} (set when swap_attention bound the layer)",
        )
    softcap: Any = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if (
        sinks is not None
        and binding.sinks_slice is not None
        and sinks.shape == (q.shape[1] * binding.sinks_slice[1],)
    ):
        r = binding.sinks_slice[0]
        sinks = sinks[r * q.shape[1] : (r + 1) * q.shape[1]]
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise refusal(
            binding,
            module,
            f"attention sinks of shape {tuple(sinks.shape)} for {q.shape[1]} local query heads "
            "(shard the sinks with the heads)",
        )
    out = gqa_attention(
        q, k, v, cache,
        scale=float(scaling), sinks=sinks, sliding_window=window,
        softcap=float(softcap) if _active(softcap) else None,
        kv_scales=binding.caches.scales.get(binding.layer_idx),
        fp8_window=binding.caches.windows.get(binding.layer_idx),
    )  # fmt: skip
    return out.unsqueeze(0), None


def layer_window(module, hf_config) -> int | None:
    """The sliding window a HF attention module will be called with: its ``sliding_window``
    (Gemma 2/3, gpt-oss, Qwen2, Cohere 2 set it per layer), else the config's (Mistral and the
    models that pass ``config.sliding_window`` to every layer); None for full attention,
    and for a module whose ``is_sliding`` is False (EXAONE 4's full layers)."""
    own = hasattr(module, "sliding_window") or hasattr(module, "is_sliding")
    w: Any = _module_window(module) if own else getattr(hf_config, "sliding_window", None)
    return int(w) if _active(w) else None


def _module_window(module) -> Any:
    """``module.sliding_window``, except on a layer that says it is not sliding: EXAONE 4
    keeps the config's window on every layer and applies it where ``is_sliding``."""
    if getattr(module, "is_sliding", None) is False:
        return None
    return getattr(module, "sliding_window", None)


def _window(binding, module, attention_mask, window_kwarg) -> int | None:
    """The layer's sliding window: what its mask, its keyword argument and the module say,
    which must agree (a window one of them leaves out is refused, never guessed)."""
    said: dict[str, Any] = {
        "the mask": attention_mask.size if isinstance(attention_mask, WindowMask) else None,
        "sliding_window=": window_kwarg if _active(window_kwarg) else None,
        "module.sliding_window": _module_window(module),
    }
    sizes = {int(v) for v in said.values() if _active(v)}
    if len(sizes) > 1 or (sizes and said["the mask"] is None):
        raise refusal(
            binding,
            module,
            f"inconsistent sliding windows ({', '.join(f'{k} {v}' for k, v in said.items())})",
        )
    return sizes.pop() if sizes else None


# ----------------------------------------------------------------------------- masks


_CODES: dict = {}


def _mask_codes() -> dict:
    """Code objects of transformers' mask closures (built once, in eager mode)."""
    if _CODES:
        return _CODES
    import transformers.masking_utils as mu

    # Built only for their code objects: the closures' arguments are never used. A factory
    # that this transformers version lacks has no code to match (None never matches a code).
    none: Any = None
    makers = {
        "and": ("and_masks", (mu.causal_mask_function,)),
        "or": ("or_masks", (mu.causal_mask_function,)),
        # Packed rows: from transformers 5.2x positions are remapped per packed sequence; before,
        # the packed mask is and-ed with the causal one.
        "remap": ("remap_positions_for_packed_sequence", (mu.causal_mask_function, none)),
        "packed": ("packed_sequence_mask_function", (none,)),
        "window": ("sliding_window_overlay", (1,)),
        "chunk": ("chunked_overlay", (1, none)),
        "block": ("blockwise_overlay", (none,)),
        "padding": ("padding_mask_function", (none,)),
        "window_bidir": ("sliding_window_bidirectional_overlay", (1,)),
    }
    for key, (name, args) in makers.items():
        factory = getattr(mu, name, None)
        _CODES[key] = factory(*args).__code__ if factory is not None else _NO_CODE
    return _CODES


_NO_CODE = object()  # stands for a factory missing from the installed transformers


_NAMES = {
    "window": "sliding-window attention",
    "window_bidir": "bidirectional sliding-window attention",
    "chunk": "chunked attention",
    "block": "a blockwise (bidirectional block) mask",
    "padding": "a padding mask",
    "or": "a custom mask overlay (or_mask_function)",
}


def _classify_eager(fn, codes, causal, bidirectional, allow: tuple[str, ...] = ()) -> str | None:
    """None when ``fn`` is causal attention over packed rows (with the overlays named in
    ``allow``); else what it is (exact walk)."""
    if fn is causal:
        return None
    if fn is bidirectional:
        return "bidirectional (non-causal) attention"
    code = getattr(fn, "__code__", None)
    if code is not None and any(code is codes[name] for name in allow):
        return None
    cells = (
        dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()))) if code else {}
    )
    if code is codes["and"] and len(cells.get("mask_functions", ())) == 2:
        remap, packed = cells["mask_functions"]
        if (
            getattr(packed, "__code__", None) is codes["packed"]
            and getattr(remap, "__code__", None) is codes["remap"]
        ):
            inner = dict(
                zip(remap.__code__.co_freevars, (c.cell_contents for c in remap.__closure__))
            )
            return _classify_eager(inner["mask_function"], codes, causal, bidirectional, allow)
    if code is codes["and"] or code is codes["or"]:
        has_causal = False
        for f in cells.get("mask_functions", ()):
            if code is codes["and"] and getattr(f, "__code__", None) is codes["packed"]:
                # and-ed with the packed-sequence mask: the step's requests are the packed rows.
                continue
            found = _classify_eager(f, codes, causal, bidirectional, allow)
            if found is not None:
                return found
            # An and-part classified as served is causal itself or an and holding causal.
            has_causal |= f is causal or getattr(f, "__code__", None) is codes["and"]
        if code is codes["and"] and has_causal:
            return None  # causal, and-ed with allowed overlays and the packed-sequence mask
    for key, text in _NAMES.items():
        if code is codes[key]:
            return text
    return f"the mask function {getattr(fn, '__qualname__', fn)!r}"


def cp_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs,
):
    """The ``cp`` mask function: None for causal attention over the step's requests (served
    without a mask), else a :class:`RefusedMask` naming what HF asked for.

    HF sees the step's tokens as packed rows (positions restart at every request), so plain
    causal attention reaches here as causal-over-packed-sequences; cp takes the requests from
    the step metadata instead. Traced by torch.compile, closures cannot be read, so the mask
    is told from its code objects and the creation arguments (which tell windows, chunks,
    bidirectional masks and overlays apart from packed rows).
    """
    import transformers.masking_utils as mu

    if attention_mask is not None:
        return RefusedMask(
            "a padding attention_mask (cp batches requests through the step metadata)"
        )
    if "allow_is_bidirectional_skip" in kwargs:
        return RefusedMask("bidirectional (non-causal) attention")
    if local_size is not None:
        config = kwargs.get("config")
        if getattr(config, "attention_chunk_size", None) == local_size:
            return RefusedMask(f"chunked attention (chunks of {local_size})")
        if not torch.compiler.is_compiling():
            found = _classify_eager(
                mask_function, _mask_codes(), mu.causal_mask_function,
                mu.bidirectional_mask_function, allow=("window",),
            )  # fmt: skip
            if found is not None:
                return RefusedMask(found)
        return WindowMask(int(local_size))
    if use_vmap:
        return RefusedMask("a custom mask overlay (or_mask_function / and_mask_function)")
    codes = _mask_codes()
    if torch.compiler.is_compiling():
        fn = mask_function
        if fn is mu.causal_mask_function or getattr(fn, "__code__", None) is codes["and"]:
            return None
        return RefusedMask("a mask other than causal attention")
    found = _classify_eager(
        mask_function, codes, mu.causal_mask_function, mu.bidirectional_mask_function
    )
    return None if found is None else RefusedMask(found)


def register_cp_attention() -> None:
    """Register the ``cp`` attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _mask_codes()
    AttentionInterface.register(CP_ATTN_IMPLEMENTATION, cp_attention_forward)
    AttentionMaskInterface.register(CP_ATTN_IMPLEMENTATION, cp_attention_mask)
    _skip_packed_detection_for_cp()


def _skip_packed_detection_for_cp() -> None:
    # HF's mask preparation looks for packed sequences in the position ids whenever they are
    # given without a padding mask or cache, and that test reads a device value on the host
    # (``bool(...all())``): one host-device synchronisation per mask a forward builds, which
    # left the H200 idle ~1.1 ms per prefill of 2 Llama-3-8B layers at 16k tokens. A cp model
    # always passes position ids and takes its requests from the step metadata instead, so for
    # its config (``_attn_implementation == "cp"``) the test is skipped (None: no packed rows,
    # the causal mask that cp_attention_mask serves anyway). Every other model, and traced
    # code (where HF skips the host read itself), keeps HF's function.
    import sys

    import transformers.masking_utils as mu

    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_cp_wrapped", False):
        return

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if not torch.compiler.is_compiling():
            config = sys._getframe(1).f_locals.get("config")
            if getattr(config, "_attn_implementation", None) == CP_ATTN_IMPLEMENTATION:
                return None
        return original(position_ids, *args, **kwargs)

    find_packed_sequence_indices._cp_wrapped = True  # type: ignore[attr-defined]
    find_packed_sequence_indices.__wrapped__ = original  # type: ignore[attr-defined]
    mu.find_packed_sequence_indices = find_packed_sequence_indices
