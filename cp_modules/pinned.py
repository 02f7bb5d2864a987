"""Pinned host staging for host-to-device copies that must not wait for the GPU."""

from __future__ import annotations

import torch

__all__ = ["pinned_copy"]


def pinned_copy(x: torch.Tensor) -> torch.Tensor:
    """A pinned copy of the CPU tensor ``x``, for a ``non_blocking`` copy to the GPU.

    The memory comes straight from PyTorch's caching host allocator (which keeps a block until
    the copies that read it have run). ``x.pin_memory()`` does the same after asking the
    driver whether ``x`` is pinned already, which took 0.2-1 ms a call on an H200 host: time
    the GPU then waits for the step's first kernel.
    """
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    out.copy_(x)
    return out
