"""Piecewise compilation: split a captured graph at the context-parallel attention ops.

The attention ops (``cp::gqa_attention*``, ``cp::mla_attention*``) read the step's metadata
and run collectives whose shapes change from step to step; everything between them (norms,
projections, MLPs) has static shapes per batch size. Splitting there lets the pieces be
compiled (and, on GPUs, captured as CUDA graphs) while the attention runs as it is:

    model = torch.compile(model, backend=piecewise_backend(), fullgraph=True)

``piecewise_backend(compile_piece=...)`` takes how each non-attention piece is compiled
(default: inductor through ``torch.compile``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.passes.split_module import split_module

__all__ = ["SPLIT_OPS", "piecewise_backend", "split_at_attention"]

SPLIT_OPS = (
    "cp::gqa_attention",
    "cp::gqa_attention_with_cache",
    "cp::mla_attention",
    "cp::mla_attention_with_cache",
)


def _is_split_op(node: torch.fx.Node) -> bool:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name in SPLIT_OPS
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name in SPLIT_OPS
    return False


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """Split ``gm`` so that each attention op is a submodule of its own.

    Returns:
        The split module (submodules ``submod_0`` ...) and the names of the attention pieces.
    """
    part = 0
    assignment: dict[torch.fx.Node, int] = {}
    attention_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_split_op(node):
            part += 1
            assignment[node] = part
            attention_parts.add(part)
            part += 1
        else:
            assignment[node] = part
    # No root module: the pieces take their attributes from ``gm`` itself.
    split = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)  # type: ignore[arg-type]
    return split, [f"submod_{p}" for p in sorted(attention_parts)]


def piecewise_backend(
    compile_piece: Callable[[torch.nn.Module], Callable] | None = None,
) -> Callable:
    """A Dynamo backend that compiles everything but the attention ops, piece by piece."""
    if compile_piece is None:
        compile_piece = lambda m: torch.compile(m, backend="inductor", dynamic=True)  # noqa: E731

    def backend(gm: torch.fx.GraphModule, example_inputs):
        split, attention = split_at_attention(gm)
        for name, child in list(split.named_children()):
            if name not in attention:
                setattr(split, name, _Compiled(compile_piece(child)))
        split.cp_attention_pieces = attention  # type: ignore[assignment]
        return split

    return backend


class _Compiled(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)
