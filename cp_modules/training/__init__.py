"""Context-parallel training pieces that need no trainer framework: batch sharding, loss,
FSDP2 over the dp x pcp ranks, full-tensor checkpoints, shard-only loading of a transformers
checkpoint and the streaming transformers export, and a byte-level text dataset."""

from cp_modules.training.checkpoint import (
    CheckpointFormatError,
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    read_checkpoint,
    write_checkpoint,
)
from cp_modules.training.context import (
    IGNORE_INDEX,
    CPBatch,
    CPTrainingContext,
    init_cp_training,
    lm_cross_entropy,
    make_step_current,
)
from cp_modules.training.data import ByteTextDataset
from cp_modules.training.export import export_hf
from cp_modules.training.fsdp import apply_fsdp, fsdp_mesh, mixed_precision_policy
from cp_modules.training.pretrained import load_for_training
from cp_modules.training.recompute import checkpoint_with_step

__all__ = [
    "IGNORE_INDEX",
    "ByteTextDataset",
    "CPBatch",
    "CPTrainingContext",
    "CheckpointFormatError",
    "apply_fsdp",
    "export_hf",
    "fsdp_mesh",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "init_cp_training",
    "lm_cross_entropy",
    "checkpoint_with_step",
    "load_for_training",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "make_step_current",
    "mixed_precision_policy",
    "read_checkpoint",
    "write_checkpoint",
]
