"""What the Fabric and Trainer strategies share: argument checks, safe checkpoint IO, state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from torch import nn
from torch.optim import Optimizer

from cp_modules.config import ParallelConfig
from cp_modules.training.checkpoint import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    read_checkpoint,
    write_checkpoint,
)

START_METHODS = ("subprocess", "spawn")


def no_parallelism(model: nn.Module, mesh) -> nn.Module:
    """``parallelize_fn`` that leaves the model as it is (PCP and DP need no model changes)."""
    return model


def check_strategy_args(parallel_config: Any, start_method: str) -> None:
    """Refuse a wrong config type, pipeline stages, or an unknown launcher, before any process starts."""
    if not isinstance(parallel_config, ParallelConfig):
        raise ValueError(
            f"parallel_config must be a cp_modules.ParallelConfig, got {type(parallel_config).__name__}"
        )
    if parallel_config.pp != 1:
        raise ValueError(
            f"pipeline_parallel_size={parallel_config.pp} is not supported for training; valid: 1"
        )
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {list(START_METHODS)}, got {start_method!r}")


def check_world(parallel_config: ParallelConfig, num_processes: int, num_nodes: int) -> None:
    """The launched world (devices x nodes) must be the configuration's dp * pcp * tp ranks."""
    world = num_processes * num_nodes
    if world != parallel_config.world_size:
        c = parallel_config
        raise ValueError(
            f"devices={num_processes} x num_nodes={num_nodes} = {world} processes, but the "
            f"parallel config needs dp*pp*pcp*tp = {c.dp}*{c.pp}*{c.pcp}*{c.tp} = {c.world_size}; "
            f"set devices={c.world_size // max(num_nodes, 1)} or change the config"
        )


def _owner(optimizer: Optimizer, modules: list[nn.Module]) -> nn.Module:
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for m in modules:
        if params <= {id(p) for p in m.parameters()}:
            return m
    raise ValueError(
        "the checkpoint state holds an optimizer whose parameters belong to none of its models; "
        "pass the model together with its optimizer, e.g. state={'model': model, 'optimizer': opt}"
    )


def gather_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Replace modules and optimizers in ``state`` by their full (unsharded) state dicts.

    A collective (TP shards are gathered): call on every rank. Objects with ``state_dict`` and
    ``load_state_dict`` contribute their state dict; other values pass through.
    """
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    out: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            out[key] = full_model_state_dict(obj)
        elif isinstance(obj, Optimizer):
            out[key] = full_optimizer_state_dict(_owner(obj, modules), obj)
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            out[key] = obj.state_dict()
        else:
            out[key] = obj
    return out


def restore_state(
    checkpoint: dict[str, Any], state: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """Load ``checkpoint`` entries into the objects of ``state`` (re-sharding full tensors).

    Plain values in ``state`` are replaced by the checkpoint's. Returns the entries of the
    checkpoint that ``state`` did not ask for.

    Raises:
        KeyError: when ``strict`` and ``state`` asks for keys the checkpoint lacks.
    """
    missing = [k for k in state if k not in checkpoint]
    if missing and strict:
        raise KeyError(
            f"the checkpoint has no entries {missing}; it holds {sorted(checkpoint)}. Pass "
            "strict=False to load the entries it has."
        )
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    # Models first: an optimizer's state is keyed by its model's parameter names.
    order = sorted(
        (k for k in state if k in checkpoint), key=lambda k: not isinstance(state[k], nn.Module)
    )
    for key in order:
        obj, value = state[key], checkpoint.pop(key)
        if isinstance(obj, nn.Module):
            load_full_model_state_dict(obj, value, strict=strict)
        elif isinstance(obj, Optimizer):
            load_full_optimizer_state_dict(_owner(obj, modules), obj, value)
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return checkpoint


class SafeCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO writing safetensors files of full tensors (see ``cp_modules.training.checkpoint``)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise ValueError(
                f"storage_options are not supported by {type(self).__name__}, got {storage_options!r}"
            )
        write_checkpoint(path, checkpoint)

    def load_checkpoint(
        self, path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                "weights_only=False is not supported: checkpoints are read without unpickling "
                "arbitrary objects"
            )
        return read_checkpoint(path, map_location if isinstance(map_location, str) else "cpu")

    def remove_checkpoint(self, path) -> None:
        from lightning.fabric.utilities.cloud_io import get_filesystem

        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
