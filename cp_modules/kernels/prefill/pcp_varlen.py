"""PCP head/tail attention of every segment in one variable-length kernel call.

The block path (:mod:`cp_modules.kernels.prefill.pcp_blocks`) runs each segment (a request's head
or tail chunk on this rank) as its own kernel calls and sums its gradients row run by row:
with tens of requests a step is bound by host time. Here every segment is one sequence of a
varlen call: its real queries against its keys ``[k_start, k_start + k_len)``, causal
aligned at the bottom right (query ``i`` of a segment sees its keys ``0 .. k_len - q_len +
i``), so one call serves the whole batch.

The forward runs over the local rows as they lie (:class:`InPlaceCalls`): a sequence per
segment in local order and one without keys per run of padding rows (set to 0 / -inf
afterwards), each segment's keys read where they lie in the restored K/V (FlashAttention-2's
``seqused_k``: a request's head and tail ranges overlap, which a forward may read). So
nothing is gathered and the output lands in place. The backward takes the queries, outputs
and their gradients in place too, but writes key gradients per sequence, so its keys are
packed one after another: the packed K/V hold ``sum(k_len)`` rows (about ``N (1 + 1/2P)``)
and their gradients are added back per restored row (at most two contributions a row).

A cached prefix (chunked prefill) is a second, unmasked varlen call over the prefix rows where
they lie (the request's range of ``prefix_cu``), merged by LSE; in the forward one sequence per
request spans its head and tail rows. The backward with a prefix packs the queries as well:
one sequence per request, the segments of requests with a prefix first (their queries are
the leading packed rows), and adds the two calls' query gradients. Segments whose rows
overlap have no in-place form and take the packed rows too.

The kernel is FlashAttention-2's varlen entry in PyTorch on CUDA, the reference on CPU.
FlashAttention-2 wants one head dim for queries, keys and values: narrower values (MLA's 128
against 192) are zero-padded to the query dim and the padding columns of the output dropped
(the backward likewise pads ``dout`` and ``out``, whose padding adds nothing to
``rowsum(dout * out)``).

The packing depends only on the plan's segments (and prefix lengths), so the caller builds it
once per plan (:func:`varlen_pack`) and passes it to every layer's call, forward and backward
(:mod:`cp_modules.ops.pcp_policy` keeps it with the plan's state).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cp_modules.kernels.merge import merge_partials_into
from cp_modules.kernels.prefill.grad_assembly import sole_piece
from cp_modules.pinned import pinned_copy
from cp_modules.reference.pcp_attention import (
    PrefillInputs,
    attention_with_lse,
    attention_with_lse_backward,
    lse_dtype,
)

__all__ = [
    "VarlenCall",
    "VarlenPack",
    "pcp_prefill_attention_varlen",
    "pcp_prefill_attention_varlen_backward",
    "varlen_pack",
]


@dataclass(frozen=True)
class VarlenCall:
    """The sequences of one varlen call: packed query rows ``[cu_q[i], cu_q[i + 1])`` attend
    key rows ``[cu_k[i], cu_k[i + 1])``.

    With ``k_used``, sequence ``i`` attends key rows ``[cu_k[i], cu_k[i] + k_used[i])``
    instead: the key ranges may then overlap and come in any order (a forward call that reads
    keys where they lie; FlashAttention-2's ``seqused_k``).

    Attributes:
        cu_q, cu_k: [S + 1] int32 on the device.
        cu_q_host, cu_k_host: the same as host lists.
        max_q, max_k: the longest sequence's query / key count.
        causal: bottom-right causal (the new keys) or unmasked (a cached prefix).
        k_used, k_used_host: [S] int32 on the device and as a host list, or None.
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    cu_q_host: list[int]
    cu_k_host: list[int]
    max_q: int
    max_k: int
    causal: bool
    k_used: torch.Tensor | None = None
    k_used_host: list[int] | None = None

    def key_range(self, i: int) -> slice:
        """Key rows of sequence ``i``."""
        a = self.cu_k_host[i]
        if self.k_used_host is None:
            return slice(a, self.cu_k_host[i + 1])
        return slice(a, a + self.k_used_host[i])


@dataclass(frozen=True)
class InPlaceCalls:
    """Varlen calls over the local rows as they lie: the sequences tile rows ``[0, T)`` in
    order, one per segment, plus one per run of padding rows (no keys), so the queries, the
    output and the LSE need no gather or scatter.

    Attributes:
        new: causal, keys read in place from the restored K/V (``k_used``).
        prefix: unmasked, one sequence per request from its first local row to its last (its
            head and tail: one query tile where they are short, not two), keys its cached
            prefix rows (``k_used``; none for requests without one); None without a prefix.
        backward: causal, keys packed as :attr:`VarlenPack.k_index` lays them out (the
            backward writes its key gradients per sequence, so the ranges must not overlap);
            None with a prefix (the backward then takes the packed path).
        pad_rows: [Tp] int64 on the device, the rows no segment covers (0 / -inf there).
        no_prefix_rows: [Tn] int64, the rows of the requests without a prefix (the prefix
            call's sequences without keys); None without a prefix.
        num_rows: T.
    """

    new: VarlenCall
    prefix: VarlenCall | None
    backward: VarlenCall | None
    pad_rows: torch.Tensor
    no_prefix_rows: torch.Tensor | None
    num_rows: int


@dataclass(frozen=True)
class VarlenPack:
    """Where the varlen calls' packed rows come from.

    Attributes:
        q_index: [Tq] int64, local query rows of the segments, segment by segment, the
            segments of requests with a cached prefix first.
        k_index: [Tk] int64, restored K/V rows of the segments, in the same segment order.
        new: the causal call over the segments' new keys.
        prefix: the unmasked call of the leading ``prefix.cu_q_host[-1]`` packed queries over
            the cached prefix rows as they lie, one sequence per request; None without a
            prefix.
        in_place: the calls over the local rows as they lie (given the row count T), or None.
        keys_in_order: ``k_index`` is ``0 .. Tk - 1``: the segments' keys are the restored
            rows in order, each once (one segment per request at P = 1), so the packed K/V
            are the K/V themselves and each key row gets one gradient contribution.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    new: VarlenCall
    prefix: VarlenCall | None
    in_place: InPlaceCalls | None = None
    keys_in_order: bool = False


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    # concat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorised.
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(total) - offsets


def _to_device(
    parts: dict[str, tuple[np.ndarray, torch.dtype]], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Host index arrays as device tensors of their dtypes: one (pinned, asynchronous)
    host-to-device copy for all of them, then typed views."""
    host = torch.from_numpy(np.concatenate([x for x, _ in parts.values()]).astype(np.int64))
    if torch.device(device).type == "cuda":
        host = pinned_copy(host)
    dev = host.to(device, non_blocking=True)
    views, at = {}, 0
    for name, (x, dtype) in parts.items():
        views[name] = dev[at : at + x.size].to(dtype)
        at += x.size
    return views


def _cumsum0(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(x)]).astype(np.int64)


