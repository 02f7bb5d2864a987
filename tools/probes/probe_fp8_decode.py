#!/usr/bin/env python
"""Where the fp8 GQA paged decode's time goes: split counts and tiles, bf16 beside fp8.

    python tools/probes/probe_fp8_decode.py --out DIR
    python tools/probes/probe_fp8_decode.py --out DIR --loops   # the loop/conversion switches
                                                              # and value-cache layouts
    python tools/probes/probe_fp8_decode.py --out DIR --writes  # cache writes, both layouts

For Llama-3-8B decode attention (32 query heads, 8 KV heads, D = 128, block size 64) at a few
batch x context shapes, times the Triton kernel (CUDA-graph replay, median) over split counts
and tiles for both caches (the fp8 value cache token-minor), after checking each fp8
configuration against the reference on a few queries. Prints one line per configuration and writes ``fp8-decode-probe-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch
import triton

import cp_modules.kernels.cache as cache_kernels
import cp_modules.kernels.decode.paged as gqa
from benchmarks.bench_fp8_kv import (
    BS,
    GQA_D,
    GQA_HKV,
    GQA_HQ,
    GQA_SCALE,
    _check,
    _inputs,
    graph_ms,
)
from benchmarks.common import write_results
from cp_modules.cache.kv_dtype import FP8_DTYPE, kv_scale, quantize_fp8
from cp_modules.cache.paged import allocate_kv_cache, to_token_minor
from cp_modules.kernels.decode.paged import DecodeConfig, paged_attention_kernel
from cp_modules.ops.kv_cache import write_kv_cache
from cp_modules.reference.paged_decode import paged_attention_ref

SHAPES = [(1, 131072), (8, 131072), (256, 4096)]
SPLITS = {(1, 131072): [33, 66, 132, 264, 528], (8, 131072): [10, 20, 33, 66], (256, 4096): [1, 2]}
TILES = [(16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3)]
# --loops: the default launch (op-chosen splits and tiles) with the switches of paged.py;
# V_TOKEN_MINOR (not a paged.py switch) picks the value cache's layout for the variant.
LOOP_SHAPES = [(8, 131072), (1, 131072), (256, 4096)]
_ALL: dict[str, object] = dict(BT_AHEAD=True, UNMASKED_MAIN=True, FP8_HW_FP16=True)
LOOP_VARIANTS: dict[str, dict[str, object]] = {
    "old": dict(
        BT_AHEAD=False,
        UNMASKED_MAIN=False,
        FP8_HW_FP16=False,
        FP8_STAGED=False,
        V_TOKEN_MINOR=False,
    ),
    "all": dict(_ALL, FP8_STAGED=False, V_TOKEN_MINOR=False),
    "all N64": dict(_ALL, FP8_STAGED=False, FP8_BLOCK_N=64, V_TOKEN_MINOR=False),
    "all staged": dict(_ALL, FP8_STAGED=True, V_TOKEN_MINOR=False),
    "token-minor": dict(_ALL, FP8_STAGED=False, V_TOKEN_MINOR=True),
    "token-minor N64": dict(_ALL, FP8_STAGED=False, FP8_BLOCK_N=64, V_TOKEN_MINOR=True),
    "token-minor pps24": dict(_ALL, FP8_STAGED=False, FP8_PROGRAMS_PER_SM=24, V_TOKEN_MINOR=True),
    "token-minor N64 pps32": dict(
        _ALL, FP8_STAGED=False, FP8_BLOCK_N=64, FP8_PROGRAMS_PER_SM=32, V_TOKEN_MINOR=True
    ),
}


def loops(out: str, shapes: int) -> int:
    rows: dict = {}
    ones = kv_scale(1.0, GQA_HKV, device="cuda")
    for b, c in LOOP_SHAPES[:shapes]:
        nb = b * triton.cdiv(c, BS) + 1
        shape = (nb, BS, GQA_HKV, GQA_D)
        kb = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
        vb = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
        k8, v_rows = quantize_fp8(kb, ones), quantize_fp8(vb, ones)
        v_minor = to_token_minor(v_rows)
        q, bt, seq, lens = _inputs(b, c, GQA_HQ, GQA_D, nb)
        read8 = float(lens.double().sum()) * GQA_HKV * GQA_D * 2

        def ref8(q, bt, seq, lens, upcast, k8=k8, v8=v_rows):
            return paged_attention_ref(q, k8, v8, bt, seq, lens, GQA_SCALE, upcast=upcast,
                                       k_scale=ones, v_scale=ones)  # fmt: skip

        def ref16(q, bt, seq, lens, upcast, kb=kb, vb=vb):
            return paged_attention_ref(q, kb, vb, bt, seq, lens, GQA_SCALE, upcast=upcast)

        for name, variant in LOOP_VARIANTS.items():
            flags = {k: v for k, v in variant.items() if k != "V_TOKEN_MINOR"}
            v8 = v_minor if variant["V_TOKEN_MINOR"] else v_rows
            saved = {k: getattr(gqa, k) for k in flags}
            for k, val in flags.items():
                setattr(gqa, k, val)
            try:

                def run8(q, bt, seq, lens, k8=k8, v8=v8):
                    return paged_attention_kernel(q, k8, v8, bt, seq, lens, GQA_SCALE,
                                                  k_scale=ones, v_scale=ones)  # fmt: skip

                def run16(q, bt, seq, lens, kb=kb, vb=vb):
                    return paged_attention_kernel(q, kb, vb, bt, seq, lens, GQA_SCALE)

                fp8_only = name not in ("old", "all")
                c8 = _check(run8, ref8, q, bt, seq, lens)
                c16 = {"ok": True} if fp8_only else _check(run16, ref16, q, bt, seq, lens)
                if not (c8["ok"] and c16["ok"]):
                    print(f"B={b} ctx={c} {name}: FAILED check {c8} {c16}", flush=True)
                    continue
                args = (q, bt, seq, lens)
                t8 = graph_ms(lambda f=run8, a=args: f(*a))
                t16 = float("nan") if fp8_only else graph_ms(lambda f=run16, a=args: f(*a))
            except Exception as e:
                print(f"B={b} ctx={c} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            finally:
                for k, val in saved.items():
                    setattr(gqa, k, val)
            key = f"B={b} ctx={c} {name}"
            rows[key] = {"fp8_ms": t8, "bf16_ms": t16, "fp8_TBps": read8 / t8 / 1e9,
                         "bf16_TBps": 2 * read8 / t16 / 1e9, "speedup": t16 / t8,
                         "err8": c8.get("err_out"), "err16": c16.get("err_out")}  # fmt: skip
            print(f"{key}: fp8 {t8:.4f} ms {read8 / t8 / 1e9:.2f} TB/s | bf16 {t16:.4f} ms "
                  f"{2 * read8 / t16 / 1e9:.2f} TB/s | x{t16 / t8:.2f} | err {c8['err_out']:.1e}",
                  flush=True)  # fmt: skip
        del kb, vb, k8, v8, v_rows, v_minor
        torch.cuda.empty_cache()
        path = write_results("fp8-decode-loops", {"rows": rows}, out)  # after every shape
    print(path, flush=True)
    return 0


WRITE_TOKENS = [8, 256, 32768]  # a decode step of B=8 and B=256, a 32k-token prefill chunk


def writes(out: str) -> int:
    """``cp::write_kv_cache`` into fp8 caches, the value cache in both layouts: one request's
    consecutive positions through a shuffled block table (a prefill chunk) or one token each of
    T requests (a decode step), CUDA-graph replays."""
    rows: dict = {}
    ones = kv_scale(1.0, GQA_HKV, device="cuda")
    nb = 4096
    k8, v_minor = allocate_kv_cache(nb, BS, GQA_HKV, GQA_D, dtype=FP8_DTYPE, device="cuda")
    v_rows = torch.zeros_like(k8)
    perm = torch.randperm(nb, device="cuda")
    for t in WRITE_TOKENS:
        k = torch.randn(t, GQA_HKV, GQA_D, device="cuda").to(torch.bfloat16)
        v = torch.randn_like(k)
        if t > 1024:
            pos = torch.arange(t, device="cuda")
            slots = perm[pos // BS] * BS + pos % BS
        else:
            slots = perm[:t] * BS + 17
        default = cache_kernels.WRITE_GROUPED_MIN_TOKENS
        layouts = [("[NB, BS, Hkv, D]", v_rows, default), ("token-minor", v_minor, default),
                   ("token-minor 16-token programs", v_minor, 0),
                   ("token-minor one-token programs", v_minor, 10**9)]  # fmt: skip
        for name, vc, min_tokens in layouts:
            cache_kernels.WRITE_GROUPED_MIN_TOKENS = min_tokens
            args = (k, v, k8, vc, slots, ones, ones)
            ms = graph_ms(lambda a=args: write_kv_cache(*a))
            cache_kernels.WRITE_GROUPED_MIN_TOKENS = default
            rows[f"write T={t} V {name}"] = {"ms": ms, "GBps": 2 * k.numel() / ms / 1e6}
            print(f"write T={t} V {name}: {ms * 1e3:.1f} us", flush=True)
        same = torch.equal(v_rows.view(torch.uint8), v_minor.view(torch.uint8))
        rows[f"write T={t} same bytes"] = same
        print(f"write T={t}: the same values in both layouts: {same}", flush=True)
    print(write_results("fp8-kv-writes", {"rows": rows}, out), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--loops", action="store_true")
    ap.add_argument("--writes", action="store_true", help="the cache writes in both layouts")
    ap.add_argument("--shapes", type=int, default=None, help="the first N shapes only")
    a = ap.parse_args()
    if a.loops:
        return loops(a.out, a.shapes or len(LOOP_SHAPES))
    if a.writes:
        return writes(a.out)
    rows: dict = {}
    ones = kv_scale(1.0, GQA_HKV, device="cuda")
    for b, c in SHAPES[: a.shapes or len(SHAPES)]:
        nb = b * triton.cdiv(c, BS) + 1
        shape = (nb, BS, GQA_HKV, GQA_D)
        kb = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
        vb = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
        k8, v8 = quantize_fp8(kb, ones), to_token_minor(quantize_fp8(vb, ones))
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
