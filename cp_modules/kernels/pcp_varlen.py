"""PCP head/tail attention of every segment in one variable-length kernel call.

The block path (:mod:`cp_modules.kernels.pcp_attention`) runs each segment (a request's head
or tail chunk on this rank) as its own kernel calls and sums its gradients row run by row:
with tens of requests a step is bound by host time. Here every segment is one sequence of a
varlen call: its real queries against its keys ``[k_start, k_start + k_len)``, causal
aligned at the bottom right (query ``i`` of a segment sees its keys ``0 .. k_len - q_len +
i``), so one call serves the whole batch and needs no LSE merge.

The keys of the segments are packed one after another; a request's head and tail segments
share their first keys, so the packed K/V hold ``sum(k_len)`` rows (about ``N (1 + 1/2P)``)
and their gradients are added back per restored row (at most two contributions a row).

A cached prefix (chunked prefill) joins the same call: a segment's keys are its request's
prefix rows followed by its new keys, taken from the prefix and new K/V laid end to end, and
bottom-right alignment lets every query see the whole prefix. The kernel is
FlashAttention-2's varlen entry in PyTorch on CUDA, the reference on CPU. FlashAttention-2 wants one head dim for
queries, keys and values: narrower values (MLA's 128 against 192) are zero-padded to the query
dim and the padding columns of the output dropped (the backward likewise pads ``dout`` and
``out``, whose padding adds nothing to ``rowsum(dout * out)``).

The packing depends only on the plan's segments, so it is built once per plan and kept on the
plan's host segments tensor (:func:`varlen_pack_cached`): every layer of a step, forward and
backward, reuses it.
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
    "VarlenPack",
    "pcp_prefill_attention_varlen",
    "pcp_prefill_attention_varlen_backward",
    "varlen_pack",
    "varlen_pack_cached",
]


@dataclass(frozen=True)
class VarlenPack:
    """Where the varlen call's packed rows come from.

    Attributes:
        q_index: [Tq] int64, local query rows of the segments, segment by segment.
        k_index: [Tk] int64, K/V rows of the segments, segment by segment: rows of
            ``cat([prefix, new])`` (the new rows offset by the prefix rows C; C = 0 without).
        cu_q, cu_k: [S' + 1] int32, cumulative query / key counts (S' non-empty segments).
        cu_q_host, cu_k_host: the same as host lists.
        max_q, max_k: the longest segment's query / key count.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    cu_q_host: list[int]
    cu_k_host: list[int]
    max_q: int
    max_k: int


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    # concat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorised.
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(total) - offsets


