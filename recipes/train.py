"""Train a decoder-only LM with context parallelism (PCP) and tensor parallelism (TP).

    .venv/bin/python recipes/train.py                                   # Llama-like, tp=2 pcp=2, Fabric
    .venv/bin/python recipes/train.py model=hf                          # a transformers Llama
    .venv/bin/python recipes/train.py model=hf model.checkpoint=/path/to/hf/model parallel=pcp4
    .venv/bin/python recipes/train.py model=deepseek_v3_tiny workload.strategy=trainer
    .venv/bin/python recipes/train.py -m model=llama_tiny,deepseek_v3_tiny  # one of each family
    .venv/bin/python recipes/train.py parallel=pcp4 workload.resume=ckpt.safetensors
    torchrun --nproc-per-node 4 recipes/train.py backend=cuda

Build: the composed config (``conf/train.yaml``), a byte-level dataset cut from the bundled
text (``recipes/data/tiny_corpus.txt``) and a :class:`~cp_modules.models.TinyLM` of the model's
family (``deepseek_v3`` -> MLA attention, the others -> GQA), or with ``model.hf`` the
transformers model of the family made context-parallel by :func:`cp_modules.swap_attention`,
built from the config's sizes, or loaded from a local ``model.checkpoint`` directory by
:func:`cp_modules.training.load_for_training` (each rank reads only its TP x FSDP2 shard).
Run: Lightning Fabric or the Lightning Trainer with the CP strategy: every batch is split over
PCP with DualChunkSwap, heads over TP, samples over dp. Report: the loss every ``log_every`` steps and the global tokens/s,
then a summary line; ``workload.save`` writes a checkpoint that ``workload.resume`` loads under
any layout: one safetensors file of full tensors for a path ending in ``.safetensors``, else a
distributed checkpoint directory (``torch.distributed.checkpoint``). Gradients are summed over
dp x pcp by FSDP2.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig
from recipe_configs import (
    BackendConf,
    Device,
    Family,
    ModelConf,
    load_config,
)
from torch.utils.data import DataLoader

from cp_modules.config import ParallelConfig
from cp_modules.integrations.lightning import CPFabricStrategy, CPTrainerStrategy
from cp_modules.models import TinyLM, TinyLMConfig, parallelize_model
from cp_modules.step import cp_step
from cp_modules.training import ByteTextDataset, lm_cross_entropy

DEFAULT_CORPUS = Path(__file__).parent / "data" / "tiny_corpus.txt"


class Strategy(Enum):
    fabric = "fabric"
    trainer = "trainer"


@dataclass
class TrainWorkload:
    """What ``recipes/train.py`` runs (``conf/workload/train``).

    ``steps``: optimizer steps in total (a resumed run continues from the checkpoint's step).
    ``batch_size``: sequences per data-parallel replica, each ``seq_len`` bytes.
    ``corpus``: a text file (default: the bundled one). ``save`` / ``resume``: checkpoint paths
    (``*.safetensors``: one full-tensor file; otherwise a distributed checkpoint directory).
    """

    strategy: Strategy = Strategy.fabric
    steps: int = 30
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    log_every: int = 5
    corpus: str | None = None
    save: str | None = None
    resume: str | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"workload.lr must be > 0, got {self.lr}")


@dataclass
class TrainConf:
    """Schema of ``conf/train.yaml``."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConf = field(default_factory=ModelConf)
    backend: BackendConf = field(default_factory=BackendConf)
    workload: TrainWorkload = field(default_factory=TrainWorkload)


def register_train_config() -> None:
    """Store :class:`TrainConf` in Hydra's ConfigStore as ``train_schema`` (first in the
    defaults of ``conf/train.yaml``), so overrides are type-checked when Hydra composes."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConf)


def load_train_config(cfg: DictConfig) -> TrainConf:
    """The composed config as a validated :class:`TrainConf`.

    Raises:
        ValueError: for unknown keys, wrong types or enum values, or out-of-range values.
    """
    conf = load_config(cfg, TrainConf)
    if conf.model.vocab_size < 256:
        raise ValueError(
            f"model.vocab_size={conf.model.vocab_size} is too small for byte-level tokens; need >= 256"
        )
    return conf


def tiny_lm_config(model: ModelConf) -> TinyLMConfig:
    """The TinyLM of a model family: DeepSeek -> MLA attention, Llama/Qwen2/Mistral -> GQA."""
    family = model.family if isinstance(model.family, Family) else Family(model.family)
    return TinyLMConfig(
        attention="mla" if family is Family.deepseek_v3 else "gqa",
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        qkv_bias=family is Family.qwen2,
        rope_theta=model.rope_theta,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
    )


def _device_and_backend(backend: BackendConf) -> tuple[str, str]:
    device = backend.device.value if isinstance(backend.device, Device) else str(backend.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("backend.device=cuda but CUDA is not available; use backend=cpu")
    dist_backend = backend.dist_backend
    if dist_backend == "auto":
        dist_backend = "nccl" if device == "cuda" else "gloo"
    return device, dist_backend


class HFTokensLM(torch.nn.Module):
    """A transformers causal LM on one row of this rank's tokens: ``forward(input_ids [T],
    positions [T]) -> logits [T, V]`` (the TinyLM interface), run under the batch's cp_step."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.hf = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # squeeze(0), not [0]: indexing's backward zero-fills a [1, T, V] gradient and copies
        # the logits' gradient into it (two passes over the largest tensor of the step).
        return self.hf(input_ids=input_ids[None], position_ids=positions[None]).logits.squeeze(0)


