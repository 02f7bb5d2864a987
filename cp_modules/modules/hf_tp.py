"""Tensor parallelism of a swapped HF model: the attention projections after the model's own
TP plan (:func:`parallelize_attention`), and the embeddings, MLPs and LM head
(:func:`parallelize_non_attention`). Used by :func:`~cp_modules.modules.hf_swap.swap_attention`.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import warnings
from typing import Any, cast

import torch
from torch import nn

from cp_modules.modules.attention import CPMLAAttention

__all__ = [
    "attention_tp_plan",
    "expert_modules",
    "module_name",
    "parallelize_attention",
    "parallelize_non_attention",
    "shard_experts",
]

_DEFAULT_ATTENTION_PLAN = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "o_proj": "rowwise",
    "qkv_proj": "colwise_gather_output",
}
_GATHERED = ("colwise_gather_output", "rowwise_split_input")


def attention_tp_plan(hf_config) -> dict[str, str]:
    """The model's TP plan for the children of ``self_attn`` (child name -> style)."""
    plan = dict(getattr(hf_config, "base_model_tp_plan", None) or {})
    own = {}
    for key, style in plan.items():
        m = re.fullmatch(r"(?:.*\.)?self_attn\.(\w+)", key)
        if m:
            own[m.group(1)] = style
    return own or dict(_DEFAULT_ATTENTION_PLAN)


def _grad_allreduce(module: nn.Module, tp_group: tuple[str, int]) -> None:
    """Sum the gradients of a replicated module's parameters over TP (each rank's covers only
    its own heads)."""
    from cp_modules.distributed.collectives import all_reduce

    for p in module.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: all_reduce(g.contiguous(), *tp_group))


