#!/usr/bin/env python
"""One-GPU parity: a swapped HF model against the same model with HF's own ``sdpa`` attention.

Run from the repository root on a CUDA machine:

    python -m benchmarks.bench_parity [--quick] [--only prefill,engine] [--profile DIR]

Models are built from their configs (random weights, bf16, no downloads) with the real layer
dimensions and 2 decoder layers (the engine rows: 4): Llama-3-8B, Qwen2.5-7B and DeepSeek-V3
(MLA, 128 heads; its 2 layers dense, so only attention differs from the original). Each is
deep-copied; one copy goes through ``swap_attention`` at world size 1. Both sides run the same
inputs; outputs are compared first (the 2x rule is not needed here: both are bf16 of the same
weights, and the check is that they agree to bf16 accuracy, relative error < 2e-2 of the
output's RMS), and no speed is reported for a side that disagrees.

Rows (the value is CP time / HF time, medians after warm-up, the two sides' runs interleaved;
below 1 CP is faster):
  - ``prefill``: the base model's forward on one 16k-token prompt (warm: same length each time).
  - ``new-length prefill``: the first call on a prompt of a length not seen before (16k + 64·i
    (+7 at odd i), i = 1..24, the median of the 24): plan building, kernel plan builds (cuDNN) and
    allocator growth included (the side that meets a length first grows the allocator's
    pool for both, so which side goes first alternates with each pair of lengths).
  - ``training``: forward, loss and backward of the causal LM on one 8k-token row (CP:
    ``CPTrainingContext.single().shard_batch`` + ``lm_cross_entropy``; HF: ``labels=``).
  - ``engine``: ``GenerationEngine`` against HF ``generate`` (greedy, every request runs to
    ``max_new_tokens``) on a 4-layer Llama-3-8B-shaped model: 16 prompts of 2048 tokens + 128
    new tokens in bf16, and 4 prompts of 50-1200 tokens + 24 new tokens in fp32 (tokens/s
    ratio engine / HF, time to first token, and in fp32 whether the greedy tokens agree).
Results: ``--out`` (benchmarks/results)/parity-<date>.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback

import torch

from benchmarks.common import RESULTS, apply_switches, write_results

DEV = torch.device("cuda")
DT = torch.bfloat16

MODELS = {
    "llama3-8b": (
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
            max_position_embeddings=131072,
        ),
    ),
    "qwen2.5-7b": (
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            rope_theta=1000000.0,
            max_position_embeddings=131072,
        ),
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            hidden_size=7168,
            intermediate_size=18432,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            first_k_dense_replace=8,
            vocab_size=129280,
            max_position_embeddings=163840,
            rope_scaling=None,
        ),
    ),
}


TINY = dict(hidden_size=256, intermediate_size=512, vocab_size=512, q_lora_rank=64)


def cast_keeping_rope(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` with its rotary ``inv_freq`` buffers kept fp32, as a checkpoint
    loaded in ``dtype`` has them (``.to`` alone rounds them: at bf16 a 4k-token prompt's
    logits then move ~65 % from the fp32 model's, against ~1.4 % with fp32 frequencies)."""
    keep = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
    model = model.to(dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buf.to(dtype=torch.float32))
    return model


def build(name: str, layers: int = 2, dtype: torch.dtype | None = None):
    """(HF sdpa model, swapped copy) of ``name``'s shape, random weights, on the GPU."""
    import transformers

    from cp_modules.modules.hf_swap import swap_attention

    cls_name, kw = MODELS[name]
    if DEV.type == "cpu":  # --smoke: the same code on small shapes
        kw = {**kw, **{k: v for k, v in TINY.items() if k in kw}}
        kw["num_attention_heads"] = min(kw["num_attention_heads"], 8)
        kw["num_key_value_heads"] = min(kw["num_key_value_heads"], kw["num_attention_heads"])
    cfg = getattr(transformers, cls_name)(num_hidden_layers=layers, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEV):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    hf = cast_keeping_rope(hf, dtype or DT).eval()
    for p in hf.parameters():
        if p.dim() >= 2:  # matrices; norms keep their ones, biases their zeros
            p.data.normal_(0, 0.02)
    cp = swap_attention(copy.deepcopy(hf))
    return hf, cp


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, reps: int) -> float:
    return _time_pair(fn, None, reps)[0]


def _time_pair(fa, fb, reps: int) -> tuple[float, float]:
    """Median wall times of ``fa`` and ``fb`` (None: ``fa`` alone), their runs interleaved
    (a b a b ...) so that both sides see the same clock and temperature history: timing one
    side's runs after the other's made the later side's median a few percent apart by the
    GPU's state alone."""
    ts: list[list[float]] = [[], []]
    for _ in range(reps):
        for i, fn in enumerate((fa, fb)):
            if fn is None:
                continue
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            ts[i].append(time.perf_counter() - t0)
    return statistics.median(ts[0]), statistics.median(ts[1]) if ts[1] else float("nan")


