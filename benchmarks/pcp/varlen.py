"""``bench_pcp varlen``: many requests, the block path against one varlen call per rank."""

from __future__ import annotations

import time

import torch
from triton.testing import do_bench

from benchmarks.pcp.common import (
    ALWAYS_VARLEN,
    NEVER_VARLEN,
    median,
)
from cp_modules.ops.pcp_policy import (
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
    segment_flop,
)
from cp_modules.partition import plan_pcp
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
)

# --- varlen: many requests, the block path against one varlen call per rank -----------------
# The block path runs each request's head and tail chunk as separate kernel calls (and sums their
# gradients row run by row); cp_modules.kernels.prefill.pcp_varlen runs every segment in one
# FlashAttention-2 varlen call. For R requests of L tokens (+ C cached: chunked prefill, forward
# and backward over the prefix too) the first and last rank are timed both ways (do_bench
# medians, alternating; a host-bound path is timed at its launch rate), with the host time of
# one call beside it and the two paths' outputs and gradients compared. The varlen packing is
# built once per plan, as in a model's layers.

MANY_SHAPES = {"gqa": (32, 8, 128, 128), "mla": (32, 32, 192, 128)}  # Hq, Hkv, Dqk, Dv


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


def varlen_batch(shape, R, L, P, rounds, C=0):
    hq, hkv, dqk, dv = MANY_SHAPES[shape]
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
        inputs = PrefillInputs(ql, k, v, plan.segments_host, *pre, scale)
        fns = {}
        for name, pol in (("blocks", NEVER_VARLEN), ("varlen", ALWAYS_VARLEN)):
            o, s = pcp_prefill_attention_cuda(inputs, policy=pol)
            fns[name] = (
                lambda pol=pol, inputs=inputs: pcp_prefill_attention_cuda(inputs, policy=pol),
                lambda pol=pol, o=o, s=s, dl=dl, inputs=inputs: pcp_prefill_attention_backward_cuda(
                    dl, o, s, inputs, policy=pol
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
