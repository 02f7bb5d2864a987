"""Windowed and soft-capped PCP prefill attention on one GPU: correctness, then speed.

A rank of a P-way plan (DualChunkSwap: head chunk r, tail chunk 2P-1-r) runs the CUDA path of
``cp::pcp_prefill_attention`` with a sliding window or a soft-cap, as the op chooses it
(``CPPolicy()``: FlashAttention-2's window arguments for windows, FlexAttention for soft-cap;
one packed call per step, keys cut to the window). Its time, forward and forward + backward, is
compared with the best single-GPU kernel of the same masked attention over the whole sequence,
divided by P: for windows FlashAttention-2 with its window arguments and compiled FlexAttention
with a sliding-window mask; for soft-cap compiled FlexAttention. Where the library sets
FlexAttention's block sizes itself (``flex_block_options``: soft-cap on sm_90), the baseline
runs with torch's block sizes and with the library's ("flex-blocks"), and the faster counts.

Shapes (bf16, one sequence, 32 heads x 128): window 4096 at S = 32k and 128k (Mistral / Gemma 3
/ gpt-oss windowed layers); window 4096 with soft-cap 50 (Gemma 2's local layers) and soft-cap
50 over full causal attention (its global layers) at 32k. P in {1, 2, 4, 8}; rank 0 is timed
(``--ranks all`` times every rank).

Correctness first, on the benchmark shapes: every rank's output and LSE, and the q/k/v
gradients summed over the ranks, against the fp32 reference evaluated in query chunks (each
chunk with the keys its window reaches), by the flash-attention rule: error <= 2 x base + 1e-5,
base = the larger error of the single-GPU kernels and of plain PyTorch attention in bf16. A
shape that fails reports no speed, and the script exits with status 1.

Metrics per shape and P: rank time (ms), the baselines' times, ratio = rank time / (best
baseline / P) for the forward and for forward + backward (goal: <= 1.10), and the first call of
a new plan (packing, block mask; the compiled kernels are warm) separately.

    python -m benchmarks.bench_masked                       # the suite's part
    python -m benchmarks.bench_masked --shapes w4k-32k --pcp 1 2
    python -m benchmarks.bench_masked --shapes softcap-32k --softcap-blocks bwd_BLOCK_M2=32

Writes ``benchmarks/results/masked-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch

from benchmarks.common import RESULTS, write_results
from cp_modules.kernels.masked.flash import flash_window_backward, flash_window_forward
from cp_modules.kernels.masked.prefill import (
    SOFTCAP_SM90_BLOCKS,
    flex_block_options,
    flex_compile_config,
    flex_lse_kwargs,
    masked_pack,
    softcap_score_mod,
)
from cp_modules.ops.pcp_masked import (
    choose_masked_path,
    pcp_masked_attention,
    pcp_masked_attention_backward,
)
from cp_modules.partition import plan_pcp
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    attention_with_lse,
    attention_with_lse_backward,
)

# name: (S, Hq, Hkv, D, window W or None, soft-cap c or None)
SHAPES = {
    "w4k-32k": (32768, 32, 32, 128, 4096, None),
    "w4k-128k": (131072, 32, 32, 128, 4096, None),
    "w4k-softcap-32k": (32768, 32, 32, 128, 4096, 50.0),
    "softcap-32k": (32768, 32, 32, 128, None, 50.0),
}
PCPS = (1, 2, 4, 8)
GOAL_SPEED = 1.10
REF_CHUNK = 256
ROUNDS = 3
POLICY = CPPolicy()  # the op's own choice (auto)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def median(xs):
    return sorted(xs)[len(xs) // 2]


def shape_inputs(name: str, device: str = "cuda", dtype=torch.bfloat16):
    """Seeded (q, k, v, dout) of one sequence of shape ``name`` and the softmax scale."""
    S, hq, hkv, d, _, _ = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(S, h, d, device=device, generator=g, dtype=dtype) for h in (hq, hkv, hkv)
    )
    dout = torch.randn(S, hq, d, device=device, generator=g, dtype=dtype)
    return q, k, v, dout, d**-0.5


def low_precision_attention(q, k, v, scale, window, softcap):
    """Plain PyTorch attention in the inputs' dtype, bottom-right causal, with the window and
    soft-cap (the 2x rule's base)."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("lhd,mhd->hlm", q, k.repeat_interleave(group, 1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    L, M = q.shape[0], k.shape[0]
    i = torch.arange(L, device=q.device)[:, None] + (M - L)
    j = torch.arange(M, device=q.device)[None, :]
    keep = j <= i if window is None else (j <= i) & (j > i - window)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("hlm,mhd->lhd", torch.softmax(s, -1), v.repeat_interleave(group, 1))


def reference(q, k, v, dout, scale, window, softcap, chunk: int = REF_CHUNK):
    """Masked causal attention of the whole sequence in query chunks, each against the keys
    its window reaches: the fp32 reference's (out, lse, dq, dk, dv) and plain PyTorch's (out,
    dq, dk, dv) in the inputs' dtype."""
    q32, k32, v32, dout32 = (x.float() for x in (q, k, v, dout))
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], device=q.device)
    lse = torch.empty(q.shape[:2], device=q.device)
    dq, dk, dv = torch.empty_like(q32), torch.zeros_like(k32), torch.zeros_like(v32)
    low = [torch.empty_like(out), torch.empty_like(q32), torch.zeros_like(k32),
           torch.zeros_like(v32)]  # fmt: skip
    for a in range(0, q.shape[0], chunk):
        b = min(a + chunk, q.shape[0])
        ks = 0 if window is None else max(0, a - window + 1)
        masking = dict(window=window, softcap=softcap)
        out[a:b], lse[a:b] = attention_with_lse(
            q32[a:b], k32[ks:b], v32[ks:b], scale=scale, causal=True, **masking
        )
        gq, gk, gv = attention_with_lse_backward(
            dout32[a:b], q32[a:b], k32[ks:b], v32[ks:b], out[a:b], lse[a:b], scale=scale,
            causal=True, **masking,
        )  # fmt: skip
        dq[a:b] = gq
        dk[ks:b] += gk
        dv[ks:b] += gv
        leaves = [x.clone().requires_grad_() for x in (q[a:b], k[ks:b], v[ks:b])]
        o = low_precision_attention(*leaves, scale, window, softcap)
        gq, gk, gv = torch.autograd.grad(o, leaves, dout[a:b])
        low[0][a:b] = o.detach()
        low[1][a:b] = gq
        low[2][ks:b] += gk
        low[3][ks:b] += gv
    return (out, lse, dq, dk, dv), low


