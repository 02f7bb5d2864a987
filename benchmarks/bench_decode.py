#!/usr/bin/env python
"""Paged decode attention on one GPU: KV bytes read per second of the Triton kernels.

Run from the repository root on a CUDA machine (no Hydra needed):

    python -m benchmarks.bench_decode            # full run, well under 4 minutes on an H200
    python -m benchmarks.bench_decode --quick    # a few shapes, for a smoke test

What it does, in order:
  1. GQA (32 q heads, 8 KV heads, D=128) and MLA (128 heads, 576 -> 512) in bf16, block size 64,
     for B in {1, 8, 64, 256} and contexts 4k..128k (combinations whose cache exceeds ~40 GB are
     skipped). Every shape is first checked against the pure-PyTorch reference (the 2x rule
     against a same-dtype reference, on a few queries of the batch); a shape that fails is
     reported as failed, without a speed, and the script exits non-zero at the end.
  2. The same shapes through SDPA on a contiguous copy of the KV (cuDNN, flash, mem-efficient
     where they accept the shape), with and without the time of gathering the pages.
  3. FlexAttention (torch.compile'd) on a paged pool itself, no gather: a pool holding exactly
     the batch's pages in a scrambled order (torch 2.11's flex_decoding does not compile past
     2**31 KV elements), viewed as one KV sequence [1, Hkv, NB*64, D], the query batch as flex's
     batch, and a BlockMask whose KV block is the page, listing each request's pages in order
     with a mask_mod that maps physical KV indices back to logical positions (an inverse page
     table). Two forms:
     all pages partial, and whole pages full with the tail partial. For B in {1, 8, 64} and
     contexts {16k, 128k}, while under ~30 s per model; checked like the kernels (a failed check
     gives no speed), with the mask build time (``mask_ms``) and compile time kept apart. GQA
     by default; MLA with ``--flex-models gqa mla`` (its 576/512 flex kernel did not finish
     compiling within minutes). A shape flex cannot compile is recorded as its error.
  4. DCP emulation: one rank's shard of B=8 requests of 128k tokens for D in {1, 2, 4, 8} (time,
     blocks and bytes allocated per rank).
  5. A small sweep of tile configurations and split counts on representative shapes, so the
     defaults can be revisited from the results.
  6. MLA with fewer query heads per GPU (``--mla-heads``, default 16 32 64: DeepSeek's 128 heads
     split by tensor parallelism) on four shapes, with the FLOP per KV byte of each: 128 heads
     make MLA decode compute-bound, fewer make it bandwidth-bound. ``--only-mla-heads`` runs
     just this section (decode-mla-heads-<date>.json).

Results go to benchmarks/results/decode-<date>.json as {"date", "gpu", "torch", "triton",
"metrics"}; the SDPA and FlexAttention numbers sit in each shape's row under "sdpa" and "flex"
(``--no-sdpa`` / ``--no-flex`` skip them). Bandwidth counts each KV byte the attention must read
once (K and V for GQA, the 576-wide latent row for MLA); MLA also reports TFLOP/s, as 128 heads
make it compute-bound.
Each kernel shape is timed eagerly (``ms``: what an eager caller sees, host launch path
included) and replayed from a CUDA graph (``graph_ms``: the device time, as in graph-captured
decode); at small shapes the two differ by the eager launch path (~0.05-0.1 ms).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import RESULTS
from benchmarks.decode.common import (
    BATCHES,
    BLOCK_SIZE,
    CACHE_LIMIT_BYTES,
    CONTEXTS,
    DCP_BATCH,
    DCP_LENGTH,
    DTYPE,
    FLEX_BATCHES,
    FLEX_BUDGET_S,
    FLEX_CONTEXTS,
    GQA_D,
    GQA_HKV,
    MLA_HEAD_SHAPES,
    MLA_RK,
    MLA_ROPE,
    SWEEP_SHAPES,
    TIME_BUDGET_S,
    Model,
    bench_ms,
    check,
    graph_ms,
    make_inputs,
    num_sms,
)
from benchmarks.decode.flex import (  # noqa: F401 - also used through this module
    FLEX_Q_BLOCK,
    _flex_summary,
    flex_paged_block_mask,
    flex_paged_decode,
    flex_paged_kv,
    run_flex_shape,
)
from cp_modules.cache import (
    dcp_max_local_len,
    dcp_num_blocks,
    local_seq_len,
)
from cp_modules.kernels.decode.mla import (
    choose_mla_num_splits,
    mla_programs_per_sm,
)
from cp_modules.kernels.decode.paged import (
    DecodeConfig,
    choose_num_splits,
)


def run_kernel_shape(
    model: Model, batch: int, ctx: int, splits=None, config=None, with_graph=False
) -> dict:
    q, bt, seq, kv_len = make_inputs(model, batch, ctx)
    cfg = config or model.default_config()
    if model.mla:
        used_splits = splits or choose_mla_num_splits(
            model.num_programs(batch, cfg),
            bt.shape[1] * BLOCK_SIZE,
            num_sms(),
            cfg.block_n,
            mla_programs_per_sm(cfg),
        )
    else:
        used_splits = splits or choose_num_splits(
            model.num_programs(batch, cfg), bt.shape[1] * BLOCK_SIZE, num_sms()
        )
    if config is None and not model.mla and used_splits == 1:
        cfg = model.default_config(split=False)  # what the kernel picks without splits
    # ``config`` (None unless a sweep overrides it) goes to the kernel, so that the default
    # path is the one timed.
    out, lse = model.kernel(q, bt, seq, kv_len, splits, config)
    res = {"batch": batch, "context": ctx, "num_splits": used_splits, "config": cfg.__dict__}
    res["check"] = check(model, q, bt, seq, kv_len, out, lse)
    if not res["check"]["ok"]:
        return res
    ms = bench_ms(lambda: model.kernel(q, bt, seq, kv_len, splits, config))
    res.update(
        ms=ms,
        kv_tbps=model.kv_bytes(kv_len) / ms / 1e9,
        tflops=model.flops(kv_len) / ms / 1e9,
    )
    if with_graph:
        gms = graph_ms(lambda: model.kernel(q, bt, seq, kv_len, splits, config))
        res.update(
            graph_ms=gms,
            graph_kv_tbps=model.kv_bytes(kv_len) / gms / 1e9,
            graph_tflops=model.flops(kv_len) / gms / 1e9,
        )
    return res


def run_mla_heads(heads_list: list[int]) -> list[dict]:
    """MLA rows for other head counts than DeepSeek's 128 (CUDA-graph replay included)."""
    rows = []
    for heads in heads_list:
        model = Model("mla", heads)
        max_tokens = max(b * c for b, c in MLA_HEAD_SHAPES)
        model.allocate(triton.cdiv(max_tokens, BLOCK_SIZE) + 64)
        for b, c in MLA_HEAD_SHAPES:
            res = run_kernel_shape(model, b, c, with_graph=True)
            res["heads"] = heads
            # FLOP per KV byte: the kernel is bandwidth-bound below the GPU's ridge point.
            res["flop_per_kv_byte"] = heads * 2 * (model.dq + model.dv) / model.bytes_per_token
            rows.append(res)
            print(f"[mla heads={heads:3d}] B={b:4d} ctx={c:6d} splits={res['num_splits']:3d} "
                  + (f"graph {res['graph_kv_tbps']:.2f} TB/s {res['graph_tflops']:.0f} TFLOP/s"
                     if res["check"]["ok"] else f"FAILED CHECK {res['check']}"), flush=True)  # fmt: skip
        model.caches = ()
        torch.cuda.empty_cache()
    return rows


