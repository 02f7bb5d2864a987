"""The packing of PCP head/tail prefill segments for the masked (window / soft-cap) kernels.

Shape letters: N = restored new tokens, C = cached-prefix tokens, Tq = packed queries (the
segments' real queries), Tk = packed keys, S = segments
(``cp_modules.partition.plan.SEGMENT_FIELDS``).

Every segment (a request's head or tail chunk on this rank) is one sequence of queries: its
real queries against its request's cached prefix followed by its new keys
``[k_start, k_start + k_len)``. Positions count from the request's first cached token: key
``p`` of the sequence sits at ``p``, query ``i`` of ``q_len`` at ``prefix + k_len - q_len + i``
(bottom-right causal over prefix and new keys, as the reference). A query at position ``t``
sees keys ``t - W < p <= t``. Packed keys are rows of ``[k; prefix_k]`` (the prefix rows after
the N new ones), so one call covers the cached prefix too and needs no LSE merge. Two layouts
of the keys (:data:`PACK_LAYOUTS`):

* ``"varlen"`` (FlashAttention-2's varlen calls: each sequence its own keys): every segment's
  keys are copied after the previous segment's; with a window W no query of the segment sees
  a key before ``prefix + k_len - q_len - W + 1``, so only the last ``q_len + W - 1`` keys of
  each sequence are kept (dropping keys from the front keeps the bottom-right alignment) and a
  rank's work grows with W, not with the sequence. A request's head and tail segments both
  copy the keys they share.
* ``"runs"`` (FlexAttention, whose mask is one run of keys per query, ``q_lo <= kv < q_hi``):
  without a cached prefix the packed keys are the restored new keys themselves, each once and
  in place (a slice: no copy of K / V forward, and each key's gradient comes out of the kernel
  whole: no accumulation backward); the block sparsity skips what no query sees. With a
  cached prefix a query would see two runs (its prefix rows and its new rows), so such a
  packing is built ``"varlen"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cp_modules.kernels.masked.flex_backward import key_run_mask
from cp_modules.kernels.prefill.pcp_varlen import _cumsum0, _ragged, _to_device

__all__ = [
    "PACK_LAYOUTS",
    "SPARSE_BLOCK",
    "MaskedPack",
    "RowSplit",
    "flex_block_tables",
    "masked_pack",
    "row_split",
]

PACK_LAYOUTS = ("varlen", "runs")


@dataclass(frozen=True, eq=False)
class MaskedPack:
    """The packed sequences of one plan for one window (module docstring: the layouts).

    Attributes:
        q_index: [Tq] int64, local query rows, sequence by sequence.
        k_index: [Tk] int64, rows of ``[k; prefix_k]`` (prefix rows from ``num_new`` on).
        cu_q, cu_k: [S + 1] int32 cumulative query / key counts (FlashAttention-2's varlen;
            in the ``"runs"`` layout ``cu_k`` is ``[0, N]``: one key sequence).
        cu_q_host, cu_k_host: the same as host lists.
        max_q, max_k: the longest sequence's query / key count.
        q_seq, q_pos, k_seq, k_pos: [Tq] / [Tk] int32, each packed row's key sequence and its
            position (a query's in its request; a key's in its key sequence).
        key_ranges_host: [Tq, 2] int64 numpy, the packed keys ``[lo, hi)`` each packed query
            sees (its sequence's keys inside its window, up to itself): the block sparsity of
            the FlexAttention mask.
        window: W, or None (full causal).
        num_new: N, the new-key rows before the prefix rows in ``[k; prefix_k]``.
        flex_cache: the pack's FlexAttention mask function and block masks, built on first use.
        q_lo, q_hi: [Tq] int32, the run of packed keys ``[lo, hi)`` each packed query sees
            (``key_ranges_host`` on the device: the FlexAttention mask reads them).
        q_range: ``(a, b)`` when ``q_index`` is the run ``a .. b - 1`` (the packed queries are
            a slice of the local rows, e.g. every row of an unpadded one-rank plan), else None.
        k_range: the same for ``k_index``.
        k_unique: whether no row of ``[k; prefix_k]`` is packed twice (each key's gradient
            has one contribution: no wider accumulation is needed).
        layout: ``"varlen"`` (every segment its own sequence of keys: FlashAttention-2's
            varlen calls) or ``"runs"`` (every request's keys once, shared by its segments:
            FlexAttention only; ``cu_k`` / ``max_k`` / ``k_seq`` count requests there). See
            the module docstring.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    cu_q_host: list[int]
    cu_k_host: list[int]
    max_q: int
    max_k: int
    q_seq: torch.Tensor
    q_pos: torch.Tensor
    k_seq: torch.Tensor
    k_pos: torch.Tensor
    key_ranges_host: np.ndarray
    window: int | None
    num_new: int
    flex_cache: dict = field(default_factory=dict)
    q_lo: torch.Tensor | None = None
    q_hi: torch.Tensor | None = None
    q_range: tuple[int, int] | None = None
    k_range: tuple[int, int] | None = None
    k_unique: bool = False
    layout: str = "varlen"

    @property
    def num_queries(self) -> int:
        """Tq."""
        return self.cu_q_host[-1]

    def mask_mod(self):
        """The FlexAttention ``mask_mod`` of the pack (same sequence, causal, inside the
        window), one function object per pack (compiled code is reused for it).

        Each packed query sees one run of packed keys (``key_ranges_host``: its sequence's
        keys from its window's first to itself), so the mask is ``lo[q] <= kv < hi[q]``:
        two loads per query row and none per key, where comparing sequences and positions
        would load per key as well."""
        fn = self.flex_cache.get("mask_mod")
        if fn is None:
            fn = self.flex_cache["mask_mod"] = _key_run_mask(self.q_lo, self.q_hi)
        return fn


def _key_run_mask(q_lo, q_hi):
    # A closure over tensors, the form FlexAttention's compiled path traces without guarding
    # on the values.
    def mask_mod(b, h, q_idx, kv_idx):
        return key_run_mask(b, h, q_idx, kv_idx, q_lo, q_hi)

    return mask_mod


def masked_pack(
    segments: torch.Tensor,
    num_new: int,
    prefix_cu: list[int] | None,
    window: int | None,
    device: torch.device | str,
    layout: str = "varlen",
) -> MaskedPack:
    """The packing of a plan's segments ([S, 5] int64 host tensor) over ``num_new`` restored
    new keys and the cached prefixes ragged by ``prefix_cu`` ([R + 1] host ints, or None),
    keeping only the keys a window W (or None) lets the queries see, in ``layout``
    (``"varlen"`` or ``"runs"``, see the module docstring)."""
    assert layout in PACK_LAYOUTS, layout
    segs = (segments if segments.device.type == "cpu" else segments.cpu()).numpy()
    segs = segs[segs[:, 2] > 0]
    req, qs, ql, ks, kl = (segs[:, j].astype(np.int64) for j in range(5))
    pcu = None if prefix_cu is None else np.asarray(prefix_cu, dtype=np.int64)
    plen = np.zeros_like(kl) if pcu is None else pcu[req + 1] - pcu[req]
    total = plen + kl
    first = np.zeros_like(total) if window is None else np.maximum(total - ql - (window - 1), 0)
    nk = total - first
    pstart = np.zeros_like(req) if pcu is None else pcu[req]
    seq = np.arange(segs.shape[0], dtype=np.int64)
    q_pos = _ragged(total - ql, ql)
    q_seq = np.repeat(seq, ql)
    if layout == "runs" and not plen.any():
        # Every restored new key once, in place (a slice of the inputs, no copy): a query of
        # the segment whose keys are rows [ks, ks + kl) sees rows ks + [max(t - W + 1, 0), t].
        # One key sequence; with a cached prefix a query would see two runs (its prefix rows
        # and its new rows), so that packing stays varlen.
        nk = np.array([num_new], dtype=np.int64)
        k_pos = np.arange(num_new, dtype=np.int64)
        k_seq = np.zeros(num_new, dtype=np.int64)
        k_rows = k_pos
        lo_off = np.zeros_like(q_pos) if window is None else np.maximum(q_pos - (window - 1), 0)
        key_ranges = np.stack([ks[q_seq] + lo_off, ks[q_seq] + q_pos + 1], 1)
        q_seq = np.zeros_like(q_seq)
        cu_k = _cumsum0(nk)
    else:
        layout = "varlen"
        k_pos = _ragged(first, nk)
        k_seq = np.repeat(seq, nk)
        # Key position p: a prefix row below the request's prefix length, else a new-key row.
        k_rows = np.where(
            k_pos < plen[k_seq],
            num_new + pstart[k_seq] + k_pos,
            ks[k_seq] + k_pos - plen[k_seq],
        )
        # Query at position t of a sequence whose kept keys start at position ``first``
        # (packed from cu_k): it sees positions [max(first, t - W + 1), t].
        cu_k = _cumsum0(nk)
        lo_pos = q_pos - (window - 1) if window is not None else first[q_seq]
        key_ranges = np.stack(
            [cu_k[q_seq] + np.maximum(lo_pos, first[q_seq]) - first[q_seq],
             cu_k[q_seq] + q_pos - first[q_seq] + 1], 1,
        )  # fmt: skip
    parts = {
        "q_index": (_ragged(qs, ql), torch.int64),
        "k_index": (k_rows, torch.int64),
        "cu_q": (_cumsum0(ql), torch.int32),
        "cu_k": (cu_k, torch.int32),
        "q_seq": (q_seq, torch.int32),
        "q_pos": (q_pos, torch.int32),
        "k_seq": (k_seq, torch.int32),
        "k_pos": (k_pos, torch.int32),
        "q_lo": (key_ranges[:, 0], torch.int32),
        "q_hi": (key_ranges[:, 1], torch.int32),
    }
    views = _to_device(parts, device)  # one host-to-device copy for all of them
    q_rows = parts["q_index"][0]
    if layout == "runs":  # the identity rows 0 .. N - 1: known without scanning them
        k_range, k_unique = ((0, num_new) if num_new else None), True
    else:
        k_range, k_unique = _run_of(k_rows), bool(np.unique(k_rows).size == k_rows.size)
    return MaskedPack(
        q_index=views["q_index"],
        k_index=views["k_index"],
        cu_q=views["cu_q"],
        cu_k=views["cu_k"],
        q_seq=views["q_seq"],
        q_pos=views["q_pos"],
        k_seq=views["k_seq"],
        k_pos=views["k_pos"],
        cu_q_host=parts["cu_q"][0].tolist(),  # ok: host (numpy)
        cu_k_host=parts["cu_k"][0].tolist(),  # ok: host (numpy)
        max_q=int(ql.max()) if ql.size else 0,
        max_k=int(nk.max()) if nk.size else 0,
        key_ranges_host=key_ranges.reshape(-1, 2),
        window=window,
        num_new=num_new,
        q_lo=views["q_lo"],
        q_hi=views["q_hi"],
        q_range=_run_of(q_rows),
        k_range=k_range,
        k_unique=k_unique,
        layout=layout,
    )


def _run_of(rows: np.ndarray) -> tuple[int, int] | None:
    # (a, b) when ``rows`` is a .. b - 1 (non-empty), else None.
    if rows.size == 0 or not bool((np.diff(rows) == 1).all()):
        return None
    return int(rows[0]), int(rows[-1]) + 1


# --------------------------------------------------------------------------- FlexAttention


SPARSE_BLOCK = 128


def flex_block_tables(pack: MaskedPack | RowSplit, block: int = SPARSE_BLOCK):
    """The FlexAttention block sparsity of the pack, from its queries' key ranges (exact, on
    the host): per query block, the kv blocks some of whose entries it sees (``mask_mod``
    applied) and those all of whose entries it sees (complete blocks only). Returns
    (kv_num_blocks [Bq], kv_indices [Bq, Bk], full_num_blocks [Bq], full_indices [Bq, Bk])
    int32 numpy, indices ascending, padded with 0."""
    a, b = pack.key_ranges_host[:, 0], pack.key_ranges_host[:, 1]
    tq, tk = a.size, pack.cu_k_host[-1]
    n_qb, n_kb = -(-tq // block), -(-tk // block)
    starts = np.arange(0, tq, block)
    # A query block's rows see a contiguous range of packed keys: every sequence's rows do,
    # and a sequence's last query sees up to the first key of the next.
    t_lo = np.minimum.reduceat(a, starts) // block
    t_hi = -(-np.maximum.reduceat(b, starts) // block)
    f_lo = -(-np.maximum.reduceat(a, starts) // block)
    f_hi = np.minimum(np.minimum.reduceat(b, starts) // block, tk // block)
    f_hi = np.where(starts + block <= tq, f_hi, f_lo)  # a partial query block: none full
    n_full = np.maximum(f_hi - f_lo, 0)
    has_full = n_full > 0
    # Partial blocks: the touched range less the full one (before it and after it).
    p1_hi = np.where(has_full, f_lo, t_hi)
    p2_lo = np.where(has_full, f_hi, t_hi)
    n1, n2 = p1_hi - t_lo, t_hi - p2_lo
    j = np.arange(n_kb)[None, :]
    n1c, n2c = n1[:, None], n2[:, None]
    idx = np.where(j < n1c, t_lo[:, None] + j, np.where(j < n1c + n2c, p2_lo[:, None] + j - n1c, 0))
    full = np.where(j < n_full[:, None], f_lo[:, None] + j, 0)
    assert idx.shape == (n_qb, n_kb)
    return (
        (n1 + n2).astype(np.int32),
        idx.astype(np.int32),
        n_full.astype(np.int32),
        full.astype(np.int32),
    )


# Backward row splitting (row_split): a query block whose keys span more than SPLIT_FACTOR
# times the mean run is cut into pieces of about the mean; spans under SPLIT_MIN_KEYS never;
# and only in packs whose longest block spans at least SPLIT_TAIL_SHARE of all blocks' spans
# summed (short kernels, where the last long programs are a tail). Measured on the H200
# (soft-capped 32k causal, one rank of P; docs/experiments/2026-12-01-masked-prefill-speed.md):
# the longest block's share is 6.2 / 3.2 / 1.6 / 0.8 % at P = 8 / 4 / 2 / 1, and cutting made
# the rank's forward + backward 1.7 / 0.4 % faster at P = 8 / 4 and 0.5 / 0.7 % slower at
# P = 2 / 1.
SPLIT_FACTOR = 1.5
SPLIT_MIN_KEYS = 4096
SPLIT_TAIL_SHARE = 0.025


@dataclass(frozen=True, eq=False)
class RowSplit:
    """The packed queries of a pack for FlexAttention's backward with long key runs cut in
    pieces (:func:`row_split`): rows ``0 .. Tq - 1`` are the pack's own rows with their first
    piece, then empty rows up to a multiple of the sparse block, then the further pieces, one
    128-row block of copies per source block and piece.

    Attributes:
        src: [Tq'] int64 device tensor, the pack's packed row each row copies (0 for the
            padding rows, whose runs are empty).
        extra_pos, extra_dst: [E] int64 device tensors, the rows past ``Tq`` that hold a
            piece of a real row, and that row (their dq is added to it).
        key_ranges_host: [Tq', 2] int64 numpy, each row's run of packed keys.
        q_lo, q_hi: the runs on the device (the mask's buffers).
        cu_k_host: the pack's (the keys are not split).
        flex_cache: block masks, built on first use.
    """

    src: torch.Tensor
    extra_pos: torch.Tensor
    extra_dst: torch.Tensor
    key_ranges_host: np.ndarray
    q_lo: torch.Tensor
    q_hi: torch.Tensor
    cu_k_host: list[int]
    flex_cache: dict = field(default_factory=dict)

    @property
    def num_queries(self) -> int:
        """Tq' (the rows of the split layout)."""
        return int(self.key_ranges_host.shape[0])

    def mask_mod(self):
        """The ``mask_mod`` of the split rows (``lo[q] <= kv < hi[q]``, as the pack's)."""
        fn = self.flex_cache.get("mask_mod")
        if fn is None:
            fn = self.flex_cache["mask_mod"] = _key_run_mask(self.q_lo, self.q_hi)
        return fn


def row_split(pack: MaskedPack, device, block: int = SPARSE_BLOCK) -> RowSplit | None:
    """The pack's rows with long key runs cut for the backward, or None where no query block
    spans more than ``SPLIT_FACTOR`` x the mean run (and ``SPLIT_MIN_KEYS``) keys, or where
    the longest block is under ``SPLIT_TAIL_SHARE`` of the pack's block spans summed. Cached
    in the pack.

    Why: FlexAttention's backward computes dQ in one program per query block that loops over
    every key the block sees. A PCP rank holds a request's head and tail chunks, so its tail
    chunk's programs loop over up to the whole sequence while the rest are short, and the
    last heads' long programs end the kernel alone. Each piece of a row is a row of its own
    (the same q, out, dout and LSE: the backward needs only those, so the pieces' gradients
    are exact parts that add up): each key's dK / dV come from exactly one piece of each row,
    and dQ is the sum of the pieces' (:func:`~cp_modules.kernels.masked.prefill.flex_backward`).
    Cuts fall on multiples of ``block`` (the sparse block) so no piece adds a partial block."""
    key = ("row_split", str(device))
    if key in pack.flex_cache:
        return pack.flex_cache[key]
    split = pack.flex_cache[key] = _row_split(pack, device, block)
    return split


def _row_split(pack: MaskedPack, device, block: int) -> RowSplit | None:
    ranges = pack.key_ranges_host
    tq = ranges.shape[0]
    a, b = ranges[:, 0], ranges[:, 1]
    lens = b - a
    if tq == 0 or not (lens > 0).any():
        return None
    target = float(lens[lens > 0].mean())
    starts = np.arange(0, tq, block)
    lo, hi = np.minimum.reduceat(a, starts), np.maximum.reduceat(b, starts)
    span = hi - lo
    cut = (span > SPLIT_FACTOR * target) & (span > SPLIT_MIN_KEYS)
    if not cut.any() or span.max() < SPLIT_TAIL_SHARE * span.sum():
        return None
    first = ranges.copy()
    n_rows = -(-tq // block) * block
    extra_src, extra_ranges, extra_real = [], [], []
    for qb in np.flatnonzero(cut):
        n = int(np.ceil(span[qb] / target))
        step = -(-int(span[qb]) // n)
        inner = sorted({-(-(int(lo[qb]) + j * step) // block) * block for j in range(1, n)})
        edges = [int(lo[qb])] + [e for e in inner if lo[qb] < e < hi[qb]] + [int(hi[qb])]
        if len(edges) < 3:
            continue
        r0, r1 = qb * block, min(qb * block + block, tq)
        ra, rb = a[r0:r1], b[r0:r1]
        first[r0:r1, 1] = np.maximum(np.minimum(rb, edges[1]), ra)
        for e0, e1 in zip(edges[1:-1], edges[2:]):
            pa = np.maximum(ra, e0)
            pb = np.maximum(np.minimum(rb, e1), pa)
            pad = block - (r1 - r0)
            extra_src.append(np.concatenate([np.arange(r0, r1), np.zeros(pad, np.int64)]))
            extra_ranges.append(np.concatenate([np.stack([pa, pb], 1),
                                                np.zeros((pad, 2), np.int64)]))  # fmt: skip
            extra_real.append(np.concatenate([np.ones(r1 - r0, bool), np.zeros(pad, bool)]))
    if not extra_src:
        return None
    pad_rows = n_rows - tq
    src = np.concatenate([np.arange(tq), np.zeros(pad_rows, np.int64), *extra_src])
    all_ranges = np.concatenate([first, np.zeros((pad_rows, 2), np.int64), *extra_ranges])
    real = np.concatenate(extra_real)
    extra_pos = n_rows + np.flatnonzero(real)
    parts = {
        "src": (src, torch.int64),
        "extra_pos": (extra_pos, torch.int64),
        "extra_dst": (src[extra_pos], torch.int64),
        "q_lo": (all_ranges[:, 0], torch.int32),
        "q_hi": (all_ranges[:, 1], torch.int32),
    }
    views = _to_device(parts, device)
    return RowSplit(
        src=views["src"], extra_pos=views["extra_pos"], extra_dst=views["extra_dst"],
        key_ranges_host=all_ranges, q_lo=views["q_lo"], q_hi=views["q_hi"],
        cu_k_host=pack.cu_k_host,
    )  # fmt: skip
