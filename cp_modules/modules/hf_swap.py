"""Drop-in swap: HuggingFace causal LMs run their own forward with context-parallel attention.

:func:`swap_attention` replaces every ``self_attn`` of a transformers model, in place, by an
adapter that *is* a :class:`CPFlashAttention` (Llama, Qwen2, Mistral: GQA/MHA) or a
:class:`CPMLAAttention` (DeepSeek-V2/V3: MLA) and takes over the original projection modules
themselves, so weights (and biases, dtypes, devices) are kept as they are. The adapters accept
HF's attention call (``hidden_states [1, T, hidden]``, ``position_embeddings`` computed by the
model from ``position_ids``) and return ``(out, None)``. With a TP size > 1 the rest of the
model (embeddings, MLPs, LM head) is sharded with ``parallelize_module`` on the TP mesh.

The model is then fed one step of the batch's flattened tokens as a single row:
``input_ids [1, T]`` = this rank's local tokens ``meta.token_indices`` and
``position_ids [1, T]`` = ``meta.positions``, under ``with cp_step(meta):``. Hidden states (or
logits) of the local tokens go through :func:`restore_tokens` to come back in batch order.

The model's ``config._attn_implementation`` becomes ``"cp_modules"``, registered with
transformers' ``AttentionInterface`` and without a mask function, so HF builds no causal mask
(the CP ops know the causal structure from the step's metadata).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from cp_modules.config import ParallelConfig
from cp_modules.modules.attention import CPFlashAttention, CPMLAAttention, apply_tensor_parallel
from cp_modules.modules.rope import RotaryEmbedding

__all__ = [
    "CP_ATTN_IMPLEMENTATION",
    "HFCPFlashAttention",
    "HFCPMLAAttention",
    "cp_attention_layers",
    "swap_attention",
]

CP_ATTN_IMPLEMENTATION = "cp_modules"

_GQA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLA_PROJECTIONS = (
    "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
    "kv_b_proj", "o_proj",
)


def _cp_attention_placeholder(module, *args, **kwargs):
    raise RuntimeError(
        f"{type(module).__name__} was not replaced by swap_attention but the model's "
        f"attn_implementation is {CP_ATTN_IMPLEMENTATION!r}: call swap_attention(model, ...) on "
        "the whole model"
    )


def _register_attention_interface() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTN_IMPLEMENTATION, _cp_attention_placeholder)


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


class HFCPFlashAttention(CPFlashAttention):
    """CPFlashAttention called the way HF Llama/Qwen2/Mistral decoder layers call attention.

    Shapes: forward(hidden_states [1, T, hidden], position_embeddings (cos, sin) [1, T, D])
    -> (out [1, T, hidden], None).
    """

    @classmethod
    def from_hf(cls, attn: nn.Module, config) -> HFCPFlashAttention:
        """Adapter owning ``attn``'s projection modules (weights kept, not copied)."""
        num_heads = config.num_attention_heads
        with torch.device("meta"):  # every parameter is replaced by attn's own below
            layer = cls(
                config.hidden_size, num_heads,
                getattr(config, "num_key_value_heads", None) or num_heads, attn.head_dim,
                rope_theta=_rope_theta(config),
                bias=attn.q_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
            )
        for name in _GQA_PROJECTIONS:
            setattr(layer, name, getattr(attn, name))
        layer.scaling = attn.scaling
        return _finish(layer, attn, attn.head_dim, config)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        x = _check_hidden(hidden_states)
        cos, sin = _rope_from_hf(position_embeddings, kwargs, self.rotary)
        out = super().forward(x, None, position_embeddings=(cos, sin))
        return out.unsqueeze(0), None


