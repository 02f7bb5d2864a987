"""The key-major study of benchmarks.bench_pcp: its helpers on CPU (the decomposition itself is
tested in test_pcp_key_major.py)."""

import json

import torch

from benchmarks import bench_pcp as bench
from benchmarks.common import write_results
from cp_modules.reference.pcp_attention import attention_with_lse, attention_with_lse_backward
from cp_modules.testing.numerics import max_abs_err


def test_all_ranks_equal_dense_backward():
    # The benchmark's correctness check combines every rank's gradients as training would.
    S, P = 2 * 3 * 5 + 1, 3  # a padded chunk
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(S, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v, dout = (torch.randn(S, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = attention_with_lse(q, k, v, scale=0.3, causal=True)
    want = attention_with_lse_backward(dout, q, k, v, out, lse, scale=0.3, causal=True)
    got = bench.key_major_all_ranks(dout, q, k, v, out.double(), lse, P, 0.3)
    for a, b in zip(got, want):
        assert not a.isnan().any()
        assert max_abs_err(a, b) < 1e-6  # dQ summed in fp32


def test_bytes_per_token():
    # MHA 32 x 128: dK/dV 16 KiB against Q, O, dO (24 KiB), the LSE (128 B) and dQ (8 KiB).
    assert bench.bytes_per_token(32, 32, 128, 128) == {
        "query_major": 16384,
        "key_major": 24576 + 128 + 8192,
    }


def test_results_file_names_the_kind_date_and_versions(tmp_path):
    path = write_results("pcp-key-major", {"x": 1.5}, tmp_path / "out", notes=["n"])
    got = json.loads(path.read_text())
    assert path.name == f"pcp-key-major-{got['date']}.json"
    assert got["metrics"] == {"x": 1.5} and got["notes"] == ["n"]
    assert got["torch"] == torch.__version__ and got["gpu"]
