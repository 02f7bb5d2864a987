#!/usr/bin/env python
"""fp8 (e4m3) KV cache against bf16 on one GPU: paged decode speed and bytes read.

    python -m benchmarks.bench_fp8_kv            # well under 3 minutes on an H200
    python -m benchmarks.bench_fp8_kv --quick    # two shapes per row family, a smoke test
    python -m benchmarks.bench_fp8_kv --logits   # only the logits-error rows (a few minutes)

For every shape both caches hold the same random K/V (the fp8 one quantized from the bf16 one
by ``cp::write_kv_cache`` semantics, static per-tensor scale 1.0: the values are N(0, 1)), and
each kernel is first checked against the pure-PyTorch reference on that same cache (a few
queries of the batch; the 2x rule against a same-dtype reference, whose fp8 cache is read by
the reference as ``fp8 * scale``). A shape that fails gets no speed and the exit status is 1.
Times are CUDA-graph replays (the device time, as the engine's decode graphs run).

Rows (flat, in ``metrics["rows"]``; results in ``benchmarks/results/fp8-kv-<date>.json``):

- ``paged decode gqa fp8 KV speed-up over bf16 (CUDA graph) B=<B> ctx=<ctx>``: Llama-3-8B
  decode attention (32 query heads, 8 KV heads, D=128, block size 64), bf16 time / fp8 time.
- ``paged decode gqa fp8 KV TB/s (CUDA graph) B=<B> ctx=<ctx>``: the fp8 cache's bytes the
  kernel reads (K and V, one byte each) per second. The fp8 caches come from
  ``allocate_kv_cache`` (the value cache token-minor as ``FP8_V_TOKEN_MINOR`` says); rows
  ``variant V_TOKEN_MINOR=<the other> ...`` time the same values in the other layout, rows
  ``variant BLOCK_N=<64 or 128> ...`` the other default tile (``FP8_BLOCK_N``), at B=1 rows
  ``variant MAX_SPLITS=<n> ...`` other caps of the split count (``tiles._MAX_SPLITS``, 64:
  binding there, 8 programs a split against 16 an SM wanted).
- ``paged decode mla fp8 KV TFLOP/s (128 heads) B=<B> ctx=<ctx>`` and the bf16 row of the same
  run (``paged decode mla bf16 KV TFLOP/s (128 heads) ...``: the default kernel, Gluon on
  Hopper); fp8 MLA decode at 128 heads runs the Gluon kernel's fp8 path
  (``mla_gluon_config.MLA_FP8_GLUON``). Rows ``variant GLUON=False ...`` (128 heads) time the
  Triton fp8 kernel instead (its speed-up over bf16 is the fp8 / bf16 TFLOP/s ratio), rows
  ``variant FP8_CONVERT_WARPS=2 FP8_CONVERT_REGS=24 ...`` the Gluon path with the 2-warp
  conversion; at 16 heads (Triton) rows ``variant TOKENS_ON_M=<the other> ...`` time the other
  of the two Triton kernels (heads or tokens on the tensor-core tile's M side:
  ``mla_tokens.FP8_TOKENS_ON_M``; ``... FP8_TILE=(128, 8, 1)``: its 128-token tile on 8
  warps), rows ``variant BF16_TOKENS_ON_M=<the other> bf16 ...`` the bf16 cache on the other
  one (``mla_tokens.BF16_TOKENS_ON_M``; both flipped: the row
  ``variant TOKENS_ON_M=<..> BF16_TOKENS_ON_M=<..> fp8 KV speed-up over bf16 ...``), rows
  ``variant K_T=...`` / ``ASM=...`` flip the heads-on-M kernel's key-tile load and conversion
  (with ``TOKENS_ON_M=False``).
- ``paged decode mla fp8 KV speed-up over bf16 (16 heads) B=<B> ctx=<ctx>``: DeepSeek's heads
  split 8 ways by tensor parallelism (memory-bound). On sm_90 the op runs the register-operand
  Gluon kernel there (``mla_regs_gluon.FP8_REGS_GLUON``); rows ``variant REGS_GLUON=True ...``
  time its other settings (stages, programs an SM, ``REGS_VECTOR_STORE``,
  ``REGS_Q_ONE_PASS``, ``REGS_SPREAD_MERGE``), rows
  ``variant TOKENS_GLUON=<True/False> ...`` the warp-specialised Gluon kernel and the Triton
  kernels with the register-operand kernel's routing off.
- ``fp8 KV logits error / bf16 KV logits error (vs fp32) <model>`` (Llama-3-8B, Qwen2.5-7B,
  DeepSeek-V3 shapes, 2 layers, 16k prompt; ``--logits`` runs only these, into
  ``fp8-kv-logits-<date>.json``; not in the default run, which stays within the suite's time
  per part): what the errors are and why the ratio is fair, :mod:`benchmarks.fp8_kv_logits`.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import torch
import triton
from triton.testing import do_bench

import cp_modules.kernels.decode.mla as mla_kernels
import cp_modules.kernels.decode.mla_gluon_config as mla_gluon_config
import cp_modules.kernels.decode.mla_regs_gluon as mla_regs_gluon
import cp_modules.kernels.decode.mla_tokens as mla_tokens
import cp_modules.kernels.decode.mla_tokens_gluon as mla_tokens_gluon
import cp_modules.kernels.decode.paged as gqa_kernels
import cp_modules.kernels.decode.tiles as decode_tiles
from benchmarks.common import RESULTS, switched, write_results
from benchmarks.fp8_kv_logits import NAMES, logits_error_rows
from cp_modules.cache.kv_dtype import FP8_DTYPE, kv_scale, quantize_fp8
from cp_modules.cache.paged import allocate_kv_cache, is_token_minor, to_token_minor
from cp_modules.kernels.decode.paged import DecodeConfig, paged_attention_kernel
from cp_modules.ops.paged_decode import paged_attention, paged_mla_attention
from cp_modules.reference.paged_decode import paged_attention_ref, paged_mla_attention_ref

DEVICE = "cuda"
BS = 64
GQA_HQ, GQA_HKV, GQA_D = 32, 8, 128
GQA_SCALE = GQA_D**-0.5
MLA_RK, MLA_ROPE = 512, 64
MLA_SCALE = (128 + MLA_ROPE) ** -0.5
GQA_SHAPES = [(1, 131072), (8, 131072), (64, 16384), (256, 4096), (32, 32768)]
MLA_128_SHAPES = [(1, 131072)] + [(b, c) for b in (8, 64, 256) for c in (4096, 32768, 131072)]
MLA_16_SHAPES = [(1, 131072), (8, 32768), (8, 131072), (64, 32768)]
MAX_CACHE_BYTES = 40e9  # of the bf16 cache
# The Gluon fp8 path's other conversion partition: 2 warps beside the producer warp (warp
# group 0 keeps 248 registers; the default is a warp group of its own, 4 warps at 32).
FP8_CONVERT_NARROW = {"FP8_CONVERT_WARPS": 2, "FP8_CONVERT_REGS": 24}
SWEEP_SHAPE = (8, 131072)
SWEEP_CONFIGS = [(16, 64, 4, 1), (16, 64, 4, 3), (16, 64, 4, 4), (16, 64, 4, 5), (16, 128, 8, 2),
                 (16, 128, 4, 3), (16, 128, 4, 4), (16, 32, 4, 4), (16, 256, 8, 2)]  # fmt: skip
SWEEP_ALL = False  # --sweep-all: the tile sweep on every GQA shape, not only SWEEP_SHAPE
GLUON_ONLY = False  # --gluon-only: few-head MLA rows time only the Gluon kernels' variants


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = float(do_bench(graph.replay, warmup=5, rep=30, return_mode="median"))
    del graph
    return ms


def _inputs(batch: int, ctx: int, heads: int, dq: int, num_blocks: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    width = triton.cdiv(ctx, BS)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g)[: batch * width]
    bt = perm.view(batch, width).to(torch.int32)
    q = torch.randn(batch, heads, dq, device=DEVICE, generator=g).to(torch.bfloat16)
    seq = torch.arange(batch, device=DEVICE, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int32)
    return q, bt, seq, lens


def _check(run, ref, q, bt, seq, lens) -> dict:
    """Kernel vs fp32 reference on a few queries, within 2x the same-dtype reference's error."""
    idx = torch.tensor(sorted({0, q.shape[0] // 2, q.shape[0] - 1}), device=DEVICE)
    sub = (q[idx], bt, seq[idx], lens[idx])
    out, lse = run(*sub)
    r_out, r_lse = ref(*sub, upcast=True)
    s_out, s_lse = ref(*sub, upcast=False)
    e_out = (out.float() - r_out.float()).abs().max().item()
    e_lse = (lse - r_lse).abs().max().item()
    b_out = (s_out.float() - r_out.float()).abs().max().item()
    b_lse = (s_lse - r_lse).abs().max().item()
    ok = math.isfinite(e_out) and e_out <= 2 * b_out + 1e-4 and e_lse <= 2 * b_lse + 1e-4
    return {"ok": bool(ok), "err_out": e_out, "err_lse": e_lse, "same_dtype_err_out": b_out}


def _variant(module, key, fp8, ref8, args, t16, read8, rows, checks, flag="FP8_K_TRANSPOSED",
             value=None, also=None):  # fmt: skip
    """The fp8 kernel with one of its switches flipped or set to ``value``
    (``FP8_K_TRANSPOSED``: the other key-tile load; ``FP8_DEQUANT_ASM``: the integer conversion
    in Triton ops instead of PTX; ``FP8_BLOCK_N``: tokens a tile; ``MLA_FP8_GLUON``: the Gluon
    kernel's fp8 path): checked against the reference, then timed; rows ``variant
    <switch>=<value> ...`` (speed-up, TB/s). ``also``: more switches of ``module`` set with it
    (named in the label)."""
    default = getattr(module, flag)
    value = (not default) if value is None else value
    names = {"FP8_K_TRANSPOSED": "K_T", "FP8_DEQUANT_ASM": "ASM", "FP8_BLOCK_N": "BLOCK_N",
             "MLA_FP8_GLUON": "GLUON", "FP8_CONVERT_WARPS": "FP8_CONVERT_WARPS",
             "FP8_TOKENS_ON_M": "TOKENS_ON_M", "_MAX_SPLITS": "MAX_SPLITS",
             "FP8_WIDE_HEADS": "FP8_WIDE_HEADS", "FP8_TOKENS_GLUON": "TOKENS_GLUON",
             "FP8_REGS_GLUON": "REGS_GLUON"}  # fmt: skip
    label = names[flag] + f"={value}" + "".join(f" {k}={v}" for k, v in (also or {}).items())
    t = None
    with switched(module, **(also or {}), **{flag: value}):
        try:
            chk = _check(fp8, ref8, *args)
        except Exception as e:  # e.g. a tile that does not fit shared memory
            chk = {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
        checks[f"{key} variant {label}"] = chk
        if chk["ok"]:
            t = graph_ms(lambda: fp8(*args))
            rows[f"variant {label} fp8 KV speed-up over bf16 {key}"] = t16 / t
            rows[f"variant {label} fp8 KV TB/s {key}"] = read8 / t / 1e9
            print(f"  {key} variant {label}: {t:.4f} ms x{t16 / t:.2f} "
                  f"{read8 / t / 1e9:.2f} TB/s", flush=True)  # fmt: skip
        else:
            print(f"  {key} variant {label}: FAILED check {chk}", flush=True)
    return t


def _bf16_tokens_on_m(key, bf16, ref16, args, t16, read8, rows, checks):
    """The bf16 cache on the other of the two Triton MLA kernels (``BF16_TOKENS_ON_M``
    flipped), checked, then timed: rows ``variant BF16_TOKENS_ON_M=<value> bf16 KV time / default
    bf16 ...`` and its TB/s (bf16 bytes). Returns its time (ms) or None."""
    value = not mla_tokens.BF16_TOKENS_ON_M
    label = f"BF16_TOKENS_ON_M={value}"
    mla_tokens.BF16_TOKENS_ON_M = value
    t = None
    try:
        chk = _check(bf16, ref16, *args)
        checks[f"{key} variant {label}"] = chk
        if chk["ok"]:
            t = graph_ms(lambda: bf16(*args))
            rows[f"variant {label} bf16 KV time / default bf16 {key}"] = t / t16
            rows[f"variant {label} bf16 KV TB/s {key}"] = 2 * read8 / t / 1e9
            print(f"  {key} variant {label}: {t:.4f} ms ({t / t16:.3f} of the default bf16, "
                  f"{2 * read8 / t / 1e9:.2f} TB/s)", flush=True)  # fmt: skip
        else:
            print(f"  {key} variant {label}: FAILED check {chk}", flush=True)
    finally:
        mla_tokens.BF16_TOKENS_ON_M = not value
    return t


def _layout_variant(key, fp8, ref8, v8, args, t16, read8, rows, checks):
    """The fp8 kernel on the other value-cache layout (a copy of ``v8``: token-minor <->
    [NB, BS, Hkv, D]), checked and timed like :func:`_variant`: rows ``variant
    V_TOKEN_MINOR=<value> ...``."""
    minor = is_token_minor(v8)
    other = v8.contiguous() if minor else to_token_minor(v8)
    label = f"V_TOKEN_MINOR={not minor}"
    run = functools.partial(fp8, v8=other)
    ref = functools.partial(ref8, v8=other)
    chk = _check(run, ref, *args)
    checks[f"{key} variant {label}"] = chk
    if chk["ok"]:
        t = graph_ms(lambda: run(*args))
        rows[f"variant {label} fp8 KV speed-up over bf16 {key}"] = t16 / t
        rows[f"variant {label} fp8 KV TB/s {key}"] = read8 / t / 1e9
        print(f"  {key} variant {label}: {t:.4f} ms x{t16 / t:.2f} {read8 / t / 1e9:.2f} TB/s",
              flush=True)  # fmt: skip
    else:
        print(f"  {key} variant {label}: FAILED check {chk}", flush=True)
    del other


def gqa_rows(shapes, rows: dict, checks: dict) -> bool:
    ok_all = True
    ones = kv_scale(1.0, GQA_HKV, device=DEVICE)
    for b, c in shapes:
        nb = b * triton.cdiv(c, BS) + 1
        shape = (nb, BS, GQA_HKV, GQA_D)
        kb = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE).normal_()
        vb = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE).normal_()
        # The engine's layouts (allocate_kv_cache: the value cache token-minor by default).
        k8, v8 = allocate_kv_cache(nb, BS, GQA_HKV, GQA_D, dtype=FP8_DTYPE, device=DEVICE)
        k8.copy_(quantize_fp8(kb, ones))
        v8.copy_(quantize_fp8(vb, ones))
        q, bt, seq, lens = _inputs(b, c, GQA_HQ, GQA_D, nb)

        def bf16(q, bt, seq, lens, kb=kb, vb=vb):
            return paged_attention(q, kb, vb, bt, seq, lens, scale=GQA_SCALE)

        def fp8(q, bt, seq, lens, k8=k8, v8=v8):
            return paged_attention(
                q, k8, v8, bt, seq, lens, scale=GQA_SCALE, k_scale=ones, v_scale=ones
            )

        def ref16(q, bt, seq, lens, upcast, kb=kb, vb=vb):
            return paged_attention_ref(q, kb, vb, bt, seq, lens, GQA_SCALE, upcast=upcast)

        def ref8(q, bt, seq, lens, upcast, k8=k8, v8=v8):
            return paged_attention_ref(
                q, k8, v8, bt, seq, lens, GQA_SCALE, upcast=upcast, k_scale=ones, v_scale=ones
            )

        key = f"B={b} ctx={c}"
        ch16 = _check(bf16, ref16, q, bt, seq, lens)
        ch8 = _check(fp8, ref8, q, bt, seq, lens)
        checks[f"gqa {key}"] = {"bf16": ch16, "fp8": ch8}
        if not (ch16["ok"] and ch8["ok"]):
            ok_all = False
            print(f"gqa {key}: FAILED check {ch16} {ch8}", flush=True)
            continue
        args = (q, bt, seq, lens)
        t16 = graph_ms(lambda f=bf16, a=args: f(*a))
        t8 = graph_ms(lambda f=fp8, a=args: f(*a))
        read8 = float(lens.double().sum()) * GQA_HKV * GQA_D * 2  # bytes: K and V, 1 byte each
        _variant(gqa_kernels, f"gqa {key}", fp8, ref8, (q, bt, seq, lens), t16, read8, rows,
                 checks)  # fmt: skip
        _variant(gqa_kernels, f"gqa {key}", fp8, ref8, (q, bt, seq, lens), t16, read8, rows,
                 checks, flag="FP8_DEQUANT_ASM")  # fmt: skip
        _layout_variant(f"gqa {key}", fp8, ref8, v8, (q, bt, seq, lens), t16, read8, rows,
                        checks)  # fmt: skip
        _variant(gqa_kernels, f"gqa {key}", fp8, ref8, (q, bt, seq, lens), t16, read8, rows,
                 checks, flag="FP8_BLOCK_N", value=64 if gqa_kernels.FP8_BLOCK_N == 128 else 128)  # fmt: skip
        if b == 1:  # one request: 8 programs a split, the split cap (64) decides the count
            for v in (32, 96, 128):
                _variant(decode_tiles, f"gqa {key}", fp8, ref8, args, t16, read8, rows,
                         checks, flag="_MAX_SPLITS", value=v)  # fmt: skip
        rows[f"paged decode gqa fp8 KV speed-up over bf16 (CUDA graph) {key}"] = t16 / t8
        rows[f"paged decode gqa fp8 KV TB/s (CUDA graph) {key}"] = read8 / t8 / 1e9
        rows[f"paged decode gqa bf16 KV TB/s (CUDA graph) {key}"] = 2 * read8 / t16 / 1e9
        print(f"gqa {key}: bf16 {t16:.4f} ms fp8 {t8:.4f} ms x{t16 / t8:.2f} "
              f"{read8 / t8 / 1e9:.2f} TB/s", flush=True)  # fmt: skip
        if SWEEP_ALL or (b, c) == SWEEP_SHAPE:
            # Other tiles for the fp8 cache (checked like the default): where the time goes.
            for bh, bn, w, st in SWEEP_CONFIGS:
                cfg = DecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st)

                def run(q, bt, seq, lens, cfg=cfg, k8=k8, v8=v8):
                    return paged_attention_kernel(q, k8, v8, bt, seq, lens, GQA_SCALE, config=cfg,
                                                  k_scale=ones, v_scale=ones)  # fmt: skip

                name = f"fp8 tiles H{bh} N{bn} W{w} S{st} {key}"
                try:
                    chk = _check(run, ref8, q, bt, seq, lens)
                    tms = graph_ms(lambda f=run, a=args: f(*a)) if chk["ok"] else None
                except Exception as e:  # a tile the compiler refuses
                    chk, tms = {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}, None
                checks[name] = chk
                if tms is not None:
                    rows[f"sweep gqa {name} TB/s"] = read8 / tms / 1e9
                    print(f"  {name}: {tms:.4f} ms {read8 / tms / 1e9:.2f} TB/s", flush=True)
        del bf16, fp8, ref16, ref8, kb, vb, k8, v8
        torch.cuda.empty_cache()
    return ok_all


def _triton_variants(k, bf16, fp8, ref16, ref8, args, t16, read8, rows, checks, heads):
    """The Triton MLA kernels' switches at few heads, each checked then timed (variant rows)."""
    t8m = _variant(mla_tokens, k, fp8, ref8, args, t16, read8, rows, checks,
                   flag="FP8_TOKENS_ON_M")  # fmt: skip
    if heads <= 16:  # (more heads take FP8_WIDE_TILE)
        _variant(mla_tokens, k, fp8, ref8, args, t16, read8, rows, checks,
                 flag="FP8_TOKENS_ON_M", value=True, also={"FP8_TILE": (128, 8, 1)})  # fmt: skip
    if 16 < heads <= mla_tokens.MAX_HEADS:  # the other of one 32-head tile, routed
        _variant(mla_tokens, k, fp8, ref8, args, t16, read8, rows, checks,
                 flag="FP8_WIDE_HEADS")  # fmt: skip
    t16m = _bf16_tokens_on_m(k, bf16, ref16, args, t16, read8, rows, checks)
    if t8m and t16m:  # both switches flipped
        both = (f"TOKENS_ON_M={not mla_tokens.FP8_TOKENS_ON_M} "
                f"BF16_TOKENS_ON_M={not mla_tokens.BF16_TOKENS_ON_M}")  # fmt: skip
        rows[f"variant {both} fp8 KV speed-up over bf16 {k}"] = t16m / t8m
    # K_T / ASM: the heads-on-M kernel's switches.
    with switched(mla_tokens, FP8_TOKENS_ON_M=False):
        _variant(mla_kernels, k, fp8, ref8, args, t16, read8, rows, checks)
        _variant(gqa_kernels, k, fp8, ref8, args, t16, read8, rows, checks,
                 flag="FP8_DEQUANT_ASM")  # fmt: skip


def mla_rows(shapes, heads: int, rows: dict, checks: dict) -> bool:
    ok_all = True
    one = kv_scale(1.0, 1, device=DEVICE)
    for b, c in shapes:
        nb = b * triton.cdiv(c, BS) + 1
        if nb * BS * (MLA_RK + MLA_ROPE) * 2 > MAX_CACHE_BYTES:
            continue
        cb = torch.empty((nb, BS, MLA_RK + MLA_ROPE), dtype=torch.bfloat16, device=DEVICE)
        cb.normal_()
        c8 = torch.empty(cb.shape, dtype=FP8_DTYPE, device=DEVICE)
        for i in range(0, nb, 8192):  # in pieces: an fp32 copy of the whole cache does not fit
            c8[i : i + 8192] = quantize_fp8(cb[i : i + 8192], one)
        q, bt, seq, lens = _inputs(b, c, heads, MLA_RK + MLA_ROPE, nb)

        def bf16(q, bt, seq, lens, cb=cb):
            return paged_mla_attention(q, cb, bt, seq, lens, scale=MLA_SCALE, kv_lora_rank=MLA_RK)

        def fp8(q, bt, seq, lens, c8=c8):
            return paged_mla_attention(
                q, c8, bt, seq, lens, scale=MLA_SCALE, kv_lora_rank=MLA_RK, kv_scale=one
            )

        def ref16(q, bt, seq, lens, upcast, cb=cb):
            return paged_mla_attention_ref(q, cb, bt, seq, lens, MLA_SCALE, MLA_RK, upcast=upcast)

        def ref8(q, bt, seq, lens, upcast, c8=c8):
            return paged_mla_attention_ref(
                q, c8, bt, seq, lens, MLA_SCALE, MLA_RK, upcast=upcast, kv_scale=one
            )

        key = f"B={b} ctx={c}"
        ch16 = _check(bf16, ref16, q, bt, seq, lens)
        ch8 = _check(fp8, ref8, q, bt, seq, lens)
        checks[f"mla{heads} {key}"] = {"bf16": ch16, "fp8": ch8}
        if not (ch16["ok"] and ch8["ok"]):
            ok_all = False
            print(f"mla {heads} heads {key}: FAILED check {ch16} {ch8}", flush=True)
            continue
        args = (q, bt, seq, lens)
        t16 = graph_ms(lambda f=bf16, a=args: f(*a))
        t8 = graph_ms(lambda f=fp8, a=args: f(*a))
        read8 = float(lens.double().sum()) * (MLA_RK + MLA_ROPE)
        if heads % 64 == 0:  # the Gluon kernel's fp8 path (16 heads stay on Triton)
            _variant(mla_gluon_config, f"mla{heads} {key}", fp8, ref8, args, t16, read8, rows,
                     checks, flag="MLA_FP8_GLUON")  # fmt: skip
            _variant(mla_gluon_config, f"mla{heads} {key}", fp8, ref8, args, t16, read8, rows,
                     checks, flag="FP8_CONVERT_WARPS", value=FP8_CONVERT_NARROW["FP8_CONVERT_WARPS"],
                     also={"FP8_CONVERT_REGS": FP8_CONVERT_NARROW["FP8_CONVERT_REGS"]})  # fmt: skip
        else:  # the Triton kernels' switches
            k = f"mla{heads} {key}"
            if heads <= 32:  # the register-operand Gluon kernel (mla_regs_gluon), 2 and 3 stages
                route = {"REGS_ROUTE_MAX_HEADS": 32}  # (the op's routing: to 16 heads)
                for stages in (2, 3):
                    _variant(mla_regs_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                             flag="FP8_REGS_GLUON", value=True,
                             also={"REGS_STAGES": stages, **route})  # fmt: skip
                _variant(mla_regs_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                         flag="FP8_REGS_GLUON", value=True,
                         also={"REGS_PROGRAMS_PER_SM": 2, **route})  # fmt: skip
                _variant(mla_regs_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                         flag="FP8_REGS_GLUON", value=True,
                         also={"REGS_VECTOR_STORE": True, **route})  # fmt: skip
                _variant(mla_regs_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                         flag="FP8_REGS_GLUON", value=True,
                         also={"REGS_VECTOR_STORE": True, "REGS_Q_ONE_PASS": True,
                               **route})  # fmt: skip
                # The split merge inside the kernel (where the launch has splits and at most
                # one program an SM; elsewhere this row times the default).
                _variant(mla_regs_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                         flag="FP8_REGS_GLUON", value=True,
                         also={"REGS_SPREAD_MERGE": True, **route})  # fmt: skip
                if heads > 16:  # one program for all the heads (32 a tile)
                    _variant(mla_regs_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                             flag="FP8_REGS_GLUON", value=True,
                             also={"REGS_HEAD_TILE": 32, "REGS_ROUTE_MAX_HEADS": 32})  # fmt: skip
            # The other kernels' variants with the register-operand kernel's routing off (it
            # comes first in the op's routing).
            with switched(mla_regs_gluon, FP8_REGS_GLUON=False):
                if heads <= 32:  # the warp-specialised Gluon kernel (mla_tokens_gluon)
                    _variant(mla_tokens_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                             flag="FP8_TOKENS_GLUON", value=True)  # fmt: skip
                    _variant(mla_tokens_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                             flag="FP8_TOKENS_GLUON", value=True,
                             also={"TOK_PIPELINE": not mla_tokens_gluon.TOK_PIPELINE})  # fmt: skip
                    _variant(mla_tokens_gluon, k, fp8, ref8, args, t16, read8, rows, checks,
                             flag="FP8_TOKENS_GLUON", value=False)  # fmt: skip
                if not GLUON_ONLY:  # (--gluon-only: the Triton kernels' variants not timed)
                    _triton_variants(k, bf16, fp8, ref16, ref8, args, t16, read8, rows, checks,
                                     heads)  # fmt: skip
        flops = float(lens.double().sum()) * heads * 2 * (2 * MLA_RK + MLA_ROPE)
        if heads == 128:
            rows[f"paged decode mla fp8 KV TFLOP/s (128 heads) {key}"] = flops / t8 / 1e9
            rows[f"paged decode mla bf16 KV TFLOP/s (128 heads) {key}"] = flops / t16 / 1e9
            rows[f"paged decode mla fp8 / bf16 KV TFLOP/s (128 heads) {key}"] = t16 / t8
        else:
            rows[f"paged decode mla fp8 KV speed-up over bf16 ({heads} heads) {key}"] = t16 / t8
            rows[f"paged decode mla fp8 KV TB/s ({heads} heads) {key}"] = (
                float(lens.double().sum()) * (MLA_RK + MLA_ROPE) / t8 / 1e9
            )
        print(f"mla {heads} heads {key}: bf16 {t16:.4f} ms ({flops / t16 / 1e9:.0f} TFLOP/s) "
              f"fp8 {t8:.4f} ms ({flops / t8 / 1e9:.0f} TFLOP/s) x{t16 / t8:.2f}",
              flush=True)  # fmt: skip
        del bf16, fp8, ref16, ref8, cb, c8
        torch.cuda.empty_cache()
    return ok_all


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-mla", action="store_true")
    ap.add_argument(
        "--families",
        default="gqa,mla16,mla128",
        help="comma list of row families: gqa, mla<heads> (mla16, mla128, mla32, ...)",
    )
    ap.add_argument("--logits", action="store_true", help="only the logits-error rows")
    ap.add_argument("--gluon-only", action="store_true",
                    help="few-head MLA: time only the Gluon kernels' variants")  # fmt: skip
    ap.add_argument("--sweep-all", action="store_true", help="the GQA tile sweep on every shape")
    ap.add_argument("--logits-models", default=",".join(NAMES))
    ap.add_argument("--logits-prompt", type=int, default=16384)
    ap.add_argument("--logits-steps", type=int, default=8)
    a = ap.parse_args()
    if torch.cuda.get_device_capability() < (8, 9):
        print("fp8 KV needs compute capability >= 8.9", flush=True)
        return 1
    global SWEEP_ALL, GLUON_ONLY
    SWEEP_ALL = a.sweep_all
    GLUON_ONLY = a.gluon_only
    rows: dict = {}
    checks: dict = {}
    gqa = GQA_SHAPES[:2] if a.quick else GQA_SHAPES
    kind = "fp8-kv-logits" if a.logits else "fp8-kv-quick" if a.quick else "fp8-kv"

    def save() -> None:  # after every family: a later failure keeps the rows measured so far
        path = write_results(kind, {"rows": rows, "checks": checks}, a.out,
                             fp8_dtype=str(FP8_DTYPE), block_size=BS)  # fmt: skip
        print(f"wrote {path}", flush=True)

    if a.logits:
        ok = logits_error_rows(a.logits_models.split(","), rows, checks,
                               prompt_len=a.logits_prompt, steps=a.logits_steps)  # fmt: skip
        save()
        return 0 if ok else 1
    families = set(a.families.split(","))
    if a.no_mla:
        families = {f for f in families if not f.startswith("mla")}
    ok = True
    if "gqa" in families:
        ok &= gqa_rows(gqa, rows, checks)
        save()
    # mla<H>: H heads (16: DeepSeek's 128 split 8 ways, 128 whole; others, e.g. 32 or 48, on
    # the 16-head shapes).
    for heads in sorted(int(f[3:]) for f in families if f[:3] == "mla" and f[3:].isdigit()):
        shapes = MLA_128_SHAPES if heads == 128 else MLA_16_SHAPES
        ok &= mla_rows(shapes[:2] if a.quick else shapes, heads, rows, checks)
        save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
