"""DCPCommSpec: what a decode step communicates over its DCP group, as plain values.

Built once per rank from its process groups (:meth:`DCPCommSpec.from_groups`) and carried by
the step's runtime; the DCP ops (:mod:`cp_modules.ops.dcp_comm`) take it as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cp_modules.distributed.groups import CPGroups

__all__ = ["DCP_REDUCE_STRATEGIES", "DCPCommSpec"]

DCP_REDUCE_STRATEGIES = ("none", "reduce_scatter", "all_reduce", "all_reduce_slice", "a2a")


@dataclass(frozen=True)
class DCPCommSpec:
    """Everything a decode step needs to communicate, as plain (picklable, hashable) values.

    Attributes:
        dcp_group: name of the DCP process group; its group ranks are the KV shard indices.
        dcp_size: ``N``, ranks in the DCP group.
        dcp_rank: this rank's index in the DCP group (its KV shard).
        gather_group: name of the query all-gather group (partial or full TP).
        gather_size: ``G``, ranks in it (1 = no gather).
        gather_rank: this rank's index in it, i.e. the block of its own heads among the
            gathered heads.
        reduce: one of :data:`DCP_REDUCE_STRATEGIES`.
        packed: ``a2a`` only: move outputs and LSEs in one all-to-all.
        peer_slots: per DCP peer, in group-rank order, the index of its head block among the
            ``G`` gathered blocks.

    Raises:
        ValueError: for values no decode step could use (out of range, inconsistent with the
            reduce strategy).
    """

    dcp_group: str
    dcp_size: int
    dcp_rank: int
    gather_group: str
    gather_size: int
    gather_rank: int
    reduce: str
    packed: bool
    peer_slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.reduce not in DCP_REDUCE_STRATEGIES:
            raise ValueError(
                f"reduce must be one of {list(DCP_REDUCE_STRATEGIES)}, got {self.reduce!r}"
            )
        for name in ("dcp_size", "gather_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.dcp_rank < self.dcp_size:
            raise ValueError(f"dcp_rank must be in [0, {self.dcp_size}), got {self.dcp_rank}")
        if not 0 <= self.gather_rank < self.gather_size:
            raise ValueError(
                f"gather_rank must be in [0, {self.gather_size}), got {self.gather_rank}"
            )
        slots = tuple(self.peer_slots)
        object.__setattr__(self, "peer_slots", slots)
        if len(slots) != self.dcp_size or not all(0 <= s < self.gather_size for s in slots):
            raise ValueError(
                f"peer_slots must hold dcp_size={self.dcp_size} head-block indices in "
                f"[0, gather_size={self.gather_size}), got {slots}"
            )
        if slots[self.dcp_rank] != self.gather_rank:
            raise ValueError(
                f"peer_slots[dcp_rank={self.dcp_rank}]={slots[self.dcp_rank]} must equal "
                f"gather_rank={self.gather_rank}: a rank's own heads are its gathered block"
            )
        if (self.reduce == "none") != (self.dcp_size == 1):
            raise ValueError(
                f"reduce={self.reduce!r} with dcp_size={self.dcp_size}: use 'none' exactly "
                "when dcp_size == 1"
            )
        if self.reduce == "none" and self.gather_size != 1:
            raise ValueError(f"reduce='none' needs gather_size=1, got {self.gather_size}")
        if self.reduce == "reduce_scatter" and slots != tuple(range(self.dcp_size)):
            raise ValueError(
                f"reduce='reduce_scatter' needs peer i to own gathered block i "
                f"(peer_slots={tuple(range(self.dcp_size))}), got {slots}; use "
                "'all_reduce_slice' or 'a2a'"
            )
        if self.reduce == "all_reduce" and self.gather_size != 1:
            raise ValueError(
                f"reduce='all_reduce' needs peers that own the same heads (gather_size=1), got "
                f"gather_size={self.gather_size}; use 'all_reduce_slice' or 'a2a'"
            )
        if self.packed and self.reduce != "a2a":
            raise ValueError(f"packed=True applies to reduce='a2a' only, got {self.reduce!r}")

    @classmethod
    def from_groups(
        cls, groups: CPGroups, *, packed: bool = True, reduce: str | None = None
    ) -> DCPCommSpec:
        """The spec of this rank for the configuration ``groups`` was built from.

        Args:
            groups: this rank's :class:`~cp_modules.distributed.groups.CPGroups`.
            packed: with the ``a2a`` backend, move outputs and LSEs in one all-to-all
                (ignored for other backends).
            reduce: override the configuration's reduce strategy (e.g. ``"reduce_scatter"``
                where peers own the gathered blocks in order); default: ``groups.plan.reduce``.
        """
        reduce = groups.plan.reduce if reduce is None else reduce
        gather_ranks = groups.ranks("partial_tp")
        first_tp = groups.layout.coords(gather_ranks[0])["tp"]
        return cls(
            dcp_group=groups.dcp_name,
            dcp_size=groups.config.dcp,
            dcp_rank=groups.dcp_rank,
            gather_group=groups.partial_tp_name,
            gather_size=len(gather_ranks),
            gather_rank=groups.local_rank("partial_tp"),
            reduce=reduce,
            packed=packed and reduce == "a2a",
            peer_slots=tuple(t - first_tp for t in groups.dcp_peer_tp_positions),
        )
