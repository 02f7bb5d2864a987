"""Traceable collectives: a small shim over PyTorch's functional collectives.

``all_gather_single`` / ``reduce_scatter_single`` exist in torch 2.13 but not 2.11; the older
``all_gather_tensor`` / ``reduce_scatter_tensor`` exist in both. Callers use the names here and
pass a process group *name* (a string), which crosses torch.library op boundaries and compiles.
The autograd variants (backward of all-gather = reduce-scatter and vice versa) come from
``torch.distributed._functional_collectives``' ``*_autograd`` functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch._subclasses.fake_tensor import FakeTensor

# Same signatures; the *_single names replace the *_tensor ones from torch 2.13 on. (torch types
# a group name as ``GroupName``, a NewType of str that 2.11 lacks: hence the plain Callables.)
_ag: Callable[..., torch.Tensor] = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_ag_autograd: Callable[..., torch.Tensor] = (
    getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
)
_rs: Callable[..., torch.Tensor] = (
    getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
)
_rs_autograd: Callable[..., torch.Tensor] = (
    getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd
)
_c10d_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_c10d_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "all_gather",
    "all_gather_autograd",
    "all_reduce",
    "all_to_all",
    "copy_to_group",
    "group_name",
    "reduce_scatter",
    "reduce_scatter_autograd",
    "resolve_group",
]


def group_name(group: dist.ProcessGroup | str | None) -> str:
    """Name of a process group (the default group for ``None``)."""
    if isinstance(group, str):
        return group
    if group is None:
        group = dist.group.WORLD
        assert group is not None, "torch.distributed is not initialized"
    return group.group_name


def resolve_group(name: str) -> dist.ProcessGroup:
    """Process group registered under ``name``."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]


def _eager() -> bool:
    """True outside of any tracing: plain c10d calls cost far less host time per collective
    than the functional ones (no async-tensor wrappers), which matters for eager decode."""
    if torch.compiler.is_compiling():
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is None


def all_gather(x: torch.Tensor, group: str, world_size: int, dim: int = 0) -> torch.Tensor:
    """Concatenate ``x`` from every rank of ``group`` along ``dim`` (no autograd)."""
    if world_size == 1:
        return x
    x = x.contiguous()
    if _eager() and not isinstance(x, FakeTensor):
        out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
        _c10d_ag(out, x, group=resolve_group(group))
    else:
        out = fc.wait_tensor(_ag(x, 0, group))
    return _move_gather_dim(out, world_size, dim)


def all_gather_autograd(x: torch.Tensor, group: str, world_size: int, dim: int = 0) -> torch.Tensor:
    """All-gather whose backward is a reduce-scatter of the gradient (sum over ranks)."""
    if world_size == 1:
        return x
    out = fc.wait_tensor(_ag_autograd(x.contiguous(), 0, group))
    return _move_gather_dim(out, world_size, dim)


def reduce_scatter(x: torch.Tensor, group: str, world_size: int, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's 1/world_size slice along ``dim``."""
    if world_size == 1:
        return x
    y = _split_to_front(x, world_size, dim)
    if _eager() and not isinstance(y, FakeTensor):
        out = y.new_empty((y.shape[0] // world_size, *y.shape[1:]))
        _c10d_rs(out, y, group=resolve_group(group))
    else:
        out = fc.wait_tensor(_rs(y, "sum", 0, group))
    return _from_front(out, x.shape, world_size, dim)


def reduce_scatter_autograd(
    x: torch.Tensor, group: str, world_size: int, dim: int = 0
) -> torch.Tensor:
    """Reduce-scatter whose backward is an all-gather."""
    if world_size == 1:
        return x
    y = _split_to_front(x, world_size, dim)
    out = fc.wait_tensor(_rs_autograd(y, "sum", 0, group))
    return _from_front(out, x.shape, world_size, dim)


def all_reduce(x: torch.Tensor, group: str, world_size: int) -> torch.Tensor:
    """Sum ``x`` over ``group`` (no autograd)."""
    if world_size == 1:
        return x
    if _eager() and not isinstance(x, FakeTensor):
        out = x.clone()
        dist.all_reduce(out, group=resolve_group(group))
        return out
    return fc.wait_tensor(fc.all_reduce(x, "sum", group))  # type: ignore[arg-type]


def all_to_all(
    x: torch.Tensor, group: str, world_size: int, output_split_sizes=None, input_split_sizes=None
) -> torch.Tensor:
    """All-to-all along dim 0 (equal splits unless sizes are given)."""
    if world_size == 1:
        return x
    x = x.contiguous()
    if _eager() and not isinstance(x, FakeTensor):
        rows = sum(output_split_sizes) if output_split_sizes is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(
            out, x, output_split_sizes, input_split_sizes, group=resolve_group(group)
        )
        return out
    return fc.wait_tensor(fc.all_to_all_single(x, output_split_sizes, input_split_sizes, group))  # type: ignore[arg-type]


def _move_gather_dim(out: torch.Tensor, world_size: int, dim: int) -> torch.Tensor:
    # out: [world * n0, ...] gathered along dim 0; move the rank axis next to ``dim``.
    dim = dim % out.dim()
    if dim == 0:
        return out
    shape = list(out.shape)
    out = out.reshape([world_size, shape[0] // world_size] + shape[1:])
    out = out.movedim(0, dim)
    new_shape = [shape[0] // world_size] + shape[1:]
    new_shape[dim] *= world_size
    return out.reshape(new_shape)


def _split_to_front(x: torch.Tensor, world_size: int, dim: int) -> torch.Tensor:
    dim = dim % x.dim()
    if dim == 0:
        return x.contiguous()
    shape = list(x.shape)
    parts = shape[:dim] + [world_size, shape[dim] // world_size] + shape[dim + 1 :]
    return x.reshape(parts).movedim(dim, 0).contiguous().flatten(0, 1)


def _from_front(out: torch.Tensor, shape: torch.Size, world_size: int, dim: int) -> torch.Tensor:
    dim = dim % len(shape)
    s = list(shape)
    s[dim] //= world_size
    if dim == 0:
        return out.reshape(s)
    moved = [s[dim]] + s[:dim] + s[dim + 1 :]
    return out.reshape(moved).movedim(0, dim)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str, world_size: int) -> torch.Tensor:
        ctx.group, ctx.world_size = group, world_size
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), ctx.group, ctx.world_size), None, None


def copy_to_group(x: torch.Tensor, group: str, world_size: int) -> torch.Tensor:
    """Identity whose backward sums the gradient over ``group``.

    For a tensor replicated over TP that feeds per-rank (head-sharded) work: each rank's
    gradient covers its own heads, and the sum is the tensor's full gradient.
    """
    if world_size == 1:
        return x
    return _CopyToGroup.apply(x, group, world_size)
