"""PCP attention of many requests: the block path against one varlen call per rank.

The block path runs each request's head and tail chunk as separate kernel calls (and sums
their gradients row run by row); ``cp_modules.kernels.pcp_varlen`` runs every segment in one
FlashAttention-2 varlen call. For batches of R requests of L tokens (bf16; GQA: 32 query
heads, 8 KV heads, D = 128; MLA prefill: 32 heads, Dqk 192, Dv 128) and P ranks, the first and
last rank's forward and backward are timed both ways on one GPU (triton ``do_bench`` medians,
alternating; a host-bound path is timed at its launch rate), with the host time of one call
(launches only, no synchronisation) next to it, and the two paths' outputs and gradients
compared. The varlen packing is built once per plan, as in a model's layers.

    python benchmarks/bench_pcp_varlen.py [--pcp 2 8] [--shapes gqa mla] [--batches 1x32768 ...]

A batch ``RxL+C`` gives every request a cached prefix of C tokens (chunked prefill: forward
and backward over the prefix too).

Writes ``benchmarks/results/pcp-varlen-<date>.json`` (or under $OUT). The mean forward FLOPs
per segment where the two paths cross set ``VARLEN_MAX_FLOP_PER_SEGMENT`` in
``cp_modules/kernels/pcp_attention.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time
from statistics import median_high as median

import torch
import triton
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cp_modules.kernels.pcp_attention import (  # noqa: E402
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
    segment_flop,
)
from cp_modules.partition import plan_pcp  # noqa: E402

SHAPES = {"gqa": (32, 8, 128, 128), "mla": (32, 32, 192, 128)}  # Hq, Hkv, Dqk, Dv


def host_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return dt * 1e3


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def bench(shape, R, L, P, rounds, C=0):
    hq, hkv, dqk, dv = SHAPES[shape]
    n = [L] * R
    N = sum(n)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(N, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    )
    pk, pv = (
        torch.randn(R * C, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for d in (dqk, dv)
    )
    dout = torch.randn(N, hq, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = dqk**-0.5
    ranks = []
    for r in sorted({0, P - 1}):
        plan = plan_pcp(n, [C] * R, P, r, device="cuda")
        ql, dl = q[plan.token_indices], dout[plan.token_indices]
        pre = (pk, pv, plan.prefix_cu_seqlens_host) if C else (None, None, None)
        args = (plan.segments_host, *pre, scale)
        fns = {}
        for name, vl in (("blocks", False), ("varlen", True)):
            o, s = pcp_prefill_attention_cuda(ql, k, v, *args, varlen=vl)
            fns[name] = (
                lambda vl=vl, ql=ql, args=args: pcp_prefill_attention_cuda(
                    ql, k, v, *args, varlen=vl
                ),
                lambda vl=vl, o=o, s=s, ql=ql, dl=dl, args=args: (
                    pcp_prefill_attention_backward_cuda(dl, ql, k, v, o, s, *args, varlen=vl)
                ),
            )
        (ob, sb), (ov, sv) = fns["blocks"][0](), fns["varlen"][0]()
        gb, gv = fns["blocks"][1](), fns["varlen"][1]()
        valid = plan.local_valid
        err = {
            "out": rel_err(ov[valid], ob[valid]),
            "lse": (sv[valid] - sb[valid]).abs().max().item(),
            "grads": [rel_err(a, b) for a, b in zip(gv, gb) if a is not None],
        }
        cu = plan.prefix_cu_seqlens_host.tolist() if C else None
        flop = [f for f in segment_flop(plan.segments_host.tolist(), hq, dqk, dv, cu) if f > 0]
        ranks.append({"rank": r, "fns": fns, "err": err, "flop_per_segment": sum(flop) / len(flop)})
    out = {"shape": shape, "R": R, "L": L, "prefix": C, "P": P, "ranks": []}
    for x in ranks:
        times = {f"{p}_{d}": [] for p in ("blocks", "varlen") for d in ("fwd", "bwd")}
        for rnd in range(rounds):
            order = ["blocks", "varlen"] if rnd % 2 == 0 else ["varlen", "blocks"]
            for p in order:
                times[f"{p}_fwd"].append(do_bench(x["fns"][p][0]))
                times[f"{p}_bwd"].append(do_bench(x["fns"][p][1]))
        entry = {k: x[k] for k in ("rank", "err", "flop_per_segment")}
        entry.update({k: median(v) for k, v in times.items()})
        for p in ("blocks", "varlen"):
            entry[f"{p}_host_fwd_ms"] = host_ms(x["fns"][p][0])
            entry[f"{p}_host_bwd_ms"] = host_ms(x["fns"][p][1])
        out["ranks"].append(entry)
    worst = {
        k: max(e[k] for e in out["ranks"])
        for k in ("blocks_fwd", "varlen_fwd", "blocks_bwd", "varlen_bwd")
    }
    out["worst_ms"] = worst
    print(
        f"{shape} R={R} L={L} prefix={C} P={P} flop/seg {ranks[0]['flop_per_segment']:.2e}: worst rank fwd blocks {worst['blocks_fwd']:.3f} varlen "
        f"{worst['varlen_fwd']:.3f} ms, bwd blocks {worst['blocks_bwd']:.3f} varlen "
        f"{worst['varlen_bwd']:.3f} ms; max rel err {max(max(e['err']['grads']) for e in out['ranks']):.2e}",
        flush=True,
    )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--pcp", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument(
        "--batches",
        nargs="+",
        default=["1x32768", "2x16384", "4x8192", "8x4096", "1x8192", "2x4096", "16x1024", "64x512"],
    )
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    res = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {k: dict(zip(("Hq", "Hkv", "Dqk", "Dv"), v)) for k, v in SHAPES.items()},
        "dtype": "bfloat16",
        "runs": [],
    }
    where = pathlib.Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    path = where / f"pcp-varlen-{res['date']}.json"
    for shape in a.shapes:
        for P in a.pcp:
            for b in a.batches:
                R, rest = b.split("x")
                L, _, C = rest.partition("+")
                res["runs"].append(bench(shape, int(R), int(L), P, a.rounds, int(C or 0)))
                path.write_text(json.dumps(res, indent=1))  # after every run: partial results
                torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
