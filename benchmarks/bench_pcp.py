"""PCP head/tail prefill attention on one GPU: correctness, balance, speed.

Every PCP rank's work is simulated on the one GPU: rank r's DualChunkSwap queries (head chunk
r, tail chunk 2P-1-r) attend the full K/V prefix they need, exactly as
``cp::pcp_prefill_attention`` runs it on that rank (causal square + rectangle + LSE merge on
PyTorch's fused kernels), forward and backward. The baseline is dense causal attention of the
whole sequence on the fastest kernel PyTorch ships for the shape (cuDNN for all of them here).

Shapes (bf16, one sequence of S tokens): MHA 32 heads x 128 at S = 32k and 128k; GQA 32/8 x 128
and MLA prefill (qk 192 / v 128, 32 heads) at S = 32k; P in {2, 4, 8}.

Correctness first, on the benchmark shapes: every rank's output and LSE, and the q/k/v
gradients summed over the ranks (in fp32), against the fp32 pure-PyTorch reference (evaluated
in query chunks), with the flash-attention rule: error <= 2 x base + 1e-5, base = the larger
error of the dense fused kernel and of plain PyTorch attention in bf16.
A shape that fails is reported as failed, without speeds, and the script exits with status 1.

Metrics per shape and P: per-rank forward / backward time, ratio = rank time / (dense time / P)
(dense and rank timings alternate over 5 rounds, medians kept; worst and mean over ranks;
goals: worst forward <= 1.05 for the balance and <= 1.10 for forward and backward), peak memory
of a rank vs dense.

    python -m benchmarks.bench_pcp                 # the suite's part, ~2-3 min on an H200
    python -m benchmarks.bench_pcp --shapes mha-32k --pcp 2 4

Writes ``benchmarks/results/pcp-<date>.json``. Further measurements the report cites, each a
subcommand with its own options (``python -m benchmarks.bench_pcp <study> --help``) and its
own results file:

- ``key-major``: MLA's training backward by key chunks against the query-major blocks, with the
  bytes each moves (pcp-key-major-<date>.json);
- ``grad-layout``: the training backward's K/V gradients written straight into the
  reduce-scatter layout against restored order (pcp-grad-layout-<date>.json);
- ``varlen``: many requests, the block path against one varlen call (pcp-varlen-<date>.json);
- ``new-shapes``: the first call on prompts of new lengths against the next, per path
  (pcp-new-shapes-<date>.json);
- ``timeline``: where a rank's GPU time goes in steady state (pcp-timeline-<date>.json).

What they measured and the switch points taken from them: ``docs/switch-points.md``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import pathlib
import random
import sys
import tempfile
import time
from statistics import median as statistics_median
from types import SimpleNamespace

import torch
import triton
from triton.testing import do_bench

from benchmarks.common import RESULTS, write_results
from cp_modules.kernels.prefill.attention_blocks import (
    attention_block_backward,
    attention_block_forward,
    select_block_backend,
)
from cp_modules.kernels.prefill.pcp_key_major import pcp_key_major_backward
from cp_modules.ops.cp_attention import _gathered_targets
from cp_modules.ops.pcp_policy import (
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
    segment_flop,
)
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    attention_with_lse,
    attention_with_lse_backward,
)

# name: (S, Hq, Hkv, Dqk, Dv)
SHAPES = {
    "mha-32k": (32768, 32, 32, 128, 128),
    "mha-128k": (131072, 32, 32, 128, 128),
    "gqa-32k": (32768, 32, 8, 128, 128),
    "mla-32k": (32768, 32, 32, 192, 128),
}
GOAL_BALANCE, GOAL_SPEED = 1.05, 1.10
REF_CHUNK = 256
DEVICE = "cuda"
# Dense baselines that are not fused kernels (an [H, S, S] score matrix): skip such shapes.
NO_BASELINE = {"reference"}

# The two forced paths of cp_modules.ops.pcp_policy (the automatic choice is CPPolicy()).
NEVER_VARLEN, ALWAYS_VARLEN = CPPolicy(pcp_varlen="never"), CPPolicy(pcp_varlen="always")
# The block path whatever the automatic choice would take (it runs a plan of shapes that no
# earlier plan had as varlen calls, to spare cuDNN's plan builds): these are its timings.
BLOCKS = dict(policy=NEVER_VARLEN)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def low_precision_attention(q, k, v, scale):
    """Plain PyTorch attention in the inputs' dtype, bottom-right causal (the 2x rule's base)."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("lhd,mhd->hlm", q, k.repeat_interleave(group, 1)) * scale
    L, M = q.shape[0], k.shape[0]
    i = torch.arange(L, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(M, device=q.device)[None, :] > i + M - L, float("-inf"))
    return torch.einsum("hlm,mhd->lhd", torch.softmax(s, -1), v.repeat_interleave(group, 1))


