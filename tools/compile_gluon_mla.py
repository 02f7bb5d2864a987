#!/usr/bin/env python
"""Compile the Gluon MLA decode kernel for sm_90 without a GPU and report ptxas's register and
spill counts: ``python tools/compile_gluon_mla.py [block_size] [partial 0/1] [variant] [fp8]``
(variant: a name in ``GLUON_MLA_VARIANTS``, default ``base``; ``all`` compiles each in turn).
``partial`` 1 compiles the split path (2 splits: a fused-merge variant with its merge).
``fp8`` (or ``FP8=1`` in the environment) compiles the fp8 (e4m3) cache path
(``mla_gluon_fp8``; the variant must have it, e.g. ``loader-r232-early-pz``); ``CONV_REGS`` /
``CONV_WARPS`` in the environment override its conversion warp group's registers / warps.

With ``SPLITS=<S>`` in the environment the integer and pointer arguments are specialised as a
launch with S splits (128 heads, ctx 32k) specialises them (16-byte alignment, multiples of
16, the value 1 as a constant), so the loads and stores vectorise as they do at run time;
without it every integer is a plain i32 (the numbers in the docs were taken that way).

Uses the Triton on the path (put a Triton 3.6 install first on PYTHONPATH to check the H200's
version) and the ``ptxas`` on PATH (or $PTXAS). Writes the PTX, TTGIR and cubin to $OUT_DIR
(default /tmp/gluon-mla).
"""

import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cp_modules.kernels.decode import mla_gluon as m  # noqa: E402


def _signature(page: int, partial: bool, splits: int | None, fp8: bool = False):
    """The kernel's argument types, and (with ``splits``) the attributes and constants of a
    launch with that many splits (128 heads, ctx 32k)."""
    layout = m._smem_layout()
    sig = {
        "q_desc": f"tensordesc<bf16[64, 64],{layout!r}>",
        "CACHE": "*u8" if fp8 else "*bf16", "BT": "*i32", "SEQ_IDX": "*i32", "KV_LEN": "*i32",
        "OUT": "*fp32" if partial else "*bf16", "LSE": "*fp32",
        "FOUT": "*bf16", "FLSE": "*fp32", "COUNTER": "*i32", "TRACE_BUF": "*i32",
        "KV_SCALE": "*fp32" if fp8 else "*i32", "qk_scale": "fp32",
        **{k: "i32" for k in ("stride_ot", "stride_oh", "stride_os", "stride_lt", "stride_lh",
                              "stride_ls", "stride_btr", "max_kv_len", "num_splits")},
        **{k: "constexpr" for k in ("H", "NUM_HEAD_TILES", "PAGE", "BOX_ROWS", "PARTIAL", "ISSUE",
                                    "PEEL", "WG1_REGS", "LOADER_REGS", "FUSED",
                                    "OWN_REGS", "EARLY", "SPREAD", "TRACE", "PZERO",
                                    "SCALE_P", "SP_REFILL", "FP8", "CONV_WARPS",
                                    "CONV_REGS", "HALVES")},
    }  # fmt: skip
    attrs, spec_consts = {}, {}
    if splits:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        if partial != (splits > 1):
            raise ValueError("SPLITS > 1 goes with partial 1, SPLITS=1 with partial 0")
        r, h, width = 512, 128, 32768 // page
        ints = {"stride_ot": h * splits * r, "stride_oh": splits * r,
                "stride_os": r if splits > 1 else 0, "stride_lt": h * splits, "stride_lh": splits,
                "stride_ls": 1 if splits > 1 else 0, "stride_btr": width,
                "max_kv_len": width * page}  # fmt: skip
        names_ = list(m._paged_mla_gluon_kernel.arg_names)
        for k, v in ints.items():
            kind, attr = native_specialize_impl(BaseBackend, v, False, True, True)
            if kind == "constexpr":
                sig[k] = "constexpr"
                spec_consts[k] = v
            elif attr:
                attrs[(names_.index(k),)] = [["tt.divisibility", 16]]
        for k in ("BT", "SEQ_IDX", "KV_LEN", "OUT", "LSE", "FOUT", "FLSE", "COUNTER"):
            attrs[(names_.index(k),)] = [["tt.divisibility", 16]]
    # The cache is 16-byte aligned at every launch (the TMA descriptors need it; cpasync's
    # 16-byte copies too), so Triton always specialises its pointer that way.
    attrs[(list(m._paged_mla_gluon_kernel.arg_names).index("CACHE"),)] = [["tt.divisibility", 16]]
    return layout, sig, attrs, spec_consts


