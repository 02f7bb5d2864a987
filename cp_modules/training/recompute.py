"""Activation checkpointing of context-parallel layers: the recompute runs under its own step.

``torch.utils.checkpoint`` runs the checkpointed function a second time during the backward,
when the step whose forward it repeats is no longer the scoped one (``cp_step`` has exited, or
another step is active). :func:`checkpoint_with_step` binds the function to the step that is
current when it is called, so the recompute attends with the same plan as the first forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint

from cp_modules.step import cp_step, current_step

__all__ = ["checkpoint_with_step"]


def checkpoint_with_step(
    fn: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any
) -> Any:
    """``torch.utils.checkpoint.checkpoint(fn, *args, ...)`` whose recompute re-enters the
    step of the first forward (reentrant or not).

    Raises:
        RuntimeError: outside of any :func:`~cp_modules.step.cp_step`.
    """
    meta = current_step()

    def run(*a: Any, **k: Any) -> Any:
        with cp_step(meta):
            return fn(*a, **k)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)