def _tile(starts: np.ndarray, lens: np.ndarray, num_rows: int):
    """Sequences tiling rows ``[0, num_rows)``: the intervals ``[start, start + len)`` (in
    start order) and the runs of rows between them. Returns (start, length, interval index or
    -1 for a run between intervals) per sequence, or None if the intervals overlap or leave
    the rows."""
    order = np.argsort(starts, kind="stable")
    qs, ql = starts[order], lens[order]
    ends = qs + ql
    prev = np.concatenate([[0], ends])[:-1].astype(np.int64)
    if np.any(qs < prev) or (ends.size and ends[-1] > num_rows):
        return None
    # Per interval: the rows before it, then the interval; then the rows after the last.
    first = np.stack([prev, qs], 1).ravel()
    length = np.stack([qs - prev, ql], 1).ravel()
    which = np.stack([np.full_like(order, -1), order], 1).ravel()
    last = int(ends[-1]) if ends.size else 0
    first = np.concatenate([first, [last]])
    length = np.concatenate([length, [num_rows - last]])
    which = np.concatenate([which, [-1]])
    keep = length > 0
    return first[keep], length[keep], which[keep]


def varlen_pack(
    segments: torch.Tensor,
    device: torch.device | str,
    prefix_cu: list[int] | None = None,
    num_rows: int | None = None,
) -> VarlenPack:
    """The packing of a plan's segments ([S, 5] int64, ``SEGMENT_FIELDS``), with the
    requests' cached prefixes ragged by ``prefix_cu`` ([R + 1] host ints) if given; with
    ``num_rows`` (the local row count T) also the calls over the rows as they lie."""
    segs = (segments if segments.device.type == "cpu" else segments.cpu()).numpy()
    segs = segs[segs[:, 2] > 0]
    pcu = None if prefix_cu is None else np.asarray(prefix_cu, dtype=np.int64)
    # Prefix lengths per request (none without prefixes: read only where pcu is given).
    plen = np.zeros(0, np.int64) if pcu is None else pcu[1:] - pcu[:-1]
    if pcu is not None:
        # Segments of requests with a prefix first, by request; the rest keep their order.
        has = plen[segs[:, 0]] > 0
        segs = segs[np.lexsort((segs[:, 0], ~has))]
    else:
        segs = segs[np.argsort(segs[:, 1], kind="stable")]
    req, qs, ql, ks, kl = (segs[:, j] for j in range(5))
    k_index = _ragged(ks, kl)
    # Host arrays, copied to the device in one transfer: name -> (array, dtype there).
    parts = {
        "q_index": (_ragged(qs, ql), torch.int64),
        "k_index": (k_index, torch.int64),
        "cu_q": (_cumsum0(ql), torch.int32),
        "cu_k": (_cumsum0(kl), torch.int32),
    }
    if pcu is not None:
        # Per request: its queries here if it has a prefix (else none), against its prefix.
        rows = np.bincount(req, weights=ql, minlength=plen.size).astype(np.int64)
        rows[plen == 0] = 0
        parts["pre_cu_q"] = (_cumsum0(rows), torch.int32)
        parts["pre_cu_k"] = (pcu, torch.int32)
    runs = None if num_rows is None or not segs.size else _tile(qs, ql, num_rows)
    if runs is not None:
        assert num_rows is not None  # runs are tiled over the rows
        # One sequence per segment, one without keys per run of padding rows.
        first, lens, which = runs
        seg = which >= 0
        at = np.where(seg, which, 0)
        new_len = np.where(seg, kl[at], 0)
        parts["run_cu_q"] = (_cumsum0(lens), torch.int32)
        parts["run_k0"] = (np.concatenate([np.where(seg, ks[at], 0), [0]]), torch.int32)
        parts["run_kl"] = (new_len, torch.int32)
        parts["run_pad"] = (_ragged(first[~seg], lens[~seg]), torch.int64)
        if pcu is None:
            # The backward's keys: the packed rows, in the runs' (= the packing's) order.
            parts["run_cu_k"] = (_cumsum0(new_len), torch.int32)
        else:
            # The prefix call: one sequence per request, from its first local row to its
            # last (head, tail and any padding between: one query tile, not two), if the
            # requests' rows do not interleave; else one per segment.
            r_ids = np.unique(req)
            lo = np.full(plen.size, np.iinfo(np.int64).max)
            hi = np.zeros(plen.size, np.int64)
            np.minimum.at(lo, req, qs)
            np.maximum.at(hi, req, qs + ql)
            spans = _tile(lo[r_ids], hi[r_ids] - lo[r_ids], num_rows)
            if spans is not None:
                p_first, p_lens, p_which = spans
                p_req = np.where(p_which >= 0, r_ids[np.maximum(p_which, 0)], -1)
            else:
                p_first, p_lens = first, lens
                p_req = np.where(seg, req[at], -1)
            has = p_req >= 0
            r = np.maximum(p_req, 0)
            p_len = np.where(has, plen[r], 0)
            parts["pre_run_cu_q"] = (_cumsum0(p_lens), torch.int32)
            parts["pre_run_k0"] = (np.concatenate([np.where(has, pcu[r], 0), [0]]), torch.int32)
            parts["pre_run_kl"] = (p_len, torch.int32)
            empty = has & (p_len == 0)
            parts["pre_run_empty"] = (_ragged(p_first[empty], p_lens[empty]), torch.int64)
    views = _to_device(parts, device)

    def call(cu_q: str, cu_k: str, causal: bool, k_used: str | None = None) -> VarlenCall:
        hq, hk = parts[cu_q][0], parts[cu_k][0]
        used = None if k_used is None else parts[k_used][0]
        lengths = np.diff(hk) if used is None else used
        return VarlenCall(
            cu_q=views[cu_q],
            cu_k=views[cu_k],
            cu_q_host=hq.tolist(),  # ok: host (numpy)
            cu_k_host=hk.tolist(),  # ok: host (numpy)
            max_q=int(np.diff(hq).max()) if hq.size > 1 else 0,
            max_k=int(lengths.max()) if lengths.size else 0,
            causal=causal,
            k_used=None if k_used is None else views[k_used],
            k_used_host=None if used is None else used.tolist(),  # ok: host (numpy)
        )

    prefix = None
    if pcu is not None and int(parts["pre_cu_q"][0][-1]) > 0:
        prefix = call("pre_cu_q", "pre_cu_k", causal=False)
    in_place = None
    if runs is not None:
        assert num_rows is not None
        in_place = InPlaceCalls(
            new=call("run_cu_q", "run_k0", True, "run_kl"),
            prefix=(
                call("pre_run_cu_q", "pre_run_k0", False, "pre_run_kl")
                if prefix is not None
                else None
            ),
            backward=call("run_cu_q", "run_cu_k", True) if pcu is None else None,
            pad_rows=views["run_pad"],
            no_prefix_rows=views["pre_run_empty"] if prefix is not None else None,
            num_rows=num_rows,
        )
    return VarlenPack(
        q_index=views["q_index"],
        k_index=views["k_index"],
        new=call("cu_q", "cu_k", causal=True),
        prefix=prefix,
        in_place=in_place,
        keys_in_order=bool(np.array_equal(k_index, np.arange(k_index.size))),
    )


