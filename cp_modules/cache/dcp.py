"""DCP sharding of a paged KV cache: which rank stores a token, where, and how many.

Shape letters: T = tokens (new tokens or queries), R = block-table rows (requests),
M = block-table entries per row (virtual blocks per request).

With ``D`` DCP ranks and interleave ``I``, the token at global position ``p`` of a request lives on
rank ``(p // I) % D``: runs of ``I`` consecutive tokens are dealt to the ranks in turn. A rank
addresses its tokens through *virtual blocks* of ``block_size * D`` positions: the block-table
entry ``p // (block_size * D)`` names a physical block id that every rank has, and each rank's
block of that id holds the ``block_size`` tokens of that virtual block that it owns, at local
offset ``(p % (block_size * D)) // (D * I) * I + p % I``. The block table is therefore the same
on every DCP rank; only the slot mapping (and so the cache contents) differ.

Local tokens keep the global order, so a query at global position ``g`` on rank ``r`` sees
exactly the first ``local_seq_len(g + 1, D, r, I)`` local tokens of its request.

Every function here works on Python ints and on integer tensors (on any device, without host
syncs), so the scheduler and the compiled decode step share one implementation.
"""

from __future__ import annotations

from typing import TypeVar

import torch

__all__ = [
    "dcp_local_offset",
    "dcp_max_local_len",
    "dcp_num_blocks",
    "dcp_query_kv_len",
    "dcp_rank_of",
    "dcp_scheduler_block_size",
    "dcp_slot_mapping",
    "local_seq_len",
]

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_rank(dcp_size: int, dcp_rank: int) -> None:
    _check_positive("dcp_size", dcp_size)
    if isinstance(dcp_rank, bool) or not isinstance(dcp_rank, int) or not 0 <= dcp_rank < dcp_size:
        raise ValueError(
            f"dcp_rank must be an integer in [0, {dcp_size - 1}] for dcp_size={dcp_size}, "
            f"got {dcp_rank!r}"
        )


def _check_interleave(interleave: int, block_size: int | None = None) -> None:
    _check_positive("interleave", interleave)
    if block_size is not None and (interleave > block_size or block_size % interleave):
        valid = [d for d in range(1, block_size + 1) if block_size % d == 0]
        raise ValueError(
            f"interleave={interleave} must be <= block_size={block_size} and divide it; "
            f"valid values: {valid}"
        )


def local_seq_len(
    seq_len: IntOrTensor, dcp_size: int, dcp_rank: int, interleave: int = 1
) -> IntOrTensor:
    """Number of the first ``seq_len`` tokens of a request that DCP rank ``dcp_rank`` stores.

    Full rounds of ``dcp_size * interleave`` tokens give every rank ``interleave`` tokens; the
    remainder is handed out ``interleave`` at a time from rank 0.

    Args:
        seq_len: global length(s), an int or an integer tensor of any shape (>= 0).
        dcp_size: DCP group size ``D``.
        dcp_rank: shard index in ``[0, D)``.
        interleave: tokens per run ``I``.

    Returns:
        An int for an int input, else a tensor of ``seq_len``'s shape, dtype and device.

    Raises:
        ValueError: for a size, rank or interleave out of range.
    """
    _check_rank(dcp_size, dcp_rank)
    _check_interleave(interleave)
    round_len = dcp_size * interleave
    base = seq_len // round_len * interleave
    rest = seq_len - base * dcp_size - dcp_rank * interleave
    if isinstance(rest, torch.Tensor):
        return base + rest.clamp(0, interleave)
    return base + min(max(rest, 0), interleave)


def dcp_query_kv_len(
    positions: torch.Tensor, dcp_size: int = 1, dcp_rank: int = 0, interleave: int = 1
) -> torch.Tensor:
    """Local cached tokens each query may attend: ``local_seq_len(position + 1, ...)``.

    A query at global position ``g`` attends keys ``0..g`` (its own key included, written to the
    cache before attention). On a DCP rank these are the first ``local_seq_len(g + 1)`` local
    tokens; note that ``local(G - k) != local(G) - k`` in general, which is why this is computed
    per query rather than by subtracting offsets.

    Args:
        positions: [T] integer global positions of the queries (>= 0).
        dcp_size, dcp_rank, interleave: the DCP layout (defaults: no sharding).

    Returns:
        [T] int32 on ``positions``' device.
    """
    return local_seq_len(positions.to(torch.int32) + 1, dcp_size, dcp_rank, interleave)


