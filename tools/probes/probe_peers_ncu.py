#!/usr/bin/env python
"""One launch of this project's MLA decode and of each peer's at one shape, for ``ncu``.

Run from the repository root on a CUDA machine, after ``tools/build_peers.py``:

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight \\
        --section WarpStateStats python tools/probes/probe_peers_ncu.py --batch 64 --ctx 32768

The inputs are ``bench_peers``'s (one paged pool, a scrambled block table, equal lengths with
the last request one token short). Each implementation (``--impls``: ``cp``, ``FlashMLA``,
``FlashInfer-fa3``, ``FlashInfer-fa2``; a peer that is not importable is skipped with a line
saying so) is checked against ``cp_modules.reference`` on three queries of the batch (the 2x
rule of ``bench_peers.compare``; a failed check of this project's kernel exits with status 1),
called once more to warm up, then launched once inside an NVTX range ``profile`` (pushed and
popped around that one call), so ``--nvtx-include "profile/"`` profiles only those launches:
the split kernel and its merge, for each implementation in turn. Prints one line an
implementation (its check, and the NVTX range it ran in).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_peers as bp  # noqa: E402

IMPLS = ("cp", "FlashMLA", "FlashInfer-fa3", "FlashInfer-fa2")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--impls", default="cp,FlashMLA,FlashInfer-fa3")
    ap.add_argument("--site", default=None, help="peers' install folder (default $CP_PEERS_SITE)")
    a = ap.parse_args(argv)
    impls = [s for s in a.impls.split(",") if s]
    if set(impls) - set(IMPLS):
        raise SystemExit(f"unknown --impls {sorted(set(impls) - set(IMPLS))}; valid: {IMPLS}")
    if not torch.cuda.is_available():
        print("probe_peers_ncu: skipped: no CUDA device")
        return 0
    from cp_modules.ops.paged_decode import paged_mla_attention
    from cp_modules.reference.paged_decode import paged_mla_attention_ref

    bp.add_site(a.site)
    versions = bp.peer_versions()
    print(f"peers: {versions}", flush=True)
    b, c, heads, bs = a.batch, a.ctx, a.heads, a.block_size
    g = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = triton.cdiv(b * c, bs) + 1
    pool = torch.empty(num_blocks, bs, bp.RK + bp.ROPE, dtype=bp.DTYPE, device="cuda")
    pool.normal_(generator=g)
    bt, seq, lens = bp._paged_inputs(num_blocks, bs, b, c, g)
    q = torch.randn(b, heads, bp.RK + bp.ROPE, device="cuda", generator=g).to(bp.DTYPE)
    idx = torch.tensor(sorted({0, b // 2, b - 1}), device="cuda")
    sub = (q[idx], pool, bt, seq[idx], lens[idx], bp.MLA_SCALE, bp.RK)
    ref = paged_mla_attention_ref(*sub)
    same = paged_mla_attention_ref(*sub, upcast=False)
    workspace = torch.zeros(bp.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    status = 0
    for name in impls:
        peer = name.split("-")[0]
        if peer != "cp" and not bp.available(versions, peer):
            print(f"{name}: skipped: {versions.get(peer)}", flush=True)
            continue
        pick = bp._identity
        if name == "cp":
            fn = partial(paged_mla_attention, q, pool, bt, seq, lens, scale=bp.MLA_SCALE,
                         kv_lora_rank=bp.RK)  # fmt: skip
        elif name == "FlashMLA":
            fn, pick = bp._flashmla_fn(pool, q, bt, lens)
        else:
            fn = bp._flashinfer_mla_fn(name.split("-")[1], pool, q, bt, lens, workspace)
        try:
            out, lse = pick(fn())
            check = bp.compare(out[idx], lse[idx], ref, same)
            fn()  # warm: the launch profiled below is the third
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            bp._clear_cuda_error()
            print(f"{name}: ERROR {bp._first_line(e)}", flush=True)
            status |= name == "cp"
            continue
        if not check["ok"]:
            print(f"{name}: CHECK FAILED {check}", flush=True)
            status |= name == "cp"
            continue
        torch.cuda.nvtx.range_push("profile")
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"{name}: checked (out err {check['err_out']:.2e}, lse base {check['lse_base']}),"
              f" launched in NVTX range 'profile' (h={heads} bs={bs} B={b} ctx={c})",
              flush=True)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
