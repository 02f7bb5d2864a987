#!/usr/bin/env python
"""Compile the Gluon tokens-on-M fp8 MLA decode kernel (``kernels/decode/mla_tokens_gluon.py``)
for sm_90a without a GPU and report its shared memory and ptxas's register and spill counts:
``python tools/compile_mla_tokens_gluon.py [block_size] [partial 0/1] [heads tile 16/32]``
(``CONV_REGS`` in the environment: the conversion partitions' registers; ``PIPE=1``: the
pipelined product loop, ``TOK_PIPELINE``). ``KERNEL=regs``: the register-operand kernel
(``kernels/decode/mla_regs_gluon.py``) instead, ``STAGES`` its ring depth, ``VEC_STORE=0/1``
its epilogue, ``Q_ONE_PASS=0/1`` its query load.

Uses the Triton on the path (put a Triton 3.6 install first on PYTHONPATH to check the H200's
version) and the ``ptxas`` on PATH (or $PTXAS) for the counts. Writes the PTX and TTGIR to
$OUT_DIR (default /tmp/mla-tokens-gluon).
"""

import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cp_modules.kernels.decode import mla_regs_gluon as mr  # noqa: E402
from cp_modules.kernels.decode import mla_tokens_gluon as m  # noqa: E402

_INTS = ("stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_btr", "stride_ot",
         "stride_oh", "stride_os", "stride_lt", "stride_lh", "stride_ls", "max_kv_len",
         "num_splits")  # fmt: skip


def compile_sm90(
    page: int, partial: bool, bh: int = 16, regs: int | None = None, pipe: bool | None = None
):
    """The kernel for ``bh`` heads (DeepSeek's latent, 512 + 64), block size ``page``, the split
    path with ``partial``, compiled for sm_90a."""
    fn = m._mla_tokens_gluon_kernel
    sig = {"Q": "*bf16", "C16": "*i16", "BT": "*i32", "SEQ_IDX": "*i32", "KV_LEN": "*i32",
           "OUT": "*fp32" if partial else "*bf16", "LSE": "*fp32", "KV_SCALE": "*fp32",
           "qk_scale": "fp32", **{k: "i32" for k in _INTS},
           **{k: "constexpr" for k in ("H", "BH", "PAGE", "R", "PARTIAL",
                                       "CONV_REGS", "PIPE")}}  # fmt: skip
    consts = {"H": bh, "BH": bh, "PAGE": page, "R": 512, "PARTIAL": partial,
              "CONV_REGS": regs or m.TOK_CONVERT_REGS,
              "PIPE": m.TOK_PIPELINE if pipe is None else pipe}  # fmt: skip
    return _build(fn, sig, consts, "C16")


