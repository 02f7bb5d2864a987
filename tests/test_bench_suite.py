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
DATED = "2026-11-30-NVIDIA_H200"


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
    assert (tmp_path / f"{DATED}.md").read_text() == (BENCH / f"{DATED}.md").read_text()
    got = json.loads((tmp_path / f"{DATED}.json").read_text())
    assert got == json.loads((BENCH / f"{DATED}.json").read_text())
    # Every result file the report reads is kept, and it reads all that are kept but the
    # earlier PCP run its notes cite and the two-GPU communication run of the NCCL report.
    kept = {p.name for p in (BENCH / "results").glob("*.json")}
    assert set(got["sources"].values()) == kept - {
        "pcp-first-overlap-2026-11-30.json",
        "dcp_comm-2026-11-30.json",
    }
