"""What a swapped HF model's forward checks and binds under a cp step (hooks installed by
:func:`~cp_modules.modules.hf_swap.swap_attention`): the step's positions, no media inputs, no
HF loss, and HF's gradient checkpointing bound to the step of the forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cp_modules.modules.hf_attention import MEDIA_KWARGS
from cp_modules.step import active_step, cp_step

__all__ = ["install_forward_checks"]


def install_forward_checks(model: nn.Module) -> None:
    """Hooks on ``model`` (once). Under a cp step, its base model's forward:
    - refuses a call without the step's positions: HF would number the local tokens 0..T-1
      itself, wrong rope for a rank's head and tail chunks and wrong absolute positions
      (GPT-2, OPT) for every request after the first, without an error;
    - refuses image, video and audio inputs (text-only forwards of multimodal models);
    - binds HF's gradient checkpointing to the step, so its replay in the backward attends
      with the step of the forward.
    The causal LM's forward refuses HF's own loss (``labels=``)."""
    base = getattr(model, "base_model", model)
    if getattr(base, "_cp_positions_hook", None) is not None:
        return
    name = type(model).__name__
    checkpointed = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]

    def hook(module, args, kwargs):
        meta = active_step()
        if meta is None:
            return None
        if module.training and not torch.compiler.is_compiling():  # HF checkpoints in training
            _bind_checkpointing_to_steps(checkpointed)
        if len(args) > 2:  # positions given positionally
            return None
        media = sorted(k for k, v in kwargs.items() if v is not None and k.startswith(MEDIA_KWARGS))
        if media:
            raise ValueError(
                f"{name}: {media} under a cp step: cp serves the language model of a multimodal "
                "model for text-only inputs (images, video and audio are not split over ranks)"
            )
        pos = kwargs.get("position_ids")
        if pos is None:
            raise ValueError(
                f"{name}: called under a cp step without position_ids, so the model would number "
                "this rank's tokens 0..T-1 itself; pass position_ids=meta.positions[None] (and "
                "input_ids=ids[meta.token_indices][None])"
            )
        want = meta.positions
        if pos.numel() != want.numel():
            raise ValueError(
                f"{name}: position_ids has {pos.numel()} entries but the step has "
                f"{want.numel()} local tokens on this rank; pass position_ids=meta.positions[None]"
            )
        # Values are compared where that costs no host sync (CPU tensors, outside compile).
        if (
            pos.device.type == "cpu"
            and want.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and not torch.equal(pos.reshape(-1).to(want.dtype), want)
        ):
            raise ValueError(
                f"{name}: position_ids are not the step's positions (meta.positions): under "
                "context parallelism a rank holds chunks of each request, numbered by the step"
            )
        return None

    base._cp_positions_hook = base.register_forward_pre_hook(hook, with_kwargs=True)
    if model is not base:
        top: Any = model
        top._cp_labels_hook = model.register_forward_pre_hook(_refuse_hf_loss, with_kwargs=True)


def _bind_checkpointing_to_steps(modules: list[Any]) -> None:
    """HF's gradient checkpointing (``model.gradient_checkpointing_enable()``) replays a layer
    in the backward, when the step of its forward is no longer active: the replay of a layer
    checkpointed under a cp step re-enters that step (what ``checkpoint_with_step`` does)."""
    for m in modules:
        func = m.__dict__.get("_gradient_checkpointing_func")
        if func is not None and not getattr(func, "cp_step_bound", False):
            m._gradient_checkpointing_func = _step_bound(func)


def _step_bound(func: Any) -> Any:
    """``func`` (HF's checkpoint function) with its replay run under the step that was active
    when the layer ran first."""

    def checkpointed(function, *args, **kwargs):
        meta = active_step()
        if meta is None:
            return func(function, *args, **kwargs)

        def replay(*a, **k):
            with cp_step(meta):
                return function(*a, **k)

        return func(replay, *args, **kwargs)

    checkpointed.cp_step_bound = True  # type: ignore[attr-defined]
    return checkpointed


def _refuse_hf_loss(module, args, kwargs):
    """HF's loss shifts ``labels`` by one within the row it is given. Under a cp step that row
    is this rank's tokens in the step's order (a PCP rank holds a head and a tail chunk of
    each request; requests follow each other), so the shift pairs tokens with the wrong
    targets, and the mean is over this rank's tokens only."""
    given = [k for k in ("labels", "shift_labels") if kwargs.get(k) is not None]
    if given and active_step() is not None:
        raise ValueError(
            f"{type(module).__name__}: {given[0]}= under a cp step: HF's loss would shift the "
            "targets within this rank's tokens, which are chunks of the step's requests. Take "
            "the logits and use cp_modules.training.lm_cross_entropy(logits.squeeze(0), batch) "
            "(the targets of a CPBatch, averaged over the global batch)"
        )
    return None
