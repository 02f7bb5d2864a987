"""Materialize a model built on the meta device with only this rank's shard of each tensor.

:func:`meta_causal_lm` builds a transformers causal LM whose parameters are on the meta device
(no memory) and whose buffers are real (rotary frequencies and the like, computed from the
config). Sharding (TP ``parallelize_module``, the expert split, FSDP2's ``fully_shard``) then
runs on the meta model, and :func:`materialize_from_checkpoint` allocates each parameter's local
shard on the target device and reads exactly that box of the checkpoint into it, in place (so
FSDP2's sharded parameters stay the ones it registered).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cp_modules.loading.checkpoint import CheckpointIndex
from cp_modules.loading.sources import Source, plan_sources

__all__ = [
    "global_shapes",
    "local_box",
    "materialize_from_checkpoint",
    "meta_causal_lm",
]


def meta_causal_lm(hf_config: Any, *, dtype: torch.dtype | None = None, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(hf_config)`` with its parameters on the meta device.

    Buffers are built for real on the CPU (they are small and computed from the config, e.g.
    rotary ``inv_freq``); parameters take no memory until :func:`materialize_from_checkpoint`.
    """
    from accelerate import init_empty_weights  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **kwargs)
    return model


def local_box(
    model: nn.Module, name: str, t: torch.Tensor
) -> tuple[tuple[slice, ...], torch.Tensor]:
    """The box of the global tensor that ``t`` (parameter ``name`` of ``model``) holds on this
    rank, and the local tensor to write it into."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        assert tuple(local.shape) == tuple(shape), (name, tuple(local.shape), shape)
        return tuple(slice(o, o + s) for o, s in zip(offset, shape)), local
    return tuple(slice(0, s) for s in t.shape), t


def global_shapes(model: nn.Module, names: list[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter's (and persistent buffer's) global shape, by name (DTensors whole)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters():
        out[name] = tuple(p.shape)
    for name in _persistent_buffers(model):
        out[name] = tuple(model.get_buffer(name).shape)
    if names is not None:
        out = {n: out[n] for n in names}
    return out


def _persistent_buffers(model: nn.Module) -> list[str]:
    out = []
    for mod_name, mod in model.named_modules():
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for b in mod._buffers:
            if mod._buffers[b] is not None and b not in skip:
                out.append(f"{mod_name}.{b}" if mod_name else b)
    return out


def materialize_from_checkpoint(
    model: nn.Module,
    index: CheckpointIndex,
    *,
    device: torch.device | str,
    sources: dict[str, Source] | None = None,
) -> nn.Module:
    """Allocate ``model``'s meta parameters on ``device`` and fill each with its local shard.

    Buffers keep their values (moved to ``device``); persistent buffers the checkpoint holds are
    read from it. Each parameter reads only the box of the checkpoint it holds: a DTensor's local
    shard (any placements), a split expert tensor's experts, or the whole tensor.

    Args:
        sources: from :func:`~cp_modules.loading.sources.plan_sources`, when the caller checked
            the checkpoint before sharding; planned here otherwise.

    Raises:
        ValueError: see :func:`~cp_modules.loading.sources.plan_sources`.
    """
    if sources is None:
        sources = plan_sources(model, index, global_shapes(model))
    buffers = {n: b for n, b in model.named_buffers() if not b.is_meta}
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta and n not in sources]
    if meta_buffers:
        raise ValueError(f"buffers on the meta device with no checkpoint tensor: {meta_buffers}")
    model.to_empty(device=device)
    for name, value in buffers.items():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        mod._buffers[leaf] = value.to(device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, source in sources.items():
            t = params[name] if name in params else model.get_buffer(name)
            box, local = local_box(model, name, t)
            source.read(index, box, local)
    return model
