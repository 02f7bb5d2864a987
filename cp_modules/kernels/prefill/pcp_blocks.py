"""PCP head/tail prefill attention by blocks: causal square + rectangle + prefix, LSE-merged.

Shape letters: T = this rank's local queries (padding included), N = restored new tokens, C =
cached-prefix tokens, L / M = queries / keys of one block, Hq / Hkv = query / KV heads,
Dqk / Dv = head dims, S = segments (``cp_modules.partition.plan.SEGMENT_FIELDS``).

A segment's bottom-right causal attention over ``k_len`` keys is split into blocks that every
fused attention kernel serves at full speed (:mod:`cp_modules.kernels.prefill.attention_blocks`):

* the causal *square*: the segment's ``q_len`` queries against its last ``q_len`` keys;
* the *rectangle*: the same queries against the ``k_len - q_len`` keys before them, no mask;
* the *prefix*: the same queries against the request's cached prefix, no mask;

merged exactly by their LSEs in one Triton pass (:func:`~cp_modules.kernels.merge.
merge_partials_into`) that writes the segment's rows of the result (in place over the squares'
output when that holds every row in order: one request, no padding; otherwise a fresh result
whose padding rows alone are initialised). A rank's head and tail squares of equal size run as
one batched call (a strided view, no copy). The backward runs the same blocks with the
*merged* output and LSE, so each block's probabilities are its share of the full softmax and
the block gradients sum to the gradient of the whole attention; each gradient row is then
written once (:func:`~cp_modules.kernels.prefill.grad_assembly.sum_pieces_into`), partly on a second
CUDA stream while the squares run. Long MLA rectangles may run their backward as causal pairs
(:func:`rectangle_backward_causal_pairs`). Lengths come from the host copy of the plan's
segments: nothing here reads device memory on the host. Which path runs (these blocks or one
varlen call) is decided in :mod:`cp_modules.ops.pcp_policy`; why the blocks and the variants
measured and not kept: ``docs/switch-points.md``.
"""

from __future__ import annotations

import contextlib

import torch

from cp_modules.kernels.merge import merge_partials_into
from cp_modules.kernels.prefill.attention_blocks import (
    BlockBackward,
    BlockForward,
    attention_block_backward,
    attention_block_forward,
    select_block_backend,
)
from cp_modules.kernels.prefill.grad_assembly import Piece, sole_piece, sum_pieces_into
from cp_modules.policy import CPPolicy
from cp_modules.reference.pcp_attention import PrefillInputs, lse_dtype

__all__ = [
    "host_segments",
    "pcp_blocks_backward",
    "pcp_blocks_forward",
    "rectangle_backward_causal_pairs",
]

_DEFAULTS = CPPolicy()


def _host(segments: torch.Tensor) -> torch.Tensor:
    # The plan keeps a host copy (``segments_host``) so that this is free; a device copy works
    # but costs a synchronization.
    return segments if segments.device.type == "cpu" else segments.cpu()


