"""Speculative verification steps in the engine: runs of steps on a verification graph, or one
eager step (what a step verifies and how: :mod:`cp_modules.engine.speculative`).

On a :class:`~cp_modules.engine.graphs.DecodeGraph` of ``k + 1`` query tokens per row (a CUDA
graph on CUDA, one per batch-size bucket) the verification steps of one batch run back to back
until one of its requests finishes: before that the batch cannot change (a request's blocks
are allocated when it is admitted, and nothing is admitted until a request leaves). The
block-table rows are copied once per run. Each step the host drafts, writes the ids and
positions into a pinned staging buffer (one copy), replays the graph and reads the verified
tokens: greedy acceptance runs inside the graph
(:func:`~cp_modules.engine.sampling.accept_greedy`), so the host reads ``[B, k + 2]`` integers
(the kept drafts and each query's argmax), not logits; sampling reads the real rows' logits and applies the rejection rule on the host.
The next step's drafts need this step's tokens, so the device waits while the host records
them and drafts (a plain decode run launches step t + 1 before reading step t). Without
graphs, or past the largest bucket, a step runs eagerly on :func:`build_step_metadata`'s
metadata.

Shapes: B = requests of the run, Q = k + 1 query tokens per request, V = vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from cp_modules.engine.graphs import DecodeGraph, bucket_of, graph_width
from cp_modules.engine.rows import gather_rows
from cp_modules.engine.sampling import SamplingParams
from cp_modules.engine.scheduler import Request, Scheduler, StepBatch
from cp_modules.engine.speculative import (
    Drafter,
    GenerationEngine,
    SpeculativeStats,
    _broadcast_drafts,
    _broadcast_tokens,
    accept_drafts,
    draft_counts,
)
from cp_modules.step import build_step_metadata, cp_step

__all__ = ["SpeculationBackoff", "verify_run"]


class SpeculationBackoff:
    """Whether the next decode steps verify drafts (``SamplingParams.speculative_min_accepted``).

    After a verification step, if the last ``window`` steps kept fewer than ``min_accepted``
    drafts per request on average, speculation pauses: the next ``plain`` decode steps run
    without drafts (8 at first, doubling each time a probe fails again, up to 256), then a
    verification probe follows. A probe that pays resets the pause length. Every rank decides
    alike: the kept counts are rank 0's tokens, broadcast. Tokens are those of plain decoding
    either way (greedy), or drawn from the same distribution (sampling).
    """

    FIRST, LONGEST, WINDOW = 8, 256, 2

    def __init__(self, min_accepted: float) -> None:
        self.min_accepted = min_accepted
        self.plain_left = 0  # decode steps still to run without drafts
        self._pause = self.FIRST
        self._recent: list[float] = []

    def speculate(self) -> bool:
        return self.plain_left <= 0

    def record(self, accepted: int, rows: int) -> bool:
        """One verification step kept ``accepted`` drafts over ``rows`` requests; True: pause."""
        if self.min_accepted <= 0 or rows <= 0:
            return False
        self._recent = [*self._recent[1 - self.WINDOW :], accepted / rows]
        if len(self._recent) < self.WINDOW:
            return False
        if sum(self._recent) / self.WINDOW >= self.min_accepted:
            self._pause = self.FIRST
            return False
        self.plain_left, self._pause = self._pause, min(2 * self._pause, self.LONGEST)
        self._recent = []
        return True

    def ran_plain(self, steps: int) -> None:
        self.plain_left = max(0, self.plain_left - steps)


def verify_run(
    engine: GenerationEngine,
    sched: Scheduler,
    batch: StepBatch,
    params: SamplingParams,
    generator: torch.Generator,
    drafter: Drafter,
    stats: SpeculativeStats,
    stop_ids: frozenset[int],
    start: float,
    progress: Callable[[int], object] = lambda n: None,
    backoff: SpeculationBackoff | None = None,
) -> tuple[int, int]:
    """Verification steps of ``batch``'s decoding requests (an all-decode step), each recorded
    with :meth:`Scheduler.update_verified` (``start``: the call's start, for first-token
    times; ``progress`` gets each step's new tokens): on a graph until a request finishes,
    else one eager step; ``backoff`` (if given) sees each step's kept drafts, and a run ends
    early when it pauses speculation. Returns (steps, tokens recorded)."""
    k = params.num_speculative_tokens
    reqs = list(batch.requests)
    graph = _verify_graph(engine, sched, len(reqs), k + 1, params)
    if graph is not None:
        return _graph_run(engine, sched, reqs, graph, params, generator, drafter, stats,
                          stop_ids, start, progress, backoff)  # fmt: skip
    t0 = time.perf_counter()
    drafts, qs = _draft(engine, reqs, k, drafter, params)
    t1 = time.perf_counter()
    num_new = [len(d) + 1 for d in drafts]
    num_comp = [r.num_computed for r in reqs]
    _prepare_windows(sched, reqs, num_comp, num_new, k, scheduled=True)
    rows = torch.tensor([r.admitted_row for r in reqs], dtype=torch.long)
    ids = [t for r, d in zip(reqs, drafts) for t in [r.last_token, *d]]
    logits = _eager_logits(engine, sched, num_new, num_comp, rows, ids, k)
    out = accept_drafts(logits, drafts, qs, params, generator)
    if engine.world_size > 1:
        out = _broadcast_tokens(out, k, engine.device)
    _count(stats, drafts, out, t1 - t0, time.perf_counter() - t1, 0.0)
    n = sched.update_verified(reqs, out, stop_ids, time.perf_counter() - start)
    progress(n)
    if backoff is not None:
        backoff.record(sum(len(o) - 1 for o in out), len(out))
    return 1, n


def _draft(engine, reqs: Sequence[Request], k: int, drafter: Drafter, params: SamplingParams):
    """Each request's drafts (capped by :func:`draft_counts`; rank 0's on every rank) and the
    drafter's distributions of them (None: one-hot)."""
    counts = draft_counts(reqs, k, engine.max_num_tokens)
    drafts, qs = drafter.propose(reqs, counts, params)
    drafts = [list(d[:c]) for d, c in zip(drafts, counts)]
    if qs is not None:
        qs = [q[: len(d)] for q, d in zip(qs, drafts)]
    if engine.world_size > 1:
        got = _broadcast_drafts(drafts, k, engine.device)
        if qs is not None and got != drafts:
            # A draft model drew other tokens on this rank: q of rank 0's drafts is unknown.
            raise RuntimeError("the draft model drew different drafts on different ranks")
        drafts = got
    return drafts, qs


