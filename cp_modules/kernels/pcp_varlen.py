"""PCP head/tail attention of every segment in one variable-length kernel call.

The block path (:mod:`cp_modules.kernels.pcp_attention`) runs each segment (a request's head
or tail chunk on this rank) as its own kernel calls and sums its gradients row run by row:
with tens of requests a step is bound by host time. Here every segment is one sequence of a
varlen call: its real queries against its keys ``[k_start, k_start + k_len)``, causal
aligned at the bottom right (query ``i`` of a segment sees its keys ``0 .. k_len - q_len +
i``), so one call serves the whole batch.

The keys of the segments are packed one after another; a request's head and tail segments
share their first keys, so the packed K/V hold ``sum(k_len)`` rows (about ``N (1 + 1/2P)``)
and their gradients are added back per restored row (at most two contributions a row).

A cached prefix (chunked prefill) is a second, unmasked varlen call: one sequence per request,
the queries of all its segments against its prefix rows, read where they lie (``cu_k`` is the
prefix's own ``prefix_cu``; a request without queries here is a sequence of no queries), so
no prefix row is copied; the two partials are merged by LSE. The segments of requests with a
prefix are packed first, so that call's queries are the leading packed rows. The backward
runs both calls with the merged output and LSE and adds the query gradients.

The kernel is FlashAttention-2's varlen entry in PyTorch on CUDA, the reference on CPU.
FlashAttention-2 wants one head dim for queries, keys and values: narrower values (MLA's 128
against 192) are zero-padded to the query dim and the padding columns of the output dropped
(the backward likewise pads ``dout`` and ``out``, whose padding adds nothing to
``rowsum(dout * out)``).

The packing depends only on the plan's segments (and prefix lengths), so it is built once per
plan and kept on the plan's host segments tensor (:func:`varlen_pack_cached`): every layer of
a step, forward and backward, reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cp_modules.reference.pcp_attention import (
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
    "varlen_pack_cached",
]


@dataclass(frozen=True)
class VarlenCall:
    """The sequences of one varlen call: packed query rows ``[cu_q[i], cu_q[i + 1])`` attend
    key rows ``[cu_k[i], cu_k[i + 1])``.

    Attributes:
        cu_q, cu_k: [S + 1] int32 on the device.
        cu_q_host, cu_k_host: the same as host lists.
        max_q, max_k: the longest sequence's query / key count.
        causal: bottom-right causal (the new keys) or unmasked (a cached prefix).
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    cu_q_host: list[int]
    cu_k_host: list[int]
    max_q: int
    max_k: int
    causal: bool


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
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    new: VarlenCall
    prefix: VarlenCall | None


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    # concat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorised.
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(total) - offsets


def _cumsum0(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(x)]).astype(np.int64)


def varlen_pack(
    segments: torch.Tensor, device: torch.device | str, prefix_cu: list[int] | None = None
) -> VarlenPack:
    """The packing of a plan's segments ([S, 5] int64, ``SEGMENT_FIELDS``), with the
    requests' cached prefixes ragged by ``prefix_cu`` ([R + 1] host ints) if given."""
    segs = (segments if segments.device.type == "cpu" else segments.cpu()).numpy()
    segs = segs[segs[:, 2] > 0]
    pcu = None if prefix_cu is None else np.asarray(prefix_cu, dtype=np.int64)
    if pcu is not None:
        # Segments of requests with a prefix first, by request; the rest keep their order.
        has = (pcu[segs[:, 0] + 1] - pcu[segs[:, 0]]) > 0
        segs = segs[np.lexsort((segs[:, 0], ~has))]
    req, qs, ql, ks, kl = (segs[:, j] for j in range(5))
    parts = [_ragged(qs, ql), _ragged(ks, kl), _cumsum0(ql), _cumsum0(kl)]
    if pcu is not None:
        # Per request: its queries here if it has a prefix (else none), against its prefix.
        plen = pcu[1:] - pcu[:-1]
        rows = np.bincount(req, weights=ql, minlength=plen.size).astype(np.int64)
        rows[plen == 0] = 0
        parts += [_cumsum0(rows), pcu]
    host = torch.from_numpy(np.concatenate(parts))
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    views, at = [], 0
    for p in parts:
        views.append(dev[at : at + p.size])
        at += p.size

    def call(cu_q: np.ndarray, cu_k: np.ndarray, dq, dk, causal: bool) -> VarlenCall:
        return VarlenCall(
            cu_q=dq.to(torch.int32),
            cu_k=dk.to(torch.int32),
            cu_q_host=cu_q.tolist(),  # ok: host (numpy)
            cu_k_host=cu_k.tolist(),  # ok: host (numpy)
            max_q=int(np.diff(cu_q).max()) if cu_q.size > 1 else 0,
            max_k=int(np.diff(cu_k).max()) if cu_k.size > 1 else 0,
            causal=causal,
        )

    prefix = None
    if pcu is not None and int(parts[4][-1]) > 0:
        prefix = call(parts[4], parts[5], views[4], views[5], causal=False)
    return VarlenPack(
        q_index=views[0],
        k_index=views[1],
        new=call(parts[2], parts[3], views[2], views[3], causal=True),
        prefix=prefix,
    )


