"""CPFlashAttention / CPMLAAttention on spawned gloo ranks == the same layer on one process.

Every configuration ParallelConfig accepts for the world size (tp, pcp in {1, 2, 4}; dcp per
the rules; both comm backends; both module types) runs a mixed schedule — a ragged prefill,
then a step mixing decodes with a chunked-prefill continuation over a cached prefix, then
decode steps — and training forward/backward runs with pcp in {2, 4}. One spawn per world
size runs the whole sweep inside the ranks.
"""

import pytest

from cp_modules.config import valid_dcp_sizes
from cp_modules.testing import run_distributed
from cp_modules.verify import TOLERANCE, VerifyArgs, verify_rank

pytestmark = pytest.mark.distributed


def _parallel(tp, pcp, dcp, backend="ag_rs", interleave=1):
    from cp_modules.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                          decode_context_parallel_size=dcp, dcp_comm_backend=backend,
                          dcp_kv_cache_interleave_size=interleave)  # fmt: skip


def _sweep(world_size, attention=("gqa", "mla"), interleave=(1,)):
    cases = []
    for pcp in (1, 2, 4):
        if world_size % pcp:
            continue
        tp = world_size // pcp
        if tp not in (1, 2, 4):
            continue
        for dcp in valid_dcp_sizes(tp, pcp):
            for backend in ("ag_rs", "a2a") if dcp > 1 else ("ag_rs",):
                for att in attention:
                    for inter in interleave:
                        cases.append(
                            VerifyArgs(
                                parallel=_parallel(tp, pcp, dcp, backend, inter),
                                attention=att,
                                mode="mixed",
                                seq_lens=[19, 3, 8],
                                decode_steps=2,
                                block_size=4,
                            )
                        )
    return cases


def _run_cases(rank, world_size, cases):
    out = []
    for a in cases:
        r = verify_rank(rank, world_size, a)
        p = a.parallel
        out.append(
            (
                f"tp{p.tp}-pcp{p.pcp}-dcp{p.dcp}-{p.dcp_comm_backend}-{a.attention}-{a.mode}-I{p.interleave}",
                r["errors"],
            )
        )
    return out


def _assert_all_within(results, cases):
    assert len(results[0]) == len(cases)
    for per_rank in results:
        for name, errors in per_rank:
            assert errors, name
            worst = max(errors.values())
            assert worst <= TOLERANCE["float32"], (name, errors)


def test_every_world4_configuration_mixed_schedule():
    cases = _sweep(4, interleave=(1, 2))
    assert len(cases) == 52
    _assert_all_within(run_distributed(_run_cases, 4, cases, timeout_s=1500), cases)


def test_world2_configurations_and_training():
    cases = _sweep(2) + [
        VerifyArgs(parallel=_parallel(1, 2, 1), attention=att, mode="train", seq_lens=lens)
        for att in ("gqa", "mla")
        # Padded chunks, and lengths that are multiples of 2 * pcp (no padding row at all).
        for lens in ([21, 3, 9], [16, 8])
    ]
    _assert_all_within(run_distributed(_run_cases, 2, cases, timeout_s=900), cases)


def test_varlen_path_world2_mixed_schedule_and_training():
    # pcp_varlen="always": every PCP attention (prefill, chunked prefill over a cached prefix,
    # training forward and backward into the reduce-scatter layout) runs the varlen packing.
    cases = [
        VerifyArgs(
            parallel=_parallel(1, 2, 1),
            attention=att,
            mode=mode,
            seq_lens=[21, 3, 9, 16],
            decode_steps=2,
            block_size=4,
            pcp_varlen="always",
        )
        for att in ("gqa", "mla")
        for mode in ("mixed", "train")
    ]
    results = run_distributed(_run_cases, 2, cases, timeout_s=900)
    _assert_all_within(results, cases)


def test_varlen_path_world4_pcp4():
    # As above with 4 PCP ranks: requests shorter than 2 * pcp leave ranks without queries.
    cases = [
        VerifyArgs(
            parallel=_parallel(1, 4, 1),
            attention=att,
            mode=mode,
            seq_lens=[37, 2, 11, 16],
            decode_steps=2,
            block_size=4,
            pcp_varlen="always",
        )
        for att, mode in (("gqa", "mixed"), ("mla", "train"))
    ]
    results = run_distributed(_run_cases, 4, cases, timeout_s=900)
    _assert_all_within(results, cases)