def rank_fns(plan, q, k, v, dout, scale, window, softcap, policy=None):
    """(forward, forward + backward) of one rank's masked head/tail attention on the op's
    path (``policy``), over the whole sequence's K/V."""
    policy = policy or POLICY
    ql, dl = q[plan.token_indices], dout[plan.token_indices]
    inputs = PrefillInputs(ql, k, v, plan.segments_host, None, None, None, scale)
    masking = dict(window=window, softcap=softcap, policy=policy)

    def forward():
        return pcp_masked_attention(inputs, **masking)

    def both():
        o, lse = forward()
        return pcp_masked_attention_backward(dl, o, lse, inputs, **masking)

    return forward, both


def whole_sequence_pack(S: int, window: int | None, device):
    """The packing of one sequence of S queries over its S keys (the identity rows)."""
    return masked_pack(torch.tensor([[0, 0, S, 0, S]]), S, None, window, device)


def flash_baseline(q, k, v, dout, scale, window):
    """FlashAttention-2 with its window arguments over the whole sequence: (forward, forward +
    backward, (out, lse))."""
    pack = whole_sequence_pack(q.shape[0], window, q.device)

    def forward():
        return flash_window_forward(q, k, v, pack, scale)

    def both():
        o, lse = forward()
        return flash_window_backward(dout, q, k, v, o, lse, pack, scale)

    return forward, both


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_baseline(q, k, v, dout, scale, window, softcap, kernel_options=None):
    """Compiled FlexAttention over the whole sequence with the plain sliding-window (or causal)
    mask and the soft-cap, torch's block sizes or those of ``kernel_options``: (forward,
    forward + backward)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        return keep if window is None else keep & (q_idx - kv_idx < window)

    S = q.shape[0]
    mask = create_block_mask(mask_mod, None, None, S, S, device=q.device, _compile=True)
    q4, k4, v4, do4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v, dout))
    kwargs = dict(score_mod=softcap_score_mod(softcap), block_mask=mask, scale=scale,
                  enable_gqa=q.shape[1] != k.shape[1], kernel_options=kernel_options,
                  **flex_lse_kwargs())  # fmt: skip
    flex = _compiled_flex()

    def forward():
        with torch.no_grad(), flex_compile_config():
            return flex(q4, k4, v4, **kwargs)

    leaves = [x.detach().requires_grad_() for x in (q4, k4, v4)]

    def both():
        with flex_compile_config():
            out, _ = flex(*leaves, **kwargs)
        return torch.autograd.grad(out, leaves, do4)

    def results():
        out, aux = forward()
        lse = aux if isinstance(aux, torch.Tensor) else aux.lse
        grads = both()
        return out[0].transpose(0, 1), lse[0].transpose(0, 1), [g[0].transpose(0, 1) for g in grads]

    return forward, both, results


def baselines(q, k, v, dout, scale, window, softcap):
    """name -> (forward, forward + backward, (out, lse, [dq, dk, dv])) of the single-GPU
    kernels that serve this masking."""
    res = {}
    if window is not None and softcap is None:
        fwd, both = flash_baseline(q, k, v, dout, scale, window)
        o, lse = fwd()
        res["flash"] = (fwd, both, (o, lse, list(both())))
    fwd, both, results = flex_baseline(q, k, v, dout, scale, window, softcap)
    res["flex"] = (fwd, both, results())
    blocks = flex_block_options(q, softcap)
    if blocks:  # the library's block sizes for this shape serve the baseline too
        fwd, both, results = flex_baseline(q, k, v, dout, scale, window, softcap, blocks)
        res["flex-blocks"] = (fwd, both, results())
    return res


def check_ranks(name, P, q, k, v, dout, scale, ref, base):
    """Every rank's rows and the summed gradients against the fp32 reference, 2x rule."""
    S, _, _, _, window, softcap = SHAPES[name]
    ref_out, ref_lse, *ref_grads = ref
    base_out, base_lse, base_grads = base
    errs = {"out": 0.0, "lse": 0.0}
    totals = [torch.zeros(x.shape, device=q.device) for x in ref_grads]
    for r in range(P):
        plan = plan_pcp([S], [0], P, r, device=q.device)
        fwd, both = rank_fns(plan, q, k, v, dout, scale, window, softcap)
        o, lse = fwd()
        rows, valid = plan.token_indices[plan.local_valid], plan.local_valid
        errs["out"] = max(errs["out"], max_err(o[valid], ref_out[rows]))
        errs["lse"] = max(errs["lse"], max_err(lse[valid], ref_lse[rows]))
        gq, gk, gv = both()[:3]
        totals[0].index_add_(0, rows, gq[valid].float())
        totals[1] += gk.float()
        totals[2] += gv.float()
    errs["dq_dk_dv"] = [max_err(a, b) for a, b in zip(totals, ref_grads)]
    passed = (
        errs["out"] <= 2 * base_out + 1e-5
        and errs["lse"] <= 2 * base_lse + 1e-4
        and all(e <= 2 * b + 1e-5 for e, b in zip(errs["dq_dk_dv"], base_grads))
    )
    return passed, errs