_PACK_ATTR = "_cp_varlen_pack"


def varlen_pack_cached(
    segments: torch.Tensor, device: torch.device | str, prefix_cu: list[int] | None = None
) -> VarlenPack:
    """:func:`varlen_pack`, memoised on ``segments`` (per device and prefix, dropped if
    ``segments`` is modified)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), segments._version, None if prefix_cu is None else tuple(prefix_cu))
    cached = getattr(segments, _PACK_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    pack = varlen_pack(segments, device, prefix_cu)
    try:
        setattr(segments, _PACK_ATTR, (key, pack))
    except (AttributeError, RuntimeError):  # a tensor subclass that takes no attributes
        pass
    return pack


# --------------------------------------------------------------------------- kernels


def varlen_forward_reference(qp, kp, vp, c: VarlenCall, scale: float):
    """(out [Tq, Hq, Dv], lse [Tq, Hq]) of the packed sequences, one by one (the oracle)."""
    out = qp.new_zeros(qp.shape[0], qp.shape[1], vp.shape[2])
    lse = qp.new_full(qp.shape[:2], float("-inf"), dtype=lse_dtype(qp.dtype))
    cq, ck = c.cu_q_host, c.cu_k_host
    for i in range(len(cq) - 1):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if rq.start == rq.stop:
            continue
        out[rq], lse[rq] = attention_with_lse(qp[rq], kp[rk], vp[rk], scale=scale, causal=c.causal)
    return out, lse


def varlen_backward_reference(dop, qp, kp, vp, op, lsep, c: VarlenCall, scale: float):
    """(dq, dk, dv) of the packed sequences in their inputs' dtypes (the oracle)."""
    dq, dk, dv = torch.zeros_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
    cq, ck = c.cu_q_host, c.cu_k_host
    for i in range(len(cq) - 1):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if rq.start == rq.stop:
            continue
        gq, gk, gv = attention_with_lse_backward(
            dop[rq], qp[rq], kp[rk], vp[rk], op[rq], lsep[rq], scale=scale, causal=c.causal
        )
        dq[rq], dk[rk], dv[rk] = gq, gk, gv
    return dq, dk, dv


def _pad_to(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def varlen_forward_flash(qp, kp, vp, c: VarlenCall, scale: float):
    """FlashAttention-2's varlen forward: (out, lse [Tq, Hq] fp32)."""
    dv = vp.shape[-1]
    res = torch.ops.aten._flash_attention_forward(
        qp, kp, _pad_to(vp, qp.shape[-1]), c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0, c.causal,
        False, scale=scale,
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


def pcp_prefill_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    scale: float,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    prefix_cu: list[int] | None = None,
    *,
    pack: VarlenPack | None = None,
    forward=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention of the local queries (and cached prefixes) by varlen calls.

    Same contract as :func:`~cp_modules.reference.pcp_attention.pcp_prefill_attention_reference`:
    out [T, Hq, Dv] (0 on padding rows), lse [T, Hq] fp32 (-inf there). ``prefix_*``: the
    requests' cached keys / values ragged by ``prefix_cu`` (host ints), or None.
    ``forward`` overrides the kernel (tests pass the reference).
    """
    from cp_modules.kernels.pcp_attention import merge_partials_into

    pack = pack or varlen_pack_cached(segments, q.device, prefix_cu)
    forward = forward or _kernels(q.device)[0]
    qp = q.index_select(0, pack.q_index)
    kp, vp = k.index_select(0, pack.k_index), v.index_select(0, pack.k_index)
    op, lsep = forward(qp, kp, vp, pack.new, scale)
    lsep = lsep.to(lse_dtype(q.dtype))
    if pack.prefix is not None:
        n1 = pack.prefix.cu_q_host[-1]
        o1, s1 = forward(qp[:n1], prefix_k, prefix_v, pack.prefix, scale)
        merge_partials_into([op[:n1], o1], [lsep[:n1], s1.to(lsep.dtype)], op[:n1], lsep[:n1])
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    out.index_copy_(0, pack.q_index, op.to(out.dtype))
    lse.index_copy_(0, pack.q_index, lsep)
    return out, lse


def pcp_prefill_attention_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: torch.Tensor,
    scale: float,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    prefix_cu: list[int] | None = None,
    *,
    pack: VarlenPack | None = None,
    backward=None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of :func:`pcp_prefill_attention_varlen`: dq [T], dk [N], dv [N] and, with a
    prefix, dprefix_k [C], dprefix_v [C], in the inputs' dtypes (0 on rows nothing reaches). A
    key row gets up to two contributions (the request's head and tail segments), added in the
    result's dtype."""
    pack = pack or varlen_pack_cached(segments, q.device, prefix_cu)
    backward = backward or _kernels(q.device)[1]
    qi, ki = pack.q_index, pack.k_index
    dop, qp, op, lsep = (x.index_select(0, qi) for x in (dout, q, out, lse))
    gq, gk, gv = backward(
        dop, qp, k.index_select(0, ki), v.index_select(0, ki), op, lsep, pack.new, scale
    )
    dprefix = ()
    if prefix_cu is not None:
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
