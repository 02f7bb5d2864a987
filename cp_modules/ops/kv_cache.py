"""``cp::write_kv_cache`` and ``cp::write_mla_cache``: in-place paged KV-cache writes.

Shape letters: T = new tokens, NB = physical blocks, BS = tokens per block, Hkv = KV heads,
D = head dim, R = kv_lora_rank, P = rope dim.

Both ops mutate their cache arguments (declared in the schema, so functionalization and
``opcheck`` see it) and return nothing. A slot is ``block_id * BS + offset``; slot -1 is skipped,
which is how a DCP rank drops the tokens other ranks store (see
:func:`cp_modules.cache.dcp_slot_mapping`). Two tokens with the same slot is undefined.
CPU runs the reference, CUDA the Triton kernel; neither syncs with the host.

An fp8 (``torch.float8_e4m3fn``) cache is written quantized: ``x / scale`` saturated to +-448,
with the optional fp32 scales (``[Hkv]`` per head or ``[1]``; None: 1.0) of
:mod:`cp_modules.cache.kv_dtype`.
"""

from __future__ import annotations

import torch

from cp_modules.cache.kv_dtype import is_fp8
from cp_modules.kernels.cache import write_kv_cache_kernel, write_mla_cache_kernel
from cp_modules.ops._lib import lib
from cp_modules.reference.kv_cache import write_kv_cache_ref, write_mla_cache_ref

__all__ = ["check_gqa_cache_layout", "write_kv_cache", "write_mla_cache"]

lib.define(
    "write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()"
)
lib.define(
    "write_mla_cache(Tensor kv_c, Tensor k_pe, Tensor(a!) cache, Tensor slot_mapping, "
    "Tensor? scale=None) -> ()"
)

lib.impl("write_kv_cache", write_kv_cache_ref, "CPU")
lib.impl("write_kv_cache", write_kv_cache_kernel, "CUDA")
lib.impl("write_mla_cache", write_mla_cache_ref, "CPU")
lib.impl("write_mla_cache", write_mla_cache_kernel, "CUDA")


@torch.library.register_fake("cp::write_kv_cache")
def _write_kv_cache_fake(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    return None


@torch.library.register_fake("cp::write_mla_cache")
def _write_mla_cache_fake(kv_c, k_pe, cache, slot_mapping, scale=None) -> None:
    return None


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int, *tensors: torch.Tensor) -> None:
    devices = {x.device for x in (slot_mapping, *tensors)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be an int32/int64 tensor of shape [T]=[{num_tokens}], got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )


def check_cache_scale(
    scale: torch.Tensor | None, cache: torch.Tensor, num_heads: int, name: str
) -> None:
    """ValueError unless ``scale`` is None or an fp32 [1] / [num_heads] tensor on the cache's
    device (the checked form :func:`cp_modules.cache.kv_dtype.kv_scale` makes); a scale only
    goes with an fp8 cache."""
    if scale is None:
        return
    if not is_fp8(cache.dtype):
        raise ValueError(f"{name} is given but the cache is {cache.dtype}, not fp8")
    if (
        scale.dtype != torch.float32
        or scale.dim() != 1
        or scale.numel() not in (1, num_heads)
        or scale.device != cache.device
    ):
        raise ValueError(
            f"{name} must be an fp32 tensor of shape [1] or [{num_heads}] on {cache.device} "
            f"(see cp_modules.cache.kv_dtype.kv_scale), got {scale.dtype} {tuple(scale.shape)} "
            f"on {scale.device}"
        )


def check_gqa_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError unless ``k_cache`` is contiguous in its last dim and ``v_cache`` in its last
    dim or its token dim (token-minor, :func:`cp_modules.cache.paged.allocate_kv_cache`)."""
    if k_cache.stride(-1) != 1 or (v_cache.stride(-1) != 1 and v_cache.stride(1) != 1):
        raise ValueError(
            "k_cache must be contiguous in its last dim and v_cache in its last dim or its token "
            f"dim (token-minor); got strides {k_cache.stride()} and {v_cache.stride()}"
        )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's K/V at its cache slot, in place; tokens with slot -1 are skipped.

    Args:
        k, v: [T, Hkv, D] (any float dtype; cast to the cache dtype, quantized for fp8).
        k_cache, v_cache: [NB, BS, Hkv, D], last dim contiguous (``v_cache`` may be token-minor
            instead: :func:`check_gqa_cache_layout`); written in place.
        slot_mapping: [T] int32/int64, ``block_id * BS + offset`` or -1.
        k_scale, v_scale: fp8 caches only: fp32 [Hkv] or [1] (None: 1.0).

    Raises:
        ValueError: for mismatched shapes, slot dtype, devices or scales.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [T, Hkv, D]; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [NB, BS, Hkv, D]; got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"k has [Hkv, D]={list(k.shape[1:])} but the cache holds [Hkv, D]="
            f"{list(k_cache.shape[2:])}"
        )
    check_gqa_cache_layout(k_cache, v_cache)
    _check_slots(slot_mapping, k.shape[0], k, v, k_cache, v_cache)
    check_cache_scale(k_scale, k_cache, k_cache.shape[2], "k_scale")
    check_cache_scale(v_scale, v_cache, v_cache.shape[2], "v_scale")
    torch.ops.cp.write_kv_cache(
        _last_dim_contiguous(k), _last_dim_contiguous(v), k_cache, v_cache, slot_mapping,
        k_scale, v_scale,
    )  # fmt: skip


def write_mla_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Store each token's latent and rope key in one cache row, in place; slot -1 is skipped.

    Args:
        kv_c: [T, R] compressed latent.
        k_pe: [T, P] rope key (shared by all heads).
        cache: [NB, BS, R + P], last dim contiguous; written in place.
        slot_mapping: [T] int32/int64, ``block_id * BS + offset`` or -1.
        scale: an fp8 cache only: fp32 [1] for the whole row (None: 1.0).

    Raises:
        ValueError: for mismatched shapes, slot dtype, devices or scale.
    """
    if kv_c.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != kv_c.shape[0]:
        raise ValueError(
            f"kv_c must be [T, R] and k_pe [T, P]; got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}"
        )
    if cache.dim() != 3 or cache.shape[2] != kv_c.shape[1] + k_pe.shape[1]:
        raise ValueError(
            f"cache must be [NB, BS, R + P] = [NB, BS, {kv_c.shape[1] + k_pe.shape[1]}], got "
            f"{tuple(cache.shape)}"
        )
    if cache.stride(-1) != 1:
        raise ValueError("cache must be contiguous in its last dim")
    _check_slots(slot_mapping, kv_c.shape[0], kv_c, k_pe, cache)
    check_cache_scale(scale, cache, 1, "scale")
    torch.ops.cp.write_mla_cache(
        _last_dim_contiguous(kv_c), _last_dim_contiguous(k_pe), cache, slot_mapping, scale
    )
