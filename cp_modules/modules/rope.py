"""Rotary position embeddings on true token positions (PCP hands each rank scattered positions).

Shapes: x [T, H, D]; positions [T] (int64); cos/sin [T, D_rot].
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary"]


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by angles given as ``cos``/``sin [T, D]`` (rotate-half layout).

    ``interleaved=True`` treats (x[2i], x[2i+1]) as the pairs (DeepSeek's rope layout) and
    returns the result in rotate-half order, as DeepSeek-V3's reference does.
    """
    if interleaved:
        t, h, d = x.shape
        x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, computed on the fly in fp32 (no cached max length)."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dim must be even, got {dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    inv_freq: torch.Tensor

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
