#!/usr/bin/env python
"""The whole GPU benchmark suite in one command (one device call, well under 10 minutes).

    python -m benchmarks.suite [--only lse_combine,decode,...] [--timeout 240]
    python benchmarks/suite.py ...        # the same (this file imports nothing of the package)

Runs each part, ``python -m benchmarks.bench_<part>`` from the repository root, in its own
process (a failure or a hang in one does not lose the others), in this order: ceilings (copy
and matmul roofs, dense prefill kernels per shape), lse_combine, pcp, masked (windows and
soft-cap), decode, mla_decode (the 128-head MLA sweep), fp8_kv (fp8 against bf16 KV caches),
modules, parity (one GPU against HF), decoder_parity (one GPU, decoder training
against HF's sdpa), peers (FlashMLA and FlashInfer beside this project, when tools/build_peers.py
has built them), loading (GPU memory of a Llama-3-8B-shaped load at world 1), speculative
(speculative decoding against the plain engine). Every
part checks its kernels against their references on the benchmark shapes first and reports no
speed for a wrong kernel (exit status 1). Then ``benchmarks.report`` merges the newest results
into ``benchmarks/<date>-<gpu>.{json,md}`` and plots. Exit status: 0 only if every part passed
its correctness gate. Measurements outside the suite are options of the parts (``--help``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORDER = (
    "ceilings", "lse_combine", "pcp", "masked", "decode", "mla_decode", "fp8_kv", "modules",
    "parity", "decoder_parity", "peers", "loading", "speculative",
)  # fmt: skip


def run_suite(only: list[str] | None = None, timeout_s: float = 240.0) -> int:
    """Run the selected parts and the report; returns the number of failed parts."""
    names = [n for n in ORDER if only is None or n in only]
    unknown = set(only or []) - set(ORDER)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; valid: {list(ORDER)}")
    failed = []
    for name in names:
        t0 = time.time()
        print(f"=== {name}", flush=True)
        try:
            rc = subprocess.run(
                [sys.executable, "-m", f"benchmarks.bench_{name}"], cwd=REPO, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(
            f"=== {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.time() - t0:.0f} s",
            flush=True,
        )
        if rc != 0:
            failed.append(name)
    subprocess.run([sys.executable, "-m", "benchmarks.report"], cwd=REPO, check=False)
    if failed:
        print(f"failed or refused to report: {failed}", flush=True)
    return len(failed)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {list(ORDER)}")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per part")
    a = ap.parse_args()
    return 1 if run_suite(a.only.split(",") if a.only else None, a.timeout) else 0


if __name__ == "__main__":
    sys.exit(main())
