"""Real process groups on spawned gloo ranks: membership, collectives, failure behaviour."""

import time

import pytest
import torch
import torch.distributed as dist

from cp_modules import ParallelConfig
from cp_modules.config import valid_dcp_sizes
from cp_modules.distributed.groups import init_cp_groups
from cp_modules.distributed.layout import rank_layout
from cp_modules.testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


def _configs(world_size):
    out = []
    for dp in (1, 2):
        for pp in (1, 2):
            for pcp in (1, 2, 4, 8):
                if world_size % (dp * pp * pcp):
                    continue
                tp = world_size // (dp * pp * pcp)
                for dcp in valid_dcp_sizes(tp, pcp):
                    out.append(
                        ParallelConfig(
                            tensor_parallel_size=tp,
                            prefill_context_parallel_size=pcp,
                            decode_context_parallel_size=dcp,
                            data_parallel_size=dp,
                            pipeline_parallel_size=pp,
                        )
                    )
    return out


def _check_groups(rank, world_size):
    checked = 0
    for c in _configs(world_size):
        g = init_cp_groups(c, timeout_s=30)
        layout = rank_layout(c)
        assert g.mesh.mesh_dim_names == ("dp", "pp", "pcp", "tp")
        assert g.mesh.mesh.flatten().tolist() == list(range(world_size))
        for kind in ("tp", "pcp", "dcp", "partial_tp", "ep", "dp", "replica"):
            group = getattr(g, kind)
            expected = layout.group_of(kind, rank)
            assert sorted(dist.get_process_group_ranks(group)) == sorted(expected), (c, kind)
            x = torch.tensor([float(rank + 1)])
            dist.all_reduce(x, group=group)
            assert x.item() == float(sum(r + 1 for r in expected)), (c, kind)
        # The DCP shard index and the peers' TP positions follow the group's rank order.
        assert g.dcp_rank == dist.get_group_rank(g.dcp, rank)
        assert g.dcp_peer_tp_positions == [
            layout.coords(r)["tp"] for r in sorted(layout.group_of("dcp", rank))
        ]
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [4, 8])
def test_groups_match_layout(world_size):
    counts = run_distributed(_check_groups, world_size, timeout_s=600)
    assert counts == [len(_configs(world_size))] * world_size
    assert counts[0] >= 6


def _wrong_world(rank, world_size):
    init_cp_groups(ParallelConfig(tensor_parallel_size=world_size * 2))


def test_world_size_mismatch_is_a_clear_error():
    with pytest.raises(DistributedTestError, match="world size 2 does not match the configuration"):
        run_distributed(_wrong_world, 2)


def _fail_before_collective(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank 1 failed before the all-reduce")
    x = torch.ones(4)
    dist.all_reduce(x)  # its peer never arrives
    return x.tolist()


def test_failed_rank_does_not_hang_its_peers():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_before_collective, 2, collective_timeout_s=10, timeout_s=120)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "2 of 2 ranks failed" in msg
    assert "rank 1 failed before the all-reduce" in msg
    # Rank 0 fails with the backend's error (connection closed or timeout), well before the
    # harness's own 120 s limit would kill it.
    assert "--- rank 0 ---" in msg and "killed" not in msg
    assert elapsed < 60, elapsed


def _stall_before_collective(rank, world_size):
    if rank == 1:
        time.sleep(12)  # alive but never joins: its peer must hit the collective timeout
        return None
    x = torch.ones(4)
    dist.all_reduce(x)
    return x.tolist()


def test_stalled_peer_gives_a_timeout_error_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_stall_before_collective, 2, collective_timeout_s=4, timeout_s=120)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "--- rank 0 ---" in msg and "Timed out waiting 4000ms" in msg
    assert elapsed < 60, elapsed
