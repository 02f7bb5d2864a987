"""Key-major PCP backward: each rank takes the gradients of its own key chunks.

The block backward of :mod:`cp_modules.kernels.prefill.pcp_blocks` is query-major: a rank's head
and tail queries against the gathered keys, whose K / V gradients then go back to their owners
by a reduce-scatter. Its blocks are at most one chunk of queries tall, where cuDNN's backward
at MLA's head dims (Dqk 192 / Dv 128) is slow.

Key-major turns the loop around. A rank keeps the keys it owns, and takes for each of its chunks
every query of the request at or after the chunk's first token: one tall call with a causal
mask aligned top-left (query ``i`` of the call sees keys ``0..i``), which is cuDNN's causal
mask when queries outnumber keys. Each chunk's dK / dV are then complete on their owner; the
queries' gradients are partial sums, one per rank, reduce-scattered back to the queries'
owners. The rank needs every later query's Q, O, dO and LSE, so the backward all-gathers them.

Where each is faster (measured): ``docs/switch-points.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cp_modules.kernels.prefill.attention_blocks import (
    attention_block_backward,
    select_block_backend,
)
from cp_modules.kernels.prefill.grad_assembly import Piece, sum_pieces_into
from cp_modules.kernels.prefill.pcp_blocks import host_segments

Targets = list[tuple[int, torch.Tensor]]


def tall_causal_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    backend: str | None = None,
) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Gradients of queries ``q`` [L, Hq, Dqk] against keys ``k`` [M, Hkv, Dqk], L >= M, causal
    with the first query and the first key at the same position (top-left), from the merged
    ``out`` and ``lse``.

    cuDNN applies that mask to an L x M call, so it is one call there; other kernels (whose
    causal mask may be aligned bottom-right) take the causal square of the first M queries and
    the unmasked queries after it.

    Returns:
        (dq pieces ``(first row, rows)`` covering rows [0, L), dk [M, ...], dv [M, ...]).
    """
    L, M = q.shape[0], k.shape[0]
    if L < M:
        raise ValueError(
            f"a tall causal call needs at least as many queries as keys, got {L} < {M}"
        )
    backend = backend or select_block_backend(q, k, v, True)
    if backend == "cudnn" or L == M:
        dq, dk, dv = attention_block_backward(
            dout, q, k, v, out, lse, scale=scale, causal=True, backend=backend
        )
        return [(0, dq)], dk, dv
    sq = attention_block_backward(
        dout[:M], q[:M], k, v, out[:M], lse[:M], scale=scale, causal=True, backend=backend
    )
    rest = attention_block_backward(
        dout[M:], q[M:], k, v, out[M:], lse[M:], scale=scale, causal=False, backend=backend
    )
    return [(0, sq[0]), (M, rest[0])], sq[1] + rest[1], sq[2] + rest[2]


def request_ends(segments_host: torch.Tensor, num_tokens: int) -> list[int]:
    """End row (exclusive, in batch order) of each request's new tokens, from the plan's
    segments (column 3 holds the request's first row, two segments per request)."""
    starts = segments_host[0::2, 3].tolist()  # ok: host (segments_host)
    return starts[1:] + [num_tokens]


def pcp_key_major_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
    dq_into: Targets | Callable[[], Targets] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One rank's key-major backward of causal attention over a batch of requests.

    Args:
        dout, q, out, lse: every rank's rows in batch order (all-gathered and restored):
            [N, Hq, Dv], [N, Hq, Dqk], [N, Hq, Dv], [N, Hq] (the merged output and LSE).
        k, v: this rank's own rows in its local layout, [T, Hkv, Dqk] / [T, Hkv, Dv].
        segments: the rank's plan segments on the host (``PCPPlan.segments_host``): for each of
            its chunks, the local rows and the chunk's first row in batch order.
        scale: softmax scale.
        dq_into: targets tiling the N rows of dQ (see :func:`sum_pieces_into`), e.g. views of
            the reduce-scatter buffer, that receive dQ instead of a fresh tensor (dq is then
            None); or a function returning them, called once the kernels are done, so that
            their buffer does not sit beside the kernels' workspaces.

    Returns:
        dq [N, Hq, Dqk]: the gradient of every query from this rank's keys (0 before its first
        chunk); summed over ranks it is the full dQ. dk, dv [T, ...]: the complete gradients of
        the rank's own keys, 0 on padding rows.
    """
    ends = request_ends(segments, q.shape[0])
    dq_p: list[Piece] = []
    dk_p: list[Piece] = []
    dv_p: list[Piece] = []
    dout, q, out, k, v = (x.contiguous() for x in (dout, q, out, k, v))
    lse = lse.contiguous()
    for req, q0, ql, k0, kl in host_segments(segments):
        first = k0 + kl - ql  # the chunk's first token in batch order
        rows = slice(first, ends[req])
        keys = slice(q0, q0 + ql)
        pq, gk, gv = tall_causal_backward(
            dout[rows], q[rows], k[keys], v[keys], out[rows], lse[rows],
            scale=scale, backend=backend,
        )  # fmt: skip
        dq_p += [(first + a, x) for a, x in pq]
        dk_p.append((q0, gk))
        dv_p.append((q0, gv))
    if callable(dq_into):
        dq_into = dq_into()
    dq = None
    if dq_into is None:
        dq = sum_pieces_into(torch.empty_like(q), dq_p)
    else:
        sum_pieces_into(dq_into, dq_p)
    dk = sum_pieces_into(torch.empty_like(k), dk_p)
    dv = sum_pieces_into(torch.empty_like(v), dv_p)
    return dq, dk, dv
