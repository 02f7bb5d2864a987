"""Whole gradients of a context-parallel forward, to compare with one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["full_input_grads", "full_param_grads"]


def full_input_grads(saved, pcp_group=None) -> torch.Tensor:
    """The gradient of every step's whole input ``[N, C]`` (fp32, CPU), steps concatenated.

    Args:
        saved: per step ``(_, _, x_local, meta)``: this rank's local input (its ``.grad`` set)
            and the step metadata whose ``token_indices`` place its rows.
        pcp_group: the PCP process group whose ranks' parts are summed, or None.
    """
    grads = []
    for _, _, x_local, meta in saved:
        full = torch.zeros((meta.num_tokens, x_local.shape[1]), dtype=torch.float32,
                           device=x_local.device)  # fmt: skip
        full.index_add_(0, meta.token_indices, x_local.grad.float())
        if pcp_group is not None:
            dist.all_reduce(full, group=pcp_group)
        grads.append(full.cpu())
    return torch.cat(grads)


def full_param_grads(module: nn.Module, pcp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (DTensors gathered; fp32, CPU), summed over
    ``pcp_group`` when given (each PCP rank's gradient covers its own tokens' loss)."""
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        g = g.detach().float().clone()
        if pcp_group is not None:
            dist.all_reduce(g, group=pcp_group)
        out[name] = g.cpu()
    return out
