"""Real process groups and the named DeviceMesh of a ParallelConfig.

Every rank must create every group in the same order (torch.distributed's rule), so the
builder walks the pure layout of :mod:`cp_modules.distributed.layout` and keeps the groups
holding this rank. Ops receive groups by name (``CPGroups.dcp_name`` ...), never as objects.

Every group takes the run's collective timeout (the default group's, unless the caller gives
one): a rank waiting on a peer that hangs fails after it, whichever group it waits in
(torch's own default for a new group is 30 minutes for gloo, 10 for NCCL).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cp_modules.config import ParallelConfig
from cp_modules.distributed.layout import CommPlan, RankLayout, comm_plan, rank_layout
from cp_modules.distributed.progress import progress_bars_on_rank_zero

__all__ = ["CPGroups", "flatten_mesh_axes", "group_timeout", "init_cp_groups", "init_distributed"]


@dataclass
class CPGroups:
    """This rank's groups for one ParallelConfig.

    Attributes hold the group objects and their rank lists; ``*_name`` properties give the
    names that cross op boundaries.
    """

    config: ParallelConfig
    layout: RankLayout
    plan: CommPlan
    rank: int
    mesh: DeviceMesh
    tp: dist.ProcessGroup
    pcp: dist.ProcessGroup
    dcp: dist.ProcessGroup
    partial_tp: dist.ProcessGroup
    ep: dist.ProcessGroup
    dp: dist.ProcessGroup
    replica: dist.ProcessGroup

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind``."""
        return self.layout.group_of(kind, self.rank)

    def local_rank(self, kind: str) -> int:
        """This rank's index within its group of ``kind``."""
        return self.ranks(kind).index(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)["tp"]

    @property
    def pcp_rank(self) -> int:
        return self.layout.coords(self.rank)["pcp"]

    @property
    def dcp_rank(self) -> int:
        """Shard index of this rank: its rank in the DCP process group.

        torch.distributed orders a group's ranks ascending, so shard order is ascending global
        rank within the DCP group (the layout lists members PCP-first, e.g. ``[0, 2, 1, 3]``).
        """
        return sorted(self.ranks("dcp")).index(self.rank)

    @property
    def dcp_peer_tp_positions(self) -> list[int]:
        """TP position of each DCP peer, in DCP-group rank order."""
        return [self.layout.coords(r)["tp"] for r in sorted(self.ranks("dcp"))]

    @property
    def tp_name(self) -> str:
        return self.tp.group_name

    @property
    def pcp_name(self) -> str:
        return self.pcp.group_name

    @property
    def dcp_name(self) -> str:
        return self.dcp.group_name

    @property
    def partial_tp_name(self) -> str:
        return self.partial_tp.group_name


def init_distributed(
    backend: str | None = None, timeout_s: float = 600.0, init_method: str | None = None
) -> None:
    """Initialise the default process group from the environment if it is not yet up.

    ``backend`` defaults to NCCL when CUDA is available, else gloo. ``timeout_s`` bounds every
    collective (of :func:`init_cp_groups`' groups too), so a rank whose peer died or hangs fails
    instead of waiting forever. Ranks other than 0 turn their progress bars off
    (:func:`~cp_modules.distributed.progress.progress_bars_on_rank_zero`).
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(
        backend, init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s)
    )
    progress_bars_on_rank_zero(dist.get_rank())


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The collective timeout that ``group``'s backend holds (the default group's when None);
    None where this torch does not expose it."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in pg._device_types:
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def _set_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    # DeviceMesh builds its groups with torch's default timeout; set the run's afterwards.
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def _new_groups(
    groups: list[list[int]], rank: int, timeout: datetime.timedelta | None
) -> dist.ProcessGroup:
    mine = None
    for ranks in groups:
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = g
    assert mine is not None, f"rank {rank} is in none of {groups}"
    return mine


def init_cp_groups(
    config: ParallelConfig,
    *,
    device_type: str | None = None,
    timeout_s: float | None = None,
) -> CPGroups:
    """Build the mesh and every group of ``config`` on the initialised default group.

    Args:
        config: the parallel layout.
        device_type: the mesh's device type (default: ``"cuda"`` under NCCL, else ``"cpu"``).
        timeout_s: collective timeout of every group built (the mesh's and the DCP /
            partial-TP / EP / replica groups); None: the default group's (the run's), so
            ``launch(..., timeout_s=...)`` and :func:`init_distributed`'s timeout hold in every
            group.

    Raises:
        ValueError: if the world size differs from ``config.world_size``.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_cp_groups needs an initialised default process group")
    world = dist.get_world_size()
    if world != config.world_size:
        raise ValueError(
            f"world size {world} does not match the configuration: dp*pp*pcp*tp = "
            f"{config.dp}*{config.pp}*{config.pcp}*{config.tp} = {config.world_size}"
        )
    rank = dist.get_rank()
    layout = rank_layout(config)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else group_timeout()
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(
        device_type,
        (config.dp, config.pp, config.pcp, config.tp),
        mesh_dim_names=("dp", "pp", "pcp", "tp"),
    )
    if timeout is not None:
        for dim in mesh.mesh_dim_names or ():
            _set_timeout(mesh.get_group(dim), timeout)
    # The mesh's own tp/pcp/dp groups are the layout's rows and columns; reuse them.
    tp = mesh.get_group("tp")
    pcp = mesh.get_group("pcp")
    dp = mesh.get_group("dp")
    assert sorted(dist.get_process_group_ranks(tp)) == layout.group_of("tp", rank)
    assert sorted(dist.get_process_group_ranks(pcp)) == layout.group_of("pcp", rank)
    # DCP group order matters (it is the shard order), so build it from the layout.
    dcp = _new_groups(layout.dcp_groups, rank, timeout)
    partial_tp = _new_groups(layout.partial_tp_groups, rank, timeout)
    ep = _new_groups(layout.ep_groups, rank, timeout)
    replica = _new_groups(layout.replica_groups, rank, timeout)
    return CPGroups(
        config=config,
        layout=layout,
        plan=comm_plan(config),
        rank=rank,
        mesh=mesh,
        tp=tp,
        pcp=pcp,
        dcp=dcp,
        partial_tp=partial_tp,
        ep=ep,
        dp=dp,
        replica=replica,
    )


def flatten_mesh_axes(mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> DeviceMesh:
    """The 1-D mesh over the named ``axes`` of ``mesh`` together (e.g. ``("dp", "pcp")`` -> ``"dp_pcp"``).

    Its ranks are those of the axes' product, ordered as in ``mesh``; it shares ``mesh``'s root,
    so it composes with DTensors on other axes of the same mesh (FSDP2 over ``dp_pcp`` of
    TP-sharded parameters). Built once per mesh and name, then reused. This is the one place
    that uses DeviceMesh's private flattening.

    Raises:
        ValueError: if ``mesh`` lacks one of ``axes``.
    """
    names = tuple(mesh.mesh_dim_names or ())
    missing = [a for a in axes if a not in names]
    if missing:
        raise ValueError(f"mesh has axes {list(names)}, not {missing}; cannot flatten {list(axes)}")
    if len(axes) == 1:
        return mesh[axes[0]]
    try:
        flat = mesh[name]
    except (KeyError, RuntimeError, ValueError):
        flat = None
    if flat is not None:
        return flat
    flat = mesh[axes]._flatten(name)
    # The flattened group takes the timeout of the mesh's own groups (torch gives it its default).
    timeout = group_timeout(mesh.get_group(axes[0]))
    if timeout is not None:
        _set_timeout(flat.get_group(), timeout)
    return flat
