#!/usr/bin/env python
"""The full LSE combine's tiles swept on ``bench_peers``'s footing, beside FlashInfer's merge.

Run from the repository root on a CUDA machine (after ``tools/build_peers.py`` to have
FlashInfer; without it only this project's kernel is timed):

    python tools/probes/probe_combine_tiles.py [--jobs 12] [--passes 2] [--budget-s 300]
    python tools/probes/probe_combine_tiles.py --dry   # CPU (TRITON_INTERPRET=1): checks only

The kernel is ``cp_modules.kernels.merge.lse_combine_triton`` (what ``cp::lse_combine`` runs),
with the three launch parameters it takes: rows a program (``block_rows``), columns a program
(``block_d``) and ``num_warps``. The grid, for each D: rows {1 .. 64}, columns {D, D/2, D/4}
(at least 32) and warps {1, 2, 4, 8}, keeping the tiles of 4 to 64 elements a thread. The
default launch config (``lse_combine_tile``) is timed as ``default``, and the public
op as bench_peers calls it as ``op``.

The shapes and inputs are bench_peers' combine section (``bench_peers.combine_case``: B = 512
tokens, 128 / N heads, D in {128, 512}, N in {2, 4, 8}, bf16, base-2 LSEs). Each tile is first
checked against the fp32 reference by the 2x rule (``bench_peers.compare``); a tile that fails
is recorded and not timed. Then every checked tile is timed as a CUDA-graph replay
(``graph_replay_us``: median of ``do_bench``, L2 flushed), in ``--passes`` passes over all the
shapes, every other pass in the opposite order. FlashInfer's ``merge_states`` (and
``merge_state`` at N = 2) is checked and timed at the start and the end of each shape in each
pass. Before the first pass the tiles are compiled into Triton's cache by ``--jobs`` processes.

The summary gives, for each shape, FlashInfer's time (its faster call, the mean of its
measurements), the default's and the fastest tiles' (mean of the passes), each with its
``cp / FlashInfer`` ratio. The launch config depends on D only (not on N), so it also ranks, for
each D, the tiles by their worst ratio over the three N. Nothing is applied to the kernel.

Writes ``OUT/combine-tiles-<date>.json`` after the checks and after every pass (date, GPU,
torch, triton, the peers' versions, the grid, every measurement and the summary) and prints
the summary. ``--dry`` (which sets
``TRITON_INTERPRET=1``) runs the kernel on the CPU on a few tokens and a few tiles a shape:
the grid, the checks, the passes and the summary are exercised, with the wall time of one
interpreted call in place of a GPU time (``combine-tiles-dry-<date>.json``; it means nothing).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ROWS = (1, 2, 4, 8, 16, 32, 64)
WARPS = (1, 2, 4, 8)
COL_SPLITS = (1, 2, 4)  # block_d = D / split, at least MIN_COLS
MIN_COLS = 32
ELEMS_PER_THREAD = (4, 64)


def tiles(d: int) -> list[tuple[int, int, int]]:
    """``(block_rows, block_d, num_warps)`` of the grid for a head dim ``d`` (a power of 2)."""
    out = []
    for split, rows, warps in itertools.product(COL_SPLITS, ROWS, WARPS):
        cols = d // split
        if cols < MIN_COLS:
            continue
        per_thread = rows * cols / (32 * warps)
        if ELEMS_PER_THREAD[0] <= per_thread <= ELEMS_PER_THREAD[1]:
            out.append((rows, cols, warps))
    return out


def name_of(cfg: tuple[int, int, int]) -> str:
    return "r{}_d{}_w{}".format(*cfg)


def parse_name(name: str) -> tuple[int, int, int]:
    r, d, w = name.split("_")
    return int(r[1:]), int(d[1:]), int(w[1:])


def shapes() -> list[tuple[int, int]]:
    from benchmarks.bench_peers import COMBINE_DIMS, COMBINE_NS

    return [(d, n) for d in COMBINE_DIMS for n in COMBINE_NS]


def plan(dry: bool, dry_tiles: int) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """The tiles of each shape; in a dry run the default and ``dry_tiles`` spread over the grid."""
    from cp_modules.kernels.merge import lse_combine_tile

    out = {}
    for d, n in shapes():
        grid = tiles(d)
        if dry:
            step = max(1, len(grid) // max(1, dry_tiles))
            grid = grid[::step][:dry_tiles]
        default = lse_combine_tile(d, 2)
        out[(d, n)] = sorted(set(grid) | {default})
    return out


# ---------------------------------------------------------------------------------------------
# Calls, checks and timing


def cp_call(po, pl, cfg):
    from cp_modules.kernels.merge import lse_combine_triton

    rows, cols, warps = cfg
    return partial(lse_combine_triton, po, pl, base2=True, block_rows=rows, block_d=cols,
                   num_warps=warps)  # fmt: skip


def peer_calls(po, pl, n: int) -> dict:
    """FlashInfer's merges in their own layout ([B, N, H, D]); copies made here, not timed."""
    import flashinfer

    vs, ss = po.permute(1, 0, 2, 3).contiguous(), pl.permute(1, 0, 2).contiguous()
    calls = {"merge_states": partial(flashinfer.merge_states, vs, ss)}
    if n == 2:
        calls["merge_state"] = partial(flashinfer.merge_state, po[0].contiguous(),
                                       pl[0].contiguous(), po[1].contiguous(),
                                       pl[1].contiguous())  # fmt: skip
    return calls