def test_model_widths_world2():
    # The self-check's "model" widths (real head dims, 1024-wide projections), as run on GPUs.
    cases = [
        VerifyArgs(
            parallel=_parallel(tp, pcp, dcp),
            attention=att,
            mode=mode,
            seq_lens=[21, 3, 9],
            decode_steps=2,
            block_size=4,
            widths="model",
        )
        for att in ("gqa", "mla")
        for tp, pcp, dcp, mode in ((1, 2, 1, "train"), (2, 1, 2, "mixed"))
    ]
    _assert_all_within(run_distributed(_run_cases, 2, cases, timeout_s=900), cases)


def test_unknown_widths_are_refused_before_spawning():
    from cp_modules.verify import run_verify

    with pytest.raises(
        ValueError, match=r"--widths must be one of \('tiny', 'model'\), got 'huge'"
    ):
        run_verify(VerifyArgs(parallel=_parallel(1, 2, 1), widths="huge"))


def test_training_pcp2_tp2_and_pcp4():
    cases = [
        VerifyArgs(
            parallel=_parallel(tp, pcp, 1),
            attention=att,
            mode="train",
            seq_lens=[37, 2, 11, 16],
        )
        for tp, pcp in ((2, 2), (1, 4))
        for att in ("gqa", "mla")
    ]
    _assert_all_within(run_distributed(_run_cases, 4, cases, timeout_s=900), cases)


def _run_counting_key_major(rank, world_size, cases, direct):
    # The cases' results, and how many backward calls took the key-major path on this rank.
    # ``direct``: dQ summed straight into the reduce-scatter layout whatever the run lengths
    # (by default only for long runs; these batches have short ones).
    import dataclasses

    import cp_modules.ops.mla_attention as ops

    if direct:
        cases = [
            dataclasses.replace(c, policy_changes={"direct_grad_min_rows_per_run": 1})
            for c in cases
        ]
    inner, calls = ops.pcp_key_major_backward, []

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    ops.pcp_key_major_backward = counted
    return _run_cases(rank, world_size, cases), len(calls)


@pytest.mark.parametrize("world_size, direct", [(2, True), (4, True), (8, False)])
def test_mla_key_major_backward(world_size, direct):
    # policy.mla_backward = key_major: each rank's own keys' gradients from all-gathered Q, O, dO and
    # LSE, dQ reduce-scattered; padded chunks, requests shorter than 2 * pcp, tp x pcp.
    layouts = {2: [(1, 2)], 4: [(1, 4), (2, 2)], 8: [(1, 8)]}[world_size]
    cases = [
        VerifyArgs(parallel=_parallel(tp, pcp, 1), attention="mla", mode="train",
                   seq_lens=lens, mla_backward="key_major")
        for tp, pcp in layouts
        for lens in ([21, 3, 9], [16, 8], [37, 2, 11, 16])
    ]  # fmt: skip
    results = run_distributed(
        _run_counting_key_major, world_size, cases, direct, timeout_s=900,
    )  # fmt: skip
    _assert_all_within([r[0] for r in results], cases)
    assert all(r[1] >= len(cases) for r in results), [r[1] for r in results]


@pytest.mark.slow
def test_every_world8_configuration_mixed_schedule():
    cases = _sweep(8)
    assert len(cases) == 24
    _assert_all_within(run_distributed(_run_cases, 8, cases, timeout_s=2400), cases)


def _disagreeing_batches(rank, world_size):
    from cp_modules import ParallelConfig
    from cp_modules.distributed.groups import init_cp_groups
    from cp_modules.modules import CPRuntime, build_step_metadata

    groups = init_cp_groups(
        ParallelConfig(
            tensor_parallel_size=2, prefill_context_parallel_size=2, decode_context_parallel_size=2
        )
    )
    rt = CPRuntime.from_groups(groups)
    build_step_metadata(rt, [12, 5])  # agreed
    lens = [12, 5] if rank != 3 else [12, 6]
    build_step_metadata(rt, lens)


def test_ranks_fed_different_batches_all_fail_clearly():
    from cp_modules.testing import DistributedTestError

    with pytest.raises(DistributedTestError) as info:
        run_distributed(_disagreeing_batches, 4, timeout_s=300, collective_timeout_s=30)
    msg = str(info.value)
    assert "4 of 4 ranks failed" in msg and "killed" not in msg
    assert msg.count("ranks disagree on the step's batch") == 4


def _unservable_heads(rank, world_size):
    a = VerifyArgs(parallel=_parallel(4, 1, 4), num_kv_heads=4, mode="prefill")
    verify_rank(rank, world_size, a)


def test_unservable_head_count_fails_on_every_rank():
    from cp_modules.testing import DistributedTestError

    with pytest.raises(DistributedTestError) as info:
        run_distributed(_unservable_heads, 4, timeout_s=300, collective_timeout_s=30)
    msg = str(info.value)
    assert msg.count("All ranks of a DCP group must hold the same KV heads") == 4
