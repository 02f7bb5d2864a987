#!/usr/bin/env python
"""Where the Gluon tokens-on-M fp8 MLA decode (``kernels/decode/mla_tokens_gluon.py``) spends a
small decode: graph-replay medians of the op at several split counts beside the automatic
one, and the kernel's and the split merge's own durations from the profiler.

Run from the repository root on an sm_90 GPU:

    python tools/probes/probe_mla_tokens_gluon_splits.py [--shapes 1x131072,8x32768] [--heads 16]
        [--kernel tokens|regs]

``--kernel regs``: the register-operand kernel (``kernels/decode/mla_regs_gluon.py``) instead,
its automatic split count as the launcher's (``choose_regs_splits``). ``--splits`` takes
factors of the automatic count or ``=N`` for N splits; ``--fill`` a list of fractions of each
shape's length that the requests are given (the same block tables and grid: 0 times the
program's fixed cost alone); ``--trace`` (regs) each program's timeline from the kernel's
global-timer stamps: medians of the query's load, the first tile's wait, the loop, the epilogue,
and the spread of the programs' starts and ends.

DeepSeek's latent (576 wide, block size 64), random bf16 values quantized to e4m3, scattered
block tables. Every split count is first checked against the fp32 reference (the 2x rule).
Prints one line a shape and split count, and writes the rows as JSON to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import graph_replay_us  # noqa: E402
from cp_modules.kernels.decode import mla_regs_gluon  # noqa: E402
from cp_modules.kernels.decode.mla_regs_gluon import paged_mla_regs_gluon  # noqa: E402
from cp_modules.kernels.decode.mla_tokens_gluon import paged_mla_tokens_gluon  # noqa: E402
from cp_modules.kernels.decode.tiles import _num_sms, choose_mla_num_splits  # noqa: E402
from cp_modules.reference.paged_decode import paged_mla_attention_ref  # noqa: E402
from cp_modules.testing.numerics import assert_decode_close  # noqa: E402

RK, ROPE, BS = 512, 64, 64


def _kernel_us(fn) -> dict:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            out[e.key[:40]] = e.device_time_total / e.count
    return out


def _timeline(op, q, c8, bt, seq, lens, scale, s, one) -> dict:
    """One launch with the kernel's stamps: medians over the programs (µs)."""
    buf = torch.zeros(q.shape[0] * s * 8, dtype=torch.int64, device=q.device)
    op(q, c8, bt, seq, lens, scale, RK, s, kv_scale=one, trace=buf)
    torch.cuda.synchronize()
    st = buf.view(-1, 8)[:, :5].double() / 1e3
    t0 = st[:, 0].min()

    def med(x):
        return round(float(x.median()), 2)

    return {"query": med(st[:, 1] - st[:, 0]), "first_tile_wait": med(st[:, 2] - st[:, 1]),
            "loop": med(st[:, 3] - st[:, 2]), "epilogue": med(st[:, 4] - st[:, 3]),
            "starts_spread": round(float(st[:, 0].max() - t0), 2),
            "first_end": round(float(st[:, 4].min() - t0), 2),
            "last_end": round(float(st[:, 4].max() - t0), 2)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x131072,8x32768,8x131072,64x32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--splits", default="auto,0.5,2")
    ap.add_argument("--out", default="")
    ap.add_argument("--kernel", default="tokens", choices=["tokens", "regs"])
    ap.add_argument("--fill", default="1")
    ap.add_argument("--trace", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    rows = []
    for shape in a.shapes.split(","):
        b, ctx = (int(x) for x in shape.split("x"))
        width = -(-ctx // BS)
        nb = b * width + 1
        g = torch.Generator(device=dev).manual_seed(0)
        c8 = torch.randn(nb, BS, RK + ROPE, device=dev, generator=g).to(torch.float8_e4m3fn)
        bt = torch.randperm(nb, device=dev, generator=g)[: b * width].view(b, width).int()
        q = torch.randn(b, a.heads, RK + ROPE, device=dev, generator=g).bfloat16()
        seq = torch.arange(b, device=dev, dtype=torch.int32)
        lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
        one = torch.ones(1, device=dev)
        scale = (128 + ROPE) ** -0.5
        op = paged_mla_regs_gluon if a.kernel == "regs" else paged_mla_tokens_gluon
        if a.kernel == "regs":
            auto = mla_regs_gluon.choose_regs_splits(
                b * -(-a.heads // 16), width * BS, _num_sms(q.device),
                mla_regs_gluon.REGS_PROGRAMS_PER_SM,
            )  # fmt: skip
        else:
            auto = choose_mla_num_splits(b, width * BS, _num_sms(q.device), 64, 1)
        runs = [(f, fill) for fill in a.fill.split(",") for f in a.splits.split(",")]
        for f, fill in runs:
            if f.startswith("="):
                s = int(f[1:])
            else:
                s = auto if f == "auto" else max(1, round(auto * float(f)))
            lens.fill_(int(ctx * float(fill)))

            fn = functools.partial(op, q, c8, bt, seq, lens, scale, RK, s, kv_scale=one)
            out, lse = op(q[:1], c8, bt, seq[:1], lens[:1], scale, RK, s, kv_scale=one)
            ref = paged_mla_attention_ref(q[:1], c8, bt, seq[:1], lens[:1], scale, RK,
                                          kv_scale=one)  # fmt: skip
            same = paged_mla_attention_ref(q[:1], c8, bt, seq[:1], lens[:1], scale, RK,
                                           kv_scale=one, upcast=False)  # fmt: skip
            assert_decode_close(out, lse, ref, same)
            us = graph_replay_us(fn)
            kern = _kernel_us(fn)
            tb = float(lens.double().sum()) * (RK + ROPE) / us / 1e6
            row = {"kernel": a.kernel, "batch": b, "ctx": ctx, "fill": float(fill),
                   "heads": a.heads, "splits": s,
                   "auto": s == auto,
                   "graph_us": us, "fp8_tb_s": tb, "kernels_us": kern}  # fmt: skip
            if a.trace and a.kernel == "regs":
                row["trace_us"] = _timeline(op, q, c8, bt, seq, lens, scale, s, one)
                print(f"  timeline (us): {row['trace_us']}", flush=True)
            rows.append(row)
            ks = ", ".join(f"{k} {v:.1f}" for k, v in kern.items())
            print(f"B={b} ctx={ctx} fill={fill} heads={a.heads} splits={s}"
                  f"{' (auto)' if s == auto else ''}: "
                  f"{us:.1f} us graph, {tb:.2f} TB/s; kernels: {ks}", flush=True)  # fmt: skip
        del c8, fn
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "device": torch.cuda.get_device_name()},
                                          indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
