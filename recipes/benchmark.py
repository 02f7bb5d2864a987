"""Benchmarks: the kernel scripts under benchmarks/ (CUDA), then generation throughput.

    .venv/bin/python recipes/benchmark.py                      # CPU: generation, 4 ranks vs 1
    .venv/bin/python recipes/benchmark.py backend=cuda parallel=tp4_dcp4 workload/benchmark@workload=gpu
    torchrun --nproc-per-node 4 recipes/benchmark.py backend=cuda workload/benchmark@workload=gpu

Build: the composed config (``conf/benchmark.yaml``). Run: each ``benchmarks/bench_<name>.py``
(or ``benchmarks/<name>.py``) listed in ``workload.kernels`` as a subprocess (they need CUDA and no Hydra; skipped on CPU or
when absent; they write their own dated results), then the generation workload on the
``parallel`` layout and on one process (warm-up, then the best of ``workload.repeats``).
Report: tokens/s, time to first token, KV-cache blocks and peak memory per rank, greedy-token
agreement; written to ``<out_dir>/generation-<hardware>-<date>.json``. Exit status 1 when a
kernel script fails or the generations differ.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys

import hydra
import torch
from omegaconf import DictConfig
from recipe_configs import BenchmarkConf, load_config, register_configs
from recipe_workloads import benchmark_on_rank, compare_outputs, single_process

from cp_modules.engine import launch, under_torchrun

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_kernel_benchmarks(conf: BenchmarkConf, device: str) -> dict[str, str]:
    status = {}
    for name in conf.workload.kernels:
        script = ROOT / "benchmarks" / f"bench_{name}.py"
        if not script.exists() and (ROOT / "benchmarks" / f"{name}.py").exists():
            script = ROOT / "benchmarks" / f"{name}.py"  # e.g. suite.py
        if device != "cuda":
            status[name] = "skipped (needs CUDA)"
        elif not script.exists():
            status[name] = f"skipped ({script.relative_to(ROOT)} not found)"
        elif under_torchrun() and int(os.environ["RANK"]) != 0:
            status[name] = "skipped (rank 0 runs it)"
        else:
            cmd = [sys.executable, str(script), *conf.workload.kernel_args.get(name, [])]
            print("$", " ".join(cmd), flush=True)
            rc = subprocess.run(cmd, cwd=ROOT).returncode
            status[name] = "ok" if rc == 0 else f"failed (exit status {rc})"
        print(f"bench_{name}: {status[name]}")
    return status


def hardware(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu{os.cpu_count()}"


def report(conf: BenchmarkConf, parallel: dict, single: dict) -> None:
    p = conf.parallel
    print(
        f"generation: {conf.model.checkpoint or conf.model.family.value} ({conf.model.dtype}), prompts {conf.workload.prompt_lens}, "
        f"{conf.workload.max_new_tokens} new tokens each"
    )
    print(
        f"{'layout':<34}{'tok/s':>9}{'TTFT ms':>9}{'prefill tok/s':>15}{'decode tok/s':>14}"
        f"{'KV blocks/rank':>16}"
    )
    for label, r in (
        (f"tp={p.tp} pcp={p.pcp} dcp={p.dcp} {p.dcp_comm_backend}", parallel),
        ("one process", single),
    ):
        blocks = max(x["peak_blocks"] for x in r["ranks"])
        print(
            f"{label:<34}{r['tokens_per_s']:>9.1f}{r['ttft_s'] * 1e3:>9.0f}"
            f"{r['prefill_tokens_per_s']:>15.0f}{r['decode_tokens_per_s']:>14.1f}{blocks:>16}"
        )
    mem = [x["peak_memory_bytes"] for x in parallel["ranks"]]
    if mem[0] is not None:
        print(
            f"peak device memory per rank: {max(mem) / 2**30:.2f} GiB "
            f"(one process: {single['ranks'][0]['peak_memory_bytes'] / 2**30:.2f} GiB)"
        )


register_configs()


@hydra.main(config_path="../conf", config_name="benchmark", version_base=None)
def main(cfg: DictConfig) -> None:
    conf = load_config(cfg, BenchmarkConf)
    device, dist_backend = conf.backend.resolve()

    kernels = run_kernel_benchmarks(conf, device)
    failed = [k for k, v in kernels.items() if v.startswith("failed")]
    if not conf.workload.generation:
        sys.exit(1 if failed else 0)
    parallel = launch(
        benchmark_on_rank,
        conf.parallel.world_size,
        conf,
        backend=dist_backend,
        master_addr=conf.backend.master_addr,
        timeout_s=conf.backend.collective_timeout_s,
    )
    if parallel is None:  # a rank other than 0 under torchrun
        return
    single = benchmark_on_rank(0, 1, single_process(conf))

    report(conf, parallel, single)
    mismatch = compare_outputs(parallel.pop("outputs"), single.pop("outputs"))
    print(
        "greedy tokens identical to one process"
        if not mismatch
        else f"MISMATCH in prompts {mismatch}"
    )
    out_dir = pathlib.Path(conf.workload.out_dir)
    if not out_dir.is_absolute():
        out_dir = ROOT / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"generation-{hardware(device)}-{datetime.date.today().isoformat()}.json"
    path.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "hardware": hardware(device),
                "torch": torch.__version__,
                "config": {
                    "parallel": vars(conf.parallel),
                    "model": vars(conf.model),
                    "workload": vars(conf.workload),
                },
                "kernels": kernels,
                "parallel": parallel,
                "single_process": single,
                "identical": not mismatch,
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {path}")
    sys.exit(1 if failed or mismatch else 0)


if __name__ == "__main__":
    main()
