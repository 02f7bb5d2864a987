"""A saved HF causal LM loaded for training, each rank reading only its own shard.

:func:`load_for_training` builds the model on the meta device (no memory), shards it there
(tensor parallelism by :func:`cp_modules.swap_attention`, then FSDP2 over the dp x pcp ranks by
:func:`~cp_modules.training.apply_fsdp`), and only then allocates every parameter's local shard
and reads exactly that box of the checkpoint into it
(:func:`cp_modules.loading.materialize_from_checkpoint`, positional reads of the safetensors
files, no memory map). A rank's host memory grows by about ``checkpoint bytes / (FSDP x TP
shards)`` plus one read chunk; no rank ever holds the whole model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["load_for_training"]


def load_for_training(
    path: str | os.PathLike,
    parallel: Any = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    fsdp: bool = True,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
    **hf_kwargs: Any,
) -> nn.Module:
    """Load the causal LM saved at ``path`` (``save_pretrained``'s layout) sharded for training.

    The result is the swapped transformers model (``model.cp_groups`` set), its TP shards
    DTensors on the ``tp`` axis and, with ``fsdp``, its blocks and root ``fully_shard`` over
    ``dp_pcp`` exactly as :func:`~cp_modules.training.apply_fsdp` shards them (gradients summed),
    in train mode. Every rank reads only the bytes of its own shards. The CP strategies of
    :mod:`cp_modules.integrations.lightning` take it as it is (their FSDP2 step sees it is
    applied). For example::

        ctx = init_cp_training(ParallelConfig(dp=2, tp=2), "cuda")
        model = load_for_training("/path/to/hf/model", ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    Args:
        path: a directory with ``config.json`` and safetensors (one file, or shards with
            ``model.safetensors.index.json``).
        parallel: a :class:`~cp_modules.training.CPTrainingContext`, its
            :class:`~cp_modules.distributed.groups.CPGroups`, or (one process) a
            :class:`~cp_modules.config.ParallelConfig` or ``None``.
        dtype: the parameters' dtype (default fp32, what the optimizer updates; compute in
            bf16 with ``mp_policy=mixed_precision_policy(torch.bfloat16, torch.float32)``).
        device: where the shards go (default: the current CUDA device, else the CPU).
        fsdp: apply FSDP2 (``False``: TP only; every dp x pcp rank holds its TP shard whole).
        mp_policy, reshard_after_forward: passed to :func:`~cp_modules.training.apply_fsdp`.
        hf_kwargs: for ``AutoConfig.from_pretrained``: ``trust_remote_code``, ``revision``,
            ``local_files_only``, ``token``, ``cache_dir``.

    Raises:
        ValueError: before any rank allocates the model or joins a collective (every rank
            reads the same headers, so all raise alike): a missing directory, no safetensors
            files, a checkpoint tensor missing or of another shape than the config gives
            (naming the file and tensor), head counts the layout cannot split, routed experts
            the TP size does not divide, or an unknown keyword.
    """
    from transformers import AutoConfig

    from cp_modules.loading import (
        CheckpointIndex,
        global_shapes,
        materialize_from_checkpoint,
        meta_causal_lm,
    )
    from cp_modules.loading.pretrained import _CONFIG_KWARGS, _check_layout
    from cp_modules.loading.sources import plan_sources
    from cp_modules.modules.hf_swap import _parallel_args, swap_attention
    from cp_modules.training.fsdp import apply_fsdp

    parallel = getattr(parallel, "groups", parallel)  # a CPTrainingContext
    config, groups = _parallel_args(parallel)
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"load_for_training: checkpoint directory {str(root)!r} does not exist")
    unknown = sorted(set(hf_kwargs) - set(_CONFIG_KWARGS))
    if unknown:
        raise ValueError(
            f"load_for_training builds the model from its config and reads the shards itself: "
            f"{unknown} are not taken (accepted: {list(_CONFIG_KWARGS)})"
        )
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    hf_config = AutoConfig.from_pretrained(str(root), **hf_kwargs)
    model_kwargs = {k: v for k, v in hf_kwargs.items() if k == "trust_remote_code"}
    with CheckpointIndex(root) as index:
        _check_layout(hf_config, config)
        model = meta_causal_lm(hf_config, dtype=dtype, **model_kwargs)
        # Every check against the checkpoint runs here, on the unsharded meta model, before
        # the swap and fully_shard (no collective yet): all ranks raise the same error.
        sources = plan_sources(model, index, global_shapes(model))
        model = swap_attention(model, groups if groups is not None else config)
        if groups is not None:
            model.cp_groups = groups
        if fsdp and groups is not None:
            apply_fsdp(
                model,
                groups.mesh,
                mp_policy=mp_policy,
                reshard_after_forward=reshard_after_forward,
            )
        # In place: FSDP2's sharded parameters stay the ones it registered.
        materialize_from_checkpoint(model, index, device=device, sources=sources)
    _tie_check(model)
    return model.train()


def _tie_check(model: nn.Module) -> None:
    """A tied LM head must still share the embedding's tensor after materialisation."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    hf: Any = model
    emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if emb is not None and head is not None and head.weight is not emb.weight:
        raise ValueError(
            f"{type(model).__name__}: the LM head is no longer tied to the embedding after "
            "sharding; load it with tie_word_embeddings=False or without FSDP2"
        )
