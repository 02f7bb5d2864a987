"""Rank layout, head ownership and the decode communication plan (pure math, exact)."""

import json
import subprocess
import sys

import pytest

from cp_modules import ParallelConfig
from cp_modules.distributed.layout import comm_plan, head_range, rank_layout
from cp_modules.plan import build_plan, main


def cfg(tp, pcp=1, dcp=1, backend="ag_rs", dp=1, pp=1):
    return ParallelConfig(
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
        dcp_comm_backend=backend,
        data_parallel_size=dp,
        pipeline_parallel_size=pp,
    )


H = 32

# The five cases of the design document: groups and head ownership.
CASES = {
    "case1-pcp1-tp4-dcp4": dict(
        config=cfg(4, 1, 4),
        tp=[[0, 1, 2, 3]],
        pcp=[[0], [1], [2], [3]],
        dcp=[[0, 1, 2, 3]],
        partial_tp=[[0, 1, 2, 3]],
        heads={0: (0, 8), 1: (8, 16), 2: (16, 24), 3: (24, 32)},
        gather="full_tp",
        reduce="reduce_scatter",
        fraction=1.0,
    ),
    "case2-pcp1-tp4-dcp2": dict(
        config=cfg(4, 1, 2),
        tp=[[0, 1, 2, 3]],
        pcp=[[0], [1], [2], [3]],
        dcp=[[0, 1], [2, 3]],
        partial_tp=[[0, 1], [2, 3]],
        heads={0: (0, 8), 1: (8, 16), 2: (16, 24), 3: (24, 32)},
        gather="partial_tp",
        reduce="all_reduce_slice",
        fraction=0.5,
    ),
    "case3-pcp2-tp2-dcp4": dict(
        config=cfg(2, 2, 4),
        tp=[[0, 1], [2, 3]],
        pcp=[[0, 2], [1, 3]],
        dcp=[[0, 2, 1, 3]],
        partial_tp=[[0, 1], [2, 3]],
        heads={0: (0, 16), 1: (16, 32), 2: (0, 16), 3: (16, 32)},
        gather="full_tp",
        reduce="all_reduce_slice",
        fraction=1.0,
    ),
    "case4-pcp2-tp2-dcp2": dict(
        config=cfg(2, 2, 2),
        tp=[[0, 1], [2, 3]],
        pcp=[[0, 2], [1, 3]],
        dcp=[[0, 2], [1, 3]],
        partial_tp=[[0], [2], [1], [3]],
        heads={0: (0, 16), 2: (0, 16), 1: (16, 32), 3: (16, 32)},
        gather="none",
        reduce="all_reduce",
        fraction=0.0,
    ),
    "case5-pcp2-tp4-dcp4": dict(
        config=cfg(4, 2, 4),
        tp=[[0, 1, 2, 3], [4, 5, 6, 7]],
        pcp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        dcp=[[0, 4, 1, 5], [2, 6, 3, 7]],
        partial_tp=[[0, 1], [4, 5], [2, 3], [6, 7]],
        heads={
            0: (0, 8),
            4: (0, 8),
            1: (8, 16),
            5: (8, 16),
            2: (16, 24),
            6: (16, 24),
            3: (24, 32),
            7: (24, 32),
        },
        gather="partial_tp",
        reduce="all_reduce_slice",
        fraction=0.5,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_design_cases(name):
    case = CASES[name]
    c = case["config"]
    layout = rank_layout(c)
    assert layout.tp_groups == case["tp"]
    assert layout.pcp_groups == case["pcp"]
    assert layout.dcp_groups == case["dcp"]
    assert layout.partial_tp_groups == case["partial_tp"]
    for r, rng in case["heads"].items():
        assert head_range(H, c.tp, layout.coords(r)["tp"]) == rng
    plan = comm_plan(c)
    assert (plan.query_gather, plan.reduce, plan.query_gather_fraction) == (
        case["gather"],
        case["reduce"],
        case["fraction"],
    )


@pytest.mark.parametrize(
    "tp,pcp,dcp,savings",
    [(4, 1, 4, 0.0), (4, 1, 2, 0.5), (2, 2, 2, 1.0), (4, 2, 4, 0.5)],
)
def test_communication_savings_table(tp, pcp, dcp, savings):
    assert comm_plan(cfg(tp, pcp, dcp)).query_gather_savings == savings


def test_a2a_replaces_the_reduce():
    for tp, pcp, dcp in [(4, 1, 4), (4, 1, 2), (2, 2, 2), (2, 2, 4), (4, 2, 4)]:
        p = comm_plan(cfg(tp, pcp, dcp, "a2a"))
        assert p.reduce == "a2a"
        assert p.query_gather == comm_plan(cfg(tp, pcp, dcp)).query_gather


def test_no_dcp_means_no_decode_communication():
    p = comm_plan(cfg(4, 2, 1))
    assert (p.query_gather, p.reduce, p.query_gather_fraction) == ("none", "none", 0.0)


def test_spec_examples():
    assert rank_layout(cfg(4, 2)).tp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_layout(cfg(2, 2, 2)).dcp_groups == [[0, 2], [1, 3]]
    assert rank_layout(cfg(2, 2, 4)).dcp_groups == [[0, 2, 1, 3]]
    assert rank_layout(cfg(4, 1, 2)).dcp_groups == [[0, 1], [2, 3]]


def test_ep_groups_span_dp_and_tp_not_pcp():
    layout = rank_layout(cfg(2, 2, 1, dp=2))
    # (dp, pcp, tp) = (2, 2, 2): rank = (d*2 + c)*2 + t
    assert layout.ep_groups == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.replica_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for g in layout.ep_groups:
        assert len({layout.coords(r)["pcp"] for r in g}) == 1


@pytest.mark.parametrize("dp,pp,pcp,tp", [(1, 1, 2, 4), (2, 1, 2, 2), (1, 2, 2, 2), (2, 2, 1, 2)])
def test_groups_partition_the_world(dp, pp, pcp, tp):
    from cp_modules.config import valid_dcp_sizes

    for dcp in valid_dcp_sizes(tp, pcp):
        layout = rank_layout(cfg(tp, pcp, dcp, dp=dp, pp=pp))
        world = list(range(dp * pp * pcp * tp))
        for kind in ("tp", "pcp", "dcp", "partial_tp", "dp", "pp", "ep", "replica"):
            groups = getattr(layout, f"{kind}_groups")
            assert sorted(r for g in groups for r in g) == world, kind
        for g in layout.dcp_groups:
            assert len(g) == dcp
            # A DCP group stays inside one (dp, pp) replica.
            assert len({(layout.coords(r)["dp"], layout.coords(r)["pp"]) for r in g}) == 1
        for g in layout.partial_tp_groups:
            # A partial-TP group lies in one pcp slice and inside one DCP group.
            assert len({layout.coords(r)["pcp"] for r in g}) == 1
            assert set(g) <= set(layout.group_of("dcp", g[0]))


def test_build_plan_head_ownership():
    report = build_plan(cfg(4, 2, 4), num_heads=32, num_kv_heads=2)
    by_rank = {e["rank"]: e for e in report["ranks"]}
    assert by_rank[5]["heads"] == [8, 16] and by_rank[5]["kv_heads"] == [0, 1]
    assert by_rank[6]["kv_heads"] == [1, 2]
    assert by_rank[4]["dcp_rank"] == 2  # shard order = ascending rank in the DCP group


def test_cli_json(capsys):
    assert (
        main(["--tp", "4", "--pcp", "2", "--dcp", "4", "--dcp-comm-backend", "a2a", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["tp_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out["pcp_groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert out["dcp_groups"] == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert out["partial_tp_groups"] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert out["query_gather"] == "partial_tp"
    assert out["reduce"] == "a2a"
    assert out["query_gather_fraction"] == 0.5


def test_cli_text(capsys):
    assert (
        main(["--tp", "2", "--pcp", "2", "--dcp", "2", "--num-heads", "8", "--num-kv-heads", "2"])
        == 0
    )
    text = capsys.readouterr().out
    assert "dcp_groups         [[0, 2], [1, 3]]" in text
    assert "decode query all-gather: none" in text


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--tp", "4", "--pcp", "2", "--dcp", "3"], "decode_context_parallel_size=3"),
        (["--dcp-comm-backend", "a2a"], "requires decode_context_parallel_size > 1"),
        (["--tp", "4", "--dcp", "4", "--num-heads", "32", "--num-kv-heads", "8"], "same KV heads"),
        (["--interleave", "32", "--block-size", "16"], "dcp_kv_cache_interleave_size=32"),
    ],
)
def test_cli_invalid_exits_2(args, msg, capsys):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert msg in captured.err and captured.out == ""


def test_cli_as_module_process():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cp_modules.plan",
            "--tp",
            "4",
            "--pcp",
            "2",
            "--dcp",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "invalid configuration" in r.stderr and r.stdout == ""


def test_dp_pcp_groups_are_the_gradient_sum_groups():
    # dp=2, pcp=2, tp=2: ranks ((d * pcp) + c) * tp + t; each TP position sums over dp x pcp.
    layout = rank_layout(ParallelConfig(data_parallel_size=2, prefill_context_parallel_size=2,
                                        tensor_parallel_size=2))  # fmt: skip
    assert layout.dp_pcp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
