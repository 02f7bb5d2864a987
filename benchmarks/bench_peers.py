#!/usr/bin/env python
"""This project's decode kernels beside the peers people choose for them, FlashMLA and FlashInfer,
on the same GPU, the same inputs and in one process.

Run from the repository root on a CUDA machine, after ``tools/build_peers.py`` (which puts the
peers into ``$CP_PEERS_SITE``, default ``/tmp/peers_site``; this script adds it to ``sys.path``):

    python -m benchmarks.bench_peers                 # every section, a few minutes on an H200
    python -m benchmarks.bench_peers --only mla,gqa  # sections: mla, gqa, combine
    python -m benchmarks.bench_peers --cp-only --kind peers-cp-only  # no peers: cp variants

Without a GPU or with neither peer importable it prints one line saying why and exits 0 (the
suite runs it on every machine).

Sections (bf16 everywhere):

- ``mla``: absorbed MLA paged decode (576-wide latent keys, 512-wide values) at 128 heads,
  B = 1 (ctx 128k) and B in {8, 64, 256} x ctx in {4k, 32k, 128k} (cache at most 40 GB), block
  sizes 64 and 16, and at 16 heads (tensor-parallel DeepSeek) with block size 64. This project:
  ``cp_modules.ops.paged_decode.paged_mla_attention`` (its default kernel). FlashMLA: its SM90
  dense decode through ``flash_mla_with_kvcache`` (block size 64 only; its scheduler metadata is
  made by the first call and reused, as a decode step shares it across layers). FlashInfer:
  ``BatchMLAPagedAttentionWrapper`` with the ``fa3`` and ``fa2`` backends (planned outside the
  timing), the faster is the peer's time. TFLOP/s = 2 * h * ctx * (576 + 512) * B / time.
- ``gqa``: GQA paged decode, D = 128, block size 64, Llama-3-8B (32 query / 8 KV heads) and
  Qwen2.5-7B (28 / 4), B * ctx >= 1M ({8 x 128k, 64 x 16k, 256 x 4k}) and B = 1 at 128k. This
  project: ``paged_attention``; FlashInfer: ``BatchDecodeWithPagedKVCacheWrapper`` (NHD), its
  CUDA-core decode and its tensor-core path (``use_tensor_cores``), the faster is the peer's time.
  TB/s counts the K and V bytes read once.
- ``combine``: merging N partial attention states (B = 512 tokens, 128 / N heads, D in
  {128, 512}, N in {2, 4, 8}, base-2 LSEs as FlashInfer keeps them): ``lse_combine(base="2")``
  against FlashInfer's ``merge_states`` (and ``merge_state`` at N = 2), each in its own input
  layout ([N, B, H, D] here, [B, N, H, D] there; the copies are made outside the timing). TB/s
  counts bytes read and written.

Every implementation is first checked against this project's pure-PyTorch reference on the same
inputs (``cp_modules.reference``: three queries of the batch for decode, all of it for the
combine), by the 2x rule against a same-dtype reference; LSEs may be natural or base 2 (the base
that matches is recorded). Then each is timed as a CUDA-graph replay (``graph_replay_us``: median
of ``do_bench`` with the L2 flushed). A failed check, or an error, is recorded with its message and
gives no ratio. Rows: ``<op> cp / <peer> time <shape>`` (below 1.0: this project is faster) and
the peer's own rate beside it, ``<op> <peer> TFLOP/s|TB/s <shape>``.

Results: ``benchmarks/results/peers-<date>.json`` ({"date", "gpu", "torch", "triton",
"peers": versions, "metrics": rows, "sections": every measurement}) and
``benchmarks/results/peers-<date>.md`` (the rows as a table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial

import torch
import triton

from benchmarks.common import RESULTS, graph_replay_us, write_results
from benchmarks.peers.plumbing import (  # noqa: F401 - the test and the report use them here
    DEFAULT_SITE,
    _clear_cuda_error,
    _first_line,
    add_site,
    available,
    best_variant,
    combine_shape,
    gqa_shape,
    markdown,
    mla_shape,
    peer_versions,
    rate_name,
    row_name,
    skip_reason,
    summarize,
)

DTYPE = torch.bfloat16
RK, ROPE = 512, 64
MLA_SCALE = (128 + ROPE) ** -0.5
MAX_CACHE_BYTES = 40e9
MLA_SHAPES = [(1, 131072)] + [(b, c) for b in (8, 64, 256) for c in (4096, 32768, 131072)]
MLA_HEADS = (128, 16)
MLA_BLOCK_SIZES = (64, 16)
GQA_MODELS = (("Llama-3-8B", 32, 8), ("Qwen2.5-7B", 28, 4))
GQA_SHAPES = ((1, 131072), (8, 131072), (64, 16384), (256, 4096))
GQA_D, GQA_BS = 128, 64
COMBINE_B, COMBINE_HEADS = 512, 128
COMBINE_DIMS, COMBINE_NS = (128, 512), (2, 4, 8)
SECTIONS = ("mla", "gqa", "combine")
WORKSPACE_BYTES = 256 << 20
# time.monotonic() past which rows are skipped (set by --budget-s); each skipped row says so.
_DEADLINE = [math.inf]


def _out_of_time(row: dict) -> bool:
    if time.monotonic() > _DEADLINE[0]:
        row["skipped"] = "time budget"
        return True
    return False


# ---------------------------------------------------------------------------------------------
# Checks and timing


def compare(out, lse, ref, same, lse_ref_base2: bool = False) -> dict:
    """The 2x rule on ``out`` and ``lse`` against the fp32 reference ``ref`` (out, lse) with the
    same-dtype reference ``same``. ``lse`` may be natural or base 2 (the closer is used and
    recorded); the reference's is natural unless ``lse_ref_base2``."""
    r_out, r_lse = ref
    s_out, s_lse = same
    err_out = (out.float() - r_out.float()).abs().max().item()
    base_out = (s_out.float() - r_out.float()).abs().max().item()
    lse = lse.float()
    to_ref = (
        {"e": lse, "2": lse * math.log(2)}
        if not lse_ref_base2
        else {"2": lse, "e": lse / math.log(2)}
    )
    fin = torch.isfinite(r_lse)
    errs = {}
    for base, val in to_ref.items():
        d = torch.where(fin, val - r_lse, torch.zeros_like(r_lse)).abs().max().item()
        errs[base] = d if bool((torch.isfinite(val) == fin).all()) else float("inf")
    lse_base = min(errs, key=lambda b: errs[b])
    err_lse = errs[lse_base]
    base_lse = torch.where(fin, s_lse.float() - r_lse, torch.zeros_like(r_lse)).abs().max().item()
    ok = math.isfinite(err_out) and err_out <= 2 * base_out + 1e-4
    ok = ok and math.isfinite(err_lse) and err_lse <= 2 * base_lse + 1e-4
    return {"ok": bool(ok), "err_out": err_out, "err_lse": err_lse, "lse_base": lse_base,
            "same_dtype_err_out": base_out, "same_dtype_err_lse": base_lse}  # fmt: skip


