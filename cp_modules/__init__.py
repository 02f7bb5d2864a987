"""cp_modules: context-parallel attention (PCP prefill, DCP decode) for PyTorch."""

from cp_modules.config import ParallelConfig
from cp_modules.loading import load_pretrained
from cp_modules.modules import (
    CPFlashAttention,
    CPMLAAttention,
    CPRuntime,
    apply_tensor_parallel,
    build_step_metadata,
    cp_step,
    restore_tokens,
)
from cp_modules.modules.hf_swap import swap_attention
from cp_modules.ops.correct_attn_out import correct_attn_out
from cp_modules.ops.dcp_comm import DCPCommSpec, dcp_combine, dcp_prepare_query
from cp_modules.ops.kv_cache import write_kv_cache, write_mla_cache
from cp_modules.ops.lse_combine import lse_combine, lse_combine_packed
from cp_modules.ops.paged_decode import paged_attention, paged_mla_attention
from cp_modules.ops.pcp_attention import pcp_prefill_attention
from cp_modules.partition import PCPPlan, pcp_gather_restore, plan_pcp

__all__ = [
    "CPFlashAttention",
    "CPMLAAttention",
    "CPRuntime",
    "apply_tensor_parallel",
    "build_step_metadata",
    "cp_step",
    "restore_tokens",
    "swap_attention",
    "load_pretrained",
    "DCPCommSpec",
    "PCPPlan",
    "ParallelConfig",
    "correct_attn_out",
    "dcp_combine",
    "dcp_prepare_query",
    "lse_combine",
    "lse_combine_packed",
    "paged_attention",
    "paged_mla_attention",
    "pcp_gather_restore",
    "pcp_prefill_attention",
    "plan_pcp",
    "write_kv_cache",
    "write_mla_cache",
]
__version__ = "0.1.0"
