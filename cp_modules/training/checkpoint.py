"""Checkpoints that hold full (unsharded) tensors and never unpickle arbitrary objects.

A checkpoint is one safetensors file: every tensor of a (nested) state is stored under its key
path, and the rest of the structure (dicts, lists, tuples, numbers, strings) is stored as JSON in
the file's metadata. Tensors are saved whole, so a checkpoint written under one layout (say
tp=2, pcp=2) loads under any other (tp=1, pcp=4, or one process): loading re-shards them for
the model it is given.

Reading also accepts a file written by ``torch.save`` when it holds only tensors and plain
containers: it is opened with ``torch.load(weights_only=True)``, which refuses any other object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CheckpointFormatError",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "read_checkpoint",
    "write_checkpoint",
]

_FORMAT_KEY = "cp_modules.checkpoint"
_FORMAT_VERSION = "1"


class CheckpointFormatError(ValueError):
    """A file is not a checkpoint this module can read safely, or a state cannot be stored."""


# ---- encoding of a nested state: tensors apart, the skeleton as JSON -------------------------


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            raise CheckpointFormatError(
                f"state entry {path!r} is a sharded DTensor: gather it first (full_model_state_dict "
                "/ full_optimizer_state_dict) so the checkpoint holds full tensors"
            )
        key = f"t{len(tensors)}"
        # Own contiguous CPU copy: safetensors refuses tensors that share storage (tied weights).
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{path}.{k}" if path else k, tensors) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise CheckpointFormatError(
                    f"state entry {path!r} has a key of type {type(k).__name__}; valid key types: "
                    "str, int, float, bool, None"
                )
            items.append([k, _encode(v, f"{path}[{k!r}]", tensors)])
        return {"__items__": items}
    raise CheckpointFormatError(
        f"state entry {path or '<root>'!r} is a {type(obj).__name__}, which a checkpoint cannot "
        "hold safely; valid values: tensors, numbers, strings, None, and dicts / lists / tuples "
        "of those"
    )


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__items__"}:
            return {k: _decode(v, tensors) for k, v in obj["__items__"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def write_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write ``state`` (full tensors and plain values, nested) to one safetensors file.

    Written to a temporary name first and renamed, so a crash never leaves a half file under
    ``path``. Call on one rank.

    Raises:
        CheckpointFormatError: (a ValueError) naming the first entry that is neither a full
            tensor nor a plain value.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(dict(state), "", tensors)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        tensors,
        str(tmp),
        metadata={_FORMAT_KEY: _FORMAT_VERSION, "state": json.dumps(skeleton)},
    )
    os.replace(tmp, path)


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """Read a checkpoint written by :func:`write_checkpoint` (or a tensors-only ``torch.save``).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        CheckpointFormatError: (a ValueError) if the file is neither; in particular a pickle
            holding any object other than tensors and plain containers is refused unopened.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt", device=str(map_location)) as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open API
    except SafetensorError:
        return _read_weights_only_pickle(path, map_location)
    if meta.get(_FORMAT_KEY) != _FORMAT_VERSION or "state" not in meta:
        # A plain safetensors file (e.g. a HuggingFace model.safetensors): a flat state dict.
        return dict(tensors)
    return _decode(json.loads(meta["state"]), tensors)


def _read_weights_only_pickle(path: Path, map_location) -> dict:
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means "not a safe checkpoint"
        raise CheckpointFormatError(
            f"{str(path)!r} is neither a safetensors checkpoint nor a torch.save file of tensors "
            f"and plain containers; refusing to unpickle arbitrary objects ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointFormatError(
            f"{str(path)!r} holds a {type(state).__name__}, expected a dict of state"
        )
    return state


# ---- full (unsharded) state of models and optimizers --------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded CPU tensors of ``model``'s state (TP shards gathered) on rank 0.

    A collective: call it on every rank; ranks other than 0 receive an empty dict (so no rank
    but the writer holds a second copy of the model).
    """
    if not _distributed():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return cast(dict[str, torch.Tensor], state)  # full, CPU-offloaded: tensors only


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full optimizer state keyed by parameter name (``{"state": ..., "param_groups": ...}``).

    Keyed by name rather than by position, so it loads into the same model under any layout.
    A collective: call it on every rank; ranks other than 0 receive an empty dict.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not _distributed():
        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True)
        )
    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_full_model_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Load full tensors into ``model``, sharding them as its parameters are (any layout).

    Raises:
        KeyError / RuntimeError: from ``load_state_dict`` when ``strict`` and keys or shapes
            differ.
    """
    if not _distributed():
        model.load_state_dict(dict(state_dict), strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(
        model, dict(state_dict), options=StateDictOptions(full_state_dict=True, strict=strict)
    )


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Load a :func:`full_optimizer_state_dict` into ``optimizer`` of ``model`` (any layout)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model,
        optimizer,
        optim_state_dict=dict(state),
        options=StateDictOptions(full_state_dict=True),
    )
