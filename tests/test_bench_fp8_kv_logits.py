"""The fp8 KV logits-error rows of ``benchmarks.bench_fp8_kv --logits`` on the CPU: their paged
prefill + decode path equals HF's own forward (fp32), and tiny GQA and MLA models give finite
rows under the goal's names."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import bench_parity
from benchmarks import fp8_kv_logits as bench


@pytest.mark.parametrize("name", ["qwen2.5-7b", "deepseek-v3"])
def test_decode_logits_equal_hf_forward_fp32(name):
    with bench._parity_device(torch.device("cpu")):
        hf, cp = bench_parity.build(name, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (70,), generator=g)  # crosses a block
    prompt, feed = ids[:67], ids[67:]
    got = bench._decode_logits(cp, prompt, feed, "bf16")  # the fp32 model's fp32 cache
    chunked = bench._decode_logits(cp, prompt, feed, "bf16", prefill_chunk=24)  # the reference's
    with torch.no_grad():
        want = hf(input_ids=ids[None], use_cache=False).logits[0, 67:70].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked, want, atol=1e-4, rtol=1e-4)


def test_bf16_copy_keeps_fp32_rotary_frequencies():
    with bench._parity_device(torch.device("cpu")):
        hf, _ = bench_parity.build("llama3-8b", dtype=torch.float32)
    half = bench_parity.cast_keeping_rope(hf, torch.bfloat16)
    bufs = {n: b for n, b in half.named_buffers() if n.endswith("inv_freq")}
    assert bufs and all(b.dtype == torch.float32 for b in bufs.values())
    assert next(half.parameters()).dtype == torch.bfloat16


def test_logits_rows_are_finite_gqa_and_mla():
    rows: dict = {}
    checks: dict = {}
    ok = bench.logits_error_rows(
        ["llama3-8b", "deepseek-v3"], rows, checks, prompt_len=130, steps=2, device="cpu"
    )
    assert ok, checks
    for label in ("Llama-3-8B", "DeepSeek-V3"):
        ratio = rows[f"fp8 KV logits error / bf16 KV logits error (vs fp32) {label}"]
        e16 = rows[f"bf16 KV logits error (vs fp32) {label}"]
        e8 = rows[f"fp8 KV logits error (vs fp32) {label}"]
        assert math.isfinite(ratio) and ratio == e8 / e16
        # Both bf16 runs differ from fp32, and the fp8 cache from the bf16 one: each run
        # really took its own precision.
        assert e16 > 0 and rows[f"fp8 KV logits error (vs bf16 KV) {label}"] > 0
        assert checks[f"logits {label}"]["ok"]
