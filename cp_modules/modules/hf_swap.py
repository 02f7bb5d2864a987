"""Drop-in context parallelism for HuggingFace causal LMs: :func:`swap_attention`.

GQA/MHA models keep every module they have. Their attention goes through transformers'
attention interface, set to the ``"cp"`` backend (:mod:`cp_modules.modules.hf_attention`):
the model's own projections, q/k norms, rope variant and scaling run as they are, and cp does
the attention of the step (PCP, the paged DCP-sharded KV cache, decode, training). Each
attention module gets a :class:`~cp_modules.modules.hf_attention.CPLayerBinding`
(``module.cp_binding``); the model gets the KV-cache store ``model.cp_kv_caches``, filled by
:func:`allocate_kv_caches` (one paged cache per ``layer_idx``).

MLA models (DeepSeek-V2/V3 and derivatives) swap every ``self_attn`` for a
:class:`HFCPMLAAttention` (a :class:`CPMLAAttention` that takes over the original projection
and norm modules: latent gather in prefill, absorbed decode), weights kept.

With a TP size > 1 the attention projections are sharded with ``parallelize_module`` after the
model's own TP plan (``config.base_model_tp_plan``: ``colwise`` / ``rowwise``, or
``colwise_gather_output`` / ``rowwise_split_input`` where a fused or normed projection needs
every head on every rank; ``replicated_with_grad_allreduce`` norms sum their gradients over
TP), and the embeddings, MLPs and LM head with :func:`parallelize_non_attention`.

The model is fed one step of the batch's flattened tokens as a single row:
``input_ids [1, T]`` = this rank's local tokens ``meta.token_indices`` and
``position_ids [1, T]`` = ``meta.positions``, with ``use_cache=False``, under
``with cp_step(meta):``. Hidden states (or logits) of the local tokens go through
:func:`restore_tokens` to come back in batch order.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn

from cp_modules.config import ParallelConfig
from cp_modules.modules.attention import CPMLAAttention, apply_tensor_parallel
from cp_modules.modules.hf_attention import (
    CP_ATTN_IMPLEMENTATION,
    CPKVCaches,
    CPLayerBinding,
    RefusedMask,
    check_call,
    layer_window,
    refusal,
    register_cp_attention,
)
from cp_modules.modules.hf_forward import install_forward_checks
from cp_modules.modules.hf_kv_caches import (
    allocate_kv_caches,
    cp_attention_layers,
    free_kv_caches,
    kv_cache_bytes_per_block_of,
    kv_cache_scale_tensors,
    kv_cache_tensors,
    kv_window_tensors,
)
from cp_modules.modules.hf_tp import (
    attention_tp_plan,
    module_name,
    parallelize_attention,
    parallelize_non_attention,
    shard_experts,
)
from cp_modules.modules.rope import RotaryEmbedding

__all__ = [
    "CP_ATTN_IMPLEMENTATION",
    "HFCPMLAAttention",
    "allocate_kv_caches",
    "kv_cache_bytes_per_block_of",
    "cp_attention_layers",
    "free_kv_caches",
    "kv_cache_scale_tensors",
    "kv_window_tensors",
    "kv_cache_tensors",
    "parallelize_non_attention",
    "swap_attention",
]

_MLA_PROJECTIONS = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)


def _rope_from_hf(position_embeddings, kwargs, rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, D_rot]`` from what the HF model passes (a pair, or complex ``freqs_cis``)."""
    if position_embeddings is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError("the swapped attention needs position_embeddings or position_ids")
        return rotary(position_ids[0])
    if isinstance(position_embeddings, torch.Tensor) and position_embeddings.is_complex():
        # DeepSeek-V2 rotates interleaved pairs by complex factors e^{i θ}: the same rotation
        # as cos/sin over (x[2i], x[2i+1]), which the MLA module applies with rope_interleave.
        # It returns the rotated dims in rotate-half order, V2 keeps them interleaved: q·k is
        # unchanged because q and k share the order.
        f = position_embeddings[0]
        cos, sin = f.real, f.imag
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos, sin = position_embeddings
    return cos[0], sin[0]


