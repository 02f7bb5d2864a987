"""References from transformers itself, for tests that compare cp against HF."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def hf_greedy_tokens(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    device: torch.device | str = "cpu",
    **kwargs,
) -> list[list[int]]:
    """The new tokens of HF ``generate`` (greedy) for each prompt, run one prompt at a time."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)], device=device)
            full = model.generate(  # type: ignore[operator]
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                **kwargs,
            )
            out.append(full[0, len(p) :].tolist())
    return out
