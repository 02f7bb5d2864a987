#!/usr/bin/env python
"""The GQA paged decode kernel's SASS for sm_90, compiled without a GPU: instruction mix of its
loops for the fp8 value cache's two layouts (and any switch of ``kernels/decode/paged.py``).

    python tools/probes/sass_fp8_decode.py                      # B=8 ctx=128k, both layouts
    python tools/probes/sass_fp8_decode.py --batch 256 --ctx 4096 --set FP8_BLOCK_N=64
    python tools/probes/sass_fp8_decode.py --bf16               # the bf16 cache's kernel too

The launcher runs as on the H200 (Llama-3-8B heads: 32 query heads, 8 KV heads, D = 128,
block size 64; 132 SMs for the split count; bf16 queries; the PTX conversions), on CPU tensors
with a stand-in driver that reports an sm_90 target: Triton specialises the arguments as at a
launch (pointer alignment, integers divisible by 16, the value 1), compiles with its own ptxas
and the kernel is disassembled with its nvdisasm, never launched. For each loop (a backward
branch) that holds tensor-core products it prints the static instruction count of the body
(per warp and iteration) and the counts of the opcodes that matter here. The cache holds two
blocks: strides and alignment, not sizes, decide the code. ``--out DIR`` keeps the TTGIR, PTX
and SASS. Uses the Triton on the path: put Triton 3.6 (the H200's) first on PYTHONPATH to
match the device.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cp_modules.kernels.decode.paged as gqa  # noqa: E402
from cp_modules.cache.kv_dtype import FP8_DTYPE, kv_scale  # noqa: E402
from cp_modules.cache.paged import to_token_minor  # noqa: E402
from cp_modules.kernels.decode.fp8 import fp8_launch_args  # noqa: E402

HQ, HKV, D, BS, SMS = 32, 8, 128, 64, 132
OPS = ["LDS.U8", "LDS.U16", "LDS", "LDSM", "LDG", "LDGSTS", "PRMT", "IMAD.MOV", "MOV", "HMMA",
       "F2FP", "HMNMX2", "SHF", "LOP3", "BAR", "FFMA", "MUFU"]  # fmt: skip


class _Sm90Driver:
    """Enough of a Triton driver for the JIT to specialise and compile for sm_90."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class _Compiled(Exception):
    def __init__(self, kernel):
        self.kernel = kernel


class _WarmupOnly:
    """Stands for the kernel in the launcher: compiles at ``[grid](...)`` and stops there."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def compile_only(*args, **kwargs):
            raise _Compiled(self.fn.warmup(*args, grid=grid, **kwargs))

        return compile_only


def compile_launch(
    batch: int, ctx: int, fp8: bool, token_minor: bool, query_len: int = 1, bs: int = BS
):
    """The compiled kernel of the default launch for ``batch`` queries of ``ctx`` tokens (runs
    of ``query_len`` queries of one request)."""
    width = triton.cdiv(ctx, bs)
    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    kc = torch.zeros(2, bs, HKV, D, dtype=dtype)
    vc = to_token_minor(kc) if token_minor else kc.clone()
    q = torch.zeros(batch, HQ, D, dtype=torch.bfloat16)
    bt = torch.zeros(batch, width, dtype=torch.int32)
    seq = torch.arange(batch, dtype=torch.int32) // query_len
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    ones = kv_scale(1.0, HKV) if fp8 else None
    saved = (gqa._paged_attn_kernel, gqa._num_sms, gqa.fp8_launch_args)
    gqa._paged_attn_kernel = _WarmupOnly(saved[0])
    gqa._num_sms = lambda device: SMS
    gqa.fp8_launch_args = lambda dt, dev, hw=False: fp8_launch_args(
        dt, torch.device("cuda"), asm=gqa.FP8_DEQUANT_ASM, hw_fp16=hw
    )
    drivers = triton.runtime.driver
    active = drivers._active
    drivers.set_active(_Sm90Driver())
    try:
        gqa.paged_attention_kernel(q, kc, vc, bt, seq, lens, D**-0.5, k_scale=ones, v_scale=ones,
                                   query_len=query_len)  # fmt: skip
    except _Compiled as done:
        return done.kernel
    finally:
        gqa._paged_attn_kernel, gqa._num_sms, gqa.fp8_launch_args = saved
        drivers._active = active
    raise RuntimeError("the launcher did not reach the kernel")


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def sass_of(kernel) -> str:
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def _instructions(sass: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """(address, opcode, operands) of each instruction, and each label's address."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label[1])
            continue
        m = _LINE.search(line)
        if m:
            addr = int(m[1], 16)
            labels.update({name: addr for name in pending})
            pending = []
            ins.append((addr, m[3], m[4]))
    return ins, labels


def loops_of(sass: str) -> list[dict]:
    """Each backward branch's body [target, branch] that holds HMMA: size and opcode counts."""
    ins, labels = _instructions(sass)
    found = []
    for i, (addr, op, rest) in enumerate(ins):
        hit = re.search(r"(\.L_x_\d+)", rest)
        if not op.startswith("BRA") or not hit or labels.get(hit[1], addr + 1) > addr:
            continue
        start = labels[hit[1]]
        body = [o for a, o, _ in ins[: i + 1] if a >= start]
        if not any(o.startswith("HMMA") for o in body):
            continue
        counts: collections.Counter = collections.Counter()
        for o in body:
            for name in OPS:
                if o == name or o.startswith(name + "."):
                    counts[name] += 1
        found.append({"start": hex(start), "instructions": len(body), **counts})
    return found


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--query-len", type=int, default=1, help="queries per run (speculative)")
    ap.add_argument("--block-size", type=int, default=BS)
    ap.add_argument("--bf16", action="store_true", help="also the bf16 cache's kernel")
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE of paged.py")
    ap.add_argument("--out", help="keep TTGIR, PTX and SASS here")
    a = ap.parse_args()
    for item in a.set:
        name, value = item.split("=")
        setattr(gqa, name, type(getattr(gqa, name))(eval(value)))
    cases = [("fp8 V [NB, BS, Hkv, D]", True, False), ("fp8 V token-minor", True, True)]
    if a.bf16:
        cases += [("bf16", False, False), ("bf16 V token-minor", False, True)]
    print(f"triton {triton.__version__}, B={a.batch} ctx={a.ctx} query_len={a.query_len} "
          f"block size {a.block_size}, "
          f"sets {a.set or 'none'}")  # fmt: skip
    for label, fp8, tm in cases:
        kernel = compile_launch(a.batch, a.ctx, fp8, tm, a.query_len, a.block_size)
        sass = sass_of(kernel)
        md = kernel.metadata
        print(f"[{label}] {md.num_warps} warps, {md.num_stages} stages, shared {md.shared} B, "
              f"{kernel.n_regs if hasattr(kernel, 'n_regs') else '?'} regs, "
              f"{len(_LINE.findall(sass))} instructions in all")  # fmt: skip
        for loop in loops_of(sass):
            print("   loop", " ".join(f"{k}={v}" for k, v in loop.items()))
        if a.out:
            stem = Path(a.out) / label.replace(" ", "_").replace(",", "").strip("[]")
            stem.parent.mkdir(parents=True, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                stem.with_suffix("." + ext).write_text(kernel.asm[ext])
            stem.with_suffix(".sass").write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
