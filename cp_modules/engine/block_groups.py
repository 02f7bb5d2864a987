"""KV-cache blocks of sliding-window layer groups: a request keeps only what a query can still see.

Layers are grouped by their window (full layers: the group the :class:`~cp_modules.cache.paged.
BlockTable` of the scheduler serves; each distinct window W: a :class:`WindowBlockGroup`), and
every group has its own block pool and block table per request, as hybrid KV-cache allocators
do. A query at position ``i`` of a W-window layer attends positions ``i - W + 1 .. i``, so
once a request has ``n`` tokens in its cache, no query to come sees a position before
``n - W + 1`` (the rules are :mod:`cp_modules.cache.window`). The group therefore

- writes only the new tokens a later query sees (the last W - 1 of a prompt chunk, whose own
  attention takes its new keys from the step) and every decode token,
- reads as cached prefix of a prompt chunk only its window (the step metadata's
  :meth:`~cp_modules.step.CPStepMetadata.for_window` view builds those writes and reads),
- returns a block to its pool once every position it covers lies before the first visible one.

Blocks are per DCP shard: a block-table entry covers the ``block_size * dcp`` positions of a
virtual block and names one physical block on every DCP rank, each holding its own interleaved
tokens of it. Every rank runs the same scheduler, so all ranks free the same entries: an entry
is freed when all its positions (hence every rank's local tokens of it) are out of sight.
Freed and never-written entries read 0; no read or write of the step reaches them (writes are
masked by the slot mapping, reads start at each query's window).

A request then holds at most ``ceil(W / (block_size * dcp)) + 1`` blocks at a decode step,
however long it grows (``window_block_bound`` gives the bound of a step with prompt chunks).
The allocation follows the step metadata's default decode rule (one new token and a
non-empty cache is a decode).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from cp_modules.cache.dcp import dcp_num_blocks
from cp_modules.cache.paged import BlockAllocator
from cp_modules.cache.window import (
    blocks_spanned,
    window_block_bound,
    window_first_visible,
    window_write_start,
)

__all__ = ["WindowBlockGroup", "kv_cache_windows", "window_capacity", "window_group_num_blocks"]


def window_capacity(
    window: int,
    block_size: int,
    dcp_size: int,
    max_num_tokens: int,
    prompt_len: int,
    max_len: int,
    max_query_len: int = 1,
) -> int:
    """Most blocks a request (prompt of ``prompt_len``, ``max_len`` tokens in all) holds in a
    ``window`` group whose steps schedule at most ``max_num_tokens`` new tokens.
    ``max_query_len``: new tokens of a decode (a speculative verification writes all of its
    ``k + 1`` and reads the window before the first: a run of ``W - 1 + k + 1`` positions)."""
    chunk = max(1, min(prompt_len, max_num_tokens))
    bound = window_block_bound(window, block_size, dcp_size, chunk)
    if max_query_len > 1:
        bound = max(bound, blocks_spanned(window - 1 + max_query_len, block_size * dcp_size))
    return min(dcp_num_blocks(max_len, block_size, dcp_size), bound)


def window_group_num_blocks(
    windows: Iterable[int],
    requests: list[tuple[int, int]],
    *,
    block_size: int,
    dcp_size: int,
    max_num_tokens: int,
    max_num_seqs: int,
    limit: int | None = None,
    max_query_len: int = 1,
) -> dict[int, int]:
    """Blocks each window group's cache needs so that ``max_num_seqs`` of ``requests``
    ((prompt length, total length) each) run at once: the sum of their largest capacities,
    at most ``limit`` (the full layers' block count, when one is set)."""
    out = {}
    for w in windows:
        caps = sorted(
            (
                window_capacity(w, block_size, dcp_size, max_num_tokens, p, n, max_query_len)
                for p, n in requests
            ),
            reverse=True,
        )
        need = max(1, sum(caps[:max_num_seqs]))
        out[w] = need if limit is None else min(need, limit)
    return out


def kv_cache_windows(layers: Iterable) -> list[int]:
    """The distinct sliding windows that group the KV caches of ``layers`` (cp attention
    layers: ``layer.cp_binding.sliding_window``; MLA layers and full layers: none), sorted."""
    windows = set()
    for layer in layers:
        binding = getattr(layer, "cp_binding", None)
        if binding is not None and binding.sliding_window:
            windows.add(int(binding.sliding_window))
    return sorted(windows)


class WindowBlockGroup:
    """Block pool and block-table rows of one sliding-window layer group (see the module doc).

    Each admitted request reserves the most blocks it can hold at once (``capacity``), so a
    step never runs out of blocks and no request is preempted; blocks are taken when a step
    writes into them and returned as the window moves past them.

    Args:
        window: the group's window W (keys a query sees, itself included).
        num_blocks: physical blocks of the group's cache per rank.
        block_size: tokens per physical block.
        dcp_size: DCP group size (an entry covers ``block_size * dcp_size`` positions).
        max_num_seqs: block-table rows.
        max_model_len: longest request (sets the entries per row).
        max_num_tokens: new tokens per step at most (bounds a prompt chunk).
        max_query_len: new tokens of a decode at most (``k + 1`` with speculative decoding).

    Raises:
        ValueError: for a window or sizes < 1.
    """

    def __init__(
        self,
        window: int,
        *,
        num_blocks: int,
        block_size: int,
        dcp_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_tokens: int,
        max_query_len: int = 1,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.window = window
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.max_num_tokens = max_num_tokens
        self.max_query_len = max_query_len
        self.allocator = BlockAllocator(num_blocks)
        m = dcp_num_blocks(max_model_len, block_size, dcp_size)
        self.tensor = torch.zeros(max_num_seqs, m, dtype=torch.int32)
        self._rows: list[dict[int, int]] = [{} for _ in range(max_num_seqs)]
        self._reserved: dict[int, int] = {}
        self.peak_blocks_used = 0
        self.peak_blocks_per_request = 0  # one request, at any step
        self.peak_decode_blocks_per_request = 0  # one request, at its decode steps

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def capacity(self, prompt_len: int, max_len: int) -> int:
        """Most blocks a request (prompt of ``prompt_len``, ``max_len`` tokens in all) holds."""
        return window_capacity(
            self.window, self.block_size, self.dcp_size, self.max_num_tokens, prompt_len, max_len,
            self.max_query_len,
        )  # fmt: skip

    @property
    def num_unreserved(self) -> int:
        return self.num_blocks - sum(self._reserved.values())

    def admit(self, row: int, prompt_len: int, max_len: int) -> bool:
        """Reserve ``row``'s blocks if they fit; whether they did."""
        need = self.capacity(prompt_len, max_len)
        if need > self.num_unreserved:
            return False
        self._reserved[row] = need
        return True

    def blocks(self, row: int) -> dict[int, int]:
        """Entries of ``row`` that hold a block: entry index -> physical block id (a copy)."""
        return dict(self._rows[row])

    def prepare(self, row: int, num_computed: int, num_new: int, decode_threshold: int = 1) -> None:
        """Give ``row`` the blocks its next step writes into (``decode_threshold``: the step
        metadata's, ``k + 1`` for a speculative verification)."""
        vb = self.block_size * self.dcp_size
        first = int(window_write_start(num_computed, num_new, self.window, decode_threshold))
        end = num_computed + num_new
        entries = self._rows[row]
        span = range(first // vb, -(-end // vb)) if first < end else range(0)
        missing = [e for e in span if e not in entries]
        assert len(entries) + len(missing) <= self._reserved[row], "window reservation exceeded"
        for e, block in zip(missing, self.allocator.allocate(len(missing))):
            entries[e] = block
            self.tensor[row, e] = block
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)
        self.peak_blocks_per_request = max(self.peak_blocks_per_request, len(entries))
        if num_new <= decode_threshold and num_computed > 0:
            self.peak_decode_blocks_per_request = max(
                self.peak_decode_blocks_per_request, len(entries)
            )

    def release(self, row: int, num_tokens: int) -> list[int]:
        """Return ``row``'s blocks that no query to come sees (it has ``num_tokens`` cached
        tokens); the freed block ids."""
        vb = self.block_size * self.dcp_size
        first = window_first_visible(num_tokens, self.window)
        entries = self._rows[row]
        gone = [e for e in entries if (e + 1) * vb <= first]
        freed = [entries.pop(e) for e in gone]
        self.allocator.free(freed)
        self.tensor[row, gone] = 0
        return freed

    def rollback(self, row: int, num_tokens: int) -> list[int]:
        """Return ``row``'s blocks that hold no cached token once the request keeps only its
        first ``num_tokens`` (the slots of rejected speculative tokens); the freed ids. The
        row then holds what plain decoding to ``num_tokens`` tokens would hold."""
        vb = self.block_size * self.dcp_size
        entries = self._rows[row]
        gone = [e for e in entries if e * vb >= num_tokens]
        freed = [entries.pop(e) for e in gone]
        self.allocator.free(freed)
        self.tensor[row, gone] = 0
        return freed

    def finish(self, row: int) -> None:
        """Return every block of ``row`` and its reservation."""
        self.allocator.free(self._rows[row].values())
        self._rows[row] = {}
        self._reserved.pop(row, None)
        self.tensor[row].zero_()
