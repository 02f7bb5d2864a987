"""``bench_pcp timeline``: where a rank's GPU time goes in steady state."""

from __future__ import annotations

import collections
import functools
import json
import tempfile

import torch
from triton.testing import do_bench

from benchmarks.pcp.common import (
    median,
    rank_fns,
    shape_inputs,
)
from cp_modules.kernels.prefill.attention_blocks import (
    attention_block_backward,
    attention_block_forward,
)
from cp_modules.kernels.prefill.pcp_key_major import pcp_key_major_backward
from cp_modules.partition import plan_pcp

# --- timeline: where a rank's GPU time goes in steady state ----------------------------------
# The pattern do_bench times (an L2 flush, then the call, no host syncs), repeated under the
# torch profiler; each call's GPU span (end of the flush to its last kernel) is split into busy
# time (union of all kernels on all streams), idle time and kernel classes. MLA's backward is
# its training path (key-major).

TIMELINE_REPS = 12
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_class(name: str) -> str:
    if "dot_do_o" in name:
        return "cudnn_dO_dot_O"
    if "convert_dq" in name:
        return "cudnn_dq_convert"
    if "cudnn" in name or "sdpa" in name or "fmha" in name or "flash" in name:
        return "cudnn_attention"
    if "merge" in name:
        return "lse_merge"
    if "Memcpy" in name or "copy" in name.lower():
        return "copy"
    if "Memset" in name or "Fill" in name:
        return "fill"
    if "add" in name.lower() or "sum_rows" in name:
        return "gradient_sum"
    return "other"


def timeline(fn) -> dict:
    """Median over ``TIMELINE_REPS`` do_bench-style calls of (span, busy) in microseconds and
    the kernel time by class."""
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")  # do_bench's 256 MB
    marker = torch.ones(1, dtype=torch.float64, device="cuda")  # the only float64 kernel
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(TIMELINE_REPS):
            flush.zero_()
            marker.mul_(1.0)
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    ev = sorted((e for e in events if e.get("cat") in GPU_EVENTS), key=lambda e: e["ts"])
    marks = [i for i, e in enumerate(ev) if "double" in e["name"]]
    calls = []
    # Each call: the kernels after its marker and before the next call's flush.
    for a, b in zip(marks[1:-1], marks[2:]):
        body = ev[a + 1 : b - 1]
        t0 = ev[a]["ts"] + ev[a]["dur"]
        t1 = max(e["ts"] + e["dur"] for e in body)
        busy, (cs, ce) = 0.0, (t0, t0)
        for s, e in sorted((e["ts"], e["ts"] + e["dur"]) for e in body):
            if s > ce:
                busy += ce - cs
                cs, ce = s, e
            else:
                ce = max(ce, e)
        busy += ce - cs
        by = collections.defaultdict(float)
        for e in body:
            by[kernel_class(e["name"])] += e["dur"]
        calls.append({"span_us": t1 - t0, "busy_us": busy, "kernels": len(body), "by_class_us": by})
    return sorted(calls, key=lambda c: c["span_us"])[len(calls) // 2]


def timeline_shape(name: str, pcps: list[int]) -> dict:
    q, k, v, dout, scale = shape_inputs(name)
    out, lse = attention_block_forward(q, k, v, scale=scale, causal=True)

    def dense_fwd():
        return attention_block_forward(q, k, v, scale=scale, causal=True)

    def dense_bwd():
        return attention_block_backward(dout, q, k, v, out, lse, scale=scale, causal=True)

    t_fwd = median([do_bench(dense_fwd, return_mode="median") for _ in range(3)])
    t_bwd = median([do_bench(dense_bwd, return_mode="median") for _ in range(3)])
    res = {"dense_ms": {"fwd": t_fwd, "bwd": t_bwd}, "dense_bwd": timeline(dense_bwd), "pcp": {}}
    print(f"[{name}] dense fwd {t_fwd:.2f} ms, bwd {t_bwd:.2f} ms", flush=True)
    for P in pcps:
        for r in sorted({0, P - 1}):
            plan = plan_pcp([q.shape[0]], [0], P, r, device="cuda")
            fwd, bwd, _ = rank_fns(plan, q, k, v, dout, scale)
            if name.startswith("mla"):
                kl, vl = k[plan.token_indices], v[plan.token_indices]
                bwd = functools.partial(
                    pcp_key_major_backward, dout, q, out, lse, kl, vl, plan.segments_host, scale
                )
            for what, fn, dense in (("fwd", fwd, t_fwd), ("bwd", bwd, t_bwd)):
                ideal_us = dense / P * 1e3
                ms = median([do_bench(fn, return_mode="median") for _ in range(3)])
                tl = timeline(fn)
                entry = {
                    "do_bench_ratio": ms * 1e3 / ideal_us,
                    "span_ratio": tl["span_us"] / ideal_us,
                    "busy_ratio": tl["busy_us"] / ideal_us,
                    "idle_us": tl["span_us"] - tl["busy_us"],
                    "class_ratio": {c: t / ideal_us for c, t in tl["by_class_us"].items()},
                    **tl,
                }
                res["pcp"][f"P{P}-rank{r}-{what}"] = entry
                classes = ", ".join(
                    f"{c} {x:.3f}"
                    for c, x in sorted(entry["class_ratio"].items(), key=lambda kv: -kv[1])
                )
                print(
                    f"[{name}] P={P} rank {r} {what}: do_bench {entry['do_bench_ratio']:.3f}, "
                    f"span {entry['span_ratio']:.3f}, busy {entry['busy_ratio']:.3f} x dense/P "
                    f"(idle {entry['idle_us']:.0f} us); {classes}",
                    flush=True,
                )
    return res
