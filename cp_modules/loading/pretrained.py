"""``load_pretrained``: a HF causal LM loaded straight into its cp layout, a shard per rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cp_modules.loading.checkpoint import CheckpointIndex
from cp_modules.loading.materialize import (
    global_shapes,
    materialize_from_checkpoint,
    meta_causal_lm,
)
from cp_modules.loading.sources import plan_sources

__all__ = ["load_pretrained", "load_sharded"]

# What the sharded path passes to ``AutoConfig.from_pretrained`` (and trust_remote_code to
# ``from_config``); anything else would be a from_pretrained option it does not apply.
_CONFIG_KWARGS = ("trust_remote_code", "revision", "local_files_only", "token", "cache_dir")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_pretrained(
    path: str | os.PathLike,
    parallel: Any = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **hf_kwargs: Any,
) -> nn.Module:
    """Load the causal LM saved at ``path`` into its context-parallel layout; return it swapped.

    The result is what ``swap_attention(AutoModelForCausalLM.from_pretrained(path), parallel)``
    returns (``model.cp_groups`` set when the layout spans several ranks), but no rank holds
    more than its own shard at any time: with ``tensor_parallel_size > 1`` the model is built on
    the meta device, sharded there (attention, MLPs, embeddings and LM head over TP after the
    model's TP plan, routed experts split over TP), and each rank then reads only the bytes of
    its shards from the safetensors files (one file or shards with an index) straight into
    tensors on ``device``. transformers' own conversion mapping names the checkpoint tensors
    (per-expert checkpoints fuse into the model's expert tensors). A rank's host memory grows by
    at most about ``checkpoint bytes / tp`` plus one read chunk. At ``tensor_parallel_size == 1``
    every rank holds the whole model and transformers loads it (``from_pretrained`` with
    ``device_map=device``, straight to the device).

    A GGUF checkpoint (``gguf_file=`` in ``hf_kwargs``) is quantized and cannot be sliced: it is
    loaded whole on every rank (transformers dequantizes it), then moved and sharded.

    Args:
        path: a directory written by ``save_pretrained`` (``config.json`` and safetensors).
        parallel: a :class:`~cp_modules.config.ParallelConfig` or
            :class:`~cp_modules.distributed.groups.CPGroups` (``None``: one process).
        dtype: parameter dtype (default: the config's ``dtype``, else the checkpoint's).
        device: where the shards go (default: the current CUDA device, else the CPU).
        hf_kwargs: passed to ``from_pretrained`` at ``tensor_parallel_size == 1``; with TP,
            only ``trust_remote_code``, ``revision``, ``local_files_only``, ``token`` and
            ``cache_dir`` are taken (others raise ``ValueError``).

    Raises:
        ValueError: before any rank allocates the model or joins a collective: a missing
            directory, no safetensors files, a checkpoint tensor missing or of another shape
            than the config gives (naming the file and tensor), head counts the layout cannot
            split, or routed experts the TP size does not divide.
    """
    from cp_modules.modules.hf_swap import _parallel_args

    config, groups = _parallel_args(parallel)
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"load_pretrained: checkpoint directory {str(root)!r} does not exist")
    device = torch.device(device) if device is not None else _default_device()
    gguf = hf_kwargs.get("gguf_file")
    if gguf is not None or config.tp == 1:
        return _load_whole(root, parallel, dtype=dtype, device=device, **hf_kwargs)
    return load_sharded(root, config, groups, dtype=dtype, device=device, **hf_kwargs)


def load_sharded(
    root: str | os.PathLike,
    config: Any,
    groups: Any,
    *,
    dtype: torch.dtype | None,
    device: torch.device,
    **hf_kwargs: Any,
) -> nn.Module:
    """The sharded path of :func:`load_pretrained` at any TP size (1 included: the whole model
    read by cp's reader instead of transformers'): meta build, checks, swap, shard reads."""
    from transformers import AutoConfig

    from cp_modules.modules.hf_swap import swap_attention

    unknown = sorted(set(hf_kwargs) - set(_CONFIG_KWARGS))
    if unknown:
        raise ValueError(
            f"load_pretrained with tensor_parallel_size={config.tp} builds the model from its "
            f"config and reads the shards itself: {unknown} are not taken (accepted: "
            f"{list(_CONFIG_KWARGS)})"
        )
    hf_config = AutoConfig.from_pretrained(str(root), **hf_kwargs)
    model_kwargs = {k: v for k, v in hf_kwargs.items() if k == "trust_remote_code"}
    index = CheckpointIndex(root)
    try:
        if dtype is None:
            dtype = _config_dtype(hf_config) or _checkpoint_dtype(index)
        _check_layout(hf_config, config)
        model = meta_causal_lm(hf_config, dtype=dtype, **model_kwargs)
        # Checked against the config before anything is sharded or allocated: every rank reads
        # the same headers, so every rank raises the same error, before any collective.
        sources = plan_sources(model, index, global_shapes(model))
        swap_attention(model, groups if groups is not None else config)
        materialize_from_checkpoint(model, index, device=device, sources=sources)
    finally:
        index.close()
    model.eval()
    return model


def _load_whole(root: Path, parallel: Any, *, dtype, device, **hf_kwargs) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from cp_modules.modules.hf_swap import swap_attention

    if hf_kwargs.get("gguf_file") is not None:
        model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, **hf_kwargs)
        model = model.to(device)
    else:
        CheckpointIndex(root).close()  # a clear error for a directory without safetensors
        model = AutoModelForCausalLM.from_pretrained(
            str(root), dtype=dtype, device_map=device, **hf_kwargs
        )
    return swap_attention(model, parallel)


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def _checkpoint_dtype(index: CheckpointIndex) -> torch.dtype:
    floats = [e.dtype for e in index.entries.values() if e.dtype.is_floating_point]
    return max(set(floats), key=floats.count) if floats else torch.float32


def _check_layout(hf_config: Any, config: Any) -> None:
    """Head counts and routed experts against the layout (the config alone, no collective)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(text, "num_attention_heads", None)
    if isinstance(heads, int):
        kv = getattr(text, "num_key_value_heads", None) or heads
        mla = getattr(text, "kv_lora_rank", None) is not None
        config.validate_heads(heads, None if mla else kv)
    experts = _num_routed_experts(text)
    if experts is not None and experts % config.tp:
        raise ValueError(
            f"{type(hf_config).__name__}: {experts} routed experts cannot be split over "
            f"tensor_parallel_size={config.tp}: use a TP size that divides {experts}"
        )


def _num_routed_experts(text_config: Any) -> int | None:
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        n = getattr(text_config, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None
