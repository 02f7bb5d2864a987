"""Where each parameter of a model comes from in a HF checkpoint, by transformers' own rules.

A parameter's name in the model and its tensor(s) in the checkpoint differ where transformers
converts on load: routed experts stored one tensor per expert (``mlp.experts.3.gate_proj.weight``)
are fused into ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``; families rename modules
(Mixtral's ``block_sparse_moe`` -> ``mlp``). :func:`plan_sources` asks transformers for the
model's conversion mapping (``get_model_conversion_mapping``) and renames every checkpoint key
with transformers' ``rename_source_key``, so the mapping is transformers' and not a second one.
What it cannot read a box of (an operation other than stacking experts and concatenating them,
quantized tensors) is refused by name. A :class:`Source` then reads any box of its target: the
experts of the box only, and of each only the rows the box covers.

Shapes: a fused experts target ``[E, *rest]``; a box is one ``slice`` per dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from cp_modules.loading.checkpoint import CheckpointIndex

__all__ = ["Source", "plan_sources"]


@dataclass(frozen=True)
class Source:
    """How to read the checkpoint data of one model tensor of shape ``shape``.

    ``keys``: one list of checkpoint keys per concatenated part; a direct tensor is
    ``[[key]]`` with ``stacked=False``; fused experts are ``stacked=True`` (dimension 0 indexes
    the keys of each part, in expert order) and, with several parts, concatenated along
    ``concat_dim`` of the stacked target.
    """

    target: str
    shape: tuple[int, ...]
    keys: tuple[tuple[str, ...], ...]
    stacked: bool = False
    concat_dim: int | None = None

    def read(self, index: CheckpointIndex, box: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy ``target[box]`` into ``out`` (of the box's shape), reading only what it covers."""
        if not self.stacked:
            index.read(self.keys[0][0], box, out)
            return
        e0, e1 = box[0].start or 0, box[0].stop
        sizes = [index[part[0]].shape for part in self.keys]
        for e in range(e0, e1):
            dest = out[e - e0]
            if self.concat_dim is None:
                index.read(self.keys[0][e], box[1:], dest)
                continue
            d = self.concat_dim - 1  # the dimension in one expert's tensor
            lo, hi = box[self.concat_dim].start or 0, box[self.concat_dim].stop
            offset = 0
            for part, shape in zip(self.keys, sizes):
                a, b = max(lo, offset), min(hi, offset + shape[d])
                if a < b:
                    sub = list(box[1:])
                    sub[d] = slice(a - offset, b - offset)
                    index.read(part[e], tuple(sub), dest.narrow(d, a - lo, b - a))
                offset += shape[d]


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any], Any]:
    """transformers' renamings and converters for ``model``, and its key sorter."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
        )
    except ImportError:  # a transformers without conversion mappings: names are the model's
        return [], [], sorted
    mapping = get_model_conversion_mapping(cast(Any, model))
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters, lambda keys: sorted(keys, key=dot_natural_key)


def _rename(key, renamings, converters, prefix, targets) -> tuple[str, str | None]:
    from transformers.core_model_loading import rename_source_key

    renamed, pattern = rename_source_key(key, renamings, converters, prefix, targets)
    if renamed not in targets and key in targets:
        renamed, pattern = rename_source_key(key, [], [], prefix, targets)
    return renamed, pattern


def _fused(target, shape, pattern_keys, converter, index) -> Source:
    """The source of a target that transformers fuses from several checkpoint tensors."""
    ops = [type(op).__name__ for op in converter.operations]
    dims = [getattr(op, "dim", None) for op in converter.operations]
    if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) or dims[0] != 0:
        raise ValueError(
            f"checkpoint tensors {converter.source_patterns} -> {target!r}: transformers converts "
            f"them with {ops}, which the sharded loader cannot read a slice of (it reads experts "
            "stacked on dim 0, optionally concatenated); load the model with "
            "AutoModelForCausalLM.from_pretrained and call swap_attention"
        )
    parts = tuple(tuple(pattern_keys.get(p, ())) for p in converter.source_patterns)
    if ops == ["MergeModulelist"] and len(parts) != 1:
        raise ValueError(f"{target!r}: several source patterns merged without a concatenation")
    concat_dim = dims[1] if len(ops) == 2 else None
    if concat_dim is not None and concat_dim < 0:
        concat_dim += len(shape)
    if any(len(p) != shape[0] for p in parts):
        raise ValueError(
            f"{target!r} of shape {shape} (experts on dim 0) but the checkpoint has "
            f"{[len(p) for p in parts]} tensors for {list(converter.source_patterns)}"
        )
    per_expert = [index[p[0]].shape for p in parts]
    for p, s in zip(parts, per_expert):
        bad = [k for k in p if index[k].shape != s]
        if bad:
            raise ValueError(f"{index[bad[0]].file}: tensor {bad[0]!r} has shape "
                             f"{index[bad[0]].shape}, its siblings {s}")  # fmt: skip
    if concat_dim is None:
        fused = (len(parts[0]), *per_expert[0])
    else:
        d = concat_dim - 1
        cat = list(per_expert[0])
        cat[d] = sum(s[d] for s in per_expert)
        fused = (len(parts[0]), *cat)
    if fused != shape:
        raise ValueError(
            f"{index[parts[0][0]].file}: {list(converter.source_patterns)} fuse to {fused}, but "
            f"the model's {target!r} (from its config) is {shape}"
        )
    return Source(target, shape, parts, stacked=True, concat_dim=concat_dim)


def plan_sources(
    model: nn.Module, index: CheckpointIndex, shapes: dict[str, tuple[int, ...]]
) -> dict[str, Source]:
    """The checkpoint source of every tensor in ``shapes`` (model name -> global shape).

    Called on the meta model before it is sharded, so shapes are the config's.

    Raises:
        ValueError: a tensor the checkpoint lacks (naming it and the directory), a shape that
            differs from the config's (naming the file and tensor), or a conversion the
            sharded loader cannot slice.
    """
    renamings, converters, natural = _conversions(model)
    prefix = getattr(model, "base_model_prefix", None)
    targets = dict.fromkeys(shapes, True)
    direct: dict[str, str] = {}
    fused: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    for key in natural(index.entries):
        if converters or renamings or prefix:
            renamed, pattern = _rename(key, renamings, converters, prefix, targets)
        else:
            renamed, pattern = key, None
        if renamed not in shapes:
            continue
        if pattern is None:
            direct[renamed] = key
        else:
            conv, keys = fused.setdefault(renamed, (by_pattern[pattern], {}))
            keys.setdefault(pattern, []).append(key)
    tied = _tied_sources(model)
    out: dict[str, Source] = {}
    missing = []
    for name, shape in shapes.items():
        if name in fused:
            conv, keys = fused[name]
            out[name] = _fused(name, shape, keys, conv, index)
            continue
        key = direct.get(name)
        if key is None and name in tied and tied[name] in direct:
            key = direct[tied[name]]
        if key is None:
            missing.append(name)
            continue
        entry = index[key]
        if entry.shape != shape:
            raise ValueError(
                f"{entry.file}: tensor {key!r} has shape {entry.shape}, but the model's {name!r} "
                f"(from its config) is {shape}: the checkpoint does not match its config.json"
            )
        out[name] = Source(name, shape, ((key,),))
    if missing:
        raise ValueError(
            f"{index.path}: no checkpoint tensor for {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + f" ({len(index.entries)} tensors in the checkpoint, e.g. "
            f"{list(index.entries)[:3]}): the checkpoint does not match its config.json"
        )
    return out


def _tied_sources(model: nn.Module) -> dict[str, str]:
    """Tied parameters (target -> the name whose tensor the checkpoint holds)."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(
        model, "_tied_weights_keys", None
    )
    if isinstance(tied, dict):
        return {str(k): str(v) for k, v in tied.items()}
    config = getattr(model, "config", None)
    hf: Any = model  # a transformers PreTrainedModel
    if getattr(config, "tie_word_embeddings", False) and hasattr(hf, "get_input_embeddings"):
        names = {id(m): n for n, m in model.named_modules()}
        emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
        if emb is not None and head is not None and id(emb) in names and id(head) in names:
            return {f"{names[id(head)]}.weight": f"{names[id(emb)]}.weight"}
    return {}
