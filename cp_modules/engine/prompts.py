"""The prompts a generation takes: lists (or 1-D integer tensors / arrays) of token ids.

A malformed prompt (a string, float ids, a nested list, ids outside the vocabulary) raises a
``ValueError`` naming it (``prompts[i]``, or ``prompts[i][j]`` for one id) and what is valid,
instead of being truncated or failing somewhere inside the step.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

__all__ = ["check_prompts"]


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """``prompts`` as lists of ints in ``[0, vocab_size)``, or a ``ValueError`` naming the first
    malformed one."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(
            f"prompts must be a list of prompts, each a list of token ids in "
            f"[0, {vocab_size}), got {type(prompts).__name__}"
        )
    if not len(prompts):
        raise ValueError("prompts must hold at least one prompt")
    return [_prompt_ids(i, p, vocab_size) for i, p in enumerate(prompts)]


def _prompt_ids(i: int, p: object, vocab_size: int) -> list[int]:
    valid = f"a prompt is a list (or 1-D integer tensor) of token ids in [0, {vocab_size})"
    if isinstance(p, (str, bytes)):
        raise ValueError(f"prompts[{i}] is a string ({p[:40]!r}): tokenize it first; {valid}")
    if isinstance(p, torch.Tensor):
        if p.dim() != 1 or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
            raise ValueError(f"prompts[{i}] is a {p.dim()}-D {p.dtype} tensor; {valid}")
        ids: list[object] = p.tolist()
    elif isinstance(p, Sequence):
        ids = list(p)
    elif getattr(p, "ndim", None) == 1 and hasattr(p, "tolist"):  # a NumPy array
        ids = list(p.tolist())
    else:
        raise ValueError(f"prompts[{i}] is {type(p).__name__} {p!r:.40}; {valid}")
    if not ids:
        raise ValueError(f"prompts[{i}] is empty: every prompt needs >= 1 token")
    out: list[int] = []
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(
                f"prompts[{i}][{j}] is {type(t).__name__} {t!r:.40}, not a token id; {valid}"
            )
        tid = int(t)
        if not 0 <= tid < vocab_size:
            raise ValueError(
                f"prompts[{i}] holds ids outside [0, vocab_size={vocab_size}) "
                f"(prompts[{i}][{j}] = {tid}); {valid}"
            )
        out.append(tid)
    return out
