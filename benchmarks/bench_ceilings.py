#!/usr/bin/env python
"""Physical ceilings and the dense prefill kernel landscape, measured in the same run.

    python -m benchmarks.bench_ceilings

- Device copy bandwidth (read + write bytes of a 4 GiB clone) and bf16 matmul rate (8192^3).
- Dense causal prefill through SDPA, per backend (cuDNN, FlashAttention-2, memory-efficient),
  forward and backward, for GQA D=64 and D=128 (32 q / 8 KV heads) and MLA prefill 192/128
  (128 heads), S = 8k and 16k, bf16: the fastest correct backend per shape is what the PCP
  head/tail attention should be compared with. Each backend's output is checked against the
  fastest one's (bf16 tolerance) before its time is kept.
Results: benchmarks/results/ceilings-<date>.json.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from benchmarks.common import RESULTS

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def copy_bandwidth() -> float:
    x = torch.empty(2**31, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() * 2 / (ms * 1e-3) / 1e12


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=5, rep=50)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def prefill(name: str, s: int, hq: int, hkv: int, dqk: int, dv: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(
        1, hq, s, dqk, device="cuda", dtype=torch.bfloat16, generator=g
    ).requires_grad_()
    # MLA prefill has as many K/V heads as q heads; GQA repeats KV heads (enable_gqa).
    k = torch.randn(
        1, hkv, s, dqk, device="cuda", dtype=torch.bfloat16, generator=g
    ).requires_grad_()
    v = torch.randn(
        1, hkv, s, dv, device="cuda", dtype=torch.bfloat16, generator=g
    ).requires_grad_()
    do = torch.randn(1, hq, s, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    flops_fwd = s * s * hq * (dqk + dv)  # causal: half of 2 matmuls of 2*S^2*H*D
    res: dict = {}
    outs = {}
    for bname, be in BACKENDS.items():
        try:
            with sdpa_kernel(be):

                def fwd():
                    return F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=hq != hkv
                    )

                o = fwd()
                outs[bname] = o.detach()
                t_f = do_bench(fwd, warmup=3, rep=20)
                out = fwd()
                t_b = do_bench(
                    lambda out=out: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                    warmup=3,
                    rep=20,
                )
            res[bname] = dict(
                fwd_ms=t_f,
                bwd_ms=t_b,
                fwd_tflops=flops_fwd / t_f / 1e9,
                bwd_tflops=2.5 * flops_fwd / t_b / 1e9,
            )
        except RuntimeError as e:  # the backend does not serve this shape
            res[bname] = dict(error=str(e).splitlines()[0][:120])
    served = {b: r for b, r in res.items() if "fwd_ms" in r}
    if served:
        best = min(served, key=lambda b: served[b]["fwd_ms"])
        for b in served:
            diff = (outs[b].float() - outs[best].float()).abs().max().item()
            served[b]["max_abs_diff_vs_best"] = diff
            if diff > 2e-2:
                served[b]["wrong"] = True
        res["best_fwd"] = best
        res["best_bwd"] = min(served, key=lambda b: served[b]["bwd_ms"])
    print(
        name,
        json.dumps(
            {
                b: {k2: round(v2, 2) if isinstance(v2, float) else v2 for k2, v2 in r.items()}
                if isinstance(r, dict)
                else r
                for b, r in res.items()
            }
        ),
        flush=True,
    )
    return res


def main() -> int:
    metrics: dict = {}
    metrics["copy_TBps"] = copy_bandwidth()
    metrics["matmul_bf16_TFLOPs"] = matmul_rate()
    print(
        f"copy {metrics['copy_TBps']:.2f} TB/s, bf16 matmul {metrics['matmul_bf16_TFLOPs']:.0f} TFLOP/s"
    )
    for s in (8192, 16384):
        metrics[f"gqa_d64_S{s}"] = prefill(f"gqa_d64_S{s}", s, 32, 8, 64, 64)
        metrics[f"gqa_d128_S{s}"] = prefill(f"gqa_d128_S{s}", s, 32, 8, 128, 128)
        metrics[f"mla_192_128_S{s}"] = prefill(f"mla_192_128_S{s}", s, 128, 128, 192, 128)
    out = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "metrics": metrics,
    }
    path = RESULTS / f"ceilings-{out['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
