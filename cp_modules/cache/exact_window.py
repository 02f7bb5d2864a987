"""The bf16 window of an fp8 KV cache: the sink and the newest tokens read unquantized.

An fp8 (e4m3) cache rounds every key and value to 3 mantissa bits. Most of a decode query's
attention often lies on a few keys: the first tokens (attention sinks) and the newest ones.
:class:`ExactWindow` keeps a copy of those keys and values in the model's dtype beside the
paged cache (KIVI's full-precision residual, plus the sink), and each decode query reads

- its ``recent`` newest keys (itself included: global positions ``P - recent + 1 .. P``) and
- the request's first ``sink`` tokens (positions ``0 .. sink - 1``)

from that copy, every other key from the fp8 cache. On CUDA the paged kernel attends the fp8
range only and the window's keys are merged by their LSEs (exact, as the split and DCP combines
are; :func:`merge_exact` is that merge's reference); on the CPU one reference call attends the
whole range with the window's rows in place of their fp8 copies (a window over every key: the
unquantized cache's result bit for bit). Under DCP every rank does this for the tokens it
stores, before the combine.
Measured on SmolLM2-135M: ``docs/experiments/2026-12-02-fp8-kv-scaling.md``.

Layout: one buffer per layer ``[rows + 1, sink + capacity, ...]`` (GQA ``... = 2, Hkv, D``
holding K and V; MLA ``... = Rk + Dr``), by stable request row (the engine's admitted row,
:attr:`CPStepMetadata.cache_rows <cp_modules.step.CPStepMetadata>`). Slots ``[0, sink)`` hold
the sink tokens by local index; slots ``sink + j % capacity`` hold local token ``j`` (a ring of
this rank's newest ``capacity`` tokens). Row ``rows`` is scratch: tokens another rank stores,
or that no query will read from the window, are written there. ``capacity >= recent + Q - 1``
for decode runs of ``Q`` tokens (speculative verification), so every query's window is still
in the ring.

Prompt chunks attend their new tokens unquantized (as without the window) and a cached prefix
as stored (fp8); the window serves decode queries. Everything here is device tensors only: no
host sync, CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_modules.cache.dcp import local_seq_len
from cp_modules.cache.kv_dtype import dequantize_fp8

__all__ = [
    "ExactWindow",
    "WindowRanges",
    "allocate_window_buffer",
    "check_exact_window",
    "check_window_option",
    "merge_exact",
    "window_decode_ranges",
    "window_write",
    "window_write_index",
]


@dataclass(frozen=True)
class ExactWindow:
    """Which tokens of an fp8 cache are also kept unquantized (see the module docstring).

    Attributes:
        sink: the first tokens of each request.
        recent: the newest tokens each decode query reads unquantized (itself included).
        capacity: ring slots per request row on each rank (``>= recent``; ``recent + Q - 1``
            serves decode runs of ``Q`` tokens).
    """

    sink: int = 0
    recent: int = 0
    capacity: int = 0

    @property
    def slots(self) -> int:
        return self.sink + self.capacity

    @property
    def max_query_len(self) -> int:
        """The longest decode run whose every query still finds its window in the ring."""
        return self.capacity - self.recent + 1


def check_exact_window(sink: int, recent: int, max_query_len: int = 1) -> ExactWindow | None:
    """The checked window (None when both counts are 0).

    Raises:
        ValueError: for a negative or non-integer count; the message names the option.
    """
    for name, v in (("fp8_sink_tokens", sink), ("fp8_recent_tokens", recent)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len must be an integer >= 1, got {max_query_len!r}")
    if sink == 0 and recent == 0:
        return None
    return ExactWindow(sink, recent, recent + max_query_len - 1 if recent else 0)


def check_window_option(
    kv_cache_dtype: str,
    sink: int,
    recent: int,
    names: str = "fp8_sink_tokens / fp8_recent_tokens",
    max_query_len: int = 1,
) -> ExactWindow | None:
    """:func:`check_exact_window`, and ValueError (naming ``names``) for a window beside a
    cache that is not fp8."""
    window = check_exact_window(sink, recent, max_query_len)
    if window is not None and kv_cache_dtype != "fp8_e4m3":
        raise ValueError(
            f"{names} keep tokens of an fp8 cache unquantized; kv_cache_dtype="
            f"{kv_cache_dtype!r} is not fp8: use kv_cache_dtype='fp8_e4m3' or 0"
        )
    return window


def allocate_window_buffer(
    rows: int,
    window: ExactWindow,
    tail: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A zeroed window buffer ``[rows + 1, sink + capacity, *tail]`` (the last row is scratch)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows (request rows of the window buffer) must be >= 1, got {rows!r}")
    return torch.zeros(rows + 1, window.slots, *tail, dtype=dtype, device=device)


def window_write_index(
    buf: torch.Tensor,
    window: ExactWindow,
    owned: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    ends: torch.Tensor,
    dcp: tuple[int, int, int] = (1, 0, 1),
) -> tuple[torch.Tensor, ...]:
    """Where :func:`window_write` stores each new token: [N] flat slots of ``buf.view(-1, ...)``
    in the ring and among the sinks (each where the window has them; the scratch row's first
    slot for a token that goes to neither).

    Args:
        buf: the layer's window buffer ``[rows + 1, slots, *tail]`` (only its shape is read).
        owned: [N] bool, the token is stored on this rank (its cache slot is not -1).
        rows: [N] stable request row of each token.
        positions: [N] global positions (-1: a padding token, written nowhere).
        ends: [N] the request's length after this step (only the newest ``capacity`` local
            tokens enter the ring, so two tokens never share a slot).
        dcp: (size, rank, interleave) of the DCP layout.
    """
    n_rows, slots = buf.shape[0] - 1, buf.shape[1]
    scratch = torch.full_like(positions, n_rows * slots)
    pos = positions.clamp_min(0)
    j = local_seq_len(pos, *dcp)  # this token's local index (where it is owned)
    base = rows.to(positions.dtype) * slots
    index = []
    if window.capacity:
        keep = owned & (positions >= 0) & (j >= local_seq_len(ends, *dcp) - window.capacity)
        index.append(torch.where(keep, base + window.sink + j % window.capacity, scratch))
    if window.sink:
        keep = owned & (positions >= 0) & (positions < window.sink)
        index.append(torch.where(keep, base + j, scratch))
    return tuple(index)


def window_write(buf: torch.Tensor, kv: torch.Tensor, index: tuple[torch.Tensor, ...]) -> None:
    """Store new tokens ``kv`` [N, *tail] unquantized at ``index`` (from
    :func:`window_write_index`), in place."""
    flat = buf.view(-1, *buf.shape[2:])
    val = kv.to(buf.dtype)
    for idx in index:
        flat.index_copy_(0, idx, val)


@dataclass(frozen=True)
class WindowRanges:
    """Per decode query: the fp8 range the paged kernel attends and the window's slots.

    Attributes:
        kernel_start, kernel_len: [T] local token range ``[start, len)`` left to the kernel.
        slots: [T, sink + recent] flat index into ``buf.view(-1, *tail)`` of each window key
            (sink slots first).
        valid: [T, sink + recent] which of them the query sees.
        sink_local: [T, sink] local index of each sink token (to remove its fp8 copy where the
            kernel cannot leave it out); sink_valid: [T, sink].
        positions: [T, sink + recent] local index of each window key (the CPU path puts the
            window's rows there in one reference call).
    """

    kernel_start: torch.Tensor
    kernel_len: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    sink_local: torch.Tensor
    sink_valid: torch.Tensor
    positions: torch.Tensor


def window_decode_ranges(
    buf: torch.Tensor,
    window: ExactWindow,
    rows: torch.Tensor,
    positions: torch.Tensor,
    kv_len: torch.Tensor,
    first: torch.Tensor | None,
    dcp: tuple[int, int, int] = (1, 0, 1),
) -> WindowRanges:
    """The split of each decode query's keys between the fp8 kernel and the window.

    Args:
        buf: the layer's window buffer (its row count and slots).
        rows: [T] stable request row of each query.
        positions: [T] global position ``P`` of each query.
        kv_len: [T] local tokens the query sees (``local_seq_len(P + 1)``).
        first: [T] the first global position it sees (a sliding window), or None (0).
        dcp: (size, rank, interleave).
    """
    slots = buf.shape[1]
    s, r, cap = window.sink, window.recent, window.capacity
    p = positions.to(torch.int64)
    length = kv_len.to(torch.int64)
    g0 = torch.zeros_like(p) if first is None else first.to(torch.int64).clamp_min(0)
    g_recent = torch.maximum(p + 1 - r, g0)  # first global position of the recent window
    lo = local_seq_len(g_recent, *dcp)
    g_sink_end = torch.minimum(g_recent, torch.full_like(p, s))  # sinks before the window
    sink_lo = local_seq_len(torch.minimum(g0, g_sink_end), *dcp)
    sink_hi = local_seq_len(g_sink_end, *dcp)
    start0 = local_seq_len(g0, *dcp)
    kernel_start = torch.minimum(torch.maximum(start0, sink_hi), lo)
    base = rows.to(torch.int64)[:, None] * slots
    k_sink = torch.arange(s, device=p.device)
    k_rec = torch.arange(r, device=p.device)
    sink_valid = (k_sink[None, :] >= sink_lo[:, None]) & (k_sink[None, :] < sink_hi[:, None])
    j = lo[:, None] + k_rec[None, :]
    rec_valid = j < length[:, None]
    rec_slot = s + j % cap if cap else j * 0
    slot_idx = torch.cat((base + k_sink[None, :], base + rec_slot), dim=1)
    return WindowRanges(
        kernel_start=kernel_start.to(kv_len.dtype),
        kernel_len=lo.to(kv_len.dtype),
        slots=slot_idx,
        valid=torch.cat((sink_valid, rec_valid), dim=1),
        sink_local=k_sink[None, :].expand(p.shape[0], s),
        sink_valid=sink_valid & (k_sink[None, :] < lo[:, None]),
        positions=torch.cat((k_sink[None, :].expand(p.shape[0], s), j), dim=1),
    )


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """[T, Hq, n] fp32 scores of q [T, Hq, Dk] against k [T, n, Hkv, Dk] (head h: h // G)."""
    t, hq, dk = q.shape
    hkv = k.shape[2]
    qc = q.float().view(t, hkv, hq // hkv, dk)
    s = torch.einsum("thgd,tnhd->thgn", qc, k.float()).reshape(t, hq, -1) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def _weighted(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, Hq, Dv]: weights w [T, Hq, n] times values v [T, n, Hkv, Dv]."""
    t, hq, n = w.shape
    hkv = v.shape[2]
    o = torch.einsum("thgn,tnhd->thgd", w.view(t, hkv, hq // hkv, n), v.float())
    return o.reshape(t, hq, -1)


def merge_exact(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k_add: torch.Tensor,
    v_add: torch.Tensor,
    add_valid: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    k_sub: torch.Tensor | None = None,
    v_sub: torch.Tensor | None = None,
    sub_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention ``(out, lse)`` of a key set, with keys ``k_add`` added and ``k_sub``
    (keys the set holds and should not) removed; exact in fp32.

    Args:
        out, lse: [T, Hq, Dv] and [T, Hq] (natural log, -inf for an empty set).
        q: [T, Hq, Dk].
        k_add, v_add: [T, n, Hkv, Dk] / [T, n, Hkv, Dv]; add_valid: [T, n] bool.
        k_sub, v_sub, sub_valid: the same for the keys to remove, or None.

    Returns:
        (out in ``out``'s dtype, lse fp32); a query left with no key gives 0 and -inf.
    """
    s_add = _scores(q, k_add, scale, softcap).masked_fill(~add_valid[:, None, :], float("-inf"))
    lse_k = lse.float()
    m = torch.maximum(lse_k, s_add.amax(-1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_k = torch.exp(lse_k - m)  # 0 for an empty kernel range
    w_add = torch.exp(s_add - m[..., None])
    num = out.float() * w_k[..., None] + _weighted(w_add, v_add)
    den = w_k
    if k_sub is not None:
        assert v_sub is not None and sub_valid is not None
        s_sub = _scores(q, k_sub, scale, softcap)
        w_sub = torch.exp(s_sub - m[..., None]).masked_fill(~sub_valid[:, None, :], 0.0)
        num = num - _weighted(w_sub, v_sub)
        den = (den - w_sub.sum(-1)).clamp_min(0.0)
    den = den + w_add.sum(-1)
    empty = den <= 0
    o = torch.where(empty[..., None], 0.0, num / torch.where(empty, 1.0, den)[..., None])
    lse_new = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, den)))
    return o.to(out.dtype), lse_new


def gather_window(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, n, *tail]: the window buffer's rows at ``slots`` [T, n] (flat indices)."""
    flat = buf.view(-1, *buf.shape[2:])
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *buf.shape[2:])


def gather_cache_rows(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_idx: torch.Tensor,
    local: torch.Tensor,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[T, n, L]: an MLA cache's rows of local tokens ``local`` [T, n] of each query's request
    row ``seq_idx`` [T], dequantized (fp8) to ``dtype``."""
    bs = cache.shape[1]
    rows = seq_idx.to(torch.int64)[:, None]
    blk = block_table.to(torch.int64)[rows, local // bs].clamp(0, cache.shape[0] - 1)
    got = cache.flatten(0, 1).index_select(0, (blk * bs + local % bs).reshape(-1))
    return dequantize_fp8(got, scale, dtype).view(*local.shape, cache.shape[-1])
