"""HF models with sliding windows, attention sinks and soft-capping on gloo ranks: greedy
generation through the engine at tp2 x pcp2 x dcp2 equals HF ``generate`` on one process
(gpt-oss: sinks, windowed and full layers; Gemma 3: windowed and full layers; Gemma 2: window
and soft-cap; EXAONE 4: windowed and rope-less full layers, q/k norms replicated over TP;
Gemma 3n: windowed and full layers, two of them reading the K/V of earlier layers, MLPs with
activation sparsity; Gemma 3 loaded as its multimodal class: its language model, text only; Gemma 4: K/V-shared
layers and wider heads on its full layers). Windows of 3 keys are shorter than every prompt, so they change the tokens."""

from __future__ import annotations

import pytest

from cp_modules.testing import hf_greedy_tokens, run_distributed

pytestmark = pytest.mark.distributed

PROMPT_LENS = (11, 5, 8)
MAX_NEW_TOKENS = 6
FAMILIES = ("gpt_oss", "gemma3", "gemma2", "exaone4", "gemma3n", "gemma3_multimodal", "gemma4")


def _model(family: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=3,
                  layer_types=["sliding_attention", "full_attention"], bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)  # fmt: skip
    if family == "gpt_oss":
        model = tf.GptOssForCausalLM(
            tf.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        )
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    elif family == "gemma3n":
        # Layers 2-3 reuse the K/V of layers 0-1; the first two MLPs keep the 95 % activation
        # sparsity (statistics over the intermediate features: kept replicated over TP).
        four = dict(num_hidden_layers=4, layer_types=common["layer_types"] * 2)
        model = tf.Gemma3nForCausalLM(
            tf.Gemma3nTextConfig(**{**common, **four}, vocab_size_per_layer_input=256,
                                 hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                                 activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
                                 altup_num_inputs=2, laurel_rank=4)
        )  # fmt: skip
    elif family == "gemma3_multimodal":  # its language model, text-only inputs
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
        model = tf.Gemma3ForConditionalGeneration(
            tf.Gemma3Config(text_config=common, vision_config=vision, mm_tokens_per_image=4,
                            image_token_id=255, boi_token_id=254, eoi_token_id=253)
        )  # fmt: skip
    elif family == "gemma4":  # K/V-shared layers, wider full-layer heads
        four = dict(num_hidden_layers=4, layer_types=common["layer_types"] * 2)
        model = tf.Gemma4ForCausalLM(
            tf.Gemma4TextConfig(**{**common, **four}, vocab_size_per_layer_input=256,
                                hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                                per_layer_config={"01": {"head_dim": 32}, "03": {"head_dim": 32}})
        )  # fmt: skip
    elif family == "exaone4":
        model = tf.Exaone4ForCausalLM(tf.Exaone4Config(**common))
    elif family == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common))
    else:
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(attn_logit_softcapping=5.0, **common))
    return model.eval()


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_generate(family: str) -> list[list[int]]:
    return hf_greedy_tokens(_model(family), _prompts(), MAX_NEW_TOKENS)


def _rank_body(rank: int, world_size: int, families):
    from cp_modules.config import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention

    config = ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                            decode_context_parallel_size=2, dcp_comm_backend="a2a")  # fmt: skip
    groups = init_cp_groups(config)
    out = {}
    for family in families:
        model = swap_attention(_model(family), groups)
        engine = GenerationEngine(model, groups, block_size=4, max_num_tokens=16, progress=False)
        out[family] = engine.generate(
            _prompts(), SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
        ).outputs
    return out


def test_windowed_and_sink_models_generate_like_hf_at_tp2_pcp2_dcp2():
    results = run_distributed(_rank_body, 4, FAMILIES, timeout_s=900)
    for family in FAMILIES:
        want = _hf_generate(family)
        for rank, got in enumerate(results):
            assert got[family] == want, (family, rank, got[family], want)
