#!/usr/bin/env python
"""The full LSE combine's launch rule, chosen on ``bench_peers``'s footing against FlashInfer.

Run from the repository root on a CUDA machine, after ``tools/build_peers.py``:

    python tools/probes/probe_combine_sweep.py compile --jobs 12   # Triton's cache, in parallel
    python tools/probes/probe_combine_sweep.py sweep --out DIR [--baseline OLD_MERGE.py] [--apply]

A rule is ``(tile bytes, warps, partials per tile, columns per tile)``, the four constants of
:func:`cp_modules.kernels.merge.lse_combine_launch_config`; each rule gives one tile per shape.
The shapes and inputs are ``bench_peers``'s combine section (B = 512 tokens, 128 / N heads,
D in {128, 512}, N in {2, 4, 8}, bf16, base-2 LSEs). Every distinct tile is checked and timed
by ``bench_peers.measure`` (the 2x rule against the fp32 reference, then a CUDA-graph replay
with the L2 flushed), in two passes of opposite order; FlashInfer's ``merge_states`` (and
``merge_state`` at N = 2) at the start and the end of each shape in each pass. A rule's score
is its worst ``cp / FlashInfer`` time over the shapes where FlashInfer runs (mean of the
passes; FlashInfer's faster call); ties go to the smaller total time.

``--baseline FILE`` also times that file's ``lse_combine_triton`` at its own default (a copy
of the kernel module before a change), on both footings. The second footing is
``bench_lse_combine``'s: back-to-back launches from one graph cycling over input copies, for
the plain and the packed layout. ``--apply`` writes the best rule's constants into
``cp_modules/kernels/merge.py`` so that the runs after it in the same call use it.
Writes ``DIR/combine-sweep.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from cp_modules.kernels import merge  # noqa: E402

TILES = (4096, 8192, 16384, 32768)
WARPS = (4, 8, 16)
TILE_SPLITS = ((8, 512), (4, 512))  # (partials, columns) per tile at most
SHAPES = [(d, n) for d in (128, 512) for n in (2, 4, 8)]
B, HEADS = 512, 128
CONSTANTS = ("_COMBINE_TILE_BYTES", "_COMBINE_WARPS", "_COMBINE_MAX_N", "_COMBINE_MAX_D")


def rules() -> list[tuple[int, int, int, int]]:
    """Rules whose threads read 16 to 256 bytes of partials each (bf16); 16 warps only for
    the larger tiles."""
    out = []
    for tile, warps in itertools.product(TILES, WARPS):
        if not 16 <= tile // (32 * warps) <= 256:
            continue
        if warps == 16 and tile < 16384:
            continue
        for max_n, max_d in TILE_SPLITS:
            out.append((tile, warps, max_n, max_d))
    return out


def config_for(rule, n: int, d: int, esize: int = 2) -> tuple[int, int, int, int]:
    """The launch config ``rule`` gives: the library's own function with its constants set."""
    saved = [getattr(merge, c) for c in CONSTANTS]
    try:
        for c, v in zip(CONSTANTS, rule):
            setattr(merge, c, v)
        return merge.lse_combine_launch_config.__wrapped__(n, d, esize)
    finally:
        for c, v in zip(CONSTANTS, saved):
            setattr(merge, c, v)


def inputs(d: int, n: int):
    """``bench_peers.run_combine``'s tensors: partials [N, B, H, D] bf16, base-2 LSEs."""
    h = HEADS // n
    g = torch.Generator(device="cuda").manual_seed(2)
    po = torch.randn(n, B, h, d, device="cuda", generator=g).to(torch.bfloat16)
    pl = 4 * torch.randn(n, B, h, device="cuda", generator=g)
    return po, pl


