"""The tensors of a HuggingFace safetensors directory, read a box at a time.

:class:`CheckpointIndex` parses the headers of every ``*.safetensors`` file of a directory (a
single ``model.safetensors`` or shards listed by ``model.safetensors.index.json``) without
reading any tensor data. :meth:`CheckpointIndex.read` reads one box of one tensor (a slice per
dimension) with ``os.pread``: only the bytes of the rows the box covers, in chunks of bounded
size, copied into the destination tensor chunk by chunk. Nothing is memory-mapped, so the pages
of the file do not count in the reader's resident memory and no whole tensor is ever held
unless the box is the whole tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CheckpointIndex", "TensorEntry", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# Rows are read in chunks of at most this many bytes (of the file), so a box read never holds
# more than one chunk beside its destination.
READ_CHUNK_BYTES = 16 * 2**20

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, dtype, shape and byte range (absolute, in the file)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _read_header(file: Path) -> dict[str, TensorEntry]:
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ValueError(f"{file}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{file}: unreadable safetensors header ({e})") from None
    base = 8 + n
    size = file.stat().st_size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}, which the sharded "
                f"loader does not read (known: {sorted(SAFETENSORS_DTYPES)})"
            )
        start, end = (base + int(o) for o in info["data_offsets"])
        shape = tuple(int(s) for s in info["shape"])
        if end - start != math.prod(shape) * dtype.itemsize or end > size:
            raise ValueError(
                f"{file}: tensor {name!r} of shape {shape} and dtype {dtype} does not fit its "
                f"byte range {info['data_offsets']} (file of {size} bytes): a truncated file?"
            )
        out[name] = TensorEntry(file, dtype, shape, start, end)
    return out


class CheckpointIndex:
    """The tensors of a HF safetensors directory (headers only; data read on demand).

    Raises:
        ValueError: the directory does not exist, holds no ``*.safetensors`` file, its index
            names a missing file, or a header is malformed.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"checkpoint directory {str(self.path)!r} does not exist")
        index = self.path / INDEX_NAME
        if index.exists():
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted({self.path / v for v in weight_map.values()})
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise ValueError(f"{index} names files that do not exist: {missing}")
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"{str(self.path)!r} holds no *.safetensors file (the sharded loader reads "
                "save_pretrained's safetensors layout; for a GGUF file use from_pretrained)"
            )
        self.files = files
        self._fds: dict[Path, int] = {}
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            for name, entry in _read_header(file).items():
                if name in self.entries:
                    raise ValueError(
                        f"tensor {name!r} is in both {self.entries[name].file} and {file}"
                    )
                self.entries[name] = entry

    def _fd(self, file: Path) -> int:
        # One descriptor per file until close(): reads are positional (pread).
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries[name]

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data over all files."""
        return sum(e.nbytes for e in self.entries.values())

    @property
    def largest_tensor_bytes(self) -> int:
        return max((e.nbytes for e in self.entries.values()), default=0)

    def read(self, name: str, box: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy ``tensor[box]`` of checkpoint tensor ``name`` into ``out`` (any dtype, device).

        ``box`` has one ``slice(start, stop)`` per dimension (step 1); ``out`` has the box's
        shape. The rows of dimension 0 that the box covers are read in chunks of about
        ``READ_CHUNK_BYTES``; each chunk is cut to the box and copied into ``out``.
        """
        entry = self.entries[name]
        shape = entry.shape
        if len(box) != len(shape):
            raise ValueError(f"box {box} for tensor {name!r} of shape {shape}")
        if not shape:  # a scalar
            buf = os.pread(self._fd(entry.file), entry.nbytes, entry.start)
            out.copy_(torch.frombuffer(bytearray(buf), dtype=entry.dtype).reshape(()))
            return
        starts = [b.start or 0 for b in box]
        stops = [shape[i] if b.stop is None else b.stop for i, b in enumerate(box)]
        want = tuple(b - a for a, b in zip(starts, stops))
        if tuple(out.shape) != want:
            raise ValueError(f"destination of shape {tuple(out.shape)} for box {want} of {name!r}")
        if 0 in want:
            return
        row_bytes = math.prod(shape[1:]) * entry.dtype.itemsize
        rows_per_chunk = max(1, READ_CHUNK_BYTES // max(row_bytes, 1))
        fd = self._fd(entry.file)
        r = starts[0]
        while r < stops[0]:
            n = min(rows_per_chunk, stops[0] - r)
            raw = bytearray(n * row_bytes)
            got = os.preadv(fd, [raw], entry.start + r * row_bytes)
            if got != len(raw):
                raise ValueError(f"{entry.file}: short read of tensor {name!r}")
            chunk = torch.frombuffer(raw, dtype=entry.dtype).view(n, *shape[1:])
            rest = tuple(slice(a, b) for a, b in zip(starts[1:], stops[1:]))
            piece = chunk[(slice(None),) + rest]
            out[r - starts[0] : r - starts[0] + n].copy_(piece)
            del chunk, piece, raw
            r += n