def bench_shape(name, pcps, ranks="0", check_only=False):
    from triton.testing import do_bench

    S, hq, hkv, d, window, softcap = SHAPES[name]
    q, k, v, dout, scale = shape_inputs(name)
    res = {"S": S, "Hq": hq, "Hkv": hkv, "D": d, "window": window, "softcap": softcap}
    # The op's path each way under the policy timed (the report states it per row).
    res["paths"] = {
        way: choose_masked_path(POLICY.pcp_masked, q, v, window, softcap, way)
        for way in ("forward", "backward")
    }
    (ref_out, ref_lse, *ref_grads), low = reference(q, k, v, dout, scale, window, softcap)
    kernels = baselines(q, k, v, dout, scale, window, softcap)
    res["baseline_err"] = {
        kname: {"out": max_err(o, ref_out), "lse": max_err(lse, ref_lse),
                "dq_dk_dv": [max_err(a, b) for a, b in zip(grads, ref_grads)]}
        for kname, (_, _, (o, lse, grads)) in kernels.items()
    }  # fmt: skip
    res["same_dtype_torch_err"] = {
        "out": max_err(low[0], ref_out),
        "dq_dk_dv": [max_err(a, b) for a, b in zip(low[1:], ref_grads)],
    }
    del low
    errs_b = list(res["baseline_err"].values())
    base = (
        max([e["out"] for e in errs_b] + [res["same_dtype_torch_err"]["out"]]),
        max(e["lse"] for e in errs_b),
        [max([e["dq_dk_dv"][i] for e in errs_b] + [res["same_dtype_torch_err"]["dq_dk_dv"][i]])
         for i in range(3)],
    )  # fmt: skip
    ok, res["pcp"] = True, {}
    for P in pcps:
        ref = (ref_out, ref_lse, *ref_grads)
        passed, errs = check_ranks(name, P, q, k, v, dout, scale, ref, base)
        print(f"[{name}] P={P} errors {errs}: {'ok' if passed else 'WRONG'}", flush=True)
        res["pcp"][P] = {"correct": passed, "err": errs}
        ok &= passed
    del ref_out, ref_lse, ref_grads
    torch.cuda.empty_cache()
    res["correct"] = ok
    if not ok or check_only:
        return res, ok
    for P in pcps:
        timed = range(P) if ranks == "all" else [0]
        entry = res["pcp"][P]
        # A fresh plan's first call: its packing and block mask (the kernels are compiled).
        plan = plan_pcp([S], [0], P, 0, device="cuda")
        fwd, _ = rank_fns(plan, q, k, v, dout, scale, window, softcap)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd()
        torch.cuda.synchronize()
        entry["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        fns = {r: rank_fns(plan_pcp([S], [0], P, r, device="cuda"), q, k, v, dout, scale,
                           window, softcap) for r in timed}  # fmt: skip
        runs = {(who, kind): [] for who in [*kernels, *fns] for kind in ("fwd", "fwd_bwd")}
        # Baselines and ranks alternate over the rounds (medians kept).
        for _ in range(ROUNDS):
            for who, (f, b, *_) in [*kernels.items(), *fns.items()]:
                runs[(who, "fwd")].append(do_bench(f, return_mode="median"))
                runs[(who, "fwd_bwd")].append(do_bench(b, return_mode="median"))
        for kind in ("fwd", "fwd_bwd"):
            base_ms = {kn: median(runs[(kn, kind)]) for kn in kernels}
            best = min(base_ms.values())
            rank_ms = {r: median(runs[(r, kind)]) for r in fns}
            entry[f"{kind}_baseline_ms"] = base_ms
            entry[f"{kind}_rank_ms"] = rank_ms
            entry[f"{kind}_ratio"] = max(rank_ms.values()) / (best / P)
        entry["goal_speed_met"] = max(entry["fwd_ratio"], entry["fwd_bwd_ratio"]) <= GOAL_SPEED
        print(f"[{name}] P={P} ratio fwd {entry['fwd_ratio']:.3f} fwd+bwd "
              f"{entry['fwd_bwd_ratio']:.3f} (baselines fwd {entry['fwd_baseline_ms']}, "
              f"fwd+bwd {entry['fwd_bwd_baseline_ms']} ms); first call "
              f"{entry['first_call_ms']:.1f} ms", flush=True)  # fmt: skip
    return res, True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--pcp", nargs="+", type=int, default=list(PCPS))
    p.add_argument("--ranks", default="0", choices=["0", "all"], help="which ranks are timed")
    p.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    p.add_argument("--out", default=str(RESULTS), help="directory of the results file")
    p.add_argument(
        "--pcp-masked",
        default="auto",
        choices=["auto", "flex", "flash"],
        help="the op's path (CPPolicy.pcp_masked); not auto: masked-<path>-<date>.json",
    )
    p.add_argument(
        "--softcap-blocks",
        default=None,
        metavar="KEY=N,...",
        help="override the library's soft-cap block sizes for this run, e.g. "
        "bwd_BLOCK_M2=32,bwd_BLOCK_N2=32 (a sweep; writes masked-blocks-<date>.json)",
    )
    return p.parse_args(argv)