# --------------------------------------------------------------------------- kernels


def varlen_forward_reference(qp, kp, vp, c: VarlenCall, scale: float):
    """(out [Tq, Hq, Dv], lse [Tq, Hq]) of the packed sequences, one by one (the oracle); a
    sequence without keys gives 0 and -inf."""
    out = qp.new_zeros(qp.shape[0], qp.shape[1], vp.shape[2])
    lse = qp.new_full(qp.shape[:2], float("-inf"), dtype=lse_dtype(qp.dtype))
    cq = c.cu_q_host
    for i in range(len(cq) - 1):
        rq, rk = slice(cq[i], cq[i + 1]), c.key_range(i)
        if rq.start == rq.stop or rk.start == rk.stop:
            continue
        out[rq], lse[rq] = attention_with_lse(qp[rq], kp[rk], vp[rk], scale=scale, causal=c.causal)
    return out, lse


def varlen_backward_reference(dop, qp, kp, vp, op, lsep, c: VarlenCall, scale: float):
    """(dq, dk, dv) of the packed sequences in their inputs' dtypes (the oracle)."""
    dq, dk, dv = torch.zeros_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
    cq = c.cu_q_host
    for i in range(len(cq) - 1):
        rq, rk = slice(cq[i], cq[i + 1]), c.key_range(i)
        if rq.start == rq.stop or rk.start == rk.stop:
            continue
        gq, gk, gv = attention_with_lse_backward(
            dop[rq], qp[rq], kp[rk], vp[rk], op[rq], lsep[rq], scale=scale, causal=c.causal
        )
        dq[rq], dk[rk], dv[rk] = gq, gk, gv
    return dq, dk, dv


