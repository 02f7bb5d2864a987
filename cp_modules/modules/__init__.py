"""Context-parallel attention modules and the per-step metadata they share."""

from cp_modules.modules.attention import (
    CPFlashAttention,
    CPMLAAttention,
    RMSNorm,
    apply_tensor_parallel,
)
from cp_modules.step import (
    CPRuntime,
    CPStepMetadata,
    build_step_metadata,
    cp_step,
    current_step,
    restore_tokens,
)

__all__ = [
    "CPFlashAttention",
    "CPMLAAttention",
    "CPRuntime",
    "CPStepMetadata",
    "RMSNorm",
    "apply_tensor_parallel",
    "build_step_metadata",
    "cp_step",
    "current_step",
    "restore_tokens",
]