def reference(q, k, v, dout, scale):
    """Dense causal attention in query chunks: fp32 (out, lse, dq, dk, dv) from the pure-PyTorch
    reference, and (out, dq, dk, dv) of plain PyTorch attention in the inputs' dtype."""
    q32, k32, v32, dout32 = (x.float() for x in (q, k, v, dout))
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], device=q.device)
    lse = torch.empty(q.shape[:2], device=q.device)
    dq, dk, dv = torch.empty_like(q32), torch.zeros_like(k32), torch.zeros_like(v32)
    low = [
        torch.empty_like(out),
        torch.empty_like(q32),
        torch.zeros_like(k32),
        torch.zeros_like(v32),
    ]
    for a in range(0, q.shape[0], REF_CHUNK):
        b = min(a + REF_CHUNK, q.shape[0])
        # Bottom-right causal: query a + i sees keys 0 .. a + i.
        out[a:b], lse[a:b] = attention_with_lse(
            q32[a:b], k32[:b], v32[:b], scale=scale, causal=True
        )
        gq, gk, gv = attention_with_lse_backward(
            dout32[a:b], q32[a:b], k32[:b], v32[:b], out[a:b], lse[a:b], scale=scale, causal=True
        )
        dq[a:b] = gq
        dk[:b] += gk
        dv[:b] += gv
        leaves = [
            q[a:b].clone().requires_grad_(),
            k[:b].clone().requires_grad_(),
            v[:b].clone().requires_grad_(),
        ]
        o = low_precision_attention(*leaves, scale)
        gq, gk, gv = torch.autograd.grad(o, leaves, dout[a:b])
        low[0][a:b] = o.detach()
        low[1][a:b] = gq
        low[2][:b] += gk
        low[3][:b] += gv
    return (out, lse, dq, dk, dv), low


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


ROUNDS = 5


def rank_fns(plan, q, k, v, dout, scale):
    """(forward, backward, forward + backward) callables of one rank's head/tail attention."""
    ql, dl = q[plan.token_indices], dout[plan.token_indices]
    inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, scale)

    def forward():
        return pcp_prefill_attention_cuda(inputs, **BLOCKS)

    o, lse = forward()
    return (
        forward,
        lambda: pcp_prefill_attention_backward_cuda(dl, o, lse, inputs, **BLOCKS),
        lambda: pcp_prefill_attention_backward_cuda(dl, *forward(), inputs, **BLOCKS),
    )


def median(xs):
    return sorted(xs)[len(xs) // 2]


def shape_inputs(name: str, device: str = DEVICE):
    """Seeded bf16 (q, k, v, dout) of one long sequence of shape ``name``, and its scale."""
    S, hq, hkv, dqk, dv = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(S, h, d, device=device, generator=g, dtype=torch.bfloat16)
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    )
    dout = torch.randn(S, hq, dv, device=device, generator=g, dtype=torch.bfloat16)
    return q, k, v, dout, dqk**-0.5


