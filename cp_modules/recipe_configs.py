"""Typed configuration groups shared by the Hydra recipes (``conf/parallel``, ``conf/model``,
``conf/backend``). OmegaConf checks types and enum values; ranges and cross-field rules are
checked when a group is turned into the objects it describes (``ParallelConfig`` validates).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from cp_modules.config import ParallelConfig

__all__ = ["BackendConf", "CommBackend", "Device", "Family", "ModelConf", "ParallelConf"]


class CommBackend(Enum):
    ag_rs = "ag_rs"
    a2a = "a2a"


class Family(Enum):
    llama = "llama"
    qwen2 = "qwen2"
    mistral = "mistral"
    deepseek_v3 = "deepseek_v3"


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class ParallelConf:
    """Parallel degrees (``conf/parallel``); world size = dp * pcp * tp."""

    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    dp: int = 1
    dcp_comm_backend: CommBackend = CommBackend.ag_rs
    interleave: int = 1
    packed_a2a: bool = True

    @property
    def world_size(self) -> int:
        return self.dp * self.pcp * self.tp

    def to_parallel_config(self) -> ParallelConfig:
        backend = self.dcp_comm_backend
        return ParallelConfig(
            tensor_parallel_size=self.tp,
            prefill_context_parallel_size=self.pcp,
            decode_context_parallel_size=self.dcp,
            dcp_comm_backend=backend.value if isinstance(backend, CommBackend) else backend,
            dcp_kv_cache_interleave_size=self.interleave,
            data_parallel_size=self.dp,
        )


@dataclass
class ModelConf:
    """A model family and its sizes (``conf/model``); tiny defaults build seeded random weights.

    ``checkpoint``: a local HuggingFace model directory to load instead of random weights.
    MLA fields apply to ``deepseek_v3`` only.
    """

    family: Family = Family.llama
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    seed: int = 0
    dtype: str = "float32"
    checkpoint: str | None = None


@dataclass
class BackendConf:
    """Where and how to run (``conf/backend``).

    ``dist_backend``: ``auto`` picks NCCL on CUDA, gloo on CPU. Spawned CPU runs rendezvous on
    ``master_addr`` (loopback unless told otherwise).
    """

    device: Device = Device.auto
    dist_backend: str = "auto"
    compile: bool = False
    block_size: int = 16
    master_addr: str = "127.0.0.1"
    collective_timeout_s: float = 300.0
