"""Pure-PyTorch oracles of the KV-cache writes (the CPU implementation of the ``cp`` ops).

Shape letters: T = new tokens, NB = physical blocks, BS = tokens per block, Hkv = KV heads,
D = head dim, R = kv_lora_rank, P = rope dim. A slot is ``block_id * BS + offset``; slot -1 means
"not stored here" and is skipped.
"""

from __future__ import annotations

import torch

from cp_modules.cache.kv_dtype import is_fp8, quantize_fp8

__all__ = ["write_kv_cache_ref", "write_mla_cache_ref"]


def _split_slots(slot_mapping: torch.Tensor, block_size: int):
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.int64)
    return valid, slots // block_size, slots % block_size


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``k, v`` [T, Hkv, D] into ``k_cache, v_cache`` [NB, BS, Hkv, D] at their slots.

    Tokens with slot -1 are skipped; values are cast to the cache dtype, and for an fp8 cache
    quantized with ``k_scale``, ``v_scale`` ([Hkv] or [1] fp32; None: 1.0).
    """
    valid, blk, off = _split_slots(slot_mapping, k_cache.shape[1])
    k_cache[blk, off] = _stored(k[valid], k_cache.dtype, k_scale)
    v_cache[blk, off] = _stored(v[valid], v_cache.dtype, v_scale)


def _stored(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    if not is_fp8(dtype):
        return x.to(dtype)
    if scale is None:
        scale = torch.ones(1, dtype=torch.float32, device=x.device)
    return quantize_fp8(x, scale)


def write_mla_cache_ref(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Store ``[kv_c | k_pe]`` ([T, R] and [T, P]) into ``cache`` [NB, BS, R + P] at their slots
    (an fp8 cache: quantized with the one-element ``scale``; None: 1.0)."""
    valid, blk, off = _split_slots(slot_mapping, cache.shape[1])
    r = kv_c.shape[-1]
    cache[blk, off, :r] = _stored(kv_c[valid], cache.dtype, scale)
    cache[blk, off, r:] = _stored(k_pe[valid], cache.dtype, scale)
