"""DCP decode communication: gather the query heads, then combine the per-shard partial results.

Shape legend:
    B: decode tokens    D: query head dim    Dv: value head dim
    H: heads this rank owns (H_local)    G: gather group size    Hg = G * H: gathered heads
    N: DCP group size (KV shards)

A decode step on a rank of a DCP group: :func:`dcp_prepare_query` all-gathers the query heads of
the TP positions the DCP group covers (``[B, H, D] -> [B, Hg, D]``; none when the peers already
own the same heads); attention of those heads against the rank's KV shard yields
``out [B, Hg, Dv]`` and ``lse [B, Hg]``; :func:`dcp_combine` turns the N partial results into
the exact attention for the rank's own heads, ``[B, H, Dv]``. Reduce strategies (SPEC section 1):

- ``reduce_scatter``: all-gather LSEs, correct, reduce-scatter (peers own the gathered head
  blocks in group order, e.g. dcp == tp, pcp == 1);
- ``all_reduce``: all-gather LSEs, correct, all-reduce (peers own the same heads, G == 1);
- ``all_reduce_slice``: all-gather LSEs, correct, all-reduce, keep the own head block;
- ``a2a``: send every peer the partial outputs and LSEs of the heads *that peer* owns, receive N
  partials of the own heads, combine locally (exact in every case). ``packed`` sends outputs
  and LSEs in one all-to-all (:func:`cp_modules.ops.lse_combine.pack_partials`).

Every collective is a PyTorch functional collective (traceable under ``torch.compile``), every
local kernel a ``cp::`` op with a fake; shapes are checked before the first collective so a
wrong shape raises on the rank that has it instead of hanging its peers.
"""

from __future__ import annotations

import torch

from cp_modules.distributed.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from cp_modules.distributed.dcp_spec import DCP_REDUCE_STRATEGIES, DCPCommSpec
from cp_modules.ops import correct_attn_out as _correct_attn_out  # noqa: F401  (registers the op)
from cp_modules.ops.lse_combine import _check_base, _check_out_dtype, pack_partials

__all__ = [
    "DCP_REDUCE_STRATEGIES",
    "DCPCommSpec",
    "dcp_a2a_send_buffers",
    "dcp_combine",
    "dcp_prepare_query",
]


