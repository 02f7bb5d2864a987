"""The benchmark suite's plumbing on CPU: the parts import without Hydra or a GPU, the launcher
runs as a file and as a module, and the report regenerates the committed dated report from the
committed results."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report, suite

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
DATED = "2026-12-02-NVIDIA_H200"
# What the committed dated report holds of an op removed since (the fused PCP select): the
# results it came from keep it, the report no longer reads it.
REMOVED_GOALS = ("fused PCP select TB/s",)
REMOVED_METRICS = ("pcp_select_TBps",)


def without_removed(md: str, report: dict) -> tuple[str, dict]:
    """The committed report's Markdown and JSON less the rows of removed ops."""
    md = "".join(
        line
        for line in md.splitlines(keepends=True)
        if not any(line.startswith(f"| {g} |") for g in REMOVED_GOALS)
    )
    report = dict(report)
    report["goals"] = [g for g in report["goals"] if g["goal"] not in REMOVED_GOALS]
    report["metrics"] = {k: v for k, v in report["metrics"].items() if k not in REMOVED_METRICS}
    return md, report


def test_parts_import_without_hydra():
    # The H200 image has no hydra / omegaconf: nothing the suite runs may import them.
    code = (
        "import importlib, sys\n"
        "import benchmarks.suite as s\n"
        "for n in s.ORDER:\n"
        "    importlib.import_module(f'benchmarks.bench_{n}')\n"
        "import benchmarks.report\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=300)


def test_every_part_has_its_file():
    assert sorted(p.stem for p in BENCH.glob("bench_*.py")) == sorted(
        f"bench_{n}" for n in suite.ORDER
    )


@pytest.mark.parametrize("how", [["benchmarks/suite.py"], ["-m", "benchmarks.suite"]])
def test_launcher_refuses_unknown_parts_before_running_any(how):
    r = subprocess.run(
        [sys.executable, *how, "--only", "pcp,nope"], cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode != 0
    assert "unknown benchmarks ['nope']" in r.stderr and "=== pcp" not in r.stdout


def test_report_regenerates_the_dated_report(tmp_path):
    pytest.importorskip("matplotlib")  # without it the report has no plots section
    assert report.main(["--results", str(BENCH / "results"), "--out", str(tmp_path)]) == 0
    want_md, want = without_removed(
        (BENCH / f"{DATED}.md").read_text(), json.loads((BENCH / f"{DATED}.json").read_text())
    )
    assert (tmp_path / f"{DATED}.md").read_text() == want_md
    got = json.loads((tmp_path / f"{DATED}.json").read_text())
    assert got == want
    # Every result file the report reads is kept, and it reads all that are kept but the
    # earlier PCP run its notes cite, the two-GPU communication run of the NCCL report, the
    # fused-merge sweep and the copy-count probes of the MLA decode note (variants that are
    # not the default), the soft-cap block-size sweep of the masked prefill note and the
    # repeats of the parity note.
    kept = {p.name for p in (BENCH / "results").glob("*.json")}
    read = {name for names in got["sources"].values() for name in names.split(" + ")}
    # Also kept: the decode run with the SDPA and FlexAttention comparisons and the Gluon
    # schedules' sweep (both superseded by the runs with the new split merge, cited by their
    # notes), the split-merge probe and the engine's repeat run of the split-merge note; the
    # Gluon sweep of the split-merge note, the early-release sweeps and the repeat of the MLA
    # decode run (the early-release note; the report reads that day's full MLA decode run),
    # and the MLA decode run of the Gluon schedules' note that it supersedes; the copy and
    # merge schedules' sweeps, the spread-merge probe and the timeline probe of the note on
    # those (variants that are not the default, and per-program stamps); the sweep of the
    # programmatic-dependent merge and the staggered scores, the fixed-cost probe, the probe
    # without the row zeroing, the producer-zeroing sweeps and the probe of a decode step's
    # layers of the fixed-cost note, and the full MLA decode run of the early-release note
    # (superseded by the run with producer zeroing, which the report reads); the decoder
    # training parity rows of their note (docs/experiments, not in the dated report yet).
    # The peer side-by-side runs have their own table (``peers-<date>.md``, bench_peers), and
    # the loading memory run its own file (bench_loading, one row per loader); the speculative
    # decoding runs and the fp8 KV runs and probe their notes (docs/experiments, not in the
    # dated report yet), and so do the decoder training parity runs and the combine's and the
    # bf16 GQA decode's tile sweeps (the peers note), and the parity runs with a switch set
    # (``bench_parity --set``) the notes of those switches.
    kept -= {
        name
        for name in kept
        if name.startswith(
            (
                "peers-",
                "loading-",
                "speculative-",
                "fp8-kv-",
                "fp8-decode-",
                "decoder-parity-",
                "combine-tiles-",
                "gqa-decode-tiles-",
                "parity-switched-",
            )  # fmt: skip
        )
    }
    assert read == kept - {
        "decoder-parity-2026-12-02.json",
        "decoder-parity-2026-12-03.json",
        "decoder-parity-repeat-2026-12-02.json",
        "mla-decode-gluon-pdl-stagger-2026-12-02.json",
        "mla-decode-fixed-costs-2026-12-02.json",
        "mla-decode-gluon-nozero-probe-2026-12-02.json",
        "mla-decode-gluon-pz-2026-12-02.json",
        "mla-decode-layers-probe-2026-12-02.json",
        "mla-decode-early-release-2026-12-02.json",
        "mla-decode-gluon-copies-merges-2026-12-02.json",
        "spread-merge-probe-2026-12-02.json",
        "mla-timeline-probe-2026-12-02.json",
        "mla-decode-2026-12-01.json",
        "mla-decode-gluon-2026-12-02.json",
        "mla-decode-gluon-early-2026-12-02.json",
        "mla-decode-repeat-2026-12-02.json",
        "decode-2026-12-01.json",
        "mla-decode-gluon-2026-12-01.json",
        "split-merge-probe-2026-12-02.json",
        "parity-engine-repeat-2026-12-02.json",
        "pcp-first-overlap-2026-11-30.json",
        "dcp_comm-2026-11-30.json",
        "mla-decode-gluon-fused-2026-12-01.json",
        "mla-decode-probes-2026-12-01.json",
        "masked-blocks-2026-12-01.json",
        "parity-repeats-2026-12-01.json",
    }


def test_pcp_studies_keep_the_defaults_of_their_former_scripts():
    from benchmarks import bench_pcp

    a = bench_pcp.parse_args([])
    assert a.run is bench_pcp.run_suite_part and a.pcp == [2, 4, 8]
    assert a.shapes == list(bench_pcp.SHAPES) and not a.check_only
    a = bench_pcp.parse_args(["key-major"])
    assert a.run is bench_pcp.run_key_major
    assert (a.shapes, a.pcp) == (["mla-32k", "mha-32k", "gqa-32k"], [2, 4, 8])
    a = bench_pcp.parse_args(["grad-layout"])
    assert (a.run, a.rounds) == (bench_pcp.run_grad_layout, 5)
    assert a.shapes == ["mha-32k", "gqa-32k", "mha-32k-pad", "mha-128k"]
    a = bench_pcp.parse_args(["varlen", "--batches", "64x256+2048"])
    assert (a.run, a.pcp, a.rounds, a.shapes) == (bench_pcp.run_varlen, [2, 8], 2, ["gqa", "mla"])
    assert a.batches == ["64x256+2048"]
    a = bench_pcp.parse_args(["new-shapes"])
    assert (a.run, a.pcp, a.prompts) == (bench_pcp.run_new_shapes, [2, 8], 6)
    a = bench_pcp.parse_args(["timeline", "--out", "x"])
    assert (a.run, a.pcp, a.out) == (bench_pcp.run_timeline, [4, 8], "x")
    assert a.shapes == ["mha-32k", "gqa-32k", "mla-32k"]


def test_switches_are_set_by_name_and_bad_ones_refused(monkeypatch):
    import cp_modules.ops.mla_attention as mla_ops
    from benchmarks.common import apply_switches

    monkeypatch.setattr(mla_ops, "KEYS_BY_COPIES", False)
    done = apply_switches(["cp_modules.ops.mla_attention.KEYS_BY_COPIES=True"])
    assert mla_ops.KEYS_BY_COPIES is True
    assert done == {"cp_modules.ops.mla_attention.KEYS_BY_COPIES": True}
    for bad, msg in (("KEYS_BY_COPIES", "package.module.NAME=VALUE"),
                     ("cp_modules.ops.mla_attention.NOPE=1", "has no attribute 'NOPE'"),
                     ("cp_modules.ops.mla_attention.KEYS_BY_COPIES=yes", "Python literal")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            apply_switches([bad])
