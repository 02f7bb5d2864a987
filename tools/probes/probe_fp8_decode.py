#!/usr/bin/env python
"""Where the fp8 GQA paged decode's time goes: split counts and tiles, bf16 beside fp8.

    python tools/probes/probe_fp8_decode.py --out DIR

For Llama-3-8B decode attention (32 query heads, 8 KV heads, D = 128, block size 64) at a few
batch x context shapes, times the Triton kernel (CUDA-graph replay, median) over split counts
and tiles for both caches, after checking each fp8 configuration against the reference on a
few queries. Prints one line per configuration and writes ``fp8-decode-probe-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch
import triton

from benchmarks.bench_fp8_kv import BS, GQA_D, GQA_HKV, GQA_HQ, GQA_SCALE, _inputs, graph_ms
from benchmarks.common import write_results
from cp_modules.cache.kv_dtype import kv_scale, quantize_fp8
from cp_modules.kernels.decode.paged import DecodeConfig, paged_attention_kernel
from cp_modules.reference.paged_decode import paged_attention_ref

SHAPES = [(8, 131072), (256, 4096)]
SPLITS = {(8, 131072): [5, 10, 20, 40], (256, 4096): [1, 2]}
TILES = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 8, 3), (16, 128, 4, 4), (16, 256, 8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows: dict = {}
    ones = kv_scale(1.0, GQA_HKV, device="cuda")
    for b, c in SHAPES:
        nb = b * triton.cdiv(c, BS) + 1
        shape = (nb, BS, GQA_HKV, GQA_D)
        kb = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
        vb = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
        k8, v8 = quantize_fp8(kb, ones), quantize_fp8(vb, ones)
        q, bt, seq, lens = _inputs(b, c, GQA_HQ, GQA_D, nb)
        read8 = float(lens.double().sum()) * GQA_HKV * GQA_D * 2
        ref = paged_attention_ref(q[:1], k8, v8, bt, seq[:1], lens[:1], GQA_SCALE, k_scale=ones,
                                  v_scale=ones)[0].float()  # fmt: skip
        for splits, tile in itertools.product(SPLITS[(b, c)], TILES):
            cfg = DecodeConfig(*tile)
            name = f"B={b} ctx={c} S={splits} H{tile[0]} N{tile[1]} W{tile[2]} st{tile[3]}"
            args = (q, k8, v8, bt, seq, lens, GQA_SCALE, splits)
            run8 = functools.partial(paged_attention_kernel, *args, config=cfg, k_scale=ones,
                                     v_scale=ones)  # fmt: skip
            run16 = functools.partial(paged_attention_kernel, q, kb, vb, *args[3:], config=cfg)
            try:
                err = (run8()[0][:1].float() - ref).abs().max().item()
                t8, t16 = graph_ms(run8), graph_ms(run16)
            except Exception as e:  # a tile that does not fit
                print(f"{name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows[name] = {"fp8_ms": t8, "bf16_ms": t16, "fp8_TBps": read8 / t8 / 1e9,
                          "bf16_TBps": 2 * read8 / t16 / 1e9, "err": err}  # fmt: skip
            print(f"{name}: fp8 {t8:.4f} ms {read8 / t8 / 1e9:.2f} TB/s | bf16 {t16:.4f} ms "
                  f"{2 * read8 / t16 / 1e9:.2f} TB/s | err {err:.2e}", flush=True)  # fmt: skip
        del kb, vb, k8, v8
        torch.cuda.empty_cache()
    print(write_results("fp8-decode-probe", {"rows": rows}, a.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
