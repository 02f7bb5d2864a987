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
        config: a transformers ``PretrainedConfig``; default ``model.config``, or for a GQA
            :class:`~cp_modules.models.TinyLM` the equivalent ``LlamaConfig`` (same names
            under ``model.``, same rope and norms: it loads as ``LlamaForCausalLM``). Its
            attention implementation is not written, so the export loads with transformers'
            own.
        rename: maps each state-dict name to the transformers name, for models whose names
            differ.

    Raises:
        ValueError: when no config is given and ``model`` has none (an MLA TinyLM has no
            transformers twin here: pass ``config`` and ``rename``).
    """
    if config is None and rename is None:
        config, rename = _tiny_lm_as_llama(model)
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


def _tiny_lm_as_llama(model: nn.Module) -> tuple[Any | None, Callable[[str], str] | None]:
    """The ``LlamaConfig`` and name map of a GQA TinyLM (``(None, None)`` for other models)."""
    from cp_modules.models import TinyLM

    if not isinstance(model, TinyLM) or model.config.attention != "gqa":
        return None, None
    c = model.config
    if c.qkv_bias:
        raise ValueError(
            "a TinyLM with qkv_bias=True (biases on q/k/v, none on o_proj) is not a Llama "
            "(attention_bias puts one on o_proj too): pass config= and rename= for its target"
        )
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim or c.hidden_size // c.num_heads,
        attention_bias=False,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False,
    )
    return config, lambda name: name if name.startswith("lm_head.") else "model." + name