def _identity(r):
    return r


def measure(fn: Callable, ref, same, work: float, idx=None, pick: Callable = _identity,
            lse_ref_base2: bool = False) -> dict:  # fmt: skip
    """Check ``pick(fn())`` ((out, lse), rows ``idx`` of them) against the reference, then time
    ``fn`` as a CUDA-graph replay; ``rate`` = ``work`` / time (units per second / 1e12). Errors
    are recorded, not raised."""
    try:
        out, lse = pick(fn())
        if idx is not None:
            out, lse = out[idx], lse[idx]
        torch.cuda.synchronize()
        entry = compare(out, lse, ref, same, lse_ref_base2)
        us = graph_replay_us(fn)
        entry["us" if entry["ok"] else "unchecked_us"] = us
        if entry["ok"]:
            entry["rate"] = work / (us * 1e-6) / 1e12
        return entry
    except Exception as e:  # noqa: BLE001 - the sweep records every failure and goes on
        _clear_cuda_error()
        return {"error": _first_line(e)}


def _status(entry: dict) -> str:
    if "variants" in entry:
        return "  ".join(f"{k}:{_status(v)}" for k, v in entry["variants"].items())
    if "error" in entry:
        return f"ERROR {entry['error']}"
    if not entry.get("ok"):
        return f"CHECK FAILED (out {entry['err_out']:.2e}, lse {entry['err_lse']:.2e})"
    return f"{entry['us']:.1f} us ({entry['rate']:.2f})"