class HFCPMLAAttention(CPMLAAttention):
    """CPMLAAttention called the way HF DeepSeek-V2/V3 decoder layers call attention.

    Shapes: forward(hidden_states [1, T, hidden], position_embeddings (cos, sin) [1, T, Dr]
    or complex [1, T, Dr / 2]) -> (out [1, T, hidden], None).
    """

    @classmethod
    def from_hf(cls, attn: nn.Module, config) -> HFCPMLAAttention:
        """Adapter owning ``attn``'s projection and norm modules (weights kept, not copied)."""
        complex_rope = getattr(config, "model_type", "") == "deepseek_v2"
        if attn.kv_b_proj.bias is not None:
            raise ValueError("kv_b_proj with a bias cannot be absorbed into the MLA decode query")
        with torch.device("meta"):  # every parameter is replaced by attn's own below
            layer = cls(
                config.hidden_size, config.num_attention_heads,
                q_lora_rank=getattr(attn, "q_lora_rank", None), kv_lora_rank=attn.kv_lora_rank,
                qk_nope_head_dim=attn.qk_nope_head_dim, qk_rope_head_dim=attn.qk_rope_head_dim,
                v_head_dim=attn.v_head_dim, rope_theta=_rope_theta(config),
                rope_interleave=complex_rope or bool(getattr(config, "rope_interleave", False)),
                softmax_scale=attn.scaling,
            )
        for name in _MLA_PROJECTIONS:
            mod = getattr(attn, name, None)
            if mod is not None:
                setattr(layer, name, mod)
        return _finish(layer, attn, attn.qk_rope_head_dim, config)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        x = _check_hidden(hidden_states)
        cos, sin = _rope_from_hf(position_embeddings, kwargs, self.rotary)
        out = super().forward(x, None, position_embeddings=(cos, sin))
        return out.unsqueeze(0), None


def _finish(layer, attn: nn.Module, rope_dim: int, config):
    """Rotary tables on the weights' device (used only without position_embeddings)."""
    device = next(attn.parameters()).device
    layer.rotary = RotaryEmbedding(rope_dim, _rope_theta(config)).to(device)
    layer.layer_idx = getattr(attn, "layer_idx", None)
    layer.train(attn.training)
    left = [n for n, t in (*layer.named_parameters(), *layer.named_buffers()) if t.is_meta]
    assert not left, f"adapter tensors not taken from the HF module: {left}"
    return layer


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _is_mla(attn: nn.Module) -> bool:
    return hasattr(attn, "kv_a_proj_with_mqa") and hasattr(attn, "kv_b_proj")


def _is_gqa(attn: nn.Module) -> bool:
    return all(isinstance(getattr(attn, n, None), nn.Linear) for n in _GQA_PROJECTIONS)


def _check_full_attention(config) -> None:
    """Sliding-window layers would attend fewer keys than the CP modules (full causal)."""
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", window is not None)
    if other or (window is not None and uses_window):
        raise ValueError(
            "swap_attention supports full causal attention only, but the model config has "
            f"layer_types {other or 'full_attention'} / sliding_window={window}: set "
            "config.sliding_window=None (and layer_types to 'full_attention') when every "
            "sequence is shorter than the window"
        )


