#!/usr/bin/env python
"""Build the peer kernels that ``benchmarks/bench_peers.py`` runs beside this project's, on a CUDA
machine, from sources given to it (none of their code lives in this repository).

    python tools/build_peers.py PEERS_DIR [--site /tmp/peers_site] [--logs DIR] [--jobs 16]
    export CP_PEERS_SITE=/tmp/peers_site     # bench_peers puts it on sys.path (the default)

PEERS_DIR holds any of:

- ``flashmla-*.tar.xz`` or a ``flashmla/`` folder: a snapshot of deepseek-ai/FlashMLA's ``csrc/``
  and ``flash_mla/`` with CUTLASS's ``include/`` and ``tools/util/include/`` (at the commit that
  FlashMLA pins) under ``csrc/cutlass/``. Only the SM90 dense decode is built: a one-function
  binding of FlashMLA's own ``dense_attn_decode_interface`` (``csrc/api/dense_decode.h``), its
  scheduler-metadata and split-combine kernels, and the bf16 instantiation of the split-KV MLA
  kernel, for ``sm_90a`` only with ``FLASH_MLA_DISABLE_FP16`` (FlashMLA's setup.py builds every
  sparse, fp8 and SM100 kernel too: many minutes of nvcc). The extension is built with
  ``torch.utils.cpp_extension.load`` (ninja) into ``/tmp/flashmla_build`` and installed as
  ``flash_mla.cuda`` next to FlashMLA's own Python interface in ``SITE/flash_mla``.
- ``flashinfer-*.tar.xz`` or a ``flashinfer/`` folder: flashinfer-python's package tree (a wheel
  unpacked, trimmed to its Python files, ``data/include``, the top-level ``data/csrc`` sources
  and the CUTLASS/CCCL/spdlog headers its JIT includes), copied to ``SITE/flashinfer``. FlashInfer
  compiles its kernels on first use (JIT, cached under ``$FLASHINFER_WORKSPACE_BASE``).
- ``whl/*.whl``: wheels FlashInfer needs that the GPU image lacks (apache-tvm-ffi), installed into
  SITE with ``pip --no-index --no-deps``.
- ``flashmla-obj/``: FlashMLA's CUDA sources compiled ahead (``--objects-only``, no GPU): only
  the binding is then compiled here and linked with them.
- ``flashinfer-aot/<module>/<module>.so``: FlashInfer's JIT modules for the benchmark's kernels
  compiled ahead (``--flashinfer-aot-only``, no GPU), copied to ``SITE/flashinfer/data/aot``,
  where FlashInfer loads a module without compiling it (it falls back to its JIT if one fails
  to load).

With ``--warm``, FlashInfer's kernels for the benchmark's shapes are JIT-compiled while FlashMLA
builds (``benchmarks.bench_peers.warm_flashinfer``), so the benchmark itself times, not compiles.
Each step logs to ``LOGS/build-<step>.log``; a step that fails is reported and the others go on.
Exit status: the number of failed steps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# FlashMLA's SM90 dense decode, as its setup.py compiles it (flags copied from there, less the
# gencodes of other architectures and the PTX-size warnings).
FLASHMLA_SOURCES = (
    "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "csrc/smxx/decode/combine/combine.cu",
    "csrc/sm90/decode/dense/instantiations/bf16.cu",
)
FLASHMLA_BINDING = """\
#include <pybind11/pybind11.h>

