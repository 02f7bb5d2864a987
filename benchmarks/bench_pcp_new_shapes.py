"""PCP prefill of prompts whose lengths the process has not seen: the cost of new shapes.

cuDNN builds an execution plan for every new attention shape (tens of ms); FlashAttention-2
has no per-shape cost. A serving process meets a new prompt length at almost every step, so
the first call of a plan is what it pays. For single prompts of random lengths (bf16, GQA:
32 query heads, 8 KV heads, D = 128; MLA prefill: 32 heads, Dqk 192, Dv 128) and P ranks,
the first and the second forward and backward of one rank (the last) are timed through the
varlen path, the automatic choice (which rents the varlen path for a plan of new shapes:
``CUDNN_BUILD_S`` in ``cp_modules/kernels/pcp_attention.py``) and the block path, in that
order on the same lengths (FlashAttention-2 keeps nothing per shape, and the blocks come last,
so their first calls meet shapes cuDNN has not seen).

    python benchmarks/bench_pcp_new_shapes.py [--pcp 2 8] [--shapes gqa mla] [--prompts 6]

Writes ``benchmarks/results/pcp-new-shapes-<date>.json`` (or under $OUT).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import random
import sys
import time
from statistics import median

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cp_modules.kernels.pcp_attention import (  # noqa: E402
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
)
from cp_modules.partition import plan_pcp  # noqa: E402

SHAPES = {"gqa": (32, 8, 128, 128), "mla": (32, 32, 192, 128)}  # Hq, Hkv, Dqk, Dv
PATHS = {"varlen": True, "auto": None, "blocks": False}


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def one_prompt(shape, S, P, varlen):
    hq, hkv, dqk, dv = SHAPES[shape]
    q = torch.randn(S, hq, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(S, hkv, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(S, hkv, dv, device="cuda", dtype=torch.bfloat16)
    plan = plan_pcp([S], [0], P, P - 1, device="cuda")
    ql = q[plan.token_indices]
    args = (plan.segments_host, None, None, None, dqk**-0.5)
    res = {}
    for call in ("first", "second"):
        t_f, (o, lse) = timed(lambda: pcp_prefill_attention_cuda(ql, k, v, *args, varlen=varlen))
        dout = torch.randn_like(o)
        grads = (dout, ql, k, v, o, lse, *args)
        t_b, _ = timed(lambda g=grads: pcp_prefill_attention_backward_cuda(*g, varlen=varlen))
        res[call] = {"fwd_ms": t_f, "bwd_ms": t_b}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--pcp", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--prompts", type=int, default=6)
    a = ap.parse_args(argv)
    rng = random.Random(0)
    # Warm up the libraries (first-ever calls) on a shape no measured prompt has.
    for varlen in (False, True):
        for shape in a.shapes:
            one_prompt(shape, 1000, 2, varlen)
    res = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "shapes": {k: dict(zip(("Hq", "Hkv", "Dqk", "Dv"), v)) for k, v in SHAPES.items()},
        "dtype": "bfloat16",
        "runs": [],
    }
    for shape in a.shapes:
        for P in a.pcp:
            summary = {}
            lengths = [rng.randint(12000, 30000) for _ in range(a.prompts)]
            for path, varlen in PATHS.items():
                runs = [one_prompt(shape, S, P, varlen) for S in lengths]
                res["runs"].append(
                    {"shape": shape, "P": P, "path": path, "lengths": lengths, "calls": runs}
                )
                summary[path] = {
                    f"{c}_{d}": median(r[c][f"{d}_ms"] for r in runs)
                    for c in ("first", "second")
                    for d in ("fwd", "bwd")
                }
            print(
                f"{shape} P={P} median ms (first / second call), fwd | bwd: "
                + "; ".join(
                    f"{p} {s['first_fwd']:.1f} / {s['second_fwd']:.2f} | "
                    f"{s['first_bwd']:.1f} / {s['second_bwd']:.2f}"
                    for p, s in summary.items()
                ),
                flush=True,
            )
    where = pathlib.Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    path = where / f"pcp-new-shapes-{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
