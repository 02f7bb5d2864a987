"""fp8 KV cache on whole-model shapes: decode logits against an fp32 model with an fp32 cache.

    python -m benchmarks.bench_fp8_kv --logits [--logits-models llama3-8b,qwen2.5-7b,deepseek-v3]

Models are ``bench_parity``'s (Llama-3-8B, Qwen2.5-7B, DeepSeek-V3: 2 decoder layers of the
real dimensions, random weights; DeepSeek-V3's layers are dense MLA layers), swapped to cp
attention at world size 1 with paged KV caches (block size 64). Three runs of one model's
weights, each a prefill of the same ``prompt_len`` random tokens (16k) and then ``steps``
decode steps fed the same random tokens (teacher forcing: every run sees identical inputs, so
the logits are comparable step by step):

- the reference: fp32 weights, fp32 cache (``kv_cache_dtype="bf16"`` keeps the model's dtype);
- ``bf16 KV``: the weights rounded to bf16, a bf16 cache;
- ``fp8 KV``: the same bf16 weights, an e4m3 cache (static per-tensor scales 1.0, the
  default: the random models' K/V are O(1)).

``<cache> KV logits error (vs fp32) <model>`` = ``|L - L_ref| / |L_ref|`` (Frobenius norm over
the decode steps' logits ``[steps, V]``, fp32). Both cached runs are the same bf16 model, so
both errors contain its own rounding (weights, activations; a bf16 model's K/V leave their
projections as bf16, so its bf16 cache stores them without a further rounding): the bf16 error
is that rounding alone, the fp8 error that rounding and the cache's. Their ratio is then 1
where the cache adds nothing, and the goal (``fp8 KV logits error / bf16 KV logits error (vs
fp32) <model>`` <= 3) allows the e4m3 cache up to ~2.8x the model's own error if the two add
independently (``sqrt(1 + r^2) <= 3``). A ratio against fp32 and not against the bf16 run
keeps the scale of a model's own bf16 error as the unit. The prefill attention of new tokens
reads the layer's bf16 inputs, not the cache, so only the decode steps differ between the two
cached runs. Also reported: the fp8 run against the bf16 run directly and the max |dL| rows.

Random weights (N(0, 0.02)) give nearly uniform attention over the 16k keys, which averages
the cache's rounding away more than a trained model's peaked attention does: these rows bound
the kernels' and the cache path's error, not a trained model's accuracy (for that:
``tests/test_fp8_kv_smollm2.py``, ``docs/experiments/2026-12-02-fp8-kv-scaling.md``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from benchmarks import bench_parity

BS = 64
NAMES = {"llama3-8b": "Llama-3-8B", "qwen2.5-7b": "Qwen2.5-7B", "deepseek-v3": "DeepSeek-V3"}
RATIO_ROW = "fp8 KV logits error / bf16 KV logits error (vs fp32) {}"
REF_PREFILL_CHUNK = 2048


@contextlib.contextmanager
def _parity_device(device: torch.device) -> Iterator[None]:
    """``bench_parity.build`` on ``device`` (its CPU builds are its tiny shapes)."""
    old = bench_parity.DEV
    bench_parity.DEV = device
    try:
        yield
    finally:
        bench_parity.DEV = old


@torch.no_grad()
def _decode_logits(
    model,
    prompt: torch.Tensor,
    feed: torch.Tensor,
    kv_cache_dtype: str,
    prefill_chunk: int | None = None,
):
    """Prefill ``prompt`` [P] into fresh paged caches of ``kv_cache_dtype`` (in chunks of
    ``prefill_chunk`` tokens that read their prefix from the cache, None: at once), then one
    decode step per token of ``feed`` [S]: the fp32 logits of every decode step [S, V]."""
    from cp_modules.modules.hf_swap import allocate_kv_caches, free_kv_caches
    from cp_modules.step import CPRuntime, build_step_metadata, cp_step, restore_tokens

    dev, dtype = prompt.device, next(model.parameters()).dtype
    n = prompt.numel()
    num_blocks = -(-(n + feed.numel()) // BS)
    allocate_kv_caches(model, num_blocks, BS, dtype=dtype, device=dev,
                       kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    table = torch.arange(num_blocks, dtype=torch.int32, device=dev)[None]
    head = model.get_output_embeddings()

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        meta = build_step_metadata(CPRuntime.single(), [ids.numel()], [start], block_table=table,
                                   block_size=BS, device=dev)  # fmt: skip
        with cp_step(meta):
            h = model.base_model(
                input_ids=ids[meta.token_indices][None],
                position_ids=meta.positions[None],
                use_cache=False,
            ).last_hidden_state[0]
        return head(restore_tokens(h, meta)[-1:]).float()[0]

    chunk = prefill_chunk or n
    for i in range(0, n, chunk):
        step(prompt[i : i + chunk], i)
    out = torch.stack([step(feed[i : i + 1], n + i) for i in range(feed.numel())])
    free_kv_caches(model)
    return out


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(|got - ref| / |ref| (Frobenius), max |got - ref|)."""
    d = got - ref
    return float(d.norm() / ref.norm()), float(d.abs().max())