#include "dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA (SM90 dense decode only)";
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
"""
FLASHMLA_NVCC = [
    "-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "--ptxas-options=--register-usage-level=10", "-lineinfo",
    "-DFLASH_MLA_DISABLE_FP16", "-gencode", "arch=compute_90a,code=sm_90a",
]  # fmt: skip
FLASHMLA_CXX = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations",
                "-DFLASH_MLA_DISABLE_FP16"]  # fmt: skip


def flashinfer_specs() -> list:
    """FlashInfer's JIT specs for what ``bench_peers`` runs (bf16): ``merge_states``/``merge_state``,
    the CUDA-core decode and the tensor-core (fa2 prefill) path at D = 128 (both paged-KV stride
    variants), and the MLA fa3 and fa2 kernels at 512 + 64. The arguments are those the
    wrappers' ``plan`` passes for the benchmark's calls (no RoPE, window or soft cap)."""
    import torch
    from flashinfer.jit.attention.modules import (
        _gen_batch_prefill_independent_paged_module,
        _gen_batch_prefill_primary_module,
        gen_batch_decode_module,
        gen_batch_mla_module,
    )
    from flashinfer.jit.cascade import gen_cascade_module

    bf, i32 = torch.bfloat16, torch.int32
    gqa = (bf, bf, bf, i32, 128, 128, 0, False, False)  # dtypes, head dims, posenc, swa, cap
    return [
        gen_cascade_module(),
        gen_batch_decode_module(*gqa),
        _gen_batch_prefill_primary_module("fa2", *gqa, False),  # False: no fp16 QK reduction
        _gen_batch_prefill_independent_paged_module("fa2", *gqa, False),
        gen_batch_mla_module("fa3", bf, bf, bf, i32, 512, 64, False),
        gen_batch_mla_module("fa2", bf, bf, bf, i32, 512, 64, False),
    ]


def build_flashinfer_aot(site: Path, out: Path, log) -> None:
    """Compile :func:`flashinfer_specs` with FlashInfer's own JIT (ninja + nvcc, no GPU, sm_90a)
    and copy each module to ``out/<name>/<name>.so``. ``site`` must hold ``flashinfer`` and an
    ``apache-tvm-ffi`` for this Python. A machine with no driver has no ``libcuda.so`` to link
    against: a stub with its soname is made (the modules resolve ``cu*`` symbols at load)."""
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fi_ws_aot")
    cuda_home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    # FlashInfer takes CUDA_HOME from `which nvcc` when it is unset: an nvcc wrapper in
    # /usr/local/bin gives /usr/local, whose lib64 holds no libcudart to link against.
    os.environ["CUDA_HOME"] = str(cuda_home)
    if not any((cuda_home / d / "libcuda.so").exists() for d in ("lib64", "lib64/stubs")):
        stub = Path("/tmp/peers_stubs")
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "stub.c").write_text("\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                        str(stub / "libcuda.so"), str(stub / "stub.c")], check=True)  # fmt: skip
        os.environ["LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(stub), os.environ.get("LIBRARY_PATH")])
        )
    sys.path.insert(0, str(site))
    for spec in flashinfer_specs():
        t0 = time.time()
        spec.build(verbose=False)
        dest = out / spec.name
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dest / f"{spec.name}.so")
        log(f"flashinfer: {spec.name} in {time.time() - t0:.0f} s")


def unpack(peers: Path, name: str, dest: Path) -> Path | None:
    """``peers/<name>/`` if it exists, else the first ``peers/<name>-*.tar.xz`` unpacked into
    ``dest``; the folder holding ``<name>/``'s contents, or None if neither is there."""
    folder = peers / name
    if folder.is_dir():
        return folder
    tars = sorted(peers.glob(f"{name}-*.tar.xz"))
    if not tars:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tars[-1]) as tar:
        tar.extractall(dest, filter="data")
    return dest / name


def _flashmla_includes(src: Path) -> list[Path]:
    csrc = src / "csrc"
    # CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which nvcc finds and g++ does not.
    cuda_home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    cccl = [p for p in [cuda_home / "include" / "cccl"] if p.is_dir()]
    return cccl + [csrc, csrc / "api", csrc / "kerutils" / "include", csrc / "sm90",
                   csrc / "cutlass" / "include", csrc / "cutlass" / "tools" / "util" / "include"]  # fmt: skip


