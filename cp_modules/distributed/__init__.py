"""Rank layout (pure math), process groups and meshes, and collective helpers."""

from cp_modules.distributed.layout import CommPlan, RankLayout, comm_plan, rank_layout

__all__ = ["CommPlan", "RankLayout", "comm_plan", "rank_layout"]
