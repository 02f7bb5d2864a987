#!/usr/bin/env python
"""Where MLA decode's time goes at small batches, and the split merge's launch parameters.

Run from the repository root on a CUDA machine: ``python tools/probes/probe_split_merge.py [--out D]``.
Writes ``D/split-merge-probe.json``:

* ``breakdown``: 128-head MLA decode (the Gluon kernel's default schedule) at B=8 ctx 4k / 32k,
  B=64 / 256 ctx 4k, block sizes 16 and 64, for several split counts: the whole op, the kernel
  alone (the merge replaced by a no-op) and the merge alone on fp32 partials of that shape;
* ``merge``: :func:`merge_splits_triton` for MLA's and GQA's split shapes under every launch
  configuration of a grid (rows, columns, splits per load, warps), ``old`` being one row and 64
  columns per program (the launch before 2026-12-02), ``default`` the library's choice.

Times are medians of CUDA-graph replays (``triton.testing.do_bench``); every MLA run is first
checked against the reference (``benchmarks.bench_mla_decode.check``).
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
from benchmarks.common import graph_replay_us  # noqa: E402
from cp_modules.kernels.decode import mla_gluon as gluon  # noqa: E402
from cp_modules.kernels.merge import (  # noqa: E402
    merge_splits_launch_config,
    merge_splits_triton,
)

MERGE_SHAPES = [  # (T, H, S, Dv): MLA at B = 8 / 1 / 64, GQA (32 heads) at several B
    (8, 128, 8, 512), (1, 128, 64, 512), (1, 128, 63, 512), (64, 128, 2, 512),
    (8, 128, 16, 512), (256, 32, 2, 128), (8, 32, 33, 128), (1, 32, 64, 128), (16, 32, 8, 128),
]  # fmt: skip


def merge_buffers(t, h, s, d):
    o_buf, l_buf = torch.randn(t, h, s, d, device="cuda"), torch.randn(t, h, s, device="cuda")
    out = torch.empty(t, h, d, device="cuda", dtype=torch.bfloat16)
    return o_buf, l_buf, out, torch.empty(t, h, device="cuda")


def breakdown() -> dict:
    res = {}
    real_merge = gluon.merge_splits_triton
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bs in (64, 16):
        pool = bm.make_pool(bs, 256 * 4096 + 8 * 32768)
        for b, c in [(8, 4096), (8, 32768), (64, 4096), (256, 4096)]:
            inputs = bm.make_inputs(pool, 128, b, c)
            ref = bm.reference(pool, *inputs)
            q, bt, seq, lens = inputs
            cfg = gluon.default_gluon_mla_config(bs)
            default = gluon.choose_gluon_mla_num_splits(cfg, b * 2, bt.shape[1] * bs, sms)
            row: dict = {"default_splits": default}
            for s in sorted({1, 2, 4, 8, 16, default} if b == 8 else {1, 2, 4, default}):

                def fn(s=s, args=(q, pool, bt, seq, lens)):
                    return gluon.paged_mla_attention_gluon(*args, bm.SCALE, bm.RK, s)

                out, lse = fn()
                ok = bm.check(out, lse, ref)["ok"]
                whole = graph_replay_us(fn)
                gluon.merge_splits_triton = lambda *a: None
                kernel = graph_replay_us(fn)
                gluon.merge_splits_triton = real_merge
                bufs = merge_buffers(b, 128, s, 512) if s > 1 else None
                merge = (
                    graph_replay_us(lambda bufs=bufs: merge_splits_triton(*bufs)) if bufs else 0.0
                )
                row[s] = dict(ok=ok, us=whole, kernel_us=kernel, merge_us=merge,
                              tflops=bm.tflops(128, b, c, whole / 1e3))  # fmt: skip
                print(f"bs {bs} B={b} ctx={c} S={s}: {row[s]}", flush=True)
            res[f"bs{bs} B={b} ctx={c}"] = row
        del pool
        torch.cuda.empty_cache()
    return res


def merge_sweep() -> dict:
    res = {}
    for t, h, s, d in MERGE_SHAPES:
        bufs = merge_buffers(t, h, s, d)
        block_s = triton.next_power_of_2(s)
        configs: dict = {"old": (1, 64, min(32, block_s), 4), "default": None}
        for r in (1, 2, 4, 8, 16):
            for dv in (64, 128, 256):
                if dv > triton.next_power_of_2(d):
                    continue
                for w in (4, 8):
                    ch = max(1, min(block_s, 4096 // (r * dv)))
                    for c in {ch, max(1, ch // 2)}:
                        configs[f"r{r}-dv{dv}-c{c}-w{w}"] = (r, dv, c, w)
        nbytes = bufs[0].numel() * 4 + bufs[2].numel() * 2
        merge_splits_triton(*bufs)
        want = bufs[2].clone()
        row: dict = {"default_config": merge_splits_launch_config(s, d)}
        for name, cfg in configs.items():
            merge_splits_triton(*bufs, cfg)
            ok = bool((bufs[2].float() - want.float()).abs().max().item() <= 1e-2)
            us = graph_replay_us(lambda cfg=cfg, bufs=bufs: merge_splits_triton(*bufs, cfg))
            row[name] = {"us": us, "GBps": nbytes / us / 1e3, "ok": ok}
        timed = [k for k in row if k != "default_config"]
        best = min(timed, key=lambda k: row[k]["us"])
        print(f"T={t} H={h} S={s} D={d}: old {row['old']['us']:.1f} us, default "
              f"{row['default']['us']:.1f}, best {best} {row[best]['us']:.1f}", flush=True)  # fmt: skip
        res[f"T={t} H={h} S={s} D={d}"] = row
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "merge": merge_sweep(), "breakdown": breakdown()}  # fmt: skip
    Path(a.out, "split-merge-probe.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
