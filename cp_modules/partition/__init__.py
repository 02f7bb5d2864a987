"""DualChunkSwap partition of prefill tokens over PCP ranks: plan and gather-restore."""

from cp_modules.partition.plan import SEGMENT_FIELDS, PCPPlan, plan_pcp
from cp_modules.partition.restore import pcp_gather_restore

__all__ = ["SEGMENT_FIELDS", "PCPPlan", "pcp_gather_restore", "plan_pcp"]