def _plain(x: torch.Tensor) -> torch.Tensor:
    # ``x`` itself if it is no view, else a tensor on the same memory that is not a view.
    if x._base is None:
        return x
    return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.shape, x.stride())


def _pad_to(x: torch.Tensor, d: int) -> torch.Tensor:
    # Zero columns up to ``d``, by one concatenation (the fastest way measured:
    # docs/switch-points.md).
    if x.shape[-1] == d:
        return x
    return torch.cat((x, x.new_zeros(*x.shape[:-1], d - x.shape[-1])), dim=-1)


def varlen_forward_flash(qp, kp, vp, c: VarlenCall, scale: float):
    """FlashAttention-2's varlen forward: (out, lse [Tq, Hq] fp32)."""
    dv = vp.shape[-1]
    # With at most one query a sequence and grouped KV heads, FlashAttention-2 folds the
    # query heads into the sequence dim, assuming exactly one query per sequence: a sequence
    # without queries breaks that. max_q is only a bound (the grid's query tiles), so 2 keeps
    # the general kernel.
    res = torch.ops.aten._flash_attention_forward(
        qp, kp, _pad_to(vp, qp.shape[-1]), c.cu_q, c.cu_k, max(c.max_q, 2), c.max_k, 0.0,
        c.causal, False, scale=scale, seqused_k=c.k_used,
    )  # fmt: skip
    out, lse = res[0][..., :dv], res[1]
    if lse.shape != (qp.shape[1], qp.shape[0]):
        raise RuntimeError(
            f"unexpected varlen LSE layout {tuple(lse.shape)} for {qp.shape[0]} packed queries "
            f"and {qp.shape[1]} heads (expected [heads, queries])"
        )
    return out, lse.t()


