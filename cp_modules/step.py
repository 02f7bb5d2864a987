"""Per-step attention metadata, built once per step on the host and shared by every layer.

Shape letters: R = requests, N = new tokens of the batch (all requests, original order),
T = this rank's local tokens (DualChunkSwap share, padding included), Bd = this rank's decode
tokens, C = gathered cached-prefix tokens of prefill requests.

Flow of one step: the caller builds a :class:`CPRuntime` once (from the process groups), then
per step ``meta = build_step_metadata(runtime, num_new_tokens, num_computed_tokens, ...)``,
feeds the model the local tokens ``meta.token_indices`` at positions ``meta.positions``, and
runs the model's forward under ``with cp_step(meta):``. The attention ops' forwards read the
scoped step inside their implementation, so traced code sees only q/k/v: a new batch
composition never recompiles, and the attention op is the single split point of piecewise
compilation. ``cp_step`` restores the previous step on exit.

The plan travels with the autograd graph: an op that has a backward returns a small CPU
*handle* tensor (:func:`step_handle`) that its autograd context saves with the other tensors,
and its backward resolves the plan from it (:func:`step_of`), never from the scoped step. The
handle keeps the plan alive exactly as long as some graph (or user code) holds it, so
``fwd(A); fwd(B); bwd(A)`` uses A's plan, and ``loss.backward()`` may run after the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cp_modules.cache.dcp import dcp_query_kv_len, dcp_slot_mapping, local_seq_len
from cp_modules.cache.prefix_gather import prefix_gather_plan
from cp_modules.cache.window import window_write_start
from cp_modules.config import ParallelConfig
from cp_modules.distributed.dcp_spec import DCPCommSpec
from cp_modules.partition.plan import PCPPlan, plan_pcp
from cp_modules.partition.window_exchange import WindowExchangePlan, plan_window_exchange
from cp_modules.policy import CPPolicy

__all__ = [
    "CPRuntime",
    "CPStepMetadata",
    "build_step_metadata",
    "cp_step",
    "current_step",
    "restore_tokens",
    "step_handle",
    "step_of",
]


@dataclass(frozen=True)
class CPRuntime:
    """This rank's place in the layout, as plain values (group names, sizes, ranks)."""

    config: ParallelConfig
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: str = ""
    pcp_size: int = 1
    pcp_rank: int = 0
    pcp_group: str = ""
    dcp: DCPCommSpec | None = None
    batch_group: str = ""  # the ranks that must be given the same batch (one dp replica)
    policy: CPPolicy = field(default_factory=CPPolicy)

    @property
    def dcp_size(self) -> int:
        return 1 if self.dcp is None else self.dcp.dcp_size

    @property
    def dcp_rank(self) -> int:
        return 0 if self.dcp is None else self.dcp.dcp_rank

    @classmethod
    def single(cls, *, policy: CPPolicy | None = None) -> CPRuntime:
        """One process, no parallelism (the reference every layout must equal)."""
        return cls(config=ParallelConfig(), policy=policy or CPPolicy())

    @classmethod
    def from_groups(
        cls, groups, *, packed_a2a: bool = True, policy: CPPolicy | None = None
    ) -> CPRuntime:
        """Runtime of this rank from its :class:`~cp_modules.distributed.groups.CPGroups`."""

        c = groups.config
        return cls(
            config=c,
            tp_size=c.tp,
            tp_rank=groups.tp_rank,
            tp_group=groups.tp_name,
            pcp_size=c.pcp,
            pcp_rank=groups.pcp_rank,
            pcp_group=groups.pcp_name,
            dcp=DCPCommSpec.from_groups(groups, packed=packed_a2a) if c.dcp > 1 else None,
            batch_group=groups.replica.group_name,
            policy=policy or CPPolicy(),
        )


