"""Tiles and split counts of the decode kernels (re-exported by
:mod:`cp_modules.kernels.decode.paged`, whose kernel they were first written for)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "DecodeConfig",
    "choose_mla_num_splits",
    "choose_num_splits",
    "default_config",
    "mla_default_config",
]

# Splits are never shorter than this many tokens: shorter ones cost more in the merge than
# they win in parallelism.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64
# MLA with few heads per program is bandwidth-bound and wants every SM's program slots busy,
# which at B = 1 takes more splits than GQA's cap (the merge reads the partials in chunks).
_MLA_MAX_SPLITS = 256
# Fixed cost of one MLA split program (loading Q, writing and merging its fp32 partial
# output), in units of one 64-token latent tile.
_SPLIT_COST_TILES = 5


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes and launch parameters of the split kernel.

    ``split_scores`` (MLA only): spread the score tile over the warps by columns instead of
    computing it in every warp group; None picks it from the tile (64 heads on 8 warps).
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    split_scores: bool | None = None


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


@functools.lru_cache(maxsize=256)
def default_config(group: int, dk: int, dv: int, dpe: int, split: bool = True) -> DecodeConfig:
    """Tiles for ``group`` rows per KV head (query heads per KV head times the queries of a
    run, see :func:`paged_attention_kernel`'s ``query_len``) and these head dims.

    A rope part (``dpe > 0``) means the MLA kernel: :func:`mla_default_config`. ``split``
    says whether the KV range is cut into several splits (see :func:`choose_num_splits`); the
    head tile does not depend on it, so the split count can be chosen first.

    Why these tiles (measured): ``docs/switch-points.md``.
    """
    if dpe > 0:
        return mla_default_config(group)
    block_h = min(64, max(16, _pow2(group)))
    if dk + dpe > 256 or dv > 256:
        # Wide rows: a [BLOCK_H, Dv] fp32 accumulator lives in registers, so keep the head
        # tile small and give it more warps.
        return DecodeConfig(block_h=min(block_h, 32), block_n=32, num_warps=8, num_stages=2)
    if max(dk, dv) > 128:
        return DecodeConfig(block_h=block_h, block_n=32, num_warps=4, num_stages=3)
    if not split:
        return DecodeConfig(block_h=block_h, block_n=128, num_warps=8, num_stages=2)
    return DecodeConfig(block_h=block_h, block_n=64, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=64)
def mla_default_config(heads: int) -> DecodeConfig:
    """MLA tiles (latent 576 in / 512 out) for ``heads`` query heads.

    The [BLOCK_H, 512] fp32 accumulator fills half the register file at 64 heads, so 64 heads
    take 8 warps (two warp groups, each holding half of the output columns; the tensor-core
    tile is 64 rows high). Q (72 KiB) and two 64-token latent tiles (2 x 72 KiB) fill shared
    memory. Measurements: ``docs/switch-points.md``.
    """
    block_h = min(64, max(16, _pow2(heads)))
    if block_h >= 64:
        return DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    return DecodeConfig(block_h=block_h, block_n=64, num_warps=4, num_stages=2)


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def choose_num_splits(
    num_programs: int, max_kv_len: int, num_sms: int, programs_per_sm: int | None = None
) -> int:
    """KV splits for ``num_programs`` (query, head-tile) programs from static quantities only.

    Aims at about two waves of programs over the SMs (a bf16/fp16 cache: one split once the
    programs fill the SMs), or at ``programs_per_sm`` programs per SM when given (an fp8 cache,
    :data:`FP8_PROGRAMS_PER_SM`), never cuts the longest addressable range (``max_kv_len``,
    from the block table's width) into pieces shorter than ``_MIN_SPLIT_TOKENS``, and caps the
    count at ``_MAX_SPLITS``.
    """
    if num_programs <= 0 or (programs_per_sm is None and num_programs >= num_sms):
        return 1
    want = triton.cdiv((programs_per_sm or 2) * num_sms, num_programs)
    cap = max(1, triton.cdiv(max_kv_len, _MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, _MAX_SPLITS))


def _split_buffers(
    out: torch.Tensor, lse: torch.Tensor, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], tuple[int, int, int]]:
    """Where the split programs write: ``out``/``lse`` themselves, or fp32 partials."""
    if num_splits == 1:
        return out, lse, (out.stride(0), out.stride(1), 0), (lse.stride(0), lse.stride(1), 0)
    t, hq, dv = out.shape
    o_buf = torch.empty(t, hq, num_splits, dv, dtype=torch.float32, device=out.device)
    l_buf = torch.empty(t, hq, num_splits, dtype=torch.float32, device=out.device)
    so = (o_buf.stride(0), o_buf.stride(1), o_buf.stride(2))
    sl = (l_buf.stride(0), l_buf.stride(1), l_buf.stride(2))
    return o_buf, l_buf, so, sl


@functools.lru_cache(maxsize=1024)
def choose_mla_num_splits(
    num_programs: int,
    max_kv_len: int,
    num_sms: int,
    block_n: int = 64,
    programs_per_sm: int = 1,
    split_cost_tiles: float = _SPLIT_COST_TILES,
    merge_tiles_per_split: float = 0.0,
) -> int:
    """KV splits for MLA's ``num_programs`` (query, head-tile) programs, static shapes only.

    ``programs_per_sm`` MLA programs run per SM at a time (:func:`~.mla.mla_programs_per_sm`). The
    count is the fewest splits whose estimated makespan (waves x (tiles per split + a fixed
    cost per program) + a merge tail) is within 2 % of the best, splits no shorter than
    ``_MIN_SPLIT_TOKENS`` and at most ``_MLA_MAX_SPLITS``. The fixed cost per split program is
    ``split_cost_tiles`` tiles (loading Q, writing its partial, the separate merge); a kernel
    whose last program of a row merges the others' partials itself pays
    ``merge_tiles_per_split`` tiles per extra split once per row (0 for the separate merge,
    which spreads over the whole GPU). Memoised: it runs on every eager decode call.
    """
    if num_programs <= 0:
        return 1
    slots = num_sms * max(1, programs_per_sm)
    tiles = triton.cdiv(max(1, max_kv_len), block_n)
    cap = max(1, min(_MLA_MAX_SPLITS, triton.cdiv(max_kv_len, _MIN_SPLIT_TOKENS)))
    costs = []
    for s in range(1, cap + 1):
        waves = triton.cdiv(num_programs * s, slots)
        fixed = split_cost_tiles if s > 1 else 1
        costs.append(waves * (triton.cdiv(tiles, s) + fixed) + merge_tiles_per_split * (s - 1))
    best = min(costs)
    return next(s for s, c in enumerate(costs, 1) if c <= best * 1.02)


@triton.jit
def split_range(KV_LEN, t, max_kv_len, num_splits, split, BLOCK_N: tl.constexpr):
    """(kv_len, start, end) of query ``t``'s split ``split``: its visible length (clamped to
    the block table's capacity) and the equal, tile-aligned share ``[start, end)`` of it."""
    kv_len = tl.maximum(tl.minimum(tl.load(KV_LEN + t).to(tl.int32), max_kv_len), 0)
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    return kv_len, start, tl.minimum(start + chunk, kv_len)


@triton.jit
def tile_slots(bt_row, n0, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(n_mask, blk, pos) of the tile of tokens ``[n0, n0 + BLOCK_N)`` of a block-table row:
    which are before ``end``, each token's physical block (int64; one scalar when the tile lies
    in one block, ``PAGE % BLOCK_N == 0``) and its position in that block (int64)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    if PAGE % BLOCK_N == 0:
        blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
        pos = (n0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        pos = (offs_n % PAGE).to(tl.int64)
    return n_mask, blk, pos


@triton.jit
def store_lse(l_ptrs, lse2, mask, PARTIAL: tl.constexpr):
    """A program's base-2 LSEs: as they are for the split merge (``PARTIAL``), else in base e."""
    if PARTIAL:
        tl.store(l_ptrs, lse2, mask=mask)
    else:
        tl.store(l_ptrs, lse2 * 0.6931471805599453, mask=mask)