def parallelize_attention(attn, binding, plan, tp_mesh, config, num_heads, num_kv_heads) -> None:
    """Shard one attention module's projections over ``tp_mesh`` after the model's TP plan."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    tp_group = (tp_mesh.get_group().group_name, tp)
    children = {n: m for n, m in attn.named_children() if any(True for _ in m.parameters())}
    missing = sorted(set(children) - set(plan))
    if missing:
        raise ValueError(
            f"{binding.where()}: tensor_parallel_size={tp} but the model's TP plan does not say "
            f"how to shard {missing}: run with tensor_parallel_size=1"
        )
    styles = {n: plan[n] for n in children}
    known = {"colwise", "rowwise", "replicated_with_grad_allreduce", *_GATHERED}
    odd = {n: s for n, s in styles.items() if s not in known}
    if odd:
        raise ValueError(
            f"{binding.where()}: TP styles {odd} are not supported by cp; known: {sorted(known)}"
        )
    replicated = any(s in _GATHERED for s in styles.values())
    binding.tp_group = tp_group
    kv_sharded = True
    if replicated:
        if config.tp_positions_per_dcp_group > 1:
            raise ValueError(
                f"{binding.where()}: the model's TP plan keeps every head on every TP rank "
                f"({styles}), so a DCP group may span only PCP ranks: need "
                f"decode_context_parallel_size <= prefill_context_parallel_size, got "
                f"dcp={config.dcp}, pcp={config.pcp} (or run with tensor_parallel_size=1)"
            )
        binding.heads_replicated = True
        binding.num_kv_heads = num_kv_heads
        if any(s in ("colwise", "rowwise") for s in styles.values()):
            raise ValueError(
                f"{binding.where()}: a TP plan that mixes gathered and sharded heads: {styles}"
            )
    elif num_kv_heads % tp:
        # Fewer KV heads than TP ranks: k/v projections stay replicated, each rank uses the
        # KV head of its query heads (gradients summed over TP in the attention function).
        kv_sharded = False
        binding.kv_replica_index = tp_mesh.get_local_rank() * num_kv_heads // tp
        binding.num_kv_heads = 1
        styles = {n: s for n, s in styles.items() if n not in ("k_proj", "v_proj")}
    else:
        binding.num_kv_heads = num_kv_heads // tp
    sinks = getattr(attn, "sinks", None)
    if isinstance(sinks, nn.Parameter) and not replicated:
        from cp_modules.distributed.collectives import all_reduce

        # Per-head sink logits (gpt-oss) stay whole on every rank; each rank attends with its
        # heads' slice, and the slices' gradients are summed over TP.
        binding.sinks_slice = (tp_mesh.get_local_rank(), tp)
        sinks.register_hook(lambda g: all_reduce(g.contiguous(), *tp_group))
    torch_plan: dict[str, ParallelStyle] = {}
    for n, s in styles.items():
        if s == "colwise":
            torch_plan[n] = ColwiseParallel()
        elif s == "rowwise":
            torch_plan[n] = RowwiseParallel()
        elif s == "colwise_gather_output":
            torch_plan[n] = ColwiseParallel(output_layouts=Replicate())
        elif s == "rowwise_split_input":
            torch_plan[n] = RowwiseParallel(input_layouts=Replicate())
        elif not replicated and (kv_sharded or not n.startswith("k_")):
            # replicated_with_grad_allreduce: a q/k norm over this rank's heads. With replicated
            # KV heads the k side's gradient is already summed by the attention function.
            _grad_allreduce(children[n], tp_group)
    parallelize_module(attn, tp_mesh, torch_plan)


def parallelize_non_attention(model: nn.Module, tp_mesh) -> nn.Module:
    """Shard embeddings, dense MLPs and the LM head of a HF model over ``tp_mesh``.

    Outputs stay replicated plain tensors, so the HF forward between the layers is unchanged:
    the token embedding is split over the vocabulary (row-wise: each rank looks up its rows,
    the partial results are all-reduced), MLPs are column-wise ``gate/up_proj`` + row-wise
    ``down_proj``, the LM head is split over the vocabulary and all-gathered. A module whose
    size the TP size does not divide stays replicated (a warning names it).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    plan: dict[str, ParallelStyle] = {}
    skipped: list[str] = []
    unknown: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, CPMLAAttention) or getattr(mod, "cp_binding", None) is not None:
            continue
        gate, up, down = (getattr(mod, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        if (
            isinstance(gate, nn.Linear)
            and isinstance(up, nn.Linear)
            and isinstance(down, nn.Linear)
        ):
            if not _elementwise_mlp(mod):
                unknown.append(name)
                continue
            if gate.out_features % tp:
                skipped.append(name)
                continue
            prefix = f"{name}." if name else ""
            plan[prefix + "gate_proj"] = ColwiseParallel()
            plan[prefix + "up_proj"] = ColwiseParallel()
            plan[prefix + "down_proj"] = RowwiseParallel()
    hf_model = cast(Any, model)  # a transformers PreTrainedModel
    emb = hf_model.get_input_embeddings()
    emb_name = module_name(model, emb)
    if emb_name is not None:
        if emb.num_embeddings % tp:
            skipped.append(emb_name)
        else:
            plan[emb_name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    head = hf_model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = module_name(model, head) if isinstance(head, nn.Linear) else None
    if head_name is not None and head is not None:
        if head.out_features % tp:
            skipped.append(head_name)
        else:
            plan[head_name] = ColwiseParallel(output_layouts=Replicate())
    if skipped:
        warnings.warn(
            f"modules kept replicated (sizes not divisible by the TP size {tp}): {skipped}",
            stacklevel=2,
        )
    if unknown:
        warnings.warn(
            "MLPs kept replicated: their forward is not down_proj(act_fn(gate_proj(x)) * "
            f"up_proj(x)), which column/row-wise sharding keeps exact: {unknown}",
            stacklevel=2,
        )
    return parallelize_module(model, tp_mesh, plan)


# The gated MLP that column-wise gate/up and row-wise down sharding keeps exact: everything
# between the projections is elementwise over the intermediate features. Norms over those
# features (BitNet's ffn_sub_norm) or statistics of them (Gemma 3n's activation sparsity)
# would see one rank's slice.
_GATED_MLP = re.compile(
    r"def forward\(self, (\w+)[^)]*\)[^:]*:\s*"
    r"(?:(\w+) = )?(?:return )?"
    r"self\.down_proj\(self\.act_fn\(self\.gate_proj\(\1\)\) \* self\.up_proj\(\1\)\)\s*"
    r"(?:return \2\s*)?$"
)
_ELEMENTWISE: dict[type, bool] = {}


def _elementwise_mlp(mod: nn.Module) -> bool:
    cls = type(mod)
    if cls not in _ELEMENTWISE:
        try:
            src = textwrap.dedent(inspect.getsource(cls.forward))
        except (OSError, TypeError):
            src = ""
        code = "\n".join(ln for ln in src.splitlines() if not ln.strip().startswith("#"))
        _ELEMENTWISE[cls] = _GATED_MLP.search(code.strip()) is not None
    return _ELEMENTWISE[cls]


def module_name(root: nn.Module, target: nn.Module | None) -> str | None:
    """The name of ``target`` among ``root``'s modules (None if it is not one)."""
    if target is None:
        return None
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None


# ----------------------------------------------------------------------------- routed experts


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routed-experts modules of a HF MoE model: an integer ``num_experts`` and 3-D
    parameters whose dim 0 indexes the experts (transformers 5's fused expert tensors)."""
    out = []
    for name, mod in model.named_modules():
        n = getattr(mod, "num_experts", None)
        if not isinstance(n, int) or n < 1:
            continue
        own = list(mod.named_parameters(recurse=False))
        if any(p.dim() == 3 and p.shape[0] == n for _, p in own):
            out.append((name, mod))
    return out


def _sentinel_routing(mod: nn.Module) -> bool:
    """Whether ``mod``'s forward can skip the expert index ``num_experts`` (transformers' EP
    sentinel), and if so switch it on: its grouped / batched implementations skip it once
    ``_is_expert_parallel`` is set, eager loops that one-hot over ``num_experts + 1`` classes
    always do. Otherwise the others' slots go to a local expert with a zero weight."""
    impl = getattr(getattr(mod, "config", None), "_experts_implementation", None)
    if impl in ("grouped_mm", "batched_mm"):
        if not hasattr(mod, "_is_expert_parallel"):
            return False
        cast(Any, mod)._is_expert_parallel = True
        return True
    try:
        src = inspect.getsource(inspect.unwrap(type(mod).forward))
    except (OSError, TypeError):
        return False
    return "num_experts + 1" in src and "== self.num_experts" in src


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient is summed over TP (each rank's experts give a part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        from cp_modules.distributed.collectives import all_reduce

        return all_reduce(g.contiguous(), ctx.group, ctx.size), None, None


class _SumOverTP(torch.autograd.Function):
    """Sum of the ranks' expert outputs; the gradient (replicated) passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str, size: int) -> torch.Tensor:
        from cp_modules.distributed.collectives import all_reduce

        return all_reduce(x.contiguous(), group, size)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g, None, None


def shard_experts(model: nn.Module, tp_mesh) -> list[str]:
    """Split every routed-experts module of ``model`` over ``tp_mesh``: rank ``r`` keeps
    experts ``[r E/tp, (r+1) E/tp)`` (expert parallelism over the TP group); return the names
    of the split modules.

    Each expert tensor becomes a DTensor sharded on dim 0 (experts) over TP, so FSDP2,
    checkpoints and exports see it as they see TP-sharded linears; the module's own forward
    runs on the local experts. The router stays replicated, so every rank routes every token
    the same way; a rank runs its experts on the tokens routed to them (the others' slots get
    transformers' skip index ``num_experts``, or a zero weight where the module's forward has
    no skip index) and the partial outputs are summed over TP (one all-reduce of
    ``[T, hidden]`` per MoE layer, as a row-wise MLP's). Gradients of the inputs and routing
    weights are summed over TP. On a meta model the shards stay meta
    (``materialize_from_checkpoint`` reads each rank's experts); real tensors are cut to the
    local experts (the rest is freed).

    Raises:
        ValueError: an expert count the TP size does not divide, or an experts module whose
            forward is not ``(hidden_states, expert indices, routing weights)``.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    group = (tp_mesh.get_group().group_name, tp)
    done = []
    for name, mod in expert_modules(model):
        num = int(cast(Any, mod).num_experts)
        if num % tp:
            raise ValueError(
                f"{type(model).__name__} {name!r}: {num} routed experts cannot be split over "
                f"tensor_parallel_size={tp}: use a TP size that divides {num}"
            )
        args = _forward_args(mod)
        if len(args) != 3:
            raise ValueError(
                f"{type(model).__name__} {name!r}: {type(mod).__name__}.forward{tuple(args)} is not "
                "(hidden_states, expert indices, routing weights), which cp's expert split serves"
            )
        local = num // tp
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.dim() < 1 or p.shape[0] != num:
                continue
            # Every rank holds the same tensor (or a meta one): its chunk, no communication.
            dt = distribute_tensor(p.detach(), tp_mesh, [Shard(0)], src_data_rank=None)
            setattr(mod, pname, nn.Parameter(dt, requires_grad=p.requires_grad))
        sentinel = _sentinel_routing(mod)
        cast(Any, mod).num_experts = local
        mod.forward = _on_local_experts(mod)
        mod.register_forward_pre_hook(
            _route_locally(rank * local, local, group, sentinel, args), with_kwargs=True
        )
        mod.register_forward_hook(lambda _m, _a, out, g=group: _SumOverTP.apply(out, *g))
        done.append(name)
    return done


def _forward_args(mod: nn.Module) -> list[str]:
    """The argument names of the experts class's forward (without ``self``)."""
    return list(inspect.signature(type(mod).forward).parameters)[1:]


def _on_local_experts(mod: nn.Module):
    """``mod``'s own forward run on the local tensors of its DTensor experts (differentiable:
    the gradients arrive on the DTensors)."""
    from torch.distributed.tensor import DTensor

    forward = type(mod).forward

    def run(*args: Any, **kwargs: Any) -> Any:
        params = cast(dict, mod._parameters)
        sharded = {n: p for n, p in params.items() if isinstance(p, DTensor)}
        try:
            for n, p in sharded.items():
                params[n] = p.to_local()
            return forward(mod, *args, **kwargs)
        finally:
            params.update(sharded)

    return run


def _route_locally(e0: int, local: int, group: tuple[str, int], sentinel: bool, names: list[str]):
    """A forward pre-hook mapping global expert indices to this rank's experts."""

    def hook(mod, args, kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        x, idx, w = (bound[n] for n in names)
        rel = idx - e0
        mine = (rel >= 0) & (rel < local)
        w = _CopyToTP.apply(w, *group)
        if sentinel:
            rel = torch.where(mine, rel, torch.full_like(rel, local))
        else:
            rel = torch.where(mine, rel, torch.zeros_like(rel))
        w = torch.where(mine, w, torch.zeros_like(w))
        x = _CopyToTP.apply(x, *group)
        return (x, rel, w), {}

    return hook
