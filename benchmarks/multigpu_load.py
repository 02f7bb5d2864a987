"""Shard-only loading on several GPUs: memory per rank against the contract, tokens per layout.

Two steps, so that one checkpoint serves every layout:

    python -m benchmarks.multigpu_load write --model llama3_70b --dir /data/llama70b
    torchrun --nproc-per-node 8 -m benchmarks.multigpu_load load --dir /data/llama70b --tp 8
    torchrun --nproc-per-node 8 -m benchmarks.multigpu_load load --dir /data/llama70b --tp 4 --dcp 2
    python -m benchmarks.multigpu_load compare benchmarks/results/nccl-load-*.json

``write`` streams a random checkpoint of the model's shape to disk in transformers' checkpoint
layout (names from transformers' own reverse conversion, so MoE experts are written one tensor
per expert as hub checkpoints are; shards of ``--shard-gib`` with an index), one tensor at a
time. ``load`` runs ``cp_modules.load_pretrained`` on every rank (NCCL on GPUs, gloo on CPUs)
and records, per rank, ``torch.cuda.max_memory_allocated``, the host RSS growth and the
contract ``checkpoint bytes / tp x 1.3 + the largest tensor + 96 MiB``, then greedy tokens of
a 4-prompt batch from the engine. ``compare`` checks the tokens are equal across layouts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

MIB = 2**20


def model_config(name: str, num_layers: int | None):
    from transformers import DeepseekV3Config, LlamaConfig

    if name in ("llama3_70b", "llama_tiny"):
        big = name == "llama3_70b"
        return LlamaConfig(
            vocab_size=128256 if big else 512, hidden_size=8192 if big else 128,
            intermediate_size=28672 if big else 256, num_attention_heads=64 if big else 8,
            num_key_value_heads=8 if big else 4, num_hidden_layers=num_layers or (80 if big else 2),
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            max_position_embeddings=8192, tie_word_embeddings=False, dtype="bfloat16",
        )  # fmt: skip
    if name in ("deepseek_v3", "deepseek_tiny"):
        big = name == "deepseek_v3"
        return DeepseekV3Config(
            vocab_size=129280 if big else 512, hidden_size=7168 if big else 128,
            intermediate_size=18432 if big else 256, moe_intermediate_size=2048 if big else 32,
            num_hidden_layers=num_layers or (5 if big else 3), first_k_dense_replace=3 if big else 1,
            num_attention_heads=128 if big else 8, num_key_value_heads=128 if big else 8,
            n_routed_experts=256 if big else 16, num_experts_per_tok=8 if big else 2,
            n_shared_experts=1, n_group=8 if big else 4, topk_group=4 if big else 2,
            kv_lora_rank=512 if big else 32, q_lora_rank=1536 if big else 64,
            qk_rope_head_dim=64 if big else 16, qk_nope_head_dim=128 if big else 16,
            v_head_dim=128 if big else 16, max_position_embeddings=8192, dtype="bfloat16",
        )  # fmt: skip
    raise ValueError(f"unknown model {name!r}: llama3_70b, deepseek_v3, llama_tiny, deepseek_tiny")


def write(args) -> None:
    """Stream a random checkpoint (N(0, 0.02), norms 1) in transformers' checkpoint names."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    from cp_modules.loading import meta_causal_lm

    config = model_config(args.model, args.layers)
    meta = meta_causal_lm(config, dtype=torch.bfloat16)
    shapes = revert_weight_conversion(meta, dict(meta.state_dict()))  # meta: names and shapes
    path = Path(args.dir)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    limit = int(args.shard_gib * 2**30)
    shards: list[list[str]] = [[]]
    sizes = [0]
    for name, t in shapes.items():
        n = t.numel() * 2
        if sizes[-1] and sizes[-1] + n > limit:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += n
    weight_map = {}
    t0 = time.perf_counter()
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = tuple(shapes[name].shape)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                x = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(
                    0, 0.02, generator=gen
                )
                tensors[name] = x.cpu()
            weight_map[name] = file
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        print(f"{file}: {len(names)} tensors, {sizes[i] / 2**30:.2f} GiB", flush=True)
        del tensors
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {sum(sizes) / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s to {path}")


def load(args) -> None:
    import torch.distributed as dist

    import cp_modules
    from cp_modules import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups, init_distributed
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.loading import CheckpointIndex
    from cp_modules.testing import peak_rss_growth

    init_distributed(timeout_s=args.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ParallelConfig(
        tensor_parallel_size=args.tp,
        prefill_context_parallel_size=args.pcp,
        decode_context_parallel_size=args.dcp,
        dcp_comm_backend=args.dcp_backend,
    )
    groups = init_cp_groups(cfg)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    with CheckpointIndex(args.dir) as index:
        total, largest = index.total_bytes, index.largest_tensor_bytes
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, host = peak_rss_growth(
        cp_modules.load_pretrained, args.dir, groups, dtype=torch.bfloat16, device=device
    )
    seconds = time.perf_counter() - t0
    gpu = torch.cuda.max_memory_allocated() if cuda else 0
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in model.parameters()
    )
    limit = total / args.tp * 1.3 + largest + 96 * MIB
    g = torch.Generator().manual_seed(1)
    vocab = model.config.get_text_config().vocab_size
    prompts = [
        torch.randint(vocab, (n,), generator=g).tolist() for n in (args.prompt_len, 37, 5, 300)
    ]
    engine = GenerationEngine(model, groups, block_size=64, max_num_tokens=2048)
    result = engine.generate(
        prompts, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    )
    me = {
        "rank": rank,
        "load_seconds": seconds,
        "host_rss_growth_MiB": host / MIB,
        "max_memory_allocated_MiB": gpu / MIB,
        "local_parameters_MiB": local / MIB,
        "contract_MiB": limit / MIB,
        "within_contract": host <= limit,
        "gpu_within_parameters_plus_largest": (not cuda) or gpu <= local + largest,
    }
    rows: list = [None] * world
    dist.all_gather_object(rows, me)
    if rank == 0:
        from benchmarks.common import write_results

        layout = f"tp{args.tp}-pcp{args.pcp}-dcp{args.dcp}-{args.dcp_backend}"
        out = write_results(
            f"nccl-load-{Path(args.dir).name}-{layout}",
            {"per_rank": rows, "checkpoint_MiB": total / MIB, "largest_tensor_MiB": largest / MIB},
            args.out,
            layout=layout,
            world_size=world,
            tokens=result.outputs,
            command=" ".join(sys.argv),
        )
        worst = max(rows, key=lambda r: r["host_rss_growth_MiB"])
        print(f"{layout}: worst host RSS growth {worst['host_rss_growth_MiB']:.0f} MiB (contract "
              f"{limit / MIB:.0f}), max GPU {max(r['max_memory_allocated_MiB'] for r in rows):.0f} "
              f"MiB, local parameters {local / MIB:.0f} MiB; wrote {out}")  # fmt: skip
    dist.destroy_process_group()


def compare(args) -> None:
    runs = [json.loads(Path(p).read_text()) for p in args.files]
    first = runs[0]["tokens"]
    for r in runs:
        print(r["layout"], "tokens equal to", runs[0]["layout"], ":", r["tokens"] == first)
    if any(r["tokens"] != first for r in runs):
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--model", default="llama3_70b")
    w.add_argument("--layers", type=int, default=None)
    w.add_argument("--dir", required=True)
    w.add_argument("--shard-gib", type=float, default=5.0)
    ld = sub.add_parser("load")
    ld.add_argument("--dir", required=True)
    ld.add_argument("--tp", type=int, default=1)
    ld.add_argument("--pcp", type=int, default=1)
    ld.add_argument("--dcp", type=int, default=1)
    ld.add_argument("--dcp-backend", default="ag_rs")
    ld.add_argument("--prompt-len", type=int, default=1000)
    ld.add_argument("--new-tokens", type=int, default=16)
    ld.add_argument("--timeout-s", type=float, default=600.0)
    ld.add_argument("--out", default="benchmarks/results")
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+")
    args = ap.parse_args()
    {"write": write, "load": load, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
