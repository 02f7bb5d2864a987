#!/usr/bin/env python
"""Each program's timeline in the Gluon MLA decode kernel (its ``trace`` stamps).

Run from the repository root on a CUDA machine: ``python tools/probes/probe_mla_timeline.py [--out D]``.
Writes ``D/mla-timeline-probe.json``. For each shape (128 heads, the default schedule and split
count) the op runs in a CUDA graph, replayed 20 times back to back; the stamps of the last
replay give, per program (µs from the first program's start): its start, Q's wait, warp group
0's pairs, its store of the half and the LSE, warp group 1's pairs and store, and the end. Each
is summarised as min / median / max over the programs, next to the op's replay median
(``do_bench``). Every shape is first checked against the reference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_mla_decode as bm  # noqa: E402
from cp_modules.kernels.decode import mla_gluon as gluon  # noqa: E402

SHAPES = [(64, 8, 4096), (16, 8, 4096), (64, 8, 32768), (64, 64, 32768), (64, 256, 4096)]


def _stats(x: torch.Tensor) -> dict:
    x = x.double() / 1e3
    return {"min": x.min().item(), "median": x.median().item(), "max": x.max().item()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "rows": {}}  # fmt: skip
    for bs, b, ctx in SHAPES:
        pool = bm.make_pool(bs, b * ctx)
        q, bt, seq, lens = bm.make_inputs(pool, 128, b, ctx)
        ref = bm.reference(pool, q, bt, seq, lens)
        cfg = gluon.default_gluon_mla_config(bs)
        splits = gluon.choose_gluon_mla_num_splits(cfg, b * 2, bt.shape[1] * bs, sms)
        trace = torch.zeros(b * 2 * splits * 8, dtype=torch.int64, device="cuda")

        def fn(trace=trace, args=(q, pool, bt, seq, lens), s=splits):
            return gluon.paged_mla_attention_gluon(*args, bm.SCALE, bm.RK, s, trace=trace)

        out, lse = fn()
        ok = bm.check(out, lse, ref)["ok"]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        op_us = float(do_bench(graph.replay, warmup=10, rep=40, return_mode="median")) * 1e3
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        t = trace.view(-1, 8)
        t0 = t[:, 0].min()
        end = torch.maximum(t[:, 3], t[:, 5])
        tiles = triton.cdiv(triton.cdiv(ctx, splits), 64)
        row = {
            "splits": splits, "programs": t.shape[0], "tiles_per_program": tiles, "ok": ok,
            "op_us": op_us, "span_us": (end.max() - t0).item() / 1e3,
            "start": _stats(t[:, 0] - t0), "q_wait": _stats(t[:, 1] - t[:, 0]),
            "wg0_pairs": _stats(t[:, 2] - t[:, 1]), "wg0_store": _stats(t[:, 3] - t[:, 2]),
            "wg1_pairs_end": _stats(t[:, 4] - t[:, 1]), "wg1_store": _stats(t[:, 5] - t[:, 4]),
            "end": _stats(end - t0), "sms_used": int(t[:, 6].unique().numel()),
        }  # fmt: skip
        print(f"bs {bs} B={b} ctx={ctx}: {json.dumps(row)}", flush=True)
        res["rows"][f"bs{bs} B={b} ctx={ctx}"] = row
        del graph, pool
        torch.cuda.empty_cache()
    Path(a.out, "mla-timeline-probe.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
