#!/usr/bin/env python
"""The tokens-on-M fp8 MLA decode at 16 heads, one launch per kernel for ncu.

Run from the repository root on a GPU:

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section WarpStateStats \
        python tools/probes/probe_mla16_fp8_ncu.py --batch 8 --ctx 32768

Builds DeepSeek's latent cache (576 wide, block size 64) in bf16 and fp8 for ``batch`` requests
of ``ctx`` tokens, 16 heads, checks each kernel against the fp32 reference (the 2x rule), warms
it up, then launches each once inside an NVTX range ``profile`` (the split merge too; an inner
range names the kernel): the bf16 default kernel, the fp8 Triton tokens-on-M kernel, the
fp8 heads-on-M kernel (``mla_tokens.FP8_TOKENS_ON_M`` off), and the warp-specialised Gluon
tokens-on-M kernel (``mla_tokens_gluon``), and the register-operand Gluon kernel
(``mla_regs_gluon``). ``--runs`` picks some of them (bf16, fp8, fp8-heads-on-m, fp8-gluon,
fp8-regs); ``--heads`` another head count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import switched  # noqa: E402
from cp_modules.kernels.decode import mla_regs_gluon, mla_tokens, mla_tokens_gluon  # noqa: E402
from cp_modules.ops.paged_decode import paged_mla_attention  # noqa: E402
from cp_modules.reference.paged_decode import paged_mla_attention_ref  # noqa: E402
from cp_modules.testing.numerics import assert_decode_close  # noqa: E402

RK, ROPE, BS = 512, 64, 64


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--runs", default="bf16,fp8,fp8-heads-on-m,fp8-gluon,fp8-regs")
    a = ap.parse_args()
    HEADS = a.heads
    dev = "cuda"
    width = -(-a.ctx // BS)
    nb = a.batch * width + 1
    g = torch.Generator(device=dev).manual_seed(0)
    cb = torch.randn(nb, BS, RK + ROPE, device=dev, generator=g).to(torch.bfloat16)
    c8 = cb.to(torch.float8_e4m3fn)
    one = torch.ones(1, device=dev)
    bt = torch.randperm(nb, device=dev, generator=g)[: a.batch * width].view(a.batch, width)
    bt = bt.to(torch.int32)
    q = torch.randn(a.batch, HEADS, RK + ROPE, device=dev, generator=g).to(torch.bfloat16)
    seq = torch.arange(a.batch, device=dev, dtype=torch.int32)
    lens = torch.full((a.batch,), a.ctx, device=dev, dtype=torch.int32)
    scale = (128 + ROPE) ** -0.5
    # (name, cache, switches of mla_tokens, which Gluon kernel is routed ("", "tokens",
    # "regs"), scale)
    runs = [
        ("bf16", cb, {}, "", None),
        ("fp8", c8, {}, "", one),
        ("fp8-heads-on-m", c8, {"FP8_TOKENS_ON_M": False}, "", one),
        ("fp8-gluon", c8, {}, "tokens", one),
        ("fp8-regs", c8, {}, "regs", one),
    ]
    wanted = a.runs.split(",")
    for name, cache, switches, gluon, sc in runs:
        if name not in wanted:
            continue
        with (
            switched(mla_tokens, **switches),
            switched(mla_tokens_gluon, FP8_TOKENS_GLUON=gluon == "tokens"),
            switched(mla_regs_gluon, FP8_REGS_GLUON=gluon == "regs"),
        ):

            def fn(qq=q, cache=cache, sc=sc):
                return paged_mla_attention(qq, cache, bt, seq, lens, scale=scale,
                                           kv_lora_rank=RK, kv_scale=sc)  # fmt: skip

            sub = q[:1]
            out, lse = paged_mla_attention(sub, cache, bt, seq[:1], lens[:1], scale=scale,
                                           kv_lora_rank=RK, kv_scale=sc)  # fmt: skip
            ref = paged_mla_attention_ref(sub, cache, bt, seq[:1], lens[:1], scale, RK,
                                          upcast=True, kv_scale=sc)  # fmt: skip
            same = paged_mla_attention_ref(sub, cache, bt, seq[:1], lens[:1], scale, RK,
                                           upcast=False, kv_scale=sc)  # fmt: skip
            assert_decode_close(out, lse, ref, same)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
            torch.cuda.nvtx.range_push(name)
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.range_pop()
            print(f"{name}: checked and profiled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
