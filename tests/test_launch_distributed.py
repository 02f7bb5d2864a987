"""``launch`` on spawned gloo ranks: what a rank returns arrives, only rank 0 draws progress
bars, and every group of ``init_cp_groups`` takes the run's timeout."""

from __future__ import annotations

import io
import time

import pytest
import torch
import torch.distributed as dist

from cp_modules import ParallelConfig
from cp_modules.distributed.groups import flatten_mesh_axes, group_timeout, init_cp_groups
from cp_modules.engine import launch

pytestmark = pytest.mark.distributed

GROUPS = ("tp", "pcp", "dp", "dcp", "partial_tp", "ep", "replica")


def _bars_and_a_tensor(rank, world_size):
    import tqdm.auto
    import transformers.utils.logging as hf_logging

    out = io.StringIO()
    for _ in tqdm.auto.tqdm(range(3), file=out, desc="work"):  # no disable= of its own
        pass
    mine = {"drew": bool(out.getvalue()), "hf_bars": hf_logging.is_progress_bar_enabled()}
    seen: list = [None] * world_size
    dist.all_gather_object(seen, mine)
    # A large tensor and a nested one: they must arrive after this process has exited.
    return {
        "bars": seen,
        "big": torch.arange(1 << 16, dtype=torch.float32),
        "nested": [torch.ones(3)],
    }


def test_launch_returns_tensors_and_only_rank_zero_draws_bars():
    result = launch(_bars_and_a_tensor, 2, timeout_s=60)
    assert result["bars"] == [{"drew": True, "hf_bars": True}, {"drew": False, "hf_bars": False}]
    big = result["big"]
    assert torch.equal(big, torch.arange(1 << 16, dtype=torch.float32))
    # A copy of the data, not a storage shared through the exited rank's file descriptor.
    assert not big.is_shared()
    assert torch.equal(result["nested"][0], torch.ones(3))


TIMEOUT_S = 4.0  # also the rendezvous timeout: room for the ranks to start
HANG_S = 10.0  # the hanging rank's sleep: the peer must fail well before it wakes


def _one_rank_hangs(rank, world_size):
    groups = init_cp_groups(ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2))
    timeouts = {kind: group_timeout(getattr(groups, kind)) for kind in GROUPS}
    timeouts["dp_pcp"] = group_timeout(
        flatten_mesh_axes(groups.mesh, ("dp", "pcp"), "dp_pcp").get_group()
    )
    if rank == 1:
        time.sleep(HANG_S)  # alive, not crashed: its peer waits in the collective
    waited = {}
    for kind in ("dcp", "tp"):  # a group of its own and one of the mesh's
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2), group=getattr(groups, kind))
            error = None
        except RuntimeError as err:
            error = str(err).splitlines()[0]
        waited[kind] = (time.monotonic() - t0, error)
    return {k: v.total_seconds() if v is not None else None for k, v in timeouts.items()}, waited


def test_every_group_takes_the_runs_timeout_and_a_hanging_rank_fails_its_peer():
    timeouts, waited = launch(_one_rank_hangs, 2, timeout_s=TIMEOUT_S)
    assert timeouts == dict.fromkeys([*GROUPS, "dp_pcp"], TIMEOUT_S)
    for kind, (seconds, error) in waited.items():
        # Without the run's timeout rank 0 would wait until rank 1 woke (HANG_S) and succeed.
        assert error is not None and "Timed out" in error, (kind, seconds, error)
        assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + 2.5, (kind, seconds)
