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
import inspect
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from triton.testing import do_bench

from benchmarks.common import RESULTS
from cp_modules.cache import (
    dcp_max_local_len,
    dcp_num_blocks,
    kv_cache_bytes_per_block,
    local_seq_len,
)
from cp_modules.kernels.decode.mla import (
    choose_mla_num_splits,
    mla_programs_per_sm,
    paged_mla_attention_kernel,
)
from cp_modules.kernels.decode.paged import (
    DecodeConfig,
    choose_num_splits,
    default_config,
    paged_attention_kernel,
)
from cp_modules.reference.paged_decode import (
    paged_attention_ref,
    paged_mla_attention_ref,
)

try:  # flex_attention's auxiliary-output request; releases without it take return_lse=True
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None
# Query-side block lists serve backward only; skip building them where the API allows.
_NO_Q_BLOCKS = (
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)

BATCHES = (1, 8, 64, 256)
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
CACHE_LIMIT_BYTES = 40e9
BLOCK_SIZE = 64
DTYPE = torch.bfloat16
GQA_HQ, GQA_HKV, GQA_D = 32, 8, 128
MLA_H, MLA_RK, MLA_ROPE = 128, 512, 64
TIME_BUDGET_S = 170.0  # optional sections (SDPA, DCP emulation, sweep) are skipped past this
DEVICE = "cuda"
DCP_BATCH, DCP_LENGTH = 8, 131072
SWEEP_SHAPES = ((64, 16384), (1, 131072))
# MLA with fewer query heads per GPU (DeepSeek's 128 split by tensor parallelism, or gathered
# from a smaller DCP group): the FLOP per KV byte falls with the heads, and with them whether
# the kernel is compute- or bandwidth-bound.
MLA_HEAD_SHAPES = ((1, 131072), (8, 131072), (64, 32768), (256, 16384))
FLEX_BATCHES = (1, 8, 64)
FLEX_CONTEXTS = (16384, 131072)
FLEX_BUDGET_S = 30.0  # per model: wall time the flex comparison may add, compiles included
FLEX_Q_BLOCK = 128  # the block mask's query block: flex_decoding needs a multiple of its BLOCK_M