def logits_error_rows(
    names: list[str],
    rows: dict,
    checks: dict,
    *,
    prompt_len: int = 16384,
    steps: int = 8,
    device: torch.device | str = "cuda",
) -> bool:
    """The ``fp8 KV logits error / bf16 KV logits error (vs fp32) <model>`` rows of ``names``
    (keys of ``bench_parity.MODELS``) and the errors they are made of, into ``rows``; False if
    a model's errors are not all finite (its rows are then left out, the errors go to
    ``checks``). On a CPU ``device`` the models are ``bench_parity``'s tiny shapes."""
    dev = torch.device(device)
    ok = True
    old_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the reference is fp32, not TF32
    try:
        for name in names:
            ok &= _model_rows(name, rows, checks, prompt_len, steps, dev)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        torch.set_float32_matmul_precision(old_precision)
    return ok


def _model_rows(name: str, rows: dict, checks: dict, prompt_len: int, steps: int, dev) -> bool:
    from cp_modules.modules.hf_swap import swap_attention

    label = NAMES[name]
    with _parity_device(dev):
        hf, model = bench_parity.build(name, dtype=torch.float32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g).to(dev)
    feed = torch.randint(0, vocab, (steps,), generator=g).to(dev)
    # fp32 weights, fp32 cache; prefilled in chunks (fp32 prefill runs the reference
    # attention, whose scores of a whole 16k prompt at 128 heads would not fit).
    ref = _decode_logits(model, prompt, feed, "bf16", prefill_chunk=REF_PREFILL_CHUNK)
    del model
    gc.collect()
    # The same weights rounded once to bf16; the rotary frequencies stay fp32, as in a bf16
    # checkpoint (rounded, they alone would move the logits far from the fp32 model's).
    half = swap_attention(bench_parity.cast_keeping_rope(hf, torch.bfloat16))
    got = {dt: _decode_logits(half, prompt, feed, dt) for dt in ("bf16", "fp8_e4m3")}
    del hf, half
    e16, m16 = _errors(got["bf16"], ref)
    e8, m8 = _errors(got["fp8_e4m3"], ref)
    e8_16, m8_16 = _errors(got["fp8_e4m3"], got["bf16"])
    vals = {
        f"bf16 KV logits error (vs fp32) {label}": e16,
        f"fp8 KV logits error (vs fp32) {label}": e8,
        f"fp8 KV logits error (vs bf16 KV) {label}": e8_16,
        f"bf16 KV logits max abs error (vs fp32) {label}": m16,
        f"fp8 KV logits max abs error (vs fp32) {label}": m8,
        f"fp8 KV logits max abs error (vs bf16 KV) {label}": m8_16,
    }
    finite = all(torch.isfinite(torch.tensor(v)) for v in vals.values()) and e16 > 0
    checks[f"logits {label}"] = {"ok": bool(finite), "prompt_len": prompt_len, "steps": steps,
                                 **vals}  # fmt: skip
    if not finite:
        print(f"logits {label}: non-finite or zero errors {vals}", flush=True)
        return False
    rows.update(vals)
    rows[RATIO_ROW.format(label)] = e8 / e16
    print(f"logits {label} prompt {prompt_len} + {steps} steps: bf16 KV {e16:.3e}, fp8 KV "
          f"{e8:.3e} (x{e8 / e16:.3f}), fp8 vs bf16 KV {e8_16:.3e}", flush=True)  # fmt: skip
    return True