def varlen_backward_flash(dop, qp, kp, vp, op, lsep, c: VarlenCall, scale: float):
    """FlashAttention-2's varlen backward: (dq, dk, dv) in the inputs' dtype."""
    seed = torch.empty(2, dtype=torch.uint64, device=qp.device)
    unused = torch.empty((), dtype=torch.uint64, device=qp.device)
    d, dv = qp.shape[-1], vp.shape[-1]
    dq, dk, dvp = torch.ops.aten._flash_attention_backward(
        _pad_to(dop, d), qp, kp, _pad_to(vp, d), _pad_to(op, d), lsep.t().contiguous(),
        c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0, c.causal, seed, unused, scale=scale,
    )  # fmt: skip
    return dq, dk, dvp[..., :dv]


def _kernels(device: torch.device):
    if device.type == "cuda":
        return varlen_forward_flash, varlen_backward_flash
    return varlen_forward_reference, varlen_backward_reference


# --------------------------------------------------------------------------- PCP attention


def _padding_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # out [T, Hq, Dv] of zeros and lse [T, Hq] of -inf: every row as a padding row.
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    return out, torch.full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)


def _host_prefix_cu(inputs: PrefillInputs) -> list[int] | None:
    # The prefix offsets as host ints, or None without a prefix (prefix_k and its offsets).
    if inputs.prefix_k is None or inputs.prefix_cu_seqlens is None:
        return None
    return inputs.prefix_cu_seqlens.tolist()  # ok: host (CPU tensor)


