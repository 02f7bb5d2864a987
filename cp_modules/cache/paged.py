"""Paged KV cache: block allocator, block tables and cache allocation.

Shape letters: NB = physical blocks, BS = tokens per block, Hkv = KV heads, D = head dim,
R = block-table rows (requests), M = block-table entries per row.

Cache layouts:
    GQA/MHA: ``k_cache``, ``v_cache``: [NB, BS, Hkv, D]. An fp8 ``v_cache`` is stored
             token-minor (:data:`FP8_V_TOKEN_MINOR`): its storage is [NB, Hkv, D, BS]
             contiguous and the cache is that storage's ``.permute(0, 3, 1, 2)`` view, so it
             keeps the logical shape (torch code indexes it as any other) while the decode
             kernel's P @ V reads the tokens, its contraction dimension, as contiguous bytes.
    MLA:     ``cache``: [NB, BS, kv_lora_rank + rope_dim]; the latent ``kv_c`` first, then the
             shared rope key ``k_pe``, so absorbed decode reads one contiguous row per token
             (576 elements for DeepSeek-V2/V3) and uses its first ``kv_lora_rank`` as V.

With DCP of size D, a block-table entry covers ``BS * D`` positions of a request (a virtual
block) and names the same physical block id on every rank; the host-side allocator and table
below run identically on every rank of a DCP group, so they agree without communication.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from cp_modules.cache.dcp import dcp_num_blocks
from cp_modules.cache.kv_dtype import is_fp8

__all__ = [
    "BlockAllocator",
    "BlockTable",
    "NoFreeBlocksError",
    "allocate_kv_cache",
    "allocate_mla_cache",
    "dcp_token_capacity",
    "is_token_minor",
    "kv_cache_bytes_per_block",
    "num_blocks_for_memory",
    "to_token_minor",
]

# fp8 GQA/MHA value caches stored token-minor (see the module docstring); off: [NB, BS, Hkv, D]
# contiguous like every other cache. Read at every allocation. The decode kernel's value tile
# then enters P @ V as contiguous bytes along the tokens instead of one byte at a time
# (docs/experiments/2026-12-03-fp8-decode-speed.md).
FP8_V_TOKEN_MINOR = True


class NoFreeBlocksError(RuntimeError):
    """The allocator has fewer free blocks than were asked for."""


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class BlockAllocator:
    """Free list of the physical block ids ``[0, num_blocks)``.

    Blocks are handed out lowest id first and freed blocks are reused in the order they were
    freed, so the same sequence of calls gives the same ids on every rank.

    Raises:
        ValueError: for ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        _check_positive("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free block ids.

        Raises:
            ValueError: for ``n < 0``.
            NoFreeBlocksError: when fewer than ``n`` blocks are free (nothing is taken).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return block ids to the free list.

        Raises:
            ValueError: for an id that is not currently allocated (double free, out of range).
        """
        ids = list(ids)
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(
                f"cannot free blocks {bad or ids}: each id must be allocated (in "
                f"[0, {self.num_blocks})) and listed once"
            )
        self._used.difference_update(ids)
        self._free.extend(ids)


class BlockTable:
    """Block-table rows of the live requests, on the host and as an int32 device tensor.

    One entry per virtual block of ``block_size * dcp_size`` positions; entry ``j`` of a row is
    the physical block (on every DCP rank) that holds that rank's tokens of positions
    ``[j * block_size * dcp_size, (j + 1) * block_size * dcp_size)``.

    Args:
        max_num_reqs: rows ``R``.
        max_model_len: longest request; sets ``M = ceil(max_model_len / (block_size * dcp_size))``.
        block_size: tokens per physical block.
        allocator: the rank's (or the DCP group's replicated) block allocator.
        dcp_size: DCP group size.
        device: where ``tensor`` lives.

    Raises:
        ValueError: for sizes < 1.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        allocator: BlockAllocator,
        *,
        dcp_size: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        _check_positive("max_num_reqs", max_num_reqs)
        _check_positive("max_model_len", max_model_len)
        _check_positive("block_size", block_size)
        _check_positive("dcp_size", dcp_size)
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.allocator = allocator
        self.max_blocks_per_req = dcp_num_blocks(max_model_len, block_size, dcp_size)
        self.max_model_len = max_model_len
        self.tensor = torch.zeros(
            max_num_reqs, self.max_blocks_per_req, dtype=torch.int32, device=device
        )
        self._rows: list[list[int]] = [[] for _ in range(max_num_reqs)]

    def blocks(self, row: int) -> list[int]:
        """Physical block ids of ``row`` (a copy)."""
        return list(self._rows[row])

    def ensure_capacity(self, row: int, seq_len: int) -> list[int]:
        """Grow ``row`` so it covers ``seq_len`` tokens; return the newly allocated ids.

        Raises:
            ValueError: for ``seq_len`` outside ``[0, max_model_len]`` or a bad row.
            NoFreeBlocksError: when the allocator runs out (the row is left unchanged).
        """
        if not 0 <= row < len(self._rows):
            raise ValueError(f"row must be in [0, {len(self._rows) - 1}], got {row}")
        if not 0 <= seq_len <= self.max_model_len:
            raise ValueError(
                f"seq_len must be in [0, max_model_len={self.max_model_len}], got {seq_len}"
            )
        need = dcp_num_blocks(seq_len, self.block_size, self.dcp_size) - len(self._rows[row])
        if need <= 0:
            return []
        new = self.allocator.allocate(need)
        start = len(self._rows[row])
        self._rows[row].extend(new)
        self.tensor[row, start : start + need] = torch.tensor(new, dtype=torch.int32)
        return new

    def free_row(self, row: int) -> None:
        """Release every block of ``row`` and clear it."""
        self.allocator.free(self._rows[row])
        self._rows[row] = []
        self.tensor[row].zero_()


