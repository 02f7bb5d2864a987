"""DualChunkSwap partition of one step's new tokens over the PCP ranks.

Shape letters: R = requests, N = new tokens of the batch (all requests, original order),
T = this rank's local tokens (padding included; the same count on every rank),
S = attention segments (2 per request: head and tail), P = PCP size.

A prefill request with ``n`` new tokens is padded to ``2P·c`` tokens (``c = ceil(n / 2P)``),
cut into ``2P`` chunks of ``c`` tokens, and rank ``r`` takes chunk ``r`` (its head) and chunk
``2P-1-r`` (its tail), so every rank does the same causal work. A decode request (at most
``decode_threshold`` new tokens and a non-empty context) is not split: every rank holds all of
its tokens. With P = 1 no request is split: each is one unpadded chunk in order, its head
segment covers it and its tail segment is empty. Padding slots copy the request's first token (with its position) and are dropped by
the restore after the all-gather.

The plan is built on the host once per step from host lists and shared by every layer; all
index math is vectorized numpy. Tensors the model needs on the device are moved there once
(``device=``); the attention metadata also keeps a host copy so that the attention op's CUDA
launcher reads lengths without synchronizing with the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cp_modules.pinned import pinned_copy

__all__ = ["SEGMENT_FIELDS", "PCPPlan", "plan_pcp"]

# Columns of ``PCPPlan.segments``: one row per (request, head|tail) segment. ``q_start/q_len``
# address this rank's local queries (only the real ones: padding queries are left out), and
# ``k_start/k_len`` the request's keys in the restored, unpadded K/V. Queries attend their
# keys causally aligned at the bottom right (the last query sees the last key), so query ``i``
# of a segment sees keys ``[k_start, k_start + k_len - q_len + i]``.
SEGMENT_FIELDS = ("request", "q_start", "q_len", "k_start", "k_len")


@dataclass(frozen=True, eq=False)
class PCPPlan:
    """This rank's share of one step's tokens and everything needed to restore them.

    Host ints (``pcp_size`` ... ``num_tokens``) describe the step; tensors live on the plan's
    device unless named ``*_host`` (always CPU). Traced code should read only tensors (and
    their shapes) from a plan, so that a new batch composition does not recompile.

    Attributes:
        pcp_size, pcp_rank: the PCP group size and this rank's index in it.
        num_reqs: R.
        num_tokens: N, new tokens of the batch (the restored length).
        num_local_tokens_padded: T, local tokens per rank (equal on all ranks: the all-gather
            size).
        token_indices: [T] int64, this rank's tokens as indices into the batch's flattened
            new tokens (padding slots point at the first token of their request).
        positions: [T] int64, true positions for RoPE (``num_computed + index``).
        local_valid: [T] bool, False for padding slots.
        num_local_tokens: [R] int64, local slots of each request (``2c``, or ``n`` for a decode and at P = 1).
        restore_index: [P·T] int64, permutation of the all-gathered tokens into request order.
        unpad_mask: [P·T] bool, keeps the real tokens of the restored order (and one copy of
            each decode token).
        gather_index: [N] int64, ``restore_index[unpad_mask]``: all-gathered → original order.
        gather_pad_index: [P·T - N] int64, ``restore_index[~unpad_mask]``: the all-gathered
            rows that ``gather_index`` leaves out (padding slots, and the other ranks' copies
            of decode tokens).
        gather_runs_host: [K, 3] int64 on CPU, ``gather_index`` as runs of consecutive rows:
            ``(first restored row, first all-gathered row, length)``, in restored order, each
            run within one rank's rows. All-gathered rows outside every run are padding.
        num_scheduled_tokens, num_computed_tokens: [R] int64, the inputs.
        is_decode: [R] bool, requests replicated on every rank instead of split.
        chunk_size: [R] int64, ``c`` (for a decode, and at P = 1: its ``n``).
        head_q_len, tail_q_len: [R] int64, real (non-padding) queries of this rank's head and
            tail chunk of each request.
        head_k_len, tail_k_len: [R] int64, keys of the restored, unpadded K/V that the head and
            tail chunk attend: ``min(c·(r+1), n)`` and ``min(c·(2P-r), n)`` (0 for a chunk of
            padding only). The padded sizes ``c·(r+1)`` and ``c·(2P-r)`` shrink to these because
            the restored K/V holds no padding.
        local_offsets: [R] int64, first local slot of each request.
        key_offsets: [R] int64, first row of each request in the restored K/V (cumulative n).
        segments, segments_host: [S, 5] int64 (``SEGMENT_FIELDS``), S = 2R: the attention
            metadata on the device and on the host.
        prefix_cu_seqlens, prefix_cu_seqlens_host: [R + 1] int64, cumulative
            ``num_computed_tokens``: the layout of a dense cached prefix gathered per request.
    """

    pcp_size: int
    pcp_rank: int
    num_reqs: int
    num_tokens: int
    num_local_tokens_padded: int
    token_indices: torch.Tensor
    positions: torch.Tensor
    local_valid: torch.Tensor
    num_local_tokens: torch.Tensor
    restore_index: torch.Tensor
    unpad_mask: torch.Tensor
    gather_index: torch.Tensor
    gather_pad_index: torch.Tensor
    num_scheduled_tokens: torch.Tensor
    num_computed_tokens: torch.Tensor
    is_decode: torch.Tensor
    chunk_size: torch.Tensor
    head_q_len: torch.Tensor
    tail_q_len: torch.Tensor
    head_k_len: torch.Tensor
    tail_k_len: torch.Tensor
    local_offsets: torch.Tensor
    key_offsets: torch.Tensor
    segments: torch.Tensor
    segments_host: torch.Tensor
    gather_runs_host: torch.Tensor
    prefix_cu_seqlens: torch.Tensor
    prefix_cu_seqlens_host: torch.Tensor


def _as_int_array(name: str, values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D sequence of integers, got {values!r}")
    return arr.astype(np.int64)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    if x.size > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def _ragged_arange(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, offset) of every element of consecutive ranges of the given lengths."""
    owner = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    offset = np.arange(owner.size, dtype=np.int64) - np.repeat(_exclusive_cumsum(lengths), lengths)
    return owner, offset


