"""Rank layout and decode communication plan, as pure functions of a ParallelConfig.

Ranks are laid out as ``(dp, pp, pcp, tp)`` with tp innermost. Nothing here touches
torch.distributed: the same functions feed the CLI planner, the real group builder and tests.

Group kinds (lists of global ranks):
- tp: a row of one pcp slice; TP position t owns heads [t*H/tp, (t+1)*H/tp).
- pcp: the same TP position across the pcp slices.
- dcp: spans PCP first, then TP: each (pcp, tp) block is transposed to (tp, pcp), flattened and
  cut into runs of dcp ranks.
- partial_tp: within one pcp slice, the TP positions covered by one DCP group (the query
  all-gather group for decode).
- ep: dp x tp, not pcp (for MoE layers).
- replica: every rank of one data-parallel replica (pp x pcp x tp): the ranks that work on the
  same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cp_modules.config import ParallelConfig

__all__ = ["CommPlan", "RankLayout", "comm_plan", "head_range", "rank_layout"]


@dataclass(frozen=True)
class RankLayout:
    """Every group of a configuration, as lists of global ranks."""

    world_size: int
    tp_groups: list[list[int]]
    pcp_groups: list[list[int]]
    dcp_groups: list[list[int]]
    partial_tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    pp_groups: list[list[int]]
    ep_groups: list[list[int]]
    replica_groups: list[list[int]]
    dp_pcp_groups: list[list[int]]
    sizes: tuple[int, int, int, int]  # (dp, pp, pcp, tp)

    def coords(self, rank: int) -> dict[str, int]:
        """(dp, pp, pcp, tp) coordinates of a global rank."""
        return _coords(rank, self.sizes)

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` (``"tp"``, ``"pcp"``, ``"dcp"``, ...) that holds ``rank``."""
        groups: list[list[int]] = getattr(self, f"{kind}_groups")
        for g in groups:
            if rank in g:
                return g
        raise AssertionError(f"rank {rank} is in no {kind} group")


def _coords(rank: int, sizes: tuple[int, int, int, int]) -> dict[str, int]:
    dp, pp, pcp, tp = sizes
    return {
        "dp": rank // (pp * pcp * tp),
        "pp": rank // (pcp * tp) % pp,
        "pcp": rank // tp % pcp,
        "tp": rank % tp,
    }


def rank_layout(config: ParallelConfig) -> RankLayout:
    """All groups of ``config`` (pure; no torch.distributed)."""
    dp, pp, pcp, tp, dcp = config.dp, config.pp, config.pcp, config.tp, config.dcp

    def rank(d: int, p: int, c: int, t: int) -> int:
        return ((d * pp + p) * pcp + c) * tp + t

    tp_groups, pcp_groups, dcp_groups, partial_tp_groups = [], [], [], []
    for d in range(dp):
        for p in range(pp):
            tp_groups += [[rank(d, p, c, t) for t in range(tp)] for c in range(pcp)]
            pcp_groups += [[rank(d, p, c, t) for c in range(pcp)] for t in range(tp)]
            transposed = [rank(d, p, c, t) for t in range(tp) for c in range(pcp)]
            dcp_groups += [transposed[i : i + dcp] for i in range(0, len(transposed), dcp)]
            k = config.tp_positions_per_dcp_group
            for i in range(tp // k):
                for c in range(pcp):
                    partial_tp_groups.append([rank(d, p, c, t) for t in range(i * k, (i + 1) * k)])
    dp_groups = [
        [rank(d, p, c, t) for d in range(dp)]
        for p in range(pp)
        for c in range(pcp)
        for t in range(tp)
    ]
    pp_groups = [
        [rank(d, p, c, t) for p in range(pp)]
        for d in range(dp)
        for c in range(pcp)
        for t in range(tp)
    ]
    ep_groups = [
        [rank(d, p, c, t) for d in range(dp) for t in range(tp)]
        for p in range(pp)
        for c in range(pcp)
    ]
    replica_groups = [
        [rank(d, p, c, t) for p in range(pp) for c in range(pcp) for t in range(tp)]
        for d in range(dp)
    ]
    dp_pcp_groups = [
        [rank(d, p, c, t) for d in range(dp) for c in range(pcp)]
        for p in range(pp)
        for t in range(tp)
    ]
    layout = RankLayout(
        world_size=config.world_size,
        tp_groups=tp_groups,
        pcp_groups=pcp_groups,
        dcp_groups=dcp_groups,
        partial_tp_groups=partial_tp_groups,
        dp_groups=dp_groups,
        pp_groups=pp_groups,
        ep_groups=ep_groups,
        replica_groups=replica_groups,
        dp_pcp_groups=dp_pcp_groups,
        sizes=(dp, pp, pcp, tp),
    )
    return layout


def head_range(num_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Query heads ``[start, end)`` owned by TP position ``tp_rank``."""
    per = num_heads // tp_size
    return tp_rank * per, (tp_rank + 1) * per


@dataclass(frozen=True)
class CommPlan:
    """How a decode step moves data for one configuration.

    Attributes:
        query_gather: ``"none"``, ``"partial_tp"`` or ``"full_tp"``: the query all-gather group.
        query_gather_size: ranks in that gather (1 = no gather).
        reduce: ``"none"`` (dcp == 1), ``"reduce_scatter"``, ``"all_reduce"`` (DCP peers already
            own the same heads), ``"all_reduce_slice"`` or ``"a2a"``.
        query_gather_fraction: heads gathered relative to a full TP gather (0 = no gather).
    """

    query_gather: str
    query_gather_size: int
    reduce: str
    query_gather_fraction: float

    @property
    def query_gather_savings(self) -> float:
        """Share of the full-TP query all-gather volume this plan avoids."""
        return 1.0 - self.query_gather_fraction


def comm_plan(config: ParallelConfig) -> CommPlan:
    """Decode communication plan of ``config`` (SPEC section 1 table)."""
    tp, pcp, dcp = config.tp, config.pcp, config.dcp
    if dcp == 1:
        return CommPlan("none", 1, "none", 0.0)
    k = config.tp_positions_per_dcp_group
    if k == 1:
        gather = "none"
    elif k == tp:
        gather = "full_tp"
    else:
        gather = "partial_tp"
    fraction = 0.0 if k == 1 else k / tp
    if config.dcp_comm_backend == "a2a":
        reduce = "a2a"
    elif pcp == 1 and dcp == tp:
        reduce = "reduce_scatter"
    elif k == 1:
        reduce = "all_reduce"
    else:
        reduce = "all_reduce_slice"
    return CommPlan(gather, k, reduce, fraction)
