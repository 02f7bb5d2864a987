"""Shard-only loading: a rank reads, from a HF safetensors checkpoint, only what it keeps."""

from cp_modules.loading.checkpoint import CheckpointIndex, TensorEntry
from cp_modules.loading.materialize import (
    global_shapes,
    local_box,
    materialize_from_checkpoint,
    meta_causal_lm,
)
from cp_modules.loading.pretrained import load_pretrained
from cp_modules.loading.sources import Source, plan_sources

__all__ = [
    "CheckpointIndex",
    "Source",
    "TensorEntry",
    "global_shapes",
    "load_pretrained",
    "local_box",
    "materialize_from_checkpoint",
    "meta_causal_lm",
    "plan_sources",
]
