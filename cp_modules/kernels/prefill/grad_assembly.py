"""Gradient assembly: each gradient row written once, as the fp32 sum of the blocks' pieces.

Shape letters: N = rows of the gradient (tokens), n = rows of one run.

A block backward yields gradient *pieces*: ``(first row, rows[, reversed])`` ranges of the
whole gradient. :func:`sum_pieces_into` walks the row intervals where the set of covering
pieces is constant and writes each interval once (zero, copy, ``a + b``, or the Triton sum of
up to four pieces, reversed ones read backwards), so no zeroed buffer is read back.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

from cp_modules.reference.pcp_attention import lse_dtype

__all__ = ["Piece", "sole_piece", "sum_pieces_into", "sum_rows_triton"]

Piece = tuple[int, torch.Tensor] | tuple[int, torch.Tensor, bool]
# (first row, rows) targets tiling a gradient's rows.
Targets = list[tuple[int, torch.Tensor]]


@triton.jit
def _sum_rows_kernel(
    dst, p0, p1, p2, p3, r0, r1, r2, r3, d0, d1, d2, d3, num_rows, row_len,
    NUM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # dst row i = sum over pieces k < NUM of piece k's row (r_k + i * d_k), d_k = +1 or -1;
    # one program: BLOCK consecutive elements of the flattened rows.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_rows * row_len
    i = offs // row_len
    col = offs % row_len
    acc = tl.load(p0 + (r0 + i * d0) * row_len + col, mask=mask, other=0.0).to(tl.float32)
    if NUM > 1:
        acc += tl.load(p1 + (r1 + i * d1) * row_len + col, mask=mask, other=0.0).to(tl.float32)
    if NUM > 2:
        acc += tl.load(p2 + (r2 + i * d2) * row_len + col, mask=mask, other=0.0).to(tl.float32)
    if NUM > 3:
        acc += tl.load(p3 + (r3 + i * d3) * row_len + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=mask)


def sum_rows_triton(rows: torch.Tensor, parts: list[tuple[torch.Tensor, int, int]]) -> None:
    """``rows`` [n, ...] (contiguous) = the fp32 sum of 1-4 parts, rounded once.

    A part is (piece, row of the piece that lands on rows[0], +1 or -1): -1 reads the piece's
    rows backwards, so a gradient computed on reversed operands is summed without a flipped
    copy. Pieces are contiguous with rows' row size.
    """
    num = len(parts)
    assert 1 <= num <= 4 and rows.is_contiguous()
    n, row_len = rows.shape[0], rows[0].numel()
    if n * row_len == 0:
        return
    for x, first, step in parts:
        assert x.is_contiguous() and x[0].numel() == row_len
        assert 0 <= first < x.shape[0] and 0 <= first + (n - 1) * step < x.shape[0]
    ps = [p for p, _, _ in parts] + [parts[0][0]] * (4 - num)
    firsts = [f for _, f, _ in parts] + [0] * (4 - num)
    steps = [d for _, _, d in parts] + [1] * (4 - num)
    block = 1024
    _sum_rows_kernel[(triton.cdiv(n * row_len, block),)](
        rows, *ps, *firsts, *steps, n, row_len, NUM=num, BLOCK=block
    )


def sole_piece(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient ``like``'s rows receive when one piece ``x`` covers each row exactly once:
    ``x`` itself (as a tensor that is no view) when it has ``like``'s shape and dtype and is
    contiguous, else a copy into a fresh tensor like ``like`` (what :func:`sum_pieces_into`
    writes for a single piece: the same values, rounded once)."""
    if x.shape == like.shape and x.dtype == like.dtype and x.is_contiguous():
        if x._base is None:
            return x
        return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.shape, x.stride())
    return torch.empty_like(like).copy_(x)


def _part_rows(part: tuple[torch.Tensor, int, int], n: int) -> torch.Tensor:
    # ``n`` rows of a (piece, first row, step) part in natural order (a copy when reversed).
    x, first, step = part
    return x[first : first + n] if step == 1 else x[first - n + 1 : first + 1].flip(0)


