"""Pure-PyTorch oracle of PCP head/tail prefill attention, forward and backward.

Shape letters: T = this rank's local queries (padding included), N = restored new tokens of the
batch, C = cached-prefix tokens of the batch, L / M = queries / keys of one block, Hq / Hkv =
query / key-value heads (Hq a multiple of Hkv), Dqk / Dv = query-key / value head dims,
S = segments (``cp_modules.partition.plan.SEGMENT_FIELDS``).

Every block is computed densely in fp32 (this is the CPU path and the test oracle, not a
memory-lean kernel). Causal masks are aligned at the bottom right: query ``i`` of ``L`` sees key
``j`` of ``M`` iff ``j <= i + M - L``. LSEs are natural-log, fp32. Queries outside every
segment (padding) get output 0 and LSE ``-inf``. LSEs are fp32 (fp64 for fp64 inputs, so that
the oracle can be made exact).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "PrefillInputs",
    "lse_dtype",
    "attention_with_lse",
    "attention_with_lse_backward",
    "pcp_prefill_attention_backward_reference",
    "pcp_prefill_attention_reference",
]


class PrefillInputs(NamedTuple):
    """What every PCP prefill attention path reads: this rank's queries, the restored new
    keys/values, the plan's segments, the cached prefixes and the softmax scale.

    Fields:
        q: [T, Hq, Dqk] local queries in ``token_indices`` order.
        k: [N, Hkv, Dqk], v: [N, Hkv, Dv] restored, unpadded new keys/values.
        segments: [S, 5] int64 host tensor (``SEGMENT_FIELDS``).
        prefix_k: [C, Hkv, Dqk], prefix_v: [C, Hkv, Dv] cached keys/values of the requests,
            ragged by ``prefix_cu_seqlens`` ([R + 1] int64, host), or all three None.
        scale: softmax scale.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    segments: torch.Tensor
    prefix_k: torch.Tensor | None
    prefix_v: torch.Tensor | None
    prefix_cu_seqlens: torch.Tensor | None
    scale: float


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of LSEs (and of the math) for inputs of ``dtype``: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _acc(x: torch.Tensor) -> torch.Tensor:
    # fp32 math for half types; fp64 inputs stay fp64 so the oracle can be made exact.
    return x.to(lse_dtype(x.dtype))