def _build_model(conf: TrainConf, groups=None, device=None) -> torch.nn.Module:
    """TinyLM, or with ``model.hf`` the swapped transformers model (``groups``: the rank's
    CPGroups, whose TP mesh shards it). A ``model.checkpoint`` directory of safetensors is
    loaded with :func:`cp_modules.training.load_for_training`: built on the meta device, sharded
    by TP and FSDP2 there, then each rank reads only its own shard onto ``device``."""
    if not conf.model.hf:
        torch.manual_seed(conf.model.seed)
        return TinyLM(tiny_lm_config(conf.model))
    from recipe_models import DTYPES, build_model

    from cp_modules import swap_attention

    if conf.model.checkpoint and not conf.model.gguf_file:
        from cp_modules.training import load_for_training

        if conf.model.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {conf.model.dtype!r}")
        model = load_for_training(
            conf.model.checkpoint,
            groups,
            dtype=DTYPES[conf.model.dtype],
            device=device,
            local_files_only=True,
        )
        return HFTokensLM(model)
    model = build_model(conf.model).train()
    return HFTokensLM(swap_attention(model, groups))


def _parallelize_fn(conf: TrainConf):
    # swap_attention applies TP to a transformers model itself.
    return None if conf.model.hf else parallelize_model


def _loader(conf: TrainConf) -> DataLoader:
    w = conf.workload
    dataset = ByteTextDataset(w.corpus or DEFAULT_CORPUS, w.seq_len)
    # The strategy swaps the sampler for a DistributedSampler over dp, shuffled with the global
    # seed (seed_everything), so all ranks of a replica draw the same samples. Full batches
    # only: every replica plans the same step shape.
    return DataLoader(dataset, batch_size=w.batch_size, shuffle=True, drop_last=True)


