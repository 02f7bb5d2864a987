"""The key-major PCP backward benchmark's decomposition, on CPU: every rank's own key chunks
against the queries at or after them give the dense causal gradients, summed over ranks."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from cp_modules.reference.pcp_attention import attention_with_lse, attention_with_lse_backward
from cp_modules.testing.numerics import max_abs_err

_spec = importlib.util.spec_from_file_location(
    "bench_pcp_key_major",
    Path(__file__).resolve().parents[1] / "benchmarks" / "bench_pcp_key_major.py",
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("dims", [(4, 2, 12, 8), (2, 2, 8, 8)], ids=["GQA-Dqk12-Dv8", "MHA-D8"])
@pytest.mark.parametrize("pcp", [1, 2, 3, 4], ids=lambda p: f"P{p}")
def test_key_major_ranks_equal_dense_backward(pcp, dims):
    hq, hkv, dqk, dv = dims
    S = 2 * pcp * 5
    g = torch.Generator().manual_seed(pcp)
    q, k = (
        torch.randn(S, hq, dqk, generator=g, dtype=torch.float64),
        torch.randn(S, hkv, dqk, generator=g, dtype=torch.float64),
    )
    v = torch.randn(S, hkv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(S, hq, dv, generator=g, dtype=torch.float64)
    out, lse = attention_with_lse(q, k, v, scale=0.3, causal=True)
    want = attention_with_lse_backward(dout, q, k, v, out, lse, scale=0.3, causal=True)
    got = bench.key_major_all_ranks(dout, q, k, v, out, lse, pcp, scale=0.3, backend="reference")
    for a, b in zip(got, want):
        assert not a.isnan().any()  # every key row is some rank's chunk
        assert max_abs_err(a, b) < 1e-12
    # A rank's dQ contributions start at its first key chunk.
    c = S // (2 * pcp)
    for r in range(pcp):
        dq, dkv = bench.key_major_rank(dout, q, k, v, out, lse, pcp, r, scale=0.3,
                                       backend="reference")  # fmt: skip
        assert sorted(dkv) == sorted({r * c, (2 * pcp - 1 - r) * c})
        assert torch.all(dq[: r * c] == 0) and dq[r * c :].abs().sum() > 0


def test_tall_causal_backward_is_top_left():
    # 7 queries from the position of the first of 3 keys: query i sees keys 0..min(i, 2).
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for n in (7, 3, 3))
    dout = torch.randn(7, 2, 4, generator=g, dtype=torch.float64)
    mask = torch.arange(3)[None, :] <= torch.arange(7)[:, None]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    s = torch.einsum("lhd,mhd->hlm", leaves[0], leaves[1]) * 0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    ref_out = torch.einsum("hlm,mhd->lhd", p, leaves[2])
    want = torch.autograd.grad(ref_out, leaves, dout)
    lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1).T.detach()
    got = bench.tall_causal_backward(dout, q, k, v, ref_out.detach(), lse, scale=0.5,
                                     backend="reference")  # fmt: skip
    for a, b in zip(got, want):
        assert max_abs_err(a, b) < 1e-12


def test_bytes_per_token():
    # MHA 32 x 128: dK/dV 16 KiB against Q, O, dO (24 KiB), the LSE (128 B) and dQ (8 KiB).
    assert bench.bytes_per_token(32, 32, 128, 128) == {
        "query_major": 16384,
        "key_major": 24576 + 128 + 8192,
    }


def test_results_file_names_the_kind_date_and_versions(tmp_path):
    path = bench.write_results("pcp-key-major", {"x": 1.5}, tmp_path / "out", notes=["n"])
    got = json.loads(path.read_text())
    assert path.name == f"pcp-key-major-{got['date']}.json"
    assert got["metrics"] == {"x": 1.5} and got["notes"] == ["n"]
    assert got["torch"] == torch.__version__ and got["gpu"]
