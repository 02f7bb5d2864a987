"""Dense masked-softmax attention: the oracle for sliding windows, sinks and soft-capping.

Shape letters: N = tokens of one sequence (queries and keys alike), H / Hkv = query / KV
heads, D / Dv = head dims. Materialises the [H, N, N] scores: for tests only.

Semantics (transformers' conventions):
- causal: query i attends key j <= i; with a sliding window W also j > i - W (W keys);
- soft-cap c: scores <- c * tanh(scores / c) after scaling, before masking and softmax;
- sinks s_h: softmax over the masked scores and one extra logit per head, whose column is
  dropped: p_j = exp(x_j) / (sum_k exp(x_k) + exp(s_h)).
"""

from __future__ import annotations

import torch

__all__ = ["dense_attention"]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one sequence: (out [N, H, Dv], lse [N, H]), differentiable.

    The LSE is over the scores and, with ``sinks``, the sink logit too (``logaddexp``).
    """
    n, h = q.shape[0], q.shape[1]
    rep = h // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1)
    vv = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, kk) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed = allowed & (j > i - sliding_window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.to(scores.dtype)[:, None, None].expand(h, n, 1)
        scores = torch.cat([scores, col], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [H, N]
    p = torch.exp(scores - lse[..., None])
    if sinks is not None:
        p = p[..., :-1]
    out = torch.einsum("hij,jhd->ihd", p, vv)
    return out, lse.transpose(0, 1)