def _cp_prefill(cp, ids):
    from cp_modules.step import CPRuntime, build_step_metadata, cp_step, restore_tokens

    meta = build_step_metadata(CPRuntime.single(), [ids.shape[0]], device=DEV)
    with cp_step(meta):
        h = cp.base_model(
            input_ids=ids[meta.token_indices][None],
            position_ids=meta.positions[None],
            use_cache=False,
        ).last_hidden_state[0]
    return restore_tokens(h, meta)


def _hf_prefill(hf, ids):
    return hf.base_model(input_ids=ids[None], use_cache=False).last_hidden_state[0]


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def prefill_rows(name: str, quick: bool, metrics: dict, profile: str | None = None) -> None:
    hf, cp = build(name)
    g = torch.Generator(device=DEV).manual_seed(1)
    vocab = hf.config.vocab_size
    n = 256 if DEV.type == "cpu" else (4096 if quick else 16384)
    ids = torch.randint(0, vocab, (n,), device=DEV, generator=g)
    with torch.no_grad():
        err = _agree(_cp_prefill(cp, ids), _hf_prefill(hf, ids))
        metrics[f"parity {name} prefill rel err"] = err
        if err > 2e-2:
            raise RuntimeError(f"{name}: CP prefill differs from HF by {err:.3g} (relative RMS)")
        for _ in range(2):
            _cp_prefill(cp, ids), _hf_prefill(hf, ids)
        t_cp, t_hf = _time_pair(lambda: _cp_prefill(cp, ids), lambda: _hf_prefill(hf, ids), 9)
        metrics[f"one-GPU parity prefill {name} (CP / HF sdpa)"] = t_cp / t_hf
        metrics[f"parity {name} prefill {n} ms CP"] = t_cp * 1e3
        metrics[f"parity {name} prefill {n} ms HF"] = t_hf * 1e3
        # New lengths: each side sees each length once (its first call), interleaved.
        new_cp, new_hf = [], []
        for i in range(1, 4 if quick else 25):
            m = n + 64 * i + (7 if i % 2 else 0)
            x = torch.randint(0, vocab, (m,), device=DEV, generator=g)
            # The side that runs a longer length first grows the caching allocator's pool
            # (cudaMalloc) and the other reuses it: the order alternates in pairs of lengths,
            # so that each side goes first at half the 8-aligned and half the odd lengths.
            sides = [(cp, _cp_prefill, new_cp), (hf, _hf_prefill, new_hf)]
            for side, fn, acc in sides if (i + 1) // 2 % 2 else sides[::-1]:
                _sync()
                t0 = time.perf_counter()
                fn(side, x)
                _sync()
                acc.append(time.perf_counter() - t0)
        t_cp, t_hf = statistics.median(new_cp), statistics.median(new_hf)
        metrics[f"one-GPU parity new-length prefill {name} (CP / HF sdpa)"] = t_cp / t_hf
        metrics[f"parity {name} new-length ms CP"] = t_cp * 1e3
        metrics[f"parity {name} new-length ms HF"] = t_hf * 1e3
        if profile:
            _profile(
                f"{profile}/prefill-{name}",
                {"cp": lambda: _cp_prefill(cp, ids), "hf": lambda: _hf_prefill(hf, ids)},
            )


