"""Dense single-process oracle for PCP prefill attention tests.

Shape letters: N = the batch's new tokens, C = cached-prefix tokens, Hq / Hkv = query / KV
heads, Dqk / Dv = head dims.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["dense_prefill_attention"]


def dense_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_scheduled_tokens: Sequence[int],
    *,
    scale: float,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    prefix_lens: Sequence[int] | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every request's new tokens over (its cached prefix + new tokens).

    Plain PyTorch, one request at a time, differentiable; the [n, C + n] score matrix of each
    request is materialized.

    Args:
        q: [N, Hq, Dqk]; k: [N, Hkv, Dqk]; v: [N, Hkv, Dv] new tokens, request after request.
        num_scheduled_tokens: new tokens per request.
        scale: softmax scale.
        prefix_k: [C, Hkv, Dqk], prefix_v: [C, Hkv, Dv] cached tokens, request after request,
            ``prefix_lens`` of each (all three or none).
        upcast: compute in fp32 (fp64 stays fp64); otherwise in the inputs' dtype.

    Returns:
        out [N, Hq, Dv] in q's dtype, lse [N, Hq] fp32 (fp64 for fp64 inputs).
    """
    dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    start = pstart = 0
    for i, n in enumerate(num_scheduled_tokens):
        c = 0 if prefix_lens is None else prefix_lens[i]
        keys, values = k[start : start + n], v[start : start + n]
        if c:
            assert prefix_k is not None and prefix_v is not None
            keys = torch.cat([prefix_k[pstart : pstart + c], keys])
            values = torch.cat([prefix_v[pstart : pstart + c], values])
        qi = q[start : start + n].to(dtype)
        keys = keys.to(dtype).repeat_interleave(group, dim=1)
        values = values.to(dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,mhd->hnm", qi, keys) * scale
        visible = torch.arange(c + n)[None, :] <= c + torch.arange(n)[:, None]
        s = s.masked_fill(~visible.to(s.device), float("-inf"))
        lse = torch.logsumexp(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1)
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hnm,mhd->nhd", p, values).to(q.dtype))
        lses.append(lse.transpose(0, 1))
        start += n
        pstart += c
    return torch.cat(outs), torch.cat(lses)
