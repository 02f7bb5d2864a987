"""The masked-attention benchmark's CPU-checkable parts: its chunked reference against the dense
oracle, the per-rank calls it times (on the CPU twins of the paths the op takes on CUDA)
against that reference, the whole-sequence packing of its FlashAttention-2 baseline, and the
shapes it covers."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_masked as bench
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy
from cp_modules.reference.masked_attention import dense_attention

S, H, HKV, D = 45, 4, 2, 8


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(S, h, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV))
    return q, k, v, torch.randn(S, H, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("window, softcap", [(6, None), (6, 2.0), (None, 2.0), (100, None)])
def test_reference_and_rank_calls_equal_the_oracle(window, softcap):
    q, k, v, dout = _inputs()
    scale = D**-0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = dense_attention(*leaves, scale=scale, sliding_window=window, softcap=softcap)
    want = [o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, dout)]
    # Chunks of 4 queries: the window cuts each chunk's keys.
    ref, low = bench.reference(q, k, v, dout, scale, window, softcap, chunk=4)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ref, want):
        torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=1e-5, msg=name)  # fp32 math
    # In fp64 the "same dtype" attention is the oracle's (kept in fp32 buffers).
    for name, a, b in zip(("out", "dq", "dk", "dv"), low, [want[0], *want[2:]]):
        torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=1e-5, msg=name)
    paths = ["flex"] + (["flash"] if softcap is None else [])
    for path in paths:
        for P in (1, 2, 3):
            totals = [torch.zeros_like(x) for x in want[2:]]
            for r in range(P):
                plan = plan_pcp([S], [0], P, r, device="cpu")
                fwd, both = bench.rank_fns(plan, q, k, v, dout, scale, window, softcap,
                                           CPPolicy(pcp_masked=path))  # fmt: skip
                out, lse_r = fwd()
                rows, valid = plan.token_indices[plan.local_valid], plan.local_valid
                torch.testing.assert_close(out[valid], want[0][rows], atol=1e-12, rtol=1e-11)
                torch.testing.assert_close(lse_r[valid], want[1][rows], atol=1e-12, rtol=1e-11)
                gq, gk, gv = both()[:3]
                totals[0].index_add_(0, rows, gq[valid])
                totals[1] += gk
                totals[2] += gv
            for name, a, b in zip(("dq", "dk", "dv"), totals, want[2:]):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-11, msg=f"{path} P{P} {name}")


def test_whole_sequence_pack_is_the_identity():
    pack = bench.whole_sequence_pack(S, 6, "cpu")
    assert pack.q_index.tolist() == list(range(S)) == pack.k_index.tolist()
    assert pack.cu_q_host == pack.cu_k_host == [0, S] and pack.window == 6


def test_the_suite_part_covers_the_shapes():
    windowed = {n: s for n, s in bench.SHAPES.items() if s[4] == 4096 and s[5] is None}
    assert sorted(s[0] for s in windowed.values()) == [32768, 131072]
    assert any(s[5] for s in bench.SHAPES.values())  # soft-cap rows
    args = bench.parse_args([])
    assert args.pcp == [1, 2, 4, 8] and args.shapes == list(bench.SHAPES)
    assert bench.POLICY == CPPolicy()  # the op's own path choice is timed


def test_softcap_block_sweep_takes_only_the_librarys_keys():
    assert bench.parse_blocks("bwd_BLOCK_M2=32,fwd_num_warps=8") == {
        "bwd_BLOCK_M2": 32,
        "fwd_num_warps": 8,
    }
    for bad in ("BLOCK_M2=32", "bwd_BLOCK_M2=x", "bwd_BLOCK_M2"):
        with pytest.raises(SystemExit, match="not KEY=N"):
            bench.parse_blocks(bad)
