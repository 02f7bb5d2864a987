"""Build a HuggingFace causal LM from a :class:`~cp_modules.recipe_configs.ModelConf`.

Tiny models are made from a config with weights seeded by ``ModelConf.seed`` (no downloads);
``ModelConf.checkpoint`` loads a local model directory instead. Only the model class of the
family is imported, so ranks do not pay for all of transformers.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from cp_modules.recipe_configs import Family, ModelConf

__all__ = ["DTYPES", "build_model", "hf_config"]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _classes(family: Family):
    if family is Family.llama:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig, LlamaForCausalLM
    if family is Family.qwen2:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2Config, Qwen2ForCausalLM
    if family is Family.mistral:
        from transformers import MistralConfig, MistralForCausalLM

        return MistralConfig, MistralForCausalLM
    if family is Family.deepseek_v3:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        return DeepseekV3Config, DeepseekV3ForCausalLM
    raise ValueError(f"family must be one of {[f.value for f in Family]}, got {family!r}")


def hf_config(conf: ModelConf):
    """The transformers config of a tiny model described by ``conf`` (a fresh object)."""
    config_cls, _ = _classes(conf.family)
    common = dict(
        vocab_size=conf.vocab_size,
        hidden_size=conf.hidden_size,
        intermediate_size=conf.intermediate_size,
        num_hidden_layers=conf.num_layers,
        num_attention_heads=conf.num_heads,
        max_position_embeddings=conf.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": conf.rope_theta},
        initializer_range=conf.initializer_range,
        tie_word_embeddings=conf.tie_word_embeddings,
        # No stop token unless a workload asks for one (HF's defaults would stop at id 2).
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if conf.family is Family.deepseek_v3:
        return config_cls(
            num_key_value_heads=conf.num_heads,
            q_lora_rank=conf.q_lora_rank,
            kv_lora_rank=conf.kv_lora_rank,
            qk_nope_head_dim=conf.qk_nope_head_dim,
            qk_rope_head_dim=conf.qk_rope_head_dim,
            v_head_dim=conf.v_head_dim,
            rope_interleave=conf.rope_interleave,
            n_routed_experts=conf.num_experts,
            num_experts_per_tok=conf.num_experts_per_tok,
            moe_intermediate_size=conf.moe_intermediate_size,
            first_k_dense_replace=conf.first_k_dense_replace,
            n_group=1,
            topk_group=1,
            # The grouped-mm experts kernel has no fp64 path; the per-expert loop has one.
            **({"experts_implementation": "eager"} if conf.dtype == "float64" else {}),
            **common,
        )
    extra = {"head_dim": conf.head_dim} if conf.head_dim else {}
    if conf.family is Family.mistral:
        extra["sliding_window"] = None
    if conf.family is Family.llama:
        extra["attention_bias"] = conf.attention_bias
    return config_cls(num_key_value_heads=conf.num_kv_heads, **extra, **common)


def build_model(conf: ModelConf, device: torch.device | str | None = None) -> nn.Module:
    """The causal LM of ``conf`` in eval mode, in ``conf.dtype`` on ``device``.

    Tiny models get the same weights on every call and every rank (seeded); a checkpoint
    directory is loaded with ``from_pretrained`` (local files only).

    Raises:
        ValueError: for an unknown dtype or family.
    """
    if conf.dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {conf.dtype!r}")
    dtype = DTYPES[conf.dtype]
    if conf.checkpoint:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(conf.checkpoint, dtype=dtype, local_files_only=True)
    else:
        _, model_cls = _classes(conf.family)
        torch.manual_seed(conf.seed)
        # from_config keeps the config object it is given: a fresh one per model.
        model = model_cls._from_config(copy.deepcopy(hf_config(conf)))
        model = model.to(dtype)
    return model.to(device).eval() if device is not None else model.eval()
