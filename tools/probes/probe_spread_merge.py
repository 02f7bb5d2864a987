#!/usr/bin/env python
"""Where the spread split merge's time goes at B = 8 (128 heads, 8 splits).

Run from the repository root on a CUDA machine: ``python tools/probes/probe_spread_merge.py [--out D]``.
Writes ``D/spread-merge-probe.json``: for block sizes 64 and 16 and B=8 at ctx 4k and 32k, the
whole op (µs, CUDA-graph replay medians) of

* ``separate``: the default schedule with its separate merge launch;
* ``kernel``: the same with the merge launch replaced by a no-op (the kernel alone);
* ``separate-coop``: the default schedule launched as a cooperative grid (what the launch
  attribute alone costs);
* ``spread``: ``loader2-r232-early-spread`` (cooperative, the merge in the kernel);
* ``spread-nocoop``: the same kernel launched without the cooperative attribute (the grid of
  128 programs is resident on an idle H200 anyway).

Every timed variant is first checked against the reference (``bench_mla_decode.check``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_mla_decode as bm  # noqa: E402
from cp_modules.kernels.decode import mla_gluon as gluon  # noqa: E402
from tools.probes.probe_split_merge import graph_us  # noqa: E402


class _ForceCoop:
    """Stands in for the kernel object: launches it with ``launch_cooperative_grid`` forced."""

    def __init__(self, kernel, coop: bool):
        self.kernel, self.coop = kernel, coop

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            kw["launch_cooperative_grid"] = self.coop
            return launch(*args, **kw)

        return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    real_kernel, real_merge = gluon._paged_mla_gluon_kernel, gluon.merge_splits_triton
    spread_cfg = gluon.GLUON_MLA_VARIANTS["loader2-r232-early-spread"]
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "rows": {}}  # fmt: skip
    for bs in (64, 16):
        pool = bm.make_pool(bs, 8 * 32768)
        for ctx in (4096, 32768):
            inputs = bm.make_inputs(pool, 128, 8, ctx)
            ref = bm.reference(pool, *inputs)
            q, bt, seq, lens = inputs
            row: dict = {}
            cases = {
                "separate": (None, None, False),
                "kernel": (None, None, True),
                "separate-coop": (None, True, False),
                "spread": (spread_cfg, None, False),
                "spread-nocoop": (spread_cfg, False, False),
            }
            for name, (cfg, coop, no_merge) in cases.items():
                gluon._paged_mla_gluon_kernel = (
                    real_kernel if coop is None else _ForceCoop(real_kernel, coop)
                )

                def fn(cfg=cfg, args=(q, pool, bt, seq, lens)):
                    return gluon.paged_mla_attention_gluon(*args, bm.SCALE, bm.RK, 8, config=cfg)

                out, lse = fn()
                ok = bm.check(out, lse, ref)["ok"] if not no_merge else None
                if no_merge:
                    gluon.merge_splits_triton = lambda *args: None
                us = graph_us(fn)
                gluon.merge_splits_triton = real_merge
                gluon._paged_mla_gluon_kernel = real_kernel
                row[name] = {"us": us, "ok": ok, "tflops": bm.tflops(128, 8, ctx, us / 1e3)}
                print(f"bs {bs} B=8 ctx={ctx} {name}: {row[name]}", flush=True)
            res["rows"][f"bs{bs} B=8 ctx={ctx}"] = row
        del pool
        torch.cuda.empty_cache()
    Path(a.out, "spread-merge-probe.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