def _prepare_windows(sched, reqs, num_comp, num_new, k: int, scheduled: bool) -> None:
    """Window groups: the blocks each request's verification writes into. ``scheduled``: the
    step came from :meth:`Scheduler.schedule`, which prepared one token already; later steps
    of a run ask for that token first too, so blocks are taken in the same order."""
    for g in sched.window_groups.values():
        for r, c, n in zip(reqs, num_comp, num_new):
            if not scheduled:
                g.prepare(r.admitted_row, int(c), 1)
            g.prepare(r.admitted_row, int(c), int(n), decode_threshold=k + 1)


def _count(stats: SpeculativeStats, drafts, out, draft_s: float, verify_s: float, wait_s: float):
    stats.steps += 1
    stats.rows += len(out)
    stats.drafted += sum(len(d) for d in drafts)
    stats.accepted += sum(len(o) - 1 for o in out)
    stats.emitted += sum(len(o) for o in out)
    stats.draft_s += draft_s
    stats.verify_s += verify_s
    stats.wait_s += wait_s


def _graph_run(engine, sched, reqs, graph, params, generator, drafter, stats, stop_ids, start,
               progress, backoff=None) -> tuple[int, int]:  # fmt: skip
    """Verification steps of ``reqs`` on ``graph`` until one of them finishes."""
    b, q = len(reqs), graph.query_len
    k = q - 1
    rows = torch.tensor([r.admitted_row for r in reqs], dtype=torch.long)
    graph.load_table(sched.table.tensor.index_select(0, rows), rows.tolist())
    ids, positions = graph.staged_tokens()
    ids.fill(0)
    positions.fill(-1)
    offsets = np.arange(q)
    pad = [0] * k  # unused tokens of a row (position -1)
    steps = recorded = 0
    while True:
        t0 = time.perf_counter()
        drafts, qs = _draft(engine, reqs, k, drafter, params)
        t1 = time.perf_counter()
        num_comp = np.fromiter((r.num_computed for r in reqs), dtype=np.int64, count=b)
        num_new = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=b)
        if sched.window_groups:
            _prepare_windows(sched, reqs, num_comp, num_new, k, scheduled=steps == 0)
            graph.load_window_tables(
                {w: g.tensor.index_select(0, rows) for w, g in sched.window_groups.items()}
            )
        used = offsets[None, :] < num_new[:, None]  # [B, Q]
        positions[:b] = np.where(used, num_comp[:, None] + offsets, -1)
        ids[:b] = [[r.last_token, *d, *pad[len(d) :]] for r, d in zip(reqs, drafts)]
        graph.upload()
        logits = graph.replay()
        wait = 0.0
        if graph.accept_greedy:
            if engine.world_size > 1:
                dist.broadcast(graph.verified, src=0)
            t_w = time.perf_counter()
            got = graph.read_verified(b)
            wait = time.perf_counter() - t_w
            out = [[*d[:a], t[a]] for d, (a, *t) in zip(drafts, got.tolist())]
        else:
            keep = torch.from_numpy((np.arange(b)[:, None] * q + offsets)[used])
            logits = logits.index_select(0, keep.to(logits.device))
            out = accept_drafts(logits, drafts, qs, params, generator)
            if engine.world_size > 1:
                out = _broadcast_tokens(out, k, engine.device)
        _count(stats, drafts, out, t1 - t0, time.perf_counter() - t1, wait)
        n = sched.update_verified(reqs, out, stop_ids, time.perf_counter() - start)
        progress(n)
        recorded += n
        steps += 1
        paused = backoff is not None and backoff.record(sum(len(o) - 1 for o in out), len(out))
        if paused or any(r.finished for r in reqs):
            return steps, recorded


