"""The peer benchmark's plumbing on CPU, without the peers: the one-line skip, the peer probe,
the row names and the ratio rows built from recorded measurements."""

import subprocess
import sys
from pathlib import Path

from benchmarks import bench_peers as bp

REPO = Path(__file__).resolve().parents[1]


def test_skips_with_one_line_without_gpu_or_peers():
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_peers", "--site", "/nonexistent"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_peers: skipped: "), res.stdout


def test_skip_reason_names_each_missing_peer():
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    versions = bp.peer_versions(missing)
    assert not bp.available(versions, "FlashMLA") and not bp.available(versions, "FlashInfer")
    reason = bp.skip_reason(versions, cuda=True)
    assert reason is not None and "\n" not in reason
    assert "FlashMLA ModuleNotFoundError" in reason and "FlashInfer ModuleNotFoundError" in reason
    assert bp.skip_reason(versions, cuda=False) == "bench_peers: skipped: no CUDA device"
    assert bp.skip_reason({"FlashMLA": "1.0.0", "FlashInfer": "unavailable: x"}, True) is None
    # Without peers, --cp-only still times this project's kernels and their variants.
    assert bp.skip_reason(versions, cuda=True, cp_only=True) is None
    assert bp.skip_reason(versions, cuda=False, cp_only=True) is not None


def test_row_names():
    shape = bp.mla_shape(128, 8, 4096, 64)
    assert bp.row_name("mla decode", "FlashMLA", shape) == (
        "mla decode cp / FlashMLA time (128 heads) B=8 ctx=4096"
    )
    assert bp.mla_shape(128, 8, 4096, 16) == "(128 heads) B=8 ctx=4096 bs=16"
    assert bp.row_name("lse combine", "FlashInfer", bp.combine_shape(512, 4)) == (
        "lse combine cp / FlashInfer time D=512 N=4"
    )
    assert bp.rate_name("gqa paged decode", "FlashInfer", "TB/s",
                        bp.gqa_shape("Llama-3-8B", 32, 8, 1, 131072)) == (
        "gqa paged decode FlashInfer TB/s (Llama-3-8B 32/8) B=1 ctx=131072"
    )  # fmt: skip


def test_metrics_from_recorded_rows():
    sections = {
        "mla": [{"heads": 128, "block_size": 64, "batch": 8, "ctx": 4096, "impl": {
            "cp": {"ok": True, "us": 30.0, "rate": 250.0},
            "FlashMLA": {"ok": True, "us": 20.0, "rate": 380.0},
            "FlashInfer": {"variants": {"fa3": {"ok": True, "us": 40.0, "rate": 190.0},
                                        "fa2": {"error": "RuntimeError: no"}}},
        }}],
        "combine": [{"d": 128, "n": 2, "impl": {
            "cp": {"ok": False, "err_out": 1.0, "err_lse": 0.0, "unchecked_us": 5.0},
            "FlashInfer": {"variants": {"merge_states": {"ok": True, "us": 4.0, "rate": 1.0}}},
        }}],
    }  # fmt: skip
    m = bp.build_metrics(sections)
    assert m["mla decode cp / FlashMLA time (128 heads) B=8 ctx=4096"] == 1.5
    assert m["mla decode cp / FlashInfer time (128 heads) B=8 ctx=4096"] == 0.75
    assert m["mla decode FlashMLA TFLOP/s (128 heads) B=8 ctx=4096"] == 380.0
    # This project's failed check gives no ratio; the peer's rate stays.
    assert "lse combine cp / FlashInfer time D=128 N=2" not in m
    assert m["lse combine FlashInfer TB/s D=128 N=2"] == 1.0
    errors = bp.collect_errors(sections)
    assert any("FlashInfer fa2: RuntimeError: no" in e for e in errors)
    assert any(": cp: check failed" in e for e in errors)