def cp_attention_layers(model: nn.Module) -> list[CPFlashAttention | CPMLAAttention]:
    """The context-parallel attention layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (CPFlashAttention, CPMLAAttention))]


def swap_attention(
    model: nn.Module,
    parallel: ParallelConfig | object | None = None,
    *,
    parallelize_rest: bool = True,
) -> nn.Module:
    """Replace the attention layers of a HF causal LM with CP modules in place; return the model.

    Args:
        model: a transformers model (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
            ``MistralForCausalLM``, ``DeepseekV2/V3ForCausalLM`` or their base models); every
            ``self_attn`` is swapped.
        parallel: the layout, as :class:`~cp_modules.distributed.groups.CPGroups` (tensor
            parallelism is applied on ``groups.mesh["tp"]``) or a :class:`ParallelConfig`
            (heads are validated against it; when its world size is > 1 the groups are built
            with ``init_cp_groups`` and kept as ``model.cp_groups``). ``None``: one process.
        parallelize_rest: with TP > 1, also shard the embeddings, MLPs (``gate/up/down_proj``)
            and the LM head with ``parallelize_module`` (embedding and LM head over the
            vocabulary, MLPs column-/row-wise); routed MoE experts stay replicated.

    Raises:
        ValueError: for a model without swappable attention layers, sliding-window attention,
            or head counts the layout cannot serve.
    """
    from cp_modules.distributed.groups import CPGroups, init_cp_groups

    groups = None
    if parallel is None:
        config = ParallelConfig()
    elif isinstance(parallel, ParallelConfig):
        config = parallel
    elif isinstance(parallel, CPGroups):
        config, groups = parallel.config, parallel
    else:
        raise ValueError(
            f"parallel must be a ParallelConfig, CPGroups or None, got {type(parallel).__name__}"
        )
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        raise ValueError(f"expected a transformers model with a .config, got {type(model).__name__}")
    _check_full_attention(hf_config)

    targets = [
        (name, mod) for name, mod in model.named_modules()
        if name.rsplit(".", 1)[-1] == "self_attn" and not isinstance(mod, (CPFlashAttention, CPMLAAttention))
    ]
    if not targets and not cp_attention_layers(model):
        raise ValueError(
            f"{type(model).__name__} has no `self_attn` modules to swap: supported are "
            "Llama/Qwen2/Mistral-style (q/k/v/o_proj) and DeepSeek-V2/V3-style (MLA) models"
        )
    swapped = []
    for name, attn in targets:
        if _is_mla(attn):
            config.validate_heads(hf_config.num_attention_heads, None)
            new = HFCPMLAAttention.from_hf(attn, hf_config)
        elif _is_gqa(attn):
            config.validate_heads(
                hf_config.num_attention_heads,
                getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            )
            new = HFCPFlashAttention.from_hf(attn, hf_config)
        else:
            raise ValueError(
                f"{name} ({type(attn).__name__}) is neither GQA/MHA (q_proj, k_proj, v_proj, "
                "o_proj) nor MLA (kv_a_proj_with_mqa, kv_b_proj)"
            )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        swapped.append(new)

    _register_attention_interface()
    model.set_attn_implementation(CP_ATTN_IMPLEMENTATION)

    if config.world_size > 1 and groups is None:
        groups = init_cp_groups(config)
        model.cp_groups = groups
    if groups is not None and config.tp > 1:
        tp_mesh = groups.mesh["tp"]
        for layer in swapped:
            apply_tensor_parallel(layer, tp_mesh)
        if parallelize_rest:
            parallelize_non_attention(model, tp_mesh)
    return model


def parallelize_non_attention(model: nn.Module, tp_mesh) -> nn.Module:
    """Shard embeddings, dense MLPs and the LM head of a HF model over ``tp_mesh``.

    Outputs stay replicated plain tensors, so the HF forward between the layers is unchanged:
    the token embedding is split over the vocabulary (row-wise: each rank looks up its rows,
    the partial results are all-reduced), MLPs are column-wise ``gate/up_proj`` + row-wise
    ``down_proj``, the LM head is split over the vocabulary and all-gathered. A module whose
    size the TP size does not divide stays replicated (a warning names it).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    plan = {}
    skipped = []
    for name, mod in model.named_modules():
        if isinstance(mod, (CPFlashAttention, CPMLAAttention)):
            continue
        children = {n: getattr(mod, n, None) for n in ("gate_proj", "up_proj", "down_proj")}
        if all(isinstance(c, nn.Linear) for c in children.values()):
            if children["gate_proj"].out_features % tp:
                skipped.append(name)
                continue
            prefix = f"{name}." if name else ""
            plan[prefix + "gate_proj"] = ColwiseParallel()
            plan[prefix + "up_proj"] = ColwiseParallel()
            plan[prefix + "down_proj"] = RowwiseParallel()
    emb = model.get_input_embeddings()
    emb_name = _module_name(model, emb)
    if emb_name is not None:
        if emb.num_embeddings % tp:
            skipped.append(emb_name)
        else:
            plan[emb_name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = _module_name(model, head) if isinstance(head, nn.Linear) else None
    if head_name is not None:
        if head.out_features % tp:
            skipped.append(head_name)
        else:
            plan[head_name] = ColwiseParallel(output_layouts=Replicate())
    if skipped:
        warnings.warn(
            f"modules kept replicated (sizes not divisible by the TP size {tp}): {skipped}",
            stacklevel=2,
        )
    return parallelize_module(model, tp_mesh, plan)


def _module_name(root: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None