def pcp_prefill_attention_varlen(
    inputs: PrefillInputs,
    *,
    pack: VarlenPack | None = None,
    forward=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention of the local queries (and cached prefixes) by varlen calls.

    Same contract as :func:`~cp_modules.reference.pcp_attention.pcp_prefill_attention_reference`:
    out [T, Hq, Dv] (0 on padding rows), lse [T, Hq] fp32 (-inf there). ``inputs``: a
    :class:`~cp_modules.reference.pcp_attention.PrefillInputs` (contiguous tensors; the prefix
    offsets on the host). ``pack``: :func:`varlen_pack` of the segments (built here if None);
    ``forward`` overrides the kernel (tests pass the reference).
    """
    q, k, v, segments, prefix_k, prefix_v, _, scale = inputs
    pack = pack or varlen_pack(segments, q.device, _host_prefix_cu(inputs), q.shape[0])
    forward = forward or _kernels(q.device)[0]
    if pack.new.cu_q_host[-1] == 0:  # no queries here: all padding
        return _padding_result(q, v)
    calls = pack.in_place
    if calls is not None and calls.num_rows == q.shape[0]:
        # Queries, keys and values where they lie: no gather, no scatter.
        out, lse = forward(q, k, v, calls.new, scale)
        lse = lse.to(lse_dtype(q.dtype))
        if calls.prefix is not None:
            o1, s1 = forward(q, prefix_k, prefix_v, calls.prefix, scale)
            s1 = s1.to(lse.dtype)
            empty = calls.no_prefix_rows  # set with the prefix call
            if empty is not None and empty.numel():  # sequences without keys: 0 and -inf
                o1.index_fill_(0, empty, 0.0)
                s1.index_fill_(0, empty, float("-inf"))
            merge_partials_into([out, o1], [lse, s1], out, lse)
        # Contiguous (as the op's fake declares them) and not views (the op's outputs may be
        # written in place under autograd), padding rows 0 and -inf whatever the kernel left.
        out, lse = _plain(out.contiguous()), _plain(lse.contiguous())
        if calls.pad_rows.numel():
            out.index_fill_(0, calls.pad_rows, 0.0)
            lse.index_fill_(0, calls.pad_rows, float("-inf"))
        return out, lse
    qp = q.index_select(0, pack.q_index)
    kp, vp = k.index_select(0, pack.k_index), v.index_select(0, pack.k_index)
    op, lsep = forward(qp, kp, vp, pack.new, scale)
    lsep = lsep.to(lse_dtype(q.dtype))
    if pack.prefix is not None:
        n1 = pack.prefix.cu_q_host[-1]
        o1, s1 = forward(qp[:n1], prefix_k, prefix_v, pack.prefix, scale)
        merge_partials_into([op[:n1], o1], [lsep[:n1], s1.to(lsep.dtype)], op[:n1], lsep[:n1])
    out, lse = _padding_result(q, v)
    out.index_copy_(0, pack.q_index, op.to(out.dtype))
    lse.index_copy_(0, pack.q_index, lsep)
    return out, lse


def pcp_prefill_attention_varlen_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    inputs: PrefillInputs,
    *,
    pack: VarlenPack | None = None,
    backward=None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of :func:`pcp_prefill_attention_varlen`: dq [T], dk [N], dv [N] and, with a
    prefix, dprefix_k [C], dprefix_v [C], in the inputs' dtypes (0 on rows nothing reaches). A
    key row gets up to two contributions (the request's head and tail segments), added in the
    result's dtype. ``dout``: [T, Hq, Dv] gradient of the output; ``out``, ``lse``: the
    forward's results (contiguous); ``inputs``, ``pack``: as in
    :func:`pcp_prefill_attention_varlen`."""
    q, k, v, segments, prefix_k, prefix_v, _, scale = inputs
    has_prefix = prefix_k is not None and inputs.prefix_cu_seqlens is not None
    pack = pack or varlen_pack(segments, q.device, _host_prefix_cu(inputs), q.shape[0])
    backward = backward or _kernels(q.device)[1]
    qi, ki = pack.q_index, pack.k_index
    if pack.new.cu_q_host[-1] == 0:  # no queries here: all padding
        zeros = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        if not has_prefix:
            return zeros
        assert prefix_k is not None and prefix_v is not None
        return (*zeros, torch.zeros_like(prefix_k), torch.zeros_like(prefix_v))
    calls = pack.in_place
    if not has_prefix and calls is not None and calls.num_rows == q.shape[0]:
        # Queries, outputs and their gradients where they lie; keys packed (their gradient
        # ranges must not overlap), added back per restored row.
        if pack.keys_in_order and ki.shape[0] == k.shape[0]:
            # The packed keys are the keys: no packing, and the kernel's key gradients are
            # the results (one contribution a row).
            gq, gk, gv = backward(dout, q, k, v, out, lse, calls.backward, scale)
            dk, dv = sole_piece(gk, k), sole_piece(gv, v)
        else:
            gq, gk, gv = backward(
                dout, q, k.index_select(0, ki), v.index_select(0, ki), out, lse,
                calls.backward, scale,
            )  # fmt: skip
            dk = torch.zeros_like(k).index_add_(0, ki, gk.to(k.dtype))
            dv = torch.zeros_like(v).index_add_(0, ki, gv.to(v.dtype))
        dq = gq.to(q.dtype)
        if calls.pad_rows.numel():
            dq.index_fill_(0, calls.pad_rows, 0.0)
        return dq, dk, dv
    dop, qp, op, lsep = (x.index_select(0, qi) for x in (dout, q, out, lse))
    gq, gk, gv = backward(
        dop, qp, k.index_select(0, ki), v.index_select(0, ki), op, lsep, pack.new, scale
    )
    dprefix: tuple[torch.Tensor, ...] = ()
    if has_prefix:
        assert prefix_k is not None and prefix_v is not None
        if pack.prefix is None:  # no query here has a prefix
            dprefix = (torch.zeros_like(prefix_k), torch.zeros_like(prefix_v))
        else:
            n1 = pack.prefix.cu_q_host[-1]
            gq1, gpk, gpv = backward(
                dop[:n1], qp[:n1], prefix_k, prefix_v, op[:n1], lsep[:n1], pack.prefix, scale
            )
            gq = gq.to(lse_dtype(gq.dtype))  # the two calls' query gradients, summed in fp32
            gq[:n1] += gq1
            dprefix = (gpk.to(prefix_k.dtype), gpv.to(prefix_v.dtype))
    dq = torch.zeros_like(q).index_copy_(0, qi, gq.to(q.dtype))
    dk = torch.zeros_like(k).index_add_(0, ki, gk.to(k.dtype))
    dv = torch.zeros_like(v).index_add_(0, ki, gv.to(v.dtype))
    return (dq, dk, dv, *dprefix)
