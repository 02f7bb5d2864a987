"""FlexAttention paged decode, the alternative ``bench_decode`` times next to the Triton kernels: block masks from block tables, and its timing per shape."""

from __future__ import annotations

import inspect
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from benchmarks.decode.common import (
    BLOCK_SIZE,
    DEVICE,
    FLEX_Q_BLOCK,
    GQA_D,
    GQA_HKV,
    MLA_RK,
    MLA_ROPE,
    Model,
    bench_ms,
    check,
    graph_ms,
    make_inputs,
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
