"""``bench_pcp grad-layout``: the training backward's K/V gradients written into the reduce-scatter layout."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from triton.testing import do_bench

from benchmarks.pcp.common import (
    BLOCKS,
    max_err,
    median,
    peak_mib,
)
from cp_modules.kernels.prefill.attention_blocks import (
    attention_block_backward,
    attention_block_forward,
)
from cp_modules.ops.cp_attention import _gathered_targets
from cp_modules.ops.pcp_policy import (
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
)
from cp_modules.partition import plan_pcp
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
)

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
