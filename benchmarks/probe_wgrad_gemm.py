"""Accuracy of cuBLAS's bf16 weight-gradient GEMM (dW = dYᵀ·X) against the token count K.

A PCP rank computes its projections' weight gradients over its own ``T`` tokens, where one
process takes all ``N``; the two GEMMs differ only in K. This probe measures, for bf16 inputs
and several output sizes M x N, the largest error of ``dy.t() @ x`` against the exact product of
the same bf16 inputs, relative to the largest exact value (rounding the exact result to bf16
alone gives 2e-3 to 4e-3), with PyTorch's bf16 reduced-precision reductions allowed (its
default) and disallowed.

    python benchmarks/probe_wgrad_gemm.py

Writes ``benchmarks/results/wgrad-gemm-probe-<date>.json`` (under ``--out`` if given).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from results_file import write_results  # noqa: E402

SIZES = ((64, 128), (128, 64), (256, 256), (1024, 1024), (4096, 512))
TOKENS = (2048, 2050, 2052, 2056, 3074, 4098, 6144, 6145, 6146, 6148, 6150, 6152, 6160, 8194,
          12290, 12292, 24578)  # fmt: skip


def relative_error(m: int, n: int, k: int, g: torch.Generator) -> float:
    dy = torch.randn(k, m, device="cuda", generator=g).bfloat16()
    x = torch.randn(k, n, device="cuda", generator=g).bfloat16()
    exact = dy.double().t() @ x.double()
    return float((dy.t() @ x).double().sub(exact).abs().max() / exact.abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    metrics = {}
    matmul = torch.backends.cuda.matmul
    for reduced in (True, False):
        matmul.allow_bf16_reduced_precision_reduction = reduced
        g = torch.Generator(device="cuda").manual_seed(0)
        rows = {}
        for m, n in SIZES:
            rows[f"{m}x{n}"] = {k: relative_error(m, n, k, g) for k in TOKENS}
            print(
                f"reduced={reduced} {m}x{n}: "
                + " ".join(f"{k}:{e:.1e}" for k, e in rows[f"{m}x{n}"].items()),
                flush=True,
            )
        metrics[f"bf16_reduced_precision_reduction={reduced}"] = rows
    matmul.allow_bf16_reduced_precision_reduction = True
    path = write_results(
        "wgrad-gemm-probe", metrics, args.out,
        notes=["max |dy.t() @ x - exact| / max |exact|, bf16 inputs, exact in float64"],
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