class _Meter:
    """Loss and global tokens/s per step (the first step, which warms up, is not timed)."""

    def __init__(self, log_every: int, total_steps: int, rank0: bool):
        self.log_every, self.total, self.rank0 = log_every, total_steps, rank0
        self.losses: list[float] = []
        self.tokens = 0
        self.seconds = 0.0

    def update(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        self.losses.append(loss)
        if len(self.losses) > 1:
            self.tokens += tokens
            self.seconds += seconds
        if self.rank0 and (step % self.log_every == 0 or step == self.total):
            print(
                f"step {step:>4}/{self.total}  loss {loss:.4f}  {self.tokens_per_s:8.0f} tok/s",
                flush=True,
            )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        return {
            "first_loss": self.losses[0] if self.losses else float("nan"),
            "last_loss": self.losses[-1] if self.losses else float("nan"),
            "steps": len(self.losses),
            "tokens_per_s": self.tokens_per_s,
        }


# ---- Fabric ------------------------------------------------------------------------------


def train_with_fabric(fabric: L.Fabric, conf: TrainConf) -> dict:
    """One rank's Fabric loop; returns the run's summary."""
    w = conf.workload
    strategy: CPFabricStrategy = fabric.strategy
    model = fabric.setup_module(_build_model(conf, strategy.cp.groups, strategy.root_device))
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=w.weight_decay)
    )
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if w.resume:
        fabric.load(w.resume, state)
    loader = fabric.setup_dataloaders(_loader(conf))
    meter = _Meter(w.log_every, w.steps, fabric.global_rank == 0)
    step = state["step"]
    while step < w.steps:
        for batch in loader:
            if step >= w.steps:
                break
            start = time.perf_counter()
            cp_batch = strategy.shard_batch(batch)
            with cp_step(cp_batch.meta):
                loss = lm_cross_entropy(model(cp_batch.input_ids, cp_batch.positions), cp_batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            global_loss = strategy.reduce_loss(loss).item()
            step += 1
            meter.update(
                step,
                global_loss,
                int(cp_batch.num_global_tokens.item()),
                time.perf_counter() - start,
            )
    if w.save:
        state["step"] = step
        fabric.save(w.save, state)
    return meter.summary() if fabric.global_rank == 0 else None


def _distributed_checkpoint(w: TrainWorkload) -> bool:
    return not (w.save or "").endswith(".safetensors")


def run_fabric(conf: TrainConf, device: str, dist_backend: str) -> dict | None:
    strategy = CPFabricStrategy(
        conf.parallel,
        _parallelize_fn(conf),
        start_method="spawn",
        process_group_backend=dist_backend,
        save_distributed_checkpoint=_distributed_checkpoint(conf.workload),
    )
    fabric = L.Fabric(accelerator=device, devices=conf.parallel.world_size, strategy=strategy)
    return fabric.launch(train_with_fabric, conf)


# ---- Trainer -----------------------------------------------------------------------------


class LitTinyLM(L.LightningModule):
    """TinyLM (or the swapped transformers model) trained by the Lightning Trainer; batches
    arrive as this rank's CPBatch, and the strategy scopes each batch's step."""

    def __init__(self, conf: TrainConf):
        super().__init__()
        self.conf = conf
        self.model = None if conf.model.hf else _build_model(conf)
        self.meter = _Meter(conf.workload.log_every, conf.workload.steps, rank0=False)
        self._start = 0.0

    def configure_model(self) -> None:
        # On the rank, once its process groups exist (the swap needs them for TP).
        if self.model is None:
            strategy = self.trainer.strategy
            self.model = _build_model(self.conf, strategy.cp.groups, strategy.root_device)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def training_step(self, batch, batch_idx):
        return lm_cross_entropy(self.model(batch.input_ids, batch.positions), batch)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.meter.rank0 = self.global_rank == 0
        loss = self.trainer.strategy.reduce_loss(outputs["loss"]).item()
        self.meter.update(
            self.trainer.global_step,
            loss,
            int(batch.num_global_tokens.item()),
            time.perf_counter() - self._start,
        )
        for k, v in self.meter.summary().items():
            self.log(f"train/{k}", float(v))

    def on_train_end(self) -> None:
        if self.conf.workload.save:
            self.trainer.save_checkpoint(self.conf.workload.save)

    def configure_optimizers(self):
        w = self.conf.workload
        return torch.optim.AdamW(self.parameters(), lr=w.lr, weight_decay=w.weight_decay)


def run_trainer(conf: TrainConf, device: str, dist_backend: str) -> dict | None:
    strategy = CPTrainerStrategy(
        conf.parallel,
        _parallelize_fn(conf),
        start_method="spawn",
        process_group_backend=dist_backend,
        save_distributed_checkpoint=_distributed_checkpoint(conf.workload),
    )
    trainer = L.Trainer(
        accelerator=device,
        devices=conf.parallel.world_size,
        strategy=strategy,
        max_steps=conf.workload.steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(LitTinyLM(conf), _loader(conf), ckpt_path=conf.workload.resume)
    if trainer.global_rank != 0:
        return None
    m = trainer.callback_metrics
    return {
        k: (float(m[f"train/{k}"]) if f"train/{k}" in m else float("nan"))
        for k in ("first_loss", "last_loss", "steps", "tokens_per_s")
    }


register_train_config()


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    conf = load_train_config(cfg)
    device, dist_backend = _device_and_backend(conf.backend)
    os.environ.setdefault("MASTER_ADDR", conf.backend.master_addr)
    L.seed_everything(conf.workload.seed, verbose=False)
    p, w = conf.parallel, conf.workload
    attention = tiny_lm_config(conf.model).attention
    if conf.model.hf:
        attention += ", transformers model" + (
            f" {conf.model.checkpoint}" if conf.model.checkpoint else ""
        )
    print(
        f"training {conf.model.family.value} ({attention}) with {w.strategy.value} on "
        f"{p.world_size} rank(s): tp={p.tp} pcp={p.pcp} dp={p.dp}; {w.batch_size} x {w.seq_len} "
        f"tokens per replica and step",
        flush=True,
    )

    run = run_fabric if w.strategy is Strategy.fabric else run_trainer
    summary = run(conf, device, dist_backend)
    if summary is None:  # a rank other than 0 under torchrun
        return

    print(
        f"done: {conf.model.family.value} ({attention}) tp={p.tp} pcp={p.pcp} dp={p.dp}: loss "
        f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f} in {int(summary['steps'])} "
        f"steps, {summary['tokens_per_s']:.0f} tok/s ({w.strategy.value}, {device})"
        + (f"; saved {w.save}" if w.save else ""),
        flush=True,
    )


if __name__ == "__main__":
    main()
