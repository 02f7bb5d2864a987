"""Small models built from the CP modules (training recipes, tests, examples)."""

from cp_modules.models.tiny import ATTENTION_KINDS, SwiGLU, TinyLM, TinyLMConfig, parallelize_model

__all__ = ["ATTENTION_KINDS", "SwiGLU", "TinyLM", "TinyLMConfig", "parallelize_model"]