def dcp_prepare_query(q: torch.Tensor, spec: DCPCommSpec) -> torch.Tensor:
    """All-gather the query heads the DCP group attends with: ``[B, H, D] -> [B, G * H, D]``.

    Heads are ordered by gather-group rank (block ``j`` = rank ``j``'s heads); with
    ``gather_size == 1`` the query is returned as is. Not differentiable (decode only).

    Raises:
        ValueError: if ``q`` is not 3-D.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H_local, D] (3 dims), got shape {tuple(q.shape)}")
    return all_gather(q, spec.gather_group, spec.gather_size, dim=1)


def _blocks_for_peers(x: torch.Tensor, spec: DCPCommSpec) -> torch.Tensor:
    """``[B, G * H, ...] -> [R, C, B, H, ...]`` with ``R * C = N``: block of peer ``r * C + c``.

    Real layouts repeat the gathered blocks in order over the PCP slices (slots
    ``(0..G-1) * (N / G)``): that is an expanded view and costs nothing until the send buffer is
    written. Other slot orders are stacked (one copy).
    """
    g, n = spec.gather_size, spec.dcp_size
    blocks = x.unflatten(1, (g, -1)).movedim(1, 0)  # [G, B, H, ...]
    if n % g == 0 and spec.peer_slots == tuple(range(g)) * (n // g):
        return blocks.unsqueeze(0).expand(n // g, *blocks.shape)
    return torch.stack([blocks[s] for s in spec.peer_slots]).unsqueeze(0)


def _check_combine_inputs(out: torch.Tensor, lse: torch.Tensor, spec: DCPCommSpec) -> None:
    if out.dim() != 3:
        raise ValueError(f"out must be [B, Hg, Dv] (3 dims), got shape {tuple(out.shape)}")
    _check_out_dtype("out.dtype", out.dtype)
    b, hg, dv = out.shape
    if tuple(lse.shape) != (b, hg):
        raise ValueError(
            f"lse must be [B, Hg] = {[b, hg]} to match out {tuple(out.shape)}, got "
            f"{tuple(lse.shape)}"
        )
    if lse.dtype != torch.float32:
        raise ValueError(f"lse must be torch.float32, got {lse.dtype}")
    if hg == 0 or hg % spec.gather_size:
        raise ValueError(
            f"out has Hg={hg} heads; it must be a positive multiple of "
            f"gather_size={spec.gather_size} (the query gather's head blocks)"
        )


def dcp_a2a_send_buffers(
    out: torch.Tensor, lse: torch.Tensor, spec: DCPCommSpec
) -> tuple[torch.Tensor, ...]:
    """The ``a2a`` send buffers: chunk ``i`` holds the heads DCP peer ``i`` owns.

    Args:
        out: ``[B, Hg, Dv]`` partial output of the gathered heads.
        lse: ``[B, Hg]`` fp32.
        spec: a spec with ``reduce == "a2a"``.

    Returns:
        ``(packed [N, B, W],)`` when ``spec.packed`` (see
        :func:`~cp_modules.ops.lse_combine.pack_partials`), else ``(out [N, B, H, Dv],
        lse [N, B, H])``; each made with one copy.

    Raises:
        ValueError: on a wrong shape or dtype, or a spec whose reduce is not ``"a2a"``.
    """
    if spec.reduce != "a2a":
        raise ValueError(f"dcp_a2a_send_buffers needs spec.reduce='a2a', got {spec.reduce!r}")
    _check_combine_inputs(out, lse, spec)
    n = spec.dcp_size
    b, hg, dv = out.shape
    h = hg // spec.gather_size
    out_blocks = _blocks_for_peers(out, spec)  # [R, C, B, H, Dv]
    lse_blocks = _blocks_for_peers(lse, spec)  # [R, C, B, H]
    if spec.packed:
        return (pack_partials(out_blocks, lse_blocks).flatten(0, 1),)
    # reshape is a view when every peer owns a distinct block (R == 1): copy then, not later.
    return out_blocks.reshape(n, b, h, dv).contiguous(), lse_blocks.reshape(n, b, h).contiguous()


def dcp_combine(
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: DCPCommSpec,
    *,
    return_lse: bool = False,
    base: str = "e",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Combine the DCP group's partial attention into the exact result for this rank's heads.

    Args:
        out: ``[B, Hg, Dv]`` attention of the gathered heads against this rank's KV shard
            (fp16, bf16 or fp32).
        lse: ``[B, Hg]`` fp32 LSEs of ``out`` (NaN / +inf / -inf for an empty shard).
        spec: this rank's :class:`DCPCommSpec`.
        return_lse: also return the combined LSE of the own heads.
        base: ``"e"``, or ``"2"`` for attention kernels that return base-2 LSEs.

    Returns:
        ``[B, H, Dv]`` in ``out.dtype`` (with ``all_reduce_slice`` a view); with ``return_lse``
        also ``[B, H]`` fp32 in the same base. With ``reduce == "none"`` the inputs unchanged.

    Raises:
        ValueError: on a wrong shape, dtype or base, before any collective runs.
    """
    base2 = _check_base(base)
    _check_combine_inputs(out, lse, spec)
    if spec.reduce == "none":
        return (out, lse) if return_lse else out

    n = spec.dcp_size
    b, hg, dv = out.shape
    h = hg // spec.gather_size
    if spec.reduce == "a2a":
        if spec.packed:
            (send,) = dcp_a2a_send_buffers(out, lse, spec)
            recv = all_to_all(send, spec.dcp_group, n)
            res, res_lse = torch.ops.cp.lse_combine_packed(recv, h, dv, base2)
        else:
            send_out, send_lse = dcp_a2a_send_buffers(out, lse, spec)
            recv_out = all_to_all(send_out, spec.dcp_group, n)
            recv_lse = all_to_all(send_lse, spec.dcp_group, n)
            res, res_lse = torch.ops.cp.lse_combine(recv_out, recv_lse, base2)
        return (res, res_lse) if return_lse else res

    all_lse = all_gather(lse.contiguous(), spec.dcp_group, n, dim=0).view(n, b, hg)
    slot = slice(spec.gather_rank * h, (spec.gather_rank + 1) * h)
    if spec.reduce == "reduce_scatter":
        corrected, full_lse = torch.ops.cp.correct_attn_out(out, all_lse, spec.dcp_rank, n, base2)
        res = reduce_scatter(corrected, spec.dcp_group, n, dim=0).view(b, h, dv)
    else:
        corrected, full_lse = torch.ops.cp.correct_attn_out(out, all_lse, spec.dcp_rank, 1, base2)
        res = all_reduce(corrected.view(b, hg, dv), spec.dcp_group, n)[:, slot]
    return (res, full_lse[:, slot]) if return_lse else res
