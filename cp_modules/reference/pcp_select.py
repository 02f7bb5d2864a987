"""Pure-PyTorch oracle of the fused PCP head/tail select.

Shape letters: T = local queries, N = restored new tokens, Hq / Hkv = heads, Dqk / Dv = head
dims, Lh / Lt = real head / tail queries of the batch, Mh / Mt = keys they attend (all
requests packed one after another, see ``PCPPlan.q_head_index`` ...).
"""

from __future__ import annotations

import torch

__all__ = ["pcp_select_reference"]


def pcp_select_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_head_index: torch.Tensor,
    q_tail_index: torch.Tensor,
    k_head_index: torch.Tensor,
    k_tail_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack the head and tail queries and the keys/values each attends, request by request.

    Args:
        q: [T, Hq, Dqk]; k: [N, Hkv, Dqk]; v: [N, Hkv, Dv].
        q_head_index: [Lh], q_tail_index: [Lt] int64 rows of q.
        k_head_index: [Mh], k_tail_index: [Mt] int64 rows of k and v.

    Returns:
        q_head [Lh, Hq, Dqk], q_tail [Lt, Hq, Dqk], k_head [Mh, Hkv, Dqk], v_head [Mh, Hkv, Dv],
        k_tail [Mt, Hkv, Dqk], v_tail [Mt, Hkv, Dv].
    """
    return (
        q.index_select(0, q_head_index),
        q.index_select(0, q_tail_index),
        k.index_select(0, k_head_index),
        v.index_select(0, k_head_index),
        k.index_select(0, k_tail_index),
        v.index_select(0, k_tail_index),
    )
