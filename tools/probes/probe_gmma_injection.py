#!/usr/bin/env python
"""When does ptxas inject a ``warpgroup.wait`` into warp-group MMA code? Offline, no GPU:
``python tools/probes/probe_gmma_injection.py`` (ptxas on PATH, or $PTXAS).

One warp group runs two steps of the MLA decode pattern, unrolled: the scores S as a chain of
async wgmma, then, while S is in flight, something done to the output accumulator O (defined by
the previous step's wgmma, waited for), then O += P V as another async wgmma, then a wait for
both. Each case compiles for sm_90a and prints the ptxas injection messages (C7517: a
``warpgroup.wait``, which here waits for S before P V is issued; C7519: a
``warpgroup.arrive``).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

CASES = {
    "O rescaled in place (by a loaded factor) while S is in flight": 0,
    "O only read (a row sum) while S is in flight": 1,
    "O rescaled after S is waited for": 2,
}


@gluon.jit
def _two_steps(X, CASE: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    a = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 64], lay)
    b = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 64], lay)
    o = gl.zeros([64, 64], gl.float32, mma)
    acc = gl.zeros([64], gl.float32, row_l)
    for step in gl.static_range(2):
        s = gl.zeros([64, 64], gl.float32, mma)
        for c in gl.static_range(8):
            s = warpgroup_mma(a.index(c), b.index(c).permute((1, 0)), s, is_async=True)
        alpha = gl.load(X + step * 64 + gl.arange(0, 64, layout=row_l))
        if CASE == 0:
            o = o * alpha[:, None]
        elif CASE == 1:
            acc += gl.sum(o, 1) * alpha
        else:
            s = warpgroup_mma_wait(0, deps=(s,))
            o = o * alpha[:, None]
        o = warpgroup_mma(a.index(0), b.index(1), o, is_async=True)
        s, o = warpgroup_mma_wait(0, deps=(s, o))
        acc += gl.sum(s, 1)
    gl.store(X + gl.arange(0, 64, layout=row_l), acc + gl.sum(o, 1))


def main() -> None:
    ptxas = os.environ.get("PTXAS", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        for what, case in CASES.items():
            src = GluonASTSource(_two_steps, {"X": "*fp32", "CASE": "constexpr"},
                                 constexprs={"CASE": case})  # fmt: skip
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            ptx = Path(tmp) / f"case{case}.ptx"
            ptx.write_text(kernel.asm["ptx"])
            done = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx) + ".o"],
                                  capture_output=True, text=True)  # fmt: skip
            msgs = [ln.split(": ", 1)[-1] for ln in (done.stdout + done.stderr).splitlines()
                    if "injected" in ln]  # fmt: skip
            print(f"{what}: {'; '.join(msgs) if msgs else 'nothing injected'}")


if __name__ == "__main__":
    main()
