"""The attention ops' side of an fp8 cache's bf16 window (:mod:`cp_modules.cache.exact_window`):
the window's writes from a step's new tokens and the decode attention that reads it.

Shape letters: N = new tokens of the step, T = decode queries, Hq / Hkv = query / KV heads,
D = head dim, L = an MLA latent row (Rk + Dr).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from cp_modules.cache.exact_window import (
    ExactWindow,
    WindowRanges,
    gather_window,
    window_decode_ranges,
    window_write,
    window_write_index,
)
from cp_modules.cache.kv_dtype import is_fp8
from cp_modules.kernels.decode.exact_window import window_merge_triton
from cp_modules.kernels.decode.window_index import (
    window_decode_ranges_triton,
    window_write_index_triton,
)
from cp_modules.ops.cp_common import decode_combined
from cp_modules.step import CPStepMetadata, step_entry

__all__ = ["check_window_args", "decode", "decode_with_window", "write_step_window"]

# attend(q, kv_len, kv_start) -> (out, lse); attend(q, exact=...) -> the same over the layer's own
# ranges with the window's rows in place of their fp8 copies (the reference: CPU only).
Attend = Callable[..., tuple[torch.Tensor, ...]]


def check_window_args(
    buf: torch.Tensor | None,
    sink: int,
    recent: int,
    cache: torch.Tensor,
    tail: tuple[int, ...],
    meta: CPStepMetadata,
    model_dtype: torch.dtype,
) -> ExactWindow | None:
    """The layer's window (None without one), checked on the host before any collective.

    Raises:
        ValueError: for a window without its buffer (or the reverse), a cache that is not fp8,
            a buffer of the wrong shape or dtype, or decode runs longer than its ring serves.
    """
    if buf is None or buf.numel() == 0:
        if sink or recent:
            raise ValueError(
                f"fp8_sink_tokens={sink} / fp8_recent_tokens={recent} need the layer's window "
                "buffer (allocate_kv_caches(..., fp8_sink_tokens=, fp8_recent_tokens=))"
            )
        return None
    if not is_fp8(cache.dtype):
        raise ValueError(
            f"a bf16 window goes with an fp8 cache (kv_cache_dtype='fp8_e4m3'), not {cache.dtype}"
        )
    if sink < 0 or recent < 0 or sink + recent == 0 or buf.shape[1] < sink + recent:
        raise ValueError(
            f"the window buffer holds {buf.shape[1]} slots a row, too few for "
            f"fp8_sink_tokens={sink} + fp8_recent_tokens={recent} (both >= 0, not both 0)"
        )
    if tuple(buf.shape[2:]) != tail or buf.dtype != model_dtype or buf.device != cache.device:
        raise ValueError(
            f"the window buffer must be [rows + 1, slots, {', '.join(map(str, tail))}] in "
            f"{model_dtype} on {cache.device}, got {tuple(buf.shape)} {buf.dtype} on {buf.device}"
        )
    window = ExactWindow(sink, recent, buf.shape[1] - sink)
    if meta.has_decode and recent and meta.decode_query_len > window.max_query_len:
        raise ValueError(
            f"decode runs of {meta.decode_query_len} tokens need a window ring of "
            f"fp8_recent_tokens + {meta.decode_query_len - 1} slots; this one serves runs of "
            f"{window.max_query_len} (allocate_kv_caches(..., max_query_len=))"
        )
    return window


def request_rows(meta: CPStepMetadata, rows: torch.Tensor) -> torch.Tensor:
    """The stable rows (``meta.cache_rows``) of block-table rows ``rows``."""
    return rows.to(torch.int64) if meta.cache_rows is None else meta.cache_rows[rows.long()]


def new_tokens(meta: CPStepMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N] (block-table row, global position, request length after the step) of every new
    token of the step in batch order (the order of ``meta.slot_mapping``)."""
    if meta.all_decode:
        rows = meta.decode_seq_idx.to(torch.int64)
        # Decode runs are at most a ring's capacity: every token is kept.
        return rows, meta.decode_positions, meta.decode_positions + 1
    num_new = np.asarray(meta.num_new_tokens, dtype=np.int64)
    num_comp = np.asarray(meta.num_computed_tokens, dtype=np.int64)
    req = np.repeat(np.arange(num_new.size), num_new)
    first = np.repeat(np.cumsum(num_new) - num_new, num_new)
    pos = num_comp[req] + np.arange(num_new.sum()) - first
    end = (num_comp + num_new)[req]
    dev = meta.token_indices.device

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.int64).to(dev)

    return t(req), t(pos), t(end)


def _dcp(meta: CPStepMetadata) -> tuple[int, int, int]:
    rt = meta.runtime
    return rt.dcp_size, rt.dcp_rank, rt.config.interleave


_STEP_CACHE: dict = {}