def bench_shape(name, pcps, check_only=False):
    S, hq, hkv, dqk, dv = SHAPES[name]
    q, k, v, dout, scale = shape_inputs(name)
    backend = select_block_backend(q, k, v, True)
    res = {"S": S, "Hq": hq, "Hkv": hkv, "Dqk": dqk, "Dv": dv, "dense_backend": backend}
    print(f"[{name}] dense backend: {backend}", flush=True)
    if backend in NO_BASELINE:
        # Neither cuDNN nor FlashAttention-2 serves this shape here: there is no fast baseline,
        # and the dense fp32 fallback would need an [H, S, S] score matrix.
        print(f"[{name}] skipped: no fused kernel serves this shape on this GPU", flush=True)
        res["skipped"] = "no fused kernel for this shape"
        return res, True

    def dense_fwd():
        return attention_block_forward(q, k, v, scale=scale, causal=True, backend=backend)

    out_d, lse_d = dense_fwd()
    grads_d = attention_block_backward(
        dout, q, k, v, out_d, lse_d, scale=scale, causal=True, backend=backend
    )
    (ref_out, ref_lse, *ref_grads), low = reference(q, k, v, dout, scale)
    res["dense_err"] = {
        "out": max_err(out_d, ref_out),
        "lse": max_err(lse_d, ref_lse),
        "dq_dk_dv": [max_err(a, b) for a, b in zip(grads_d, ref_grads)],
    }
    res["same_dtype_torch_err"] = {
        "out": max_err(low[0], ref_out),
        "dq_dk_dv": [max_err(a, b) for a, b in zip(low[1:], ref_grads)],
    }
    del low
    # The 2x rule's base: the larger error of the dense fused kernel and of plain PyTorch in the
    # same dtype.
    base_out = max(res["dense_err"]["out"], res["same_dtype_torch_err"]["out"])
    base_grads = [
        max(a, b)
        for a, b in zip(res["dense_err"]["dq_dk_dv"], res["same_dtype_torch_err"]["dq_dk_dv"])
    ]

    ok = True
    res["pcp"] = {}
    for P in pcps:
        errs = {"out": 0.0, "lse": 0.0}
        totals = [torch.zeros(x.shape, device=DEVICE) for x in ref_grads]
        plans = [plan_pcp([S], [0], P, r, device=DEVICE) for r in range(P)]
        for plan in plans:
            ql, dl = q[plan.token_indices], dout[plan.token_indices]
            inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, scale)
            o, lse = pcp_prefill_attention_cuda(inputs, **BLOCKS)
            rows, valid = plan.token_indices[plan.local_valid], plan.local_valid
            errs["out"] = max(errs["out"], max_err(o[valid], ref_out[rows]))
            errs["lse"] = max(errs["lse"], max_err(lse[valid], ref_lse[rows]))
            gq, gk, gv = pcp_prefill_attention_backward_cuda(dl, o, lse, inputs, **BLOCKS)[:3]
            totals[0].index_add_(0, rows, gq[valid].float())
            totals[1] += gk.float()
            totals[2] += gv.float()
        errs["dq_dk_dv"] = [max_err(a, b) for a, b in zip(totals, ref_grads)]
        bound_out = 2 * base_out + 1e-5
        bound_grads = [2 * b + 1e-5 for b in base_grads]
        passed = (
            errs["out"] <= bound_out
            and errs["lse"] <= 2 * res["dense_err"]["lse"] + 1e-4
            and all(e <= b for e, b in zip(errs["dq_dk_dv"], bound_grads))
        )
        print(
            f"[{name}] P={P} errors {errs} (dense {res['dense_err']}): {'ok' if passed else 'WRONG'}",
            flush=True,
        )
        res["pcp"][P] = {"correct": passed, "err": errs}
        ok &= passed
        del totals
    del ref_out, ref_lse, ref_grads
    torch.cuda.empty_cache()
    if not ok or check_only:
        res["correct"] = ok
        return res, ok

    def dense_bwd():
        return attention_block_backward(
            dout, q, k, v, out_d, lse_d, scale=scale, causal=True, backend=backend
        )

    res["dense_peak_mib"] = peak_mib(
        lambda: attention_block_backward(
            dout, q, k, v, *dense_fwd(), scale=scale, causal=True, backend=backend
        )
    )
    # Dense and per-rank timings alternate over a few rounds (medians kept), so a drift of the
    # GPU clock during the run moves the baseline and the ranks alike.
    dense_f, dense_b = [], []
    for P in pcps:
        fns = [
            rank_fns(plan_pcp([S], [0], P, r, device=DEVICE), q, k, v, dout, scale)
            for r in range(P)
        ]
        fwd_runs, bwd_runs = [[] for _ in range(P)], [[] for _ in range(P)]
        for _ in range(ROUNDS):
            dense_f.append(do_bench(dense_fwd, return_mode="median"))
            dense_b.append(do_bench(dense_bwd, return_mode="median"))
            for r, (f, b, _) in enumerate(fns):
                fwd_runs[r].append(do_bench(f, return_mode="median"))
                bwd_runs[r].append(do_bench(b, return_mode="median"))
        t_fwd, t_bwd = median(dense_f[-ROUNDS:]), median(dense_b[-ROUNDS:])
        fwd, bwd = [median(x) for x in fwd_runs], [median(x) for x in bwd_runs]
        # A rank holds the gathered K/V (k, v: already allocated) plus its own activations.
        peaks = [peak_mib(both) for _, _, both in fns]
        del fns
        ideal_f, ideal_b = t_fwd / P, t_bwd / P
        entry = res["pcp"][P]
        entry.update(
            dense_ms={"fwd": t_fwd, "bwd": t_bwd},
            fwd_ms=fwd,
            bwd_ms=bwd,
            fwd_ratio_worst=max(fwd) / ideal_f,
            fwd_ratio_mean=sum(fwd) / P / ideal_f,
            bwd_ratio_worst=max(bwd) / ideal_b,
            bwd_ratio_mean=sum(bwd) / P / ideal_b,
            fwd_imbalance=max(fwd) / (sum(fwd) / P),
            peak_mib_worst_rank=max(peaks),
        )
        entry["goal_balance_met"] = entry["fwd_ratio_worst"] <= GOAL_BALANCE
        entry["goal_speed_met"] = (
            max(entry["fwd_ratio_worst"], entry["bwd_ratio_worst"]) <= GOAL_SPEED
        )
        print(
            f"[{name}] P={P} fwd worst/mean ratio {entry['fwd_ratio_worst']:.3f}/{entry['fwd_ratio_mean']:.3f}"
            f"  bwd {entry['bwd_ratio_worst']:.3f}/{entry['bwd_ratio_mean']:.3f}"
            f"  (dense fwd {t_fwd:.2f} ms, bwd {t_bwd:.2f} ms)  peak {max(peaks):.0f} MiB vs dense "
            f"{res['dense_peak_mib']:.0f} MiB",
            flush=True,
        )
    res["dense_ms"] = {"fwd": median(dense_f), "bwd": median(dense_b)}
    res["correct"] = True
    return res, True