def _expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    # Query head h reads KV head h // (Hq / Hkv): adjacent query heads share a KV head.
    return x.repeat_interleave(num_q_heads // x.shape[1], dim=1)


def _fold_kv(dx: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    m, hq, d = dx.shape
    return dx.reshape(m, num_kv_heads, hq // num_kv_heads, d).sum(2)


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """[Hq, L, M] scaled scores (at least fp32), soft-capped, masked entries -inf.

    ``window`` W (bottom-right aligned like ``causal``): query ``i`` sees key ``j`` only if
    ``j > i + M - L - W`` (its W latest keys, itself included). ``softcap`` c: scores become
    ``c * tanh(scores / c)`` after scaling, before masking.
    """
    k = _expand_kv(_acc(k), q.shape[1])
    s = torch.einsum("lhd,mhd->hlm", _acc(q), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal or window:
        L, M = q.shape[0], k.shape[0]
        i = torch.arange(L, device=q.device)[:, None]
        j = torch.arange(M, device=q.device)[None, :]
        if causal:
            s = s.masked_fill(j > i + (M - L), float("-inf"))
        if window:
            s = s.masked_fill(j <= i + (M - L) - window, float("-inf"))
    return s


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block with its LSE (bottom-right causal if ``causal``).

    Args:
        q: [L, Hq, Dqk]; k: [M, Hkv, Dqk]; v: [M, Hkv, Dv] (M >= L when causal).
        scale: multiplier of ``q·k``.
        causal: mask keys after each query's position (bottom-right aligned).
        window, softcap: see :func:`_scores` (None: none).

    Returns:
        out [L, Hq, Dv] in q's dtype (0 for a query with no key), lse [L, Hq] fp32 or fp64
        (``-inf`` for a query with no key).
    """
    s = _scores(q, k, scale, causal, window, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.clamp_min(torch.finfo(lse.dtype).min)[..., None])
    out = torch.einsum("hlm,mhd->lhd", p, _expand_kv(_acc(v), q.shape[1]))
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def attention_with_lse_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* output and LSE of its queries (fp32).

    With ``out``/``lse`` of the whole attention (all blocks merged), the block's probabilities
    ``exp(s - lse)`` are its share of the global softmax, so the per-block gradients sum to the
    gradients of the merged attention: the flash-attention backward, block by block.

    Args:
        dout: [L, Hq, Dv]; q: [L, Hq, Dqk]; k: [M, Hkv, Dqk]; v: [M, Hkv, Dv];
        out: [L, Hq, Dv] final output; lse: [L, Hq] final LSE (fp32).

    Returns:
        dq [L, Hq, Dqk], dk [M, Hkv, Dqk], dv [M, Hkv, Dv], in fp32 (fp64 for fp64 inputs).
    """
    hkv = k.shape[1]
    s = _scores(q, k, scale, causal, window, softcap)
    lse_h = lse.to(s.dtype).transpose(0, 1)[..., None]
    p = torch.exp(s - lse_h.clamp_min(torch.finfo(s.dtype).min))
    do = _acc(dout)
    dv = torch.einsum("hlm,lhd->mhd", p, do)
    dp = torch.einsum("lhd,mhd->hlm", do, _expand_kv(_acc(v), q.shape[1]))
    delta = (do * _acc(out)).sum(-1).transpose(0, 1)[..., None]
    ds = p * (dp - delta) * scale
    if softcap:
        # d(c tanh(u / c)) / du = 1 - tanh^2 = 1 - (s / c)^2 (0 where masked: p is 0 there).
        ds = ds * (1 - (s.nan_to_num(neginf=0.0) / softcap) ** 2)
    dq = torch.einsum("hlm,mhd->lhd", ds, _expand_kv(_acc(k), q.shape[1]))
    dk = torch.einsum("hlm,lhd->mhd", ds, _acc(q))
    return dq, _fold_kv(dk, hkv), _fold_kv(dv, hkv)


def _segment_keys(
    seg: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    prefix_cu: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Keys/values one segment attends: its cached prefix then its new keys; prefix length."""
    req, _, _, k0, kl = seg
    keys, values = k[k0 : k0 + kl], v[k0 : k0 + kl]
    if prefix_k is None or prefix_cu is None:
        return keys, values, 0
    assert prefix_v is not None, "prefix_k without prefix_v"
    p0, p1 = prefix_cu[req], prefix_cu[req + 1]
    return torch.cat([prefix_k[p0:p1], keys]), torch.cat([prefix_v[p0:p1], values]), p1 - p0


def pcp_prefill_attention_reference(
    inputs: PrefillInputs,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head/tail attention of this rank's queries over the restored K/V (and cached prefixes).

    Args:
        inputs: the queries, keys, values, segments, prefixes and scale (:class:`PrefillInputs`).
        window: sliding window W (each query sees its W latest keys, itself included) or None.
        softcap: logit soft-cap c or None.

    Returns:
        out [T, Hq, Dv] in q's dtype, lse [T, Hq] in ``lse_dtype(q.dtype)``.
    """
    q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale = inputs
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_full((q.shape[0], q.shape[1]), float("-inf"), dtype=lse_dtype(q.dtype))
    prefix_cu = None if prefix_cu_seqlens is None else prefix_cu_seqlens.tolist()
    for seg in segments.tolist():
        q0, ql = seg[1], seg[2]
        if ql == 0:
            continue
        # The cached prefix precedes the new keys, so bottom-right alignment over the
        # concatenation already lets every query see its whole prefix.
        keys, values, _ = _segment_keys(seg, k, v, prefix_k, prefix_v, prefix_cu)
        s = _scores(q[q0 : q0 + ql], keys, scale, True, window, softcap)
        seg_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - seg_lse[..., None])
        o = torch.einsum("hlm,mhd->lhd", p, _expand_kv(_acc(values), q.shape[1]))
        out[q0 : q0 + ql] = o.to(out.dtype)
        lse[q0 : q0 + ql] = seg_lse.transpose(0, 1)
    return out, lse


def pcp_prefill_attention_backward_reference(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    inputs: PrefillInputs,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`pcp_prefill_attention_reference` from its output and LSE.

    Args:
        dout: [T, Hq, Dv] gradient of the output; out, lse: the forward's results; inputs,
            window, softcap: as in the forward.

    Returns:
        dq [T, Hq, Dqk], dk [N, Hkv, Dqk], dv [N, Hkv, Dv], dprefix_k [C, Hkv, Dqk] and
        dprefix_v [C, Hkv, Dv] (None without a prefix), each in its input's dtype.
    """
    q, k, v, segments, prefix_k, prefix_v, prefix_cu_seqlens, scale = inputs
    dq, dk, dv = (torch.zeros_like(_acc(x)) for x in (q, k, v))
    dpk: torch.Tensor | None = None
    dpv: torch.Tensor | None = None
    prefix_cu: list[int] | None = None
    if prefix_k is not None and prefix_cu_seqlens is not None:
        assert prefix_v is not None, "prefix_k without prefix_v"
        dpk, dpv = torch.zeros_like(_acc(prefix_k)), torch.zeros_like(_acc(prefix_v))
        prefix_cu = prefix_cu_seqlens.tolist()
    for seg in segments.tolist():
        req, q0, ql, k0, kl = seg
        if ql == 0:
            continue
        keys, values, num_prefix = _segment_keys(seg, k, v, prefix_k, prefix_v, prefix_cu)
        rows = slice(q0, q0 + ql)
        gq, gk, gv = attention_with_lse_backward(
            dout[rows],
            q[rows],
            keys,
            values,
            out[rows],
            lse[rows],
            scale=scale,
            causal=True,
            window=window,
            softcap=softcap,
        )
        dq[rows] += gq
        dk[k0 : k0 + kl] += gk[num_prefix:]
        dv[k0 : k0 + kl] += gv[num_prefix:]
        if num_prefix:
            assert dpk is not None and dpv is not None and prefix_cu is not None
            p0 = prefix_cu[req]
            dpk[p0 : p0 + num_prefix] += gk[:num_prefix]
            dpv[p0 : p0 + num_prefix] += gv[:num_prefix]
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        None if dpk is None or prefix_k is None else dpk.to(prefix_k.dtype),
        None if dpv is None or prefix_v is None else dpv.to(prefix_v.dtype),
    )
