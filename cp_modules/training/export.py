"""Export of trained weights in the layout ``transformers`` loads (``save_pretrained``'s).

A directory with ``config.json`` and the weights as safetensors: one ``model.safetensors``, or,
past ``max_shard_size``, ``model-00001-of-0000N.safetensors`` files and
``model.safetensors.index.json`` (the names and split of ``save_pretrained``), so
``AutoModelForCausalLM.from_pretrained(directory)`` loads it on one process, without
cp_modules, whatever (dp, pcp, tp) layout and FSDP2 sharding the model was trained under.

The export streams: tensors are gathered one at a time, a DTensor's shards sent point to
point to the writing rank (rank 0), which writes each tensor into its file at once and frees
it, so no rank ever holds more than one full tensor beside its own shards. The files' headers are written first, from the
global shapes and dtypes every rank knows without communication.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["export_hf"]

HF_WEIGHTS_NAME = "model.safetensors"
HF_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

_SAFETENSORS_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def export_hf(
    model: nn.Module,
    directory: str | os.PathLike,
    config: Any | None = None,
    *,
    rename: Callable[[str], str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write ``model``'s full weights and ``config`` to ``directory`` as transformers saves them.

    A collective: call on every rank. Tensors are gathered one at a time (TP and FSDP2 shards,
    routed experts split over TP included) to rank 0, which writes each straight into its
    safetensors file, so a rank's memory grows by at most about the largest tensor; then every
    rank waits for the files. Weights larger than ``max_shard_size`` in all are split into
    ``model-0000K-of-0000N.safetensors`` files with ``model.safetensors.index.json``, as
    ``save_pretrained`` splits them; weight files of an earlier export in ``directory`` that
    the new one does not use are removed.

    Args:
        model: a transformers causal LM (e.g. swapped with :func:`cp_modules.swap_attention`,
            its names are already transformers'), sharded or not.
        directory: created if missing.
        config: a transformers ``PretrainedConfig``; default ``model.config``, or for a GQA
            :class:`~cp_modules.models.TinyLM` the equivalent ``LlamaConfig`` (same names
            under ``model.``, same rope and norms: it loads as ``LlamaForCausalLM``). Its
            attention implementation is not written, so the export loads with transformers'
            own.
        rename: maps each state-dict name to the transformers name, for models whose names
            differ.
        max_shard_size: the most bytes of one weight file (an int, or a string such as
            ``"5GB"`` or ``"500MB"``); a tensor larger than it gets a file of its own.

    Raises:
        ValueError: when no config is given and ``model`` has none (an MLA TinyLM has no
            transformers twin here: pass ``config`` and ``rename``), or for a dtype
            safetensors cannot hold. Raised on every rank alike, before any collective.
    """
    if config is None and rename is None:
        config, rename = _tiny_lm_as_llama(model)
    if config is None:
        config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(
            f"export_hf needs a transformers config (PretrainedConfig): {type(model).__name__} "
            "has no .config; pass config=..."
        )
    entries = _entries(model, rename, tied=bool(getattr(config, "tie_word_embeddings", False)))
    split = _split(entries, max_shard_size)
    distributed = dist.is_available() and dist.is_initialized()
    writer = not distributed or dist.get_rank() == 0
    path = Path(directory)
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(path))
    for filename, names in split.filename_to_tensors.items():
        _write_file(path / filename, [(n, entries[n]) for n in names], writer)
    if writer:
        index = path / HF_WEIGHTS_INDEX_NAME
        if split.is_sharded:
            content = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            tmp = index.with_name(index.name + ".tmp")
            tmp.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, index)
        elif index.exists():
            index.unlink()
        keep = set(split.filename_to_tensors)
        for old in path.glob("model*.safetensors"):
            if old.name not in keep:
                old.unlink()
    if distributed:
        dist.barrier()


