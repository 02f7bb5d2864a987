"""Paged-cache inputs for decode kernel tests."""

from __future__ import annotations

import torch

__all__ = ["scattered_block_table"]


def scattered_block_table(
    lens: list[int], block_size: int, generator: torch.Generator, spare: int = 2
) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
    """A block table whose rows own just enough blocks for ``lens`` tokens each, drawn in a
    random order from a pool with ``spare`` blocks more: (block table [R, M] int32, the pool's
    block count, each row's flat slots ``block * block_size + offset`` for its tokens, int64)."""
    need = [-(-int(n) // block_size) for n in lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=generator)
    bt = torch.zeros(len(lens), max(1, *need), dtype=torch.int32)
    slots, used = [], 0
    for r, (n, k) in enumerate(zip(lens, need, strict=True)):
        bt[r, :k] = perm[used : used + k].to(torch.int32)
        used += k
        pos = torch.arange(int(n))
        slots.append(bt[r, pos // block_size].to(torch.int64) * block_size + pos % block_size)
    return bt, num_blocks, slots