def compile_flashmla_objects(src: Path, out: Path, jobs: int, log) -> list[Path]:
    """nvcc FlashMLA's CUDA sources into ``out/<name>.o`` (no GPU and no torch needed), with
    the flags ``torch.utils.cpp_extension`` gives them in :func:`build_flashmla`; the slow part
    of the build (``bf16.cu``, ~90 s), done ahead on any machine with the same nvcc."""
    out.mkdir(parents=True, exist_ok=True)
    inc = [f"-I{p}" for p in _flashmla_includes(src)]
    torch_like = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                  "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                  "--expt-relaxed-constexpr", "--compiler-options", "-fPIC"]  # fmt: skip
    objs = [out / (Path(s).stem + ".o") for s in FLASHMLA_SOURCES]
    t0 = time.time()
    running: list[tuple[Path, subprocess.Popen]] = []
    for s, obj in zip(FLASHMLA_SOURCES, objs):  # at most ``jobs`` nvcc at a time
        while len(running) >= max(1, jobs):
            done, p = running.pop(0)
            if p.wait():
                raise RuntimeError(f"nvcc failed on {done.stem}.cu")
        cmd = ["nvcc", *inc, *torch_like, *FLASHMLA_NVCC, "-c", str(src / s), "-o", str(obj)]
        running.append((obj, subprocess.Popen(cmd)))
    for done, p in running:
        if p.wait():
            raise RuntimeError(f"nvcc failed on {done.stem}.cu")
    (out / "NVCC_VERSION").write_text(subprocess.check_output(["nvcc", "--version"], text=True))
    log(f"flashmla: objects in {out} after {time.time() - t0:.0f} s")
    return objs