class Model:
    """One attention flavour: its cache, kernel, reference and byte/FLOP counts."""

    def __init__(self, name: str, heads: int | None = None):
        self.name = name
        self.mla = name == "mla"
        if self.mla:
            self.heads, self.dq, self.dv = heads or MLA_H, MLA_RK + MLA_ROPE, MLA_RK
            self.scale = (128 + MLA_ROPE) ** -0.5
            bpb = kv_cache_bytes_per_block(
                BLOCK_SIZE, kv_lora_rank=MLA_RK, rope_dim=MLA_ROPE, dtype=DTYPE
            )
        else:
            self.heads, self.dq, self.dv = GQA_HQ, GQA_D, GQA_D
            self.scale = GQA_D**-0.5
            bpb = kv_cache_bytes_per_block(
                BLOCK_SIZE, num_kv_heads=GQA_HKV, head_dim=GQA_D, dtype=DTYPE
            )
        self.bytes_per_block = bpb
        self.bytes_per_token = bpb // BLOCK_SIZE
        self.caches: tuple[torch.Tensor, ...] = ()

    def allocate(self, num_blocks: int) -> None:
        self.caches = ()
        torch.cuda.empty_cache()
        if self.mla:
            shape = (num_blocks, BLOCK_SIZE, MLA_RK + MLA_ROPE)
            self.caches = (torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(),)
        else:
            shape = (num_blocks, BLOCK_SIZE, GQA_HKV, GQA_D)
            self.caches = tuple(
                torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_() for _ in range(2)
            )

    def kernel(self, q, bt, seq, kv_len, splits=None, config=None):
        if self.mla:
            return paged_mla_attention_kernel(
                q, self.caches[0], bt, seq, kv_len, self.scale, MLA_RK, splits, config=config
            )
        return paged_attention_kernel(
            q, *self.caches, bt, seq, kv_len, self.scale, splits, config=config
        )

    def reference(self, q, bt, seq, kv_len, upcast=True):
        if self.mla:
            return paged_mla_attention_ref(
                q, self.caches[0], bt, seq, kv_len, self.scale, MLA_RK, upcast=upcast
            )
        return paged_attention_ref(q, *self.caches, bt, seq, kv_len, self.scale, upcast=upcast)

    def kv_bytes(self, kv_len: torch.Tensor) -> float:
        return float(kv_len.double().sum()) * self.bytes_per_token

    def flops(self, kv_len: torch.Tensor) -> float:
        return float(kv_len.double().sum()) * self.heads * 2 * (self.dq + self.dv)

    def default_config(self, split: bool = True) -> DecodeConfig:
        """The kernel's own tiles (GQA's depend on whether the KV range is split)."""
        if self.mla:
            return default_config(self.heads, MLA_RK, MLA_RK, MLA_ROPE)
        return default_config(GQA_HQ // GQA_HKV, GQA_D, GQA_D, 0, split)

    def num_programs(self, batch: int, cfg: DecodeConfig) -> int:
        group = self.heads if self.mla else GQA_HQ // GQA_HKV
        kv_heads = 1 if self.mla else GQA_HKV
        return batch * kv_heads * triton.cdiv(group, cfg.block_h)


def make_inputs(model: Model, batch: int, kv_len: int, table_len: int | None = None, seed=0):
    """Queries, a scrambled block table over the whole cache and per-query lengths."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    table_len = table_len or kv_len
    width = triton.cdiv(table_len, BLOCK_SIZE)
    num_blocks = model.caches[0].shape[0]
    assert batch * width <= num_blocks
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g)[: batch * width]
    bt = perm.view(batch, width).to(torch.int32)
    q = torch.randn(batch, model.heads, model.dq, device=DEVICE, generator=g).to(DTYPE)
    seq = torch.arange(batch, device=DEVICE, dtype=torch.int32)
    lens = torch.full((batch,), kv_len, device=DEVICE, dtype=torch.int32)
    return q, bt, seq, lens


def check(model: Model, q, bt, seq, kv_len, out, lse) -> dict:
    """Kernel vs fp32 reference on a few queries, bounded by 2x the same-dtype error."""
    idx = torch.tensor(sorted({0, q.shape[0] // 2, q.shape[0] - 1}), device=DEVICE)
    sub = (q[idx], bt, seq[idx], kv_len[idx])
    ref_out, ref_lse = model.reference(*sub)
    same_out, same_lse = model.reference(*sub, upcast=False)
    err_out = (out[idx].float() - ref_out.float()).abs().max().item()
    err_lse = (lse[idx] - ref_lse).abs().max().item()
    base_out = (same_out.float() - ref_out.float()).abs().max().item()
    base_lse = (same_lse - ref_lse).abs().max().item()
    ok = (
        math.isfinite(err_out) and err_out <= 2 * base_out + 1e-4 and err_lse <= 2 * base_lse + 1e-4
    )
    return {
        "ok": bool(ok),
        "err_out": err_out,
        "err_lse": err_lse,
        "same_dtype_err_out": base_out,
        "same_dtype_err_lse": base_lse,
    }


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def bench_ms(fn) -> float:
    return float(do_bench(fn, warmup=5, rep=30, return_mode="median"))


def graph_ms(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: the device time without the eager
    launch path (Python, allocations, Triton's dispatch), which decode hides the same way."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = bench_ms(graph.replay)
    del graph
    return ms


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


def flex_paged_block_mask(
    block_table: torch.Tensor,
    kv_len: torch.Tensor,
    page_size: int,
    num_physical_blocks: int,
    device,
    *,
    full_blocks: bool = False,
    q_block: int = FLEX_Q_BLOCK,
):
    """A FlexAttention BlockMask for one decode query per row over the physical paged KV.

    Query ``b`` attends the first ``kv_len[b]`` tokens of its row ``block_table[b]``; the KV is the
    whole cache seen as one sequence of ``num_physical_blocks * page_size`` tokens (KV batch 1,
    broadcast over the query batch), so nothing is gathered. The mask's KV block is the page:
    row ``b`` lists its pages in logical order, and its mask_mod maps a physical KV index back to
    the logical position through an inverse page table ([B, num_physical_blocks + 1] int32, -1 for
    pages the row does not own), so the mask_mod alone is also a correct dense mask.

    ``full_blocks=False`` lists every page as a partial block (mask_mod evaluated everywhere);
    ``True`` lists the pages wholly inside ``kv_len`` as full blocks and only the tail page as
    partial. flex_decoding splits full blocks over the whole physical KV length
    (TILE_KV = cdiv(KV_LEN, SPLIT_KV)) but partial ones over the row's own pages, so with several
    KV splits (small batches) the partial-only form is the one that spreads the work.
    """
    bt = block_table.to(device=device, dtype=torch.int64)
    batch, width = bt.shape
    if width > num_physical_blocks:
        raise ValueError(
            f"block table has {width} columns but the cache {num_physical_blocks} blocks"
        )
    lens = kv_len.to(device=device, dtype=torch.int64).clamp(0, width * page_size)
    pages = (lens + page_size - 1) // page_size
    col = torch.arange(width, device=device)
    live = col[None, :] < pages[:, None]
    phys = torch.where(live, bt, 0)  # dead slots are never read (past the row's block count)

    # Inverse page table; dead slots scatter into the spare last column.
    inv = torch.full((batch, num_physical_blocks + 1), -1, dtype=torch.int32, device=device)
    inv.scatter_(
        1,
        torch.where(live, bt, num_physical_blocks),
        torch.where(live, col[None, :], -1).to(torch.int32),
    )
    lens32 = lens.to(torch.int32)

    def paged_mask(b, h, q_idx, kv_idx):
        logical = inv[b, kv_idx // page_size]
        pos = logical * page_size + kv_idx % page_size
        return (logical >= 0) & (pos < lens32[b])

    def indices(num, cols):
        idx = torch.zeros(batch, 1, 1, num_physical_blocks, dtype=torch.int32, device=device)
        idx[:, 0, 0, : cols.shape[1]] = cols.to(torch.int32)
        return num.to(torch.int32).view(batch, 1, 1), idx

    if full_blocks:
        n_full = lens // page_size
        full_num, full_idx = indices(n_full, phys)
        tail = phys.gather(1, n_full.clamp(max=width - 1)[:, None])
        part_num, part_idx = indices(pages - n_full, tail)
    else:
        part_num, part_idx = indices(pages, phys)
        full_num = full_idx = None
    return BlockMask.from_kv_blocks(
        part_num,
        part_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(q_block, page_size),
        mask_mod=paged_mask,
        seq_lengths=(1, num_physical_blocks * page_size),
        **_NO_Q_BLOCKS,
    )


def flex_paged_kv(caches: tuple[torch.Tensor, ...], kv_lora_rank: int | None = None):
    """Key/value views of the paged cache as one KV sequence: [1, Hkv, NB * BS, D], no copy.

    GQA: ``caches = (k, v)`` of [NB, BS, Hkv, D] (a transpose view). MLA (``kv_lora_rank``
    given): ``caches = (latent,)`` of [NB, BS, R + P]; the key is the whole row, the value its
    first R elements.
    """
    if kv_lora_rank is not None:
        (latent,) = caches
        nb, bs, width = latent.shape
        key = latent.view(1, 1, nb * bs, width)
        return key, key[..., :kv_lora_rank]
    k, v = caches
    nb, bs, hkv, _ = k.shape
    return tuple(c.view(1, nb * bs, hkv, c.shape[-1]).transpose(1, 2) for c in (k, v))


def flex_paged_decode(attn, q, key, value, block_mask, scale, with_lse=True, kernel_options=None):
    """One decode query per request through ``attn`` (flex_attention, compiled or not):
    q [B, Hq, Dqk] -> out [B, Hq, Dv] and lse [B, Hq] (natural log; None unless ``with_lse``:
    compiled flex on CPU does not return it)."""
    qf = q.unsqueeze(2)  # [B, Hq, 1, D]: query batch B, KV batch 1 broadcast through the mask
    kw = dict(block_mask=block_mask, scale=scale, enable_gqa=True)
    if kernel_options:
        kw["kernel_options"] = kernel_options
    if not with_lse:
        return attn(qf, key, value, **kw).squeeze(2), None
    if AuxRequest is not None:
        out, aux = attn(qf, key, value, **kw, return_aux=AuxRequest(lse=True))
        lse = aux.lse
    else:
        out, lse = attn(qf, key, value, **kw, return_lse=True)
    return out.squeeze(2), lse.squeeze(2)


FLEX_KERNEL_OPTIONS = (None, {"BLOCK_N": 64}, {"BLOCK_N": 32, "num_stages": 1})


def run_flex_shape(model: Model, batch: int, ctx: int, ours_out: torch.Tensor | None) -> dict:
    """Compiled FlexAttention over the physical paged cache through a block mask (no gather).

    Two block-mask forms (see ``flex_paged_block_mask``): every page partial, and whole pages as
    full blocks with the tail page partial. Each is compiled on its own (dynamo state reset, so
    no recompile limit can send a call back to eager), checked like our kernel and only then
    timed, eagerly (``ms``) and replayed from a CUDA graph (``graph_ms``); ``mask_ms`` is the
    time to build the mask, ``compile_s`` that of the first call.
    """
    q, bt, seq, kv_len = make_inputs(model, batch, ctx)
    # Flex reads its own pool holding exactly the batch's pages, in a fresh scrambled order
    # (copied outside any timing; same values, so ``check`` against the big cache holds). With
    # the whole benchmark cache as the pool, the KV sequence exceeds 2**31 elements and the
    # flex_decoding template of torch 2.11 fails to compile in its 64-bit index path
    # ("Ternary expression with dynamic condition has inconsistent types int64 and int32").
    flat = bt.long().flatten()
    per_token = model.caches[0][0, 0].numel()
    if flat.numel() * BLOCK_SIZE * per_token >= 2**31:
        return {
            "batch": batch,
            "context": ctx,
            "skipped": "pool over 2**31 elements: flex_decoding's 64-bit index path does not "
            "compile in this torch (int64/int32 ternary)",
        }
    g = torch.Generator(device=DEVICE).manual_seed(1)
    slot = torch.randperm(flat.numel(), device=DEVICE, generator=g)
    pool = []
    for c in model.caches:
        x = torch.empty((flat.numel(), *c.shape[1:]), dtype=c.dtype, device=DEVICE)
        x[slot] = c[flat]
        pool.append(x)
    rows = slot.view(bt.shape).to(torch.int32)[seq.long()]
    num_blocks = flat.numel()
    key, value = flex_paged_kv(tuple(pool), MLA_RK if model.mla else None)
    res: dict = {
        "batch": batch,
        "context": ctx,
        "layout": (
            f"latent cache [NB, {BLOCK_SIZE}, {MLA_RK + MLA_ROPE}] viewed as key "
            f"[1, 1, NB*{BLOCK_SIZE}, {MLA_RK + MLA_ROPE}], value its [..., :{MLA_RK}] (no copy)"
            if model.mla
            else f"k/v caches [NB, {BLOCK_SIZE}, {GQA_HKV}, {GQA_D}] viewed as "
            f"[1, {GQA_HKV}, NB*{BLOCK_SIZE}, {GQA_D}] by a transpose (no copy)"
        ),
        "query": f"[B, {model.heads}, 1, {model.dq}], KV batch 1 broadcast by the block mask",
        "block_mask_block_size": [FLEX_Q_BLOCK, BLOCK_SIZE],
        "pool": f"{num_blocks} pages holding the batch's pages in a scrambled order",
    }
    best = None
    for variant, full in (("partial", False), ("full", True)):
        entry: dict = {}
        errors = []
        # Flex's own tile choice first; if its kernel does not compile for this shape, KV
        # tiles no larger than the page (the mask's KV block), then smaller and single-staged.
        for options in FLEX_KERNEL_OPTIONS:
            torch._dynamo.reset()
            entry = {"kernel_options": options}
            try:
                mask = flex_paged_block_mask(
                    rows, kv_len, BLOCK_SIZE, num_blocks, DEVICE, full_blocks=full
                )
                entry["mask_ms"] = bench_ms(
                    lambda full=full: flex_paged_block_mask(
                        rows, kv_len, BLOCK_SIZE, num_blocks, DEVICE, full_blocks=full
                    )
                )
                attn = torch.compile(flex_attention, dynamic=False, fullgraph=True)

                def call(attn=attn, mask=mask, options=options):
                    return flex_paged_decode(
                        attn, q, key, value, mask, model.scale, kernel_options=options
                    )

                t0 = time.monotonic()
                out, lse = call()
                torch.cuda.synchronize()
                entry["compile_s"] = time.monotonic() - t0
                break
            except Exception as e:  # noqa: BLE001 - a shape flex cannot serve is a result here
                text = " ".join(str(e).split())
                errors.append(f"{options}: {type(e).__name__}: {text[:300]} ... {text[-500:]}")
                entry = {}
            finally:
                torch.cuda.empty_cache()
        if errors:
            entry["failed_attempts"] = errors
        if "compile_s" not in entry:
            res[variant] = {**entry, "error": errors[-1][:200]}
            continue
        entry["check"] = check(model, q, bt, seq, kv_len, out, lse)
        if ours_out is not None:
            entry["max_abs_diff_vs_ours"] = (out.float() - ours_out.float()).abs().max().item()
        if entry["check"]["ok"]:
            ms = bench_ms(call)
            entry.update(ms=ms, kv_tbps=model.kv_bytes(kv_len) / ms / 1e9)
            if best is None or ms < best[1]:
                best = (variant, ms)
            try:  # device time, as graph_ms of our kernels (no dispatch or guard overhead)
                gms = graph_ms(call)
                entry.update(graph_ms=gms, graph_kv_tbps=model.kv_bytes(kv_len) / gms / 1e9)
            except Exception as e:  # noqa: BLE001 - a call that cannot be captured is a result
                entry["graph_error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        res[variant] = entry
        del mask, call, out, lse
    if best is not None:
        res["best"] = best[0]
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return res


def _flex_summary(entry: dict) -> str:
    if "kv_tbps" in entry:
        graph = f"{entry['graph_kv_tbps']:.2f}" if "graph_kv_tbps" in entry else "-"
        return f"{entry['kv_tbps']:.2f} TB/s, graph {graph} TB/s (mask {entry['mask_ms']:.2f} ms)"
    return entry.get("error") or f"FAILED CHECK {entry.get('check')}"


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
