"""Sampling parameters and next-token selection (greedy, or seeded temperature / top-k / top-p).

Shapes: logits [B, V] (fp32), tokens [B] (int64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "accept_greedy", "sample_tokens", "token_probs"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Args:
        max_new_tokens: tokens generated per request at most (>= 1).
        temperature: 0 picks the most likely token (greedy); > 0 samples from
            ``softmax(logits / temperature)``.
        top_k: sample among the k most likely tokens only (0: all).
        top_p: sample among the smallest set of tokens whose probability reaches ``top_p``
            (1.0: all).
        seed: seed of the sampling generator (the same on every rank).
        eos_token_id: stop a request after it generates one of these ids (kept in the output,
            as HF ``generate`` does); None: the model's ``generation_config.eos_token_id``
            (the engine's default).
        ignore_eos: with ``eos_token_id=None``, no stop token at all (run to
            ``max_new_tokens``).
        speculative: None (one token per decode step), ``"ngram"`` (prompt-lookup drafts
            from each request's own tokens) or a
            :class:`~cp_modules.engine.speculative.Drafter` (e.g. a
            :class:`~cp_modules.engine.speculative.DraftModelDrafter`): each decode step
            verifies up to ``num_speculative_tokens`` drafted tokens per request in one step
            (:mod:`cp_modules.engine.speculative`).
        num_speculative_tokens: k, drafted tokens per request and step (>= 1 with
            ``speculative``).
        speculative_min_accepted: back off from speculation while it does not pay: when the
            last two verification steps kept fewer drafts than this per request on average,
            the next decode steps run without drafts (8, doubling while speculation keeps
            failing, up to 256; reset once a probe pays). Default 0.25: on the H200 a
            verification step of k = 4 costs ~1.2 plain steps (Llama-3-8B shape, 16 requests),
            so it pays from ~0.2 kept drafts a request. 0: always verify.

    Raises:
        ValueError: for a parameter out of its range.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: int | Sequence[int] | None = None
    ignore_eos: bool = False
    speculative: object = None
    num_speculative_tokens: int = 0
    speculative_min_accepted: float = 0.25

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k filter), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no top-p filter), got {self.top_p}")
        eos = self.eos_token_id
        ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(
                f"eos_token_id must be None, an id >= 0 or a list of them, got {eos!r}"
            )
        object.__setattr__(self, "eos_token_id", ids or None)
        k = self.num_speculative_tokens
        if self.speculative is not None:
            if isinstance(self.speculative, str) and self.speculative != "ngram":
                raise ValueError(
                    f"speculative must be None, 'ngram' or a Drafter, got {self.speculative!r}"
                )
            if not isinstance(self.speculative, str) and not hasattr(self.speculative, "propose"):
                raise ValueError(
                    f"speculative must be None, 'ngram' or a Drafter (with propose()), got "
                    f"{type(self.speculative).__name__}"
                )
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(
                    f"num_speculative_tokens must be an integer >= 1 with speculative="
                    f"{self.speculative!r}, got {k!r}"
                )
        m = self.speculative_min_accepted
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < math.inf:
            raise ValueError(
                "speculative_min_accepted must be a finite number >= 0 (drafts kept per "
                f"request and verification step; 0: always verify), got {m!r}"
            )
        if self.speculative is None and k:
            raise ValueError(
                f"num_speculative_tokens={k!r} needs a drafter: set speculative='ngram' (or a "
                "Drafter), or leave num_speculative_tokens at 0"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_ids(self) -> frozenset[int]:
        eos = self.eos_token_id  # a tuple of ids or None after __post_init__
        if eos is None:
            return frozenset()
        return frozenset((eos,) if isinstance(eos, int) else eos)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token of each row: ``logits [B, V] -> tokens [B]`` (int64, on the logits' device).

    Greedy is ``argmax`` (ties to the lowest id, as HF ``generate``); sampling draws with
    ``generator`` so that ranks holding the same logits and seed draw the same tokens.
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = token_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample_tokens` samples from (temperature, top-k, top-p):
    ``logits [B, V] -> probs [B, V]`` (fp32). Greedy: one-hot at the argmax."""
    if params.greedy:
        ids = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, ids, 1.0)
    scores = logits.float() / params.temperature
    if params.top_k:
        k = min(params.top_k, scores.shape[-1])
        kth = scores.topk(k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Keep a token while the mass before it is below top_p (the first one always stays).
        drop_sorted = (cum - sorted_scores.softmax(dim=-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def accept_greedy(
    logits: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, query_len: int
) -> torch.Tensor:
    """Greedy acceptance of a verification step on the device (no host sync, graph-capturable).

    ``logits [B * Q, V]`` of ``B`` rows of ``Q = query_len`` query tokens; ``ids``,
    ``positions [B * Q]``: a row's last token, then its drafts, then unused tokens (position
    -1). A draft is kept while it equals the argmax of the row before it. Returns int64
    ``[B, 1 + Q]``: per row the number ``a`` of kept drafts, then the argmax of each query
    row; the verified tokens are the first ``a`` drafts and the argmax of query ``a`` (what
    :func:`~cp_modules.engine.speculative.accept_drafts` returns). A few small kernels.
    """
    b, q = ids.shape[0] // query_len, query_len
    target = logits.argmax(dim=-1).view(b, q)
    miss = (ids.view(b, q)[:, 1:] != target[:, :-1]) | (positions.view(b, q)[:, 1:] < 0)
    # The first miss (a last column that always misses ends a row that keeps every draft).
    kept = torch.cat([miss, miss.new_ones(b, 1)], dim=1).to(torch.uint8).argmax(dim=1)
    return torch.cat([kept[:, None], target], dim=1)