def build_flashmla(src: Path, site: Path, jobs: int, log, objects: Path | None = None) -> None:
    """Compile FlashMLA's SM90 dense decode from ``src`` and install ``site/flash_mla``. With
    ``objects`` (a folder from :func:`compile_flashmla_objects`, same nvcc), only the binding is
    compiled here and linked with them."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ["MAX_JOBS"] = str(jobs)
    from torch.utils.cpp_extension import load

    build = Path("/tmp/flashmla_build")
    build.mkdir(parents=True, exist_ok=True)
    binding = build / "dense_decode_api.cpp"
    binding.write_text(FLASHMLA_BINDING)
    objs = [objects.resolve() / (Path(s).stem + ".o") for s in FLASHMLA_SOURCES] if objects else []
    t0 = time.time()
    load(
        name="cuda",  # imported as flash_mla.cuda by FlashMLA's interface
        sources=[str(binding)] + ([] if objs else [str(src / s) for s in FLASHMLA_SOURCES]),
        extra_cflags=FLASHMLA_CXX,
        extra_cuda_cflags=FLASHMLA_NVCC,
        extra_ldflags=[str(o) for o in objs],
        extra_include_paths=[str(p) for p in _flashmla_includes(src)],
        build_directory=str(build),
        with_cuda=True,
        verbose=True,
    )
    log(
        f"flashmla: built in {time.time() - t0:.0f} s"
        + (f" (objects from {objects})" if objs else "")
    )
    pkg = site / "flash_mla"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(src / "flash_mla", pkg)
    shutil.copy2(build / "cuda.so", pkg / "cuda.so")
    (pkg / "BUILD_INFO").write_text(
        f"SM90 dense decode only (bf16), built by tools/build_peers.py from {src}\n"
    )


def install_flashinfer(src: Path, peers: Path, site: Path, log, wheels_too: bool = True) -> None:
    """Copy FlashInfer's package tree to ``site`` and install the carried wheels there (unless
    not ``wheels_too``), with the modules compiled ahead (``peers/flashinfer-aot``)."""
    wheels = sorted((peers / "whl").glob("*.whl")) if wheels_too else []
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site)]
            + [str(w) for w in wheels],
            check=True,
        )  # fmt: skip
    pkg = site / "flashinfer"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(src / "flashinfer", pkg, symlinks=True)
    for info in src.glob("*.dist-info"):
        shutil.copytree(info, site / info.name, dirs_exist_ok=True)
    aot = peers / "flashinfer-aot"
    mods = sorted(p.name for p in aot.iterdir() if p.is_dir()) if aot.is_dir() else []
    if mods:
        shutil.copytree(aot, pkg / "data" / "aot", dirs_exist_ok=True)
    log(f"flashinfer: installed {pkg} (+ {len(wheels)} wheels, {len(mods)} modules compiled ahead)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("peers", type=Path, help="folder with the peer sources (see --help)")
    ap.add_argument("--site", type=Path, default=Path("/tmp/peers_site"))
    ap.add_argument("--logs", type=Path, default=Path("/tmp/peers_logs"))
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--warm", action="store_true", help="JIT-compile FlashInfer's kernels too")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: flashmla,flashinfer")
    ap.add_argument("--objects-only", type=Path, default=None,
                    help="only nvcc FlashMLA's CUDA sources into this folder (no GPU needed)"
                    )  # fmt: skip
    ap.add_argument("--flashinfer-aot-only", type=Path, default=None,
                    help="only compile FlashInfer's modules into this folder (no GPU needed;"
                         " --site must hold an apache-tvm-ffi for this Python)")  # fmt: skip
    a = ap.parse_args(argv)
    a.site.mkdir(parents=True, exist_ok=True)
    a.logs.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    failed = []

    def log(msg: str) -> None:
        print(msg, flush=True)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(a.site), str(REPO)]))
    env.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fi_ws")
    env["MAX_JOBS"] = str(a.jobs)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    procs = {}
    if a.flashinfer_aot_only:
        src = unpack(a.peers, "flashinfer", Path("/tmp/peers_src"))
        if src is None:
            log(f"flashinfer: no flashinfer/ or flashinfer-*.tar.xz in {a.peers}")
            return 1
        install_flashinfer(src if (src / "flashinfer").is_dir() else src.parent, a.peers, a.site,
                           log, wheels_too=False)  # fmt: skip
        build_flashinfer_aot(a.site, a.flashinfer_aot_only.resolve(), log)
        return 0
    if a.objects_only:
        src = unpack(a.peers, "flashmla", Path("/tmp/peers_src"))
        if src is None:
            log(f"flashmla: no flashmla/ or flashmla-*.tar.xz in {a.peers}")
            return 1
        compile_flashmla_objects(src, a.objects_only, a.jobs, log)
        return 0
    if "flashmla" not in skip:
        src = unpack(a.peers, "flashmla", Path("/tmp/peers_src"))
        if src is None:
            log(f"flashmla: no flashmla/ or flashmla-*.tar.xz in {a.peers}")
        else:
            # In a child process, so FlashInfer's install and warm-up run beside its nvcc.
            here = str(Path(__file__).parent)
            # Objects compiled ahead (--objects-only) travel as PEERS_DIR/flashmla-obj/.
            objects = a.peers / "flashmla-obj" if (a.peers / "flashmla-obj").is_dir() else ""
            code = (
                f"import sys; from pathlib import Path; sys.path.insert(0, {here!r})\n"
                "import build_peers as b\n"
                f"b.build_flashmla(Path({str(src)!r}), Path({str(a.site)!r}), {a.jobs}, print,"
                f" {str(objects)!r} and Path({str(objects)!r}))\n"
            )
            out = open(a.logs / "build-flashmla.log", "w")
            procs["flashmla"] = subprocess.Popen(
                [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env
            )
    if "flashinfer" not in skip:
        src = unpack(a.peers, "flashinfer", Path("/tmp/peers_src"))
        if src is None:
            log(f"flashinfer: no flashinfer/ or flashinfer-*.tar.xz in {a.peers}")
        else:
            try:
                install_flashinfer(src if (src / "flashinfer").is_dir() else src.parent,
                                   a.peers, a.site, log)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported, the other steps go on
                log(f"flashinfer: install FAILED: {type(e).__name__}: {e}")
                failed.append("flashinfer")
            if a.warm and "flashinfer" not in failed:
                out = open(a.logs / "build-flashinfer-warm.log", "w")
                procs["flashinfer-warm"] = subprocess.Popen(
                    [sys.executable, "-c",
                     "from benchmarks.bench_peers import warm_flashinfer; warm_flashinfer()"],
                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                )  # fmt: skip
    t0 = time.time()
    for name, p in procs.items():
        rc = p.wait()
        log(f"{name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} at {time.time() - t0:.0f} s"
            f" (log: {a.logs}/build-{name}.log)")  # fmt: skip
        if rc:
            failed.append(name)
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
