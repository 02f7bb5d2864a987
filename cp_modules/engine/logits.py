"""What a causal LM's forward does to its LM head's output (the engine samples from the same
logits), and the config of its language model."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__: list[str] = []


def _logits_postprocess(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the causal LM's forward does to ``lm_head``'s output, as a function.

    Read from the forward's ``logits = ...`` lines: Cohere's ``logit_scale``, Granite's
    ``logits_scaling`` and Gemma-2-style final soft-capping are known; any other line is
    refused, since sampling from logits the model would not give is silently wrong.
    """
    try:
        src = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        src = ""
    lines = [
        re.sub(r"\s*#.*$", "", ln.strip())
        for ln in src.splitlines()
        if re.match(r"\s*logits\s*=\s", ln)
    ]
    hf: Any = model  # a transformers causal LM: its config and scales are not typed here
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    # Gemma-style final soft-capping runs only when the config sets it (an `if` around it).
    final_softcap = getattr(_text_config(model), "final_logit_softcapping", None)
    for ln in lines[1:]:
        if "final_logit_softcapping" in ln or ln == "logits = torch.tanh(logits)":
            if final_softcap is None:
                continue
        if ln == "logits = logits * self.logit_scale":
            steps.append(lambda x: x * hf.logit_scale)
        elif ln == "logits = logits / self.config.logits_scaling":
            steps.append(lambda x: x / hf.config.logits_scaling)
        elif ln == "logits = logits / self.config.final_logit_softcapping":
            steps.append(lambda x: x / hf.config.final_logit_softcapping)
        elif ln == "logits = torch.tanh(logits)":
            steps.append(torch.tanh)
        elif ln == "logits = logits * self.config.final_logit_softcapping":
            steps.append(lambda x: x * hf.config.final_logit_softcapping)
        else:
            raise ValueError(
                f"{type(model).__name__}.forward post-processes its logits with {ln!r}, which "
                "the engine does not know: it would sample from logits the model does not give"
            )
    if lines and not lines[0].startswith("logits = self.lm_head("):
        raise ValueError(
            f"{type(model).__name__}.forward computes logits as {lines[0]!r}, not with lm_head"
        )

    def apply(x: torch.Tensor) -> torch.Tensor:
        for f in steps:
            x = f(x)
        return x

    return apply


def _text_config(model: nn.Module) -> Any:
    """The config of ``model``'s language model (itself for a causal LM)."""
    config: Any = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config
