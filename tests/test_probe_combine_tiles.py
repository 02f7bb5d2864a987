"""The combine tile probe's logic on CPU: its grid, its summary from recorded times, and a dry
run (TRITON_INTERPRET=1) checking a few tiles against the reference."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tools" / "probes" / "probe_combine_tiles.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_combine_tiles", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("d", [128, 512])
def test_grid_holds_the_default_and_stays_in_bounds(probe, d):
    from cp_modules.kernels.merge import lse_combine_launch_config, lse_combine_tile

    grid = probe.tiles(d)
    assert lse_combine_launch_config(d, 2) in grid
    assert lse_combine_tile(d, 2) in grid
    assert len(set(grid)) == len(grid)
    for rows, cols, warps in grid:
        assert cols in (d, d // 2, d // 4) and cols >= probe.MIN_COLS
        assert 4 <= rows * cols / (32 * warps) <= 64
        assert probe.parse_name(probe.name_of((rows, cols, warps))) == (rows, cols, warps)


def _row(d, n, cp_us, peer_us):
    return {"d": d, "n": n, "default_tile": (32, 128, 4), "cp_us": cp_us, "peer_us": peer_us}


def test_summary_ratios_and_ranking(probe):
    report = {"shapes": {
        "D128_N2": _row(128, 2, {"default": [12.0, 14.0], "op": [13.0], "r8_d128_w4": [9.0, 11.0],
                                 "r16_d128_w4": [12.0, 12.0]},
                        {"merge_states": [13.0], "merge_state": [12.0, 14.0, None]}),
        "D128_N4": _row(128, 4, {"default": [11.0], "r8_d128_w4": [12.0],
                                 "r16_d128_w4": [10.0]}, {"merge_states": [10.0]}),
    }}  # fmt: skip
    s = probe.summarize(report)
    n2 = s["per_shape"]["D128_N2"]
    assert n2["peer"] == {"call": "merge_states", "us": 13.0}  # merge_state's mean is also 13
    assert n2["default"]["us"] == 13.0 and n2["default"]["ratio"] == pytest.approx(1.0)
    assert n2["op"]["ratio"] == pytest.approx(1.0)
    assert [f["tile"] for f in n2["fastest"]] == ["r8_d128_w4", "r16_d128_w4"]
    assert n2["fastest"][0]["ratio"] == pytest.approx(10.0 / 13.0)
    common = s["same_tile_for_every_n"][128]
    # r8: worst of 10/13 and 12/10 = 1.2; r16: worst of 12/13 and 10/10 = 1.0
    assert [c["tile"] for c in common] == ["r16_d128_w4", "r8_d128_w4"]
    assert common[0]["worst_ratio"] == pytest.approx(1.0)
    assert common[1]["worst_ratio"] == pytest.approx(1.2)


def test_summary_without_peer_has_no_ratio(probe):
    report = {"shapes": {"D512_N2": _row(512, 2, {"default": [30.0], "r8_d512_w4": [29.0]}, {})}}
    s = probe.summarize(report)
    assert s["per_shape"]["D512_N2"]["peer"] is None
    assert s["per_shape"]["D512_N2"]["fastest"][0]["ratio"] is None
    assert s["same_tile_for_every_n"][512][0]["worst_ratio"] is None


def _dry(tmp_path, *args):
    res = subprocess.run(
        [sys.executable, str(PROBE), "--dry", "--dry-tiles", "1", "--dry-batch", "1",
         "--out", str(tmp_path), *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    (path,) = tmp_path.glob("combine-tiles-dry-*.json")
    return json.loads(path.read_text())


def test_dry_run_checks_tiles_against_the_reference(tmp_path):
    report = _dry(tmp_path)
    assert report["dry"] and set(report["shapes"]) == {
        f"D{d}_N{n}" for d in (128, 512) for n in (2, 4, 8)
    }
    assert report["skipped"] == []
    for key, row in report["shapes"].items():
        assert {"default", "op"} <= set(row["checks"]) and len(row["checks"]) >= 3
        assert all(c["ok"] for c in row["checks"].values()), row["checks"]
        # two passes: every checked call has two (wall) times
        assert set(row["cp_us"]) == set(row["checks"])
        assert all(len(v) == 2 and all(t > 0 for t in v) for v in row["cp_us"].values())
        assert report["summary"]["per_shape"][key]["default"]["us"] > 0


def test_dry_run_past_its_budget_records_the_skipped_passes(tmp_path):
    report = _dry(tmp_path, "--budget-s", "0", "--passes", "1")
    assert len(report["skipped"]) == 6 and all("time budget" in s for s in report["skipped"])
    assert all(row["cp_us"] == {} for row in report["shapes"].values())


def test_peer_calls_pass_flashinfer_its_own_layout(probe, monkeypatch):
    """A stand-in FlashInfer reading [B, N, H, D] (merge_states) and two states (merge_state)
    through the reference: the probe's copies must give it the section's inputs."""
    import types

    import torch

    from benchmarks.bench_peers import combine_case
    from cp_modules.reference.lse_merge import lse_combine_reference

    def merge_states(v, s):
        out, lse = lse_combine_reference(v.permute(1, 0, 2, 3).float(), s.permute(1, 0, 2),
                                         base2=True)  # fmt: skip
        return out.to(v.dtype), lse

    def merge_state(va, sa, vb, sb):
        return merge_states(torch.stack([va, vb], 1), torch.stack([sa, sb], 1))

    fake = types.SimpleNamespace(merge_states=merge_states, merge_state=merge_state)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    po, pl, ref, same, _ = combine_case(128, 2, batch=2, device="cpu", dtype=torch.float16)
    calls = probe.peer_calls(po, pl, 2)
    assert set(calls) == {"merge_states", "merge_state"}
    for fn in calls.values():
        assert probe.check(fn, ref, same)["ok"]
    # A wrong layout (N and B swapped) is caught by the same check.
    wrong = probe.check(lambda: merge_states(po, pl), ref, same)
    assert not wrong["ok"]
