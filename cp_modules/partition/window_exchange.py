"""Neighbour exchange of K/V for sliding-window layers under PCP: move only the keys a rank needs.

Shape letters: N = new tokens of the batch (original order), T = this rank's local tokens
(padding included), K = this rank's exchanged keys, P = PCP size, R = requests, S = segments
(2R), ``...`` = trailing dims.

With a window of W keys, a query at in-request index ``i`` sees the new keys ``i-W+1 .. i``
(and, through the bottom-right alignment, the cached prefix when ``i < W - 1``). The queries of
a DualChunkSwap chunk starting at ``s`` therefore need the chunk's own keys and the W-1 before
it, ``[max(0, s-W+1), s + q_len)``. Rank r needs that range for its head chunk r and its tail
chunk 2P-1-r of every prefill request (their union: at most ``2(c + W - 1)`` tokens for chunks
of ``c``), and every token of the decode requests, which each rank already holds. Instead of
all-gathering all N tokens, every rank receives exactly these rows with one uneven all-to-all.

Every rank builds the same plan for all ranks on the host (the split sizes follow from the
step's token counts), so no sizes are exchanged. The exchanged rows of one request stay in
token order and each segment's keys are a contiguous run of them, so re-based segments
(``k_start``/``k_len`` into the exchanged buffer, from the chunk's first needed key) give the
attention op exactly the keys of the all-gather path under the same bottom-right causal
alignment and window; a cached prefix (read from the KV cache, not exchanged) still precedes
the new keys and stays outside the window wherever the exchange clipped keys.

With a KV cache the rank also stores the new tokens of its DCP shard: those are added to what
it receives (with dcp == 1 that is every token; the caller then keeps the all-gather, see
:func:`plan_window_exchange`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cp_modules.distributed.collectives import all_to_all
from cp_modules.partition.plan import SEGMENT_FIELDS, _to_device

__all__ = [
    "WindowExchangePlan",
    "exchange_rows",
    "exchange_rows_backward",
    "plan_window_exchange",
]


@dataclass(frozen=True, eq=False)
class WindowExchangePlan:
    """What rank ``pcp_rank`` sends and receives for a window of ``window`` keys in one step.

    Attributes:
        window: W.
        pcp_size, pcp_rank: the PCP group size and this rank's index in it.
        num_keys: K, rows this rank receives (its own rows included).
        num_keys_from_peers: rows of those that come from other ranks.
        send_rows: [sum(send_counts)] int64, local rows to send, grouped by destination rank.
        send_counts: rows sent to each rank (host ints, P).
        recv_counts: rows received from each rank (host ints, P).
        recv_index: [K] int64, for each exchanged row (request by request, token order) its row
            in the received buffer.
        token_ids: [K] int64, each exchanged row's index among the batch's new tokens.
        token_ids_host: the same on the host.
        segments_host: [S, 5] int64 on CPU (``SEGMENT_FIELDS``): the plan's segments with
            ``k_start``/``k_len`` into the exchanged rows.
    """

    window: int
    pcp_size: int
    pcp_rank: int
    num_keys: int
    num_keys_from_peers: int
    send_rows: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_index: torch.Tensor
    token_ids: torch.Tensor
    token_ids_host: torch.Tensor
    segments_host: torch.Tensor


def _int_array(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _needed_tokens(
    n: np.ndarray,
    computed: np.ndarray,
    is_decode: np.ndarray,
    P: int,
    window: int,
    cache_shard: tuple[int, tuple[int, ...], int] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[P, N] bool: the new tokens each rank needs; and each segment's first needed key and
    key end (in-request indices, [P, S])."""
    R = n.size
    N = int(n.sum())
    key_offsets = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
    chunk = np.where(is_decode, n, -(-n // (2 * P)))
    rank = np.arange(P)[:, None]
    start = np.stack([rank * chunk, (2 * P - 1 - rank) * chunk], 2)  # [P, R, 2] head, tail
    q_len = np.clip(n[None, :, None] - start, 0, chunk[None, :, None])
    # A decode request's one (head) segment covers its n tokens (every rank holds them).
    dec = np.broadcast_to(is_decode[None, :, None], start.shape)
    is_head = np.broadcast_to(np.arange(2)[None, None, :] == 0, start.shape)
    nonempty = np.where(dec, is_head, q_len > 0)
    lo = np.where(nonempty & ~dec, np.maximum(start - (window - 1), 0), 0)
    end = np.where(nonempty, np.where(dec, n[None, :, None], start + q_len), 0)
    # Mark the ranges with a difference array over the batch's tokens.
    diff = np.zeros((P, N + 1), np.int64)
    a = key_offsets[None, :, None] + lo
    b = key_offsets[None, :, None] + end
    pr = np.broadcast_to(rank[:, :, None], lo.shape)
    np.add.at(diff, (pr[nonempty], a[nonempty]), 1)
    np.add.at(diff, (pr[nonempty], b[nonempty]), -1)
    need = np.cumsum(diff, 1)[:, :N] > 0
    if cache_shard is not None:
        # The tokens each rank stores in its KV cache shard (position p on DCP rank (p//I)%D).
        dcp_size, peer_dcp_ranks, interleave = cache_shard
        req = np.repeat(np.arange(R), n)
        pos = computed[req] + np.arange(N) - key_offsets[req]
        owner = pos // interleave % dcp_size
        need |= owner[None, :] == np.asarray(peer_dcp_ranks, np.int64)[:, None]
    return need, lo.reshape(P, 2 * R), end.reshape(P, 2 * R)


def _sources(n: np.ndarray, is_decode: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
    """Per new token: the rank holding it (-1: every rank, a decode) and its local row there."""
    R = n.size
    key_offsets = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
    chunk = np.where(is_decode, n, -(-n // (2 * P)))
    local_n = np.where(is_decode, n, 2 * chunk)
    local_offsets = np.concatenate([[0], np.cumsum(local_n)[:-1]]).astype(np.int64)
    req = np.repeat(np.arange(R), n)
    j = np.arange(int(n.sum())) - key_offsets[req]
    c = chunk[req]
    k = j // c
    in_head = k < P
    src = np.where(is_decode[req], -1, np.where(in_head, k, 2 * P - 1 - k))
    row = local_offsets[req] + np.where(is_decode[req], j, np.where(in_head, j % c, c + j % c))
    return src, row


def plan_window_exchange(
    num_scheduled_tokens: Sequence[int] | np.ndarray | torch.Tensor,
    num_computed_tokens: Sequence[int] | np.ndarray | torch.Tensor,
    is_decode: Sequence[bool] | np.ndarray | torch.Tensor,
    pcp_size: int,
    pcp_rank: int,
    window: int,
    *,
    cache_shard: tuple[int, tuple[int, ...], int] | None = None,
    device: torch.device | str | None = None,
) -> WindowExchangePlan | None:
    """The exchange of one step's new K/V for a window of ``window`` keys; this rank's part.

    Args:
        num_scheduled_tokens, num_computed_tokens: [R] the step's host counts (as for
            :func:`~cp_modules.partition.plan_pcp`).
        is_decode: [R] the requests the PCP plan replicates instead of splitting.
        pcp_size, pcp_rank: P and this rank's index.
        window: W >= 1.
        cache_shard: ``(dcp_size, DCP rank of each PCP rank, interleave)`` when the new tokens
            are also written to a KV cache sharded that way: each rank then also receives the
            tokens it stores. None without a cache write.
        device: where the index tensors live (``*_host`` stay on CPU).

    Returns:
        The :class:`WindowExchangePlan`, or None when every rank needs every token (then the
        all-gather moves the same rows with a cheaper collective).

    Raises:
        ValueError: for a window < 1 or counts that do not fit each other.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    if not 0 <= pcp_rank < pcp_size:
        raise ValueError(f"pcp_rank must be in [0, {pcp_size - 1}], got {pcp_rank}")
    n, computed = _int_array(num_scheduled_tokens), _int_array(num_computed_tokens)
    dec = np.asarray(
        is_decode.cpu().numpy() if isinstance(is_decode, torch.Tensor) else is_decode, dtype=bool
    ).reshape(-1)
    if not n.size == computed.size == dec.size or (n.size and n.min() < 1):
        raise ValueError(
            f"need one count >= 1 per request in every argument, got {n.tolist()}, "
            f"{computed.tolist()}, {dec.tolist()}"
        )
    P, r, R = pcp_size, pcp_rank, n.size
    if cache_shard is not None and (
        len(cache_shard[1]) != P or not all(0 <= d < cache_shard[0] for d in cache_shard[1])
    ):
        raise ValueError(f"cache_shard must name a DCP rank per PCP rank, got {cache_shard}")
    need, lo, end = _needed_tokens(n, computed, dec, P, window, cache_shard)
    if need.all():
        return None
    src, row = _sources(n, dec, P)
    key_offsets = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
    ranks = np.arange(P)
    # Sender side: what this rank sends to each destination, in the destination's order.
    send_rows, send_counts = [], []
    for d in ranks:
        tok = np.flatnonzero(need[d] & np.where(src < 0, d == r, src == r))
        send_rows.append(row[tok])
        send_counts.append(tok.size)
    # Receiver side: the rows arrive grouped by source rank, each group in token order.
    tokens = np.flatnonzero(need[r])
    from_rank = np.where(src[tokens] < 0, r, src[tokens])
    order = np.argsort(from_rank, kind="stable")
    recv_index = np.empty_like(order)
    recv_index[order] = np.arange(order.size)
    recv_counts = np.bincount(from_rank, minlength=P)
    # Segments: the first needed key of each segment among this rank's exchanged rows.
    req = np.repeat(np.arange(R), 2)
    k_start = np.searchsorted(tokens, key_offsets[req] + lo[r])
    segments = np.stack(
        [req, *_local_segment_columns(n, dec, P, r), k_start, end[r] - lo[r]], 1
    ).astype(np.int64)
    assert segments.shape[1] == len(SEGMENT_FIELDS)
    # One pinned copy per dtype to the device (as for the PCP plan).
    on_device = _to_device(
        dict(
            send_rows=np.concatenate(send_rows).astype(np.int64),
            recv_index=recv_index.astype(np.int64),
            token_ids=tokens.astype(np.int64),
        ),
        device,
    )
    return WindowExchangePlan(
        window=window,
        pcp_size=P,
        pcp_rank=r,
        num_keys=int(tokens.size),
        num_keys_from_peers=int(tokens.size - recv_counts[r]),
        send_counts=tuple(int(x) for x in send_counts),
        recv_counts=tuple(int(x) for x in recv_counts),
        token_ids_host=torch.from_numpy(tokens.astype(np.int64)),
        segments_host=torch.from_numpy(segments),
        **on_device,
    )


def _local_segment_columns(n, is_decode, P, r):
    """``q_start`` and ``q_len`` of this rank's segments (as in :func:`plan_pcp`)."""
    chunk = np.where(is_decode, n, -(-n // (2 * P)))
    local_n = np.where(is_decode, n, 2 * chunk)
    local_offsets = np.concatenate([[0], np.cumsum(local_n)[:-1]]).astype(np.int64)
    head_q = np.where(is_decode, n, np.clip(n - r * chunk, 0, chunk))
    tail_q = np.where(is_decode, 0, np.clip(n - (2 * P - 1 - r) * chunk, 0, chunk))
    q_start = np.stack([local_offsets, local_offsets + chunk], 1).reshape(-1)
    q_len = np.stack([head_q, tail_q], 1).reshape(-1)
    return q_start, q_len


def exchange_rows(x_local: torch.Tensor, plan: WindowExchangePlan, group_name: str) -> torch.Tensor:
    """This rank's exchanged rows ``[T, ...] -> [K, ...]`` (request by request, token order).

    Not differentiable by itself: :func:`exchange_rows_backward` is its adjoint.

    Raises:
        ValueError: if ``x_local`` has fewer rows than the plan sends from (checked before the
            collective).
    """
    if x_local.dim() < 1:
        raise ValueError(f"x_local must have a token dim, got shape {tuple(x_local.shape)}")
    send = x_local.index_select(0, plan.send_rows)
    recv = all_to_all(
        send, group_name, plan.pcp_size, list(plan.recv_counts), list(plan.send_counts)
    )
    return recv.index_select(0, plan.recv_index)


def exchange_rows_backward(
    dx: torch.Tensor, plan: WindowExchangePlan, group_name: str, num_local_tokens: int
) -> torch.Tensor:
    """Adjoint of :func:`exchange_rows`: ``[K, ...] -> [T, ...]``, each local row receiving the
    sum of the gradients of its copies on every rank (0 for rows nobody received)."""
    if dx.shape[0] != plan.num_keys:
        raise ValueError(f"dx must have the plan's {plan.num_keys} rows, got {dx.shape[0]}")
    recv = dx.new_empty(dx.shape)
    recv.index_copy_(0, plan.recv_index, dx)
    back = all_to_all(
        recv, group_name, plan.pcp_size, list(plan.send_counts), list(plan.recv_counts)
    )
    out = dx.new_zeros((num_local_tokens, *dx.shape[1:]))
    return out.index_add_(0, plan.send_rows, back)
