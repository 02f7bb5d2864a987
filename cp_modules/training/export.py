"""Export of trained weights in the layout ``transformers`` loads (``save_pretrained``'s).

A directory with ``config.json`` and one ``model.safetensors`` of full tensors, so
``AutoModelForCausalLM.from_pretrained(directory)`` loads it on one process, without
cp_modules, whatever (dp, pcp, tp) layout and FSDP2 sharding the model was trained under.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from cp_modules.training.checkpoint import full_model_state_dict

__all__ = ["export_hf"]

HF_WEIGHTS_NAME = "model.safetensors"


def export_hf(
    model: nn.Module,
    directory: str | os.PathLike,
    config: Any | None = None,
    *,
    rename: Callable[[str], str] | None = None,
) -> None:
    """Write ``model``'s full weights and ``config`` to ``directory`` as transformers saves them.

    A collective: call on every rank (TP and FSDP2 shards are gathered); rank 0 writes
    ``config.json`` and ``model.safetensors``, then every rank waits for it.

    Args:
        model: a transformers causal LM (e.g. swapped with :func:`cp_modules.swap_attention`,
            its names are already transformers'), sharded or not.
        directory: created if missing.
        config: a transformers ``PretrainedConfig``; default ``model.config``. Its attention
            implementation is not written, so the export loads with transformers' own.
        rename: maps each state-dict name to the transformers name, for models whose names
            differ (e.g. ``lambda n: n if n.startswith("lm_head") else "model." + n`` for a
            :class:`~cp_modules.models.TinyLM`, whose names are Llama's without ``model.``).

    Raises:
        ValueError: when no config is given and ``model`` has none.
    """
    if config is None:
        config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(
            f"export_hf needs a transformers config (PretrainedConfig): {type(model).__name__} "
            "has no .config; pass config=..."
        )
    state = full_model_state_dict(model)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        from safetensors.torch import save_file

        tensors = {
            (rename(k) if rename is not None else k): v.detach().to("cpu").contiguous().clone()
            for k, v in state.items()
        }
        if getattr(config, "tie_word_embeddings", False):
            # transformers ties the head to the embedding on load; the file holds it once.
            tensors.pop("lm_head.weight", None)
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(path))
        tmp = path / (HF_WEIGHTS_NAME + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / HF_WEIGHTS_NAME)
    if distributed:
        dist.barrier()
