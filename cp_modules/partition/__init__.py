"""DualChunkSwap partition of prefill tokens over PCP ranks: plan, gather-restore, attention."""

from cp_modules.ops.pcp_attention import pcp_prefill_attention
from cp_modules.partition.plan import SEGMENT_FIELDS, PCPPlan, plan_pcp
from cp_modules.partition.restore import pcp_gather_restore

__all__ = ["SEGMENT_FIELDS", "PCPPlan", "pcp_gather_restore", "pcp_prefill_attention", "plan_pcp"]
