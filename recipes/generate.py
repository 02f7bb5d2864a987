"""Generate with a HuggingFace model whose attention runs context-parallel, and check it.

    .venv/bin/python recipes/generate.py                      # SmolLM2-135M-Instruct, 2 CPU ranks (pcp=2, dcp=2)
    .venv/bin/python recipes/generate.py model=llama_tiny parallel=tp2_pcp2_dcp2   # tiny random Llama, 4 ranks
    .venv/bin/python recipes/generate.py model=deepseek_v3_tiny parallel=tp2_pcp2_dcp4_a2a
    .venv/bin/python recipes/generate.py workload/generate@workload=long_prompt workload.max_new_tokens=8
    torchrun --nproc-per-node 4 recipes/generate.py backend=cuda

Build: the composed config (``conf/generate.yaml``) and the prompts (through the model's chat
template). Run: every rank builds the model, sets its attention to cp (``swap_attention``),
shards it with tensor parallelism and generates with the engine. Report: the generations, throughput, time to first token, KV-cache blocks per
rank; then the same generation on one process: greedy tokens must be identical, else the exit
status is 1.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig
from recipe_configs import GenerateConf, load_config, register_configs
from recipe_models import model_name
from recipe_workloads import (
    compare_outputs,
    generate_on_rank,
    make_prompts,
    single_process,
)

from cp_modules.engine import GenerationResult, launch


def _show(ids: list[int], tokenizer, limit: int = 12) -> str:
    if tokenizer is not None:
        return repr(tokenizer.decode(ids))
    shown = " ".join(map(str, ids[:limit]))
    return f"[{shown}{' ...' if len(ids) > limit else ''}]"


def report(conf: GenerateConf, prompts, result: GenerationResult, tokenizer) -> None:
    p = conf.parallel
    print(
        f"{model_name(conf.model)} ({conf.model.dtype}) on {p.world_size} rank(s): tp={p.tp} "
        f"pcp={p.pcp} dcp={p.dcp} {p.dcp_comm_backend}"
    )
    for i, (prompt, out, why) in enumerate(zip(prompts, result.outputs, result.finish_reasons)):
        print(f"  [{i}] prompt {len(prompt):>5} tokens {_show(prompt, tokenizer)}")
        print(f"      -> {len(out)} tokens ({why}) {_show(out, tokenizer, limit=len(out))}")
    s = result.stats
    print(
        f"generated {s.num_generated_tokens} tokens in {s.total_s:.2f} s over {s.num_steps} steps: "
        f"{s.tokens_per_s:.1f} tok/s; time to first token {s.ttft_s * 1e3:.0f} ms (mean); "
        f"prefill {s.prefill_tokens_per_s:.0f} tok/s, decode {s.decode_tokens_per_s:.1f} tok/s"
    )
    if s.spec_steps:
        print(
            f"speculative decoding: {s.spec_steps} verification steps, "
            f"{s.tokens_per_verify:.2f} tokens per request and step, acceptance "
            f"{s.acceptance_rate:.0%} of {s.spec_draft_tokens} drafts"
        )
    print(
        f"KV cache per rank: {s.peak_blocks} blocks of {conf.backend.block_size} tokens in use at most "
        f"({s.kv_cache_bytes / 2**20:.2f} MiB allocated; {s.kv_cache_dtype}, "
        f"{s.kv_bytes_per_token} bytes per token"
        + (
            f"; bf16 window: sink {s.kv_fp8_window[0]}, newest {s.kv_fp8_window[1]}, "
            f"{s.kv_window_bytes / 2**20:.2f} MiB)"
            if any(s.kv_fp8_window)
            else ")"
        )
    )


register_configs()


@hydra.main(config_path="../conf", config_name="generate", version_base=None)
def main(cfg: DictConfig) -> None:
    conf = load_config(cfg, GenerateConf)
    prompts, tokenizer = make_prompts(conf)
    if conf.workload.prompts and tokenizer is None:
        print(
            f"{model_name(conf.model)} has no tokenizer: random prompts of {conf.workload.prompt_lens} tokens"
        )
    _, dist_backend = conf.backend.resolve()

    result = launch(
        generate_on_rank,
        conf.parallel.world_size,
        conf,
        prompts,
        backend=dist_backend,
        master_addr=conf.backend.master_addr,
        timeout_s=conf.backend.collective_timeout_s,
    )
    if result is None:  # a rank other than 0 under torchrun
        return

    report(conf, prompts, result, tokenizer)
    if not conf.workload.check:
        return
    if conf.workload.temperature > 0:
        print("check skipped: sampled tokens depend on the last bits of the logits")
        return
    reference = generate_on_rank(0, 1, single_process(conf), prompts)
    bad = compare_outputs(result.outputs, reference.outputs)
    print(
        f"single process: {reference.stats.tokens_per_s:.1f} tok/s, KV cache "
        f"{reference.stats.peak_blocks} blocks at most"
    )
    if bad:
        for i in bad:
            print(
                f"MISMATCH prompt {i}: parallel {result.outputs[i]} != single process {reference.outputs[i]}"
            )
        sys.exit(1)
    print(f"OK: greedy tokens identical to single-process generation ({len(prompts)} prompts)")


if __name__ == "__main__":
    main()
