"""PCP head/tail prefill attention on one GPU: correctness, balance, speed, select bandwidth.

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
(dense and rank timings alternate over 5 rounds, medians kept, so clock drift cancels; the
same code measured in two processes still moves a ratio by up to ~2-3 %)
(worst and mean over ranks; goals: worst forward <= 1.05 for the balance and <= 1.10 for
forward and backward), peak memory of a rank vs dense. Fused select: GB/s moved (read +
written) for the six outputs of the worst rank at S = 128k, P = 4 (goal >= 3.4 TB/s), next
to six ``index_select`` calls and a device copy.

    python benchmarks/bench_pcp.py                 # ~2-3 min on an H200
    python benchmarks/bench_pcp.py --shapes mha-32k --pcp 2 4

Writes ``benchmarks/results/pcp-<date>.json``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_file import write_results  # noqa: E402

from cp_modules.kernels.pcp_attention import (  # noqa: E402
    attention_block_backward,
    attention_block_forward,
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
    select_block_backend,
)
from cp_modules.kernels.pcp_select import pcp_select_triton  # noqa: E402
from cp_modules.partition import plan_pcp  # noqa: E402
from cp_modules.reference.pcp_attention import (  # noqa: E402
    attention_with_lse,
    attention_with_lse_backward,
)
from cp_modules.reference.pcp_select import pcp_select_reference  # noqa: E402

# name: (S, Hq, Hkv, Dqk, Dv)
SHAPES = {
    "mha-32k": (32768, 32, 32, 128, 128),
    "mha-128k": (131072, 32, 32, 128, 128),
    "gqa-32k": (32768, 32, 8, 128, 128),
    "mla-32k": (32768, 32, 32, 192, 128),
}
GOAL_BALANCE, GOAL_SPEED, GOAL_SELECT_TBPS = 1.05, 1.10, 3.4
REF_CHUNK = 256
DEVICE = "cuda"
# Dense baselines that are not fused kernels (an [H, S, S] score matrix): skip such shapes.
NO_BASELINE = {"reference"}

# The block path whatever the automatic choice would take (it runs a plan of shapes that no
# earlier plan had as varlen calls, to spare cuDNN's plan builds): these are its timings.
BLOCKS = dict(varlen=False)


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
    args = (plan.segments_host, None, None, None, scale)

    def forward():
        return pcp_prefill_attention_cuda(ql, k, v, *args, **BLOCKS)

    o, lse = forward()
    return (
        forward,
        lambda: pcp_prefill_attention_backward_cuda(dl, ql, k, v, o, lse, *args, **BLOCKS),
        lambda: pcp_prefill_attention_backward_cuda(dl, ql, k, v, *forward(), *args, **BLOCKS),
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
            args = (plan.segments_host, None, None, None, scale)
            o, lse = pcp_prefill_attention_cuda(ql, k, v, *args, **BLOCKS)
            rows, valid = plan.token_indices[plan.local_valid], plan.local_valid
            errs["out"] = max(errs["out"], max_err(o[valid], ref_out[rows]))
            errs["lse"] = max(errs["lse"], max_err(lse[valid], ref_lse[rows]))
            gq, gk, gv = pcp_prefill_attention_backward_cuda(dl, ql, k, v, o, lse, *args, **BLOCKS)[:3]
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


def bench_select(S=131072, P=4, hq=32, hkv=32, d=128):
    """Bandwidth of the fused select for the rank that moves the most bytes."""
    plans = [plan_pcp([S], [0], P, r, device=DEVICE) for r in range(P)]
    plan = max(plans, key=lambda p: p.k_tail_index.numel() + p.k_head_index.numel())
    q = torch.randn(plan.token_indices.numel(), hq, d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(S, hkv, d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    idx = (plan.q_head_index, plan.q_tail_index, plan.k_head_index, plan.k_tail_index)
    got = pcp_select_triton(q, k, v, *idx)
    want = pcp_select_reference(q, k, v, *idx)
    if not all(torch.equal(a, b) for a, b in zip(got, want)):
        print("[select] WRONG: kernel differs from the reference", flush=True)
        return {"correct": False}, False
    moved = 2 * sum(x.numel() * x.element_size() for x in got)
    t = do_bench(lambda: pcp_select_triton(q, k, v, *idx), return_mode="median")
    t_ref = do_bench(lambda: pcp_select_reference(q, k, v, *idx), return_mode="median")
    big = torch.empty(moved // 4, dtype=torch.bfloat16, device=DEVICE)
    t_copy = do_bench(lambda: torch.empty_like(big).copy_(big), return_mode="median")
    res = {
        "correct": True,
        "S": S,
        "P": P,
        "rank": plan.pcp_rank,
        "bytes_moved": moved,
        "ms": t,
        "tb_per_s": moved / t / 1e9,
        "index_select_x6_tb_per_s": moved / t_ref / 1e9,
        "device_copy_tb_per_s": 2 * big.numel() * 2 / t_copy / 1e9,
    }
    res["goal_met"] = res["tb_per_s"] >= GOAL_SELECT_TBPS
    print(f"[select] {res}", flush=True)
    return res, True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--pcp", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    metrics, all_ok = {}, True
    for name in args.shapes:
        metrics[name], ok = bench_shape(name, args.pcp, args.check_only)
        all_ok &= ok
        torch.cuda.empty_cache()
    metrics["select"], ok = bench_select()
    all_ok &= ok
    path = write_results("pcp", metrics, args.out)
    print(
        f"wrote {path}; {'all correct' if all_ok else 'SOME KERNELS ARE WRONG (no speeds for them)'}"
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