def kv_cache_bytes_per_block(
    block_size: int,
    *,
    dtype: torch.dtype,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
) -> int:
    """Bytes of one physical block on one rank, for GQA (heads, head_dim) or MLA (latent, rope).

    Raises:
        ValueError: unless exactly one of the GQA or MLA size pairs is given.
    """
    gqa = num_kv_heads is not None and head_dim is not None
    mla = kv_lora_rank is not None and rope_dim is not None
    if gqa == mla:
        raise ValueError(
            "give either num_kv_heads and head_dim (GQA/MHA) or kv_lora_rank and rope_dim (MLA)"
        )
    elem = torch.empty((), dtype=dtype).element_size()
    if num_kv_heads is not None and head_dim is not None:
        per_token = 2 * num_kv_heads * head_dim
    else:
        assert kv_lora_rank is not None and rope_dim is not None
        per_token = kv_lora_rank + rope_dim
    return block_size * per_token * elem


def num_blocks_for_memory(memory_bytes: int, bytes_per_block: int) -> int:
    """Physical blocks that fit in ``memory_bytes`` of one rank."""
    _check_positive("bytes_per_block", bytes_per_block)
    return max(0, memory_bytes) // bytes_per_block


def dcp_token_capacity(num_blocks: int, block_size: int, dcp_size: int = 1) -> int:
    """Tokens of requests the scheduler may hold with ``num_blocks`` physical blocks per rank.

    Each block-table entry covers ``block_size * dcp_size`` positions, so DCP multiplies the
    capacity the same per-rank memory gives by ``dcp_size``.
    """
    return num_blocks * block_size * dcp_size


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    v_token_minor: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed GQA/MHA caches ``k_cache, v_cache``: [NB, BS, Hkv, D] each.

    ``v_token_minor``: store ``v_cache`` token-minor (a view of [NB, Hkv, D, BS] storage,
    strides ``(Hkv * D * BS, 1, D * BS, BS)``); None: for fp8 caches as
    :data:`FP8_V_TOKEN_MINOR` says, never for others. ``k_cache`` is always contiguous.

    Raises:
        ValueError: for sizes < 1.
    """
    for name, v in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        _check_positive(name, v)
    if v_token_minor is None:
        v_token_minor = FP8_V_TOKEN_MINOR and is_fp8(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    if not v_token_minor:
        return k_cache, torch.zeros(shape, dtype=dtype, device=device)
    storage = torch.zeros(
        (num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype, device=device
    )
    return k_cache, storage.permute(0, 3, 1, 2)


def is_token_minor(cache: torch.Tensor) -> bool:
    """Whether a [NB, BS, H, D] cache is stored token-minor (its token stride is 1, BS > 1)."""
    return cache.dim() == 4 and cache.shape[1] > 1 and cache.stride(1) == 1


def to_token_minor(cache: torch.Tensor) -> torch.Tensor:
    """A token-minor copy (:func:`allocate_kv_cache`'s ``v_token_minor``) of a [NB, BS, H, D]
    cache: the same values, storage [NB, H, D, BS]."""
    return cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def allocate_mla_cache(
    num_blocks: int,
    block_size: int,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Zeroed MLA cache: [NB, BS, kv_lora_rank + rope_dim] (latent first, then rope key).

    Raises:
        ValueError: for sizes < 1.
    """
    for name, v in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("kv_lora_rank", kv_lora_rank),
        ("rope_dim", rope_dim),
    ):
        _check_positive(name, v)
    return torch.zeros(
        (num_blocks, block_size, kv_lora_rank + rope_dim), dtype=dtype, device=device
    )
