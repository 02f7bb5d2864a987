"""A compact generation engine on the paged, DCP-sharded KV cache, and its launcher."""

from cp_modules.engine.engine import GenerationEngine, GenerationResult, GenerationStats
from cp_modules.engine.launch import LaunchError, launch, under_torchrun
from cp_modules.engine.sampling import SamplingParams, sample_tokens
from cp_modules.engine.scheduler import Request, Scheduler, StepBatch

__all__ = [
    "GenerationEngine",
    "GenerationResult",
    "GenerationStats",
    "LaunchError",
    "Request",
    "SamplingParams",
    "Scheduler",
    "StepBatch",
    "launch",
    "sample_tokens",
    "under_torchrun",
]
