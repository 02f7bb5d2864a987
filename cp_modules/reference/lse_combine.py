"""Pure-PyTorch oracle of the LSE-weighted combine of partial attention outputs.

Shape legend:
    N: partial results (KV shards)    B: tokens    H: heads    D: value head dim

For every (token, head) with partial outputs ``o_n`` and log-sum-exps ``l_n`` of disjoint key
sets, the attention over the union is ``sum_n w_n * o_n`` with ``w_n = exp(l_n - m) / S``,
``m = max_n l_n``, ``S = sum_n exp(l_n - m)``, and its LSE is ``m + log S``. An LSE that is
NaN or +inf marks an empty shard: it counts as -inf, so its weight is exactly 0 and its output
(often NaN for an empty softmax) is ignored. A row whose shards are all empty gives 0 and an
LSE of -inf. All arithmetic is fp32; the output is cast back to the input dtype.
"""

from __future__ import annotations

import torch

__all__ = ["lse_combine_reference", "lse_weights_reference"]


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
