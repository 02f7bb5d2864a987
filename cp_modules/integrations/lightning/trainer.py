"""Lightning Trainer strategy for context-parallel training (dp x pcp x tp).

class LitLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = TinyLM(TinyLMConfig())

    def training_step(self, batch, batch_idx):          # batch: CPBatch (this rank's share)
        loss = lm_cross_entropy(self.model(batch.input_ids, batch.positions), batch)
        self.log("loss", self.trainer.strategy.reduce_loss(loss))
        return loss

strategy = CPTrainerStrategy(ParallelConfig(tensor_parallel_size=2,
                                            prefill_context_parallel_size=2),
                             parallelize_fn=parallelize_model)
L.Trainer(accelerator="cpu", devices=4, strategy=strategy).fit(LitLM(), loader)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer

from cp_modules.config import ParallelConfig
from cp_modules.integrations.lightning._common import (
    SafeCheckpointIO,
    check_strategy_args,
    check_world,
)
from cp_modules.step import cp_step
from cp_modules.training.checkpoint import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from cp_modules.training.context import CPBatch, CPTrainingContext, init_cp_training
from cp_modules.training.fsdp import apply_fsdp

__all__ = ["CPTrainerStrategy"]


class CPTrainerStrategy(ModelParallelStrategy):
    """Trainer strategy: CP meshes, DualChunkSwap batches, dp-only sampler, FSDP2 over dp x pcp.

    Builds the (dp, pp, pcp, tp) mesh and the DCP groups of ``parallel_config``, applies
    ``parallelize_fn(lightning_module, mesh)`` in ``setup`` (or leaves tensor parallelism to the
    module's ``configure_model``, where ``self.device_mesh`` is this mesh), then FSDP2 on the
    flattened ``dp_pcp`` axis (:func:`~cp_modules.training.apply_fsdp`: each child module of
    the LightningModule is a root), which sums the gradients over the dp x pcp ranks in the
    backward. Every batch becomes this rank's :class:`~cp_modules.training.CPBatch` on its way
    to the device, and the batch's step is scoped around ``training_step`` (backwards use their
    forwards' plans). Checkpoints are Lightning's distributed checkpoints (a DCP directory that
    loads under any layout), or with ``save_distributed_checkpoint=False`` one safetensors
    file of full tensors (also any layout).

    Args:
        parallel_config: the parallel degrees; ``devices * num_nodes`` must be its world size.
        parallelize_fn: module-level ``fn(module, mesh) -> module`` that shards the
            LightningModule in place (e.g. :func:`cp_modules.models.parallelize_model`).
        start_method: ``"subprocess"`` (Lightning's default: the script is re-run per rank) or
            ``"spawn"`` (workers spawned by ``fit``; the trained weights come back to the main
            process as full tensors).
        process_group_backend: ``"gloo"``/``"nccl"``; default from the device.
        timeout: collective timeout.
        mixed_precision: an FSDP2 ``MixedPrecisionPolicy`` (see
            :func:`cp_modules.training.mixed_precision_policy`); default: the parameters' dtype.
        save_distributed_checkpoint: ``True``: DCP directories; ``False``: full-tensor
            safetensors files. ``fit(ckpt_path=...)`` reads either.

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
            data_parallel_size=parallel_config.dp * parallel_config.pcp,
            tensor_parallel_size=parallel_config.tp,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.parallel_config = parallel_config
        self._parallelize_fn = parallelize_fn
        self._start_method = start_method
        self._mixed_precision = mixed_precision
        # Full-tensor files (and the spawn launcher's weights) go through safetensors.
        self.checkpoint_io = SafeCheckpointIO()
        self._cp: CPTrainingContext | None = None

    @property
    def cp(self) -> CPTrainingContext:
        """This rank's groups, runtime and reductions (after the processes are set up)."""
        if self._cp is None:
            raise RuntimeError("the context-parallel groups exist only once the Trainer runs")
        return self._cp

    def _configure_launcher(self) -> None:
        check_world(self.parallel_config, self.num_processes, self.num_nodes)
        assert self.cluster_environment is not None
        if (
            self._start_method == "spawn"
            and not self.cluster_environment.creates_processes_externally
        ):
            self._launcher = _FullWeightsSpawnLauncher(self)
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
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Sampler over dp only: every pcp x tp rank of a replica reads the same samples."""
        return {"num_replicas": self.cp.dp_size, "rank": self.cp.dp_rank}

    def setup(self, trainer: pl.Trainer) -> None:
        # The parent's setup, with parallelize_fn as an alternative to configure_model.
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if not any(t.is_meta for t in [*self.model.parameters(), *self.model.buffers()]):
            self.model.to(self.root_device)
        # Once per module: the Trainer sets up again for validate/test after fit.
        if self._parallelize_fn is not None and not getattr(self.model, "_cp_parallelized", False):
            module = self._parallelize_fn(self.model, self.device_mesh)
            if module is not self.model:
                raise ValueError(
                    "parallelize_fn must shard the LightningModule in place and return it, got "
                    f"{type(module).__name__}"
                )
            self.model._cp_parallelized = True  # type: ignore[assignment]
        apply_fsdp(self.model, self.device_mesh, mp_policy=self._mixed_precision)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        """Move the replica batch to the device and keep this rank's DualChunkSwap share (a CPBatch)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if isinstance(batch, CPBatch):
            return batch
        return self.cp.shard_batch(batch)

    @staticmethod
    def _step_of(args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
        # The step of the batch being run, scoped to its *_step call (batches may be planned
        # ahead by prefetching; each carries its own plan, and backwards use what their
        # forwards saved).
        batch = args[0] if args else kwargs.get("batch")
        return cp_step(batch.meta) if isinstance(batch, CPBatch) else contextlib.nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_of(args, kwargs):
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_of(args, kwargs):
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_of(args, kwargs):
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_of(args, kwargs):
            return super().predict_step(*args, **kwargs)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Global mean loss from this rank's share (detached; for ``self.log``)."""
        return self.cp.reduce_loss(loss)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state: sharded (DCP) or full tensors on rank 0 (others: empty). A collective."""
        assert self.model is not None
        if self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        return full_model_state_dict(self.model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name: sharded (DCP) or full on rank 0. A collective."""
        assert self.model is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        return full_optimizer_state_dict(self.model, optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        """A DCP directory (every rank writes its shards), or rank 0 writes one safetensors file."""
        if self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        path = Path(self.broadcast(filepath))
        if self.global_rank == 0:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimizers from a DCP directory or a full-tensor file, resharded.

        Raises:
            ValueError: for ``weights_only=False`` or a file that is not safe to read.
        """
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        assert self.model is not None and self.lightning_module is not None
        load_full_model_state_dict(
            self.model, checkpoint["state_dict"], strict=self.lightning_module.strict_loading
        )
        states = checkpoint.get("optimizer_states", [])
        if self.optimizers and len(states) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint holds {len(states)} optimizer states but the module configures "
                f"{len(self.optimizers)} optimizers"
            )
        for optimizer, state in zip(self.optimizers, states):
            load_full_optimizer_state_dict(self.model, optimizer, state)
        return checkpoint

    def teardown(self) -> None:
        super().teardown()


class _FullWeightsSpawnLauncher(_MultiProcessingLauncher):
    """Spawn launcher that returns the trained weights as full tensors in a safetensors file.

    Lightning's launcher pickles ``state_dict()`` from rank 0, which for a TP-sharded module
    holds DTensors that the main process cannot rebuild (and would need unpickling).
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        # Each spawned worker destroys its process group before it exits: left to the
        # interpreter's shutdown, gloo's worker threads are torn down in an arbitrary order and
        # a rank could abort (std::terminate) after a finished fit.
        try:
            super()._wrapping_function(*args, **kwargs)
        finally:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None)
        fitting = trainer.state.fn == TrainerFn.FITTING
        # A collective (TP shards are gathered): every rank takes part.
        state_dict = full_model_state_dict(trainer.lightning_module) if fitting else None
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if fitting:
            weights_path = os.path.join(tempfile.mkdtemp(), "weights.safetensors")
            assert state_dict is not None
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)

    def _recover_results_in_main_process(
        self, worker_output: _WorkerOutput, trainer: pl.Trainer
    ) -> None:
        if worker_output.weights_path is not None:
            state_dict = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            self._strategy.checkpoint_io.remove_checkpoint(Path(worker_output.weights_path).parent)
            # Full tensors into the main process's unsharded module.
            trainer.lightning_module.load_state_dict(state_dict, strict=False)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)
