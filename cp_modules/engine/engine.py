"""Batched generation on a paged, DCP-sharded KV cache with a swapped HuggingFace model.

Each step the host scheduler picks decodes and prompt chunks (chunked prefill under a token
budget), :func:`build_step_metadata` plans the step for this rank (DualChunkSwap share of the
prompt tokens over PCP, decode tokens replicated, cache slots on this DCP shard), the model's
own forward runs on the local tokens, and the LM head and the sampler run on the hidden state
of the last token of every request that needs a next token (only those rows are gathered
over PCP, in batch order). Sampled ids are broadcast from rank 0 and read on the host once per
step: the only host sync of a step.

Shapes: N = new tokens of the step (batch order), T = this rank's local tokens, S = requests
sampled this step, V = vocabulary.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cp_modules.cache.dcp import dcp_num_blocks
from cp_modules.cache.exact_window import check_window_option
from cp_modules.cache.kv_dtype import check_kv_cache_dtype, kv_cache_storage_dtype
from cp_modules.distributed.progress import generation_bar
from cp_modules.engine.block_groups import kv_cache_windows, window_group_num_blocks
from cp_modules.engine.graphs import DecodeGraph, bucket_of, decode_batch, graph_width
from cp_modules.engine.logits import _logits_postprocess, _text_config
from cp_modules.engine.prompts import check_prompts
from cp_modules.engine.results import GenerationResult, GenerationStats
from cp_modules.engine.rows import gather_rows as _gather_rows
from cp_modules.engine.sampling import SamplingParams, sample_tokens
from cp_modules.engine.scheduler import Request, Scheduler, StepBatch
from cp_modules.engine.speculative import SpeculativeStats, make_drafter
from cp_modules.engine.verification import SpeculationBackoff, verify_run
from cp_modules.modules.hf_kv_caches import (
    allocate_kv_caches,
    cp_attention_layers,
    kv_cache_bytes_per_block_of,
    kv_cache_tensors,
    kv_window_bytes,
    mark_kv_caches_static,
)
from cp_modules.step import CPRuntime, build_step_metadata, cp_step

__all__ = ["GenerationEngine", "GenerationResult", "GenerationStats"]


class GenerationEngine:
    """Generate from a batch of prompts with a model whose attention was swapped to CP modules.

    Args:
        model: a HF causal LM after :func:`~cp_modules.modules.hf_swap.swap_attention` (its
            layers are sharded with the same ``groups``).
        groups: this rank's :class:`~cp_modules.distributed.groups.CPGroups`; default
            ``model.cp_groups`` when swap_attention built them, else one process.
        block_size: tokens per physical KV-cache block (the interleave must divide it).
        max_num_tokens: new tokens per step at most (the chunked-prefill budget).
        max_num_seqs: requests in flight at most.
        num_blocks: KV-cache blocks per rank and layer; default: enough for every request of a
            ``generate`` call at full length. Sliding-window layers get what their window needs
            (at most this): their blocks go back to the pool as the window moves on.
        compile: ``torch.compile`` the prefill and the decode forward (dynamic shapes; the
            attention op is opaque to the compiler, so new batch compositions reuse the graphs:
            one for prefill steps, one for decode steps and one for single-token decode steps,
            which dynamic shapes specialize).
        compile_backend: the ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` traces
            without code generation).
        progress: show a progress bar (rank 0 only).
        packed_a2a: one packed all-to-all for the ``a2a`` DCP combine (else two).
        decode_graphs: run decode steps on static buffers (:mod:`cp_modules.engine.graphs`),
            replayed as CUDA graphs (one per batch-size bucket), with the next step launched
            before the host reads the last one's tokens. None: on for a CUDA model in one
            process, off on CPU and with several processes (True there captures the layout's
            collectives too; True on CPU runs the same static-buffer steps eagerly). Sliding-
            window layer groups copy their moving block-table rows into the graph's buffers
            each step. A model whose forward cannot be captured (e.g. a host synchronisation in
            its MoE routing): with None the engine warns once and decodes eagerly; with True the
            capture's error is raised.
        kv_cache_dtype: ``"bf16"`` (the model's own dtype) or ``"fp8_e4m3"`` (half the bytes
            of a bf16 cache: written quantized with the layers' static scales, read
            dequantized by the decode and prefix kernels; :mod:`cp_modules.cache.kv_dtype`).
        kv_cache_memory: bytes of KV cache per rank: the pool then holds
            ``kv_cache_memory // bytes per block`` blocks (over all layers), so an fp8 cache
            holds twice the tokens of a bf16 one in the same memory; it replaces
            ``num_blocks`` (give one of them).
        kv_cache_fp8_sink, kv_cache_fp8_recent: an fp8 cache's bf16 window: decode queries
            read their request's first and their own newest tokens unquantized (a buffer per
            layer beside the pool: :mod:`cp_modules.cache.exact_window`); 0 and 0: none.

    Stop tokens: a request stops at ``params.eos_token_id``, or, when that is None, at the
    model's ``generation_config.eos_token_id`` (one id or a list), unless
    ``params.ignore_eos``.

    Raises:
        ValueError: for a model without swapped attention, a dtype the decode kernels do not
            take, a layout with dp or pp > 1, sizes out of range, an unknown
            ``kv_cache_dtype`` or fp8 on a GPU without fp8 conversions, a bf16 window without
            an fp8 cache or with a negative size, or an LM head whose
            logits the model post-processes in a way the engine does not know.
    """

    def __init__(
        self,
        model: nn.Module,
        groups=None,
        *,
        block_size: int = 16,
        max_num_tokens: int = 256,
        max_num_seqs: int = 16,
        num_blocks: int | None = None,
        compile: bool = False,
        compile_backend: str = "inductor",
        progress: bool = True,
        packed_a2a: bool = True,
        decode_graphs: bool | None = None,
        kv_cache_dtype: str = "bf16",
        kv_cache_memory: int | None = None,
        kv_cache_fp8_sink: int = 0,
        kv_cache_fp8_recent: int = 0,
    ) -> None:
        self.model = model
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        names = "kv_cache_fp8_sink / kv_cache_fp8_recent"
        check_window_option(kv_cache_dtype, kv_cache_fp8_sink, kv_cache_fp8_recent, names)
        self.kv_cache_fp8_window = (kv_cache_fp8_sink, kv_cache_fp8_recent)
        self._window_query_len = 0  # the decode runs the window buffers serve (0: none yet)
        self.layers = cp_attention_layers(model)
        if not self.layers:
            raise ValueError(
                "model has no context-parallel attention: call swap_attention(model, ...) first"
            )
        hf: Any = model  # a transformers causal LM: its own attributes are not typed here
        self.base: nn.Module = hf.base_model
        lm_head: nn.Module | None = hf.get_output_embeddings()
        if lm_head is None or self.base is model:
            raise ValueError(f"expected a causal LM with an LM head, got {type(model).__name__}")
        self.lm_head: nn.Module = lm_head
        groups = groups if groups is not None else getattr(model, "cp_groups", None)
        self.runtime = (
            CPRuntime.from_groups(groups, packed_a2a=packed_a2a)
            if groups is not None
            else CPRuntime.single()
        )
        cfg = self.runtime.config
        if cfg.dp > 1 or cfg.pp > 1:
            raise ValueError(
                f"GenerationEngine serves one data-parallel replica without pipeline stages: "
                f"data_parallel_size={cfg.dp}, pipeline_parallel_size={cfg.pp} must be 1 "
                "(run one engine per replica)"
            )
        cfg.validate_block_size(block_size)
        for name, v in (("max_num_tokens", max_num_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if num_blocks is not None and (
            isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1
        ):
            raise ValueError(f"num_blocks must be None or an integer >= 1, got {num_blocks!r}")
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = min(max_num_seqs, max_num_tokens)
        self.num_blocks = num_blocks
        self.progress = progress
        self.world_size = dist.get_world_size() if groups is not None else 1
        self.rank = dist.get_rank() if groups is not None else 0
        weight = lm_head.weight
        assert isinstance(weight, torch.Tensor)
        self.device = weight.device
        self.dtype = weight.dtype
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"the model's dtype is {self.dtype}; the paged decode kernels take float32, "
                "bfloat16 or float16: convert the model with model.to(dtype)"
            )
        self.kv_storage_dtype = kv_cache_storage_dtype(kv_cache_dtype, self.dtype, self.device)
        self.kv_bytes_per_block = kv_cache_bytes_per_block_of(
            model, block_size, self.kv_storage_dtype
        )
        if kv_cache_memory is not None:
            if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, int):
                raise ValueError(f"kv_cache_memory must be an integer, got {kv_cache_memory!r}")
            if num_blocks is not None:
                raise ValueError("give num_blocks or kv_cache_memory, not both")
            if kv_cache_memory < self.kv_bytes_per_block:
                raise ValueError(
                    f"kv_cache_memory={kv_cache_memory} bytes holds no block: one block takes "
                    f"{self.kv_bytes_per_block} bytes over all layers ({kv_cache_dtype})"
                )
            self.num_blocks = kv_cache_memory // self.kv_bytes_per_block
        self.vocab_size = _text_config(model).vocab_size
        self._logits_fn = _logits_postprocess(model)
        self._cache_blocks = 0
        self._window_blocks: dict[int, int] = {}
        self._windows = kv_cache_windows(self.layers)
        self._compiled = compile
        if decode_graphs is None:
            # On by default for one CUDA process; several processes opt in (collectives
            # inside the graphs are not yet tested on NCCL).
            self._graphs_requested = False  # a capture failure falls back to eager
            decode_graphs = self.device.type == "cuda" and self.world_size == 1
        else:
            self._graphs_requested = bool(decode_graphs)  # a capture failure is an error
        self.decode_graphs = bool(decode_graphs)
        self._graphs: dict[tuple, DecodeGraph] = {}
        self._graph_pool: tuple[int, int] | None = None
        self.num_graph_captures = 0
        self._prefill_fn = self._prefill_forward
        self._decode_fn = self._decode_forward
        if compile:
            self._prefill_fn = torch.compile(
                self._prefill_forward, dynamic=True, backend=compile_backend
            )
            self._decode_fn = torch.compile(
                self._decode_forward, dynamic=True, backend=compile_backend
            )

    # The model's own forward on this rank's local tokens: [1, T] ids and positions -> [1, T, H].
    # Two functions so that prefill and decode are compiled (and cached) separately.
    def _prefill_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.base(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state

    def _decode_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.base(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state

    def _ensure_cache(
        self, num_blocks: int, window_blocks: dict[int, int], query_len: int = 1
    ) -> int:
        """(Re)allocate every layer's cache when it has fewer than ``num_blocks`` blocks (the
        layers of window W: ``window_blocks[W]``) or its bf16 window shorter runs than Q."""
        if (
            num_blocks <= self._cache_blocks
            and all(n <= self._window_blocks.get(w, 0) for w, n in window_blocks.items())
            and (self.kv_cache_fp8_window == (0, 0) or query_len <= self._window_query_len)
        ):
            return self._cache_blocks
        self._window_query_len = max(query_len, self._window_query_len)
        num_blocks = max(num_blocks, self._cache_blocks)
        self._window_blocks = {
            w: max(n, self._window_blocks.get(w, 0)) for w, n in window_blocks.items()
        }
        allocate_kv_caches(
            self.model, num_blocks, self.block_size, dtype=self.dtype, device=self.device,
            window_num_blocks=self._window_blocks, kv_cache_dtype=self.kv_cache_dtype,
            fp8_sink_tokens=self.kv_cache_fp8_window[0],
            fp8_recent_tokens=self.kv_cache_fp8_window[1], max_num_seqs=self.max_num_seqs,
            max_query_len=self._window_query_len,
        )  # fmt: skip
        self._graphs.clear()  # captured graphs hold the old caches' addresses
        if self._compiled:
            mark_kv_caches_static(self.model)
        self._cache_blocks = num_blocks
        return num_blocks

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits of hidden states ``[S, H] -> [S, V]``: its LM head and what its
        forward does to the head's output (Cohere's scale, Granite's divisor, soft-capping)."""
        return self._logits_fn(self.lm_head(hidden))

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end a request: ``params``' own, else the model's generation config's."""
        if params.eos_token_id is not None or params.ignore_eos:
            return params.stop_ids
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            return frozenset()
        return frozenset((eos,) if isinstance(eos, int) else (int(i) for i in eos))

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        return check_prompts(prompts, self.vocab_size)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> GenerationResult:
        """Generate for every prompt (token ids); the same call, with the same inputs, on every rank.

        Raises:
            ValueError: for empty prompts, ids outside the vocabulary, requests longer than the
                model's max_position_embeddings, or a cache too small for one request.
        """
        params = params or SamplingParams()
        prompts = self._check_prompts(prompts)
        limit = getattr(_text_config(self.model), "max_position_embeddings", None)
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        if limit is not None and longest > limit:
            raise ValueError(
                f"the longest prompt plus max_new_tokens={params.max_new_tokens} is {longest} "
                f"tokens, more than the model's max_position_embeddings={limit}"
            )
        requests = [Request(i, p, params.max_new_tokens) for i, p in enumerate(prompts)]
        drafter = self._speculative_drafter(params)
        query_len = params.num_speculative_tokens + 1  # new tokens of a decode at most
        dcp = self.runtime.dcp_size
        need = self.num_blocks or sum(
            dcp_num_blocks(r.max_len, self.block_size, dcp) for r in requests
        )
        window_need = window_group_num_blocks(
            self._windows,
            [(len(r.prompt), r.max_len) for r in requests],
            block_size=self.block_size,
            dcp_size=dcp,
            max_num_tokens=self.max_num_tokens,
            max_num_seqs=self.max_num_seqs,
            limit=self.num_blocks,
            max_query_len=query_len,
        )
        num_blocks = self._ensure_cache(need, window_need, query_len)
        sched = Scheduler(
            requests,
            num_blocks=num_blocks,
            block_size=self.block_size,
            dcp_size=dcp,
            max_num_tokens=self.max_num_tokens,
            max_num_seqs=self.max_num_seqs,
            window_num_blocks=self._window_blocks,
            max_query_len=query_len,
        )
        spec = SpeculativeStats()
        backoff = SpeculationBackoff(params.speculative_min_accepted)
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        stop_ids = self.stop_ids(params)
        bar = generation_bar(
            len(requests) * params.max_new_tokens, self.progress and self.rank == 0
        )
        prefill_s = decode_s = 0.0
        decode_tokens = steps = 0
        t0 = time.perf_counter()

        def record(batch: StepBatch, tokens: list[int]) -> None:
            bar.update(sched.update(batch, tokens, stop_ids, time.perf_counter() - t0))
            if any(t in stop_ids for t in tokens):
                # A request stopped early: its unused tokens leave the bar's total.
                bar.total = sum(len(r.output) if r.finished else r.max_new_tokens for r in requests)
                bar.refresh()

        with torch.no_grad():
            while not sched.done:
                batch = sched.schedule()
                t_step = time.perf_counter()
                speculate = drafter is not None and backoff.speculate()
                if speculate and steps and batch.num_prefill_tokens == 0:
                    n_steps, n = verify_run(self, sched, batch, params, generator, drafter,
                                            spec, stop_ids, t0, bar.update, backoff)  # fmt: skip
                    decode_s += time.perf_counter() - t_step
                    decode_tokens += n
                    steps += n_steps
                    continue
                graph = self._serving_graph(batch) if steps else None
                if graph is not None:
                    n_steps, n_tokens = self._decode_run(
                        sched, batch, graph, params, generator, record, backoff.plain_left
                    )
                    backoff.ran_plain(n_steps)
                    decode_s += time.perf_counter() - t_step
                    decode_tokens += n_tokens
                    steps += n_steps
                    continue
                tokens = self._step(batch, params, generator, first=steps == 0)
                now = time.perf_counter()
                if batch.num_prefill_tokens:
                    prefill_s += now - t_step
                else:
                    decode_s += now - t_step
                    decode_tokens += len(tokens)
                    backoff.ran_plain(1)
                record(batch, tokens)
                steps += 1
        bar.close()
        stats = GenerationStats(
            num_requests=len(requests),
            num_prompt_tokens=sum(len(r.prompt) for r in requests),
            num_generated_tokens=sum(len(r.output) for r in requests),
            num_steps=steps,
            total_s=time.perf_counter() - t0,
            ttft_s=sum(r.first_token_s for r in requests) / len(requests),
            prefill_s=prefill_s,
            decode_s=decode_s,
            num_blocks=num_blocks,
            peak_blocks=sched.peak_blocks_used,
            kv_cache_bytes=sum(c.nbytes for c in kv_cache_tensors(self.model)),
            num_decode_step_tokens=decode_tokens,
            peak_window_blocks={w: g.peak_blocks_used for w, g in sched.window_groups.items()},
            peak_window_blocks_per_request={
                w: g.peak_blocks_per_request for w, g in sched.window_groups.items()
            },
            peak_window_blocks_per_decode={
                w: g.peak_decode_blocks_per_request for w, g in sched.window_groups.items()
            },
            spec_steps=spec.steps,
            spec_rows=spec.rows,
            spec_draft_tokens=spec.drafted,
            spec_accepted_tokens=spec.accepted,
            spec_emitted_tokens=spec.emitted,
            spec_draft_s=spec.draft_s,
            spec_verify_s=spec.verify_s,
            spec_wait_s=spec.wait_s,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_bytes_per_token=self.kv_bytes_per_block // self.block_size,
            kv_fp8_window=self.kv_cache_fp8_window,
            kv_window_bytes=kv_window_bytes(self.model),
        )
        return GenerationResult(
            outputs=[r.output for r in requests],
            finish_reasons=[r.stop_reason for r in requests],
            stats=stats,
        )

    def _speculative_drafter(self, params: SamplingParams):
        """The drafter of ``params.speculative`` (None without speculation), checked."""
        if params.speculative is None:
            return None
        k = params.num_speculative_tokens
        if k + 1 > self.max_num_tokens:
            raise ValueError(
                f"num_speculative_tokens={k}: a verification step holds k + 1 = {k + 1} "
                f"tokens of a request, more than the step budget max_num_tokens="
                f"{self.max_num_tokens}: lower num_speculative_tokens or raise max_num_tokens"
            )
        drafter = make_drafter(params.speculative)
        drafter.check(self)
        drafter.begin()
        return drafter

    @property
    def cache_blocks(self) -> int:
        """Blocks per full-attention layer cache (0 before the first ``generate``)."""
        return self._cache_blocks

    def _serving_graph(self, batch: StepBatch) -> DecodeGraph | None:
        # The graph of a decode-only step in a bucket (captured on first use), or None.
        if not (
            self.decode_graphs
            and all(n == 1 for n in batch.num_new)
            and batch.num_prefill_tokens == 0
            and len(batch.sample_requests) == len(batch.requests)
            and bucket_of(len(batch.requests)) is not None
        ):
            return None
        try:
            return self._decode_graph(batch)
        except RuntimeError as err:
            self._graph_capture_failed(
                err,
                RuntimeError(
                    f"decode_graphs=True but the model's decode step cannot be captured as a "
                    f"CUDA graph: {err}; pass decode_graphs=False (or None: eager fallback)"
                ),
                "decode steps",
            )
            return None

    def _graph_capture_failed(self, err: RuntimeError, requested: Exception, steps: str) -> None:
        """A step's graph could not be captured: raise ``requested`` (from ``err``) when graphs
        were asked for, else warn that these ``steps`` run eagerly and turn graphs off."""
        if self._graphs_requested:
            raise requested from err
        warnings.warn(
            f"{steps} run eagerly: the model's step cannot be captured as a CUDA graph "
            f"({str(err).splitlines()[0]})",
            stacklevel=4,
        )
        self.decode_graphs = False
        self._graphs.clear()

    @property
    def window_cache_blocks(self) -> dict[int, int]:
        """Blocks per cache of each sliding-window layer group (window -> blocks)."""
        return dict(self._window_blocks)

    def _decode_graph(self, batch: StepBatch) -> DecodeGraph:
        bucket, width = bucket_of(len(batch.requests)), graph_width(batch.block_table.shape[1])
        assert bucket is not None
        windows = {w: graph_width(t.shape[1]) for w, t in batch.window_block_tables.items()}
        key = (bucket, width, tuple(sorted(windows.items())))
        graph = self._graphs.get(key)
        if graph is None:
            capture = self.device.type == "cuda"
            if capture and self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = DecodeGraph(
                self,
                self._decode_fn,
                bucket,
                width,
                capture=capture,
                pool=self._graph_pool,
                window_widths=windows,
            )
            self._graphs[key] = graph
            self.num_graph_captures += int(capture)
        return graph

    def _decode_run(
        self, sched, batch, graph, params, generator, record, max_steps: int = 0
    ) -> tuple[int, int]:
        """Decode steps of ``batch``'s requests on ``graph`` until one of them finishes (or
        after ``max_steps`` > 0 steps: a pause in speculation).

        Step t + 1 is launched before the host reads step t's tokens (its inputs are updated on
        the device), so the host's bookkeeping of step t overlaps the GPU's work on t + 1. When
        a request stops early (a stop token), the step already launched computed one token too
        many for it: that token is dropped. Returns (steps, tokens recorded).
        """
        b = graph.load(batch)
        # Steps until the first request reaches max_new_tokens (stop tokens may end it sooner).
        num = min(r.max_new_tokens - len(r.output) for r in batch.requests)
        num = min(num, max_steps) if max_steps > 0 else num
        inflight: list[tuple[StepBatch, torch.Tensor, torch.cuda.Event | None]] = []
        steps = recorded = 0
        bookkeeping = decode_batch(batch.requests)  # what every later step's update reads
        on_cuda = self.device.type == "cuda"
        # At most two steps are in flight: two pinned token buffers and events take turns.
        hosts = [torch.empty(b, dtype=torch.long, pin_memory=True) for _ in range(2 * on_cuda)]
        events = [torch.cuda.Event() for _ in range(2 * on_cuda)]

        def consume() -> bool:
            nonlocal recorded
            step, host, event = inflight.pop(0)
            if event is not None:
                event.synchronize()
            tokens = host.tolist()
            keep = [i for i, r in enumerate(step.requests) if not r.finished]
            if len(keep) < len(step.requests):
                step = decode_batch([step.requests[i] for i in keep])
                tokens = [tokens[i] for i in keep]
            if step.requests:
                record(step, tokens)
                recorded += len(tokens)
            return any(r.finished for r in step.requests)

        for t in range(num):
            logits = graph.replay()
            tokens = sample_tokens(logits[:b], params, generator)
            if self.world_size > 1:
                dist.broadcast(tokens, src=0)
            if on_cuda:
                host, event = hosts[t % 2], events[t % 2]
                host.copy_(tokens, non_blocking=True)
                event.record()
            else:
                host, event = tokens, None
            inflight.append((batch, host, event))
            steps += 1
            if t + 1 < num:
                graph.advance(tokens)  # the next step's inputs, on the device
                computed = [c + 1 for c in batch.num_computed]
                batch = dataclasses.replace(bookkeeping, num_computed=computed)
                if sched.window_groups:
                    tables = sched.advance_windows(batch.requests, batch.num_computed)
                    graph.load_window_tables(tables)
            if len(inflight) > 1 and consume():
                break
        while inflight:
            consume()
        return steps, recorded

    def _step(
        self, batch: StepBatch, params: SamplingParams, generator: torch.Generator, first: bool
    ) -> list[int]:
        """Run one step on this rank; return the sampled ids of ``batch.sample_requests``."""
        meta = build_step_metadata(
            self.runtime,
            batch.num_new,
            batch.num_computed,
            block_table=batch.block_table,
            window_block_tables=batch.window_block_tables,
            block_size=self.block_size,
            cache_rows=[r.admitted_row for r in batch.requests],
            device=self.device,
            # Ranks given the same prompts schedule the same steps (the sampled ids are
            # broadcast): compare the batch across ranks once per call, not at every step.
            check_consistency=first,
        )
        # [1, T] ids and positions: one row of local tokens (fresh tensors, not views).
        ids = batch.input_ids.to(self.device, non_blocking=True)[None].index_select(
            1, meta.token_indices
        )
        positions = meta.positions[None].clone()
        forward = self._decode_fn if meta.all_decode else self._prefill_fn
        with cp_step(meta):
            hidden = forward(ids, positions)[0]
        if not batch.sample_requests:
            return []
        rows = batch.sample_rows.to(self.device, non_blocking=True)
        logits = self.compute_logits(_gather_rows(hidden, meta, rows)).float()
        tokens = sample_tokens(logits, params, generator)
        if self.world_size > 1:
            # Every rank holds the same logits and generator state; the broadcast makes the
            # choice identical even if a reduction order ever made logits differ in a last bit.
            dist.broadcast(tokens, src=0)
        return tokens.tolist()
