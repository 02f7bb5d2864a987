"""A small decoder-only language model built from the CP attention layers, in two flavours.

``attention="gqa"``: Llama-like (CPFlashAttention, grouped-query heads, SwiGLU MLP).
``attention="mla"``: DeepSeek-like (CPMLAAttention, latent KV, SwiGLU MLP).

The model runs on this rank's local tokens of the current step (see
:func:`~cp_modules.modules.cp_step`): ``forward(input_ids [T], positions [T]) -> logits [T, V]``.
Parameter names follow the HuggingFace models (``embed_tokens``, ``layers.i.self_attn.q_proj``,
``mlp.gate_proj``, ``norm``, ``lm_head``) so checkpoints read like theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from cp_modules.modules import CPFlashAttention, CPMLAAttention, RMSNorm, apply_tensor_parallel

__all__ = ["ATTENTION_KINDS", "SwiGLU", "TinyLM", "TinyLMConfig", "parallelize_model"]

ATTENTION_KINDS = ("gqa", "mla")


@dataclass
class TinyLMConfig:
    """Sizes of a :class:`TinyLM`; the MLA fields apply to ``attention="mla"`` only.

    Raises:
        ValueError: for an unknown ``attention`` kind or a size below 1.
    """

    attention: str = "gqa"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int | None = None
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"attention must be one of {list(ATTENTION_KINDS)}, got {self.attention!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class SwiGLU(nn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (Llama / DeepSeek dense layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, c: TinyLMConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn: CPFlashAttention | CPMLAAttention
        if c.attention == "gqa":
            self.self_attn = CPFlashAttention(
                c.hidden_size,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                rope_theta=c.rope_theta,
                bias=c.qkv_bias,
            )
        else:
            self.self_attn = CPMLAAttention(
                c.hidden_size,
                c.num_heads,
                q_lora_rank=c.q_lora_rank,
                kv_lora_rank=c.kv_lora_rank,
                qk_nope_head_dim=c.qk_nope_head_dim,
                qk_rope_head_dim=c.qk_rope_head_dim,
                v_head_dim=c.v_head_dim,
                rope_theta=c.rope_theta,
                eps=c.rms_norm_eps,
            )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLM(nn.Module):
    """Embedding, ``num_layers`` pre-norm blocks (CP attention + SwiGLU), final norm, LM head.

    Shapes: forward(input_ids [T] int64, positions [T] int64) -> logits [T, vocab] (fp32 when
    the weights are fp32), on this rank's local tokens of the current CP step.
    """

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x))


def _tp_submesh(mesh):
    names = mesh.mesh_dim_names or ()
    for name in ("tp", "tensor_parallel"):
        if name in names:
            return mesh[name]
    if mesh.ndim == 1:
        return mesh
    raise ValueError(
        f"parallelize_model needs a 1-D mesh or a mesh with a 'tp' (or 'tensor_parallel') "
        f"dimension, got dimensions {names}"
    )


def parallelize_model(model: nn.Module, mesh) -> nn.Module:
    """Shard every CP attention layer and SwiGLU MLP inside ``model`` over the mesh's TP axis.

    Attention uses :func:`~cp_modules.modules.apply_tensor_parallel` (heads split over TP);
    MLPs split ``gate_proj``/``up_proj`` column-wise and ``down_proj`` row-wise. Everything
    else (embeddings, norms, LM head) stays replicated. The model is changed in place and
    returned, so this serves as the ``parallelize_fn`` of the Lightning strategies for a bare
    model or for a LightningModule holding one.

    Args:
        model: any module; its CP attention layers and SwiGLU MLPs are found by type.
        mesh: the strategy's device mesh (its ``"tp"`` dimension is used) or a 1-D TP mesh.

    Raises:
        ValueError: when the mesh has no TP dimension or head counts do not split over it.
    """
    tp_mesh = _tp_submesh(mesh)
    if tp_mesh.size() == 1:
        return model
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mlp_plan = {
        "gate_proj": ColwiseParallel(),
        "up_proj": ColwiseParallel(),
        "down_proj": RowwiseParallel(),
    }
    for module in list(model.modules()):
        if isinstance(module, (CPFlashAttention, CPMLAAttention)):
            apply_tensor_parallel(module, tp_mesh)
        elif isinstance(module, SwiGLU):
            if module.gate_proj.out_features % tp_mesh.size():
                raise ValueError(
                    f"intermediate_size={module.gate_proj.out_features} must be divisible by "
                    f"the TP size {tp_mesh.size()}"
                )
            parallelize_module(module, tp_mesh, mlp_plan)
    return model
