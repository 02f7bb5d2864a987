"""swap_attention on one process: the model's own forward gives the original model's logits.

Families: Llama (GQA), Qwen2 (q/k/v bias), Mistral, DeepSeek-V3 (MLA; interleaved rope or not;
MoE layers), DeepSeek-V2 (MLA without q compression, complex rope). The swapped model is fed a
ragged batch of prompts flattened into one row (``input_ids [1, T]``, ``position_ids`` = the
step's positions) and its logits, restored to batch order, are compared with the original
model run prompt by prompt; then the same with a paged KV cache, the prompts prefilled in two
chunks (the second attends the cached first).
"""

from __future__ import annotations

import copy

import pytest
import torch

from cp_modules.cache.paged import allocate_kv_cache, allocate_mla_cache
from cp_modules.config import ParallelConfig
from cp_modules.modules import (
    CPFlashAttention,
    CPRuntime,
    build_step_metadata,
    cp_step,
    restore_tokens,
)
from cp_modules.modules.hf_swap import (
    CP_ATTN_IMPLEMENTATION,
    HFCPFlashAttention,
    HFCPMLAAttention,
    cp_attention_layers,
    swap_attention,
)

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=8, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MLA = dict(num_key_value_heads=8, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
           n_group=1, topk_group=1, first_k_dense_replace=1)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is fastest, and spin-waiting threads crawl on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _build(family: str):
    import transformers as tf

    if family == "llama":
        cfg, cls = tf.LlamaConfig(num_key_value_heads=2, **COMMON), tf.LlamaForCausalLM
    elif family == "llama_bias":
        cfg = tf.LlamaConfig(num_key_value_heads=4, attention_bias=True, **COMMON)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(num_key_value_heads=2, **COMMON), tf.Qwen2ForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(num_key_value_heads=4, sliding_window=None, **COMMON)
        cls = tf.MistralForCausalLM
    elif family == "deepseek_v3":
        cfg, cls = tf.DeepseekV3Config(q_lora_rank=32, **MLA, **COMMON), tf.DeepseekV3ForCausalLM
    elif family == "deepseek_v3_plain_rope":
        cfg = tf.DeepseekV3Config(q_lora_rank=32, rope_interleave=False, **MLA, **COMMON)
        cls = tf.DeepseekV3ForCausalLM
    elif family == "deepseek_v2":
        cfg, cls = tf.DeepseekV2Config(q_lora_rank=None, **MLA, **COMMON), tf.DeepseekV2ForCausalLM
    else:
        raise AssertionError(family)
    torch.manual_seed(0)
    # from_config keeps the config object: a fresh copy per model.
    return cls._from_config(copy.deepcopy(cfg)).eval()


FAMILIES = ["llama", "llama_bias", "qwen2", "mistral", "deepseek_v3", "deepseek_v3_plain_rope", "deepseek_v2"]
LENS = [13, 1, 6]


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g) for n in LENS]


def _original_logits(model, prompts):
    with torch.no_grad():
        return [model(input_ids=p[None]).logits[0] for p in prompts]


def _run_step(model, prompts, starts, ends, block_table=None):
    """Logits [N, V] of prompt tokens [start, end) of each request, in batch order."""
    rt = CPRuntime.single()
    meta = build_step_metadata(
        rt, [e - s for s, e in zip(starts, ends)], starts, block_table=block_table, block_size=4
    )
    flat = torch.cat([p[s:e] for p, s, e in zip(prompts, starts, ends)])
    with torch.no_grad(), cp_step(meta):
        logits = model(input_ids=flat[meta.token_indices][None], position_ids=meta.positions[None]).logits
        return restore_tokens(logits[0], meta)


@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_logits_equal_the_original_model(family):
    prompts = _prompts()
    original = _build(family)
    want = _original_logits(original, prompts)
    names = list(original.state_dict())

    model = swap_attention(_build(family))
    layers = cp_attention_layers(model)
    assert len(layers) == 2
    mla = family.startswith("deepseek")
    assert all(isinstance(m, HFCPMLAAttention if mla else HFCPFlashAttention) for m in layers)
    assert model.config._attn_implementation == CP_ATTN_IMPLEMENTATION
    assert list(model.state_dict()) == names  # same parameter names: checkpoints load as they are

    got = _run_step(model, prompts, [0] * len(prompts), [len(p) for p in prompts])
    torch.testing.assert_close(got, torch.cat(want))

    # Paged KV cache: prefill the first part of each prompt, then the rest over the cached prefix.
    for layer in layers:
        if isinstance(layer, CPFlashAttention):
            layer.kv_cache = allocate_kv_cache(16, 4, layer.num_kv_heads, layer.head_dim, dtype=torch.float32)
        else:
            layer.kv_cache = allocate_mla_cache(16, 4, layer.kv_lora_rank, layer.qk_rope_head_dim, dtype=torch.float32)
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    split = [n // 2 for n in LENS]
    split[1] = 1  # the one-token prompt is done in the first step
    _run_step(model, prompts, [0, 0, 0], split, table)
    rest = [i for i, (s, n) in enumerate(zip(split, LENS)) if s < n]
    got = _run_step(model, [prompts[i] for i in rest], [split[i] for i in rest], [LENS[i] for i in rest], table[rest])
    torch.testing.assert_close(got, torch.cat([want[i][split[i]:] for i in rest]))


def test_swap_keeps_the_weights_themselves():
    original = _build("qwen2")
    attn = original.model.layers[0].self_attn
    q, o = attn.q_proj, attn.o_proj
    swap_attention(original)
    new = original.model.layers[0].self_attn
    assert new.q_proj is q and new.o_proj is o and new.q_proj.bias is not None
    mla = _build("deepseek_v3")
    kv_b = mla.model.layers[1].self_attn.kv_b_proj
    swap_attention(mla)
    assert mla.model.layers[1].self_attn.kv_b_proj is kv_b
    assert mla.model.layers[1].self_attn.rope_interleave


def test_swap_is_idempotent():
    model = swap_attention(_build("llama"))
    layers = cp_attention_layers(model)
    swap_attention(model)
    assert cp_attention_layers(model) == layers


def test_swap_rejects_sliding_window_attention():
    import transformers as tf

    cfg = tf.MistralConfig(num_key_value_heads=4, sliding_window=16, **COMMON)
    with pytest.raises(ValueError, match="sliding_window=16"):
        swap_attention(tf.MistralForCausalLM(cfg))


def test_swap_rejects_a_layout_that_cannot_serve_the_heads():
    # 2 KV heads, tp=2, pcp=2, dcp=4: a DCP group would span ranks holding different KV heads.
    config = ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                            decode_context_parallel_size=4)
    with pytest.raises(ValueError, match="KV heads"):
        swap_attention(_build("llama"), config)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        swap_attention(_build("llama"), ParallelConfig(tensor_parallel_size=3))


def test_swap_rejects_models_without_attention_and_bad_arguments():
    with pytest.raises(ValueError, match="transformers model"):
        swap_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="ParallelConfig, CPGroups or None"):
        swap_attention(_build("llama"), {"tp": 2})


def test_swapped_attention_takes_one_row_of_tokens():
    model = swap_attention(_build("llama"))
    meta = build_step_metadata(CPRuntime.single(), [2, 2])
    with torch.no_grad(), cp_step(meta), pytest.raises(ValueError, match=r"hidden_states \[1, T, hidden\]"):
        model(input_ids=torch.zeros(2, 2, dtype=torch.long), position_ids=torch.zeros(2, 2, dtype=torch.long))
