"""Byte-level causal-LM samples cut from a text file (vocabulary: the 256 byte values)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["ByteTextDataset"]


class ByteTextDataset(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes of a file as next-token samples.

    Sample ``i``: ``input_ids`` = bytes ``[i*S, (i+1)*S)``, ``labels`` = the bytes one further
    (``S = seq_len``), and ``index`` = ``i`` (so tests and logs can tell samples apart).

    Raises:
        ValueError: if ``seq_len`` < 1 or the file holds fewer than ``seq_len + 1`` bytes.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        data = Path(path).read_bytes()
        if len(data) < seq_len + 1:
            raise ValueError(
                f"{str(path)!r} holds {len(data)} bytes; seq_len={seq_len} needs at least "
                f"{seq_len + 1}"
            )
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        w = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return {"input_ids": w[:-1], "labels": w[1:], "index": torch.tensor(i)}
