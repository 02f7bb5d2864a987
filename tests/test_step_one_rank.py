"""World size 1: the direct one-rank plan equals the general DualChunkSwap plan field by field.

At pcp = 1 every request is one unsplit segment in batch order; ``plan_pcp`` builds that
layout without the general partition (and ``build_step_metadata`` skips the decode-row math
when no request decodes). Random batches with cached prefixes, decode rows and several
decode thresholds: every field of the plan and of the step metadata equals what the general
path gives (values, dtypes, shapes, devices), and the decode rows equal a token-by-token
oracle.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import cp_modules.step as step_mod
from cp_modules.partition import plan_pcp
from cp_modules.partition.plan import PCPPlan, _plan_split
from cp_modules.step import CPRuntime, build_step_metadata


def _general_plan(n, m, pcp_size, pcp_rank, decode_threshold=1, device=None) -> PCPPlan:
    """The general path's plan (what plan_pcp built at P = 1 before the direct plan)."""
    n = np.asarray(n, dtype=np.int64)
    m = np.asarray(m, dtype=np.int64)
    is_decode = (n <= decode_threshold) & (m > 0)
    return _plan_split(n, m, pcp_size, pcp_rank, is_decode, device)


def _assert_same(a, b, where: str) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        name = f"{where}.{f.name}"
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), name
            assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), name
            assert torch.equal(x, y), name
        elif isinstance(x, PCPPlan):
            _assert_same(x, y, name)
        elif f.name in ("serial", "window_plans", "window_views", "runtime"):
            continue
        else:
            assert x == y, name


def _random_batch(rng: np.random.Generator):
    r = int(rng.integers(1, 9))
    n = np.where(rng.random(r) < 0.4, rng.integers(1, 4, r), rng.integers(1, 300, r))
    m = np.where(rng.random(r) < 0.5, rng.integers(1, 200, r), 0)
    return n.tolist(), m.tolist(), int(rng.integers(0, 4))


def test_one_rank_plan_equals_the_general_plan():
    rng = np.random.default_rng(0)
    cases = [([16384], [0], 1), ([1], [7], 1), ([5, 3, 1], [0, 2, 4], 1), ([2, 2], [0, 0], 3)]
    cases += [_random_batch(rng) for _ in range(300)]
    for i, (n, m, threshold) in enumerate(cases):
        direct = plan_pcp(n, m, 1, 0, decode_threshold=threshold)
        _assert_same(direct, _general_plan(n, m, 1, 0, threshold), f"case {i} {n} {m}")
    # Tensor and numpy inputs take the same path.
    n, m = torch.tensor([4, 1, 9]), np.array([0, 3, 2])
    _assert_same(plan_pcp(n, m, 1, 0), _general_plan([4, 1, 9], [0, 3, 2], 1, 0), "inputs")


def _decode_oracle(n, m, threshold):
    """(local row, request, position) of every decode token at P = 1, token by token."""
    rows, reqs, pos, start = [], [], [], 0
    for i, (ni, mi) in enumerate(zip(n, m)):
        if ni <= threshold and mi > 0:
            for j in range(ni):
                rows.append(start + j)
                reqs.append(i)
                pos.append(mi + j)
        start += ni
    return rows, reqs, pos


def _block_table(n, m, block_size, seed):
    need = max(-(-(a + b) // block_size) for a, b in zip(n, m))
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(len(n) * need, generator=g).view(len(n), need)


def _metas(monkeypatch, rt, n, m, threshold, **kw):
    direct = build_step_metadata(rt, n, m, decode_threshold=threshold, **kw)
    with monkeypatch.context() as mp:
        mp.setattr(step_mod, "plan_pcp", _general_plan)
        general = build_step_metadata(rt, n, m, decode_threshold=threshold, **kw)
    return direct, general


def test_one_rank_step_metadata_equals_the_general_path(monkeypatch):
    rt = CPRuntime.single()
    rng = np.random.default_rng(1)
    for i in range(60):
        n, m, threshold = _random_batch(rng)
        block_size = int(rng.choice([4, 16]))
        table = _block_table(n, m, block_size, i)
        windows = {8: _block_table(n, m, block_size, i + 1000)} if i % 3 == 0 else None
        direct, general = _metas(
            monkeypatch, rt, n, m, threshold, block_table=table, block_size=block_size,
            window_block_tables=windows,
        )  # fmt: skip
        _assert_same(direct, general, f"case {i}")
        for w in direct.window_views:
            _assert_same(direct.window_views[w], general.window_views[w], f"case {i} w{w}")
        rows, reqs, pos = _decode_oracle(n, m, threshold)
        assert direct.local_decode_idx.tolist() == rows
        assert direct.decode_seq_idx.tolist() == reqs
        assert direct.decode_positions.tolist() == pos
        assert direct.has_decode == bool(rows)
    # Cache-less steps (training, a plain forward): no decode rows, empty typed tensors.
    for n in ([16384], [3, 1, 7], [1]):
        direct, general = _metas(monkeypatch, rt, n, None, 1)
        _assert_same(direct, general, f"cache-less {n}")
        assert direct.local_decode_idx.dtype == torch.int64 and direct.local_decode_idx.numel() == 0
        assert direct.decode_seq_idx.dtype == torch.int32
        assert direct.decode_kv_len.dtype == torch.int32


def test_one_rank_plan_fields_share_equal_contents_only():
    # The direct plan shares one tensor between fields of equal contents; nothing else aliases.
    p = plan_pcp([6, 2], [0, 3], 1, 0)
    assert p.token_indices.data_ptr() == p.gather_index.data_ptr() == p.restore_index.data_ptr()
    assert p.positions.data_ptr() != p.token_indices.data_ptr()
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 4]
    assert p.gather_pad_index.numel() == 0 and p.gather_runs_host.tolist() == [[0, 0, 8]]


@pytest.mark.gpu
def test_one_rank_plan_equals_the_general_plan_on_the_gpu():
    rng = np.random.default_rng(2)
    for i in range(50):
        n, m, threshold = _random_batch(rng)
        direct = plan_pcp(n, m, 1, 0, decode_threshold=threshold, device="cuda")
        general = _general_plan(n, m, 1, 0, threshold, device="cuda")
        _assert_same(direct, general, f"case {i}")


@pytest.mark.parametrize("pcp", [1, 2, 4])
@pytest.mark.parametrize("num_new", [[1, 1, 1], [1], [3, 1, 2]], ids=["one-each", "one", "multi"])
def test_all_decode_rows_are_the_local_rows_in_order(pcp, num_new):
    # The attention ops return an all-decode step's decode result as the output, with no
    # scatter: that needs the decode rows to be every local row, in order.
    num_new = np.array(num_new)
    num_comp = np.array([7, 30, 2][: len(num_new)])
    is_decode = np.ones(len(num_new), dtype=bool)
    idx, req, pos = step_mod._decode_rows(pcp, num_new, num_comp, is_decode, int(num_new.sum()))
    assert idx.tolist() == list(range(int(num_new.sum())))
    assert req.tolist() == np.repeat(np.arange(len(num_new)), num_new).tolist()
    assert pos.tolist() == [int(c) + i for c, n in zip(num_comp, num_new) for i in range(n)]
