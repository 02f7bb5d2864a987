"""Which cached tokens a sliding-window layer still needs, and how many blocks they span.

A query at position ``i`` of a layer with window ``W`` attends positions ``i - W + 1 .. i``.
A request whose cache holds its first ``n`` tokens asks its next query (position ``n``) and
every later one for nothing before ``window_first_visible(n, W)``; a step that adds tokens
``[c0, c1)`` must keep in the cache only those a later query sees, plus (a decode) the tokens
the step itself reads from the cache. The scheduler's windowed block groups and the step
metadata share these rules, so what is allocated is exactly what is written and read.

Every function takes Python ints; :func:`window_write_start` also numpy arrays (per request).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "blocks_spanned",
    "window_block_bound",
    "window_first_visible",
    "window_write_start",
]


def window_first_visible(num_tokens: int, window: int) -> int:
    """First position any query of a request with ``num_tokens`` cached tokens can still see
    (the next query is at position ``num_tokens``): ``max(0, num_tokens - window + 1)``."""
    return max(0, num_tokens - window + 1)


def window_write_start(
    num_computed: ArrayLike, num_new: ArrayLike, window: int, decode_threshold: int = 1
) -> np.ndarray:
    """First new token of a step that the cache of a ``window`` layer keeps.

    A prompt chunk ``[c0, c1)`` attends its own new keys from the step itself, so it keeps
    only what a later query sees: ``max(c0, c1 - W + 1)``. A decode (at most
    ``decode_threshold`` new tokens and a non-empty cache, the step metadata's rule) reads its
    keys from the cache: it keeps every new token, ``c0``.
    """
    num_computed = np.asarray(num_computed)
    num_new = np.asarray(num_new)
    decode = (num_new <= decode_threshold) & (num_computed > 0)
    chunk = np.maximum(num_computed, num_computed + num_new - window + 1)
    return np.where(decode, num_computed, chunk)


def blocks_spanned(length: int, virtual_block: int) -> int:
    """Most blocks of ``virtual_block`` positions a run of ``length`` consecutive positions
    touches (at the worst alignment): 0 for an empty run, else ``ceil((length - 1) / B) + 1``."""
    if length <= 0:
        return 0
    return (length + 2 * virtual_block - 2) // virtual_block


def window_block_bound(window: int, block_size: int, dcp_size: int, max_chunk: int) -> int:
    """Most blocks (of ``block_size * dcp_size`` positions) a request of a ``window`` layer
    group holds in one step, when its prompt chunks have at most ``max_chunk`` new tokens.

    A chunk ``[c0, c1)`` with a cached prefix needs that prefix's window ``[c0 - W + 1, c0)``
    and the tokens it keeps ``[max(c0, c1 - W + 1), c1)``: one run of ``W - 1 + n``
    positions, or two runs of ``W - 1`` when the chunk is longer than the window. A decode
    (one token) needs the run of the W keys its query sees: at most
    ``ceil(W / (block_size * dcp_size)) + 1`` blocks.
    """
    vb = block_size * dcp_size
    decode = blocks_spanned(window, vb)
    chunk = min(blocks_spanned(window - 1 + max_chunk, vb), 2 * blocks_spanned(window - 1, vb))
    return max(decode, chunk)
