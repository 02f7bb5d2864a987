"""Arrival counters of the decode kernels' in-kernel split merges (the Gluon MLA kernel's
fused and spread merges, the register-operand kernel's spread merge): zeroed int32 workspaces
kept per device and stream, which every launch leaves at 0 again.
"""

from __future__ import annotations

import torch

__all__ = ["merge_counters", "reserve_merge_counters"]

# One int32 per (query, head tile) row, per device and stream. Every launch leaves them at 0
# (the last program of a row resets its counter), so one buffer serves every later launch on
# its stream, eager or replayed from a CUDA graph. Buffers are never freed or shrunk: a
# captured graph keeps the address it was captured with.
_MIN_COUNTERS = 1024
_counters: dict[tuple[torch.device, int], torch.Tensor] = {}
_retired_counters: list[torch.Tensor] = []


def _stream_key(device: torch.device) -> tuple[torch.device, int]:
    if device.type != "cuda":
        return device, 0
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, torch.cuda.current_stream(device).cuda_stream


def merge_counters(device: torch.device, num_rows: int) -> torch.Tensor:
    """The in-kernel merges' zeroed arrival counters (int32, at least ``num_rows``) for launches on
    the current stream of ``device``.

    Kept per device and stream: launches that run at the same time on different streams
    never share counters (launches on one stream run one after another). Grown to the next
    power of two (at least 1024 rows) when a launch needs more; an outgrown buffer is kept
    alive, since a CUDA graph captured with it still uses its address. Nothing is allocated
    while the stream captures a graph, unless this stream has no buffer that large yet: then
    the buffer is allocated once into that graph's memory pool (zeroed by a memset captured
    before the kernel), kept, and reused by later launches and captures on the stream. Run
    one eager call of the largest size on the capture stream, or call
    :func:`reserve_merge_counters` there, before capturing to avoid even that.
    """
    key = _stream_key(device)
    buf = _counters.get(key)
    if buf is None or buf.numel() < num_rows:
        size = max(_MIN_COUNTERS, 1 << max(0, num_rows - 1).bit_length())
        if buf is not None:
            _retired_counters.append(buf)
        buf = torch.zeros(size, dtype=torch.int32, device=key[0])
        _counters[key] = buf
    return buf


def reserve_merge_counters(device: torch.device | str, num_rows: int) -> None:
    """Allocate the in-kernel merges' counters for ``num_rows`` (query, head tile) rows on the
    current stream of ``device`` ahead of a CUDA-graph capture on that stream."""
    merge_counters(torch.device(device), num_rows)