def check(fn, ref, same) -> dict:
    """The 2x rule on ``fn()``'s (out, lse); errors are recorded, not raised."""
    import torch

    from benchmarks import bench_peers as bp

    try:
        out, lse = fn()
        if out.is_cuda:
            torch.cuda.synchronize()
        return bp.compare(out, lse, ref, same, lse_ref_base2=True)
    except Exception as e:  # noqa: BLE001 - every failure is recorded and the sweep goes on
        if torch.cuda.is_available():
            bp._clear_cuda_error()
        return {"ok": False, "error": bp._first_line(e)}


def timed(fn) -> float | None:
    import torch

    from benchmarks import bench_peers as bp
    from benchmarks.common import graph_replay_us

    try:
        return graph_replay_us(fn)
    except Exception:  # noqa: BLE001 - recorded as a missing time
        if torch.cuda.is_available():
            bp._clear_cuda_error()
        return None


def wall_us(fn) -> float:
    """A dry run's stand-in for :func:`timed`: the wall time of one interpreted call (it only
    exercises the passes and the summary; it measures nothing about a GPU)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def _compile_some(jobs: list, case_kw: dict) -> int:
    """Run each ``(d, n, cfg)`` once on the shape's inputs, filling Triton's cache."""
    import torch

    from benchmarks.bench_peers import combine_case

    for d, n, cfg in jobs:
        po, pl, *_ = combine_case(d, n, **case_kw)
        try:
            cp_call(po, pl, cfg)()
        except Exception:  # noqa: BLE001, S112 - the main process records the error
            continue
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(jobs)


def compile_all(todo: dict, jobs: int, log, **case_kw) -> None:
    """Fill Triton's cache with every tile of ``todo`` from ``jobs`` processes (spawned)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    work = [(d, n, c) for (d, n), cfgs in todo.items() for c in cfgs]
    t0 = time.time()
    chunks = [work[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        done = sum(ex.map(_compile_some, chunks, [case_kw] * jobs))
    log(f"compiled {done} combine launches with {jobs} processes in {time.time() - t0:.0f} s")


# ---------------------------------------------------------------------------------------------
# Summary


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarize(report: dict, top: int = 5) -> dict:
    """Per shape: FlashInfer's time, the default's, the fastest tiles' and their ratios; per D:
    the tiles ranked by their worst ``cp / FlashInfer`` ratio over the N (ties: total time)."""
    per_shape, by_d = {}, {}
    for key, row in report["shapes"].items():
        fi = {k: _mean(v) for k, v in row["peer_us"].items()}
        fi = {k: v for k, v in fi.items() if v is not None}
        fi_best = min(fi.items(), key=lambda kv: kv[1]) if fi else None
        cp = {k: _mean(v) for k, v in row["cp_us"].items()}
        cp = {k: v for k, v in cp.items() if v is not None}
        ranked = sorted(cp.items(), key=lambda kv: kv[1])

        def ratio(us, fi_best=fi_best):
            return us / fi_best[1] if fi_best and us is not None else None

        tiles_ranked = [(k, v) for k, v in ranked if k not in ("default", "op")]
        per_shape[key] = {
            "d": row["d"], "n": row["n"],
            "peer": {"call": fi_best[0], "us": fi_best[1]} if fi_best else None,
            "default": {"tile": row["default_tile"], "us": cp.get("default"),
                        "ratio": ratio(cp.get("default"))},
            "op": {"us": cp.get("op"), "ratio": ratio(cp.get("op"))},
            "fastest": [{"tile": k, "us": v, "ratio": ratio(v)} for k, v in tiles_ranked[:top]],
        }  # fmt: skip
        by_d.setdefault(row["d"], {})[row["n"]] = (cp, fi_best[1] if fi_best else None)
    common = {}
    for d, per_n in by_d.items():
        names = set.intersection(*(set(cp) for cp, _ in per_n.values())) - {"default", "op"}
        scored = []
        for name in names:
            us = {n: per_n[n][0][name] for n in per_n}
            ratios = {n: us[n] / fi for n, (_, fi) in per_n.items() if fi}
            worst = max(ratios.values()) if ratios else None
            scored.append({"tile": name, "worst_ratio": worst, "total_us": sum(us.values()),
                           "us": us, "ratios": ratios})  # fmt: skip
        scored.sort(key=lambda s: (s["worst_ratio"] is None, round(s["worst_ratio"] or 0, 3),
                                   s["total_us"]))  # fmt: skip
        common[d] = scored[:top]
    return {"per_shape": per_shape, "same_tile_for_every_n": common}


def print_summary(summary: dict, log) -> None:
    def r(x):
        return "-" if x is None else f"{x:.3f}"

    for key, s in summary["per_shape"].items():
        peer = s["peer"]
        fi = "-" if not peer else "{:.2f} us ({})".format(peer["us"], peer["call"])
        log(f"{key}: FlashInfer {fi}; "
            f"default {name_of(s['default']['tile'])} {s['default']['us']} us ratio "
            f"{r(s['default']['ratio'])}; op ratio {r(s['op']['ratio'])}")  # fmt: skip
        for f in s["fastest"]:
            log(f"    {f['tile']:14s} {f['us']:.2f} us  ratio {r(f['ratio'])}")
    for d, scored in summary["same_tile_for_every_n"].items():
        log(f"D={d}, one tile for every N (worst ratio, total us):")
        for s in scored:
            log(f"    {s['tile']:14s} {r(s['worst_ratio'])}  {s['total_us']:.2f}  "
                + " ".join(f"N={n}:{r(v)}" for n, v in s["ratios"].items()))  # fmt: skip


# ---------------------------------------------------------------------------------------------


def save(report: dict, out: str) -> Path:
    """Write the report (with its summary so far) to ``out/combine-tiles[-dry]-<date>.json``."""
    report["summary"] = summarize(report)
    path = Path(out) / f"combine-tiles{'-dry' if report['dry'] else ''}-{report['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    return path


def run(a) -> dict:
    import torch
    import triton

    from benchmarks import bench_peers as bp

    def log(msg: str) -> None:
        print(msg, flush=True)

    device = "cpu" if a.dry else "cuda"
    batch = a.dry_batch if a.dry else bp.COMBINE_B
    dtype = torch.float16 if a.dry else bp.DTYPE  # the interpreter has no bf16
    bp.add_site(a.site)
    versions = bp.peer_versions() if not a.dry else {}
    have_fi = (not a.dry) and bp.available(versions, "FlashInfer")
    todo = plan(a.dry, a.dry_tiles)
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "peers": versions, "dry": a.dry, "batch": batch,
        "dtype": str(dtype), "grid": {"rows": ROWS, "warps": WARPS, "col_splits": COL_SPLITS,
                                      "elems_per_thread": ELEMS_PER_THREAD},
        "passes": a.passes, "shapes": {}, "skipped": [],
    }  # fmt: skip
    log(f"peers: {versions}; {sum(map(len, todo.values()))} tiles over {len(todo)} shapes")
    jobs = a.jobs if a.jobs is not None else (1 if a.dry else 12)
    if jobs > 1:
        compile_all(todo, jobs, log, batch=batch, device=device, dtype=dtype)
    t0 = time.monotonic()
    cases = {}
    for (d, n), cfgs in todo.items():
        po, pl, ref, same, work = bp.combine_case(d, n, batch=batch, device=device, dtype=dtype)
        from cp_modules.kernels.merge import lse_combine_tile
        from cp_modules.ops.lse_combine import lse_combine

        calls = {name_of(c): cp_call(po, pl, c) for c in cfgs}
        calls["default"] = cp_call(po, pl, lse_combine_tile(d, po.element_size()))
        calls["op"] = partial(lse_combine, po, pl, return_lse=True, base="2")
        peers = peer_calls(po, pl, n) if have_fi else {}
        row = {"d": d, "n": n, "heads": bp.COMBINE_HEADS // n, "bytes": work,
               "default_tile": lse_combine_tile(d, po.element_size()),
               "checks": {}, "peer_checks": {}, "cp_us": {}, "peer_us": {}}  # fmt: skip
        for name, fn in calls.items():
            row["checks"][name] = check(fn, ref, same)
        for name, fn in peers.items():
            row["peer_checks"][name] = check(fn, ref, same)
        bad = {k: v for k, v in row["checks"].items() if not v["ok"]}
        log(f"D={d} N={n}: {len(calls) - len(bad)}/{len(calls)} checked"
            + (f"; FAILED {sorted(bad)}" if bad else "")
            + "".join(f"; FlashInfer {k} {'ok' if v['ok'] else v.get('error', 'check failed')}"
                      for k, v in row["peer_checks"].items()))  # fmt: skip
        ok_calls = {k: fn for k, fn in calls.items() if row["checks"][k]["ok"]}
        ok_peers = {k: fn for k, fn in peers.items() if row["peer_checks"][k]["ok"]}
        cases[(d, n)] = (ok_calls, ok_peers)
        report["shapes"][f"D{d}_N{n}"] = row
    save(report, a.out)  # the checks, before any time
    timer = wall_us if a.dry else timed
    for p in range(a.passes):
        order = list(cases) if p % 2 == 0 else list(cases)[::-1]
        for d, n in order:
            row = report["shapes"][f"D{d}_N{n}"]
            if time.monotonic() - t0 > a.budget_s:
                report["skipped"].append(f"pass {p} D={d} N={n}: time budget")
                continue
            ok_calls, ok_peers = cases[(d, n)]
            names = list(ok_calls) if p % 2 == 0 else list(ok_calls)[::-1]
            for k, fn in ok_peers.items():
                row["peer_us"].setdefault(k, []).append(timer(fn))
            for k in names:
                row["cp_us"].setdefault(k, []).append(timer(ok_calls[k]))
            for k, fn in ok_peers.items():
                row["peer_us"].setdefault(k, []).append(timer(fn))
            log(f"pass {p} D={d} N={n}: {len(names)} tiles at {time.monotonic() - t0:.0f} s")
        save(report, a.out)  # after every pass, so that a run cut short leaves its times
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--site", default=None, help="peers' install folder (default $CP_PEERS_SITE)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes compiling the tiles first (default 12; 1 with --dry)",
    )
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="no shape's pass starts after this many seconds past the compile")  # fmt: skip
    ap.add_argument(
        "--dry",
        action="store_true",
        help="CPU, TRITON_INTERPRET=1: check a few tiles on a few tokens (wall times only)",
    )
    ap.add_argument("--dry-batch", type=int, default=2)
    ap.add_argument("--dry-tiles", type=int, default=3)
    a = ap.parse_args(argv)
    if a.passes < 1:
        raise SystemExit(f"--passes must be at least 1, got {a.passes}")
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit decorates the kernels
    import torch

    if not a.dry and not torch.cuda.is_available():
        print("probe_combine_tiles: skipped: no CUDA device (--dry checks on the CPU)")
        return 0
    report = run(a)
    path = save(report, a.out)
    print_summary(report["summary"], print)
    bad = [f"{k} {t}" for k, r in report["shapes"].items() for t, c in r["checks"].items()
           if not c["ok"]]  # fmt: skip
    print(f"wrote {path}; {len(bad)} failed checks" + (f": {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