def _rows(x: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """``length`` rows of ``x`` (contiguous [N, ...]) from each start.

    One start gives the slice; two give a [2, length, ...] view whose batch stride is the
    distance between the starts (no copy), which is how two equal squares share one call.
    """
    if len(starts) == 1:
        return x[starts[0] : starts[0] + length]
    a, b = starts
    assert b > a and x.is_contiguous()
    row = x.stride(0)
    return x.as_strided(
        (2, length, *x.shape[1:]),
        ((b - a) * row, *x.stride()),
        x.storage_offset() + a * row,
    )


def _square_groups(segs: list[list[int]]) -> list[list[int]]:
    """Indices of the segments whose causal squares run in one call.

    Two segments pair up when their squares have the same size and both their query rows and
    their square keys start later for the second (positive batch strides): a request's head
    and tail on a rank, in a training batch of equal-length sequences. Others run alone.
    """
    groups, i = [], 0
    while i < len(segs):
        a = segs[i]
        if i + 1 < len(segs):
            b = segs[i + 1]
            if b[2] == a[2] and b[1] > a[1] and _square_start(b) > _square_start(a):
                groups.append([i, i + 1])
                i += 2
                continue
        groups.append([i])
        i += 1
    return groups


def _square_start(seg: list[int]) -> int:
    _, _, ql, k0, kl = seg
    return k0 + kl - ql


def _other_blocks(
    seg: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu: list[int] | None,
) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """(where, first key row, keys, values) of a segment's unmasked blocks: the rectangle of
    new keys before its square, and its request's cached prefix."""
    req, _, ql, k0, kl = seg
    blocks = []
    if kl > ql:
        split = k0 + kl - ql
        blocks.append(("new", k0, k[k0:split], v[k0:split]))
    if prefix_cu is not None and prefix_cu[req + 1] > prefix_cu[req]:
        assert prefix_k is not None and prefix_v is not None  # they come with prefix_cu
        p0, p1 = prefix_cu[req], prefix_cu[req + 1]
        blocks.append(("prefix", p0, prefix_k[p0:p1], prefix_v[p0:p1]))
    return blocks


def host_segments(segments: torch.Tensor) -> list[list[int]]:
    """The non-empty segments ([S, 5] int64, ideally the plan's host copy) as host lists."""
    return [s for s in _host(segments).tolist() if s[2] > 0]  # ok: host (segments_host)


def pcp_blocks_forward(
    inputs: PrefillInputs,
    *,
    block_forward: BlockForward = attention_block_forward,
    segs: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention of the local queries by blocks; same contract as the reference.

    Args:
        inputs: the queries, keys, values, host segments, prefixes and scale
            (:class:`~cp_modules.reference.pcp_attention.PrefillInputs`).
        block_forward: the per-block kernel (tests pass the reference to check the
            decomposition on CPU).
        segs: :func:`host_segments` of ``segments`` if the caller has them already.

    Returns:
        out [T, Hq, Dv] in q's dtype (0 on padding rows), lse [T, Hq] fp32 (-inf on padding).
    """
    q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale = inputs
    segs = host_segments(segments) if segs is None else segs
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    prefix_cu = None
    if prefix_k is not None and prefix_cu_seqlens is not None:
        assert prefix_v is not None, "prefix_k and prefix_v come together"
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
        prefix_cu = prefix_cu_seqlens.tolist()  # ok: host (CPU tensor)
    T, rows_shape = q.shape[0], (q.shape[1], v.shape[2])
    squares: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out = None
    groups = _square_groups(segs)
    for group in groups:
        ql = segs[group[0]][2]
        ks = [_square_start(segs[i]) for i in group]
        o, s = block_forward(
            _rows(q, [segs[i][1] for i in group], ql),
            _rows(k, ks, ql),
            _rows(v, ks, ql),
            scale=scale,
            causal=True,
        )
        for j, i in enumerate(group):
            squares[i] = (o[j], s[j]) if len(group) > 1 else (o, s)
        if len(groups) == 1 and [segs[i][1] for i in group] == list(range(0, T, ql)):
            if o.is_contiguous():
                # The squares' output holds every row of the result in order (one request's
                # head and tail, no padding): merge into it in place instead of copying. A
                # plain tensor on the same storage, not a view, so that callers may still
                # write into the op's output in place under autograd.
                out = o.new_empty(0).set_(
                    o.untyped_storage(),
                    o.storage_offset(),
                    (T, *rows_shape),
                    (rows_shape[0] * rows_shape[1], rows_shape[1], 1),
                )
    if out is None:
        out = q.new_empty(T, *rows_shape)
        _fill_uncovered(out, segs, 0.0)
    lse = torch.empty(q.shape[:2], dtype=lse_dtype(q.dtype), device=q.device)
    _fill_uncovered(lse, segs, float("-inf"))
    for i, seg in enumerate(segs):
        r = slice(seg[1], seg[1] + seg[2])
        outs, lses = [squares[i][0]], [squares[i][1]]
        for _, _, kb, vb in _other_blocks(seg, k, v, prefix_k, prefix_v, prefix_cu):
            o, s = block_forward(q[r], kb, vb, scale=scale, causal=False)
            outs.append(o)
            lses.append(s)
        merge_partials_into(outs, lses, out[r], lse[r])
    return out, lse


def _fill_uncovered(x: torch.Tensor, segs: list[list[int]], value: float) -> None:
    """Fill the rows of ``x`` that no segment's queries cover (padding) with ``value``.

    The merges write every covered row, so the rest is all that needs initialising; past a
    handful of separate runs one fill of the whole tensor costs less than many small ones.
    """
    spans = sorted((seg[1], seg[1] + seg[2]) for seg in segs)
    gaps, pos = [], 0
    for a, b in spans:
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < x.shape[0]:
        gaps.append((pos, x.shape[0]))
    if len(gaps) > 4:
        x.fill_(value)
        return
    for a, b in gaps:
        x[a:b].fill_(value)


def _causal_pairs(
    forced: bool | None, min_rows: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    # Where cuDNN's causal backward outruns its unmasked one (MLA's head dims, long blocks:
    # docs/switch-points.md).
    L, M = q.shape[0], k.shape[0]
    if L < 2 or M < L:
        return False
    if forced is not None:
        return forced
    return (
        L >= min_rows
        and q.shape[-1] != v.shape[-1]
        and select_block_backend(q, k, v, True) == "cudnn"
    )


def rectangle_backward_causal_pairs(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    block_backward: BlockBackward = attention_block_backward,
) -> tuple[list[Piece], list[Piece], list[Piece]]:
    """Backward of an unmasked block (q [L, ...] against k, v [M, ...], M >= L) as causal calls.

    The keys are cut into L-wide tiles. An unmasked L x L tile is its lower triangle (a causal
    call) plus its strict upper triangle; with queries and keys in reversed order the strict
    upper triangle is the causal (L - 1)-square of q[:-1] against k[1:]. So each tile takes two
    causal calls (the reversed operands are copies), and keys past the last whole tile take
    one unmasked call. The probabilities come from the merged ``out`` and ``lse``, so the
    pieces add up to the block's gradients exactly.

    Returns:
        (dq, dk, dv) pieces for :func:`sum_pieces_into`, rows relative to q and to k / v:
        dq as one fp32 piece, the strict upper triangles' dk / dv as reversed pieces.
    """
    L, M = q.shape[0], k.shape[0]
    span = M // L * L
    dout_r, q_r, out_r, lse_r = (x.flip(0) for x in (dout, q, out, lse))
    k_r, v_r = k[:span].flip(0), v[:span].flip(0)
    dq = torch.zeros(q.shape, dtype=lse_dtype(q.dtype), device=q.device)
    dq_up = torch.zeros_like(dq[1:])  # reversed rows of q[:-1]
    dk_p: list[Piece] = []
    dv_p: list[Piece] = []
    for a in range(0, span, L):
        gq, gk, gv = block_backward(
            dout, q, k[a : a + L], v[a : a + L], out, lse, scale=scale, causal=True
        )
        dq += gq
        dk_p.append((a, gk))
        dv_p.append((a, gv))
        f = span - a - L  # the tile's first row in k_r
        gq, gk, gv = block_backward(
            dout_r[1:], q_r[1:], k_r[f : f + L - 1], v_r[f : f + L - 1], out_r[1:], lse_r[1:],
            scale=scale, causal=True,
        )  # fmt: skip
        dq_up += gq
        dk_p.append((a + 1, gk, True))
        dv_p.append((a + 1, gv, True))
    dq[:-1] += dq_up.flip(0)
    if span < M:
        gq, gk, gv = block_backward(
            dout, q, k[span:], v[span:], out, lse, scale=scale, causal=False
        )
        dq += gq
        dk_p.append((span, gk))
        dv_p.append((span, gv))
    return [(0, dq)], dk_p, dv_p


# A second CUDA stream per device for the gradient sums that overlap the squares' backward.
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    device = torch.device(
        "cuda", device.index if device.index is not None else torch.cuda.current_device()
    )
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


@contextlib.contextmanager
def _on_side(side: torch.cuda.Stream | None, main: torch.cuda.Stream | None):
    """Run the body on ``side`` after the work queued so far on ``main`` (inline without one).

    The caller makes ``main`` wait for ``side`` before anything frees or reads what the body
    wrote; tensors the body allocates belong to ``side``'s memory pool.
    """
    if side is None:
        yield
        return
    assert main is not None
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield


def _still_needed(
    pieces: list[Piece], late: list[tuple[int, int]], side: torch.cuda.Stream | None
) -> list[Piece]:
    """The pieces that touch a ``late`` range (rows written after the squares). The others
    have been read by writes queued on ``side``: their memory is handed to it, so that it is
    reused only once those writes are done."""
    kept = []
    for piece in pieces:
        first, x = piece[0], piece[1]
        if any(a < first + x.shape[0] and first < a + m for a, m in late):
            kept.append(piece)
        elif side is not None:
            x.record_stream(side)
    return kept


def _one_square(
    segs: list[list[int]], q: torch.Tensor, k: torch.Tensor, prefix_cu: list[int] | None
) -> bool:
    """Whether the only segment is one causal square over every query and key row, with no
    cached prefix."""
    if len(segs) != 1:
        return False
    req, q0, ql, k0, kl = segs[0]
    no_prefix = prefix_cu is None or prefix_cu[req + 1] == prefix_cu[req]
    return q0 == 0 and k0 == 0 and ql == kl == q.shape[0] == k.shape[0] and no_prefix


def pcp_blocks_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    inputs: PrefillInputs,
    *,
    block_backward: BlockBackward = attention_block_backward,
    causal_pairs: bool | None = None,
    causal_pairs_min_rows: int = _DEFAULTS.causal_pairs_min_rows,
    overlap_gradient_sums: bool = _DEFAULTS.overlap_gradient_sums,
    dk_into: list[tuple[int, torch.Tensor]] | None = None,
    dv_into: list[tuple[int, torch.Tensor]] | None = None,
    segs: list[list[int]] | None = None,
) -> tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]:
    """Gradients of :func:`pcp_blocks_forward`, block by block.

    ``dout``: [T, Hq, Dv] gradient of the output; ``out``, ``lse``: the forward's results;
    ``inputs``: as in the forward. Every block (the paired squares, each rectangle and prefix) yields (dq, dk, dv) for its
    rows; :func:`sum_pieces_into` writes each gradient row once, on CUDA partly on a second
    stream while the squares run (``overlap_gradient_sums``). Pieces are the kernels'
    outputs, summed in fp32 and rounded once per row. ``causal_pairs``: whether unmasked
    blocks run as causal pairs (:func:`rectangle_backward_causal_pairs`); None decides per
    block (MLA head dims on cuDNN, at least ``causal_pairs_min_rows`` queries). ``dk_into`` /
    ``dv_into``: targets tiling the N rows of dK / dV (see :func:`sum_pieces_into`) that
    receive the gradient instead of a fresh tensor; that result is then None. ``segs``: as in
    :func:`pcp_blocks_forward`.

    Returns:
        dq [T, Hq, Dqk], dk [N, Hkv, Dqk], dv [N, Hkv, Dv], dprefix_k, dprefix_v (None
        without a prefix), each in its input's dtype.
    """
    q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale = inputs
    segs = host_segments(segments) if segs is None else segs
    dout, q, k, v, out = (x.contiguous() for x in (dout, q, k, v, out))
    lse = lse.contiguous()
    prefix_cu = None
    if prefix_k is not None and prefix_cu_seqlens is not None:
        assert prefix_v is not None, "prefix_k and prefix_v come together"
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
        prefix_cu = prefix_cu_seqlens.tolist()  # ok: host (CPU tensor)
    if dk_into is None and _one_square(segs, q, k, prefix_cu):
        # One causal square covers every query and key row (one request at P = 1, no cached
        # prefix): its gradients are the results as they are, with no assembly.
        gq, gk, gv = block_backward(dout, q, k, v, out, lse, scale=scale, causal=True)
        return sole_piece(gq, q), sole_piece(gk, k), sole_piece(gv, v), None, None
    dq_p: list[Piece] = []
    dk_p: dict[str, list[Piece]] = {"new": [], "prefix": []}
    dv_p: dict[str, list[Piece]] = {"new": [], "prefix": []}
    # The rectangles and prefixes run first and the causal squares last. In between, the rows
    # that no square touches (most of dK / dV, the prefix gradients, rows no block reaches) are
    # written on a second stream while the squares run: these sums and fills are memory-bound,
    # the squares' kernels compute-bound. The results are allocated only once needed (dQ after
    # the squares: every query row is in a square), and the pieces used up by then are handed
    # to the second stream's allocator, so the squares' workspace replaces them in memory.
    for seg in segs:
        r = slice(seg[1], seg[1] + seg[2])
        for where, first, kb, vb in _other_blocks(seg, k, v, prefix_k, prefix_v, prefix_cu):
            if _causal_pairs(causal_pairs, causal_pairs_min_rows, q[r], kb, vb):
                pq, pk, pv = rectangle_backward_causal_pairs(
                    dout[r], q[r], kb, vb, out[r], lse[r], scale=scale,
                    block_backward=block_backward,
                )  # fmt: skip
            else:
                gq, gk, gv = block_backward(
                    dout[r], q[r], kb, vb, out[r], lse[r], scale=scale, causal=False
                )
                pq, pk, pv = [(0, gq)], [(0, gk)], [(0, gv)]
            dq_p += [(seg[1] + a, *rest) for a, *rest in pq]
            dk_p[where] += [(first + a, *rest) for a, *rest in pk]
            dv_p[where] += [(first + a, *rest) for a, *rest in pv]
    # The last block's pieces live on in the lists only.
    pq = pk = pv = gq = gk = gv = None  # type: ignore[assignment]
    square_k = [(_square_start(seg), seg[2]) for seg in segs]
    side = _side_stream(q.device) if overlap_gradient_sums and q.is_cuda else None
    main = torch.cuda.current_stream(q.device) if side is not None else None
    dk_dst = torch.empty_like(k) if dk_into is None else dk_into
    dv_dst = torch.empty_like(v) if dv_into is None else dv_into
    dpk = dpv = None
    if prefix_k is not None and prefix_v is not None and prefix_cu is not None:
        dpk, dpv = torch.empty_like(prefix_k), torch.empty_like(prefix_v)
    with _on_side(side, main):
        sum_pieces_into(dk_dst, dk_p["new"], skip=square_k)
        sum_pieces_into(dv_dst, dv_p["new"], skip=square_k)
        if dpk is not None and dpv is not None:
            sum_pieces_into(dpk, dk_p["prefix"])
            sum_pieces_into(dpv, dv_p["prefix"])
    for where in ("new", "prefix"):
        late = square_k if where == "new" else []
        dk_p[where] = _still_needed(dk_p[where], late, side)
        dv_p[where] = _still_needed(dv_p[where], late, side)
    for group in _square_groups(segs):
        ql = segs[group[0]][2]
        qs = [segs[i][1] for i in group]
        ks = [_square_start(segs[i]) for i in group]
        gq, gk, gv = block_backward(
            _rows(dout, qs, ql),
            _rows(q, qs, ql),
            _rows(k, ks, ql),
            _rows(v, ks, ql),
            _rows(out, qs, ql),
            _rows(lse, qs, ql),
            scale=scale,
            causal=True,
        )
        if len(group) == 1:
            gq, gk, gv = (x.unsqueeze(0) for x in (gq, gk, gv))
        for j in range(len(group)):
            dq_p.append((qs[j], gq[j]))
            dk_p["new"].append((ks[j], gk[j]))
            dv_p["new"].append((ks[j], gv[j]))
    dq = torch.empty_like(q)
    sum_pieces_into(dq, dq_p)
    sum_pieces_into(dk_dst, dk_p["new"], only=square_k)
    sum_pieces_into(dv_dst, dv_p["new"], only=square_k)
    if side is not None:
        assert main is not None
        main.wait_stream(side)
    dk = dk_dst if isinstance(dk_dst, torch.Tensor) else None
    dv = dv_dst if isinstance(dv_dst, torch.Tensor) else None
    return dq, dk, dv, dpk, dpv
