"""What the fp8 cache's bf16 window (cp_modules.cache.exact_window) adds to one decode layer.

One all-decode step of 1 and of 4 attention layers (cache write, decode, window write and
merge; the layers share one cache), captured in a CUDA graph and replayed; median of replays.
The window's index math (which slots a token writes, which keys a query reads from the window)
is computed once a step and shared by the step's layers, as in a model; so each row gives the
window's cost per layer (``layer_added_us``, from the 4-layer step less the 1-layer step) and
once per step (``step_added_us``). GQA: Llama-3-8B's layout (32 query heads, 8 KV heads,
D=128); MLA: DeepSeek-V3's (128 heads, latent 512 + 64), bf16 model.

    python tools/probes/probe_fp8_window_cost.py [--out DIR] [--profile]

``--profile``: also each case's kernels (torch.profiler, 5 eager steps after a warm-up; GPU time
per kernel name), printed and written to ``fp8-window-cost-kernels.txt``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from cp_modules.cache.exact_window import allocate_window_buffer, check_exact_window
from cp_modules.cache.kv_dtype import kv_scale
from cp_modules.cache.paged import allocate_kv_cache, allocate_mla_cache
from cp_modules.ops.gqa_attention import gqa_attention
from cp_modules.ops.mla_attention import mla_attention
from cp_modules.step import CPRuntime, build_step_metadata, cp_step

BS = 64


def _time(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _kernels(fn, steps=5) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=25, max_name_column_width=90
    )


def _case(kind, b, ctx, window, layers, prof=None):
    dev, dt = "cuda", torch.bfloat16
    per = -(-(ctx + 1) // BS)
    table = torch.arange(b * per, dtype=torch.int32, device=dev).view(b, per)
    meta = build_step_metadata(CPRuntime.single(), [1] * b, [ctx] * b, block_table=table,
                               block_size=BS, device=dev, check_consistency=False)  # fmt: skip
    win = check_exact_window(*window)
    if kind == "gqa":
        kc, vc = allocate_kv_cache(b * per, BS, 8, 128, dtype=torch.float8_e4m3fn, device=dev)
        kc.view(torch.uint8).random_(0, 120)
        vc.view(torch.uint8).random_(0, 120)
        sc = (kv_scale(1.0, 8, device=dev), kv_scale(1.0, 8, device=dev))
        fw = None
        if win is not None:
            buf = allocate_window_buffer(b, win, (2, 8, 128), dtype=dt, device=dev)
            fw = (buf, *window)
        q, k = (
            torch.randn(b, 32, 128, device=dev, dtype=dt),
            torch.randn(b, 8, 128, device=dev, dtype=dt),
        )

        def step():
            with cp_step(meta):
                for _ in range(layers):
                    gqa_attention(q, k, k, (kc, vc), scale=128**-0.5, kv_scales=sc, fp8_window=fw)

    else:
        cache = allocate_mla_cache(b * per, BS, 512, 64, dtype=torch.float8_e4m3fn, device=dev)
        cache.view(torch.uint8).random_(0, 120)
        fw = None
        if win is not None:
            buf = allocate_window_buffer(b, win, (576,), dtype=dt, device=dev)
            fw = (buf, *window)
        q = torch.randn(b, 128, 192, device=dev, dtype=dt)
        lat = torch.randn(b, 576, device=dev, dtype=dt)
        w_uk = torch.randn(128, 128, 512, device=dev, dtype=dt) * 0.04
        w_uv = torch.randn(128, 128, 512, device=dev, dtype=dt) * 0.04

        c_scale = kv_scale(1.0, 1, device=dev)  # (made before the graph's capture)

        def step():
            with cp_step(meta):
                for _ in range(layers):
                    mla_attention(q, lat, w_uk, w_uv, cache, scale=192**-0.5, kv_lora_rank=512,
                                  cache_scale=c_scale, fp8_window=fw)  # fmt: skip

    if prof is not None:
        prof.append(
            f"## {kind} B={b} ctx={ctx} window={window} layers={layers} (5 steps)\n{_kernels(step)}"
        )
    return _time(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    rows = []
    prof: list[str] | None = [] if args.profile else None
    for kind, shapes in (("gqa", [(1, 131072), (8, 32768), (64, 16384)]),
                         ("mla", [(1, 131072), (8, 32768), (64, 4096)])):  # fmt: skip
        for b, ctx in shapes:
            t = {
                (w, n): _case(kind, b, ctx, w, n, prof if n == 1 else None)
                for w in ((0, 0), (1, 16))
                for n in (1, 4)
            }
            layer = (t[(1, 16), 4] - t[(1, 16), 1] - t[(0, 0), 4] + t[(0, 0), 1]) / 3
            rows.append(dict(
                kind=kind, B=b, ctx=ctx, plain_us=round(t[(0, 0), 1], 2),
                window_us=round(t[(1, 16), 1], 2), plain4_us=round(t[(0, 0), 4], 2),
                window4_us=round(t[(1, 16), 4], 2), layer_added_us=round(layer, 2),
                step_added_us=round(t[(1, 16), 1] - t[(0, 0), 1] - layer, 2),
            ))  # fmt: skip
            print(rows[-1], flush=True)
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8-window-cost.json").write_text(
            json.dumps(dict(info=info, rows=rows), indent=1)
        )
    if prof:
        text = "\n\n".join(prof)
        print(text)
        if args.out:
            (Path(args.out) / "fp8-window-cost-kernels.txt").write_text(text)


if __name__ == "__main__":
    main()