# ---------------------------------------------------------------------------------------------
# MLA decode


def _paged_inputs(num_blocks: int, block_size: int, batch: int, ctx: int, g: torch.Generator):
    """A scrambled block table over ``num_blocks`` pages, each request its own row, all of
    length ``ctx`` (the last of several one token short, so tiles end mid-block)."""
    width = triton.cdiv(ctx, block_size)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * width]
    bt = perm.view(batch, width).to(torch.int32)
    seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    if batch > 1:
        lens[-1] = ctx - 1
    return bt, seq, lens


def _csr(bt: torch.Tensor, lens: torch.Tensor, block_size: int):
    """FlashInfer's page lists: indptr [B+1], indices, last page lengths."""
    pages = (lens + block_size - 1) // block_size
    indptr = torch.zeros(bt.shape[0] + 1, dtype=torch.int32, device=bt.device)
    indptr[1:] = torch.cumsum(pages, 0)
    mask = torch.arange(bt.shape[1], device=bt.device)[None, :] < pages[:, None]
    indices = bt[mask].to(torch.int32).contiguous()
    last = (lens - (pages - 1) * block_size).to(torch.int32)
    return indptr, indices, last


def _flashmla_fn(pool, q, bt, lens):
    import flash_mla

    q4, kc = q.unsqueeze(1), pool.unsqueeze(2)
    meta, _ = flash_mla.get_mla_metadata()

    fn = partial(flash_mla.flash_mla_with_kvcache, q4, kc, bt, lens, RK, meta,
                 softmax_scale=MLA_SCALE, causal=False)  # fmt: skip
    return fn, _flashmla_pick


def _flashmla_pick(r):
    """FlashMLA's (out [B, 1, H, Dv], lse [B, H, 1]) as (out [B, H, Dv], lse [B, H])."""
    return r[0][:, 0], r[1][:, :, 0]


def _flashinfer_mla_fn(backend, pool, q, bt, lens, workspace):
    import flashinfer

    heads, bs, batch = q.shape[1], pool.shape[1], q.shape[0]
    indptr, indices, _ = _csr(bt, lens, bs)
    qo = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    plan = dict(qo_indptr=qo, kv_indptr=indptr, kv_indices=indices, kv_len_arr=lens,
                num_heads=heads, head_dim_ckv=RK, head_dim_kpe=ROPE, page_size=bs,
                causal=False, sm_scale=MLA_SCALE, q_data_type=DTYPE, kv_data_type=DTYPE)  # fmt: skip
    try:
        w.plan(**plan, lse_mode="basee")
    except TypeError:
        w.plan(**plan)
    q_nope, q_pe = q[..., :RK].contiguous(), q[..., RK:].contiguous()
    ckv, kpe = pool[..., :RK], pool[..., RK:]

    return partial(w.run, q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe,
                   return_lse=True, return_lse_base_on_e=True)  # fmt: skip