def _verify_graph(
    engine: GenerationEngine, sched: Scheduler, num_requests: int, q: int, params
) -> DecodeGraph | None:
    """The verification graph of ``num_requests`` rows of ``q`` tokens (captured on first
    use, one per batch-size bucket, q and acceptance: greedy graphs accept on the device), or
    None (eager)."""
    bucket = bucket_of(num_requests)
    if not engine.decode_graphs or bucket is None:
        return None
    width = graph_width(sched.table.tensor.shape[1])
    windows = {w: graph_width(g.tensor.shape[1]) for w, g in sched.window_groups.items()}
    greedy = bool(params.greedy)
    key = ("verify", q, greedy, bucket, width, tuple(sorted(windows.items())))
    graph = engine._graphs.get(key)
    if graph is not None:
        return graph
    capture = engine.device.type == "cuda"
    if capture and engine._graph_pool is None:
        engine._graph_pool = torch.cuda.graph_pool_handle()
    try:
        graph = DecodeGraph(engine, engine._decode_fn, bucket, width, capture=capture,
                            pool=engine._graph_pool, window_widths=windows, query_len=q,
                            accept_greedy=greedy)  # fmt: skip
    except RuntimeError as err:
        engine._graph_capture_failed(
            err,
            ValueError(
                f"speculative={params.speculative!r} with decode_graphs=True, but the model's "
                f"verification step cannot be captured as a CUDA graph: {err}; pass "
                "decode_graphs=None (eager fallback) or False, or speculative=None"
            ),
            "verification steps",
        )
        return None
    engine._graphs[key] = graph
    engine.num_graph_captures += int(capture)
    return graph


def _eager_logits(engine, sched, num_new, num_comp, rows, ids, k) -> torch.Tensor:
    meta = build_step_metadata(
        engine.runtime,
        num_new,
        num_comp,
        block_table=sched.table.tensor.index_select(0, rows),
        cache_rows=rows.tolist(),
        window_block_tables={
            w: g.tensor.index_select(0, rows) for w, g in sched.window_groups.items()
        },
        block_size=engine.block_size,
        decode_threshold=k + 1,
        device=engine.device,
        check_consistency=False,
    )
    assert meta.all_decode
    flat = torch.tensor(ids, dtype=torch.long).to(engine.device)
    x = flat[None].index_select(1, meta.token_indices)
    with cp_step(meta):
        hidden = engine._decode_fn(x, meta.positions[None].clone())[0]
    all_rows = torch.arange(len(ids), device=engine.device)
    return engine.compute_logits(gather_rows(hidden, meta, all_rows)).float()