class _Entry:
    """One exported tensor: its global shape and dtype, and how to gather it whole."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name = name
        self.tensor = tensor
        self.shape = tuple(tensor.shape)  # a DTensor's is global
        self.dtype = tensor.dtype
        if self.dtype not in _SAFETENSORS_NAMES:
            raise ValueError(
                f"export_hf: {name!r} has dtype {self.dtype}, which safetensors cannot hold "
                f"(valid: {sorted(str(d) for d in _SAFETENSORS_NAMES)})"
            )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def gather(self, writer: bool) -> torch.Tensor | None:
        """The full tensor on the writer (rank 0), ``None`` elsewhere; every rank calls it in
        turn for every entry (sharded tensors communicate)."""
        from torch.distributed.tensor import DTensor

        t = self.tensor.detach()
        if isinstance(t, DTensor):
            return _gather_to_rank0(self.name, t, writer)
        return t if writer else None


def _gather_to_rank0(name: str, t: Any, writer: bool) -> torch.Tensor | None:
    """A DTensor's full tensor assembled on rank 0 from its shards, one shard at a time.

    The ranks of rank 0's mesh that own a distinct shard (coordinate 0 on every axis the tensor
    is replicated over) send it to rank 0 (point to point), which writes each into place; the
    other ranks send nothing and hold nothing more than their shard.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    if any(p.is_partial() for p in placements):
        raise ValueError(f"export_hf: {name!r} is a partial sum ({placements}), not a shard")
    replicated = [i for i, p in enumerate(placements) if p.is_replicate()]
    ranks = mesh.mesh  # global ranks, indexed by mesh coordinate
    rank = dist.get_rank()

    def owner(coord) -> bool:
        return all(coord[i] == 0 for i in replicated)

    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if not writer:
        coord = mesh.get_coordinate()
        if 0 in ranks.flatten().tolist() and coord is not None and owner(coord):
            meta = torch.tensor([*offset, *shape], dtype=torch.int64, device=local.device)
            dist.send(meta, dst=0)
            if local.numel():
                dist.send(local.contiguous(), dst=0)
        return None
    full = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].copy_(local)
    for coord in torch.cartesian_prod(*(torch.arange(n) for n in ranks.shape)).reshape(
        -1, ranks.dim()
    ):
        src = int(ranks[tuple(coord.tolist())])
        if src == rank or not owner(coord.tolist()):
            continue
        meta = torch.empty(2 * t.dim(), dtype=torch.int64, device=local.device)
        dist.recv(meta, src=src)
        offs, sizes = meta[: t.dim()].tolist(), meta[t.dim() :].tolist()
        if 0 in sizes:
            continue
        buf = torch.empty(sizes, dtype=t.dtype, device=local.device)
        dist.recv(buf, src=src)
        full[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].copy_(buf)
        del buf
    return full


def _entries(
    model: nn.Module, rename: Callable[[str], str] | None, *, tied: bool
) -> dict[str, _Entry]:
    out: dict[str, _Entry] = {}
    for key, value in model.state_dict().items():
        name = rename(key) if rename is not None else key
        out[name] = _Entry(name, value)
    if tied:
        # transformers ties the head to the embedding on load; the file holds it once.
        out.pop("lm_head.weight", None)
    return out


def _split(entries: dict[str, _Entry], max_shard_size: int | str):
    """``save_pretrained``'s split of the tensors into files (huggingface_hub's algorithm)."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    return split_state_dict_into_shards_factory(
        entries,
        get_storage_size=lambda e: e.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )


def _write_file(file: Path, entries: list[tuple[str, _Entry]], writer: bool) -> None:
    """Gather ``entries`` one at a time (every rank) and stream them into ``file`` (the writer).

    The safetensors header (names, dtypes, shapes, byte offsets) is known from the global
    shapes, so it is written first and each tensor's bytes follow as soon as it is gathered.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, e in entries:
        header[name] = {
            "dtype": _SAFETENSORS_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    tmp = file.with_name(file.name + ".tmp")
    f = open(tmp, "wb") if writer else None
    try:
        if f is not None:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
        for _name, e in entries:
            full = e.gather(writer)
            if f is not None and full is not None:
                data = full.to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(data.numpy().data)
                del data
            del full
    finally:
        if f is not None:
            f.close()
    if writer:
        os.replace(tmp, file)


def _tiny_lm_as_llama(model: nn.Module) -> tuple[Any | None, Callable[[str], str] | None]:
    """The ``LlamaConfig`` and name map of a GQA TinyLM (``(None, None)`` for other models)."""
    from cp_modules.models import TinyLM

    if not isinstance(model, TinyLM) or model.config.attention != "gqa":
        return None, None
    c = model.config
    if c.qkv_bias:
        raise ValueError(
            "a TinyLM with qkv_bias=True (biases on q/k/v, none on o_proj) is not a Llama "
            "(attention_bias puts one on o_proj too): pass config= and rename= for its target"
        )
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim or c.hidden_size // c.num_heads,
        attention_bias=False,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False,
    )
    return config, lambda name: name if name.startswith("lm_head.") else "model." + name
