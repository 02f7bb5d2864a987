"""What every benchmark shares: the results file (figures with the date, GPU and versions), and
the CUDA-graph replay time of a callable."""

from __future__ import annotations

import datetime
import json
import pathlib

import torch
import triton

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def write_results(kind: str, metrics: dict, out: str | pathlib.Path, **extra) -> pathlib.Path:
    """Write ``{out}/{kind}-{date}.json`` holding the date, GPU name, torch and triton versions,
    ``metrics`` and any ``extra`` top-level fields; return its path."""
    report = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "metrics": metrics,
        **extra,
    }
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{kind}-{report['date']}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def graph_replay_us(fn, rep: int = 40) -> float:
    """Median µs of ``do_bench`` (L2 flushed before each replay) over a CUDA graph of ``fn``,
    after one eager call (compilation, allocations)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = float(do_bench(graph.replay, warmup=10, rep=rep, return_mode="median"))
    del graph
    return ms * 1e3