def _runs(index: np.ndarray, rows_per_rank: int) -> np.ndarray:
    # [K, 3] (position, index[position], length) for the maximal runs of ``index`` rising by 1
    # that stay within one rank's block of ``rows_per_rank`` rows.
    if index.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.ones(index.size, dtype=bool)
    brk[1:] = (np.diff(index) != 1) | (index[1:] % max(rows_per_rank, 1) == 0)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, index.size))
    return np.stack([starts, index[starts], lengths], 1).astype(np.int64)


def _to_device(
    arrays: dict[str, np.ndarray], device: torch.device | str | None
) -> dict[str, torch.Tensor]:
    """The arrays as tensors on ``device``: int64, or bool for boolean arrays.

    Off the CPU they travel as one pinned int64 buffer and one pinned byte buffer (two
    asynchronous copies instead of one blocking copy per field) and come back as views.
    """
    device = torch.device("cpu" if device is None else device)
    if device.type == "cpu":
        return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
    return _packed_to_device(arrays, device)


def _packed_to_device(
    arrays: dict[str, np.ndarray], device: torch.device
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for np_dtype, is_bool in ((np.int64, False), (np.uint8, True)):
        names = [k for k, a in arrays.items() if (a.dtype == np.bool_) == is_bool]
        flat = [arrays[k].astype(np_dtype, copy=False).reshape(-1) for k in names]
        host = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, np_dtype))
        pinned = device.type == "cuda" and torch.cuda.is_available()
        buf = pinned_copy(host).to(device, non_blocking=True) if pinned else host.to(device)
        start = 0
        for k, f in zip(names, flat):
            view = buf[start : start + f.size].view(arrays[k].shape)
            out[k] = view.view(torch.bool) if is_bool else view
            start += f.size
    return out


