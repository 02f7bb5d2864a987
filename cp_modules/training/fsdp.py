"""FSDP2 over the dp x pcp ranks: gradient sums (and parameter sharding) for CP training.

Every rank's loss is its local token-loss sum divided by the *global* token count, so the
gradient of the global batch is the **sum** of the per-rank gradients over the dp x pcp ranks
of one TP position (see :mod:`cp_modules.training.context`). FSDP2 (``fully_shard``) on the
flattened ``dp_pcp`` mesh axis reduce-scatters exactly those gradients; it averages by default,
so :func:`apply_fsdp` sets its divide factor to 1 and forces plain SUM collectives (gloo has no
pre-multiplied sum).

As in torchtitan, tensor parallelism is applied first (parameters become DTensors on the
``tp`` axis) and FSDP2 then shards them over ``dp_pcp`` of the same mesh: one ``fully_shard``
per transformer block (a module holding a CP attention layer as a direct child), then one on
the root.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DP_PCP_AXIS", "apply_fsdp", "fsdp_mesh", "mixed_precision_policy"]

DP_PCP_AXIS = "dp_pcp"


def fsdp_mesh(mesh):
    """The 1-D ``dp_pcp`` mesh of a (dp, pp, pcp, tp) mesh, over which gradients are summed."""
    from cp_modules.distributed.groups import flatten_mesh_axes

    return flatten_mesh_axes(mesh, ("dp", "pcp"), DP_PCP_AXIS)


def mixed_precision_policy(
    param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
):
    """FSDP2's ``MixedPrecisionPolicy``: e.g. ``param_dtype=torch.bfloat16, reduce_dtype=torch.float32``.

    Parameters (and the optimizer) stay in their own dtype (fp32); the forward and backward run
    in ``param_dtype``; gradients are reduced in ``reduce_dtype``. ``None``: the parameters' dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _blocks(model: nn.Module) -> list[nn.Module]:
    from cp_modules.modules import CPFlashAttention, CPMLAAttention

    return [
        m
        for m in model.modules()
        if any(isinstance(c, (CPFlashAttention, CPMLAAttention)) for c in m.children())
    ]


def _roots(model: nn.Module) -> list[nn.Module]:
    """Modules whose forward is called from outside: the model, or a LightningModule's children.

    A LightningModule's own forward is usually not what its ``training_step`` calls, and FSDP2
    unshards a root's parameters in the root's forward, so there each child holding parameters
    is a root.
    """
    from lightning.pytorch import LightningModule  # a dependency of the package

    if not isinstance(model, LightningModule):
        return [model]
    own = list(model.parameters(recurse=False))
    if own:
        raise ValueError(
            f"{type(model).__name__} holds parameters directly ({len(own)}); apply_fsdp shards a "
            "LightningModule through its child modules: move them into a submodule"
        )
    return [c for c in model.children() if any(True for _ in c.parameters())]


def _set_sum_reduction(module) -> None:
    # Gradients are summed, never averaged: the loss is already normalised by the global
    # token count. Plain SUM collectives (no PREMUL_SUM, which gloo lacks).
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(1.0)
    else:  # older FSDP2
        module.set_reduce_scatter_divide_factor(1.0)
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)


def _sharded_by_apply_fsdp(model: nn.Module) -> bool:
    """Every parameter of ``model`` lies in a submodule apply_fsdp already sharded."""
    inner = [m for m in model.modules() if getattr(m, "_cp_fsdp_applied", False)]
    if not inner:
        return False
    covered = {id(p) for m in inner for p in m.parameters()}
    return all(id(p) in covered for p in model.parameters())


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    mp_policy=None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over the dp x pcp ranks of ``mesh``; gradients are summed there.

    Call after tensor parallelism (``parallelize_fn``). ``fully_shard`` is applied to every
    block (a module with a CP attention layer as a direct child) and then to the root (the
    model; for a LightningModule, each child module holding parameters). After the backward,
    every parameter's ``.grad`` is its shard of the gradient summed over dp x pcp, so the
    optimizer step needs no further reduction. Idempotent; a module all of whose parameters
    lie in submodules apply_fsdp sharded (e.g. a wrapper around what
    :func:`~cp_modules.training.load_for_training` returns) is taken as it is. The model may be
    on the meta device (materialise it afterwards, in place).

    Args:
        model: the (TP-parallelized) model, on this rank's device.
        mesh: the strategy's (dp, pp, pcp, tp) :class:`DeviceMesh`.
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` (see :func:`mixed_precision_policy`);
            default: compute and reduce in the parameters' dtype.
        reshard_after_forward: free the gathered parameters after each block's forward
            (gathered again in the backward).

    Raises:
        ValueError: for a mesh without ``dp`` and ``pcp`` axes, or a model that already holds
            ``fully_shard`` modules of its own (their reduction would average, not sum).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if getattr(model, "_cp_fsdp_applied", False):
        return model
    if _sharded_by_apply_fsdp(model):
        # E.g. a wrapper (or LightningModule) around a model load_for_training sharded.
        model._cp_fsdp_applied = True  # type: ignore[assignment]
        return model
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} already holds fully_shard modules: leave FSDP2 to apply_fsdp "
            f"(the CP strategies call it), which shards over {DP_PCP_AXIS!r} and sums gradients "
            "(the losses are normalised by the global token count; FSDP2's default averages)"
        )
    dp_pcp = fsdp_mesh(mesh)
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    units = [*_blocks(model), *_roots(model)]
    for unit in units:
        fully_shard(
            unit, mesh=dp_pcp, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
    for unit in units:
        _set_sum_reduction(unit)
    model._cp_fsdp_applied = True  # type: ignore[assignment]
    return model
