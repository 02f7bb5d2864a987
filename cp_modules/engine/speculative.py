"""Speculative decoding: drafted tokens verified in one step against the DCP-sharded cache.

A verification step of decoding requests feeds each request its last token and ``n <= k``
drafted tokens (``n + 1`` query tokens at positions ``c .. c + n``) as one *decode* of
``n + 1`` tokens (the step metadata's ``decode_threshold = k + 1``): the tokens are
replicated over PCP, written into the paged cache on their DCP shard, and every query
attends the sharded cache up to its own position (``dcp_query_kv_len`` per token), so the
drafts see each other causally through the cache. The LM head runs on every query row: row
``i`` gives the target's distribution of the token after draft ``i``.

Acceptance (:func:`accept_drafts`): greedy keeps the drafts that equal the target's argmax
and appends the target's argmax after the last kept one, so the output is the plain greedy
output. Sampling uses the rejection rule of speculative sampling (Leviathan et al. 2023,
Chen et al. 2023): draft ``d_i`` (drawn from the drafter's ``q_i``) is kept with probability
``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection a token is drawn from
``normalize(max(0, p_i - q_i))``; when all are kept a bonus token is drawn from ``p_n``. The
output then has the target's distribution ``p`` (temperature, top-k, top-p applied). An
n-gram drafter is deterministic: its ``q`` is one-hot, and the rule keeps ``d_i`` with
probability ``p_i(d_i)`` and resamples from ``p_i`` with ``d_i`` removed.

Rollback: a request keeps its last token and its accepted drafts in the cache
(``num_computed`` moves on by the tokens emitted); the rejected drafts' slots stay written
but lie past every later query's ``kv_len`` until they are overwritten. The full layers'
block-table rows hold the request's whole lifetime from its admission (drafts are capped so
that no position passes ``prompt + max_new_tokens``), and sliding-window groups return the
blocks only the rejected drafts used (:meth:`WindowBlockGroup.rollback`).

The engine runs the steps (in runs on a verification graph, greedy acceptance on the
device): :mod:`cp_modules.engine.verification`.

Drafters (:class:`Drafter`): :class:`NgramDrafter` (prompt lookup: the tokens that followed
the latest earlier occurrence of the request's last n-gram), :class:`DraftModelDrafter` (a
small HF causal LM with the target's vocabulary and its own KV cache per request), and
:class:`ReplayDrafter` (proposes given continuations: the benchmark's always-accepted and
always-rejected drafters).

Shapes: R = requests of the step, N = query tokens of the step (``sum(n_r + 1)``), V =
vocabulary, D = drafted tokens of the step (``sum(n_r)``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from cp_modules.engine.sampling import SamplingParams, token_probs
from cp_modules.engine.scheduler import Request

# The engine served (a :class:`~cp_modules.engine.engine.GenerationEngine`; not imported:
# engine.py imports this module).
GenerationEngine = Any

__all__ = [
    "DraftModelDrafter",
    "Drafter",
    "NgramDrafter",
    "ReplayDrafter",
    "SpeculativeStats",
    "accept_drafts",
]


class Drafter(Protocol):
    """Proposes draft tokens for decoding requests.

    ``propose(requests, num_tokens, params)`` returns, per request, at most ``num_tokens[i]``
    draft ids continuing ``requests[i].tokens``, and the drafter's distributions of them:
    None for a deterministic drafter (one-hot ``q``), else a list of ``[n_i, V]`` fp32
    probability tensors (``q`` of each draft, the distribution it was drawn from).
    ``check(engine)`` validates the drafter against the target engine (ValueError naming the
    option); ``begin()`` resets per-call state at the start of ``generate``.
    """

    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int], params: SamplingParams
    ) -> tuple[list[list[int]], list[torch.Tensor] | None]: ...

    def check(self, engine: GenerationEngine) -> None: ...

    def begin(self) -> None: ...


class NgramDrafter:
    """Prompt-lookup drafts: find the request's last ``n`` tokens (``max_ngram`` down to
    ``min_ngram``) earlier in its own tokens (prompt and output, the latest occurrence) and
    propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def check(self, engine: GenerationEngine) -> None:
        pass

    def begin(self) -> None:
        pass

    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int], params: SamplingParams
    ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        return [ngram_draft(r.tokens, k, self.max_ngram, self.min_ngram) for r, k in
                zip(requests, num_tokens)], None  # fmt: skip


