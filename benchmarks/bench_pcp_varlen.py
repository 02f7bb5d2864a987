"""PCP attention of many requests: the block path against one varlen call per rank.

The block path runs each request's head and tail chunk as separate kernel calls (and sums
their gradients row run by row); ``cp_modules.kernels.pcp_varlen`` runs every segment in one
FlashAttention-2 varlen call. For batches of R requests of L tokens (bf16, 32 query heads,
8 KV heads, D = 128) and P ranks, every rank's forward and backward are timed both ways on one
GPU (triton ``do_bench`` medians, alternating), with the host time of one call (launches only,
no synchronisation) next to it, and the two paths' outputs and gradients compared.

    python benchmarks/bench_pcp_varlen.py [--pcp 8] [--batches 1x32768 8x4096 32x4096 64x512]

Writes ``benchmarks/results/pcp-varlen-<date>.json`` (or under $OUT). The crossover sets
``VARLEN_MIN_SEGMENTS`` in ``cp_modules/kernels/pcp_attention.py``.
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
)
from cp_modules.partition import plan_pcp  # noqa: E402

HQ, HKV, D = 32, 8, 128


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


def bench(R, L, P, rounds):
    n = [L] * R
    N = sum(n)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(N, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
        for h in (HQ, HKV, HKV)
    )
    dout = torch.randn(N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = D**-0.5
    ranks = []
    for r in range(P):
        plan = plan_pcp(n, [0] * R, P, r, device="cuda")
        ql, dl = q[plan.token_indices], dout[plan.token_indices]
        args = (plan.segments_host, None, None, None, scale)
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
            "dq_dk_dv": [rel_err(a, b) for a, b in zip(gv[:3], gb[:3])],
        }
        ranks.append({"fns": fns, "err": err})
    out = {"R": R, "L": L, "P": P, "ranks": []}
    for r, x in enumerate(ranks):
        times = {f"{p}_{d}": [] for p in ("blocks", "varlen") for d in ("fwd", "bwd")}
        for rnd in range(rounds):
            order = ["blocks", "varlen"] if rnd % 2 == 0 else ["varlen", "blocks"]
            for p in order:
                times[f"{p}_fwd"].append(do_bench(x["fns"][p][0]))
                times[f"{p}_bwd"].append(do_bench(x["fns"][p][1]))
        entry = {"rank": r, "err": x["err"]}
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
        f"R={R} L={L} P={P}: worst rank fwd blocks {worst['blocks_fwd']:.3f} varlen "
        f"{worst['varlen_fwd']:.3f} ms, bwd blocks {worst['blocks_bwd']:.3f} varlen "
        f"{worst['varlen_bwd']:.3f} ms; max rel err {max(max(e['err']['dq_dk_dv']) for e in out['ranks']):.2e}",
        flush=True,
    )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--pcp", type=int, nargs="+", default=[8])
    ap.add_argument("--batches", nargs="+", default=["1x32768", "8x4096", "32x4096", "64x512"])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    res = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bfloat16"},
        "runs": [],
    }
    for P in a.pcp:
        for b in a.batches:
            R, L = (int(x) for x in b.split("x"))
            res["runs"].append(bench(R, L, P, a.rounds))
            torch.cuda.empty_cache()
    where = pathlib.Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    path = where / f"pcp-varlen-{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
