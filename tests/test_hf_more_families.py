"""More transformers families through ``swap_attention`` on one process: logits of a ragged
batch flattened into one row equal the original model's (run prompt by prompt), with and
without the paged KV cache (the prompts' second halves over their cached first halves).

Tiny configs (hidden 64, 8 query heads, 2 KV heads unless the family has none, 2 layers) of
families beyond :data:`~cp_modules.modules.hf_families.FAMILIES`: windowed layer mixes
(Cohere 2, OLMo 3, Gemma 2 and 3, gpt-oss, windowed Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE,
Phi-3, Starcoder2), rope-less layers (SmolLM3), MoE families, and families whose attention
or norms differ from Llama's (Phi, Nemotron, BitNet's sub-norm, HunYuan, ERNIE 4.5, Helium,
Apertus, Arcee, Seed-OSS, GLM, OPT's learned positions), and DeepSeek-style MLA in MiniCPM3,
GLM-4-MoE-Lite, Youtu and AXK1. Then the language model of multimodal models (Gemma 3,
Gemma 4, Qwen2.5-VL, Qwen3-VL, SmolVLM, InternVL, Mistral 3, LLaVA) for text-only inputs;
PaliGemma (a prefix LM) refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_hf_swap import LENS, _check_over_the_paged_cache, _original_logits, _prompts, _run_step

from cp_modules.modules.hf_swap import allocate_kv_caches, swap_attention

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
MIXED = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
SLIDING = dict(sliding_window=4, use_sliding_window=True, max_window_layers=1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MHA = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
MLA = dict(
    COMMON, num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
)  # fmt: skip

GEMMA4 = dict(
    COMMON, num_hidden_layers=4, num_attention_heads=4, head_dim=16, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"] * 2, vocab_size_per_layer_input=256,
    hidden_size_per_layer_input=8, num_kv_shared_layers=2,
    per_layer_config={"01": {"head_dim": 32}, "03": {"head_dim": 32}},
)  # fmt: skip

# name: (config class, causal-LM class, config kwargs)
CASES = {
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {**COMMON, **MIXED}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {**COMMON, **MIXED}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**COMMON, "head_dim": 8, "sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**COMMON, "head_dim": 8, **MIXED}),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **COMMON,
            "intermediate_size": 64,
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            **MIXED,
        },
    ),  # fmt: skip
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {**COMMON, "sliding_window": 4}),
    "mixtral_window": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**COMMON, "sliding_window": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),  # fmt: skip
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", {**COMMON, **SLIDING}),
    "qwen3_window": ("Qwen3Config", "Qwen3ForCausalLM", {**COMMON, "head_dim": 8, **SLIDING}),
    "qwen3_moe_window": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**COMMON, "head_dim": 8, **MOE, **SLIDING},
    ),  # fmt: skip
    "phi3_window": ("Phi3Config", "Phi3ForCausalLM", {**COMMON, "sliding_window": 4}),
    "starcoder2_window": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        {**COMMON, "sliding_window": 4},
    ),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", COMMON),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**COMMON, **MOE, "shared_expert_intermediate_size": 32},
    ),  # fmt: skip
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {**COMMON, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        {**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),  # fmt: skip
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        {**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),  # fmt: skip
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            **COMMON,
            "head_dim": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),  # fmt: skip
    "hunyuan_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        {**COMMON, "head_dim": 8, "num_experts": 4, "moe_topk": 2},
    ),  # fmt: skip
    "phi": ("PhiConfig", "PhiForCausalLM", {**MHA, "qk_layernorm": True}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", COMMON),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", COMMON),
    "hunyuan_dense": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        {**COMMON, "head_dim": 8},
    ),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {**COMMON, "head_dim": 8}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {**COMMON, "head_dim": 8}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", COMMON),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", COMMON),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {**COMMON, "head_dim": 8}),
    "glm": ("GlmConfig", "GlmForCausalLM", {**COMMON, "head_dim": 8}),
    # Gemma 4: layers 2-3 reuse the K/V of layers 0-1, the full layers have wider heads and
    # proportional rope; its model slices masks by logits_to_keep (the whole mask here).
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(GEMMA4, pad_token_id=None)),
    # DeepSeek-style MLA in other families (module swap to HFCPMLAAttention).
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", MLA),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", MLA),
    "youtu": ("YoutuConfig", "YoutuForCausalLM", MLA),
    "axk1": ("AXK1Config", "AXK1ForCausalLM", MLA),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {**MHA, "ffn_dim": 128, "word_embed_proj_dim": 64, "dropout": 0.0},
    ),  # fmt: skip
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_equal_the_original_model_with_and_without_a_paged_cache(name):
    import transformers as tf

    config_cls, model_cls, kwargs = CASES[name]
    if not hasattr(tf, model_cls):
        pytest.skip(f"transformers {tf.__version__} has no {model_cls}")
    torch.manual_seed(0)
    original = getattr(tf, model_cls)(getattr(tf, config_cls)(**kwargs)).float().eval()
    prompts = _prompts()
    want = _original_logits(original, prompts)
    model = swap_attention(copy.deepcopy(original))
    got = _run_step(model, prompts, [0] * len(prompts), list(LENS))
    torch.testing.assert_close(got, torch.cat(want))
    allocate_kv_caches(model, 16, 4, dtype=torch.float32)
    _check_over_the_paged_cache(model, prompts, want)


def _multimodal(name: str):
    """A tiny multimodal model whose language model is a tiny family (vision towers tiny too)."""
    import transformers as tf

    from cp_modules.modules.hf_families import tiny_config

    torch.manual_seed(0)
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    if name == "gemma3":
        text = dict(COMMON, num_attention_heads=4, head_dim=16, **MIXED)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
        config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                 image_token_id=255, boi_token_id=254, eoi_token_id=253)  # fmt: skip
        return tf.Gemma3ForConditionalGeneration(config).eval()
    if name == "qwen2_5_vl":  # multimodal rope: text-only positions are 1-D
        text = {**tiny_config("qwen2").to_dict(), "rope_parameters": mrope}
        vision = dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64
        )
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
        return tf.Qwen2_5_VLForConditionalGeneration(config).eval()
    if name == "gemma4":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, head_dim=16)  # fmt: skip
        config = tf.Gemma4Config(text_config=dict(GEMMA4, pad_token_id=0), vision_config=vision,
                                 audio_config=None)  # fmt: skip
        return tf.Gemma4ForConditionalGeneration(config).eval()
    if name == "qwen3_vl":
        text = {
            **tiny_config("qwen3").to_dict(),
            "rope_parameters": {**mrope, "mrope_interleaved": True},
        }
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4,
                      out_hidden_size=64, deepstack_visual_indexes=[0])  # fmt: skip
        config = tf.Qwen3VLConfig(text_config=text, vision_config=vision)
        return tf.Qwen3VLForConditionalGeneration(config).eval()
    small_vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    if name == "smolvlm":
        text = {**tiny_config("llama").to_dict(), "model_type": "llama"}
        config = tf.SmolVLMConfig(text_config=text, vision_config=small_vision)
        return tf.SmolVLMForConditionalGeneration(config).eval()
    if name == "internvl":  # passes image_sizes=None down to its layers
        text = {**tiny_config("qwen2").to_dict(), "model_type": "qwen2"}
        config = tf.InternVLConfig(text_config=text, vision_config=small_vision)
        return tf.InternVLForConditionalGeneration(config).eval()
    if name == "paligemma":  # a prefix LM: bidirectional over the prompt
        text = {**tiny_config("gemma").to_dict(), "model_type": "gemma"}
        config = tf.PaliGemmaConfig(
            text_config=text, vision_config={**small_vision, "projection_dim": 64}
        )
        return tf.PaliGemmaForConditionalGeneration(config).eval()
    if name == "mistral3":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, head_dim=16)  # fmt: skip
        config = tf.Mistral3Config(
            text_config=tiny_config("mistral").to_dict(), vision_config=vision
        )
        return tf.Mistral3ForConditionalGeneration(config).eval()
    text = {**tiny_config("llama").to_dict(), "model_type": "llama"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    return tf.LlavaForConditionalGeneration(
        tf.LlavaConfig(text_config=text, vision_config=vision)
    ).eval()


MULTIMODAL = [
    "gemma3",
    "gemma4",
    "qwen2_5_vl",
    "qwen3_vl",
    "smolvlm",
    "internvl",
    "mistral3",
    "llava",
]


@pytest.mark.parametrize("name", MULTIMODAL)
def test_a_multimodal_models_language_model_serves_text_only_inputs(name):
    import transformers as tf

    from cp_modules.modules import CPRuntime, build_step_metadata, cp_step
    from cp_modules.modules.hf_swap import cp_attention_layers

    if name == "gemma4" and not hasattr(tf, "Gemma4ForConditionalGeneration"):
        pytest.skip(f"transformers {tf.__version__} has no Gemma 4")
    original = _multimodal(name)
    prompts = _prompts()
    want = _original_logits(original, prompts)
    model = swap_attention(copy.deepcopy(original))
    layers = cp_attention_layers(model)
    assert len(layers) == (4 if name == "gemma4" else 2)
    decoder = model.get_decoder()
    assert all(any(m is layer for m in decoder.modules()) for layer in layers)
    config = model.config
    assert config.get_text_config()._attn_implementation == "cp"
    assert config.vision_config._attn_implementation != "cp"  # the vision tower keeps its own
    got = _run_step(model, prompts, [0] * len(prompts), list(LENS))
    torch.testing.assert_close(got, torch.cat(want))
    allocate_kv_caches(model, 16, 4, dtype=torch.float32)
    _check_over_the_paged_cache(model, prompts, want)
    # Images are not split over ranks: refused under a cp step.
    meta = build_step_metadata(CPRuntime.single(), [4])
    with torch.no_grad(), cp_step(meta), pytest.raises(ValueError, match="'pixel_values'"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), position_ids=meta.positions[None],
              pixel_values=torch.zeros(1, 3, 28, 28), use_cache=False)  # fmt: skip


def test_a_multimodal_prefix_lm_is_refused():
    with pytest.raises(ValueError, match=r"language_model.layers.0.self_attn.*non-causal"):
        swap_attention(_multimodal("paligemma"))