def varlen_pack(
    segments: torch.Tensor, device: torch.device | str, prefix_cu: list[int] | None = None
) -> VarlenPack:
    """The packing of a plan's segments ([S, 5] int64 on the host, ``SEGMENT_FIELDS``), with
    the requests' cached prefixes ragged by ``prefix_cu`` ([R + 1] host ints) if given."""
    segs = (segments if segments.device.type == "cpu" else segments.cpu()).numpy()
    keep = segs[:, 2] > 0
    req, qs, ql, ks, kl = (segs[keep, j] for j in range(5))
    if prefix_cu is None:
        k_rows, k_len = _ragged(ks, kl), kl
    else:
        pcu = np.asarray(prefix_cu, dtype=np.int64)
        ps, pl = pcu[req], pcu[req + 1] - pcu[req]
        # Per segment its prefix rows, then its new rows (offset by the C prefix rows).
        k_rows = _ragged(np.stack([ps, ks + pcu[-1]], 1).ravel(), np.stack([pl, kl], 1).ravel())
        k_len = pl + kl
    cu_q = np.concatenate([[0], np.cumsum(ql)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(k_len)]).astype(np.int64)
    host = torch.from_numpy(np.concatenate([_ragged(qs, ql), k_rows, cu_q, cu_k]))
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    nq, nk, ns = int(cu_q[-1]), int(cu_k[-1]), cu_q.size
    return VarlenPack(
        q_index=dev[:nq],
        k_index=dev[nq : nq + nk],
        cu_q=dev[nq + nk : nq + nk + ns].to(torch.int32),
        cu_k=dev[nq + nk + ns :].to(torch.int32),
        cu_q_host=cu_q.tolist(),
        cu_k_host=cu_k.tolist(),
        max_q=int(ql.max()) if ql.size else 0,
        max_k=int(k_len.max()) if k_len.size else 0,
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


def varlen_forward_reference(qp, kp, vp, pack: VarlenPack, scale: float):
    """(out [Tq, Hq, Dv], lse [Tq, Hq]) of the packed sequences, one by one (the oracle)."""
    outs, lses = [], []
    cq, ck = pack.cu_q_host, pack.cu_k_host
    for i in range(len(cq) - 1):
        o, s = attention_with_lse(
            qp[cq[i] : cq[i + 1]], kp[ck[i] : ck[i + 1]], vp[ck[i] : ck[i + 1]],
            scale=scale, causal=True,
        )  # fmt: skip
        outs.append(o)
        lses.append(s)
    if not outs:
        return qp.new_empty(0, qp.shape[1], vp.shape[2]), qp.new_empty(
            0, qp.shape[1], dtype=lse_dtype(qp.dtype)
        )
    return torch.cat(outs), torch.cat(lses)


def varlen_backward_reference(dop, qp, kp, vp, op, lsep, pack: VarlenPack, scale: float):
    """(dq, dk, dv) of the packed sequences in their inputs' dtypes (the oracle)."""
    dqs, dks, dvs = [], [], []
    cq, ck = pack.cu_q_host, pack.cu_k_host
    for i in range(len(cq) - 1):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        gq, gk, gv = attention_with_lse_backward(
            dop[rq], qp[rq], kp[rk], vp[rk], op[rq], lsep[rq], scale=scale, causal=True
        )
        dqs.append(gq)
        dks.append(gk)
        dvs.append(gv)
    if not dqs:
        return torch.zeros_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
    return (
        torch.cat(dqs).to(qp.dtype),
        torch.cat(dks).to(kp.dtype),
        torch.cat(dvs).to(vp.dtype),
    )


def _pad_to(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def varlen_forward_flash(qp, kp, vp, pack: VarlenPack, scale: float):
    """FlashAttention-2's varlen forward (bottom-right causal): (out, lse [Tq, Hq] fp32)."""
    dv = vp.shape[-1]
    res = torch.ops.aten._flash_attention_forward(
        qp, kp, _pad_to(vp, qp.shape[-1]), pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, 0.0,
        True, False, scale=scale,
    )  # fmt: skip
    out, lse = res[0][..., :dv], res[1]
    if lse.shape != (qp.shape[1], qp.shape[0]):
        raise RuntimeError(
            f"unexpected varlen LSE layout {tuple(lse.shape)} for {qp.shape[0]} packed queries "
            f"and {qp.shape[1]} heads (expected [heads, queries])"
        )
    return out, lse.t()


def varlen_backward_flash(dop, qp, kp, vp, op, lsep, pack: VarlenPack, scale: float):
    """FlashAttention-2's varlen backward: (dq, dk, dv) in the inputs' dtype."""
    seed = torch.empty(2, dtype=torch.uint64, device=qp.device)
    unused = torch.empty((), dtype=torch.uint64, device=qp.device)
    d, dv = qp.shape[-1], vp.shape[-1]
    dq, dk, dvp = torch.ops.aten._flash_attention_backward(
        _pad_to(dop, d), qp, kp, _pad_to(vp, d), _pad_to(op, d), lsep.t().contiguous(),
        pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, 0.0, True, seed, unused, scale=scale,
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
    """Head/tail attention of the local queries (and cached prefixes) in one varlen call.

    Same contract as :func:`~cp_modules.reference.pcp_attention.pcp_prefill_attention_reference`:
    out [T, Hq, Dv] (0 on padding rows), lse [T, Hq] fp32 (-inf there). ``prefix_*``: the
    requests' cached keys / values ragged by ``prefix_cu`` (host ints), or None.
    ``forward`` overrides the kernel (tests pass the reference).
    """
    pack = pack or varlen_pack_cached(segments, q.device, prefix_cu)
    forward = forward or _kernels(q.device)[0]
    if prefix_cu is not None:
        k, v = torch.cat([prefix_k, k]), torch.cat([prefix_v, v])
    qp = q.index_select(0, pack.q_index)
    kp, vp = k.index_select(0, pack.k_index), v.index_select(0, pack.k_index)
    op, lsep = forward(qp, kp, vp, pack, scale)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    out.index_copy_(0, pack.q_index, op.to(out.dtype))
    lse.index_copy_(0, pack.q_index, lsep.to(lse.dtype))
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
    num_prefix = 0
    if prefix_cu is not None:
        num_prefix = prefix_k.shape[0]
        k, v = torch.cat([prefix_k, k]), torch.cat([prefix_v, v])
    qi, ki = pack.q_index, pack.k_index
    gq, gk, gv = backward(
        dout.index_select(0, qi), q.index_select(0, qi), k.index_select(0, ki),
        v.index_select(0, ki), out.index_select(0, qi), lse.index_select(0, qi), pack, scale,
    )  # fmt: skip
    dq = torch.zeros_like(q).index_copy_(0, qi, gq.to(q.dtype))
    dk = torch.zeros_like(k).index_add_(0, ki, gk.to(k.dtype))
    dv = torch.zeros_like(v).index_add_(0, ki, gv.to(v.dtype))
    if prefix_cu is None:
        return dq, dk, dv
    return dq, dk[num_prefix:], dv[num_prefix:], dk[:num_prefix], dv[:num_prefix]
