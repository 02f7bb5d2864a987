"""Pure-PyTorch oracle of the LSE correction used by the ``ag_rs`` DCP combine.

Shape legend:
    N: DCP ranks    B: tokens    H: heads (all gathered heads)    D: value head dim
    K: head blocks of the output (the reduce-scatter's world size, or 1)

After the LSEs of every rank are all-gathered, each rank scales its own partial output by its
combine weight ``w_rank = exp(l_rank - m) / sum_n exp(l_n - m)`` (see
:mod:`cp_modules.reference.lse_combine`); summing the corrected outputs over the ranks (a
reduce-scatter or an all-reduce) then gives the exact attention over the whole KV sequence.
"""

from __future__ import annotations

import torch

from cp_modules.reference.lse_combine import lse_weights_reference

__all__ = ["correct_attn_out_reference"]


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