def run_mla(versions: dict, log, shapes=MLA_SHAPES, heads_list=MLA_HEADS,
            block_sizes=MLA_BLOCK_SIZES, cp_variants=()) -> list[dict]:  # fmt: skip
    """``cp_variants``: Gluon schedules (``GLUON_MLA_VARIANTS`` keys) timed beside the default
    as entries ``cp-<name>`` (at head counts the Gluon kernel serves), like a peer; at 16 heads
    the tokens-on-M kernel likewise (``cp-tokens-on-m``: rows ``mla decode cp / cp-tokens-on-m
    time ...``)."""
    from cp_modules.kernels.decode.mla_tokens import MAX_HEADS as MAX_TOKENS_ON_M_HEADS
    from cp_modules.kernels.decode.mla_tokens import paged_mla_tokens_on_m
    from cp_modules.ops.paged_decode import paged_mla_attention
    from cp_modules.reference.paged_decode import paged_mla_attention_ref

    rows = []
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    shapes = [s for s in shapes if s[0] * s[1] * (RK + ROPE) * 2 <= MAX_CACHE_BYTES]
    for bs in block_sizes:
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(0)
        num_blocks = triton.cdiv(max(b * c for b, c in shapes), bs) + 1
        pool = torch.empty(num_blocks, bs, RK + ROPE, dtype=DTYPE, device="cuda").normal_(
            generator=g
        )
        for heads in heads_list:
            if heads != 128 and bs != 64:
                continue
            for b, c in shapes:
                row = {"heads": heads, "block_size": bs, "batch": b, "ctx": c, "impl": {}}
                rows.append(row)
                if _out_of_time(row):
                    continue
                bt, seq, lens = _paged_inputs(num_blocks, bs, b, c, g)
                q = torch.randn(b, heads, RK + ROPE, device="cuda", generator=g).to(DTYPE)
                idx = torch.tensor(sorted({0, b // 2, b - 1}), device="cuda")
                sub = (q[idx], pool, bt, seq[idx], lens[idx], MLA_SCALE, RK)
                ref = paged_mla_attention_ref(*sub)
                same = paged_mla_attention_ref(*sub, upcast=False)
                work = 2 * heads * float(lens.sum().item()) * (RK + ROPE + RK)

                ours = partial(paged_mla_attention, q, pool, bt, seq, lens, scale=MLA_SCALE,
                               kv_lora_rank=RK)  # fmt: skip
                impl = row["impl"]
                impl["cp"] = measure(ours, ref, same, work, idx)
                for name in cp_variants if heads % 64 == 0 else ():
                    from cp_modules.kernels.decode.mla_gluon import (
                        GLUON_MLA_VARIANTS,
                        paged_mla_attention_gluon,
                    )

                    fn = partial(paged_mla_attention_gluon, q, pool, bt, seq, lens, MLA_SCALE, RK,
                                 config=GLUON_MLA_VARIANTS[name])  # fmt: skip
                    impl[f"cp-{name}"] = measure(fn, ref, same, work, idx)
                if heads <= MAX_TOKENS_ON_M_HEADS:  # the tokens-on-M kernel (its switch aside)
                    fn = partial(paged_mla_tokens_on_m, q, pool, bt, seq, lens, MLA_SCALE, RK)
                    impl["cp-tokens-on-m"] = measure(fn, ref, same, work, idx)
                if available(versions, "FlashMLA"):
                    try:
                        fn, pick = _flashmla_fn(pool, q, bt, lens)
                        impl["FlashMLA"] = measure(fn, ref, same, work, idx, pick)
                    except Exception as e:  # noqa: BLE001
                        _clear_cuda_error()
                        impl["FlashMLA"] = {"error": _first_line(e)}
                if available(versions, "FlashInfer"):
                    variants = {}
                    for backend in ("fa3", "fa2"):
                        try:
                            fn = _flashinfer_mla_fn(backend, pool, q, bt, lens, workspace)
                            variants[backend] = measure(fn, ref, same, work, idx)
                        except Exception as e:  # noqa: BLE001
                            _clear_cuda_error()
                            variants[backend] = {"error": _first_line(e)}
                    impl["FlashInfer"] = {"variants": variants}
                for name, entry in impl.items():
                    log(f"mla h={heads:3d} bs={bs} B={b:3d} ctx={c:6d} {name:10s} {_status(entry)}")
        del pool
    return rows


# ---------------------------------------------------------------------------------------------
# GQA decode


def _flashinfer_gqa_fn(tensor_cores, k, v, q, bt, lens, workspace, hkv):
    import flashinfer

    indptr, indices, last = _csr(bt, lens, k.shape[1])
    w = flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=tensor_cores
    )
    w.plan(indptr, indices, last, q.shape[1], hkv, q.shape[2], k.shape[1],
           q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=q.shape[2] ** -0.5)  # fmt: skip

    return partial(w.run, q, (k, v), return_lse=True)


def run_gqa(versions: dict, log, models=GQA_MODELS, shapes=GQA_SHAPES) -> list[dict]:
    from cp_modules.kernels.decode.gqa_tokens import paged_gqa_tokens_on_m
    from cp_modules.ops.paged_decode import paged_attention
    from cp_modules.reference.paged_decode import paged_attention_ref

    rows = []
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    for model, hq, hkv in models:
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(1)
        num_blocks = triton.cdiv(max(b * c for b, c in shapes), GQA_BS) + 1
        k = torch.empty(num_blocks, GQA_BS, hkv, GQA_D, dtype=DTYPE, device="cuda")
        v = torch.empty_like(k)
        k.normal_(generator=g)
        v.normal_(generator=g)
        scale = GQA_D**-0.5
        for b, c in shapes:
            row = {"model": model, "hq": hq, "hkv": hkv, "batch": b, "ctx": c, "impl": {}}
            rows.append(row)
            if _out_of_time(row):
                continue
            bt, seq, lens = _paged_inputs(num_blocks, GQA_BS, b, c, g)
            q = torch.randn(b, hq, GQA_D, device="cuda", generator=g).to(DTYPE)
            idx = torch.tensor(sorted({0, b // 2, b - 1}), device="cuda")
            sub = (q[idx], k, v, bt, seq[idx], lens[idx], scale)
            ref = paged_attention_ref(*sub)
            same = paged_attention_ref(*sub, upcast=False)
            work = float(lens.sum().item()) * hkv * GQA_D * 2 * 2  # K and V bytes

            ours = partial(paged_attention, q, k, v, bt, seq, lens, scale=scale)
            impl = row["impl"]
            impl["cp"] = measure(ours, ref, same, work, idx)
            # The tokens-on-M kernel (its switch aside): rows gqa paged decode cp /
            # cp-tokens-on-m.
            fn = partial(paged_gqa_tokens_on_m, q, k, v, bt, seq, lens, scale)
            impl["cp-tokens-on-m"] = measure(fn, ref, same, work, idx)
            if available(versions, "FlashInfer"):
                variants = {}
                for name, tc in (("cuda-cores", False), ("tensor-cores", True)):
                    try:
                        fn = _flashinfer_gqa_fn(tc, k, v, q, bt, lens, workspace, hkv)
                        variants[name] = measure(fn, ref, same, work, idx)
                    except Exception as e:  # noqa: BLE001
                        _clear_cuda_error()
                        variants[name] = {"error": _first_line(e)}
                impl["FlashInfer"] = {"variants": variants}
            for name, entry in impl.items():
                log(f"gqa {model:11s} B={b:3d} ctx={c:6d} {name:10s} {_status(entry)}")
        del k, v
    return rows


# ---------------------------------------------------------------------------------------------
# LSE combine / merge_states


def combine_case(d: int, n: int, batch: int = COMBINE_B, device: str = "cuda", dtype=DTYPE):
    """The combine section's inputs for one shape: ``(po, pl, ref, same, work)``: partials
    ``[N, batch, 128 / N, D]``, base-2 LSEs ``[N, batch, 128 / N]`` fp32, the fp32 reference
    (out, lse), the same-dtype reference and the bytes read and written."""
    from cp_modules.reference.lse_merge import lse_combine_reference, lse_weights_reference

    h = COMBINE_HEADS // n
    g = torch.Generator(device=device).manual_seed(2)
    po = torch.randn(n, batch, h, d, device=device, generator=g).to(dtype)
    pl = 4 * torch.randn(n, batch, h, device=device, generator=g)
    ref = lse_combine_reference(po.float(), pl, base2=True)
    w, _ = lse_weights_reference(pl, base2=True)
    same = (torch.where(w[..., None] > 0, po * w.to(dtype)[..., None], 0).sum(0), ref[1])
    work = (n * batch * h * d + batch * h * d) * po.element_size() + (n + 1) * batch * h * 4
    return po, pl, ref, same, work


def run_combine(versions: dict, log) -> list[dict]:
    from cp_modules.ops.lse_combine import lse_combine

    rows = []
    for d in COMBINE_DIMS:
        for n in COMBINE_NS:
            h = COMBINE_HEADS // n
            po, pl, ref, same, work = combine_case(d, n)
            row = {"d": d, "n": n, "batch": COMBINE_B, "heads": h, "impl": {}}
            rows.append(row)
            if _out_of_time(row):
                continue

            ours = partial(lse_combine, po, pl, return_lse=True, base="2")
            impl = row["impl"]
            impl["cp"] = measure(ours, ref, same, work, lse_ref_base2=True)
            if available(versions, "FlashInfer"):
                import flashinfer

                vs = po.permute(1, 0, 2, 3).contiguous()
                ss = pl.permute(1, 0, 2).contiguous()
                fn = partial(flashinfer.merge_states, vs, ss)
                variants = {"merge_states": measure(fn, ref, same, work, lse_ref_base2=True)}
                if n == 2:
                    a_v, b_v = po[0].contiguous(), po[1].contiguous()
                    a_s, b_s = pl[0].contiguous(), pl[1].contiguous()
                    fn = partial(flashinfer.merge_state, a_v, a_s, b_v, b_s)
                    variants["merge_state"] = measure(fn, ref, same, work, lse_ref_base2=True)
                impl["FlashInfer"] = {"variants": variants}
            for name, entry in impl.items():
                log(f"combine D={d} N={n} {name:10s} {_status(entry)}")
    return rows


def warm_flashinfer() -> None:
    """JIT-compile FlashInfer's kernels of every section on tiny inputs (``tools/build_peers.py
    --warm`` runs this while FlashMLA builds); each failure is printed, not raised."""
    add_site()
    versions = peer_versions()
    print(versions, flush=True)
    if not available(versions, "FlashInfer"):
        return
    versions = {"FlashInfer": versions["FlashInfer"]}
    t0 = time.time()
    for name, run in (
        ("combine", lambda: run_combine(versions, print)),
        ("gqa", lambda: run_gqa(versions, print, shapes=((2, 256),))),
        ("mla", lambda: run_mla(versions, print, shapes=((2, 256),), heads_list=(128, 16))),
    ):
        try:
            run()
        except Exception as e:  # noqa: BLE001
            print(f"warm {name}: {_first_line(e)}", flush=True)
        print(f"warm {name} done at {time.time() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------


def collect_errors(sections: dict) -> list[str]:
    """``"<section> <shape>: <impl>: <error>"`` for every failed run."""
    out = []
    for sec, rows in sections.items():
        for row in rows:
            shape = {k: v for k, v in row.items() if k != "impl"}
            for name, entry in row["impl"].items():
                for var, e in (entry.get("variants") or {name: entry}).items():
                    label = name if var == name else f"{name} {var}"
                    if "error" in e:
                        out.append(f"{sec} {shape}: {label}: {e['error']}")
                    elif not e.get("ok"):
                        out.append(f"{sec} {shape}: {label}: check failed "
                                   f"(out {e['err_out']:.2e}, lse {e['err_lse']:.2e})")  # fmt: skip
    return out


def build_metrics(sections: dict) -> dict:
    metrics: dict = {}
    for row in sections.get("mla", []):
        shape = mla_shape(row["heads"], row["batch"], row["ctx"], row["block_size"])
        summarize("mla decode", shape, row["impl"], "TFLOP/s", metrics)
    for row in sections.get("gqa", []):
        shape = gqa_shape(row["model"], row["hq"], row["hkv"], row["batch"], row["ctx"])
        summarize("gqa paged decode", shape, row["impl"], "TB/s", metrics)
    for row in sections.get("combine", []):
        summarize("lse combine", combine_shape(row["d"], row["n"]), row["impl"], "TB/s", metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"subset of {list(SECTIONS)}")
    ap.add_argument("--site", default=None, help="peers' install folder (default $CP_PEERS_SITE)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--kind", default="peers", help="results file name: <kind>-<date>.json")
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="skip the rows that would start after this many seconds")  # fmt: skip
    ap.add_argument("--cp-variants", default="",
                    help="comma-separated Gluon MLA schedules timed beside the default as "
                         "cp-<name> (their rows read cp / cp-<name>)")  # fmt: skip
    ap.add_argument("--cp-only", action="store_true",
                    help="run without peers: only this project's kernels and their variants "
                         "(cp-tokens-on-m, cp-<name>), rows cp / cp-<variant>")  # fmt: skip
    a = ap.parse_args(argv)
    cp_variants = tuple(n for n in a.cp_variants.split(",") if n)
    only = [s for s in a.only.split(",") if s]
    if set(only) - set(SECTIONS):
        raise SystemExit(f"unknown sections {sorted(set(only) - set(SECTIONS))}; valid: {SECTIONS}")
    add_site(a.site)
    # FlashInfer's legacy MLA arguments (the split q_nope/q_pe, ckv/kpe form) warn on each call.
    warnings.filterwarnings(
        "ignore", category=DeprecationWarning, module=r"(flashinfer|benchmarks)"
    )
    versions = peer_versions()
    reason = skip_reason(versions, torch.cuda.is_available(), cp_only=a.cp_only)
    if reason:
        print(reason, flush=True)
        return 0
    print(f"peers: {versions}", flush=True)
    t0 = time.time()
    _DEADLINE[0] = time.monotonic() + a.budget_s
    sections: dict = {}

    def log(m: str) -> None:
        print(m, flush=True)

    def save():
        metrics, errors = build_metrics(sections), collect_errors(sections)
        path = write_results(a.kind, metrics, a.out, peers=versions, sections=sections,
                             errors=errors)  # fmt: skip
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return path, metrics, errors

    # Block size 64 first (FlashMLA's only one), then the short combine, block size 16, GQA.
    steps = [("mla", lambda: run_mla(versions, log, block_sizes=(64,), cp_variants=cp_variants)),
             ("combine", lambda: run_combine(versions, log)),
             ("mla", lambda: run_mla(versions, log, block_sizes=(16,), cp_variants=cp_variants)),
             ("gqa", lambda: run_gqa(versions, log))]  # fmt: skip
    for name, run in steps:
        if name not in only:
            continue
        sections.setdefault(name, []).extend(run())
        path, metrics, errors = save()
        print(f"=== {name} done at {time.time() - t0:.0f} s", flush=True)
    for k, v in metrics.items():
        print(f"{k}: {v:.3f}", flush=True)
    print(f"wrote {path} ({datetime.datetime.now():%H:%M:%S})", flush=True)
    # A wrong kernel of this project fails the run; a peer's failure is only recorded.
    bad = [e for e in errors if ": cp: " in e or ": cp-" in e]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
