"""What every benchmark shares: the results file (figures with the date, GPU and versions), and
the CUDA-graph replay time of a callable."""

from __future__ import annotations

import contextlib
import datetime
import json
import pathlib
from collections.abc import Iterator
from types import ModuleType

import torch
import triton

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@contextlib.contextmanager
def switched(module: ModuleType, **values) -> Iterator[None]:
    """Set module switches (``NAME=value``) inside the block; the old values come back on exit."""
    saved = {k: getattr(module, k) for k in values}
    try:
        for k, v in values.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


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


def apply_switches(settings: list[str]) -> dict:
    """Set module switches given as ``package.module.NAME=VALUE`` (VALUE a Python literal),
    e.g. ``cp_modules.ops.mla_attention.KEYS_BY_COPIES=True``, before a run; returns them
    ({"package.module.NAME": value}) for the results file.

    Raises:
        ValueError: a setting without ``=``, a module without that attribute, or a value that
            is not a literal.
    """
    import ast
    import importlib

    done: dict = {}
    for item in settings:
        target, sep, text = item.partition("=")
        mod_name, _, attr = target.rpartition(".")
        if not sep or not mod_name:
            raise ValueError(f"--set wants package.module.NAME=VALUE, got {item!r}")
        module = importlib.import_module(mod_name)
        if not hasattr(module, attr):
            raise ValueError(f"--set {item!r}: {mod_name} has no attribute {attr!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"--set {item!r}: the value must be a Python literal") from e
        setattr(module, attr, value)
        done[target] = value
    return done


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
