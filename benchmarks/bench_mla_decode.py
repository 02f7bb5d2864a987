#!/usr/bin/env python
"""Absorbed MLA paged decode on one GPU: TFLOP/s of the Triton kernel, its tile variants and the
Gluon two-warp-group kernel.

Run from the repository root on a CUDA machine (no Hydra needed):

    python -m benchmarks.bench_mla_decode            # full sweep, under 5 minutes on an H200
    python -m benchmarks.bench_mla_decode --quick    # three shapes, block size 64
    python -m benchmarks.bench_mla_decode --gluon-only --variants hoist,loader,loader-r232 --budget-s 220
        # the Gluon schedule variants only: the 128-head shapes and 64 heads at B=64 ctx 32k

What it does:
  1. 128 heads (DeepSeek-V3's absorbed decode: 576-wide latent keys, 512-wide values), bf16,
     block sizes 16 and 64, B in {1 (ctx 128k), 8, 64, 256} x ctx in {4k, 32k, 128k} where the
     cache (B * ctx * 576 * 2 bytes) is at most 40 GB. One pool per block size holds the
     largest shape; each shape takes a scrambled block table over it.
  2. 16, 32 and 64 heads (tensor-parallel MLA) at B in {8, 64}, ctx 32k, block size 64.
  Variants: ``triton`` (the shipped kernel with its default tiles), ``triton-N<n>-S<s>-W8[-split]``
  (plain-Triton 64-head tiles on 8 warps, other token tiles and pipeline depths; the two head
  halves of a query are neighbours in the grid and read the same split through L2) and
  ``gluon`` (:mod:`cp_modules.kernels.decode.mla_gluon` with its default schedule; 128
  and 64 heads only) and ``gluon-<name>`` for each schedule named in ``--variants`` (keys of
  ``GLUON_MLA_VARIANTS``: who issues the tile copies, peeled last pair, register split, the
  split merge fused into the kernel, e.g. ``--variants loader-r232-fused,loader-r232-fused16``).
  Every variant is first checked against the fp32 reference on three queries of the batch (the
  2x rule against a same-dtype reference), and its CUDA graph's outputs again after the timed
  replays; a failed check gets no speed. Each variant runs in a
  try block: an error is recorded and the sweep goes on. The Gluon variant runs in a child
  process with a time limit, so a hang or a faulting kernel cannot take the sweep with it.
  Times are CUDA-graph replays (device time). TFLOP/s = 2 * h * ctx * (576 + 512) * B / time.

Results: benchmarks/results/mla-decode-<date>.json ({"date", "gpu", "torch", "triton",
"metrics"}); the summary rows ``paged decode mla TFLOP/s (128 heads) B=<B> ctx=<ctx>`` hold the
best checked variant's rate at the slower of the two block sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from benchmarks.common import RESULTS, write_results
from cp_modules.kernels.decode.mla import paged_mla_attention_kernel
from cp_modules.kernels.decode.paged import DecodeConfig
from cp_modules.reference.paged_decode import paged_mla_attention_ref

DTYPE = torch.bfloat16
RK, ROPE = 512, 64
SCALE = (128 + ROPE) ** -0.5
MAX_CACHE_BYTES = 40e9
SHAPES_128 = [(1, 131072)] + [(b, c) for b in (8, 64, 256) for c in (4096, 32768, 131072)]
QUICK_128 = [(1, 131072), (8, 32768), (64, 4096)]
HEADS_SHAPES = [(8, 32768), (64, 32768)]
TRITON_VARIANTS = {
    "triton": None,  # at 128 heads: N64-S2-W8-split
    "triton-N64-S1-W8-split": DecodeConfig(64, 64, 8, 1, True),
    "triton-N32-S2-W8-split": DecodeConfig(64, 32, 8, 2, True),
    "triton-N32-S3-W8-split": DecodeConfig(64, 32, 8, 3, True),
}
QUICK_TRITON = ("triton", "triton-N32-S2-W8-split")


def cache_bytes(batch: int, ctx: int) -> float:
    return batch * ctx * (RK + ROPE) * 2


def tflops(heads: int, batch: int, ctx: int, ms: float) -> float:
    return 2 * heads * ctx * (RK + ROPE + RK) * batch / ms / 1e9


def make_pool(block_size: int, max_tokens: int, seed: int = 0) -> torch.Tensor:
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = triton.cdiv(max_tokens, block_size) + 1
    pool = torch.empty(num_blocks, block_size, RK + ROPE, dtype=DTYPE, device="cuda")
    return pool.normal_(generator=g)


def make_inputs(pool: torch.Tensor, heads: int, batch: int, ctx: int, seed: int = 0):
    """Queries, a scrambled block table over the pool, and equal lengths (the last query of a
    batch of several one token short, so tiles end mid-block)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bs = pool.shape[1]
    width = triton.cdiv(ctx, bs)
    perm = torch.randperm(pool.shape[0], device="cuda", generator=g)[: batch * width]
    bt = perm.view(batch, width).to(torch.int32)
    q = torch.randn(batch, heads, RK + ROPE, device="cuda", generator=g).to(DTYPE)
    seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    if batch > 1:
        lens[-1] = ctx - 1
    return q, bt, seq, lens


