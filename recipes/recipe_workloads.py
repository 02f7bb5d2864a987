"""Rank bodies of the recipes: build the model, swap its attention, run the engine.

These are module-level functions so that spawned ranks can unpickle them; the recipes in
``recipes/`` compose the configs, :func:`~cp_modules.engine.launch.launch` these functions and
print the report.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from recipe_configs import (
    BenchmarkConf,
    GenerateConf,
    GenerateWorkload,
    ModelConf,
)
from recipe_models import build_cp_model, load_tokenizer, model_dir

from cp_modules.config import ParallelConfig
from cp_modules.engine.engine import GenerationEngine, GenerationResult
from cp_modules.engine.sampling import SamplingParams

__all__ = [
    "benchmark_on_rank",
    "build_engine",
    "compare_outputs",
    "generate_on_rank",
    "make_prompts",
    "sampling_params",
    "single_process",
]


def make_prompts(conf: GenerateConf) -> tuple[list[list[int]], object | None]:
    """Token ids of the workload's prompts, and the tokenizer when the model has one.

    With a tokenizer, ``workload.prompts`` (text) are encoded, through the tokenizer's chat
    template as one user turn each when ``workload.chat`` and the tokenizer has a template.
    Without text prompts, or for a tiny model (no tokenizer), the prompts are random ids of
    ``workload.prompt_lens`` tokens drawn with ``workload.seed``.
    """
    w = conf.workload
    tok = load_tokenizer(conf.model) if w.prompts else None
    if w.prompts and tok is not None:
        if w.chat and getattr(tok, "chat_template", None):
            ids = [
                list(
                    tok.apply_chat_template(
                        [{"role": "user", "content": p}],
                        add_generation_prompt=True,
                        return_dict=True,
                    )["input_ids"]
                )
                for p in w.prompts
            ]
        else:
            ids = [tok(p)["input_ids"] for p in w.prompts]
        return ids, tok
    vocab_size = conf.model.vocab_size
    path = model_dir(conf.model)
    if path is not None:
        from transformers import AutoConfig

        extra = {"gguf_file": conf.model.gguf_file} if conf.model.gguf_file else {}
        vocab_size = AutoConfig.from_pretrained(path, local_files_only=True, **extra).vocab_size
    g = torch.Generator().manual_seed(w.seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in w.prompt_lens], None


def sampling_params(conf: GenerateConf) -> SamplingParams:
    """The workload's sampling; ``eos_token_id`` None: the engine stops at the model's
    generation config's end-of-sequence ids."""
    w = conf.workload
    return SamplingParams(
        max_new_tokens=w.max_new_tokens,
        temperature=w.temperature,
        top_k=w.top_k,
        top_p=w.top_p,
        seed=w.seed,
        eos_token_id=w.eos_token_id,
        speculative=w.speculative,
        num_speculative_tokens=w.num_speculative_tokens,
        speculative_min_accepted=w.speculative_min_accepted,
    )


def _device(conf_backend) -> torch.device:
    device, _ = conf_backend.resolve()
    if device == "cuda":
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        )
    return torch.device("cpu")


def build_engine(
    model_conf: ModelConf,
    parallel: ParallelConfig,
    backend,
    *,
    max_num_tokens: int,
    max_num_seqs: int = 16,
    progress: bool = True,
) -> GenerationEngine:
    """The model of ``model_conf`` with CP attention on this rank's groups, in an engine."""
    from cp_modules.distributed.groups import init_cp_groups

    if backend.num_threads:
        torch.set_num_threads(backend.num_threads)
    config = parallel
    groups = init_cp_groups(config) if config.world_size > 1 else None
    model = build_cp_model(model_conf, groups if groups is not None else config, _device(backend))
    return GenerationEngine(
        model,
        groups,
        block_size=backend.block_size,
        max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs,
        compile=backend.compile,
        compile_backend=backend.compile_backend,
        progress=progress,
        packed_a2a=backend.packed_a2a,
        kv_cache_dtype=backend.kv_cache_dtype,
        kv_cache_fp8_sink=backend.kv_cache_fp8_sink,
        kv_cache_fp8_recent=backend.kv_cache_fp8_recent,
    )


def generate_on_rank(
    rank: int, world_size: int, conf: GenerateConf, prompts: list[list[int]]
) -> GenerationResult | None:
    """One rank of ``recipes/generate.py``: rank 0 returns the result, other ranks None."""
    w = conf.workload
    engine = build_engine(
        conf.model,
        conf.parallel,
        conf.backend,
        max_num_tokens=w.max_num_tokens,
        max_num_seqs=w.max_num_seqs,
        progress=w.progress,
    )
    params = sampling_params(conf)
    if conf.backend.compile:
        # Compile the prefill and decode graphs before the timed run.
        engine.generate(prompts, dataclasses.replace(params, max_new_tokens=2))
    result = engine.generate(prompts, params)
    return result if rank == 0 else None


def single_process(conf: GenerateConf | BenchmarkConf) -> GenerateConf | BenchmarkConf:
    """The same run on one process (the reference every layout must equal), without a progress bar."""
    workload = conf.workload
    if isinstance(workload, GenerateWorkload):
        workload = dataclasses.replace(workload, progress=False)
    return dataclasses.replace(conf, parallel=ParallelConfig(), workload=workload)


def compare_outputs(got: list[list[int]], want: list[list[int]]) -> list[int]:
    """Indices of the prompts whose generated ids differ."""
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b] + list(
        range(min(len(got), len(want)), max(len(got), len(want)))
    )


def benchmark_on_rank(rank: int, world_size: int, conf: BenchmarkConf) -> dict | None:
    """One rank of the generation benchmark: a warm-up, then ``repeats`` timed runs.

    Returns (rank 0) the fastest run's numbers and every rank's KV-cache blocks and peak device
    memory; other ranks return None.
    """
    import torch.distributed as dist

    w = conf.workload
    engine = build_engine(
        conf.model,
        conf.parallel,
        conf.backend,
        max_num_tokens=w.max_num_tokens,
        max_num_seqs=max(len(w.prompt_lens), 1),
        progress=False,
    )
    g = torch.Generator().manual_seed(w.seed)
    prompts = [
        torch.randint(0, conf.model.vocab_size, (n,), generator=g).tolist() for n in w.prompt_lens
    ]
    params = SamplingParams(max_new_tokens=w.max_new_tokens, seed=w.seed)
    engine.generate(prompts, dataclasses.replace(params, max_new_tokens=2))
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    runs = [engine.generate(prompts, params) for _ in range(w.repeats)]
    best = min(runs, key=lambda r: r.stats.total_s)
    s = best.stats
    mine = {
        "peak_blocks": s.peak_blocks,
        "kv_cache_bytes": s.kv_cache_bytes,
        "kv_cache_dtype": s.kv_cache_dtype,
        "kv_bytes_per_token": s.kv_bytes_per_token,
        "kv_fp8_window": list(s.kv_fp8_window),
        "kv_window_bytes": s.kv_window_bytes,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(engine.device) if cuda else None,
    }
    per_rank = [mine]
    if world_size > 1:
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, mine)
    if rank != 0:
        return None
    return {
        "world_size": world_size,
        "tokens_per_s": s.tokens_per_s,
        "ttft_s": s.ttft_s,
        "prefill_tokens_per_s": s.prefill_tokens_per_s,
        "decode_tokens_per_s": s.decode_tokens_per_s,
        "total_s": s.total_s,
        "num_prompt_tokens": s.num_prompt_tokens,
        "num_generated_tokens": s.num_generated_tokens,
        "outputs": best.outputs,
        "ranks": per_rank,
    }
