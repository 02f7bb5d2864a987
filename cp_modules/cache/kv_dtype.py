"""KV-cache precision: ``kv_cache_dtype`` ("bf16" or "fp8_e4m3"), fp8 scales and their checks.

Shape letters: H = KV heads of the cache (1 for an MLA latent cache).

An fp8 cache stores ``x / scale`` rounded to ``torch.float8_e4m3fn`` (saturated to +-448) and the
decode kernels read ``fp8 * scale``: the key scale is folded into the softmax scale and the
value scale into the output, so neither costs a multiply per element. Scales are static:
one per cache tensor (vLLM's ``k_scale`` / ``v_scale``, default 1.0) or one per KV head, as
fp32 device tensors ``[H]`` so that CUDA graphs and ``torch.compile`` see tensors, not
constants. Why static per-tensor scales (measured): ``docs/experiments/2026-12-02-fp8-kv-scaling.md``.
Beside an fp8 cache, :mod:`cp_modules.cache.exact_window` can keep each request's first tokens
and every decode query's newest ones unquantized (``kv_cache_fp8_sink`` / ``_recent``).

``"bf16"`` is the unquantized cache: it keeps the layer's own K/V dtype (bf16 for served
models, fp32 in CPU tests), exactly as before fp8 existed.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "KV_CACHE_DTYPES",
    "check_fp8_device",
    "check_kv_cache_dtype",
    "dequantize_fp8",
    "is_fp8",
    "kv_cache_storage_dtype",
    "kv_scale",
    "quantize_fp8",
]

KV_CACHE_DTYPES = ("bf16", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """``kv_cache_dtype`` itself, or ValueError naming the option and the valid values."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return kv_cache_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def check_fp8_device(device: torch.device | str | None) -> None:
    """ValueError unless ``device`` can convert to and from fp8 e4m3 in the kernels.

    CPU always can (torch's float8 types, the reference path); CUDA needs compute capability
    8.9 (Ada) or newer for the hardware conversions the Triton kernels use.
    """
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ValueError(f"kv_cache_dtype='fp8_e4m3' is served on CPU and CUDA, not {dev.type}")
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        raise ValueError(
            f"kv_cache_dtype='fp8_e4m3' needs a GPU with fp8 conversions (compute capability "
            f">= 8.9: Ada, Hopper, Blackwell); {torch.cuda.get_device_name(dev)} is "
            f"{cap[0]}.{cap[1]}: use kv_cache_dtype='bf16'"
        )


def kv_cache_storage_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.dtype:
    """The torch dtype a cache of ``kv_cache_dtype`` is allocated in.

    Raises:
        ValueError: for an unknown ``kv_cache_dtype`` or fp8 on a device without fp8.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "bf16":
        return model_dtype
    check_fp8_device(device)
    return FP8_DTYPE


def kv_scale(
    value: float | torch.Tensor | None,
    num_heads: int,
    *,
    name: str = "k_scale",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A checked fp32 scale tensor ``[num_heads]`` from a scalar, a per-head vector or None (1.0).

    Raises:
        ValueError: unless ``value`` is a positive finite scalar (a number, a 0-d or 1-element
            tensor) or a vector of ``num_heads`` positive finite values; the message names
            ``name``.
    """
    if value is None:
        return torch.ones(num_heads, dtype=torch.float32, device=device)
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise ValueError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    t = torch.as_tensor(value).detach().to(torch.float32).cpu()
    if t.numel() == 1 and t.dim() <= 1:
        t = t.reshape(1).expand(num_heads)
    elif t.shape != (num_heads,):
        raise ValueError(
            f"{name} must be a scalar or one value per KV head ([{num_heads}]), got shape "
            f"{tuple(t.shape)}"
        )
    bad = [float(x) for x in t.tolist() if not (math.isfinite(x) and x > 0)]
    if bad:
        raise ValueError(f"{name} must hold positive finite values, got {bad[:4]}")
    return t.contiguous().to(device)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, head_dim: int = -2) -> torch.Tensor:
    """``x / scale`` saturated to +-448 and rounded (nearest even) to fp8 e4m3.

    ``scale`` [H] scales dim ``head_dim`` of ``x`` (a 1-element scale: all of it).
    """
    s = scale.to(torch.float32)
    if s.numel() > 1:
        shape = [1] * x.dim()
        shape[head_dim] = s.numel()
        s = s.view(shape)
    else:
        s = s.reshape(())
    return (x.to(torch.float32) / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(
    x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, head_dim: int = -2
) -> torch.Tensor:
    """``x * scale`` in ``dtype`` (an fp8 ``x``); any other ``x`` is only cast to ``dtype``."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.to(torch.float32)
    if scale is not None:
        s = scale.to(torch.float32)
        if s.numel() > 1:
            shape = [1] * x.dim()
            shape[head_dim] = s.numel()
            s = s.view(shape)
        else:
            s = s.reshape(())
        y = y * s
    return y.to(dtype)
