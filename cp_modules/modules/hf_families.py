"""Tiny configurations of the HuggingFace families cp serves (offline, seeded random weights).

Each family is built from its transformers config class with tiny sizes (hidden 64, 8 query
heads, 2 KV heads, 2 layers, vocabulary 256) plus what makes the family itself: Qwen3's and
OLMo2's q/k norms, Phi-3's fused ``qkv_proj``, GLM-4's and StableLM's partial rotary, Cohere's
interleaved rope and logit scale, Granite's multipliers, llama3 and yarn rope scaling, MoE
layers, EXAONE 4's windowed and full (rope-less) layers, the GPT-style families (GPT-2's learned
positions, GPTBigCode's single KV head, GPT-J / CodeGen / GPT-NeoX partial rotary), DeepSeek's
MLA. Used by the tests and by the recipes' tiny ``model=`` choices.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["FAMILIES", "build_tiny", "tiny_config"]

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    # No stop token (HF's defaults would stop at id 2 or 0).
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
_MLA = dict(
    num_key_value_heads=8,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)
# MHA (or multi-query in GPTBigCode): these configs have no num_key_value_heads. Dropout off
# (cp refuses attention dropout in training; GPT-2's configs default to 0.1).
_GPT = dict(
    num_key_value_heads=None,
    attn_pdrop=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)

# family -> (transformers config class, causal-LM class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "max_position_embeddings": 128,
        },
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "attention_multiplier": 0.3,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
        },
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 8}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # GPT-style families whose attention module is ``attn`` / ``attention``.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {**_GPT, "scale_attn_by_inverse_layer_idx": True}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {**_GPT, "multi_query": True}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {**_GPT, "rotary_dim": 4}),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", {**_GPT, "rotary_dim": 4}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**_GPT, "rotary_pct": 0.5}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {"q_lora_rank": None, **_MLA}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {"q_lora_rank": 32, **_MLA}),
}


def tiny_config(family: str, **overrides):
    """A fresh transformers config of the tiny ``family`` model (``overrides`` win).

    Raises:
        ValueError: for an unknown family.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    config_cls, _, extra = FAMILIES[family]
    return getattr(transformers, config_cls)(**{**_COMMON, **copy.deepcopy(extra), **overrides})


def build_tiny(
    family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, config=None, **overrides
) -> nn.Module:
    """The tiny ``family`` causal LM with weights seeded by ``seed``, in eval mode.

    ``config``: a config to use instead of :func:`tiny_config` (copied: ``from_config`` keeps
    the object it is given).
    """
    import transformers

    cfg = copy.deepcopy(config) if config is not None else tiny_config(family, **overrides)
    if dtype == torch.float64 and family in ("deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral"):
        # The grouped-mm experts kernel has no fp64 path; the per-expert loop has one.
        cfg.experts_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])._from_config(cfg)
    return model.to(dtype).eval()
