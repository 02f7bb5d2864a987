"""What ``bench_peers`` needs without a GPU: finding the built peers, their versions, the skip
line, row names and the report's Markdown."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

DEFAULT_SITE = "/tmp/peers_site"


def add_site(site: str | None = None) -> str:
    """Put the peers' install folder (``site``, else ``$CP_PEERS_SITE``, else /tmp/peers_site)
    first on ``sys.path`` when it exists; returns the folder."""
    path = site or os.environ.get("CP_PEERS_SITE") or DEFAULT_SITE
    if Path(path).is_dir() and path not in sys.path:
        sys.path.insert(0, path)
    return path


def _first_line(e: BaseException) -> str:
    """The error's type and message on one line (at most 600 characters)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:600]}".rstrip(": ")


def _clear_cuda_error() -> None:
    """Wait for the GPU, then reset the CUDA runtime's last error: a peer's failed launch
    (``invalid argument``) is not sticky, but left in place the next launch of anyone reports it."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the error being cleared
        pass
    import ctypes

    libs = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart" in line:
                libs.add(line.split()[-1])
    for lib in libs:
        try:
            ctypes.CDLL(lib).cudaGetLastError()
        except OSError:
            pass


def peer_versions(importer: Callable[[str], object] = importlib.import_module) -> dict[str, str]:
    """``{"FlashMLA": version, "FlashInfer": version}``; a peer that cannot be imported maps to
    ``"unavailable: <why>"``."""
    found = {}
    try:
        mod = importer("flash_mla")
        cuda = importer("flash_mla.cuda")
        if not hasattr(cuda, "dense_decode_fwd"):
            raise ImportError("flash_mla.cuda has no dense_decode_fwd")
        info = Path(getattr(mod, "__file__", "") or ".").parent / "BUILD_INFO"
        extra = f" ({info.read_text().strip()})" if info.is_file() else ""
        found["FlashMLA"] = f"{getattr(mod, '__version__', '?')}{extra}"
    except Exception as e:  # noqa: BLE001 - any failure means the peer is not there
        found["FlashMLA"] = f"unavailable: {_first_line(e)}"
    try:
        mod = importer("flashinfer")
        found["FlashInfer"] = str(getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        found["FlashInfer"] = f"unavailable: {_first_line(e)}"
    return found


def available(versions: dict[str, str], peer: str) -> bool:
    return not versions.get(peer, "unavailable").startswith("unavailable")


def skip_reason(versions: dict[str, str], cuda: bool, *, cp_only: bool = False) -> str | None:
    """One line saying why the benchmark cannot run, or None if it can (``cp_only``: no peer
    is needed, only this project's kernels and their variants are timed)."""
    if not cuda:
        return "bench_peers: skipped: no CUDA device"
    if not cp_only and not any(available(versions, p) for p in versions):
        why = "; ".join(f"{p} {v.removeprefix('unavailable: ')}" for p, v in versions.items())
        return (
            f"bench_peers: skipped: no peer importable ({why}); build them with "
            "tools/build_peers.py and set CP_PEERS_SITE"
        )
    return None


def row_name(op: str, peer: str, shape: str) -> str:
    """``<op> cp / <peer> time <shape>``: this project's time over the peer's."""
    return f"{op} cp / {peer} time {shape}"


def rate_name(op: str, peer: str, unit: str, shape: str) -> str:
    """``<op> <peer> <unit> <shape>``: the peer's own rate."""
    return f"{op} {peer} {unit} {shape}"


def mla_shape(heads: int, batch: int, ctx: int, block_size: int) -> str:
    tail = "" if block_size == 64 else f" bs={block_size}"
    return f"({heads} heads) B={batch} ctx={ctx}{tail}"


def gqa_shape(model: str, hq: int, hkv: int, batch: int, ctx: int) -> str:
    return f"({model} {hq}/{hkv}) B={batch} ctx={ctx}"


def combine_shape(d: int, n: int) -> str:
    return f"D={d} N={n}"


def summarize(op: str, shape: str, entries: dict, unit: str, metrics: dict) -> None:
    """Add the ratio and rate rows of one shape: ``entries`` maps ``"cp"`` and each peer to
    ``{"us", "rate", "ok"}`` dicts (a peer's entry may hold several variants under
    ``"variants"``; its best checked one counts)."""
    ours = entries.get("cp", {})
    for peer, entry in entries.items():
        if peer == "cp":
            continue
        best = best_variant(entry)
        if best is None:
            continue
        metrics[rate_name(op, peer, unit, shape)] = best["rate"]
        if ours.get("ok") and "us" in ours:
            metrics[row_name(op, peer, shape)] = ours["us"] / best["us"]


def best_variant(entry: dict) -> dict | None:
    """The fastest checked measurement of a peer entry (itself or one of its variants)."""
    cands = list(entry.get("variants", {}).values()) or [entry]
    ok = [c for c in cands if c.get("ok") and "us" in c]
    return min(ok, key=lambda c: c["us"]) if ok else None


def markdown(report: dict) -> str:
    lines = [
        f"# Peers side by side ({report['date']}, {report['gpu']})",
        "",
        f"torch {report['torch']}, triton {report['triton']}; "
        + ", ".join(f"{k} {v}" for k, v in report["peers"].items()),
        "",
        "Below 1.0: this project is faster. Produced by `python -m benchmarks.bench_peers`.",
        "",
        "| row | value |",
        "|---|---|",
    ]
    for k, v in report["metrics"].items():
        lines.append(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    errors = report.get("errors", [])
    if errors:
        lines += ["", "Could not run:", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"
