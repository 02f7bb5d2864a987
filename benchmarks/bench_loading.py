"""GPU memory of loading a Llama-3-8B-shaped checkpoint at world size 1.

Writes a random Llama-3-8B-shaped model (bf16, ``save_pretrained`` with shards and an index) to
local disk, then loads it twice onto the GPU, in fresh allocator state each time:
``cp_modules.load_pretrained`` (world 1: transformers' ``from_pretrained`` straight to the
device, then ``swap_attention``) and cp's shard reader (``load_sharded``: meta build, swap,
pread of each tensor into its device tensor). For each: ``torch.cuda.max_memory_allocated``
against the parameters' bytes and the largest tensor (goal: parameters + at most the largest
tensor), the host RSS growth, the time, and the logits of both loads compared.

    python -m benchmarks.bench_loading --dir /tmp/llama3-8b --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time
from pathlib import Path

import torch

from benchmarks.common import write_results


def llama3_8b_config(num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False, dtype="bfloat16",
    )  # fmt: skip


def write_checkpoint(path: Path, num_layers: int) -> float:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(llama3_8b_config(num_layers), dtype=torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def measure(name: str, load, ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    from cp_modules.modules import CPRuntime
    from cp_modules.step import build_step_metadata, cp_step
    from cp_modules.testing import peak_rss_growth

    gc.collect()  # the previous model (reference cycles) is gone before the base is read
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model, host = peak_rss_growth(load)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    meta = build_step_metadata(
        CPRuntime.single(), num_new_tokens=[ids.numel()], num_computed_tokens=[0], device=ids.device
    )
    with cp_step(meta), torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=meta.positions[None]).logits[0].float()
    row = {
        "allocated_before_GiB": base / 2**30,
        "max_memory_allocated_GiB": peak / 2**30,
        "parameters_GiB": params / 2**30,
        "largest_tensor_GiB": largest / 2**30,
        "peak_over_parameters_GiB": (peak - params) / 2**30,
        "goal_met": peak <= params + largest,
        "host_rss_growth_GiB": host / 2**30,
        "seconds": seconds,
    }
    print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    del model
    return row, logits.cpu()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/llama3-8b-random")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    args = ap.parse_args()
    import cp_modules
    from cp_modules import ParallelConfig
    from cp_modules.loading.pretrained import load_sharded

    path = Path(args.dir)
    write_s = write_checkpoint(path, args.layers)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"checkpoint {size / 2**30:.2f} GiB in {len(list(path.glob('*.safetensors')))} files, "
          f"written in {write_s:.1f} s", flush=True)  # fmt: skip
    ids = torch.arange(16, device="cuda") * 997 % 128256
    device = torch.device("cuda", 0)
    rows = {}
    rows["load_pretrained (world 1: from_pretrained + swap)"], a = measure(
        "load_pretrained", lambda: cp_modules.load_pretrained(path, device=device), ids
    )
    rows["cp shard reader (load_sharded, world 1)"], b = measure(
        "load_sharded",
        lambda: load_sharded(path, ParallelConfig(), None, dtype=None, device=device),
        ids,
    )
    same = bool(torch.equal(a, b))
    print("logits equal:", same, "max abs diff", (a - b).abs().max().item(), flush=True)
    out = write_results(
        "loading",
        {"rows": rows, "logits_equal": same, "checkpoint_GiB": size / 2**30},
        args.out,
        model=f"Llama-3-8B shape, {args.layers} layers, random bf16",
    )
    print("wrote", out)
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    # The gate: both loads hold the same weights (a wrong read would change the logits).
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
