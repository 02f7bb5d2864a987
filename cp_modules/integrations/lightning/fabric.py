"""Lightning Fabric strategy for context-parallel training (dp x pcp x tp).

strategy = CPFabricStrategy(ParallelConfig(tensor_parallel_size=2,
                                           prefill_context_parallel_size=2),
                            parallelize_fn=parallelize_model)
fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
fabric.launch()
model = fabric.setup_module(TinyLM(cfg))          # parallelize_fn (TP), then FSDP2
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
loader = fabric.setup_dataloaders(loader)         # sampler over the dp axis only
for batch in loader:
    batch = strategy.shard_batch(batch)           # DualChunkSwap share of this rank
    with cp_step(batch.meta):                     # the forward's plan (scoped)
        loss = lm_cross_entropy(model(batch.input_ids, batch.positions), batch)
    fabric.backward(loss)                         # FSDP2 sums gradients over dp x pcp
    optimizer.step()
    optimizer.zero_grad()
    global_loss = strategy.reduce_loss(loss)
fabric.save("ckpt", {"model": model, "optimizer": optimizer})  # a DCP directory
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from torch import nn
from torch.optim import Optimizer

from cp_modules.config import ParallelConfig
from cp_modules.integrations.lightning._common import (
    check_strategy_args,
    check_world,
    gather_state,
    no_parallelism,
    restore_state,
)
from cp_modules.training.checkpoint import (
    load_full_model_state_dict,
    read_checkpoint,
    write_checkpoint,
)
from cp_modules.training.context import CPBatch, CPTrainingContext, init_cp_training
from cp_modules.training.fsdp import apply_fsdp

__all__ = ["CPFabricStrategy"]


class CPFabricStrategy(ModelParallelStrategy):
    """Fabric strategy: CP meshes, DualChunkSwap batches, dp-only sampler, FSDP2 over dp x pcp.

    Builds the (dp, pp, pcp, tp) mesh and the DCP groups of ``parallel_config`` (through
    :func:`~cp_modules.training.init_cp_training`); ``setup_module`` applies
    ``parallelize_fn(model, mesh)`` (tensor parallelism) and then FSDP2 on the flattened
    ``dp_pcp`` axis (:func:`~cp_modules.training.apply_fsdp`), which sums the gradients over the
    dp x pcp ranks in the backward. Batches are sharded with :meth:`shard_batch` (run the
    forward under ``with cp_step(batch.meta):``; the backward uses the plan its forward saved).
    Checkpoints are Lightning's distributed checkpoints (``torch.distributed.checkpoint``, a
    directory; loads under any layout), or with ``save_distributed_checkpoint=False`` one
    safetensors file of full tensors (also loads under any layout).

    Args:
        parallel_config: the parallel degrees; the launched world must be its ``world_size``.
        parallelize_fn: module-level ``fn(model, mesh) -> model`` applied in ``setup_module``
            (e.g. :func:`cp_modules.models.parallelize_model` for TP); default: no change.
        start_method: ``"subprocess"`` (Lightning's default: the script is re-run per rank) or
            ``"spawn"`` (``fabric.launch(fn)`` spawns workers; ``fn`` must be module-level).
        process_group_backend: ``"gloo"``/``"nccl"``; default from the device.
        timeout: collective timeout.
        mixed_precision: an FSDP2 ``MixedPrecisionPolicy`` (e.g.
            ``cp_modules.training.mixed_precision_policy(torch.bfloat16, torch.float32)``);
            default: compute and reduce in the parameters' dtype.
        save_distributed_checkpoint: ``True``: ``save`` writes a DCP directory; ``False``: one
            safetensors file of full tensors. ``load`` reads either.

    Raises:
        ValueError: for a config that is not a ParallelConfig, pipeline stages, an unknown
            start method, or a device count that does not match the config.
    """

    def __init__(
        self,
        parallel_config: ParallelConfig,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None,
        *,
        start_method: str = "subprocess",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        mixed_precision: Any | None = None,
        save_distributed_checkpoint: bool = True,
    ) -> None:
        check_strategy_args(parallel_config, start_method)
        super().__init__(
            parallelize_fn=parallelize_fn or no_parallelism,
            data_parallel_size=parallel_config.dp * parallel_config.pcp,
            tensor_parallel_size=parallel_config.tp,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.parallel_config = parallel_config
        self._start_method = start_method
        self._mixed_precision = mixed_precision
        self._cp: CPTrainingContext | None = None

    @property
    def cp(self) -> CPTrainingContext:
        """This rank's groups, runtime and reductions (after the processes are set up)."""
        if self._cp is None:
            raise RuntimeError("the context-parallel groups exist only after fabric.launch()")
        return self._cp

    def _configure_launcher(self) -> None:
        check_world(self.parallel_config, self.num_processes, self.num_nodes)
        assert self.cluster_environment is not None
        if (
            self._start_method == "spawn"
            and not self.cluster_environment.creates_processes_externally
        ):
            self._launcher = _MultiProcessingLauncher(self, start_method="spawn")
        else:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        # Not the parent's: it builds a 2-D (data_parallel, tensor_parallel) mesh; the CP mesh
        # (dp, pp, pcp, tp) and its groups come from init_cp_training instead.
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        timeout_s = self._timeout.total_seconds() if self._timeout is not None else None
        self._cp = init_cp_training(self.parallel_config, self.root_device, timeout_s=timeout_s)
        self._device_mesh = self._cp.mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Sampler over dp only: every pcp x tp rank of a replica reads the same samples."""
        return {"num_replicas": self.cp.dp_size, "rank": self.cp.dp_rank}

    def setup_module(self, module: nn.Module) -> nn.Module:
        # The parent leaves placement to the user; the CP ops need every tensor on this rank's
        # device (meta-initialised modules are materialised there by the parent instead).
        if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            module = module.to(self.root_device)
        module = super().setup_module(module)
        return apply_fsdp(module, self.device_mesh, mp_policy=self._mixed_precision)

    def shard_batch(self, batch: Mapping[str, torch.Tensor]) -> CPBatch:
        """This rank's DualChunkSwap share of a replica batch; run the model's forward on it
        under ``with cp_step(batch.meta):``.

        See :meth:`cp_modules.training.CPTrainingContext.shard_batch` for the batch format.
        """
        return self.cp.shard_batch(batch)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Global mean loss from this rank's share (detached; for logging)."""
        return self.cp.reduce_loss(loss)

    def save_checkpoint(
        self,
        path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save the models, optimizers and plain values of ``state``; call on every rank.

        With ``save_distributed_checkpoint`` (the default) Lightning writes a distributed
        checkpoint directory (each rank its shards; plain values in ``meta.pt``); otherwise the
        full tensors are gathered and rank 0 writes one safetensors file.

        Raises:
            ValueError: for ``storage_options`` or ``filter`` (not supported), or a state value
                a checkpoint cannot hold safely.
        """
        if self._save_distributed_checkpoint:
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        if storage_options is not None or filter is not None:
            raise ValueError(
                f"{type(self).__name__}.save_checkpoint supports neither storage_options nor "
                f"filter, got storage_options={storage_options!r}, filter={filter!r}"
            )
        path = Path(self.broadcast(path))
        full = gather_state(state)
        if self.global_rank == 0:
            write_checkpoint(path, full)
        self.barrier()

    def load_checkpoint(
        self,
        path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint into ``state``, resharded for this run's layout.

        A directory is a distributed checkpoint (Lightning's loader, any saving layout). A file
        is a full-tensor checkpoint: every rank reads it (safetensors, or a tensors-only
        ``torch.save``; nothing else is unpickled). A bare module loads a flat model state dict.

        Raises:
            ValueError: for an empty ``state``, ``weights_only=False``, or an unsafe file.
        """
        if not state:
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs a state to restore, e.g. "
                f"state={{'model': model, 'optimizer': optimizer}}; got {state!r}"
            )
        path = Path(self.broadcast(path))
        if path.is_dir():
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if weights_only is False:
            raise ValueError(
                "weights_only=False is not supported: checkpoints hold tensors and plain values only"
            )
        checkpoint = read_checkpoint(path)
        if isinstance(state, nn.Module):
            load_full_model_state_dict(state, checkpoint, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                f"loading an optimizer alone is not supported by {type(self).__name__}: pass "
                "state={'model': model, 'optimizer': optimizer}"
            )
        return restore_state(checkpoint, state, strict)