def dcp_max_local_len(seq_len: IntOrTensor, dcp_size: int, interleave: int = 1) -> IntOrTensor:
    """Most tokens any rank stores of a length-``seq_len`` request: ``ceil(L / (D*I)) * I``.

    It bounds rank 0's share (the largest) without a host sync, e.g. for workspace sizing.
    """
    _check_positive("dcp_size", dcp_size)
    _check_interleave(interleave)
    round_len = dcp_size * interleave
    return (seq_len + round_len - 1) // round_len * interleave


def dcp_scheduler_block_size(block_size: int, dcp_size: int) -> int:
    """Tokens of a request covered by one block-table entry: ``block_size * D``.

    Each entry names one physical block on every DCP rank, so the scheduler (and its memory
    accounting) sees blocks ``D`` times larger than a rank's physical block.
    """
    _check_positive("block_size", block_size)
    _check_positive("dcp_size", dcp_size)
    return block_size * dcp_size


def dcp_num_blocks(seq_len: IntOrTensor, block_size: int, dcp_size: int = 1) -> IntOrTensor:
    """Block-table entries (= physical blocks allocated on every rank) for ``seq_len`` tokens."""
    vb = dcp_scheduler_block_size(block_size, dcp_size)
    return (seq_len + vb - 1) // vb


def dcp_rank_of(positions: IntOrTensor, dcp_size: int, interleave: int = 1) -> IntOrTensor:
    """DCP rank that stores the token at each global position: ``(p // I) % D``."""
    _check_positive("dcp_size", dcp_size)
    _check_interleave(interleave)
    return positions // interleave % dcp_size


def dcp_local_offset(
    positions: IntOrTensor, block_size: int, dcp_size: int, interleave: int = 1
) -> IntOrTensor:
    """Offset inside its rank's physical block of the token at each global position.

    ``(p % (block_size * D)) // (D * I) * I + p % I``.
    """
    _check_positive("dcp_size", dcp_size)
    _check_interleave(interleave, block_size)
    vb = block_size * dcp_size
    return positions % vb // (dcp_size * interleave) * interleave + positions % interleave


def dcp_slot_mapping(
    positions: torch.Tensor,
    block_table_rows: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> torch.Tensor:
    """Cache slot (``block_id * block_size + offset``) of each new token on this rank, or -1.

    A token gets -1 when another DCP rank stores it, when its position is negative (padding
    tokens of a statically shaped batch) or when it lies beyond the ``M`` virtual blocks of its
    row (checking that would need a host sync; dropping the write is safer than corrupting a
    neighbour's block). Vectorised and sync-free.

    Args:
        positions: [T] integer global positions of the new tokens.
        block_table_rows: [T] integer row of ``block_table`` (request) of each token.
        block_table: [R, M] integer physical block ids, one per virtual block of
            ``block_size * dcp_size`` positions; the same on every DCP rank.
        block_size: tokens per physical block.
        dcp_size, dcp_rank, interleave: the DCP layout.

    Returns:
        [T] int64 slots on ``positions``' device.

    Raises:
        ValueError: for a layout out of range or mismatched shapes.
    """
    _check_rank(dcp_size, dcp_rank)
    _check_interleave(interleave, block_size)
    if positions.dim() != 1 or block_table_rows.shape != positions.shape:
        raise ValueError(
            f"positions and block_table_rows must both be [T]; got {tuple(positions.shape)} "
            f"and {tuple(block_table_rows.shape)}"
        )
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, M], got shape {tuple(block_table.shape)}")
    pos = positions.to(torch.int64)
    vb = block_size * dcp_size
    valid = (pos >= 0) & (pos < block_table.shape[1] * vb)
    pos = pos.clamp(0, block_table.shape[1] * vb - 1)
    entry = pos // vb
    block_ids = block_table[block_table_rows.to(torch.int64), entry].to(torch.int64)
    offsets = dcp_local_offset(pos, block_size, dcp_size, interleave)
    mine = valid & (dcp_rank_of(pos, dcp_size, interleave) == dcp_rank)
    return torch.where(mine, block_ids * block_size + offsets, torch.full_like(pos, -1))
