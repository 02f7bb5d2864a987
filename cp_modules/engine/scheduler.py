"""Host-side scheduler: chunked prefill under a token budget, decode, paged-cache blocks.

Every rank runs the same scheduler on the same inputs (prompts, sampled tokens broadcast from
rank 0), so all ranks build the same steps and the same block tables without communicating.

A step holds every running request that decodes (one token each) and then prompt chunks, in
arrival order, until ``max_num_tokens`` new tokens are scheduled. A request is admitted when its
whole lifetime (prompt + max_new_tokens) fits in the free blocks, so no request is ever
preempted; admitted requests keep their block-table row until they finish.

Sliding-window layer groups (``window_num_blocks``) have block pools and tables of their own
(:class:`~cp_modules.engine.block_groups.WindowBlockGroup`): a request reserves there only the
blocks its window can span, takes them as it writes and returns them as the window moves on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from cp_modules.cache.dcp import dcp_num_blocks
from cp_modules.cache.paged import BlockAllocator, BlockTable
from cp_modules.engine.block_groups import WindowBlockGroup

__all__ = ["Request", "Scheduler", "StepBatch"]


@dataclass
class Request:
    """One prompt and its generation state."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    row: int | None = None
    finished: bool = False
    finish_reason: str | None = None
    first_token_time: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def last_token(self) -> int:
        """The latest token (a decoding request's next input; no copy of ``tokens``)."""
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def first_token_s(self) -> float:
        """When its first token came (the request has one)."""
        assert self.first_token_time is not None, f"request {self.index} finished without a token"
        return self.first_token_time

    @property
    def stop_reason(self) -> str:
        """Why it stopped (the request has finished)."""
        assert self.finish_reason is not None, f"request {self.index} has not finished"
        return self.finish_reason

    @property
    def admitted_row(self) -> int:
        """The request's block-table row (set when it is admitted)."""
        assert self.row is not None, f"request {self.index} is not admitted"
        return self.row

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_computed >= len(self.prompt)


@dataclass
class StepBatch:
    """One step: requests in batch order, their new and cached token counts, and the inputs.

    Attributes:
        requests: scheduled requests (batch order: decodes first, then prompt chunks).
        num_new: [R] new tokens per request; num_computed: [R] tokens already cached.
        input_ids: [N] the new tokens, flattened in batch order.
        block_table: [R, M] int32 (host) rows of the scheduled requests.
        sample_rows: [S] rows of ``input_ids`` whose next token is sampled (last token of a
            request that has no unprocessed tokens left after this step).
        sample_requests: the S requests those rows belong to.
        window_block_tables: window W -> [R, M] int32 rows of the W-window layer group
            (entries out of every query's window read 0).
    """

    requests: list[Request]
    num_new: list[int]
    num_computed: list[int]
    input_ids: torch.Tensor
    block_table: torch.Tensor
    sample_rows: torch.Tensor
    sample_requests: list[Request]
    window_block_tables: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for r, n in zip(self.requests, self.num_new) if not r.is_decoding)