def ngram_draft(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """At most ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` (``max_ngram`` down to ``min_ngram`` tokens long) that occurs earlier."""
    if k < 1:
        return []
    t = list(tokens)
    n_tok = len(t)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = t[n_tok - n :]
        # Latest start j < n_tok - n with t[j : j + n] == suffix.
        for j in range(n_tok - n - 1, -1, -1):
            if t[j : j + n] == suffix:
                return t[j + n : j + n + k]
    return []


class ReplayDrafter:
    """Proposes continuations known in advance: request ``i`` at ``L`` tokens gets
    ``sequences[i][L : L + k]`` (prompt and continuation). With the target's own greedy
    tokens every draft is accepted; ``offset`` adds ``offset`` (mod ``vocab_size``) to every
    proposed id, so with ``offset != 0`` every greedy draft is rejected. For benchmarks and
    tests."""

    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int, offset: int = 0):
        self.sequences = [list(s) for s in sequences]
        self.vocab_size, self.offset = vocab_size, offset

    def check(self, engine: GenerationEngine) -> None:
        pass

    def begin(self) -> None:
        pass

    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int], params: SamplingParams
    ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        out = []
        for r, k in zip(requests, num_tokens):
            n = len(r.prompt) + len(r.output)
            seq = self.sequences[r.index][n : n + max(k, 0)]
            out.append([(t + self.offset) % self.vocab_size for t in seq])
        return out, None


class DraftModelDrafter:
    """Drafts with a small HF causal LM that shares the target's vocabulary (its original
    attention, one process; each rank runs the same draft, rank 0's drafts are broadcast):
    ``k`` tokens per step, one forward each, on a KV cache of its own per request (a
    ``DynamicCache``, cropped to the tokens the target kept). Greedy targets get the draft's
    argmax; sampling targets get tokens drawn from the draft's distribution under the same
    temperature / top-k / top-p (its ``q``), with a generator seeded from ``seed``."""

    def __init__(self, model: nn.Module, *, seed: int = 0) -> None:
        self.model = model
        self.seed = seed
        self._state: dict[int, tuple[Any, list[int]]] = {}
        self._generator: torch.Generator | None = None
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def vocab_size(self) -> int:
        config: Any = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(config.vocab_size)

    def check(self, engine: GenerationEngine) -> None:
        if self.vocab_size != engine.vocab_size:
            raise ValueError(
                f"speculative: the draft model's vocab_size={self.vocab_size} differs from the "
                f"target's vocab_size={engine.vocab_size}: a draft model must share the "
                "target's vocabulary (tokenizer)"
            )
        if hasattr(self.model, "cp_groups") or any(
            hasattr(m, "cp_binding") for m in self.model.modules()
        ):
            raise ValueError(
                "speculative: the draft model's attention was swapped to cp modules; pass the "
                "model with its original attention (it runs on each rank on its own)"
            )

    def begin(self) -> None:
        self._state.clear()
        dev = next(self.model.parameters()).device
        self._generator = torch.Generator(device=dev).manual_seed(self.seed)

    @torch.no_grad()
    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int], params: SamplingParams
    ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        from transformers import DynamicCache

        if self._generator is None:
            self.begin()
        dev = next(self.model.parameters()).device
        drafts: list[list[int]] = []
        probs: list[torch.Tensor] = []
        for r, k in zip(requests, num_tokens):
            tokens = r.tokens
            cache, fed = self._state.get(r.index, (None, []))
            common = 0
            for a, b in zip(fed, tokens):
                if a != b:
                    break
                common += 1
            common = min(common, len(tokens) - 1)  # one token to feed at least
            if cache is None or common == 0:
                cache, common = DynamicCache(), 0
            elif cache.get_seq_length() > common:
                cache.crop(common - cache.get_seq_length())  # drop the tokens past ``common``
            fed = tokens[:common]
            draft: list[int] = []
            qs: list[torch.Tensor] = []
            feed = tokens[common:]
            for _ in range(k):
                ids = torch.tensor([feed], device=dev)
                pos = torch.arange(len(fed), len(fed) + len(feed), device=dev)[None]
                out = self.model(input_ids=ids, position_ids=pos, use_cache=True,
                                 **{self._cache_kw: cache})  # fmt: skip
                fed = fed + feed
                logits = out.logits[0, -1:].float()
                q = token_probs(logits, params)
                if params.greedy:
                    t = int(logits.argmax(-1))
                else:
                    t = int(torch.multinomial(q, 1, generator=self._generator))
                draft.append(t)
                qs.append(q[0])
                feed = [t]
            self._state[r.index] = (cache, fed)
            drafts.append(draft)
            v = self.vocab_size
            probs.append(torch.stack(qs) if qs else torch.zeros(0, v, device=dev))
        return drafts, (None if params.greedy else probs)


def make_drafter(spec) -> Drafter:
    """The drafter of ``SamplingParams.speculative``."""
    return NgramDrafter() if spec == "ngram" else spec


@dataclass
class SpeculativeStats:
    """Counts and timings of the verification steps of one ``generate`` call."""

    steps: int = 0  # verification steps
    rows: int = 0  # request verifications (a step verifies every decoding request)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens the verification steps produced (accepted + one per row)
    draft_s: float = 0.0
    verify_s: float = 0.0
    wait_s: float = 0.0  # of verify_s: the host waiting for a graph step's verified tokens