def plan_pcp(
    num_scheduled_tokens: Sequence[int] | np.ndarray | torch.Tensor,
    num_computed_tokens: Sequence[int] | np.ndarray | torch.Tensor,
    pcp_size: int,
    pcp_rank: int,
    decode_threshold: int = 1,
    device: torch.device | str | None = None,
) -> PCPPlan:
    """Split one step's new tokens over ``pcp_size`` ranks with DualChunkSwap; this rank's plan.

    Contract: concatenating every rank's ``token_indices``, indexing by ``restore_index`` and
    keeping ``unpad_mask`` gives ``arange(N)``; ``gather_index`` does both steps at once.

    Args:
        num_scheduled_tokens: [R] new tokens per request (host ints, each >= 1), in batch order.
        num_computed_tokens: [R] tokens already in the KV cache per request (>= 0).
        pcp_size: ranks of the PCP group (P >= 1).
        pcp_rank: this rank's index in the PCP group.
        decode_threshold: requests with at most this many new tokens and a non-empty context
            are decodes: replicated on every rank, not split.
        device: where the plan's tensors live (default CPU); ``*_host`` tensors stay on CPU.

    Returns:
        The :class:`PCPPlan` of ``pcp_rank``.

    Raises:
        ValueError: for a size, rank, threshold or token count outside its valid range.
    """
    if isinstance(pcp_size, bool) or not isinstance(pcp_size, int) or pcp_size < 1:
        raise ValueError(f"pcp_size must be an integer >= 1, got {pcp_size!r}")
    if isinstance(pcp_rank, bool) or not isinstance(pcp_rank, int) or not 0 <= pcp_rank < pcp_size:
        raise ValueError(
            f"pcp_rank must be an integer in [0, {pcp_size - 1}] for pcp_size={pcp_size}, "
            f"got {pcp_rank!r}"
        )
    if (
        isinstance(decode_threshold, bool)
        or not isinstance(decode_threshold, int)
        or decode_threshold < 0
    ):
        raise ValueError(f"decode_threshold must be an integer >= 0, got {decode_threshold!r}")
    n = _as_int_array("num_scheduled_tokens", num_scheduled_tokens)
    computed = _as_int_array("num_computed_tokens", num_computed_tokens)
    if n.shape != computed.shape:
        raise ValueError(
            f"num_scheduled_tokens and num_computed_tokens must have one entry per request, got "
            f"{n.size} and {computed.size} entries"
        )
    if n.size and n.min() < 1:
        raise ValueError(f"num_scheduled_tokens must all be >= 1, got {n.tolist()}")
    if computed.size and computed.min() < 0:
        raise ValueError(f"num_computed_tokens must all be >= 0, got {computed.tolist()}")

    P, r = pcp_size, pcp_rank
    num_reqs = int(n.size)
    is_decode = (n <= decode_threshold) & (computed > 0)
    if P == 1 and num_reqs:
        return _plan_one_rank_cached(n, computed, is_decode, device)
    return _plan_split(n, computed, P, r, is_decode, device)


# The last one-rank plans built on a GPU with autograd on, by their batch. A training loop at
# pcp = 1 plans the same batch shape every step; a plan's tensors are read-only, so the same
# plan serves each of those steps (the step metadata around it, and its handle, stay per step)
# and the step starts without host-to-device copies. Only with autograd on: what is kept per
# plan (``ops.pcp_policy.PlanState``) includes the cuDNN rental's call counts, and a forward
# that autograd differentiates rents nothing, while an inference plan kept over calls would
# go on renting FlashAttention-2 where a fresh plan of a shape seen before takes cuDNN at once.
# Bounded, so varying batches only cycle through it.
_ONE_RANK_PLANS: dict[tuple, PCPPlan] = {}
_ONE_RANK_PLANS_KEPT = 8


