#!/usr/bin/env python
"""Compile the fp8 window's Triton kernels for sm_90 without a GPU (a compile check):
``python tools/compile_window_kernels.py``.

The decode ranges and write index (``kernels/decode/window_index.py``) and the merge
(``kernels/decode/exact_window.py``) for MLA with the sink's fp8 rows read from the cache
(``HAS_SUB``, with a scale) and for GQA. Uses the Triton on the path (put a Triton 3.6 install first on
PYTHONPATH to check the H200's version) and its ptxas (or $TRITON_PTXAS_PATH). Prints one line
a kernel, and how many e4m3 conversions the MLA merge's PTX holds.
"""

import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cp_modules.kernels.decode import exact_window as ew  # noqa: E402
from cp_modules.kernels.decode import window_index as wi  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, types: dict, consts: dict, name: str, default: str = "i32") -> str:
    sig = {n: types.get(n, "constexpr" if n in consts else default) for n in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET)
    print(f"{name}: compiled for sm_90 (triton {triton.__version__}), "
          f"cubin {len(k.asm['cubin'])} B", flush=True)  # fmt: skip
    return k.asm["ptx"]


def main() -> None:
    i64 = "*i64"
    _compile(
        wi._ranges_kernel,
        dict(
            rows_ptr=i64,
            pos_ptr=i64,
            len_ptr="*i32",
            first_ptr=i64,
            start_ptr="*i32",
            klen_ptr="*i32",
            slots_ptr=i64,
            valid_ptr="*i8",
            sink_local_ptr=i64,
            sink_valid_ptr="*i8",
            positions_ptr=i64,
        ),  # fmt: skip
        dict(
            SINK=1,
            RECENT=16,
            CAP=16,
            HAS_FIRST=True,
            DCP=2,
            RANK=1,
            INTERLEAVE=4,
            BLOCK_T=64,
            BLOCK_C=32,
        ),  # fmt: skip
        "decode ranges",
    )
    _compile(
        wi._write_index_kernel,
        dict(
            owned_ptr="*i8", rows_ptr=i64, pos_ptr=i64, ends_ptr=i64, ring_ptr=i64, sink_ptr=i64
        ),  # fmt: skip
        dict(SINK=1, CAP=16, DCP=1, RANK=0, INTERLEAVE=1, BLOCK_N=64),
        "write index",
    )
    ptrs = dict(q_ptr="*bf16", out_ptr="*bf16", lse_ptr="*fp32", o_new_ptr="*bf16",
                lse_new_ptr="*fp32", buf_ptr="*bf16", slots_ptr=i64, valid_ptr="*i8",
                sub_ptr="*u8", sub_valid_ptr="*i8", sub_local_ptr=i64, seq_idx_ptr="*i32",
                bt_ptr="*i32", sub_scale_ptr="*fp32", scale="fp32", softcap="fp32")  # fmt: skip
    mla = dict(DK=576, DV=512, BLOCK_N=32, BLOCK_S=16, BLOCK_D=128, HAS_SUB=True,
               SOFTCAP=False, HAS_SCALE=True, PAGE=64)  # fmt: skip
    ptx = _compile(ew._window_merge_kernel, ptrs, mla, "merge, MLA, sink rows from the fp8 cache")
    print(f"  e4m3 conversions in its PTX: {sum('e4m3' in line for line in ptx.splitlines())}")
    gqa = dict(mla, DK=128, DV=128, HAS_SUB=False, HAS_SCALE=False)
    _compile(ew._window_merge_kernel, ptrs, gqa, "merge, GQA")


if __name__ == "__main__":
    main()
