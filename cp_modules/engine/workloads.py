"""Rank bodies of the recipes: build the model, swap its attention, run the engine.

These are module-level functions so that spawned ranks can unpickle them; the recipes in
``recipes/`` compose the configs, :func:`~cp_modules.engine.launch.launch` these functions and
print the report.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from cp_modules.engine.engine import GenerationEngine, GenerationResult
from cp_modules.engine.model import build_model
from cp_modules.engine.sampling import SamplingParams
from cp_modules.recipe_configs import GenerateConf, ModelConf, ParallelConf

__all__ = [
    "build_engine",
    "compare_outputs",
    "generate_on_rank",
    "make_prompts",
    "single_process",
]


def make_prompts(conf: GenerateConf) -> tuple[list[list[int]], object | None]:
    """Token ids of the workload's prompts, and the tokenizer when the prompts are text.

    Raises:
        ValueError: for text prompts without a checkpoint to take the tokenizer from.
    """
    w = conf.workload
    if w.prompts:
        if not conf.model.checkpoint:
            raise ValueError(
                "workload.prompts (text) needs model.checkpoint (a local model directory with a "
                "tokenizer); without one use workload.prompt_lens"
            )
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(conf.model.checkpoint, local_files_only=True)
        return [tok(p)["input_ids"] for p in w.prompts], tok
    g = torch.Generator().manual_seed(w.seed)
    return [torch.randint(0, conf.model.vocab_size, (n,), generator=g).tolist() for n in w.prompt_lens], None


def sampling_params(conf: GenerateConf) -> SamplingParams:
    w = conf.workload
    return SamplingParams(
        max_new_tokens=w.max_new_tokens, temperature=w.temperature, top_k=w.top_k,
        top_p=w.top_p, seed=w.seed, eos_token_id=w.eos_token_id,
    )


def _device(conf_backend) -> torch.device:
    device, _ = conf_backend.resolve()
    if device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def build_engine(
    model_conf: ModelConf, parallel: ParallelConf, backend, *, max_num_tokens: int,
    max_num_seqs: int = 16, progress: bool = True,
) -> GenerationEngine:
    """The model of ``model_conf`` with CP attention on this rank's groups, in an engine."""
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules.hf_swap import swap_attention

    if backend.num_threads:
        torch.set_num_threads(backend.num_threads)
    config = parallel.to_parallel_config()
    groups = init_cp_groups(config) if config.world_size > 1 else None
    model = build_model(model_conf, _device(backend))
    swap_attention(model, groups if groups is not None else config)
    return GenerationEngine(
        model, groups, block_size=backend.block_size, max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs, compile=backend.compile, compile_backend=backend.compile_backend,
        progress=progress,
        packed_a2a=parallel.packed_a2a,
    )


def generate_on_rank(
    rank: int, world_size: int, conf: GenerateConf, prompts: list[list[int]]
) -> GenerationResult | None:
    """One rank of ``recipes/generate.py``: rank 0 returns the result, other ranks None."""
    w = conf.workload
    engine = build_engine(
        conf.model, conf.parallel, conf.backend, max_num_tokens=w.max_num_tokens,
        max_num_seqs=w.max_num_seqs, progress=w.progress,
    )
    params = sampling_params(conf)
    if conf.backend.compile:
        # Compile the prefill and decode graphs before the timed run.
        engine.generate(prompts, dataclasses.replace(params, max_new_tokens=2))
    result = engine.generate(prompts, params)
    return result if rank == 0 else None


def single_process(conf: GenerateConf) -> GenerateConf:
    """The same run on one process (the reference every layout must equal), without a progress bar."""
    return dataclasses.replace(
        conf, parallel=ParallelConf(), workload=dataclasses.replace(conf.workload, progress=False)
    )


def compare_outputs(got: list[list[int]], want: list[list[int]]) -> list[int]:
    """Indices of the prompts whose generated ids differ."""
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b] + list(
        range(min(len(got), len(want)), max(len(got), len(want)))
    )