def _build(fn, sig: dict, consts: dict, cache: str):
    """``fn`` compiled for sm_90a on 4 warps. The launcher's tensors are 16-byte aligned, and
    so are the cache's row strides (checked) and the output's strides (the launcher allocates
    it: multiples of 512 elements), which Triton's launcher specialises as such at run time."""
    names = list(fn.arg_names)
    attrs = {(names.index(k),): [["tt.divisibility", 16]]
             for k in ("Q", cache, "BT", "OUT", "LSE", "stride_qt", "stride_qh", "stride_cb",
                       "stride_cs", "stride_ot", "stride_oh", "stride_os")}  # fmt: skip
    src = GluonASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_regs_sm90(
    page: int,
    partial: bool,
    bh: int = 16,
    stages: int | None = None,
    trace: bool = False,
    vec_store: bool | None = None,
    q_one_pass: bool | None = None,
    spread_splits: int = 0,
):
    """The register-operand kernel, as :func:`compile_sm90` (``trace``: with its timeline
    stamps; ``vec_store``: its vector-store epilogue, None: ``REGS_VECTOR_STORE``;
    ``spread_splits`` S > 1: the split merge spread over the programs, for S splits)."""
    fn = mr._mla_regs_gluon_kernel
    sig = {"Q": "*bf16", "C8": "*u8", "BT": "*i32", "SEQ_IDX": "*i32", "KV_LEN": "*i32",
           "OUT": "*fp32" if partial else "*bf16", "LSE": "*fp32", "KV_SCALE": "*fp32",
           "qk_scale": "fp32", **{k: "i32" for k in _INTS}, "TRACE_BUF": "*i64",
           "COUNTER": "*i32", "FOUT": "*bf16", "FLSE": "*fp32",
           **{k: "i32" for k in ("stride_fot", "stride_foh", "stride_flt", "stride_flh")},
           **{k: "constexpr" for k in ("H", "BH", "PAGE", "PARTIAL", "STAGES", "VEC_STORE", "OUT_L",
                                       "Q_ONE_PASS", "Q_L", "TRACE", "SPREAD", "CB", "S_P2",
                                       "MERGE_L")}}  # fmt: skip
    consts = {"H": bh, "BH": bh, "PAGE": page, "PARTIAL": partial,
              "STAGES": stages or mr.REGS_STAGES,
              "VEC_STORE": mr.REGS_VECTOR_STORE if vec_store is None else vec_store,
              "OUT_L": mr._out_layout(bh), "TRACE": trace,
              "Q_ONE_PASS": mr.REGS_Q_ONE_PASS if q_one_pass is None else q_one_pass}  # fmt: skip
    consts["Q_L"] = mr._q_layout(bh) if consts["Q_ONE_PASS"] else None
    s_p2, cb = mr.spread_block_columns(spread_splits) if spread_splits > 1 else (1, 4)
    consts.update({"SPREAD": spread_splits > 1, "CB": cb, "S_P2": s_p2,
                   "MERGE_L": mr._merge_layout(s_p2, cb, bh) if spread_splits > 1 else None})  # fmt: skip
    return _build(fn, sig, consts, "C8")


def main() -> None:
    page = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    partial = sys.argv[2] == "1" if len(sys.argv) > 2 else True
    bh = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    regs = int(os.environ["CONV_REGS"]) if "CONV_REGS" in os.environ else None
    pipe = os.environ["PIPE"] == "1" if "PIPE" in os.environ else None
    out = Path(os.environ.get("OUT_DIR", "/tmp/mla-tokens-gluon"))
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get("KERNEL") == "regs":
        stages = int(os.environ["STAGES"]) if "STAGES" in os.environ else None
        vec = os.environ["VEC_STORE"] == "1" if "VEC_STORE" in os.environ else None
        q1 = os.environ["Q_ONE_PASS"] == "1" if "Q_ONE_PASS" in os.environ else None
        spread = int(os.environ.get("SPREAD", "0"))  # S > 1: the spread merge for S splits
        k = compile_regs_sm90(page, partial, bh, stages, vec_store=vec, q_one_pass=q1,
                              spread_splits=spread)  # fmt: skip
        tag = "_vec" if (mr.REGS_VECTOR_STORE if vec is None else vec) else ""
        tag += "_q1" if (mr.REGS_Q_ONE_PASS if q1 is None else q1) else ""
        tag += f"_spread{spread}" if spread > 1 else ""
        stem = out / f"regs_bs{page}_partial{int(partial)}_h{bh}_s{stages or mr.REGS_STAGES}{tag}"
    else:
        k = compile_sm90(page, partial, bh, regs, pipe)
        tag = "_pipe" if (m.TOK_PIPELINE if pipe is None else pipe) else ""
        stem = out / f"tok_bs{page}_partial{int(partial)}_h{bh}{tag}"
    stem.with_suffix(".ptx").write_text(k.asm["ptx"])
    stem.with_suffix(".ttgir").write_text(k.asm["ttgir"])
    cmd = [os.environ.get("PTXAS", "ptxas"), "-arch=sm_90a", "-v", str(stem.with_suffix(".ptx")),
           "-o", str(stem.with_suffix(".cubin"))]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    info = [ln.strip() for ln in (done.stdout + done.stderr).splitlines()
            if "registers" in ln or "spill" in ln or "injected" in ln or "error" in ln]  # fmt: skip
    print(f"[bs={page} partial={int(partial)} heads={bh}] triton {triton.__version__}: shared "
          f"{k.metadata.shared} B; " + " | ".join(info))  # fmt: skip


if __name__ == "__main__":
    main()
