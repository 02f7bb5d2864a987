"""PCP training backward: dK/dV written straight into the reduce-scatter layout vs restored.

In training, a rank's K/V gradients (over all N restored tokens) go back to their owners by a
reduce-scatter whose input is in all-gathered order ([P, 2, T, Hkv, D]: per rank, its dK rows
then its dV rows). Three ways of producing that input are timed for every rank of a 32k / 128k
sequence on one GPU (the reduce-scatter itself is not run):

- ``restored``: the kernels' gradients in restored order, then an ``index_copy`` into the
  gathered buffer and contiguous dK / dV halves of the result (the former training path);
- ``direct``: the gradient blocks summed straight into the buffer
  (``cp_modules.ops.cp_attention._gathered_targets`` + ``dk_into`` / ``dv_into``, the current
  training path);
- ``kernels``: the kernel function alone, restored order (what ``bench_pcp.py`` times).

Ratios are rank time / (cuDNN dense causal backward / P); dense and rank timings alternate over
``ROUNDS`` rounds (medians). Peak memory: allocated while a variant runs, above its inputs
(worst rank). Also checks that ``direct`` equals ``restored`` (dK / dV
bit for bit; dQ within cuDNN's run-to-run variation, shown next to two ``restored`` calls).

    python benchmarks/bench_pcp_grad_layout.py [mha-32k gqa-32k mha-32k-pad mha-128k]

Writes ``benchmarks/results/pcp-grad-layout-<date>.json`` (or under $OUT if set).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import sys
from statistics import median_high as median
from types import SimpleNamespace

import torch
import triton
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cp_modules.kernels.pcp_attention import (  # noqa: E402
    attention_block_backward,
    attention_block_forward,
    pcp_prefill_attention_backward_cuda,
    pcp_prefill_attention_cuda,
)
from cp_modules.ops.cp_attention import _gathered_targets  # noqa: E402
from cp_modules.partition import plan_pcp  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
# name: (S, Hq, Hkv, D); "-pad": a length that leaves padding slots on every P.
SHAPES = {
    "mha-32k": (32768, 32, 32, 128),
    "gqa-32k": (32768, 32, 8, 128),
    "mha-32k-pad": (32768 - 7, 32, 32, 128),
    "mha-128k": (131072, 32, 32, 128),
}

# The block path whatever the automatic choice would take (it runs a plan of shapes that no
# earlier plan had as varlen calls, to spare cuDNN's plan builds): these are its timings.
BLOCKS = dict(varlen=False)


def peak_mib(fn) -> float:
    # Peak memory allocated while ``fn`` runs and its results live, above what was allocated
    # before.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    del res
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def rank_variants(S, P, r, q, k, v, dout, scale):
    plan = plan_pcp([S], [0], P, r, device="cuda")
    t, hkv, d = plan.num_local_tokens_padded, k.shape[1], k.shape[2]
    ql, dl = q[plan.token_indices], dout[plan.token_indices]
    args = (plan.segments_host, None, None, None, scale)
    o, lse = pcp_prefill_attention_cuda(ql, k, v, *args, **BLOCKS)
    gidx, pad = plan.gather_index, plan.gather_index.numel() < P * t

    def restored():
        dq, dk, dv, _, _ = pcp_prefill_attention_backward_cuda(dl, ql, k, v, o, lse, *args, **BLOCKS)
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
            dl, ql, k, v, o, lse, *args, dk_into=dk_into, dv_into=dv_into, **BLOCKS
        )[0]
        return dq, buf[r, 0], buf[r, 1]

    def kernels():
        return pcp_prefill_attention_backward_cuda(dl, ql, k, v, o, lse, *args, **BLOCKS)

    return {"restored": restored, "direct": direct, "kernels": kernels}


def bench_shape(name):
    S, hq, hkv, d = SHAPES[name]
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
            diff = [max_diff(x, y) for x, y in zip(a, b)]
            noise = [max_diff(x, y) for x, y in zip(a, a2)]
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
        for rnd in range(ROUNDS):
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


def main():
    names = sys.argv[1:] or list(SHAPES)
    out = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rounds": ROUNDS,
        "shapes": {name: bench_shape(name) for name in names},
    }
    where = pathlib.Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    path = where / f"pcp-grad-layout-{out['date']}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