def training_rows(name: str, quick: bool, metrics: dict, profile: str | None) -> None:
    from cp_modules.step import cp_step
    from cp_modules.training import CPTrainingContext, lm_cross_entropy

    hf, cp = build(name)
    hf.train(), cp.train()
    n = 256 if DEV.type == "cpu" else (2048 if quick else 8192)
    g = torch.Generator(device=DEV).manual_seed(2)
    ids = torch.randint(0, hf.config.vocab_size, (1, n), device=DEV, generator=g)
    ctx = CPTrainingContext.single(DEV)

    def cp_step_fn():
        cb = ctx.shard_batch({"input_ids": ids})
        with cp_step(cb.meta):
            logits = cp(
                input_ids=cb.input_ids[None], position_ids=cb.positions[None], use_cache=False
            ).logits.squeeze(0)  # not [0]: its backward zero-fills and copies [1, T, V]
            loss = lm_cross_entropy(logits, cb)
        loss.backward()
        return loss

    def hf_step_fn():
        loss = hf(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    l_cp, l_hf = cp_step_fn(), hf_step_fn()
    err = abs(float(l_cp.detach()) - float(l_hf.detach())) / abs(float(l_hf.detach()))
    # Every parameter's gradient, as one vector per side.
    gerr = _agree(
        torch.cat([p.grad.flatten().float() for p in cp.parameters() if p.grad is not None]),
        torch.cat([p.grad.flatten().float() for p in hf.parameters() if p.grad is not None]),
    )
    metrics[f"parity {name} training loss rel err"] = err
    metrics[f"parity {name} training grad rel err"] = gerr
    if err > 1e-2 or gerr > 5e-2:
        raise RuntimeError(f"{name}: CP training differs from HF: loss {err:.3g}, grad {gerr:.3g}")
    for m in (hf, cp):
        m.zero_grad(set_to_none=True)
    for _ in range(2):
        cp_step_fn(), hf_step_fn()
    t_cp, t_hf = _time_pair(cp_step_fn, hf_step_fn, 9)
    metrics[f"one-GPU parity training {name} (CP / HF sdpa)"] = t_cp / t_hf
    metrics[f"parity {name} training {n} ms CP"] = t_cp * 1e3
    metrics[f"parity {name} training {n} ms HF"] = t_hf * 1e3
    if profile:
        _profile(f"{profile}/train-{name}", {"cp": cp_step_fn, "hf": hf_step_fn})


def _profile(prefix: str, fns: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    for side, fn in fns.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            _sync()
        averages = prof.key_averages()
        with open(f"{prefix}-{side}.txt", "w") as f:
            for key in ("cuda_time_total", "self_cuda_time_total"):
                f.write(averages.table(sort_by=key, row_limit=40) + "\n")


def engine_rows(quick: bool, metrics: dict, profile: str | None, compiled: bool = False) -> None:
    cases = (
        ("16x2048+128 bf16", torch.bfloat16, [2048] * 16, 128),
        ("4 prompts fp32", torch.float32, [50, 300, 700, 1200], 24),
    )
    for case in cases:
        _engine_case(*case, quick=quick, metrics=metrics, profile=profile)
        torch.cuda.empty_cache()
    if compiled:
        # The engine with compile=True (its decode graphs capture the compiled forward).
        _engine_case(*cases[0], quick=quick, metrics=metrics, profile=None, compile=True)


def _engine_case(label, dtype, lens, new, *, quick, metrics, profile, compile=False) -> None:
    from cp_modules.engine import GenerationEngine, SamplingParams

    if quick:
        lens, new = [min(n, 64 if DEV.type == "cpu" else 512) for n in lens], min(new, 8)
    hf, cp = build("llama3-8b", layers=4, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    engine = GenerationEngine(
        cp, block_size=64, max_num_tokens=sum(lens), max_num_seqs=len(lens), progress=False,
        compile=compile,
    )  # fmt: skip
    if compile:
        label = f"{label} (engine compiled)"
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)

    def run_engine():
        return engine.generate(prompts, params)

    def run_hf():
        outs = []
        with torch.no_grad():
            if len(set(lens)) == 1:
                x = torch.tensor(prompts, device=DEV)
                y = hf.generate(
                    x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=0,
                )  # fmt: skip
                outs = [r[len(p) :].tolist() for r, p in zip(y, prompts)]
            else:
                # Ragged prompts: one left-padded batch with its attention mask.
                width = max(lens)
                x = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEV)
                mask = torch.tensor(
                    [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEV
                )
                y = hf.generate(
                    x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip
                outs = [r[width:].tolist() for r in y]
        return outs

    res, ref = run_engine(), run_hf()  # warm-up on the same shapes
    if dtype == torch.float32:
        same = sum(a == b for a, b in zip(res.outputs, ref))
        metrics[f"engine {label} greedy tokens equal HF (requests)"] = same
    t_engine, t_hf = _time_pair(run_engine, run_hf, 3)
    res = run_engine()
    tokens = sum(len(o) for o in res.outputs)
    metrics[f"engine vs HF generate tokens/s {label}"] = t_hf / t_engine
    metrics[f"engine {label} tokens/s"] = tokens / t_engine
    metrics[f"HF generate {label} tokens/s"] = tokens / t_hf
    metrics[f"engine {label} ttft ms"] = res.stats.ttft_s * 1e3
    metrics[f"engine {label} decode tokens/s"] = res.stats.decode_tokens_per_s
    steps = max(res.stats.num_steps, 1)
    metrics[f"engine {label} s per decode step"] = res.stats.decode_s / max(steps - 1, 1)
    if profile:
        _profile(f"{profile}/engine-{label.split()[0].replace('+', '_')}", {"engine": run_engine})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="prefill,training,engine")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--profile", default=None, help="folder for profiler tables")
    ap.add_argument("--engine-compile", action="store_true", help="also the compiled engine")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (no timing value)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module switch first (results: parity-switched-<date>.json)")  # fmt: skip
    a = ap.parse_args()
    switches = apply_switches(a.set)
    if a.smoke:
        global DEV, DT
        DEV, DT, a.quick = torch.device("cpu"), torch.float32, True
    metrics: dict = {}
    failed = []
    parts = a.only.split(",")
    for name in a.models.split(","):
        for part, fn in (("prefill", prefill_rows), ("training", training_rows)):
            if part not in parts:
                continue
            try:
                fn(name, a.quick, metrics, a.profile)
            except Exception:
                traceback.print_exc()
                failed.append(f"{part} {name}")
            torch.cuda.empty_cache()
            print(f"done {part} {name}", flush=True)
    if "engine" in parts:
        try:
            engine_rows(a.quick, metrics, a.profile, compiled=a.engine_compile)
        except Exception:
            traceback.print_exc()
            failed.append("engine")
    for k, v in metrics.items():
        print(f"{k}: {v:.4g}")
    if switches:
        write_results("parity-switched", metrics, a.out, switches=switches)
    else:
        write_results("parity", metrics, a.out)
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