def reference(pool, q, bt, seq, lens):
    idx = torch.tensor(sorted({0, q.shape[0] // 2, q.shape[0] - 1}), device="cuda")
    sub = (q[idx], pool, bt, seq[idx], lens[idx], SCALE, RK)
    return idx, paged_mla_attention_ref(*sub), paged_mla_attention_ref(*sub, upcast=False)


def check(out, lse, ref) -> dict:
    idx, (r_out, r_lse), (s_out, s_lse) = ref
    err_out = (out[idx].float() - r_out.float()).abs().max().item()
    err_lse = (lse[idx] - r_lse).abs().max().item()
    base_out = (s_out.float() - r_out.float()).abs().max().item()
    base_lse = (s_lse - r_lse).abs().max().item()
    ok = math.isfinite(err_out) and err_out <= 2 * base_out + 1e-4
    ok = ok and math.isfinite(err_lse) and err_lse <= 2 * base_lse + 1e-4
    return {"ok": bool(ok), "err_out": err_out, "err_lse": err_lse,
            "same_dtype_err_out": base_out, "same_dtype_err_lse": base_lse}  # fmt: skip


def graph_ms(fn, check_replayed) -> tuple[float, dict]:
    """Median replay time of ``fn`` captured in a CUDA graph, and ``check_replayed`` of the
    graph's outputs after the timed replays (state a kernel carries between launches, such as
    the fused merge's arrival counters, must leave every replay exact)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fn()
    ms = float(do_bench(graph.replay, warmup=5, rep=30, return_mode="median"))
    torch.cuda.synchronize()
    replayed = check_replayed(*got)
    del graph
    return ms, replayed


def run_variant(fn, pool, inputs, ref, heads, batch, ctx) -> dict:
    """Check ``fn`` against the reference, time it, check the replayed outputs again; a rate
    only when both checks pass. Errors are recorded, not raised."""
    try:
        out, lse = fn(pool, *inputs)
        torch.cuda.synchronize()
        entry = {"check": check(out, lse, ref)}
        if entry["check"]["ok"]:
            ms, replayed = graph_ms(lambda: fn(pool, *inputs), lambda o, s: check(o, s, ref))
            entry["check_replayed"] = replayed
            if replayed["ok"]:
                entry.update(graph_ms=ms, tflops=tflops(heads, batch, ctx, ms))
        return entry
    except Exception as e:  # noqa: BLE001 - the sweep records every failure and goes on
        return {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}


def triton_fn(config):
    def fn(pool, q, bt, seq, lens):
        return paged_mla_attention_kernel(q, pool, bt, seq, lens, SCALE, RK, None, config=config)

    return fn


def gluon_fn(pool, q, bt, seq, lens):
    from cp_modules.kernels.decode.mla_gluon import paged_mla_attention_gluon

    return paged_mla_attention_gluon(q, pool, bt, seq, lens, SCALE, RK)


def gluon_variant_fn(name: str):
    """The Gluon kernel with the schedule ``GLUON_MLA_VARIANTS[name]``."""

    def fn(pool, q, bt, seq, lens):
        from cp_modules.kernels.decode.mla_gluon import (
            GLUON_MLA_VARIANTS,
            paged_mla_attention_gluon,
        )

        config = GLUON_MLA_VARIANTS[name]
        return paged_mla_attention_gluon(q, pool, bt, seq, lens, SCALE, RK, config=config)

    return fn


def gluon_variants(names: list[str]) -> dict:
    """{"gluon": the default schedule (name ``default``), "gluon-<name>": a named schedule}."""
    return {
        "gluon" if n == "default" else f"gluon-{n}": gluon_fn
        if n == "default"
        else gluon_variant_fn(n)
        for n in names
    }


def plan(quick: bool, gluon_only: bool = False) -> list[tuple[int, int, int, int]]:
    """(heads, block size, B, ctx) rows in run order (``gluon_only``: the 128-head shapes and
    64 heads at B = 64, ctx 32k)."""
    rows = []
    if gluon_only:
        # Both block sizes of a shape side by side (a short budget cuts whole shapes).
        rows = [(128, bs, b, c) for b, c in SHAPES_128 for bs in (16, 64)
                if cache_bytes(b, c) <= MAX_CACHE_BYTES]  # fmt: skip
        return rows + [(64, 64, 64, 32768)]
    for bs in (64,) if quick else (16, 64):
        for b, c in QUICK_128 if quick else SHAPES_128:
            if cache_bytes(b, c) <= MAX_CACHE_BYTES:
                rows.append((128, bs, b, c))
    if not quick:
        rows += [(h, 64, b, c) for h in (16, 32, 64) for b, c in HEADS_SHAPES]
    return rows


def sweep(variants: dict, rows, budget_s: float, log) -> list[dict]:
    """Run ``variants`` ({name: fn}) over ``rows``; one pool per block size (kept while the
    rows alternate between block sizes)."""
    results, pools, t0 = [], {}, time.monotonic()
    for heads, bs, b, c in rows:
        row = {"heads": heads, "block_size": bs, "batch": b, "ctx": c, "variants": {}}
        results.append(row)
        if time.monotonic() - t0 > budget_s:
            row["skipped"] = "time budget"
            continue
        try:
            if bs not in pools:
                # Keep only the pools that rows still ahead use.
                ahead = {s for _, s, _, _ in rows[len(results) - 1 :]}
                pool = None
                for k in [k for k in pools if k not in ahead]:
                    del pools[k]
                need = max(bb * cc for h, s, bb, cc in rows if s == bs)
                pools[bs] = make_pool(bs, need)
            pool = pools[bs]
            inputs = make_inputs(pool, heads, b, c)
            ref = reference(pool, *inputs)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            continue
        for name, fn in variants.items():
            if name.startswith("gluon") and heads % 64:
                continue
            entry = run_variant(fn, pool, inputs, ref, heads, b, c)
            row["variants"][name] = entry
            rate = f"{entry['tflops']:.0f} TFLOP/s" if "tflops" in entry else "-"
            status = entry.get("error") or _check_status(entry)
            log(f"h={heads:3d} bs={bs:2d} B={b:3d} ctx={c:6d} {name:24s} {rate:>14s}  {status}")
    return results


def _check_status(entry: dict) -> str:
    if not entry.get("check", {}).get("ok"):
        return "CHECK FAILED"
    return "ok" if entry.get("check_replayed", {}).get("ok") else "CHECK FAILED after replay"


def run_gluon_child(rows, budget_s: float, timeout_s: float, names=()) -> list[dict] | str:
    """The Gluon variants' rows from a child process, or why there are none."""
    cmd = [sys.executable, "-m", "benchmarks.bench_mla_decode", "--child-gluon",
           json.dumps(rows), "--budget-s", str(budget_s), "--variants", ",".join(names)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        sys.stderr.write((e.stderr or b"").decode(errors="replace")[-2000:] if e.stderr else "")
        return f"timed out after {timeout_s:.0f} s (a hang or a slow compile)"
    sys.stderr.write(done.stderr[-4000:])
    for line in done.stdout.splitlines():
        if line.startswith("GLUON_ROWS "):
            return json.loads(line[len("GLUON_ROWS ") :])
    return f"child exited {done.returncode} without results: {done.stderr.strip()[-500:]}"


def summarize(rows: list[dict]) -> dict:
    """Per (heads, B, ctx): the best checked variant per block size; the reported rate is the
    slower block size's best (the goal holds for both)."""
    best: dict[tuple[int, int, int], dict[int, tuple[float, str]]] = {}
    for r in rows:
        for name, e in r["variants"].items():
            if "tflops" in e:
                per_bs = best.setdefault((r["heads"], r["batch"], r["ctx"]), {})
                if e["tflops"] > per_bs.get(r["block_size"], (0.0, ""))[0]:
                    per_bs[r["block_size"]] = (e["tflops"], name)
    summary = {}
    for (h, b, c), per_bs in sorted(best.items()):
        rate, name = min(per_bs.values())
        summary[f"paged decode mla TFLOP/s ({h} heads) B={b} ctx={c}"] = {
            "value": rate, "variant": name, "block_sizes": sorted(per_bs),
            "per_block_size": {str(k): {"tflops": v[0], "variant": v[1]} for k, v in per_bs.items()},
        }  # fmt: skip
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three shapes, block size 64")
    parser.add_argument("--no-gluon", action="store_true", help="skip the Gluon kernel")
    parser.add_argument("--budget-s", type=float, default=140.0,
                        help="wall-clock budget per sweep (Triton, Gluon); later rows skipped")  # fmt: skip
    parser.add_argument("--variants", default="",
                        help="comma-separated Gluon schedules (GLUON_MLA_VARIANTS keys) timed "
                             "next to the default one as gluon-<name>")  # fmt: skip
    parser.add_argument("--gluon-only", action="store_true",
                        help="no Triton variants; the 128-head shapes and one 64-head shape")  # fmt: skip
    parser.add_argument("--child-gluon", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    names = [n for n in args.variants.split(",") if n]
    if args.child_gluon is not None:
        rows = [tuple(r) for r in json.loads(args.child_gluon)]
        log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
        got = sweep(gluon_variants(names or ["default"]), rows, args.budget_s, log)
        print("GLUON_ROWS " + json.dumps(got, default=str))
        return 0
    from cp_modules.kernels.decode.mla_gluon import GLUON_MLA_VARIANTS

    unknown = [n for n in names if n not in GLUON_MLA_VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {unknown}; known: {sorted(GLUON_MLA_VARIANTS)}")

    rows = plan(args.quick, args.gluon_only)
    start = time.monotonic()
    gluon_rows: list[dict] | str = "skipped (--no-gluon)"
    gluon_status: dict[str, str] = {}
    if not args.no_gluon:
        # One child process per schedule: a hang or a fault costs that schedule's rows only.
        share = (1.0 if args.gluon_only else 0.7) * args.budget_s / (1 + len(names))
        gluon_rows = [{"variants": {}} for _ in rows]
        for name in ["default", *names]:
            print(f"Gluon kernel, schedule {name} (child process)...", flush=True)
            got = run_gluon_child(rows, share, timeout_s=share + 60, names=[name])
            gluon_status[name] = got if isinstance(got, str) else "ran"
            if isinstance(got, str):
                print(f"  gluon {name}: {got}", flush=True)
                continue
            for merged, r in zip(gluon_rows, got):
                merged["variants"].update(r["variants"])
                status = r.get("skipped") or r.get("error")
                if status:
                    merged.setdefault("status", {})[name] = status
                if r["heads"] % 64:
                    continue
                for vname, e in r["variants"].items() if not status else [(name, {})]:
                    rate = f"{e['tflops']:.0f} TFLOP/s" if "tflops" in e else "-"
                    st = status or e.get("error")
                    st = st or _check_status(e)
                    print(f"  h={r['heads']:3d} bs={r['block_size']:2d} B={r['batch']:3d} "
                          f"ctx={r['ctx']:6d} {vname:20s} {rate:>14s}  {st}", flush=True)  # fmt: skip
    names = () if args.gluon_only else QUICK_TRITON if args.quick else tuple(TRITON_VARIANTS)
    variants = {n: triton_fn(TRITON_VARIANTS[n]) for n in names}
    if variants:
        results = sweep(variants, rows, args.budget_s, lambda s: print(s, flush=True))
    else:
        results = [{"heads": h, "block_size": bs, "batch": b, "ctx": c, "variants": {}}
                   for h, bs, b, c in rows]  # fmt: skip
    if not isinstance(gluon_rows, str):
        for r, g in zip(results, gluon_rows):
            r["variants"].update(g["variants"])
            if "status" in g:
                r["gluon_status"] = g["status"]
    summary = summarize(results)
    print()
    for name, s in summary.items():
        print(f"{name}: {s['value']:.0f} ({s['variant']}, block sizes {s['block_sizes']})")
    metrics = {"rows": results, "summary": summary,
               "gluon": gluon_rows if isinstance(gluon_rows, str) else gluon_status,
               "wall_s": time.monotonic() - start}  # fmt: skip
    metrics["gluon_variants"] = {
        n: repr(GLUON_MLA_VARIANTS[n]) for n in args.variants.split(",") if n
    }
    kind = "-quick" if args.quick else "-gluon" if args.gluon_only else ""
    path = write_results("mla-decode" + kind, metrics, Path(args.out))
    print(f"wrote {path} ({metrics['wall_s']:.0f} s)")
    failed = [f"{r['heads']}/{r['block_size']}/{r['batch']}/{r['ctx']} {n}"
              for r in results for n, e in r["variants"].items()
              if False in (e.get("check", {}).get("ok"),
                           e.get("check_replayed", {}).get("ok"))]  # fmt: skip
    if failed:
        print("CHECK FAILED: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