@dataclass(frozen=True, eq=False)
class CPStepMetadata:
    """Everything the attention layers need for one step (see the module docstring).

    Attributes:
        runtime: the rank's :class:`CPRuntime`.
        plan: the DualChunkSwap :class:`PCPPlan` (also used when pcp == 1).
        token_indices: [T] the batch's new tokens this rank feeds the model.
        positions: [T] their true positions.
        num_new_tokens, num_computed_tokens: host tuples, per request.
        all_decode: every request is a decode (the prefill path is skipped).
        has_decode: some request is a decode (the paged DCP path runs).
        local_decode_idx: [Bd] rows of the local tokens that are decodes.
        decode_seq_idx: [Bd] block-table row of each decode token.
        decode_kv_len: [Bd] local cached tokens each decode token sees on this DCP rank.
        decode_positions: [Bd] global position of each decode token (sliding windows).
        decode_query_len: Q: every decode request has Q new tokens, so the decode tokens are
            runs of Q consecutive tokens of one request (Q = k + 1 in a speculative
            verification), which the paged decode kernel serves reading their K/V once; 1 when
            the decode requests' token counts differ.
        block_table: [R, M] or None (no KV cache: training, or a cache-less forward).
        block_size: tokens per physical block.
        max_block_id: largest block id the step touches (checked against each cache, host).
        slot_mapping: [N] this rank's cache slot of each new token (-1: stored elsewhere).
        prefix_*: the cached prefix of prefill requests, gathered from the DCP shards:
            ``prefix_read_slots`` [Lp] local slots to read (padded), ``prefix_gather_index`` [C]
            rows of the all-gathered [D * Lp] buffer in request/position order,
            ``prefix_cu_seqlens`` [R + 1] (CPU) per-request prefix lengths (0 for decodes).
        is_decode_host: per request, replicated over PCP (a decode) instead of split.
        window_plans: the step's K/V exchanges of sliding-window layers, built on first use
            (:meth:`window_exchange`).
        window_views: window W -> the metadata of the W-window layer group's KV cache (its own
            block table; it writes only the new tokens a later query sees and reads as cached
            prefix only the window), when the caller gave that group's block table; see
            :meth:`for_window`.
        cache_rows: [R] a stable row per request (the engine's admitted row), where an fp8
            cache's bf16 window keeps its tokens; None: the block-table row.
    """

    runtime: CPRuntime
    plan: PCPPlan
    token_indices: torch.Tensor
    positions: torch.Tensor
    num_new_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]
    all_decode: bool
    has_decode: bool
    local_decode_idx: torch.Tensor
    decode_seq_idx: torch.Tensor
    decode_kv_len: torch.Tensor
    decode_positions: torch.Tensor
    block_table: torch.Tensor | None
    block_size: int
    max_block_id: int
    slot_mapping: torch.Tensor | None
    has_prefix: bool
    prefix_read_slots: torch.Tensor | None
    prefix_gather_index: torch.Tensor | None
    prefix_cu_seqlens: torch.Tensor | None
    is_decode_host: tuple[bool, ...] = ()
    decode_query_len: int = 1
    window_plans: dict = field(default_factory=dict, repr=False)
    window_views: Mapping[int, CPStepMetadata] = field(default_factory=dict)
    cache_rows: torch.Tensor | None = None
    serial: int = field(default_factory=lambda: next(_SERIALS))

    def window_exchange(self, window: int, with_cache: bool) -> WindowExchangePlan | None:
        """The neighbour exchange of this step's new K/V for layers with a sliding window of
        ``window`` keys (:mod:`cp_modules.partition.window_exchange`), built once per step and
        shared by those layers. ``with_cache``: each rank also receives the new tokens its DCP
        shard of the KV cache stores. None when every rank needs every token (the all-gather
        is then the cheaper collective)."""
        key = (window, with_cache)
        if key not in self.window_plans:
            rt = self.runtime
            shard = None
            if with_cache:
                # DCP groups span the PCP ranks of dcp/pcp TP positions, ranked by global
                # rank: PCP rank j of this TP position is DCP rank dcp_rank + (j - pcp_rank)*k.
                k = rt.dcp_size // rt.pcp_size if rt.dcp_size > 1 else 0
                assert rt.dcp_size == 1 or k * rt.pcp_size == rt.dcp_size, "dcp is pcp * k"
                peers = tuple(rt.dcp_rank + (j - rt.pcp_rank) * k for j in range(rt.pcp_size))
                shard = (rt.dcp_size, peers, rt.config.interleave)
            self.window_plans[key] = plan_window_exchange(
                self.num_new_tokens, self.num_computed_tokens, self.is_decode_host,
                rt.pcp_size, rt.pcp_rank, window, cache_shard=shard,
                device=self.token_indices.device,
            )  # fmt: skip
        return self.window_plans[key]

    def for_window(self, sliding_window: int | None) -> CPStepMetadata:
        """The metadata a layer with ``sliding_window`` reads: its layer group's cache view if
        the step has one, else this (one cache layout for every layer)."""
        if not sliding_window or not self.window_views:
            return self
        return self.window_views.get(sliding_window, self)

    def decode_kv_start(self, sliding_window: int | None) -> torch.Tensor | None:
        """[Bd] first local token each decode token sees with a window of ``sliding_window``
        keys (its positions ``p - W + 1 .. p``) on this DCP rank, or None without a window."""
        if not sliding_window:
            return None
        rt = self.runtime
        first = (self.decode_positions - sliding_window + 1).clamp_min(0)
        return local_seq_len(first.to(torch.int32), rt.dcp_size, rt.dcp_rank, rt.config.interleave)

    @property
    def num_local_tokens(self) -> int:
        return int(self.token_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


def _check_batch(num_new: np.ndarray, num_computed: np.ndarray) -> None:
    if num_new.shape != num_computed.shape or num_new.ndim != 1 or num_new.size == 0:
        raise ValueError(
            "num_new_tokens and num_computed_tokens must be non-empty 1-D sequences of equal "
            f"length, got {num_new.shape} and {num_computed.shape}"
        )
    if (num_new < 1).any():
        raise ValueError(
            f"every request needs >= 1 new token, got num_new_tokens={num_new.tolist()}"
        )  # ok: host (numpy)
    if (num_computed < 0).any():
        raise ValueError(
            f"num_computed_tokens must be >= 0, got {num_computed.tolist()}"
        )  # ok: host (numpy)


def build_step_metadata(
    runtime: CPRuntime,
    num_new_tokens: Sequence[int],
    num_computed_tokens: Sequence[int] | None = None,
    *,
    block_table: torch.Tensor | None = None,
    block_size: int = 16,
    decode_threshold: int = 1,
    device: torch.device | str | None = None,
    check_consistency: bool = True,
    window_block_tables: Mapping[int, torch.Tensor] | None = None,
    cache_rows: Sequence[int] | torch.Tensor | None = None,
) -> CPStepMetadata:
    """Plan one step for this rank: the PCP split, cache slots, decode and prefix metadata.

    Args:
        runtime: this rank's :class:`CPRuntime`.
        num_new_tokens: [R] new tokens per request (host ints), in batch order.
        num_computed_tokens: [R] tokens of each request already in the KV cache (default 0).
        block_table: [R, M] physical block ids per request (one entry per virtual block of
            ``block_size * dcp`` positions, equal on every DCP rank); None without a KV cache.
        block_size: tokens per physical block (``dcp_kv_cache_interleave_size`` must divide it).
        decode_threshold: requests with at most this many new tokens and a non-empty context
            run on the paged decode path (replicated over PCP, KV sharded over DCP).
        device: where the metadata tensors live.
        check_consistency: compare a fingerprint of the batch across the ranks of this data-
            parallel replica (one small all-gather of a fixed size per step) so that ranks fed
            different batches fail with a clear error instead of hanging or computing garbage
            in a later collective.
        window_block_tables: window W -> [R, M] block table of the W-window layer group (a
            cache of its own that holds only what its window still sees), like
            ``block_table``; each gives the step a :meth:`CPStepMetadata.for_window` view.
        cache_rows: [R] a stable row per request (the engine's admitted rows: an fp8 cache's
            bf16 window keeps its tokens there); None: the block-table row.

    Raises:
        ValueError: for an inconsistent batch, a cached prefix without a block table, a
            block size the interleave does not divide, or ranks that disagree on the batch.
    """
    num_new = np.asarray(list(num_new_tokens), dtype=np.int64)
    num_comp = (
        np.zeros_like(num_new)
        if num_computed_tokens is None
        else np.asarray(list(num_computed_tokens), dtype=np.int64)
    )
    _check_batch(num_new, num_comp)
    if block_table is None and (num_comp > 0).any():
        raise ValueError(
            "requests with num_computed_tokens > 0 attend their cached prefix: pass the "
            "block_table of the KV cache"
        )
    tables = dict(window_block_tables or {})
    if tables and block_table is None:
        raise ValueError("window_block_tables need the block_table of the full layers too")
    bad = [w for w in tables if isinstance(w, bool) or not isinstance(w, int) or w < 1]
    if bad:
        raise ValueError(f"window_block_tables keys must be windows (integers >= 1), got {bad}")
    named = {"block_table": block_table}
    named.update({f"window_block_tables[{w}]": bt for w, bt in tables.items()})
    for name, bt in named.items():
        if bt is not None:
            _check_block_table(name, bt, runtime, block_size, num_new, num_comp)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if check_consistency and runtime.batch_group:
        _check_same_batch_on_all_ranks(runtime, num_new, num_comp, block_table, block_size, dev)
    plan = plan_pcp(
        num_new, num_comp, runtime.pcp_size, runtime.pcp_rank, decode_threshold, device=dev
    )
    is_decode = (num_new <= decode_threshold) & (num_comp > 0)
    has_decode = bool(is_decode.any())

    def t(x, dtype=torch.int64):
        return torch.as_tensor(np.asarray(x), dtype=dtype).to(dev)

    if has_decode:
        local_decode_idx, dec_req_of_tok, dec_positions = _decode_rows(
            runtime.pcp_size, num_new, num_comp, is_decode, plan.num_local_tokens_padded
        )
        decode_rows = dict(
            local_decode_idx=t(local_decode_idx),
            decode_seq_idx=t(dec_req_of_tok, torch.int32),
            decode_positions=t(dec_positions),
        )
    else:
        # No decode rows (every step without a cache takes this): empty tensors.
        decode_rows = dict(
            local_decode_idx=torch.empty(0, dtype=torch.int64, device=dev),
            decode_seq_idx=torch.empty(0, dtype=torch.int32, device=dev),
            decode_positions=torch.empty(0, dtype=torch.int64, device=dev),
        )
    cache: dict = dict(
        block_table=None, max_block_id=-1, slot_mapping=None, has_prefix=False,
        prefix_read_slots=None, prefix_gather_index=None, prefix_cu_seqlens=None,
    )  # fmt: skip
    decode_kv_len = torch.empty(0, dtype=torch.int32, device=dev)
    views: dict[int, dict] = {}
    if block_table is not None:
        args = (block_size, num_new, num_comp, decode_threshold, dev)
        cache = _cache_fields(runtime, block_table, *args)
        views = {w: _cache_fields(runtime, bt, *args, w) for w, bt in sorted(tables.items())}
        decode_kv_len = dcp_query_kv_len(
            decode_rows["decode_positions"], runtime.dcp_size, runtime.dcp_rank,
            runtime.config.interleave,
        )  # fmt: skip

    rows_t = None if cache_rows is None else torch.as_tensor(cache_rows, dtype=torch.int64)
    if rows_t is not None and (rows_t.shape != (num_new.size,) or (rows_t < 0).any()):
        raise ValueError(f"cache_rows must hold one row >= 0 per request, got {rows_t.tolist()}")
    meta = CPStepMetadata(
        runtime=runtime,
        plan=plan,
        token_indices=plan.token_indices,
        positions=plan.positions,
        num_new_tokens=tuple(int(x) for x in num_new),
        num_computed_tokens=tuple(int(x) for x in num_comp),
        all_decode=bool(is_decode.all()),
        has_decode=has_decode,
        decode_kv_len=decode_kv_len,
        **decode_rows,
        block_size=block_size,
        is_decode_host=tuple(bool(x) for x in is_decode),
        decode_query_len=_decode_run_length(num_new, is_decode),
        cache_rows=None if rows_t is None else rows_t.to(dev),
        **cache,
    )
    if views:
        meta = dataclasses.replace(
            meta,
            window_views={
                w: dataclasses.replace(meta, serial=next(_SERIALS), **f) for w, f in views.items()
            },
        )
    return meta


def _decode_run_length(num_new: np.ndarray, is_decode: np.ndarray) -> int:
    """The decode requests' common number of new tokens, or 1 when they differ (or none)."""
    counts = np.unique(num_new[is_decode])
    return int(counts[0]) if counts.size == 1 else 1


def _decode_rows(
    pcp_size: int,
    num_new: np.ndarray,
    num_comp: np.ndarray,
    is_decode: np.ndarray,
    num_local: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local row, request, position) of every decode token, from host values.

    Decode tokens are replicated on every PCP rank: a decode request keeps its n tokens (as
    does every request at P = 1), a prefill request holds 2c = 2 * ceil(n / 2P) local slots.
    """
    chunk = -(-num_new // (2 * pcp_size))
    local_counts = np.where(is_decode | (pcp_size == 1), num_new, 2 * chunk)
    local_offsets = np.concatenate([[0], np.cumsum(local_counts)[:-1]])
    assert int(local_counts.sum()) == num_local, "the plan's local rows"
    dec_reqs = np.nonzero(is_decode)[0]
    dec_counts = num_new[dec_reqs]
    dec_req_of_tok = np.repeat(dec_reqs, dec_counts)
    dec_tok_in_req = np.arange(dec_counts.sum()) - np.repeat(
        np.cumsum(dec_counts) - dec_counts, dec_counts
    )
    local_decode_idx = local_offsets[dec_req_of_tok] + dec_tok_in_req
    return local_decode_idx, dec_req_of_tok, num_comp[dec_req_of_tok] + dec_tok_in_req


def _check_block_table(name, block_table, runtime, block_size, num_new, num_comp) -> None:
    runtime.config.validate_block_size(block_size)
    if block_table.dim() != 2 or block_table.shape[0] != num_new.size:
        raise ValueError(
            f"{name} must be [num_requests={num_new.size}, max_blocks], got "
            f"{tuple(block_table.shape)}"
        )
    virtual = block_size * runtime.dcp_size
    need = int(((num_new + num_comp + virtual - 1) // virtual).max())
    if need > block_table.shape[1]:
        raise ValueError(
            f"{name} has {block_table.shape[1]} blocks per request but the longest "
            f"request needs {need} (virtual blocks of block_size*dcp = {virtual} tokens)"
        )


def _cache_fields(runtime, block_table, block_size, num_new, num_comp, decode_threshold, dev,
                  window: int | None = None) -> dict:  # fmt: skip
    """The step's cache slots and cached-prefix read through ``block_table``; with a
    ``window`` W, those of a W-window layer group: it keeps only the new tokens a later query
    sees, or that a decode reads from the cache (:func:`window_write_start`: positions
    ``>= max(c0, c1 - W + 1)`` of a prompt chunk ``[c0, c1)``, every decode token) and reads
    as prefix of a prompt chunk only ``[max(0, c0 - W + 1), c0)``."""
    virtual = block_size * runtime.dcp_size
    used = (num_new + num_comp + virtual - 1) // virtual
    bt_host = block_table.cpu()
    max_block_id = max(int(bt_host[r, : used[r]].max()) for r in range(num_new.size))
    if int(bt_host.min()) < 0 and any(
        int(bt_host[r, : used[r]].min()) < 0 for r in range(num_new.size)
    ):
        raise ValueError("block_table holds negative block ids in entries the batch uses")
    block_table = block_table.to(dev)
    req_of_new = np.repeat(np.arange(num_new.size), num_new)
    pos_of_new = num_comp[req_of_new] + (
        np.arange(num_new.sum()) - np.repeat(np.cumsum(num_new) - num_new, num_new)
    )
    prefix_start = np.zeros_like(num_comp)
    if window is not None:
        keep = window_write_start(num_comp, num_new, window, decode_threshold)
        pos_of_new = np.where(pos_of_new >= keep[req_of_new], pos_of_new, -1)  # -1: not kept
        prefix_start = np.maximum(num_comp - window + 1, 0)
    slot_mapping = dcp_slot_mapping(
        torch.as_tensor(pos_of_new).to(dev),
        torch.as_tensor(req_of_new).to(dev),
        block_table,
        block_size,
        runtime.dcp_size,
        runtime.dcp_rank,
        runtime.config.interleave,
    )
    is_decode = (num_new <= decode_threshold) & (num_comp > 0)
    prefix_len = np.where(is_decode, 0, num_comp - prefix_start)
    has_prefix = bool(prefix_len.sum() > 0)
    prefix_read = prefix_index = None
    if has_prefix:
        read_np, index_np = prefix_gather_plan(
            prefix_len, bt_host.numpy(), block_size, runtime.dcp_size, runtime.dcp_rank,
            runtime.config.interleave, prefix_start,
        )  # fmt: skip
        prefix_read = torch.as_tensor(read_np, dtype=torch.int64).to(dev)
        prefix_index = torch.as_tensor(index_np, dtype=torch.int64).to(dev)
    return dict(
        block_table=block_table,
        max_block_id=max_block_id,
        slot_mapping=slot_mapping,
        has_prefix=has_prefix,
        prefix_read_slots=prefix_read,
        prefix_gather_index=prefix_index,
        prefix_cu_seqlens=torch.as_tensor(
            np.concatenate([[0], np.cumsum(prefix_len)]), dtype=torch.int64
        ),
    )


def _check_same_batch_on_all_ranks(runtime, num_new, num_comp, block_table, block_size, dev):
    """All-gather a fixed-size fingerprint of the batch and compare it across ranks."""
    import torch.distributed as dist

    from cp_modules.distributed.collectives import all_gather, resolve_group

    group = resolve_group(runtime.batch_group)
    bt = -1 if block_table is None else int(block_table.shape[1])
    h = np.uint64(1469598103934665603)
    for v in np.concatenate([num_new, num_comp]):
        h = np.uint64((int(h) ^ int(v)) * 1099511628211 % (1 << 63))
    mine = torch.tensor(
        [num_new.size, int(num_new.sum()), int(num_comp.sum()), bt, block_size, int(h)],
        dtype=torch.int64,
        device=dev,
    )
    world = dist.get_world_size(group)
    everyone = all_gather(mine, runtime.batch_group, world).view(world, mine.numel())
    bad = (everyone != mine).any(dim=1).nonzero().flatten().tolist()  # ok: host (once a step)
    if bad:
        raise ValueError(
            "ranks disagree on the step's batch (number of requests, new/computed tokens per "
            f"request, block-table width or block size): rank {dist.get_rank()} differs from "
            f"ranks {bad}. Every rank of a context-parallel group must be given the same batch."
        )


_SERIALS: Iterator[int] = itertools.count(1)
_CURRENT: CPStepMetadata | None = None


def active_step() -> CPStepMetadata | None:
    """The metadata of the step being run, or None outside of any :func:`cp_step`."""
    return _CURRENT


def current_step() -> CPStepMetadata:
    """The metadata of the step being run.

    Raises:
        RuntimeError: outside of any :func:`cp_step`.
    """
    if _CURRENT is None:
        raise RuntimeError(
            "no context-parallel step is active: build the step's metadata with "
            "build_step_metadata(...) and run the model's forward under `with cp_step(meta):` "
            "(activation checkpointing runs the forward again in the backward: checkpoint "
            "with cp_modules.training.checkpoint_with_step, which re-enters the step; HF's "
            "gradient_checkpointing_enable() does so on models swap_attention prepared)"
        )
    return _CURRENT


def step_entry() -> int:
    """Changes at every :func:`cp_step` entry (keys what a step's layers compute once)."""
    return _ENTRY


_ENTRIES, _ENTRY = itertools.count(1), 0


@contextlib.contextmanager
def cp_step(meta: CPStepMetadata) -> Iterator[CPStepMetadata]:
    """Make ``meta`` the current step's metadata inside the block; the previous one (or none)
    is restored on exit. Backwards need no active step: they use the plan their forward saved.
    """
    global _CURRENT, _ENTRY
    if not isinstance(meta, CPStepMetadata):
        raise TypeError(f"cp_step takes a CPStepMetadata, got {type(meta).__name__}")
    previous, _CURRENT = _CURRENT, meta
    _ENTRY = next(_ENTRIES)
    try:
        yield meta
    finally:
        _CURRENT = previous


# serial -> plan, for the plans some live handle refers to (see the module docstring). Each
# plan has one numpy array holding its serial; every handle tensor of the plan is a view of
# that array (torch.from_numpy keeps the array alive), and the array's finalizer drops the
# plan once the last handle (saved by any graph) is gone.
_PLANS: dict[int, CPStepMetadata] = {}
_HANDLE_ARRAYS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def step_handle(meta: CPStepMetadata) -> torch.Tensor:
    """A [1] int64 CPU tensor that names ``meta`` and keeps it alive while it lives."""
    arr = _HANDLE_ARRAYS.get(meta.serial)
    if arr is None:
        arr = np.array([meta.serial], dtype=np.int64)
        _HANDLE_ARRAYS[meta.serial] = arr
        _PLANS[meta.serial] = meta
        weakref.finalize(arr, _PLANS.pop, meta.serial, None)
    return torch.from_numpy(arr)


def step_of(handle: torch.Tensor) -> CPStepMetadata:
    """The plan a :func:`step_handle` names (what an op's forward saved for its backward).

    Raises:
        RuntimeError: if the plan was released (the handle was copied rather than kept, e.g.
            by a saved-tensor hook that moves saved tensors).
    """
    serial = int(handle.reshape(-1)[0])
    meta = _PLANS.get(serial)
    if meta is None:
        raise RuntimeError(
            f"the step plan {serial} that this attention op's forward saved was released: "
            "its handle tensor was copied instead of kept (a saved-tensor hook that copies "
            "CPU tensors?); keep saved CPU tensors as they are"
        )
    return meta


def restore_tokens(x_local: torch.Tensor, meta: CPStepMetadata | None = None) -> torch.Tensor:
    """All-gather per-token rows over PCP and return them in the batch's order, padding dropped.

    ``[T, ...] -> [N, ...]``; differentiable (hidden states before the LM head, or outputs to
    compare with a single-process run).
    """
    from cp_modules.partition.restore import pcp_gather_restore

    meta = current_step() if meta is None else meta
    rt = meta.runtime
    return pcp_gather_restore(x_local, meta.plan, rt.pcp_group, rt.pcp_size)