def _plan_one_rank_cached(
    n: np.ndarray, computed: np.ndarray, is_decode: np.ndarray, device: torch.device | str | None
) -> PCPPlan:
    dev = torch.device("cpu" if device is None else device)
    if (
        dev.type != "cuda"
        or not torch.is_grad_enabled()
        or torch.cuda.is_current_stream_capturing()
    ):
        # CPU plans cost no copies; a plan made while a CUDA graph is captured lives in the
        # graph's memory pool.
        return _plan_one_rank(n, computed, is_decode, device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (n.tobytes(), computed.tobytes(), is_decode.tobytes(), dev)
    plan = _ONE_RANK_PLANS.pop(key, None)
    if plan is None:
        plan = _plan_one_rank(n, computed, is_decode, dev)
        if len(_ONE_RANK_PLANS) >= _ONE_RANK_PLANS_KEPT:
            _ONE_RANK_PLANS.pop(next(iter(_ONE_RANK_PLANS)))
    _ONE_RANK_PLANS[key] = plan  # the newest last
    return plan


def _plan_split(
    n: np.ndarray,
    computed: np.ndarray,
    P: int,
    r: int,
    is_decode: np.ndarray,
    device: torch.device | str | None,
) -> PCPPlan:
    """The general DualChunkSwap plan of rank ``r`` of ``P`` (validated inputs)."""
    num_reqs = int(n.size)
    # Unsplit requests keep their tokens in order as one chunk: decodes (replicated), and at
    # P = 1 every request (one rank holds both halves, so one causal segment does the work of
    # head and tail without padding, a second kernel call or a gradient sum).
    unsplit = is_decode | (P == 1)
    chunk = np.where(unsplit, n, -(-n // (2 * P)))
    local_n = np.where(unsplit, n, 2 * chunk)
    local_offsets = _exclusive_cumsum(local_n)
    key_offsets = _exclusive_cumsum(n)
    num_local = int(local_n.sum())
    num_tokens = int(n.sum())

    # This rank's slots: offset ``o`` within the request's slots maps to the in-request index
    # ``idx`` of the padded request (head chunk r, then tail chunk 2P-1-r).
    req, o = _ragged_arange(local_n)
    c_t, n_t = chunk[req], n[req]
    in_head = o < c_t
    padded_idx = np.where(
        unsplit[req], o, np.where(in_head, r * c_t + o, (2 * P - 1 - r) * c_t + o - c_t)
    )
    valid = padded_idx < n_t
    in_req = np.where(valid, padded_idx, 0)
    token_indices = key_offsets[req] + in_req
    positions = computed[req] + in_req

    # Restore: walk the padded request order and name the (rank, local slot) holding each
    # element. A decode's padded length is P·n: the P replicas one after another, of which the
    # unpad mask keeps rank 0's.
    padded_len = np.where(unsplit, P * n, 2 * P * chunk)
    preq, q = _ragged_arange(padded_len)
    c_p, n_p = chunk[preq], n[preq]
    k = q // c_p
    src_rank = np.where(unsplit[preq], k, np.where(k < P, k, 2 * P - 1 - k))
    slot = np.where(unsplit[preq], q % c_p, np.where(k < P, q % c_p, c_p + q % c_p))
    restore_index = src_rank * num_local + local_offsets[preq] + slot
    unpad_mask = q < n_p
    gather_index = restore_index[unpad_mask]

    head_chunk = np.where(unsplit, 0, r)
    tail_chunk = 2 * P - 1 - r
    head_q = np.where(unsplit, n, np.clip(n - r * chunk, 0, chunk))
    tail_q = np.where(unsplit, 0, np.clip(n - tail_chunk * chunk, 0, chunk))
    head_k = np.where(head_q > 0, head_chunk * chunk + head_q, 0)
    tail_k = np.where(tail_q > 0, tail_chunk * chunk + tail_q, 0)
    segments = np.empty((2 * num_reqs, len(SEGMENT_FIELDS)), dtype=np.int64)
    segments[0::2] = np.stack([np.arange(num_reqs), local_offsets, head_q, key_offsets, head_k], 1)
    segments[1::2] = np.stack(
        [np.arange(num_reqs), local_offsets + chunk, tail_q, key_offsets, tail_k], 1
    )
    prefix_cu = np.concatenate([[0], np.cumsum(computed)]).astype(np.int64)

    arrays = dict(
        token_indices=token_indices,
        positions=positions,
        local_valid=valid,
        num_local_tokens=local_n,
        restore_index=restore_index,
        unpad_mask=unpad_mask,
        gather_index=gather_index,
        gather_pad_index=restore_index[~unpad_mask],
        num_scheduled_tokens=n,
        num_computed_tokens=computed,
        is_decode=is_decode,
        chunk_size=chunk,
        head_q_len=head_q,
        tail_q_len=tail_q,
        head_k_len=head_k,
        tail_k_len=tail_k,
        local_offsets=local_offsets,
        key_offsets=key_offsets,
        segments=segments,
        prefix_cu_seqlens=prefix_cu,
    )
    return PCPPlan(
        gather_runs_host=torch.from_numpy(_runs(gather_index, num_local)),
        pcp_size=P,
        pcp_rank=r,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        num_local_tokens_padded=num_local,
        segments_host=torch.from_numpy(segments),
        prefix_cu_seqlens_host=torch.from_numpy(prefix_cu),
        **_to_device(arrays, device),
    )


def _plan_one_rank(
    n: np.ndarray, computed: np.ndarray, is_decode: np.ndarray, device: torch.device | str | None
) -> PCPPlan:
    """:func:`plan_pcp` at P = 1, built directly: every request is one unsplit segment in batch
    order, so the local tokens are the batch's new tokens (no padding) and every restore
    index is the identity.

    The fields equal the general path's. Fields with equal contents share one tensor (the
    [N] identity serves ``token_indices``, ``restore_index`` and ``gather_index``; the [N]
    all-true mask ``local_valid`` and ``unpad_mask``; the [R] counts ``num_local_tokens``,
    ``num_scheduled_tokens``, ``chunk_size``, ``head_q_len`` and ``head_k_len``): plan tensors
    are read-only. The [N] tensors are made on the device itself; the per-request ones travel
    in one packed copy.
    """
    num_reqs, num_tokens = int(n.size), int(n.sum())
    offsets = _exclusive_cumsum(n)
    zeros = np.zeros(num_reqs, dtype=np.int64)
    reqs = np.arange(num_reqs, dtype=np.int64)
    # Per request: (request, offset, n, offset, n) for its segment, then its empty tail.
    segments = np.stack(
        [reqs, offsets, n, offsets, n, reqs, offsets + n, zeros, offsets, zeros], 1
    ).reshape(2 * num_reqs, len(SEGMENT_FIELDS))
    prefix_cu = np.concatenate([[0], np.cumsum(computed)]).astype(np.int64)
    host = dict(
        n=n, computed=computed, is_decode=is_decode, zeros=zeros, offsets=offsets,
        segments=segments, prefix_cu=prefix_cu,
    )  # fmt: skip
    shifted = num_reqs > 1
    if shifted:
        # Position of token j of request i: computed[i] + j - offsets[i].
        host["shift"] = np.repeat(computed - offsets, n)
    small = _to_device(host, device)
    dev = torch.device("cpu" if device is None else device)
    identity = torch.arange(num_tokens, dtype=torch.int64, device=dev)
    if shifted:
        positions = identity + small["shift"]
    else:
        first = int(computed[0])
        positions = torch.arange(first, first + num_tokens, dtype=torch.int64, device=dev)
    valid = torch.ones(num_tokens, dtype=torch.bool, device=dev)
    run = np.array([[0, 0, num_tokens]], dtype=np.int64)
    return PCPPlan(
        pcp_size=1,
        pcp_rank=0,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        num_local_tokens_padded=num_tokens,
        token_indices=identity,
        positions=positions,
        local_valid=valid,
        num_local_tokens=small["n"],
        restore_index=identity,
        unpad_mask=valid,
        gather_index=identity,
        gather_pad_index=identity.new_empty(0),
        num_scheduled_tokens=small["n"],
        num_computed_tokens=small["computed"],
        is_decode=small["is_decode"],
        chunk_size=small["n"],
        head_q_len=small["n"],
        tail_q_len=small["zeros"],
        head_k_len=small["n"],
        tail_k_len=small["zeros"],
        local_offsets=small["offsets"],
        key_offsets=small["offsets"],
        segments=small["segments"],
        segments_host=torch.from_numpy(segments),
        gather_runs_host=torch.from_numpy(run),
        prefix_cu_seqlens=small["prefix_cu"],
        prefix_cu_seqlens_host=torch.from_numpy(prefix_cu),
    )
