"""Which cache slots a DCP rank reads for the cached prefixes of a step, and where each
prefix token lands after the all-gather (host numpy; :func:`cp_modules.step.build_step_metadata`
turns them into the step's ``prefix_read`` / ``prefix_index``)."""

from __future__ import annotations

import numpy as np
import torch

from cp_modules.cache.dcp import local_seq_len

__all__ = ["local_index", "prefix_gather_plan"]


def prefix_gather_plan(
    prefix_len: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    prefix_start: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Slots this rank reads for the cached prefixes, and where each prefix token lands.

    Request ``r``'s prefix is its positions ``[prefix_start[r], prefix_start[r] +
    prefix_len[r])`` (start 0 by default: the whole context; a sliding window reads only its
    last keys). A rank's local tokens of a request fill its physical blocks in order (local
    token ``j`` is in block-table entry ``j // block_size`` at offset ``j % block_size``), so
    reading is a gather by slot. Every rank reads the same padded count ``Lp`` (the largest
    rank's share), all-gathers, and ``gather_index`` picks prefix position ``p`` of each
    request from rank ``(p // I) % D`` at row ``rank * Lp + offset_of_request_on_rank +
    local_index - first_local_index``.
    """
    d, r, i = dcp_size, dcp_rank, interleave
    start = np.zeros_like(prefix_len) if prefix_start is None else prefix_start
    first = torch.from_numpy(start)
    stop = torch.from_numpy(start + prefix_len)
    local_lo = np.stack([local_seq_len(first, d, k, i).numpy() for k in range(d)])  # [D, R]
    local_counts = np.stack([local_seq_len(stop, d, k, i).numpy() for k in range(d)]) - local_lo
    padded = int(local_counts.sum(1).max())
    req_offsets = np.concatenate(
        [np.zeros((d, 1), np.int64), np.cumsum(local_counts, 1)[:, :-1]], 1
    )
    # This rank's read slots, request by request.
    mine = local_counts[r]
    req = np.repeat(np.arange(prefix_len.size), mine)
    j = local_lo[r, req] + np.arange(mine.sum()) - np.repeat(np.cumsum(mine) - mine, mine)
    read = block_table[req, j // block_size].astype(np.int64) * block_size + j % block_size
    read = np.concatenate([read, np.zeros(padded - read.size, np.int64)])
    # Where each prefix position comes from.
    preq = np.repeat(np.arange(prefix_len.size), prefix_len)
    p = (
        start[preq]
        + np.arange(prefix_len.sum())
        - np.repeat(np.cumsum(prefix_len) - prefix_len, prefix_len)
    )
    owner = p // i % d
    local = local_index(p, d, i) - local_lo[owner, preq]
    gather = owner * padded + req_offsets[owner, preq] + local
    return read, gather


def local_index(p: np.ndarray, d: int, i: int) -> np.ndarray:
    """Index of position ``p`` among its owner's tokens (the owner's tokens before ``p``)."""
    round_len = d * i
    return np.asarray(p // round_len * i + p % i)