# --- key-major: MLA's training backward by key chunks (cp_modules.kernels.prefill.pcp_key_major) ------
# Rank j keeps its own key chunks and takes for each every query at or after it, in one tall
# top-left causal call; the chunks' dK / dV come out complete and the dQ pieces go back to the
# queries' owners by a reduce-scatter, after all-gathering Q, O, dO and the LSE. Checked like the
# suite (the key-major gradients summed over ranks against the fp32 reference, 2x rule), then
# timed against the query-major rank backward (rank_fns), both over dense backward / P.

KEY_MAJOR_ROUNDS = 3


def key_major_fn(dout, q, out, lse, k, v, P, rank, scale):
    """Rank ``rank``'s key-major backward of one sequence (its own K / V rows gathered first,
    outside what is timed)."""
    plan = plan_pcp([q.shape[0]], [0], P, rank, device=q.device)
    k_own, v_own = k[plan.token_indices], v[plan.token_indices]
    return functools.partial(
        pcp_key_major_backward, dout, q, out, lse, k_own, v_own, plan.segments_host, scale
    ), plan


def key_major_all_ranks(dout, q, k, v, out, lse, P, scale):
    """Every rank's key-major gradients combined: (dq summed over ranks in fp32, dk, dv)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for r in range(P):
        fn, plan = key_major_fn(dout, q, out, lse, k, v, P, r, scale)
        gq, gk, gv = fn()
        valid = plan.local_valid
        dq += gq.float()
        dk[plan.token_indices[valid]] = gk[valid]
        dv[plan.token_indices[valid]] = gv[valid]
    return dq, dk, dv


def bytes_per_token(hq, hkv, dqk, dv) -> dict[str, int]:
    """Bytes a token moves over the PCP group in one backward (bf16; LSE fp32), per design."""
    return {
        "query_major": 2 * hkv * (dqk + dv),  # dK / dV reduce-scattered
        "key_major": 2 * hq * (dqk + 2 * dv) + 4 * hq + 2 * hq * dqk,  # Q, O, dO, LSE; dQ
    }


def key_major_shape(name, pcps):
    S, hq, hkv, dqk, dv = SHAPES[name]
    q, k, v, dout, scale = shape_inputs(name)
    backend = select_block_backend(q, k, v, True)
    res = {"S": S, "Hq": hq, "Hkv": hkv, "Dqk": dqk, "Dv": dv, "backend": backend}
    res["bytes_per_token"] = bytes_per_token(hq, hkv, dqk, dv)
    out, lse = attention_block_forward(q, k, v, scale=scale, causal=True, backend=backend)
    dense = attention_block_backward(
        dout, q, k, v, out, lse, scale=scale, causal=True, backend=backend
    )
    (_, _, *ref_grads), low = reference(q, k, v, dout, scale)
    base = [
        max(max_err(a, r), max_err(b, r)) for a, b, r in zip(dense, low[1:], ref_grads)
    ]  # the larger error of the dense kernel and of plain PyTorch in bf16
    del low
    res["pcp"], ok = {}, True
    for P in pcps:
        got = key_major_all_ranks(dout, q, k, v, out, lse, P, scale)
        errs = [max_err(a, r) for a, r in zip(got, ref_grads)]
        passed = all(e <= 2 * b + 1e-5 for e, b in zip(errs, base))
        res["pcp"][P] = {"correct": passed, "err_dq_dk_dv": errs, "base_dq_dk_dv": base}
        print(f"[{name}] P={P} key-major errors {errs} (base {base}): "
              f"{'ok' if passed else 'WRONG'}", flush=True)  # fmt: skip
        ok &= passed
    del ref_grads
    torch.cuda.empty_cache()
    if not ok:
        return res, False

    def dense_bwd():
        return attention_block_backward(
            dout, q, k, v, out, lse, scale=scale, causal=True, backend=backend
        )

    for P in pcps:
        key_fns = [key_major_fn(dout, q, out, lse, k, v, P, r, scale)[0] for r in range(P)]
        query_fns = [
            rank_fns(plan_pcp([S], [0], P, r, device="cuda"), q, k, v, dout, scale)[1]
            for r in range(P)
        ]
        runs = {"dense": [], "key": [[] for _ in range(P)], "query": [[] for _ in range(P)]}
        for _ in range(KEY_MAJOR_ROUNDS):
            runs["dense"].append(do_bench(dense_bwd, return_mode="median"))
            for r in range(P):
                runs["key"][r].append(do_bench(key_fns[r], return_mode="median"))
                runs["query"][r].append(do_bench(query_fns[r], return_mode="median"))
        ideal = median(runs["dense"]) / P
        entry = res["pcp"][P]
        entry["dense_bwd_ms"] = median(runs["dense"])
        for path in ("key", "query"):
            t = [median(x) for x in runs[path]]
            entry[f"{path}_major_ms"] = t
            entry[f"{path}_major_worst"] = max(t) / ideal
            entry[f"{path}_major_mean"] = sum(t) / P / ideal
        print(
            f"[{name}] P={P} backward worst/mean: key-major {entry['key_major_worst']:.3f}/"
            f"{entry['key_major_mean']:.3f}  query-major {entry['query_major_worst']:.3f}/"
            f"{entry['query_major_mean']:.3f}  (dense {entry['dense_bwd_ms']:.2f} ms)",
            flush=True,
        )
        del key_fns, query_fns
    return res, True


# --- grad-layout: the training backward's K/V gradients for the reduce-scatter ----------------
# The reduce-scatter's input is in all-gathered order ([P, 2, T, Hkv, D]: per rank its dK rows,
# then its dV rows). Three ways of producing it, every rank of one sequence (the reduce-scatter
# itself is not run): ``restored`` (gradients in restored order, then index-copied: the former
# path), ``direct`` (summed straight into the buffer through
# ``cp_modules.ops.cp_attention._gathered_targets``: the current path for long runs), ``kernels``
# (the kernel function alone, as the suite times it). ``direct`` must equal ``restored`` (dK / dV
# bit for bit; dQ within cuDNN's run-to-run variation, shown next to two ``restored`` calls).
# Ratios over dense backward / P, rounds alternating (medians); peak memory above the inputs.

# name: (S, Hq, Hkv, D); "-pad": a length that leaves padding slots on every P.
GRAD_LAYOUT_SHAPES = {
    "mha-32k": (32768, 32, 32, 128),
    "gqa-32k": (32768, 32, 8, 128),
    "mha-32k-pad": (32768 - 7, 32, 32, 128),
    "mha-128k": (131072, 32, 32, 128),
}


def rank_variants(S, P, r, q, k, v, dout, scale):
    plan = plan_pcp([S], [0], P, r, device="cuda")
    t, hkv, d = plan.num_local_tokens_padded, k.shape[1], k.shape[2]
    ql, dl = q[plan.token_indices], dout[plan.token_indices]
    inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, scale)
    o, lse = pcp_prefill_attention_cuda(inputs, **BLOCKS)
    gidx, pad = plan.gather_index, plan.gather_index.numel() < P * t

    def restored():
        dq, dk, dv, _, _ = pcp_prefill_attention_backward_cuda(dl, o, lse, inputs, **BLOCKS)
        buf = (dk.new_zeros if pad else dk.new_empty)((P * t, 2, hkv, d))
        buf.select(1, 0).index_copy_(0, gidx, dk)
        buf.select(1, 1).index_copy_(0, gidx, dv)
        part = buf.view(P, t, 2, hkv, d)[r]  # where this rank's reduce-scatter result lands
        return dq, part[:, 0].contiguous(), part[:, 1].contiguous()

    def direct():
        buf = k.new_empty((P, 2, t, hkv, d))
        meta = SimpleNamespace(plan=plan, num_local_tokens=t)
        dk_into, dv_into = _gathered_targets(meta, buf)
        dq = pcp_prefill_attention_backward_cuda(
            dl, o, lse, inputs, dk_into=dk_into, dv_into=dv_into, **BLOCKS
        )[0]
        return dq, buf[r, 0], buf[r, 1]

    def kernels():
        return pcp_prefill_attention_backward_cuda(dl, o, lse, inputs, **BLOCKS)

    return {"restored": restored, "direct": direct, "kernels": kernels}


def grad_layout_shape(name, rounds):
    S, hq, hkv, d = GRAD_LAYOUT_SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for h in (hq, hkv, hkv, hq)
    )
    scale = d**-0.5
    od, ld = attention_block_forward(q, k, v, scale=scale, causal=True)

    def dense():
        return attention_block_backward(dout, q, k, v, od, ld, scale=scale, causal=True)

    res = {}
    for P in (2, 4, 8):
        ranks = [rank_variants(S, P, r, q, k, v, dout, scale) for r in range(P)]
        checks = []
        for r, fns in enumerate(ranks):
            a, b, a2 = fns["restored"](), fns["direct"](), fns["restored"]()
            diff = [max_err(x, y) for x, y in zip(a, b)]
            noise = [max_err(x, y) for x, y in zip(a, a2)]
            assert diff[1] == diff[2] == 0.0, (name, P, r, diff)
            del a, b, a2
            peaks = {key: peak_mib(fn) for key, fn in fns.items()}
            checks.append(
                {
                    "rank": r,
                    "direct_vs_restored": diff,
                    "restored_vs_restored": noise,
                    "peak_mib": peaks,
                }
            )
        times = {key: [[] for _ in range(P)] for key in ("restored", "direct", "kernels")}
        dense_ms = []
        for rnd in range(rounds):
            dense_ms.append(do_bench(dense))
            for r, fns in enumerate(ranks):
                keys = list(times)
                for key in keys[rnd % 3 :] + keys[: rnd % 3]:
                    times[key][r].append(do_bench(fns[key]))
        per = median(dense_ms) / P
        entry = {"dense_over_P_ms": per, "checks": checks}
        line = [f"[{name}] P={P} dense/P {per:.3f} ms"]
        for key in times:
            entry.setdefault("worst_peak_mib", {})[key] = max(c["peak_mib"][key] for c in checks)
        line.append(f"peak MiB {entry['worst_peak_mib']}")
        for key, ts in times.items():
            ms = [median(x) for x in ts]
            ratios = [x / per for x in ms]
            entry[key] = {"ms": ms, "worst": max(ratios), "mean": sum(ratios) / P}
            line.append(f"{key} worst {max(ratios):.3f} mean {sum(ratios) / P:.3f}")
        print("  ".join(line), flush=True)
        res[P] = entry
        del ranks
        torch.cuda.empty_cache()
    return res


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


# --- new-shapes: prompts of lengths the process has not seen --------------------------------
# cuDNN builds an execution plan for every new attention shape; FlashAttention-2 has no per-shape
# cost. For single prompts of random lengths, the last rank's first and second forward and
# backward, through the varlen path, the automatic choice (which rents the varlen path for a plan
# of new shapes) and the block path, in that order on the same lengths (the blocks come last, so
# their first calls meet shapes cuDNN has not seen).

NEW_SHAPE_PATHS = {
    "varlen": ALWAYS_VARLEN,
    "auto": CPPolicy(pcp_varlen="auto"),
    "blocks": NEVER_VARLEN,
}


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def new_shape_prompt(shape, S, P, policy):
    hq, hkv, dqk, dv = MANY_SHAPES[shape]
    q = torch.randn(S, hq, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(S, hkv, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(S, hkv, dv, device="cuda", dtype=torch.bfloat16)
    plan = plan_pcp([S], [0], P, P - 1, device="cuda")
    ql = q[plan.token_indices]
    inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, dqk**-0.5)
    res = {}
    for call in ("first", "second"):
        t_f, (o, lse) = timed(lambda: pcp_prefill_attention_cuda(inputs, policy=policy))
        dout = torch.randn_like(o)
        grads = (dout, o, lse, inputs)
        t_b, _ = timed(lambda g=grads: pcp_prefill_attention_backward_cuda(*g, policy=policy))
        res[call] = {"fwd_ms": t_f, "bwd_ms": t_b}
    return res


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


def needs_cuda() -> bool:
    if torch.cuda.is_available():
        return True
    print("needs a CUDA GPU", file=sys.stderr)
    return False


def run_suite_part(args) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    metrics, all_ok = {}, True
    for name in args.shapes:
        metrics[name], ok = bench_shape(name, args.pcp, args.check_only)
        all_ok &= ok
        torch.cuda.empty_cache()
    path = write_results("pcp", metrics, args.out)
    print(
        f"wrote {path}; {'all correct' if all_ok else 'SOME KERNELS ARE WRONG (no speeds for them)'}"
    )
    return 0 if all_ok else 1


def run_key_major(args) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    metrics, all_ok = {}, True
    for name in args.shapes:
        metrics[name], ok = key_major_shape(name, args.pcp)
        all_ok &= ok
        torch.cuda.empty_cache()
    path = write_results("pcp-key-major", metrics, args.out)
    print(f"wrote {path}; {'all correct' if all_ok else 'SOME RESULTS ARE WRONG'}")
    return 0 if all_ok else 1


def run_grad_layout(args) -> int:
    out = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rounds": args.rounds,
        "shapes": {name: grad_layout_shape(name, args.rounds) for name in args.shapes},
    }
    path = pathlib.Path(args.out) / f"pcp-grad-layout-{out['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


def run_varlen(args) -> int:
    res = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {k: dict(zip(("Hq", "Hkv", "Dqk", "Dv"), v)) for k, v in MANY_SHAPES.items()},
        "dtype": "bfloat16",
        "runs": [],
    }
    path = pathlib.Path(args.out) / f"pcp-varlen-{res['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        for P in args.pcp:
            for b in args.batches:
                R, rest = b.split("x")
                L, _, C = rest.partition("+")
                res["runs"].append(varlen_batch(shape, int(R), int(L), P, args.rounds, int(C or 0)))
                path.write_text(json.dumps(res, indent=1))  # after every run: partial results
                torch.cuda.empty_cache()
    print(f"wrote {path}")
    return 0


def run_new_shapes(args) -> int:
    rng = random.Random(0)
    # Warm up the libraries (first-ever calls) on a shape no measured prompt has.
    for policy in (NEVER_VARLEN, ALWAYS_VARLEN):
        for shape in args.shapes:
            new_shape_prompt(shape, 1000, 2, policy)
    res = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "shapes": {k: dict(zip(("Hq", "Hkv", "Dqk", "Dv"), v)) for k, v in MANY_SHAPES.items()},
        "dtype": "bfloat16",
        "runs": [],
    }
    for shape in args.shapes:
        for P in args.pcp:
            summary = {}
            lengths = [rng.randint(12000, 30000) for _ in range(args.prompts)]
            for path, policy in NEW_SHAPE_PATHS.items():
                runs = [new_shape_prompt(shape, S, P, policy) for S in lengths]
                res["runs"].append(
                    {"shape": shape, "P": P, "path": path, "lengths": lengths, "calls": runs}
                )
                summary[path] = {
                    f"{c}_{d}": statistics_median(r[c][f"{d}_ms"] for r in runs)
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
    path = pathlib.Path(args.out) / f"pcp-new-shapes-{res['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0


def run_timeline(args) -> int:
    metrics = {name: timeline_shape(name, args.pcp) for name in args.shapes}
    path = write_results("pcp-timeline", metrics, args.out)
    print(f"wrote {path}")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.set_defaults(run=run_suite_part)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--pcp", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    parser.add_argument("--out", default=str(RESULTS), help="directory of the results file")
    studies = parser.add_subparsers(title="studies outside the suite", metavar="STUDY")

    def study(name, run, doc, shapes, shape_default, pcp_default):
        sub = studies.add_parser(name, help=doc, description=doc)
        sub.set_defaults(run=run)
        sub.add_argument("--shapes", nargs="+", default=shape_default, choices=list(shapes))
        if pcp_default is not None:
            sub.add_argument("--pcp", nargs="+", type=int, default=pcp_default)
        sub.add_argument("--out", default=str(RESULTS), help="directory of the results file")
        return sub

    study("key-major", run_key_major,
          "MLA's training backward by key chunks against the query-major blocks",
          SHAPES, ["mla-32k", "mha-32k", "gqa-32k"], [2, 4, 8])  # fmt: skip
    sub = study("grad-layout", run_grad_layout,
                "training backward: K/V gradients straight into the reduce-scatter layout",
                GRAD_LAYOUT_SHAPES, list(GRAD_LAYOUT_SHAPES), None)  # fmt: skip
    sub.add_argument("--rounds", type=int, default=5)
    sub = study("varlen", run_varlen, "many requests: the block path against one varlen call",
                MANY_SHAPES, list(MANY_SHAPES), [2, 8])  # fmt: skip
    sub.add_argument(
        "--batches",
        nargs="+",
        default=["1x32768", "2x16384", "4x8192", "8x4096", "1x8192", "2x4096", "16x1024", "64x512"],
        help="RxL or RxL+C: R requests of L new tokens after C cached ones",
    )
    sub.add_argument("--rounds", type=int, default=2)
    sub = study("new-shapes", run_new_shapes,
                "prompts of new lengths: the first call against the next, per path",
                MANY_SHAPES, list(MANY_SHAPES), [2, 8])  # fmt: skip
    sub.add_argument("--prompts", type=int, default=6)
    study("timeline", run_timeline, "where a rank's GPU time goes in steady state",
          SHAPES, ["mha-32k", "gqa-32k", "mla-32k"], [4, 8])  # fmt: skip
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not needs_cuda():
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
