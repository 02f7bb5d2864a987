#!/usr/bin/env python
"""Where the fp8 Gluon MLA decode spends its time: the kernel with parts of its conversion taken
out, beside the bf16 kernel, in one process per variant.

Run from the repository root on the H200, one process per variant (a variant replaces Gluon
functions of :mod:`cp_modules.kernels.decode.mla_gluon_fp8` before the first compile):

    python tools/probes/probe_mla_fp8_parts.py --variant fp8 --warps 4 --regs 32

Variants (``--variant``):
- ``fp8``: the kernel as shipped (checked against the fp32 reference first, the 2x rule);
- ``nocvt``: each piece's conversion does nothing (wait for its bytes, the barriers and the
  ready arrivals stay): what the pipeline with half the bytes costs without the conversion;
- ``copy``: each piece's load and store stay, the ``cvt`` becomes a sign extension;
- ``noq``: Q is not brought into fp16 (the conversion partition only waits for it);
- ``pipe``: the conversion loads each latent piece's bytes before it stores the previous
  piece's fp16 (checked like ``fp8``: it computes the same values);
- ``ready1``: each latent piece ready as soon as it is converted (a proxy fence and barrier a
  piece instead of one for each 4), checked;
- ``pipe1``: both, checked.

Only ``fp8``, ``pipe``, ``ready1`` and ``pipe1`` compute the right values; the others are for timing. Prints, per shape, the bf16
kernel's time (the same process) and the variant's, CUDA-graph replay medians, and with
``--profile`` launches the variant once more in an NVTX range ``profile`` (for ``ncu
--nvtx --nvtx-include profile/``). ``--json`` appends one JSON line a shape to that file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = ("fp8", "nocvt", "copy", "noq", "pipe", "ready1", "pipe1")


try:  # the replacements, at module level (Gluon resolves a function's globals)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from cp_modules.kernels.decode.mla_gluon_fp8 import _CVT_ASM, _Q_LANDED
    from cp_modules.kernels.decode.mla_gluon_parts import _BN, _LANDED, _LAT, _sync_warp_group

    @gluon.jit
    def _cvt_mask(x, valid, lay: gl.constexpr, MASK: gl.constexpr):
        y = gl.inline_asm_elementwise(_CVT_ASM, "=r,=r,r", [x], dtype=gl.int32, is_pure=True,
                                      pack=2)  # fmt: skip
        if MASK:
            rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, lay))
            y = gl.where((rows < valid)[:, None], y, gl.zeros_like(y))
        return y

    @gluon.jit
    def _pipelined(k16, k32, k_ready, buf: gl.constexpr, first: gl.constexpr, phase, valid,
                   lay: gl.constexpr, MASK: gl.constexpr, EACH: gl.constexpr):  # fmt: skip
        # The next piece's bytes are loaded before this piece's fp16 is stored; EACH: every
        # piece ready as soon as it is stored (a fence and barrier a piece).
        mbarrier.wait(k_ready.index(_LANDED + buf * _LAT + first), phase)
        x = k16.index(2 * (buf * _LAT + first) + 1).load(lay)
        for i in gl.static_range(_LAT // 2):
            y = _cvt_mask(x, valid, lay, MASK)
            if i + 1 < _LAT // 2:
                mbarrier.wait(k_ready.index(_LANDED + buf * _LAT + first + i + 1), phase)
                x = k16.index(2 * (buf * _LAT + first + i + 1) + 1).load(lay)
            _sync_warp_group()
            k32.index(buf * _LAT + first + i).store(y)
            if EACH:
                fence_async_shared()
                _sync_warp_group()
                mbarrier.arrive(k_ready.index(buf * 16 + first + i))
        if not EACH:
            fence_async_shared()
            _sync_warp_group()
            for i in gl.static_range(_LAT // 2):
                mbarrier.arrive(k_ready.index(buf * 16 + first + i))

    @gluon.jit
    def _pipe_half_tile(k16, k32, k_ready, buf: gl.constexpr, first: gl.constexpr, phase, valid,
                        lay: gl.constexpr, MASK: gl.constexpr):  # fmt: skip
        _pipelined(k16, k32, k_ready, buf, first, phase, valid, lay, MASK, False)

    @gluon.jit
    def _nocvt(src16, dst32, valid, lay: gl.constexpr, MASK: gl.constexpr):
        _sync_warp_group()

    @gluon.jit
    def _copy(src16, dst32, valid, lay: gl.constexpr, MASK: gl.constexpr):
        x = src16.load(lay)
        _sync_warp_group()
        dst32.store(x.to(gl.int32))

    @gluon.jit
    def _noq(q_lat, q_pe, q_in, qpe_in, vec_smem, q_bar, k_ready, lay: gl.constexpr):
        mbarrier.wait(k_ready.index(_Q_LANDED), 0)
        fence_async_shared()
        _sync_warp_group()
        mbarrier.arrive(q_bar)

    @gluon.jit
    def _ready1_half_tile(k16, k32, k_ready, buf: gl.constexpr, first: gl.constexpr, phase,
                          valid, lay: gl.constexpr, MASK: gl.constexpr):  # fmt: skip
        # Each latent piece ready as soon as it is converted (a fence and barrier a piece).
        for i in gl.static_range(_LAT // 2):
            mbarrier.wait(k_ready.index(_LANDED + buf * _LAT + first + i), phase)
            x = k16.index(2 * (buf * _LAT + first + i) + 1).load(lay)
            y = _cvt_mask(x, valid, lay, MASK)
            _sync_warp_group()
            k32.index(buf * _LAT + first + i).store(y)
            fence_async_shared()
            _sync_warp_group()
            mbarrier.arrive(k_ready.index(buf * 16 + first + i))

    @gluon.jit
    def _pipe1_half_tile(k16, k32, k_ready, buf: gl.constexpr, first: gl.constexpr, phase,
                         valid, lay: gl.constexpr, MASK: gl.constexpr):  # fmt: skip
        _pipelined(k16, k32, k_ready, buf, first, phase, valid, lay, MASK, True)

except ImportError:  # pragma: no cover - a Triton without Gluon
    pass


def _patch(variant: str) -> None:
    import cp_modules.kernels.decode.mla_gluon_fp8 as f8

    if variant == "nocvt":
        f8._fp8_convert_bytes = _nocvt
    elif variant == "copy":
        f8._fp8_convert_bytes = _copy
    elif variant == "noq":
        f8._fp8_query = _noq
    elif variant == "pipe":
        f8._fp8_convert_half_tile = _pipe_half_tile
    elif variant == "ready1":
        f8._fp8_convert_half_tile = _ready1_half_tile
    elif variant == "pipe1":
        f8._fp8_convert_half_tile = _pipe1_half_tile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="fp8", choices=VARIANTS)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--regs", type=int, default=32)
    ap.add_argument("--shapes", default="1x131072,8x4096,64x32768")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_mla_fp8_parts: skipped: no CUDA device")
        return 0
    _patch(a.variant)
    import triton

    import cp_modules.kernels.decode.mla_gluon_config as cfg
    from benchmarks import bench_fp8_kv as bf
    from cp_modules.cache.kv_dtype import FP8_DTYPE, kv_scale, quantize_fp8
    from cp_modules.ops.paged_decode import paged_mla_attention
    from cp_modules.reference.paged_decode import paged_mla_attention_ref

    cfg.MLA_FP8_GLUON = True
    cfg.FP8_CONVERT_WARPS, cfg.FP8_CONVERT_REGS = a.warps, a.regs
    one = kv_scale(1.0, 1, device="cuda")
    rk, width = bf.MLA_RK, bf.MLA_RK + bf.MLA_ROPE
    for shape in a.shapes.split(","):
        b, c = (int(x) for x in shape.split("x"))
        nb = b * triton.cdiv(c, bf.BS) + 1
        cb = torch.empty((nb, bf.BS, width), dtype=torch.bfloat16, device="cuda").normal_()
        c8 = torch.empty(cb.shape, dtype=FP8_DTYPE, device="cuda")
        for i in range(0, nb, 8192):
            c8[i : i + 8192] = quantize_fp8(cb[i : i + 8192], one)
        q, bt, seq, lens = bf._inputs(b, c, a.heads, width, nb)

        def run16(q, bt, seq, lens, cb=cb):
            return paged_mla_attention(q, cb, bt, seq, lens, scale=bf.MLA_SCALE, kv_lora_rank=rk)

        def run8(q, bt, seq, lens, c8=c8):
            return paged_mla_attention(q, c8, bt, seq, lens, scale=bf.MLA_SCALE,
                                       kv_lora_rank=rk, kv_scale=one)  # fmt: skip

        def ref8(q, bt, seq, lens, upcast, c8=c8):
            return paged_mla_attention_ref(q, c8, bt, seq, lens, bf.MLA_SCALE, rk,
                                           upcast=upcast, kv_scale=one)  # fmt: skip

        check = (
            bf._check(run8, ref8, q, bt, seq, lens)
            if a.variant in ("fp8", "pipe", "ready1", "pipe1")
            else None
        )
        if check is not None and not check["ok"]:
            print(f"B={b} ctx={c}: CHECK FAILED {check}", flush=True)
            return 1
        args = (q, bt, seq, lens)
        t16 = bf.graph_ms(lambda f=run16, a=args: f(*a))
        t8 = bf.graph_ms(lambda f=run8, a=args: f(*a))
        row = {"variant": a.variant, "warps": a.warps, "regs": a.regs, "heads": a.heads,
               "B": b, "ctx": c, "bf16_ms": t16, "fp8_ms": t8, "fp8_over_bf16_speed": t16 / t8,
               "check": check}  # fmt: skip
        print(f"{a.variant} w{a.warps}/r{a.regs} B={b} ctx={c}: bf16 {t16:.4f} ms, "
              f"variant {t8:.4f} ms, x{t16 / t8:.3f}", flush=True)  # fmt: skip
        if a.json:
            with open(a.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        if a.profile:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
            run16(q, bt, seq, lens)
            run8(q, bt, seq, lens)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
        del cb, c8
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
