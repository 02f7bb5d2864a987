#!/usr/bin/env python
"""bf16 GQA paged decode: tiles, split counts and the block-table-ahead loop, beside FlashInfer.

On ``bench_peers``' GQA shapes (Llama-3-8B 32/8 and Qwen2.5-7B 28/4 heads, D=128, 64-token
blocks; B=1 and 8 at 128k, 64 at 16k, 256 at 4k), this project's ``paged_attention_kernel``
with a few launch variants (:func:`variants`: KV splits around the default count and
``BF16_BT_AHEAD``, the block-table entries one tile ahead, where the KV range is split; a few
tiles where it is not) is checked by ``bench_peers``' 2x rule against the fp32 reference, then timed as a CUDA-graph
replay (medians), in two passes of opposite order; FlashInfer's batch decode (CUDA cores and
tensor cores, the better one) is checked and timed at each shape's start and end in each pass.

    CP_PEERS_SKIP=flashmla bash tools/run_with_peers.sh \\
        python3 tools/probes/probe_gqa_decode_tiles.py --out "$OUT" [--budget-s 240]

Writes ``gqa-decode-tiles-<date>.json`` (date, GPU, versions, every time, a per-shape ranking).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import triton

# Unsplit shapes (B * Hkv programs fill the SMs): these tiles at one and two splits.
UNSPLIT_TILES = ((128, 8, 2), (64, 4, 3), (128, 4, 3), (64, 8, 2))
SPLIT_FACTORS = (0.5, 1, 2, 4)


def variants(b: int, hkv: int, group: int, ctx: int) -> list[dict]:
    """Launch variants of one shape (each a compile of its own: kept few). Split shapes: the
    default tile at the default split count times 1/2, 1, 2, 4, each with and without the
    block-table-ahead loop; unsplit shapes: a few tiles at one and two splits."""
    from cp_modules.kernels.decode.paged import DecodeConfig, choose_num_splits, default_config
    from cp_modules.kernels.decode.tiles import _num_sms

    base = choose_num_splits(b * hkv, ctx, _num_sms(torch.device("cuda")))
    out = []
    if base > 1:
        d = default_config(group, 128, 128, 0)
        grid = [(d, n) for n in sorted({max(2, min(64, round(base * f))) for f in SPLIT_FACTORS})]
    else:
        h = default_config(group, 128, 128, 0).block_h
        grid = [(DecodeConfig(h, bn, w, st), n) for bn, w, st in UNSPLIT_TILES for n in (1, 2)]
    for cfg, n in grid:
        for ahead in (False, True) if cfg.num_stages >= 3 else (False,):
            name = f"n{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}_x{n}"
            out.append({"name": name + ("_ahead" if ahead else ""), "config": cfg,
                        "splits": n, "ahead": ahead})  # fmt: skip
    return out


def _run(v: dict, args: tuple, scale: float):
    from cp_modules.kernels.decode import paged

    paged.BF16_BT_AHEAD = v["ahead"]
    return paged.paged_attention_kernel(*args, scale, v["splits"], config=v["config"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--passes", type=int, default=2)
    a = ap.parse_args()
    from benchmarks import bench_peers as bp
    from benchmarks.common import graph_replay_us
    from cp_modules.kernels.decode import paged
    from cp_modules.ops.paged_decode import paged_attention
    from cp_modules.reference.paged_decode import paged_attention_ref

    t0 = time.monotonic()
    bp.add_site(None)
    versions = bp.peer_versions()
    has_fi = bp.available(versions, "FlashInfer")
    workspace = torch.zeros(bp.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "peers": versions,
        "shapes": {},
        "skipped": [],
    }
    out = Path(a.out) / f"gqa-decode-tiles-{report['date']}.json"
    cases = []
    for model, hq, hkv in bp.GQA_MODELS:
        g = torch.Generator(device="cuda").manual_seed(1)
        num_blocks = triton.cdiv(max(b * c for b, c in bp.GQA_SHAPES), bp.GQA_BS) + 1
        k = torch.empty(num_blocks, bp.GQA_BS, hkv, bp.GQA_D, dtype=bp.DTYPE, device="cuda")
        v = torch.empty_like(k)
        k.normal_(generator=g), v.normal_(generator=g)
        for b, c in bp.GQA_SHAPES:
            bt, seq, lens = bp._paged_inputs(num_blocks, bp.GQA_BS, b, c, g)
            q = torch.randn(b, hq, bp.GQA_D, device="cuda", generator=g).to(bp.DTYPE)
            idx = torch.tensor(sorted({0, b // 2, b - 1}), device="cuda")
            sub = (q[idx], k, v, bt, seq[idx], lens[idx], bp.GQA_D**-0.5)
            ref = paged_attention_ref(*sub)
            same = paged_attention_ref(*sub, upcast=False)
            work = float(lens.sum().item()) * hkv * bp.GQA_D * 2 * 2
            key = f"{model} B={b} ctx={c}"
            args = (q, k, v, bt, seq, lens)
            shape = {"bytes": work, "checks": {}, "times": {}}
            report["shapes"][key] = shape
            fns = {"default": partial(paged_attention, *args, scale=bp.GQA_D**-0.5)}
            for var in variants(b, hkv, hq // hkv, c):
                fns[var["name"]] = partial(_run, var, args, bp.GQA_D**-0.5)
            if has_fi:
                for name, tc in (("FlashInfer-cuda-cores", False), ("FlashInfer-tc", True)):
                    try:
                        fns[name] = bp._flashinfer_gqa_fn(tc, k, v, q, bt, lens, workspace, hkv)
                    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                        shape["checks"][name] = {"error": bp._first_line(e)}
            for name, fn in fns.items():
                if time.monotonic() - t0 > a.budget_s / 2:
                    shape["checks"][name] = {"error": "time budget (checks and compiles)"}
                    continue
                try:
                    o, lse = fn()
                    shape["checks"][name] = bp.compare(o[idx], lse[idx], ref, same)
                except Exception as e:  # noqa: BLE001
                    bp._clear_cuda_error()
                    shape["checks"][name] = {"error": bp._first_line(e)}
            paged.BF16_BT_AHEAD = False
            ok = [n for n, r in shape["checks"].items() if r.get("ok")]
            print(f"{key}: {len(ok)}/{len(fns)} checked", flush=True)
            cases.append((key, {n: fns[n] for n in ok}, work))
    for p in range(a.passes):
        for key, fns, _bytes in cases if p % 2 == 0 else cases[::-1]:
            if time.monotonic() - t0 > a.budget_s:
                report["skipped"].append(f"pass {p} {key}: time budget")
                continue
            times = report["shapes"][key]["times"]
            names = list(fns) if p % 2 == 0 else list(fns)[::-1]
            for name in names:
                times.setdefault(name, []).append(graph_replay_us(fns[name]))
            paged.BF16_BT_AHEAD = False
        _summarize(report)
        out.write_text(json.dumps(report, indent=1, default=str))
        print(f"pass {p} done at {time.monotonic() - t0:.0f} s", flush=True)
    for key, s in report["shapes"].items():
        print(key, json.dumps(s.get("summary")), flush=True)
    print(f"wrote {out}", flush=True)


def _summarize(report: dict) -> None:
    for s in report["shapes"].values():
        med = {n: statistics.median(t) for n, t in s["times"].items()}
        fi = [med[n] for n in med if n.startswith("FlashInfer")]
        peer = min(fi) if fi else None
        ranked = sorted((n for n in med if not n.startswith("FlashInfer")), key=med.get)
        s["summary"] = {
            "FlashInfer us": peer,
            "default us": med.get("default"),
            "default / FlashInfer": med["default"] / peer if peer and "default" in med else None,
            "best": [(n, med[n], med[n] / peer if peer else None) for n in ranked[:6]],
            "default TB/s": s["bytes"] / (med["default"] * 1e-6) / 1e12
            if "default" in med
            else None,
        }


if __name__ == "__main__":
    main()
