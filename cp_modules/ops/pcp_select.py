"""``cp::pcp_select``: the fused PCP head/tail select as a differentiable op.

Shape letters: T = local queries, N = restored new tokens, Hq / Hkv = heads, Dqk / Dv = head
dims, Lh / Lt = packed head / tail queries, Mh / Mt = packed head / tail keys.

It packs what a varlen attention kernel needs for the head and for the tail chunks of every
request (queries and the key prefix each attends) in one pass. CPU runs the reference
(``index_select``); CUDA runs the Triton kernel. The backward scatters the gradients back.
"""

from __future__ import annotations

import torch

from cp_modules.kernels.pcp_select import pcp_select_triton
from cp_modules.ops._lib import lib
from cp_modules.partition.plan import PCPPlan
from cp_modules.reference.pcp_select import pcp_select_reference

__all__ = ["pcp_select"]

lib.define(
    "pcp_select(Tensor q, Tensor k, Tensor v, Tensor q_head_index, Tensor q_tail_index, "
    "Tensor k_head_index, Tensor k_tail_index) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.impl("cp::pcp_select", "CPU", lib=lib)
def _select_cpu(q, k, v, q_head_index, q_tail_index, k_head_index, k_tail_index):
    return pcp_select_reference(q, k, v, q_head_index, q_tail_index, k_head_index, k_tail_index)


@torch.library.impl("cp::pcp_select", "CUDA", lib=lib)
def _select_cuda(q, k, v, q_head_index, q_tail_index, k_head_index, k_tail_index):
    return pcp_select_triton(q, k, v, q_head_index, q_tail_index, k_head_index, k_tail_index)


@torch.library.register_fake("cp::pcp_select", lib=lib)
def _select_fake(q, k, v, q_head_index, q_tail_index, k_head_index, k_tail_index):
    return (
        q.new_empty((q_head_index.shape[0],) + q.shape[1:]),
        q.new_empty((q_tail_index.shape[0],) + q.shape[1:]),
        k.new_empty((k_head_index.shape[0],) + k.shape[1:]),
        v.new_empty((k_head_index.shape[0],) + v.shape[1:]),
        k.new_empty((k_tail_index.shape[0],) + k.shape[1:]),
        v.new_empty((k_tail_index.shape[0],) + v.shape[1:]),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, q_head_index, q_tail_index, k_head_index, k_tail_index = inputs
    ctx.shapes = (q.shape, k.shape, v.shape)
    ctx.save_for_backward(q_head_index, q_tail_index, k_head_index, k_tail_index)


def _backward(ctx, dq_head, dq_tail, dk_head, dv_head, dk_tail, dv_tail):
    q_head_index, q_tail_index, k_head_index, k_tail_index = ctx.saved_tensors
    q_shape, k_shape, v_shape = ctx.shapes
    dq = dq_head.new_zeros(q_shape).index_add(0, q_head_index, dq_head)
    dq = dq.index_add(0, q_tail_index, dq_tail)
    dk = dk_head.new_zeros(k_shape).index_add(0, k_head_index, dk_head)
    dk = dk.index_add(0, k_tail_index, dk_tail)
    dv = dv_head.new_zeros(v_shape).index_add(0, k_head_index, dv_head)
    dv = dv.index_add(0, k_tail_index, dv_tail)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("cp::pcp_select", _backward, setup_context=_setup_context, lib=lib)


def pcp_select(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PCPPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack this rank's real head/tail queries and the K/V rows each attends, in one pass.

    Request by request: ``q_head`` holds the real head queries and ``k_head``/``v_head`` the
    ``head_k_len`` keys they attend (bottom-right aligned: the last query of a request sits on
    its last key); likewise for the tail.

    Args:
        q: [T, Hq, Dqk] local queries in ``plan.token_indices`` order.
        k: [N, Hkv, Dqk], v: [N, Hkv, Dv] restored, unpadded K/V.
        plan: this rank's :class:`~cp_modules.partition.PCPPlan`.

    Returns:
        q_head [Lh, Hq, Dqk], q_tail [Lt, Hq, Dqk], k_head [Mh, Hkv, Dqk], v_head [Mh, Hkv, Dv],
        k_tail [Mt, Hkv, Dqk], v_tail [Mt, Hkv, Dv].

    Raises:
        ValueError: if q, k, v are not 3-D or their token counts do not fit the plan.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k and v must be 3-D [tokens, heads, dim], got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != plan.token_indices.shape[0]:
        raise ValueError(
            f"q must hold the plan's {plan.token_indices.shape[0]} local tokens, got {q.shape[0]}"
        )
    if k.shape[0] != plan.gather_index.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(
            f"k and v must hold the plan's {plan.gather_index.shape[0]} restored tokens, got "
            f"{k.shape[0]} and {v.shape[0]}"
        )
    return torch.ops.cp.pcp_select(
        q, k, v, plan.q_head_index, plan.q_tail_index, plan.k_head_index, plan.k_tail_index
    )