def load_baseline(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("combine_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile_some(jobs: list, baseline: str | None) -> int:
    old = load_baseline(baseline)
    for d, n, cfg in jobs:
        po, pl = inputs(d, n)
        if cfg is None:
            old.lse_combine_triton(po, pl, base2=True)
        else:
            bn, br, bd, w = cfg
            merge.lse_combine_triton(po, pl, base2=True, block_n=bn, block_rows=br,
                                     block_d=bd, num_warps=w)  # fmt: skip
    torch.cuda.synchronize()
    return len(jobs)


def all_jobs(baseline: str | None) -> list:
    jobs = []
    for d, n in SHAPES:
        for cfg in sorted({config_for(r, n, d) for r in rules()}):
            jobs.append((d, n, cfg))
        if baseline:
            jobs.append((d, n, None))
    return jobs


def cmd_compile(a) -> int:
    jobs = all_jobs(a.baseline)
    t0 = time.time()
    chunks = [jobs[i :: a.jobs] for i in range(a.jobs)]
    import multiprocessing as mp

    with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as ex:
        done = sum(ex.map(_compile_some, chunks, [a.baseline] * len(chunks)))
    print(f"compiled {done} combine launches in {time.time() - t0:.0f} s", flush=True)
    return 0


def cmd_sweep(a) -> int:
    from benchmarks import bench_lse_combine as bl
    from benchmarks import bench_peers as bp
    from cp_modules.ops.lse_combine import pack_partials, unpack_partials
    from cp_modules.reference.lse_merge import lse_combine_reference, lse_weights_reference

    bp.add_site()
    versions = bp.peer_versions()
    have_fi = bp.available(versions, "FlashInfer")
    if have_fi:
        import flashinfer
    old = load_baseline(a.baseline)
    t_start = time.time()
    report: dict = {"peers": versions, "gpu": torch.cuda.get_device_name(), "shapes": {}}
    cfgs = {s: sorted({config_for(r, s[1], s[0]) for r in rules()}) for s in SHAPES}
    for d, n in SHAPES:
        po, pl = inputs(d, n)
        h = HEADS // n
        ref = lse_combine_reference(po.float(), pl, base2=True)
        w, _ = lse_weights_reference(pl, base2=True)
        same = (torch.where(w[..., None] > 0, po * w.to(po.dtype)[..., None], 0).sum(0), ref[1])
        work = (n * B * h * d + B * h * d) * 2 + (n + 1) * B * h * 4
        meas = partial(bp.measure, ref=ref, same=same, work=work, lse_ref_base2=True)
        fi_fns = {}
        if have_fi:
            vs, ss = po.permute(1, 0, 2, 3).contiguous(), pl.permute(1, 0, 2).contiguous()
            fi_fns["merge_states"] = partial(flashinfer.merge_states, vs, ss)
            if n == 2:
                fi_fns["merge_state"] = partial(flashinfer.merge_state, po[0].contiguous(),
                                                pl[0].contiguous(), po[1].contiguous(),
                                                pl[1].contiguous())  # fmt: skip
        row: dict = {"fi": {k: [] for k in fi_fns}, "cp": {}, "errors": {}}
        todo = [(f"cp:{c}", c) for c in cfgs[(d, n)]]
        if old is not None:
            todo.append(("baseline", None))
        for p in range(2):
            order = todo if p == 0 else todo[::-1]
            for k, fn in fi_fns.items():
                e = meas(fn)
                row["fi"][k].append(e.get("us"))
                if "us" not in e:
                    row["errors"][f"fi {k}"] = e.get("error", "check failed")
            for name, cfg in order:
                if cfg is None:
                    fn = partial(old.lse_combine_triton, po, pl, base2=True)
                else:
                    bn, br, bd, wp = cfg
                    fn = partial(merge.lse_combine_triton, po, pl, base2=True, block_n=bn,
                                 block_rows=br, block_d=bd, num_warps=wp)  # fmt: skip
                e = meas(fn)
                row["cp"].setdefault(name, []).append(e.get("us"))
                if "us" not in e:
                    row["errors"][name] = e.get("error") or f"check failed {e}"
            for k, fn in fi_fns.items():
                row["fi"][k].append(meas(fn).get("us"))
        report["shapes"][f"D{d}_N{n}"] = row
        print(f"D={d} N={n}: {len(todo)} tiles x 2 passes at {time.time() - t_start:.0f} s; "
              f"FlashInfer {row['fi']}; errors {row['errors']}", flush=True)  # fmt: skip
        for name, us in sorted(row["cp"].items(), key=lambda kv: _fi_mean(kv[1]) or 1e9)[:6]:
            print(f"  {name}: {us}", flush=True)
        if "baseline" in row["cp"]:
            print(f"  baseline: {row['cp']['baseline']}", flush=True)

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return statistics.fmean(xs) if len(xs) == 2 else None

    fi_us = {}
    for key, row in report["shapes"].items():
        means = [m for m in map(_fi_mean, row["fi"].values()) if m is not None]
        fi_us[key] = min(means) if means else None
    scored = []
    for rule in rules():
        times, ratios, ok = {}, {}, True
        for d, n in SHAPES:
            key = f"D{d}_N{n}"
            t = mean(report["shapes"][key]["cp"][f"cp:{config_for(rule, n, d)}"])
            if t is None:
                ok = False
                break
            times[key] = t
            if fi_us[key]:
                ratios[key] = t / fi_us[key]
        if ok:
            worst = max(ratios.values()) if ratios else 0.0
            scored.append({"rule": rule, "worst_ratio": worst, "total_us": sum(times.values()),
                           "ratios": ratios, "us": times})  # fmt: skip
    scored.sort(key=lambda r: (round(r["worst_ratio"], 3), r["total_us"]))
    report["fi_us"] = fi_us
    report["rules"] = scored
    best = scored[0]["rule"]
    report["best_rule"] = dict(zip(CONSTANTS, best))
    if old is not None:
        report["baseline_us"] = {k: mean(r["cp"]["baseline"]) for k, r in report["shapes"].items()}
    print("best 8 rules (tile, warps, max N, max D): worst cp/FI, total us", flush=True)
    for r in scored[:8]:
        print(f"  {r['rule']}: {r['worst_ratio']:.3f} {r['total_us']:.1f}  "
              + " ".join(f"{k}={v:.3f}" for k, v in r["ratios"].items()), flush=True)  # fmt: skip
    print(f"FlashInfer us: {fi_us}", flush=True)
    if old is not None:
        print(f"baseline us: {report['baseline_us']}", flush=True)

    # bench_lse_combine's footing: back-to-back launches cycling over copies (L2 defeated).
    suite = {}
    for d, n in SHAPES:
        h = HEADS // n
        copies = [bl.make_partials(n, d, h, seed=i)
                  for i in range(bl.copies_for(n * B * h * d * 2))]  # fmt: skip
        packed = [unpack_partials(pack_partials(o, lg), h, d) for o, lg in copies]
        bn, br, bd, wp = config_for(best, n, d)
        new = partial(merge.lse_combine_triton, block_n=bn, block_rows=br, block_d=bd,
                      num_warps=wp)  # fmt: skip
        impls = {"new": new} | ({"baseline": old.lse_combine_triton} if old else {})
        for name, f in impls.items():
            suite[f"D{d}_N{n}_{name}_us"] = bl.graph_us([partial(f, o, lg) for o, lg in copies])
            suite[f"D{d}_N{n}_{name}_packed_us"] = bl.graph_us(
                [partial(f, o, lg) for o, lg in packed]
            )
        del copies, packed
    report["suite_footing_us"] = suite
    for k, v in suite.items():
        print(f"suite {k}: {v:.2f}", flush=True)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "combine-sweep.json").write_text(json.dumps(report, indent=1, default=str))
    if a.apply:
        path = REPO / "cp_modules" / "kernels" / "merge.py"
        src = path.read_text()
        for c, v in zip(CONSTANTS, best):
            src = re.sub(rf"^{c} = \d+$", f"{c} = {v}", src, count=1, flags=re.M)
        path.write_text(src)
        print(f"applied {report['best_rule']} to {path}", flush=True)
    print(f"sweep done in {time.time() - t_start:.0f} s", flush=True)
    return 0


def _fi_mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--jobs", type=int, default=12)
    c.add_argument("--baseline", default=None)
    s = sub.add_parser("sweep")
    s.add_argument("--out", required=True)
    s.add_argument("--baseline", default=None)
    s.add_argument("--apply", action="store_true")
    a = ap.parse_args(argv)
    return cmd_compile(a) if a.cmd == "compile" else cmd_sweep(a)


if __name__ == "__main__":
    sys.exit(main())