def parse_blocks(text: str) -> dict:
    """``"bwd_BLOCK_M2=32,fwd_num_warps=8"`` -> the kernel-option dict, keys checked against
    the library's own."""
    blocks = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in SOFTCAP_SM90_BLOCKS or not value.isdigit():
            raise SystemExit(f"--softcap-blocks: {item!r} is not KEY=N with KEY one of "
                             f"{sorted(SOFTCAP_SM90_BLOCKS)}")  # fmt: skip
        blocks[key] = int(value)
    return blocks


def main(argv=None) -> int:
    global POLICY
    args = parse_args(argv)
    POLICY = CPPolicy(pcp_masked=args.pcp_masked)
    blocks = parse_blocks(args.softcap_blocks) if args.softcap_blocks else None
    if blocks:  # the library's rule and the flex-blocks baseline both take them
        SOFTCAP_SM90_BLOCKS.update(blocks)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    metrics, all_ok = {}, True
    for name in args.shapes:
        metrics[name], ok = bench_shape(name, args.pcp, args.ranks, args.check_only)
        all_ok &= ok
        torch.cuda.empty_cache()
    label = "masked" if args.pcp_masked == "auto" else f"masked-{args.pcp_masked}"
    extra = {}
    if blocks:
        label, extra = f"{label}-blocks", {"softcap_blocks": dict(SOFTCAP_SM90_BLOCKS)}
    path = write_results(label, metrics, args.out, **extra)
    print(
        f"wrote {path}; {'all correct' if all_ok else 'SOME PATHS ARE WRONG (no speeds for them)'}"
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