@overload
def sum_pieces_into(
    dst: torch.Tensor,
    pieces: list[Piece],
    *,
    skip: list[tuple[int, int]] | None = None,
    only: list[tuple[int, int]] | None = None,
) -> torch.Tensor: ...
@overload
def sum_pieces_into(
    dst: Targets,
    pieces: list[Piece],
    *,
    skip: list[tuple[int, int]] | None = None,
    only: list[tuple[int, int]] | None = None,
) -> Targets: ...
def sum_pieces_into(
    dst: torch.Tensor | Targets,
    pieces: list[Piece],
    *,
    skip: list[tuple[int, int]] | None = None,
    only: list[tuple[int, int]] | None = None,
) -> torch.Tensor | Targets:
    """Write into ``dst`` [N, ...] the sum of row ranges ``(first row, rows[, reversed])``;
    0 elsewhere. A reversed piece holds its rows last-first (natural row ``first + j`` is its
    row ``len - 1 - j``).

    ``dst`` may also be a list of ``(first row, rows)`` targets that tile rows ``[0, N)`` in
    order, each a tensor of its own (views into a buffer laid out differently, e.g. the
    all-gathered order that a reduce-scatter takes), so the result lands there without an
    index copy.

    Each run of rows covered by the same pieces is written once: zero-filled, copied, or the
    sum of its pieces computed in fp32 and rounded once (``a + b`` for two pieces of the
    result's dtype, else :func:`sum_rows_triton` on CUDA for up to 4 pieces, reversed ones
    included) — so no zeroed buffer is read back and each gradient block is read once.

    ``skip``: ``(first row, rows)`` ranges whose pieces do not exist yet; the rows they touch
    are left as they are. A second call with all the pieces and ``only`` = those ranges then
    writes just those rows, so the two calls together write every row once.
    """
    assert skip is None or only is None
    targets = [(0, dst)] if isinstance(dst, torch.Tensor) else dst
    n = 0
    for first, rows in targets:
        assert first == n, "targets must tile the rows in order"
        n += rows.shape[0]
    events: dict[int, list[int]] = {0: [], n: []}
    for first, _ in targets:
        events.setdefault(first, [])
    held = [(a, a + m) for a, m in (skip or only or ()) if m > 0]
    if only is not None and not held:
        return dst
    for a, b in held:
        assert 0 <= a and b <= n
        events.setdefault(a, [])
        events.setdefault(b, [])
    for idx, (first, x, *_) in enumerate(pieces):
        if x.shape[0] == 0:
            continue
        assert 0 <= first and first + x.shape[0] <= n
        events.setdefault(first, []).append(idx)
        events.setdefault(first + x.shape[0], []).append(~idx)
    active: list[int] = []
    points = sorted(events)
    t = -1
    for a, b in zip(points, points[1:]):
        for e in events[a]:
            if e >= 0:
                active.append(e)
            else:
                active.remove(~e)
        while t + 1 < len(targets) and targets[t + 1][0] <= a:
            t += 1
        if held and any(c < b and a < d for c, d in held) != (only is not None):
            continue
        t_first, t_rows = targets[t]
        rows = t_rows[a - t_first : b - t_first]
        # (piece, its row for natural row a, step)
        parts = []
        for i in active:
            first, x, *rev = pieces[i]
            if rev and rev[0]:
                parts.append((x, first + x.shape[0] - 1 - a, -1))
            else:
                parts.append((x, a - first, 1))
        n_rows = b - a
        natural = all(d == 1 for _, _, d in parts)
        fused = (
            rows.is_cuda
            and len(parts) <= 4
            and rows.is_contiguous()
            and all(x.is_contiguous() for x, _, _ in parts)
        )
        if not parts:
            rows.zero_()
        elif natural and len(parts) == 1:
            rows.copy_(_part_rows(parts[0], n_rows))
        elif natural and len(parts) == 2 and rows.dtype == parts[0][0].dtype == parts[1][0].dtype:
            torch.add(*(_part_rows(p, n_rows) for p in parts), out=rows)
        elif fused:
            sum_rows_triton(rows, parts)
        else:
            xs = [_part_rows(p, n_rows) for p in parts]
            acc = xs[0].to(lse_dtype(rows.dtype))
            for x in xs[1:]:
                acc = acc + x
            rows.copy_(acc)
    return dst
