"""The rows of a step's hidden states that the LM head reads, gathered over PCP.

Shapes: T = this rank's local tokens, S = rows gathered, H = hidden size.
"""

from __future__ import annotations

import torch

from cp_modules.distributed.collectives import all_gather
from cp_modules.step import CPStepMetadata

__all__ = ["gather_rows"]


def gather_rows(hidden: torch.Tensor, meta: CPStepMetadata, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (batch order) of the step's hidden states: ``[T, H] -> [S, H]``.

    What ``restore_tokens(hidden, meta)[rows]`` returns, but each PCP rank contributes only S
    rows to the all-gather instead of its T: a long prompt's hidden states stay where they are.
    """
    rt = meta.runtime
    src = meta.plan.gather_index.index_select(0, rows)  # position in the all-gathered [P*T]
    if rt.pcp_size == 1:
        return hidden.index_select(0, src)
    t, s = hidden.shape[0], rows.shape[0]
    # Every rank sends the local rows at the owners' offsets; only the owner's copy is kept.
    picked = all_gather(hidden.index_select(0, src % t), rt.pcp_group, rt.pcp_size)  # [P*S, H]
    return picked.index_select(0, src // t * s + torch.arange(s, device=src.device))
