"""Decode steps on static buffers, replayed as CUDA graphs (one graph per batch-size bucket).

Shape letters: B = decode requests of the step, Bp = the bucket (the smallest of
:data:`BUCKETS` >= B), M = block-table width of the graph, V = vocabulary.

A decode step reads three inputs that live in static device buffers: the token ids [Bp], their
positions [Bp] and the requests' block-table rows [Bp, M]. Everything else the attention layers
need (each token's cache slot on this DCP rank, the local KV length it attends) is derived from
them on the device inside the graph, so a step of the same bucket replays the same graph with
no host work but the launch (sliding-window layer groups add their block-table rows, which
move with the window: one copy per group and step). Padding rows (B < Bp) have position -1: they write no cache slot
and attend no key (their rows are ignored). The graph ends with fp32 logits [Bp, V] in a static
buffer; sampling runs after it on the first B rows.

Between steps of a decode run (the same requests, one token each) the next step's inputs are
updated on the device: the sampled ids become the next ids and every position moves on by one,
so the host never waits for a step before launching the next one (see
``GenerationEngine._decode_run``). The block-table rows never change during a run: a request's
whole lifetime is allocated when it is admitted.

On CPU (or with CUDA graphs off) the same buffers and derivations run eagerly: the code path
the CUDA graph captures, checked by the CPU tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from cp_modules.cache.dcp import dcp_query_kv_len, dcp_slot_mapping
from cp_modules.engine.rows import gather_rows
from cp_modules.engine.sampling import accept_greedy
from cp_modules.engine.scheduler import Request, StepBatch
from cp_modules.pinned import pinned_copy
from cp_modules.step import CPRuntime, build_step_metadata, cp_step

__all__ = ["BUCKETS", "DecodeGraph", "DecodeServer", "bucket_of", "decode_batch", "graph_width"]

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512)


def bucket_of(num_requests: int) -> int | None:
    """The smallest bucket holding ``num_requests`` decode rows (None past the largest)."""
    return next((b for b in BUCKETS if b >= num_requests), None)


def graph_width(blocks: int) -> int:
    """Block-table width of a graph serving rows of ``blocks`` entries: the next power of two
    (so calls with slightly different request lengths share graphs)."""
    return 1 << max(blocks - 1, 0).bit_length()


class DecodeServer(Protocol):
    """What a decode graph reads from the engine that serves it (the
    :class:`~cp_modules.engine.engine.GenerationEngine`): its runtime, device, cache sizes and
    LM head."""

    @property
    def runtime(self) -> CPRuntime: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def block_size(self) -> int: ...
    @property
    def cache_blocks(self) -> int: ...
    @property
    def window_cache_blocks(self) -> dict[int, int]: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DecodeGraph:
    """One bucket's decode step on static buffers; captured as a CUDA graph when ``capture``.

    Args:
        engine: the engine served (runtime, device, cache sizes and the LM head).
        forward: the decode forward the engine runs: ``(ids [1, Bp], positions [1, Bp])`` ->
            hidden states ``[1, Bp, H]``.
        bucket: Bp, decode rows of the graph.
        width: M, block-table entries per row.
        capture: capture a CUDA graph (CUDA only); else :meth:`replay` runs the step eagerly.
        pool: the CUDA graph memory pool shared by the engine's graphs.
        query_len: Q, query tokens per row (1: a decode step; ``k + 1``: a speculative
            verification, :mod:`cp_modules.engine.speculative`); the buffers of ids and
            positions hold ``Bp * Q`` tokens, row after row, and the logits ``[Bp * Q, V]``.
            A row's unused tokens have position -1, like padding rows.
        accept_greedy: a greedy verification (Q > 1): the graph also runs the acceptance
            (:func:`~cp_modules.engine.sampling.accept_greedy`) into :attr:`verified`
            ``[Bp, 1 + Q]``, and its logits stay in the model's dtype (only their argmax is
            read).
    """

    def __init__(
        self,
        engine: DecodeServer,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        bucket: int,
        width: int,
        *,
        capture: bool,
        pool=None,
        window_widths: dict[int, int] | None = None,
        query_len: int = 1,
        accept_greedy: bool = False,
    ) -> None:
        rt, dev = engine.runtime, engine.device
        self.engine, self.forward, self.bucket, self.width = engine, forward, bucket, width
        self.query_len = q = query_len
        self.accept_greedy = accept_greedy and q > 1
        # Ids and positions in one buffer (one copy a step), staged on the host in pinned
        # memory; the verified tokens come back the same way.
        pinned = dev.type == "cuda"
        self._inputs = torch.zeros(2, bucket * q, dtype=torch.long, device=dev)
        self._staging = torch.zeros(2, bucket * q, dtype=torch.long, pin_memory=pinned)
        self.ids, self.positions = self._inputs[0], self._inputs[1]
        self.positions.fill_(-1)
        self.verified = torch.zeros(bucket, q + 1, dtype=torch.long, device=dev)
        self._verified_host = torch.zeros(bucket, q + 1, dtype=torch.long, pin_memory=pinned)
        self._verified_event = torch.cuda.Event() if pinned else None
        self.block_table = torch.zeros(bucket, width, dtype=torch.int32, device=dev)
        self.rows = torch.arange(bucket, device=dev).repeat_interleave(q)  # each token's row
        # Each row's request row (the scheduler's admitted row: an fp8 cache's bf16 window).
        self.cache_rows = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.out_rows = torch.arange(bucket * q, device=dev)  # rows of the logits
        # The step's structure (every row a one-token decode) from the planner itself; the
        # position-dependent fields are replaced by buffers the graph fills.
        widths = dict(window_widths or {})
        meta = build_step_metadata(
            rt,
            [q] * bucket,
            [1] * bucket,
            block_table=torch.zeros(bucket, width, dtype=torch.int32),
            window_block_tables={
                w: torch.zeros(bucket, m, dtype=torch.int32) for w, m in widths.items()
            },
            block_size=engine.block_size,
            decode_threshold=q,
            device=dev,
            check_consistency=False,
        )
        assert meta.all_decode and meta.slot_mapping is not None
        self.kv_len = torch.zeros_like(meta.decode_kv_len)
        self.slots = torch.zeros_like(meta.slot_mapping)
        # Sliding-window layer groups: their own block tables (rewritten every step, as the
        # window moves) and cache slots.
        self.window_tables = {
            w: torch.zeros(bucket, m, dtype=torch.int32, device=dev) for w, m in widths.items()
        }
        self.window_slots = {w: torch.zeros_like(self.slots) for w in widths}
        plan = dataclasses.replace(meta.plan, positions=self.positions)
        views = {
            w: dataclasses.replace(
                meta.window_views[w],
                plan=plan,
                positions=self.positions,
                decode_positions=self.positions,
                decode_kv_len=self.kv_len,
                slot_mapping=self.window_slots[w],
                block_table=self.window_tables[w],
                max_block_id=engine.window_cache_blocks[w] - 1,
                cache_rows=self.cache_rows,
            )  # fmt: skip
            for w in widths
        }
        self.meta = dataclasses.replace(
            meta,
            plan=plan,
            positions=self.positions,
            decode_positions=self.positions,
            decode_kv_len=self.kv_len,
            slot_mapping=self.slots,
            block_table=self.block_table,
            # Block ids come from the scheduler's tables: below every cache's block count.
            max_block_id=engine.cache_blocks - 1,
            window_views=views,
            cache_rows=self.cache_rows,
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if capture:
            self._capture(pool)

    def _derive(self) -> None:
        # Per-token cache metadata from the positions and block-table rows (what
        # build_step_metadata computes on the host for a decode step).
        rt = self.engine.runtime
        d, r, i = rt.dcp_size, rt.dcp_rank, rt.config.interleave
        self.kv_len.copy_(dcp_query_kv_len(self.positions, d, r, i))
        bs = self.engine.block_size
        self.slots.copy_(dcp_slot_mapping(self.positions, self.rows, self.block_table, bs, d, r, i))
        for w, table in self.window_tables.items():
            # A decode keeps its own token in a windowed layer's cache too.
            slots = dcp_slot_mapping(self.positions, self.rows, table, bs, d, r, i)
            self.window_slots[w].copy_(slots)

    def _step(self) -> torch.Tensor:
        self._derive()
        with cp_step(self.meta):
            hidden = self.forward(self.ids[None], self.positions[None])[0]
        logits = self.engine.compute_logits(gather_rows(hidden, self.meta, self.out_rows))
        if self.accept_greedy:
            self.verified = accept_greedy(logits, self.ids, self.positions, self.query_len)
            return logits
        return logits.float()

    def _capture(self, pool) -> None:
        # Warm up on a side stream (compilation, autotuning, kernel plans), then capture. The
        # positions are all -1 here: nothing is written to the cache.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = self._step()

    def load(self, batch: StepBatch) -> int:
        """Copy an all-decode batch's ids, positions and block-table rows into the buffers;
        returns B. Rows past B become padding."""
        b = len(batch.requests)
        assert b <= self.bucket and batch.block_table.shape[1] <= self.width
        dev = self.ids.device
        pinned = dev.type == "cuda"

        def up(x: torch.Tensor) -> torch.Tensor:
            # The host rows, pinned on CUDA: the buffer's copy_ is then the one transfer.
            return pinned_copy(x) if pinned else x

        self.ids[:b].copy_(up(batch.input_ids.to(torch.long)), non_blocking=pinned)
        self.ids[b:].zero_()
        pos = torch.tensor(batch.num_computed, dtype=torch.long)
        self.positions[:b].copy_(up(pos), non_blocking=pinned)
        self.positions[b:].fill_(-1)
        self.block_table.zero_()
        m = batch.block_table.shape[1]
        self.block_table[:b, :m].copy_(up(batch.block_table.to(torch.int32)), non_blocking=pinned)
        self.load_cache_rows([r.admitted_row for r in batch.requests])
        self.load_window_tables(batch.window_block_tables)
        return b

    def load_cache_rows(self, rows) -> None:
        """Copy the batch's request rows (host ints, batch order); rows past them read row 0."""
        pinned = self.ids.device.type == "cuda"
        host = torch.zeros(self.bucket, dtype=torch.long)
        host[: len(rows)] = torch.as_tensor(rows, dtype=torch.long)
        self.cache_rows.copy_(pinned_copy(host) if pinned else host, non_blocking=pinned)

    def load_table(self, block_table: torch.Tensor, rows=None) -> None:
        """Copy the block-table rows [B, M] (host int32) of a run of verification steps (they
        do not change while its requests run) and their request rows ``rows`` (None: 0..B-1);
        rows past B read block 0."""
        b, m = block_table.shape
        self.load_cache_rows(list(range(b)) if rows is None else rows)
        assert b <= self.bucket and m <= self.width
        pinned = self.ids.device.type == "cuda"
        table = torch.zeros(self.bucket, self.width, dtype=torch.int32)
        table[:b, :m] = block_table
        self.block_table.copy_(pinned_copy(table) if pinned else table, non_blocking=pinned)

    def staged_tokens(self):
        """Numpy views ``(ids, positions)`` [Bp, Q] of the host staging buffer that
        :meth:`upload` copies in. Write them only after the last step's result was read (the
        copy of the step before may still be reading them until then)."""
        arr = self._staging.numpy()
        return arr[0].reshape(self.bucket, self.query_len), arr[1].reshape(
            self.bucket, self.query_len
        )

    def upload(self) -> None:
        """Copy the staged ids and positions into the graph's inputs (one stream-ordered copy)."""
        pinned = self._verified_event is not None
        self._inputs.copy_(self._staging, non_blocking=pinned)

    def read_verified(self, num_rows: int):
        """The host copy of :attr:`verified`'s first ``num_rows`` rows after the last replay
        (a numpy [num_rows, Q + 1] view; waits for the step)."""
        host = self._verified_host
        host.copy_(self.verified, non_blocking=self._verified_event is not None)
        if self._verified_event is not None:
            self._verified_event.record()
            self._verified_event.synchronize()
        return host.numpy()[:num_rows]

    def load_window_tables(self, tables: dict[int, torch.Tensor]) -> None:
        """Copy the window groups' block-table rows ([B, M_W] host int32, batch order) into the
        buffers (stream-ordered: a step already launched still reads the previous ones)."""
        pinned = self.ids.device.type == "cuda"
        for w, buf in self.window_tables.items():
            rows = tables[w].to(torch.int32)
            src = pinned_copy(rows) if pinned else rows
            buf.zero_()
            buf[: rows.shape[0], : rows.shape[1]].copy_(src, non_blocking=pinned)

    def replay(self) -> torch.Tensor:
        """Run the step on the buffers; the logits [Bp * Q, V] (a static buffer on CUDA): fp32,
        or the model's dtype in a greedy verification graph (its result: :attr:`verified`)."""
        if self.graph is None:
            return self._step()
        self.graph.replay()
        assert self.logits is not None
        return self.logits

    def advance(self, tokens: torch.Tensor) -> None:
        """The next step of the run: the sampled ids [B] become the inputs, positions move on."""
        b = tokens.shape[0]
        self.ids[:b].copy_(tokens)
        self.positions[:b].add_(1)


def decode_batch(requests: list[Request], num_computed: list[int] | None = None) -> StepBatch:
    """The bookkeeping of a decode step of ``requests`` (one token each) whose inputs live on
    the device: what :meth:`Scheduler.update` reads."""
    num_computed = [r.num_computed for r in requests] if num_computed is None else num_computed
    n = len(requests)
    return StepBatch(
        requests=list(requests),
        num_new=[1] * n,
        num_computed=list(num_computed),
        input_ids=torch.zeros(0, dtype=torch.long),
        block_table=torch.zeros(n, 0, dtype=torch.int32),
        sample_rows=torch.arange(n),
        sample_requests=list(requests),
    )