def run_sdpa_shape(model: Model, batch: int, ctx: int, ours_out: torch.Tensor | None) -> dict:
    """SDPA on a contiguous gathered copy of the same KV; the gather timed separately."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, bt, seq, kv_len = make_inputs(model, batch, ctx)
    idx = bt.long()

    def gather():
        if model.mla:
            return (model.caches[0][idx].view(batch, 1, -1, MLA_RK + MLA_ROPE),)
        return tuple(c[idx].view(batch, -1, GQA_HKV, GQA_D).transpose(1, 2) for c in model.caches)

    res: dict = {"batch": batch, "context": ctx}
    try:
        kv = gather()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {**res, "error": "out of memory for the contiguous copy"}
    res["gather_ms"] = bench_ms(gather)
    qs = q.view(batch, model.heads, 1, model.dq)
    k = kv[0]
    v = kv[0][..., :MLA_RK] if model.mla else kv[1]
    best = None
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def fn(backend=backend, k=k, v=v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, k, v, scale=model.scale, enable_gqa=True)

        try:
            o = fn()
            ms = bench_ms(fn)
        except Exception as e:  # noqa: BLE001 - unsupported shapes are a result here
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            continue
        entry = {"ms": ms, "kv_tbps": model.kv_bytes(kv_len) / ms / 1e9}
        if ours_out is not None:
            entry["max_abs_diff_vs_ours"] = (
                (o.view_as(ours_out).float() - ours_out.float()).abs().max().item()
            )
        res[name] = entry
        if best is None or ms < best[1]:
            best = (name, ms)
    if best is not None:
        total = best[1] + res["gather_ms"]
        res["best"] = best[0]
        res["gather_plus_sdpa_kv_tbps"] = model.kv_bytes(kv_len) / total / 1e9
    del kv, k, v, fn
    torch.cuda.empty_cache()
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the SDPA comparison")
    parser.add_argument(
        "--no-flex", action="store_true", help="skip the FlexAttention paged comparison"
    )
    parser.add_argument(
        "--flex-models",
        nargs="+",
        default=["gqa"],
        choices=["gqa", "mla"],
        help="models compared with FlexAttention (MLA's 576/512 flex kernel did not finish "
        "compiling within ~3 minutes with torch 2.11 on an H200, so it is opt-in)",
    )
    parser.add_argument(
        "--mla-heads",
        nargs="*",
        type=int,
        default=[16, 32, 64],
        help="also time MLA with these query-head counts (shapes MLA_HEAD_SHAPES); none to skip",
    )
    parser.add_argument(
        "--only-mla-heads",
        action="store_true",
        help="run only the MLA head-count section (writes decode-mla-heads-<date>.json)",
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    batches = (1, 64) if args.quick else BATCHES
    contexts = (4096, 131072) if args.quick else CONTEXTS
    metrics: dict = {"block_size": BLOCK_SIZE, "dtype": str(DTYPE), "shapes": {}}
    failures = []
    flex_wall: dict = {}  # wall time spent in the FlexAttention comparison, per model

    def elapsed() -> float:
        """Time counted against TIME_BUDGET_S: the flex comparison has a budget of its own."""
        return time.monotonic() - t_start - sum(flex_wall.values())

    flex_skipped: list = []
    flex_failed: list = []  # FlexAttention shapes whose output failed the check (no speed kept)

    for name in () if args.only_mla_heads else ("gqa", "mla"):
        model = Model(name)
        combos = [
            (b, c) for b in batches for c in contexts
            if b * c * model.bytes_per_token <= CACHE_LIMIT_BYTES
        ]  # fmt: skip
        skipped = [
            (b, c) for b in batches for c in contexts if (b, c) not in combos
        ]  # fmt: skip
        max_tokens = max(b * c for b, c in combos)
        model.allocate(triton.cdiv(max_tokens, BLOCK_SIZE) + 64)
        rows = []
        flex_s, flex_dead = 0.0, None
        flex_wall[name] = 0.0
        for b, c in combos:
            res = run_kernel_shape(model, b, c, with_graph=True)
            print(f"[{name}] B={b:4d} ctx={c:6d} splits={res['num_splits']:3d} "
                  + (f"{res['ms']:.3f} ms {res['kv_tbps']:.2f} TB/s {res['tflops']:.0f} TFLOP/s"
                     f" | graph {res['graph_ms']:.3f} ms {res['graph_kv_tbps']:.2f} TB/s "
                     f"{res['graph_tflops']:.0f} TFLOP/s"
                     if res["check"]["ok"] else f"FAILED CHECK {res['check']}"), flush=True)  # fmt: skip
            if not res["check"]["ok"]:
                failures.append((name, b, c))
            run_sdpa = not args.no_sdpa and elapsed() < TIME_BUDGET_S * 0.6
            run_flex = (
                not args.no_flex
                and name in args.flex_models
                and b in FLEX_BATCHES
                and c in FLEX_CONTEXTS
                and flex_s < FLEX_BUDGET_S
            )
            ours = None
            if run_sdpa or (run_flex and flex_dead is None):
                q, bt, seq, kv_len = make_inputs(model, b, c)
                ours, _ = model.kernel(q, bt, seq, kv_len)
            if run_sdpa:
                res["sdpa"] = run_sdpa_shape(model, b, c, ours)
                sd = res["sdpa"]
                print(f"        sdpa best={sd.get('best')} "
                      + " ".join(f"{k}={v.get('kv_tbps', 0):.2f}" for k, v in sd.items()
                                 if isinstance(v, dict) and "kv_tbps" in v)
                      + f" gather+sdpa={sd.get('gather_plus_sdpa_kv_tbps', 0):.2f} TB/s", flush=True)  # fmt: skip
            if run_flex and flex_dead is not None:
                # Both forms failed on an earlier shape of this model: most likely the same
                # error again, so the compile time is not spent on it twice.
                res["flex"] = {"batch": b, "context": c, "error": f"not retried: {flex_dead}"}
            elif run_flex:
                t_flex = time.monotonic()
                res["flex"] = fx = run_flex_shape(model, b, c, ours)
                flex_s += time.monotonic() - t_flex
                flex_wall[name] = flex_s
                if "skipped" in fx:
                    print(f"        flex skipped: {fx['skipped']}", flush=True)
                    rows.append(res)
                    continue
                errors = [fx[k].get("error") for k in ("partial", "full")]
                if all(errors):
                    flex_dead = f"B={b} ctx={c}: {errors[0]}"
                flex_failed += [(name, b, c, k) for k in ("partial", "full")
                                if fx[k].get("check") and not fx[k]["check"]["ok"]]  # fmt: skip
                summary = " ".join(f"{k}={_flex_summary(fx[k])}" for k in ("partial", "full"))
                print(f"        flex {summary}", flush=True)
            elif (
                not args.no_flex
                and name in args.flex_models
                and b in FLEX_BATCHES
                and c in FLEX_CONTEXTS
            ):
                flex_skipped.append((name, b, c))
            rows.append(res)
        metrics["shapes"][name] = {
            "config": model.default_config().__dict__,
            "config_without_splits": model.default_config(split=False).__dict__,
            "results": rows,
            "skipped_over_cache_limit": skipped,
        }
        ok_rows = [r for r in rows if r["check"]["ok"]]
        big = [r for r in ok_rows if r["batch"] * r["context"] >= 1 << 20]
        metrics["shapes"][name]["min_kv_tbps_where_B_ctx_ge_1M"] = (
            min(r["kv_tbps"] for r in big) if big else None
        )
        metrics["shapes"][name]["min_graph_kv_tbps_where_B_ctx_ge_1M"] = (
            min(r["graph_kv_tbps"] for r in big) if big else None
        )

        # DCP emulation: the shard one rank holds of 8 requests of 128k tokens.
        if not args.quick and elapsed() < TIME_BUDGET_S:
            dcp_rows = []
            for d in (1, 2, 4, 8):
                length = DCP_LENGTH
                local = local_seq_len(length, d, 0, 1)
                q, bt, seq, kv_len = make_inputs(model, DCP_BATCH, local, table_len=local)
                out, lse = model.kernel(q, bt, seq, kv_len)
                chk = check(model, q, bt, seq, kv_len, out, lse)
                row = {
                    "dcp": d,
                    "local_tokens": local,
                    "max_local_tokens": dcp_max_local_len(length, d, 1),
                    "blocks_per_rank_per_request": dcp_num_blocks(length, BLOCK_SIZE, d),
                    "bytes_per_rank_per_request": dcp_num_blocks(length, BLOCK_SIZE, d)
                    * model.bytes_per_block,
                    "check": chk,
                }
                if chk["ok"]:
                    ms = bench_ms(lambda: model.kernel(q, bt, seq, kv_len))  # noqa: B023
                    row.update(ms=ms, kv_tbps=model.kv_bytes(kv_len) / ms / 1e9)
                else:
                    failures.append((name, "dcp", d))
                dcp_rows.append(row)
                print(f"[{name}] dcp={d} local={local} {row.get('ms', float('nan')):.3f} ms",
                      flush=True)  # fmt: skip
            metrics["shapes"][name]["dcp_emulation_B8_L128k"] = dcp_rows

        # Config sweep on one bandwidth-bound and one split-KV shape.
        if not args.quick and elapsed() < TIME_BUDGET_S:
            if model.mla:
                # (block_h, block_n, num_warps, num_stages, split_scores)
                configs = [(64, 64, 8, 2, True), (64, 64, 8, 2, False), (64, 32, 8, 2, True),
                           (64, 32, 8, 3, False), (64, 64, 16, 2, True)]  # fmt: skip
            else:
                configs = [(16, 64, 4, 3), (16, 32, 4, 3), (16, 128, 4, 3), (16, 64, 8, 3),
                           (16, 64, 4, 2), (16, 128, 8, 2), (16, 64, 4, 4)]  # fmt: skip
            sweep = []
            for b, c in SWEEP_SHAPES:
                for cfg_t in configs:
                    if elapsed() > TIME_BUDGET_S:
                        break
                    cfg = DecodeConfig(*cfg_t)
                    try:
                        res = run_kernel_shape(model, b, c, config=cfg)
                    except Exception as e:  # noqa: BLE001 - a config that does not fit is a result
                        res = {"batch": b, "context": c, "error": f"{type(e).__name__}: {e}"[:200]}
                    res["config"] = cfg.__dict__
                    sweep.append(res)
                for splits in (8, 16, 32, 64, 128):
                    if b != 1 or elapsed() > TIME_BUDGET_S:
                        break
                    res = run_kernel_shape(model, b, c, splits=splits)
                    sweep.append(res)
            metrics["shapes"][name]["sweep"] = sweep
            for r in sweep:
                if "kv_tbps" in r:
                    print(f"[{name} sweep] B={r['batch']} ctx={r['context']} S={r['num_splits']} "
                          f"{r['config']} {r['kv_tbps']:.2f} TB/s", flush=True)  # fmt: skip
        model.caches = ()
        torch.cuda.empty_cache()

    if args.mla_heads and not args.quick:
        metrics["mla_heads"] = run_mla_heads(args.mla_heads)
        failures += [("mla", r["heads"], r["batch"], r["context"])
                     for r in metrics["mla_heads"] if not r["check"]["ok"]]  # fmt: skip

    metrics["flex"] = {
        "shapes": {"batches": FLEX_BATCHES, "contexts": FLEX_CONTEXTS},
        "wall_s": flex_wall,
        "budget_s_per_model": FLEX_BUDGET_S,
        "skipped_over_time_budget": flex_skipped,
        "failed_checks": flex_failed,
        "note": "results per shape under shapes.<model>.results[i].flex",
    }
    metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    metrics["wall_s"] = time.monotonic() - t_start
    metrics["failed_checks"] = failures
    date = datetime.date.today().isoformat()
    report = {
        "date": date,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "metrics": metrics,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "-mla-heads" if args.only_mla_heads else "-quick" if args.quick else ""
    path = out_dir / f"decode{kind}-{date}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path} in {metrics['wall_s']:.0f} s")
    if flex_failed:
        print(f"FlexAttention outputs FAILED the check for {flex_failed} (recorded, no speed)",
              file=sys.stderr)  # fmt: skip
    if failures:
        print(f"correctness checks FAILED for {failures}; their speeds are not reported",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