def _check_hidden(hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(
            "context-parallel attention takes one row of the step's local tokens: "
            f"hidden_states [1, T, hidden], got {tuple(hidden_states.shape)}; feed the model "
            "input_ids[meta.token_indices][None] and position_ids=meta.positions[None]"
        )
    return hidden_states[0]


class HFCPMLAAttention(CPMLAAttention):
    """CPMLAAttention called the way HF DeepSeek-V2/V3 decoder layers call attention.

    Shapes: forward(hidden_states [1, T, hidden], position_embeddings (cos, sin) [1, T, Dr]
    or complex [1, T, Dr / 2]) -> (out [1, T, hidden], None).
    """

    layer_idx: int | None
    where: str

    @classmethod
    def from_hf(cls, attn: Any, config) -> HFCPMLAAttention:
        """Adapter owning ``attn``'s projection and norm modules (weights kept, not copied)."""
        complex_rope = getattr(config, "model_type", "") == "deepseek_v2"
        if attn.kv_b_proj.bias is not None:
            raise ValueError("kv_b_proj with a bias cannot be absorbed into the MLA decode query")
        with torch.device("meta"):  # every parameter is replaced by attn's own below
            layer = cls(
                config.hidden_size,
                config.num_attention_heads,
                q_lora_rank=getattr(attn, "q_lora_rank", None),
                kv_lora_rank=attn.kv_lora_rank,
                qk_nope_head_dim=attn.qk_nope_head_dim,
                qk_rope_head_dim=attn.qk_rope_head_dim,
                v_head_dim=attn.v_head_dim,
                rope_theta=_rope_theta(config),
                rope_interleave=complex_rope or bool(getattr(config, "rope_interleave", False)),
                softmax_scale=attn.scaling,
            )
        for name in _MLA_PROJECTIONS:
            mod = getattr(attn, name, None)
            if mod is not None:
                setattr(layer, name, mod)
        device = next(attn.parameters()).device
        if device.type == "meta":  # a model built on meta: the frequencies are real buffers
            device = torch.device("cpu")
        layer.rotary = RotaryEmbedding(attn.qk_rope_head_dim, _rope_theta(config)).to(device)
        layer.layer_idx = getattr(attn, "layer_idx", None)
        layer.where = f"{type(attn).__name__} (layer_idx={layer.layer_idx})"
        layer.train(attn.training)
        left = [
            n
            for n, t in (*layer.named_parameters(), *layer.named_buffers())
            if t.is_meta and not any(t is q for q in attn.parameters())
        ]
        assert not left, f"adapter tensors not taken from the HF module: {left}"
        return layer

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        if isinstance(attention_mask, RefusedMask):
            raise refusal(None, self, f"{self.where}: {attention_mask.feature}")
        if attention_mask is not None:
            raise refusal(None, self, f"{self.where}: an explicit attention mask")
        x = _check_hidden(hidden_states)
        cos, sin = _rope_from_hf(position_embeddings, kwargs, self.rotary)
        out = super().forward(x, None, position_embeddings=(cos, sin))
        return out.unsqueeze(0), None


# What the forward of DeepSeek-V2/V3-style MLA (and its copies: MiniCPM3, GLM-4-MoE-Lite, Youtu,
# AXK1) reads from its module and config: what HFCPMLAAttention implements. Anything else (an
# output gate, a sparse indexer, LongCat's LoRA scales, sinks) would be dropped by the swap.
_MLA_FORWARD_ATTRS = frozenset(
    {*_MLA_PROJECTIONS, "attention_dropout", "config", "expand_kv", "kv_lora_rank", "layer_idx",
     "q_lora_rank", "qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "scaling", "training"}
)  # fmt: skip
_MLA_CONFIG_ATTRS = frozenset({"_attn_implementation", "rope_interleave"})


def _check_mla_module(attn: nn.Module, where: str) -> None:
    """Refuse an MLA module whose forward does more than DeepSeek-V2/V3's."""
    try:
        src = inspect.getsource(type(attn).forward)
    except (OSError, TypeError):
        src = ""
    used = set(re.findall(r"self\.(\w+)", src))
    config_used = set(re.findall(r"self\.config\.(\w+)", src))
    own = {n for n, m in attn.named_children() if any(True for _ in m.parameters())}
    own |= {n for n, _ in attn.named_parameters(recurse=False)}
    unknown = sorted((used - _MLA_FORWARD_ATTRS) | (own - set(_MLA_PROJECTIONS)))
    unknown += sorted(f"config.{n}" for n in config_used - _MLA_CONFIG_ATTRS)
    if not src or unknown:
        what = f"uses {unknown}" if src else "has no readable forward"
        raise ValueError(
            f"{where}: {type(attn).__name__} looks like MLA (kv_a_proj_with_mqa, kv_b_proj) "
            f"but {what}, which cp's MLA (DeepSeek-V2/V3's) does not implement"
        )


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _is_mla(attn: nn.Module) -> bool:
    return hasattr(attn, "kv_a_proj_with_mqa") and hasattr(attn, "kv_b_proj")


_USES_INTERFACE: dict[type, bool] = {}


def _uses_interface(attn: nn.Module) -> bool:
    """Whether ``attn``'s forward calls transformers' attention interface."""
    cls = type(attn)
    if cls not in _USES_INTERFACE:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        _USES_INTERFACE[cls] = "ALL_ATTENTION_FUNCTIONS" in src
    return _USES_INTERFACE[cls]


# What decoder layers call their self-attention: ``self_attn`` (Llama and most families);
# ``attn`` / ``attention`` in GPT-2, GPT-J, CodeGen, GPTBigCode and GPT-NeoX, which are taken
# only as causal self-attention (vision towers and cross-attention use the same names).
_SELF_ATTN_NAMES = ("attn", "attention")


def _is_decoder_attention(name: str, mod: nn.Module) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "self_attn":
        return True
    return (
        leaf in _SELF_ATTN_NAMES
        and getattr(mod, "is_causal", None) is True
        and not getattr(mod, "is_cross_attention", False)
        and isinstance(getattr(mod, "layer_idx", None), int)
    )


def _kv_heads(attn: nn.Module, num_heads: int, config_kv_heads: int) -> int:
    """The KV heads of one attention module: from its ``num_key_value_groups`` where it has
    one (GPTBigCode's multi-query layers say it only there), else the config's."""
    groups = getattr(attn, "num_key_value_groups", None)
    if isinstance(groups, int) and groups > 0 and num_heads % groups == 0:
        return num_heads // groups
    return config_kv_heads


def _parallel_args(parallel):
    from cp_modules.distributed.groups import CPGroups

    if parallel is None:
        return ParallelConfig(), None
    if isinstance(parallel, ParallelConfig):
        return parallel, None
    if isinstance(parallel, CPGroups):
        return parallel.config, parallel
    raise ValueError(
        f"parallel must be a ParallelConfig, CPGroups or None, got {type(parallel).__name__}"
    )


# Layer types the attention interface serves: full causal attention, and sliding windows
# (the window arrives as the layer's mask and keyword argument; CPU reference paths).
_SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")


def _check_layer_types(model: nn.Module, hf_config) -> None:
    other = {
        i: t
        for i, t in enumerate(getattr(hf_config, "layer_types", None) or [])
        if t not in _SERVED_LAYER_TYPES
    }
    if other:
        i, t = next(iter(other.items()))
        raise ValueError(
            f"{type(model).__name__} layer {i} (and {len(other) - 1} more): layer type {t!r} "
            "is not implemented by context-parallel attention (served: "
            f"{', '.join(_SERVED_LAYER_TYPES)})"
        )


def swap_attention(
    model: nn.Module,
    parallel: ParallelConfig | object | None = None,
    *,
    parallelize_rest: bool = True,
) -> nn.Module:
    """Make a HF causal LM context-parallel, in place; return the model.

    GQA/MHA attention is set to transformers' ``"cp"`` attention interface (the model keeps
    its modules); MLA attention (DeepSeek-V2/V3 style) is swapped for :class:`HFCPMLAAttention`.

    Args:
        model: a transformers causal LM (or base model).
        parallel: the layout, as :class:`~cp_modules.distributed.groups.CPGroups` (tensor
            parallelism is applied on ``groups.mesh["tp"]``) or a :class:`ParallelConfig`
            (heads are validated against it; when its world size is > 1 the groups are built
            with ``init_cp_groups`` and kept as ``model.cp_groups``). ``None``: one process.
        parallelize_rest: with TP > 1, also shard the embeddings, MLPs (``gate/up/down_proj``)
            and the LM head with ``parallelize_module``, and split routed MoE experts over the
            TP ranks (:func:`~cp_modules.modules.hf_tp.shard_experts`).

    Raises:
        ValueError: naming the model class, the layer and the feature, for attention cp cannot
            serve exactly: a layer that neither goes through the attention interface nor is
            MLA, sliding-window / chunked / non-causal layers, sinks, soft-capping (the
            forward refuses what only shows at call time), head counts or a TP plan the
            layout cannot serve.
    """
    from cp_modules.distributed.groups import init_cp_groups

    config, groups = _parallel_args(parallel)
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        raise ValueError(
            f"expected a transformers model with a .config, got {type(model).__name__}"
        )
    model_name = type(model).__name__
    hf_config, prefix, sub_config = _language_model(model, hf_config)
    _check_layer_types(model, hf_config)
    register_cp_attention()
    caches = getattr(model, "cp_kv_caches", None) or CPKVCaches()

    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if name.startswith(prefix)
        and _is_decoder_attention(name, mod)
        and getattr(mod, "cp_binding", None) is None
        and not isinstance(mod, CPMLAAttention)
    ]
    cross = [n for n, m in model.named_modules() if getattr(m, "is_cross_attention", False) is True]
    if cross:
        raise ValueError(
            f"{model_name} layer {cross[0]!r}: cross-attention (an encoder's keys) is not "
            "implemented by context-parallel attention; cp serves causal self-attention (build "
            "the model without add_cross_attention)"
        )
    if not targets and not cp_attention_layers(model):
        raise ValueError(
            f"{model_name} has no self-attention modules cp knows (`self_attn`, or causal "
            "`attn` / `attention` with a layer_idx): cp serves causal LMs whose attention goes "
            "through transformers' attention interface, and DeepSeek-V2/V3-style MLA models"
        )
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    swapped_mla, bound = [], []
    for name, attn in targets:
        where = f"{model_name} layer {name!r}"
        if _is_mla(attn):
            _check_mla_module(attn, where)
            config.validate_heads(num_heads, None)
            new = HFCPMLAAttention.from_hf(attn, hf_config)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
            swapped_mla.append(new)
            continue
        if not _uses_interface(attn):
            raise ValueError(
                f"{where}: {type(attn).__name__} does not go through transformers' attention "
                "interface and is not a known MLA layer, so cp cannot serve it"
            )
        layer_idx = getattr(attn, "layer_idx", None)
        if not isinstance(layer_idx, int):
            raise ValueError(
                f"{where}: {type(attn).__name__} has no integer layer_idx (its KV-cache slot)"
            )
        kv_heads = _kv_heads(attn, num_heads, num_kv_heads)
        config.validate_heads(num_heads, kv_heads)
        head_dim = getattr(attn, "head_dim", None) or hf_config.hidden_size // num_heads
        binding = CPLayerBinding(
            model_name=model_name,
            layer_name=name,
            layer_idx=layer_idx,
            caches=caches,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            sliding_window=layer_window(attn, hf_config),
        )
        # What shows on the module already (windows, sinks, is_causal) fails here, not at the
        # first forward.
        check_call(binding, attn, None, 0.0, {})
        bound.append((name, attn, binding))
    if len({b.layer_idx for _, _, b in bound}) != len(bound):
        raise ValueError(
            f"{model_name}: attention modules share a layer_idx (each needs its own KV cache)"
        )

    hf_model: Any = model  # a transformers PreTrainedModel
    if config.world_size > 1 and groups is None:
        groups = init_cp_groups(config)
        hf_model.cp_groups = groups
    if groups is not None and config.tp > 1:
        tp_mesh = groups.mesh["tp"]
        plan = attention_tp_plan(hf_config)
        for _, attn, binding in bound:
            parallelize_attention(
                attn, binding, plan, tp_mesh, config, num_heads, binding.num_kv_heads
            )
        for layer in swapped_mla:
            apply_tensor_parallel(layer, tp_mesh)
        if parallelize_rest:
            parallelize_non_attention(model, tp_mesh)
            shard_experts(model, tp_mesh)
    for _, attn, binding in bound:
        attn.cp_binding = binding
    hf_model.cp_kv_caches = caches
    install_forward_checks(model)
    # A multimodal model: its language model only (the vision tower keeps its attention).
    hf_model.set_attn_implementation(
        {sub_config: CP_ATTN_IMPLEMENTATION} if sub_config else CP_ATTN_IMPLEMENTATION
    )
    return model


def _language_model(model: nn.Module, hf_config):
    """(the text model's config, the module-name prefix of its layers, the sub-config key)
    of a causal LM ("", None) or of a multimodal model whose language model cp serves for
    text-only forwards (Gemma 3 / 3n / 4 load this way through AutoModelForCausalLM)."""
    if isinstance(getattr(hf_config, "num_attention_heads", None), int):
        return hf_config, "", None
    name = type(model).__name__
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else None
    key = next(
        (k for k in getattr(hf_config, "sub_configs", {}) if getattr(hf_config, k, None) is text),
        None,
    )
    hf_model: Any = model
    decoder = hf_model.get_decoder() if hasattr(model, "get_decoder") else None
    prefix = module_name(model, decoder)
    if (
        text is None
        or text is hf_config
        or key is None
        or not prefix
        or not isinstance(getattr(text, "num_attention_heads", None), int)
    ):
        raise ValueError(
            f"{name}: its config has no num_attention_heads and no text model cp can find "
            "(a text_config and get_decoder()); cp serves decoder-only causal LMs, the language "
            "model of multimodal ones (text-only inputs), and DeepSeek-V2/V3-style MLA models"
        )
    return text, prefix + ".", key