def _per_step(meta: CPStepMetadata, key: tuple, make: Callable[[], object]):
    """``make()`` once per step and metadata view (every layer of the step shares it); a CUDA
    graph's capture enters its step again, so it records the computation too."""
    entry = step_entry()
    if _STEP_CACHE.get("entry") != entry:
        _STEP_CACHE.clear()
        _STEP_CACHE["entry"] = entry
    k = (meta.serial, *key)
    if k not in _STEP_CACHE:
        _STEP_CACHE[k] = make()
    return _STEP_CACHE[k]


def write_step_window(
    buf: torch.Tensor,
    window: ExactWindow,
    kv: torch.Tensor,
    slots: torch.Tensor,
    meta: CPStepMetadata,
    token_ids: torch.Tensor | None = None,
    key: tuple = (),
) -> None:
    """Write the step's new tokens ``kv`` [N, ...] (those with a cache slot on this rank) into
    the window; ``token_ids``: which of the step's new tokens ``kv`` holds (a window exchange);
    ``key``: what else tells the step's ``slots`` / ``token_ids`` apart (the layer's window)."""

    def index():
        rows, pos, ends = new_tokens(meta)
        if token_ids is not None:
            rows, pos, ends = (x.index_select(0, token_ids) for x in (rows, pos, ends))
        owned = slots >= 0
        # CUDA: one launch for what the reference does in about 30 small kernels.
        make = window_write_index_triton if buf.is_cuda else window_write_index
        return make(buf, window, owned, request_rows(meta, rows), pos, ends, _dcp(meta))

    idx = _per_step(meta, ("write", window, tuple(buf.shape[:2]), *key), index)
    window_write(buf, kv, idx)


def decode_with_window(
    q: torch.Tensor,
    buf: torch.Tensor,
    window: ExactWindow,
    meta: CPStepMetadata,
    sliding_window: int,
    attend: Attend,
    scale: float,
    softcap: float | None = None,
    mla: tuple[torch.Tensor, int, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q`` [T, Hq, Dk] on this rank's shard, the window's keys read
    unquantized. CUDA: the fp8 kernel on the keys outside the window, merged with the window's
    keys by one Triton launch. CPU: one reference call over each query's whole range with the
    window's rows in place of their fp8 copies (``attend(q, exact=...)``), so that a window
    over every key gives the unquantized cache's result bit for bit.

    ``attend(q, kv_len, kv_start)`` runs the paged kernel on local ranges ``[kv_start, kv_len)``
    (GQA; an MLA kernel gets ``kv_start=None`` and attends ``[0, kv_len)``, the sink tokens'
    fp8 copies included: ``mla = (cache, kv_lora_rank, kv_scale)`` removes them here).
    ``sliding_window``: the layer's window W (queries see positions ``P - W + 1 ..``), or 0.
    """

    def ranges():
        first = None
        if sliding_window:
            first = (meta.decode_positions - sliding_window + 1).clamp_min(0)
        # CUDA: one launch for what the reference does in about 70 small kernels.
        make = window_decode_ranges_triton if buf.is_cuda else window_decode_ranges
        return make(
            buf, window, request_rows(meta, meta.decode_seq_idx), meta.decode_positions,
            meta.decode_kv_len, first, _dcp(meta),
        )  # fmt: skip

    r = _per_step(meta, ("read", window, tuple(buf.shape[:2]), sliding_window), ranges)
    assert isinstance(r, WindowRanges)
    if not q.is_cuda:
        rows_w = gather_window(buf, r.slots)  # [T, S + R, ...]
        if mla is None:
            o, lse = attend(q, exact=(r.positions, rows_w[:, :, 0], rows_w[:, :, 1], r.valid))
        else:
            o, lse = attend(q, exact=(r.positions, rows_w, r.valid))
        return o, lse
    out, lse = attend(q, r.kernel_len, None if mla is not None else r.kernel_start)
    sub = None
    if mla is not None and window.sink:
        # The sink's fp8 copies the MLA kernel attended, removed (read from the cache in the
        # merge; gather_cache_rows is the reference of that read).
        cache, _, kv_scale = mla
        assert meta.block_table is not None, "decode reads a KV cache"
        sub = (cache, meta.block_table, meta.decode_seq_idx, r.sink_local, kv_scale)
    gqa = mla is None
    return window_merge_triton(
        out, lse, q, buf, r.slots, r.valid, scale, softcap,
        value_dim=out.shape[-1], value_offset=buf.stride(2) if gqa else 0,
        sub_valid=None if sub is None else r.sink_valid, sub_cache=sub,
    )  # fmt: skip


def decode(
    q: torch.Tensor,
    meta: CPStepMetadata,
    attend: Attend,
    exact: ExactWindow | None,
    buf: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float | None = None,
    mla: tuple[torch.Tensor, int, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode queries' attention combined over DCP: ``attend(q)`` alone, or through the
    layer's window (:func:`decode_with_window`) where it has one."""
    if exact is None:
        return decode_combined(q, meta, attend)
    return decode_combined(
        q, meta,
        lambda qq: decode_with_window(
            qq, buf, exact, meta, sliding_window, attend, scale, softcap, mla
        ),
    )  # fmt: skip