class Scheduler:
    """Schedules requests on a paged KV cache of ``num_blocks`` blocks per rank.

    Args:
        requests: the batch, in arrival order.
        num_blocks: physical blocks per rank.
        block_size: tokens per physical block.
        dcp_size: DCP group size (a block-table entry covers ``block_size * dcp_size`` tokens).
        max_num_tokens: new tokens per step at most (the chunked-prefill budget).
        max_num_seqs: requests per step at most (and block-table rows).
        window_num_blocks: window W -> physical blocks per rank of the W-window layer group
            (its own pool and block table); the groups not named here are full layers, served
            by the ``num_blocks`` pool.
        max_query_len: new tokens of a decode at most (``k + 1`` with speculative decoding;
            the window groups reserve for it).

    Raises:
        ValueError: when the budget cannot hold one decode per running request, or a request
            needs more blocks than a cache has.
    """

    def __init__(
        self,
        requests: list[Request],
        *,
        num_blocks: int,
        block_size: int,
        dcp_size: int,
        max_num_tokens: int,
        max_num_seqs: int,
        window_num_blocks: Mapping[int, int] | None = None,
        max_query_len: int = 1,
    ) -> None:
        if max_num_seqs < 1 or max_num_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_tokens={max_num_tokens} must be >= max_num_seqs={max_num_seqs} >= 1 "
                "(every running request decodes one token per step)"
            )
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        for r in requests:
            need = dcp_num_blocks(r.max_len, block_size, dcp_size)
            if need > num_blocks:
                raise ValueError(
                    f"request {r.index} needs {need} blocks (prompt {len(r.prompt)} + "
                    f"max_new_tokens {r.max_new_tokens} tokens) but the cache has num_blocks="
                    f"{num_blocks}: raise num_blocks or lower max_new_tokens"
                )
        max_model_len = max(r.max_len for r in requests)
        self.allocator = BlockAllocator(num_blocks)
        self.table = BlockTable(
            max_num_seqs, max_model_len, block_size, self.allocator, dcp_size=dcp_size
        )
        self.window_groups = {
            w: WindowBlockGroup(
                w,
                num_blocks=n,
                block_size=block_size,
                dcp_size=dcp_size,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                max_num_tokens=max_num_tokens,
                max_query_len=max_query_len,
            )
            for w, n in sorted((window_num_blocks or {}).items())
        }
        for g in self.window_groups.values():
            for r in requests:
                need = g.capacity(len(r.prompt), r.max_len)
                if need > g.num_blocks:
                    raise ValueError(
                        f"request {r.index} needs {need} blocks in the window={g.window} layer "
                        f"group but its cache has {g.num_blocks}: raise that group's blocks"
                    )
        self.waiting = list(requests)
        self.running: list[Request] = []
        self._free_rows = list(range(max_num_seqs))
        self.peak_blocks_used = 0

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self) -> None:
        while self.waiting and self._free_rows:
            r = self.waiting[0]
            need = dcp_num_blocks(r.max_len, self.block_size, self.dcp_size)
            row = self._free_rows[0]
            groups = self.window_groups.values()
            fits = all(g.capacity(len(r.prompt), r.max_len) <= g.num_unreserved for g in groups)
            if need > self.allocator.num_free or not fits:
                return
            r.row = self._free_rows.pop(0)
            self.table.ensure_capacity(r.row, r.max_len)
            for g in groups:
                admitted = g.admit(row, len(r.prompt), r.max_len)
                assert admitted, "checked above"
            self.running.append(self.waiting.pop(0))
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)

    def schedule(self) -> StepBatch:
        """The next step's batch (decodes first, then prompt chunks within the budget)."""
        self._admit()
        assert self.running, "schedule() called with nothing to run"
        budget = self.max_num_tokens
        chosen: list[tuple[Request, int]] = []
        for r in self.running:
            if r.is_decoding:
                chosen.append((r, 1))
                budget -= 1
        for r in self.running:
            if not r.is_decoding and budget > 0:
                n = min(len(r.prompt) - r.num_computed, budget)
                chosen.append((r, n))
                budget -= n
        ids: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for r, n in chosen:
            ids.extend(r.tokens[r.num_computed : r.num_computed + n])
            if r.num_computed + n == len(r.tokens):
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(r)
        rows = torch.tensor([r.row for r, _ in chosen], dtype=torch.long)
        for g in self.window_groups.values():
            for r, n in chosen:
                g.prepare(r.admitted_row, r.num_computed, n)
        return StepBatch(
            requests=[r for r, _ in chosen],
            num_new=[n for _, n in chosen],
            num_computed=[r.num_computed for r, _ in chosen],
            input_ids=torch.tensor(ids, dtype=torch.long),
            block_table=self.table.tensor.index_select(0, rows),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
            sample_requests=sample_reqs,
            window_block_tables={
                w: g.tensor.index_select(0, rows) for w, g in self.window_groups.items()
            },
        )

    def advance_windows(
        self, requests: list[Request], num_computed: list[int]
    ) -> dict[int, torch.Tensor]:
        """The window groups' bookkeeping of a decode step scheduled before the previous step's
        :meth:`update` (the engine's decode runs launch ahead): blocks no later query sees go
        back (what that update does too; releasing twice is a no-op) and each request's next
        write gets its block. Returns each group's block-table rows of ``requests``."""
        rows = torch.tensor([r.row for r in requests], dtype=torch.long)
        for g in self.window_groups.values():
            for r, c in zip(requests, num_computed):
                g.release(r.admitted_row, c)
                g.prepare(r.admitted_row, c, 1)
        return {w: g.tensor.index_select(0, rows) for w, g in self.window_groups.items()}

    def update(
        self, batch: StepBatch, tokens: list[int], stop_ids: frozenset[int], now: float
    ) -> int:
        """Record a step's sampled tokens; finish requests; return the number of new tokens."""
        for r, n in zip(batch.requests, batch.num_new):
            r.num_computed += n
            for g in self.window_groups.values():
                g.release(r.admitted_row, r.num_computed)
        for r, t in zip(batch.sample_requests, tokens):
            self._append(r, t, stop_ids, now)
        self._retire()
        return len(tokens)

    def update_verified(
        self,
        requests: list[Request],
        tokens: list[list[int]],
        stop_ids: frozenset[int],
        now: float,
    ) -> int:
        """Record a speculative verification step of decoding ``requests``: each request's
        verified tokens (its accepted drafts and one token of the target's). The step cached
        the request's last token and its drafts; the last token and the accepted drafts stay
        (``num_computed`` moves on by ``len(tokens)``), the rejected drafts' slots are rolled
        back: window groups return the blocks only they used. Tokens past a stop token or
        ``max_new_tokens`` are dropped. Returns the number of new tokens."""
        added = 0
        for r, toks in zip(requests, tokens):
            assert toks and r.is_decoding
            assert len(r.prompt) + len(r.output) == r.num_computed + 1, "a decoding request"
            kept = 0
            for t in toks:
                self._append(r, t, stop_ids, now)
                kept += 1
                if r.finished:
                    break
            added += kept
            r.num_computed += kept
            row = r.row
            assert row is not None, "a running request holds a row"
            for g in self.window_groups.values():
                g.release(row, r.num_computed)
                g.rollback(row, r.num_computed)
        self._retire()
        return added

    @staticmethod
    def _append(r: Request, t: int, stop_ids: frozenset[int], now: float) -> None:
        if r.first_token_time is None:
            r.first_token_time = now
        r.output.append(t)
        if t in stop_ids:
            r.finished, r.finish_reason = True, "eos"
        elif len(r.output) >= r.max_new_tokens:
            r.finished, r.finish_reason = True, "length"

    def _retire(self) -> None:
        for r in [r for r in self.running if r.finished]:
            self.running.remove(r)
            self.table.free_row(r.admitted_row)
            for g in self.window_groups.values():
                g.finish(r.admitted_row)
            self._free_rows.append(r.admitted_row)
            self._free_rows.sort()
