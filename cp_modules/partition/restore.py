"""All-gather a per-token tensor over the PCP group and put it back in the batch's order.

Shape letters: T = this rank's local tokens (padding included), N = the batch's new tokens,
P = PCP size, ``...`` = any trailing dims (K/V heads and head dim, the MLA latent, hidden).
"""

from __future__ import annotations

import torch

from cp_modules.distributed.collectives import all_gather_autograd
from cp_modules.partition.plan import PCPPlan

__all__ = ["pcp_gather_restore"]


def pcp_gather_restore(
    x_local: torch.Tensor, plan: PCPPlan, group_name: str, pcp_size: int
) -> torch.Tensor:
    """All-gather ``x_local`` over the PCP group, restore request order and drop padding.

    The same call restores K/V (or the MLA latent and rope key) before attention and the KV
    cache write, and hidden states before the LM head. It is differentiable: the gradient is
    scattered back to the gathered order (padding and decode replicas other than rank 0's get
    zero) and reduce-scattered, so each rank receives the sum over ranks for its own tokens.

    Args:
        x_local: [T, ...] this rank's rows, in ``plan.token_indices`` order.
        plan: this rank's :class:`PCPPlan` (its ``gather_index`` on ``x_local``'s device).
        group_name: name of the PCP process group.
        pcp_size: size of that group (must equal ``plan.pcp_size``).

    Returns:
        [N, ...] the rows of every rank's tokens in the batch's original order.

    Raises:
        ValueError: if ``pcp_size`` differs from the plan's or ``x_local`` does not have the
            plan's T rows (checked before the collective, so no rank waits on a bad shape).
    """
    if pcp_size != plan.pcp_size:
        raise ValueError(f"pcp_size={pcp_size} must equal the plan's pcp_size={plan.pcp_size}")
    if x_local.dim() < 1 or x_local.shape[0] != plan.token_indices.shape[0]:
        raise ValueError(
            f"x_local must have the plan's {plan.token_indices.shape[0]} local tokens in dim 0, "
            f"got shape {tuple(x_local.shape)}"
        )
    gathered = all_gather_autograd(x_local, group_name, pcp_size)
    return gathered.index_select(0, plan.gather_index)