def compile_sm90(
    name: str,
    page: int,
    partial: bool,
    splits: int | None = None,
    wg1_regs: int | None = None,
    fp8: bool = False,
    conv: tuple[int, int] | None = None,
):
    """The Gluon MLA kernel of variant ``name`` compiled for sm_90 (no GPU needed); ``fp8``:
    its fp8-cache path (``conv``: the conversion warp group's (warps, registers); default
    the module's)."""
    layout, sig, attrs, spec_consts = _signature(page, partial, splits, fp8)
    cfg = m.GLUON_MLA_VARIANTS[name]
    box = min(page, 64, cfg.max_box_rows)
    if fp8:
        from cp_modules.kernels.decode import mla_gluon_config as mc

        warps, regs = conv or (mc.FP8_CONVERT_WARPS, mc.FP8_CONVERT_REGS)
        sig["c_desc"] = f"tensordesc<u8[{box}, 64],{m._fp8_smem_layout()!r}>"
        sig["h_desc"] = "constexpr"
        spec_consts.update({"FP8": True, "CONV_WARPS": warps, "CONV_REGS": regs})
    else:
        sig["c_desc"] = f"tensordesc<bf16[{box}, 64],{layout!r}>"
        # The half-tile descriptor ([piece, row, column]; read with half_copies only).
        h_layout = m.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        sig["h_desc"] = (f"tensordesc<bf16[4, {box}, 64],{h_layout!r}>"
                         if cfg.half_copies and box == 64 else "constexpr")  # fmt: skip
        spec_consts.update({"FP8": False, "CONV_WARPS": 4, "CONV_REGS": 48})
    n = splits if splits else 2 if partial else 1
    if sig["h_desc"] == "constexpr":
        spec_consts["h_desc"] = None
    constexprs = {"H": 128, "NUM_HEAD_TILES": 2, "PAGE": page, "BOX_ROWS": box,
                  "PARTIAL": partial, "TRACE": False, **spec_consts,
                  **cfg.constexprs(n, spread=cfg.spreads_merge(n, 2 * n, 132)),
                  "WG1_REGS": wg1_regs if wg1_regs is not None else cfg.wg1_regs}  # fmt: skip
    src = GluonASTSource(m._paged_mla_gluon_kernel, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def main() -> None:
    page = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    partial = sys.argv[2] == "1" if len(sys.argv) > 2 else True
    splits_env = os.environ.get("SPLITS")
    splits = int(splits_env) if splits_env else None
    names = sys.argv[3] if len(sys.argv) > 3 else "base"
    fp8 = (len(sys.argv) > 4 and sys.argv[4] == "fp8") or os.environ.get("FP8") == "1"
    conv = None
    if "CONV_REGS" in os.environ or "CONV_WARPS" in os.environ:
        from cp_modules.kernels.decode import mla_gluon_config as mc

        conv = (int(os.environ.get("CONV_WARPS", mc.FP8_CONVERT_WARPS)),
                int(os.environ.get("CONV_REGS", mc.FP8_CONVERT_REGS)))  # fmt: skip
    names = list(m.GLUON_MLA_VARIANTS) if names == "all" else names.split(",")
    out = Path(os.environ.get("OUT_DIR", "/tmp/gluon-mla"))
    out.mkdir(parents=True, exist_ok=True)
    wg1 = int(os.environ["WG1_REGS"]) if "WG1_REGS" in os.environ else None
    for name in names:
        try:
            kernel = compile_sm90(name, page, partial, splits, wg1, fp8, conv)
        except ValueError as e:
            sys.exit(str(e))
        tag = (f"_S{splits_env}" if splits_env else "") + ("_fp8" if fp8 else "")
        stem = out / f"mla_{name}_bs{page}_partial{int(partial)}{tag}"
        stem.with_suffix(".ptx").write_text(kernel.asm["ptx"])
        stem.with_suffix(".ttgir").write_text(kernel.asm["ttgir"])
        ptxas = os.environ.get("PTXAS", "ptxas")
        cmd = [ptxas, "-arch=sm_90a", "-v", str(stem.with_suffix(".ptx")), "-o",
               str(stem.with_suffix(".cubin"))]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        info = [ln.strip() for ln in (done.stdout + done.stderr).splitlines()
                if "registers" in ln or "spill" in ln or "injected" in ln or "error" in ln]  # fmt: skip
        print(
            f"[{name} bs={page} partial={int(partial)}{' S=' + splits_env if splits_env else ''}"
            f"{' fp8' if fp8 else ''}] triton {triton.__version__}: shared "
            f"{kernel.metadata.shared} B, {kernel.metadata.num_warps} warps; " + " | ".join(info)
        )


if __name__ == "__main__":
    main()