def accept_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor] | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The verified tokens of each request: its accepted drafts and one token of the target.

    ``logits [N, V]`` (fp32): the target's logits of every query row, request after request,
    ``len(drafts[i]) + 1`` rows each (row j: the distribution after the request's last token
    and its first j drafts). ``draft_probs``: None (one-hot ``q``: a deterministic drafter)
    or ``[n_i, V]`` per request.
    """
    counts = [len(d) for d in drafts]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n + 1)
    assert logits.shape[0] == offsets[-1], (tuple(logits.shape), counts)
    dev = logits.device
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            o, a = offsets[i], 0
            while a < len(d) and d[a] == target[o + a]:
                a += 1
            out.append(list(d[:a]) + [target[o + a]])
        return out
    p = token_probs(logits, params)  # [N, V]
    draft_rows = torch.tensor(
        [offsets[i] + j for i, n in enumerate(counts) for j in range(n)], dtype=torch.long
    ).to(dev)
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long).to(dev)
    q = None
    if draft_probs is not None:
        q = torch.cat([qq.to(dev, torch.float32) for qq in draft_probs]) if flat.numel() else None
    keep: list[bool] = []
    if flat.numel():
        p_d = p.index_select(0, draft_rows).gather(1, flat[:, None])[:, 0]  # [D]
        q_d = q.gather(1, flat[:, None])[:, 0] if q is not None else torch.ones_like(p_d)
        u = torch.rand(flat.shape[0], generator=generator, device=dev)
        # Keep with probability min(1, p / q): u < p / q, i.e. u * q < p (q > 0: d ~ q).
        keep = (u * q_d < p_d).tolist()
    # Per request: accepted count, and the distribution of the token after them.
    accepted, rows, residual = [], [], []
    k0 = 0
    for i, n in enumerate(counts):
        a = 0
        while a < n and keep[k0 + a]:
            a += 1
        accepted.append(a)
        rows.append(offsets[i] + a)
        residual.append(a < n)
        k0 += n
    dist_rows = p.index_select(0, torch.tensor(rows, dtype=torch.long).to(dev))  # [R, V]
    rej = [i for i, r in enumerate(residual) if r]
    if rej:
        # Rejected at draft a: normalize(max(0, p_a - q_a)).
        starts = [sum(counts[:i]) for i in range(len(counts))]
        idx = torch.tensor([starts[i] + accepted[i] for i in rej], dtype=torch.long).to(dev)
        if q is not None:
            q_rows = q.index_select(0, idx)
        else:
            q_rows = torch.zeros(len(rej), p.shape[1], device=dev)
            q_rows.scatter_(1, flat.index_select(0, idx)[:, None], 1.0)
        sel = torch.tensor(rej, dtype=torch.long).to(dev)
        res = (dist_rows.index_select(0, sel) - q_rows).clamp_min(0)
        mass = res.sum(-1, keepdim=True)
        # p == q on every token (no rejection is possible then) would leave nothing: keep p.
        res = torch.where(mass > 0, res / mass.clamp_min(1e-30), dist_rows.index_select(0, sel))
        dist_rows = dist_rows.index_copy(0, sel, res)
    last = torch.multinomial(dist_rows, 1, generator=generator)[:, 0].tolist()
    return [list(d[:a]) + [t] for d, a, t in zip(drafts, accepted, last)]


def draft_counts(requests: Sequence[Request], k: int, max_num_tokens: int) -> list[int]:
    """Drafts per request: at most ``k``, no position past the request's last
    (``prompt + max_new_tokens - 1``: the last emitted token is never cached), and at most
    ``max_num_tokens`` query tokens in the step (shared evenly)."""
    share = max(max_num_tokens // max(len(requests), 1) - 1, 0)
    return [max(0, min(k, r.max_new_tokens - len(r.output) - 1, share)) for r in requests]


def _broadcast_drafts(drafts: list[list[int]], k: int, device) -> list[list[int]]:
    # Rank 0's drafts on every rank (the step's batch must be the same everywhere).
    buf = torch.full((len(drafts), k + 1), -1, dtype=torch.long)
    for i, d in enumerate(drafts):
        buf[i, 0] = len(d)
        buf[i, 1 : 1 + len(d)] = torch.tensor(d, dtype=torch.long)
    buf = buf.to(device)
    dist.broadcast(buf, src=0)
    rows = buf.cpu().tolist()
    return [row[1 : 1 + row[0]] for row in rows]


def _broadcast_tokens(tokens: list[list[int]], k: int, device) -> list[list[int]]:
    return _broadcast_drafts(tokens, k + 1, device)
