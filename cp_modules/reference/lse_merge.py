"""Pure-PyTorch oracles of the LSE merge family (:mod:`cp_modules.kernels.merge`).

Shape legend:
    N: partial results (KV shards, ranks or blocks)    B / L: tokens    H: heads
    D: value head dim    K: head blocks of a corrected output

For every (token, head) with partial outputs ``o_n`` and log-sum-exps ``l_n`` of disjoint key
sets, the attention over the union is ``sum_n w_n * o_n`` with ``w_n = exp(l_n - m) / S``,
``m = max_n l_n``, ``S = sum_n exp(l_n - m)``, and its LSE is ``m + log S``. An LSE that is
NaN or +inf marks an empty shard: it counts as -inf, so its weight is exactly 0 and its output
(often NaN for an empty softmax) is ignored. A row whose shards are all empty gives 0 and an
LSE of -inf. The arithmetic is fp32 (fp64 for the fp64 partials of :func:`merge_partials_reference`).

* :func:`lse_weights_reference`: the weights and the merged LSE alone;
* :func:`lse_combine_reference`: the full combine of stacked partials (``cp::lse_combine``);
* :func:`correct_attn_out_reference`: one rank's partial scaled by its weight, for a sum over
  ranks (``cp::correct_attn_out``);
* :func:`merge_partials_reference`: the merge of a list of partials lying anywhere (PCP
  blocks; dtype-generic, so the fp64 oracle of the PCP paths stays exact).
"""

from __future__ import annotations

import torch

from cp_modules.reference.pcp_attention import lse_dtype

__all__ = [
    "correct_attn_out_reference",
    "lse_combine_reference",
    "lse_weights_reference",
    "merge_partials_reference",
]


def lse_weights_reference(
    partial_lse: torch.Tensor, *, base2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised combine weights and the combined LSE of stacked partial LSEs.

    Args:
        partial_lse: ``[N, ...]`` LSEs (any float dtype; computed in fp32).
        base2: the LSEs are base 2 (``log2 sum 2^x``) instead of natural.

    Returns:
        ``weights [N, ...]`` fp32 (0 for empty shards, all 0 for all-empty rows) and
        ``lse [...]`` fp32 in the same base (-inf for all-empty rows).
    """
    lse = partial_lse.float()
    neg_inf = torch.full_like(lse, float("-inf"))
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), neg_inf, lse)
    m = lse.amax(dim=0)
    # All shards empty: subtract 0 so that exp(-inf - m) stays 0 instead of NaN.
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp2(lse - m) if base2 else torch.exp(lse - m)
    s = e.sum(dim=0)
    nonempty = s > 0
    s_safe = torch.where(nonempty, s, torch.ones_like(s))
    weights = e / s_safe
    log_s = torch.log2(s_safe) if base2 else torch.log(s_safe)
    out_lse = torch.where(nonempty, m + log_s, torch.full_like(m, float("-inf")))
    return weights, out_lse


def lse_combine_reference(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, *, base2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine ``N`` partial attention results into one, exactly (fp32 math).

    Args:
        partial_out: ``[N, B, H, D]`` partial outputs (fp16, bf16 or fp32; any strides).
        partial_lse: ``[N, B, H]`` partial LSEs (fp32).
        base2: the LSEs are base 2.

    Returns:
        ``out [B, H, D]`` in ``partial_out.dtype`` and ``lse [B, H]`` fp32.
    """
    weights, lse = lse_weights_reference(partial_lse, base2=base2)
    w = weights.unsqueeze(-1)
    # where(), not a plain product: an empty shard's output may be NaN and 0 * NaN is NaN.
    terms = torch.where(w > 0, partial_out.float() * w, torch.zeros_like(w))
    return terms.sum(dim=0).to(partial_out.dtype), lse


def correct_attn_out_reference(
    out: torch.Tensor,
    all_lse: torch.Tensor,
    rank: int,
    *,
    num_blocks: int = 1,
    base2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale this rank's partial output by its LSE weight among all ranks.

    Args:
        out: ``[B, H, D]`` this rank's partial output (fp16, bf16 or fp32).
        all_lse: ``[N, B, H]`` fp32 LSEs of every rank (this rank's at index ``rank``).
        rank: index of this rank in ``all_lse``.
        num_blocks: ``K``; the result is laid out head-block-major so that a reduce-scatter
            over ``K`` ranks can send block ``k`` to rank ``k`` without a copy.
        base2: the LSEs are base 2.

    Returns:
        ``corrected [K, B, H/K, D]`` in ``out.dtype`` (fp32 math, one rounding) and the
        combined ``lse [B, H]`` fp32.
    """
    weights, lse = lse_weights_reference(all_lse, base2=base2)
    w = weights[rank].unsqueeze(-1)
    corrected = torch.where(w > 0, out.float() * w, torch.zeros_like(w)).to(out.dtype)
    b, h, d = out.shape
    corrected = corrected.view(b, num_blocks, h // num_blocks, d).transpose(0, 1).contiguous()
    return corrected, lse


def merge_partials_reference(
    outs: list[torch.Tensor], lses: list[torch.Tensor], out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE-weighted merge of partial attentions of the same queries over disjoint keys.

    The math of the module docstring in ``lse_dtype(out_dtype)`` (fp64 stays fp64), the
    weights applied before the normalisation (as the in-place Triton merge does).

    Args:
        outs: N tensors [L, H, D]; lses: N tensors [L, H] (any strides).
        out_dtype: dtype of the merged output.

    Returns:
        out [L, H, D] in ``out_dtype``, lse [L, H] in ``lse_dtype(out_dtype)``.
    """
    acc_dtype = lse_dtype(out_dtype)
    if len(outs) == 1:
        return outs[0].to(out_dtype), lses[0].to(acc_dtype)
    lse = torch.stack([x.to(acc_dtype) for x in lses])
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)
    m = lse.amax(0)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    total = w.sum(0)
    nonempty = total > 0
    safe = torch.where(nonempty, total, torch.ones_like(total))
    acc = sum(
        torch.where(wi[..., None] > 0, wi[..., None] * o.to(acc_dtype), 0.0)
        for wi, o in zip(w, outs)
    )
    out_lse = torch.where(nonempty, m + torch.log(safe), float("-inf"))
    return (acc / safe[..., None]).to(out_dtype), out_lse
