"""Context-parallel attention layers: CPFlashAttention (GQA/MHA) and CPMLAAttention (MLA).

Both own their projections like the attention layers users know (Llama's q/k/v/o_proj,
DeepSeek-V2/V3's q_a/q_b/kv_a/kv_b/o_proj, same names and shapes, so weights load as they
are) and run on this rank's local tokens ``[T, hidden]`` at true ``positions [T]`` for the
step set by :func:`~cp_modules.step.cp_step`.

Tensor parallelism uses PyTorch's own API: :func:`apply_tensor_parallel` shards the
projections with ``parallelize_module`` (column-wise q/k/v or q_b/kv_b, row-wise o_proj) on the
TP mesh; the forward reads the local head counts from the projection outputs. KV heads fewer
than the TP size are replicated (each TP position keeps the KV head its query heads use).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from cp_modules.distributed.collectives import copy_to_group
from cp_modules.modules.rope import RotaryEmbedding, apply_rotary
from cp_modules.ops.cp_attention import gqa_attention, mla_attention

__all__ = ["CPFlashAttention", "CPMLAAttention", "RMSNorm", "apply_tensor_parallel"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (fp32 statistics)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class CPFlashAttention(nn.Module):
    """GQA/MHA self-attention with PCP prefill/training and DCP decode.

    Args:
        hidden_size: model width.
        num_heads: query heads (all TP ranks together).
        num_kv_heads: KV heads (``num_heads`` for MHA).
        head_dim: per-head dim (default ``hidden_size // num_heads``).
        rope_theta: RoPE base.
        bias: bias on q/k/v (Qwen2 style); o_proj has none.
        sinks: learn one sink logit per head (gpt-oss): softmax over the scores and the sink,
            whose probability adds no value (parameter ``sinks`` [num_heads], zeros at init).
        sliding_window: W: a query at position i attends keys ``i - W < j <= i`` (None: all
            earlier keys).
        softcap: c: scores become ``c * tanh(scores / c)`` before masking (Gemma 2). Windows
            and soft-cap run on every device in prefill and training; decode tokens on CUDA
            refuse them for now (CPU serves them).

    Shapes: forward(hidden_states [T, hidden], positions [T]) -> [T, hidden].
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        rope_theta: float = 10000.0,
        bias: bool = False,
        o_bias: bool = False,
        sinks: bool = False,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 (or None), got {softcap}")
        self.sliding_window = sliding_window
        self.softcap = softcap
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=o_bias)
        self.rotary = RotaryEmbedding(self.head_dim, rope_theta)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        # Set by apply_tensor_parallel: the TP group, and the KV head this TP position uses
        # when KV heads are replicated over TP.
        self.tp_group: tuple[str, int] = ("", 1)
        self.kv_replica_index: int | None = None
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # An fp8 kv_cache's (k_scale, v_scale), fp32 [Hkv_local] or [1]; None: 1.0.
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        # An fp8 kv_cache's bf16 window (buffer, sink, recent): cp_modules.cache.exact_window.
        self.fp8_window: tuple[torch.Tensor, int, int] | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        t = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(t, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(t, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(t, -1, self.head_dim)
        if self.kv_replica_index is not None:
            # Replicated KV projections: every TP position's heads add to the KV gradient.
            i = self.kv_replica_index
            k = copy_to_group(k, *self.tp_group)[:, i : i + 1]
            v = copy_to_group(v, *self.tp_group)[:, i : i + 1]
        cos, sin = (
            position_embeddings if position_embeddings is not None else self.rotary(positions)
        )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attend(q, k, v)
        return self.o_proj(out.reshape(t, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention core after projections and RoPE: [T, H, D], [T, Hkv, D] x2 -> [T, H, D]."""
        sinks = self.sinks
        if isinstance(sinks, DTensor):  # TP: this rank's heads
            sinks = sinks.to_local()
        return gqa_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            self.kv_cache,
            scale=self.scaling,
            sinks=sinks,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            kv_scales=self.kv_scales,
            fp8_window=self.fp8_window,
        )


class CPMLAAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention with PCP prefill/training and DCP decode.

    Args:
        hidden_size: model width.
        num_heads: query heads.
        q_lora_rank: rank of the query compression (None: a plain q_proj, as in V2-Lite).
        kv_lora_rank: rank of the KV latent (Rk, e.g. 512).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: Dn (128), Dr (64), Dv (128).
        rope_theta: RoPE base; rope_interleave: DeepSeek's interleaved rope layout.
        softmax_scale: default ``(Dn + Dr) ** -0.5``.

    Shapes: forward(hidden_states [T, hidden], positions [T]) -> [T, hidden].
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        rope_theta: float = 10000.0,
        rope_interleave: bool = False,
        softmax_scale: float | None = None,
        eps: float = 1e-6,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_interleave = rope_interleave
        self.scaling = softmax_scale if softmax_scale is not None else self.qk_head_dim**-0.5
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta)
        self.tp_group: tuple[str, int] = ("", 1)
        self.kv_cache: torch.Tensor | None = None
        # An fp8 kv_cache's scale, fp32 [1]; None: 1.0.
        self.kv_cache_scale: torch.Tensor | None = None
        # An fp8 kv_cache's bf16 window (buffer, sink, recent): cp_modules.cache.exact_window.
        self.fp8_window: tuple[torch.Tensor, int, int] | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        t = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(t, -1, self.qk_head_dim)
        kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_c, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        cos, sin = (
            position_embeddings if position_embeddings is not None else self.rotary(positions)
        )
        dn = self.qk_nope_head_dim
        q_pe = apply_rotary(q[..., dn:], cos, sin, interleaved=self.rope_interleave)
        if q.requires_grad:
            q = torch.cat((q[..., :dn], q_pe), dim=-1)
        else:
            # No autograd: the rope part is rotated into q's own columns (one copy of
            # [T, H, Dr] where joining the parts copies all of [T, H, Dn + Dr]). Under
            # autograd q may be a view made inside a custom Function (FSDP, TP), which
            # must not be written in place.
            q[..., dn:] = q_pe
        k_pe = apply_rotary(k_pe.unsqueeze(1), cos, sin, interleaved=self.rope_interleave).squeeze(
            1
        )
        kv_c = self.kv_a_layernorm(kv_c)
        latent: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (kv_c, k_pe)
        if self.tp_group[1] > 1:
            # The latent is shared by every head: each TP rank's heads add to its gradient
            # (one sum for both parts).
            latent = copy_to_group(torch.cat((kv_c, k_pe), dim=-1), *self.tp_group)
        out = self.attend(q, latent)
        return self.o_proj(out.reshape(t, -1))

    def up_projection_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads of kv_b_proj as ``w_uk [H, Dn, Rk]`` and ``w_uv [H, Dv, Rk]``."""
        w = self.kv_b_proj.weight
        if isinstance(w, DTensor):
            w = w.to_local()
        w = w.view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def up_projection_weight(self) -> torch.Tensor:
        """This rank's heads of kv_b_proj as one ``w_kv [H, Dn + Dv, Rk]`` (a view)."""
        w = self.kv_b_proj.weight
        if isinstance(w, DTensor):
            w = w.to_local()
        return w.view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    def attend(
        self, q: torch.Tensor, latent: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Attention core: q [T, H, Dn + Dr], latent [T, Rk + Dr] (or its parts kv_c [T, Rk],
        k_pe [T, Dr]) -> [T, H, Dv]. The up-projection runs as one GEMM with kv_b_proj's
        whole weight (as HF runs it)."""
        return mla_attention(
            q.contiguous(),
            latent if isinstance(latent, tuple) else latent.contiguous(),
            self.up_projection_weight(),
            None,
            self.kv_cache,
            scale=self.scaling,
            kv_lora_rank=self.kv_lora_rank,
            cache_scale=self.kv_cache_scale,
            fp8_window=self.fp8_window,
        )


def apply_tensor_parallel(module: nn.Module, tp_mesh, config=None) -> nn.Module:
    """Shard a CPFlashAttention / CPMLAAttention over ``tp_mesh`` with ``parallelize_module``.

    With ``config`` (a ParallelConfig) the layer's head counts are first checked against the
    whole layout (``config.validate_heads``), e.g. that a DCP group's ranks share KV heads.

    Raises:
        ValueError: when the head counts do not split over the mesh or the layout.
    """
    if config is not None:
        kv = module.num_kv_heads if isinstance(module, CPFlashAttention) else None
        config.validate_heads(module.num_heads, kv)
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    if tp == 1:
        return module
    if module.num_heads % tp:
        raise ValueError(f"num_heads={module.num_heads} must be divisible by the TP size {tp}")
    plan: dict[str, ParallelStyle] = {"o_proj": RowwiseParallel()}
    module.tp_group = (tp_mesh.get_group().group_name, tp)  # type: ignore[assignment]
    if isinstance(module, CPFlashAttention):
        plan["q_proj"] = ColwiseParallel()
        if module.sinks is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            module.sinks = nn.Parameter(distribute_tensor(module.sinks.data, tp_mesh, [Shard(0)]))
        if module.num_kv_heads % tp == 0:
            plan["k_proj"] = ColwiseParallel()
            plan["v_proj"] = ColwiseParallel()
        elif tp % module.num_kv_heads == 0:
            module.kv_replica_index = tp_mesh.get_local_rank() * module.num_kv_heads // tp
        else:
            raise ValueError(
                f"num_kv_heads={module.num_kv_heads} and TP size {tp}: one must divide the other"
            )
    elif isinstance(module, CPMLAAttention):
        plan["q_b_proj" if module.q_lora_rank is not None else "q_proj"] = ColwiseParallel()
        plan["kv_b_proj"] = ColwiseParallel(use_local_output=True)
    else:
        raise TypeError(f"expected CPFlashAttention or CPMLAAttention, got {type(module).__name__}")
    return parallelize_module(module, tp_mesh, plan)
