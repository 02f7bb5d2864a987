"""Pure-PyTorch oracles of the KV-cache writes (the CPU implementation of the ``cp`` ops).

Shape letters: T = new tokens, NB = physical blocks, BS = tokens per block, Hkv = KV heads,
D = head dim, R = kv_lora_rank, P = rope dim. A slot is ``block_id * BS + offset``; slot -1 means
"not stored here" and is skipped.
"""

from __future__ import annotations

import torch

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
) -> None:
    """Store ``k, v`` [T, Hkv, D] into ``k_cache, v_cache`` [NB, BS, Hkv, D] at their slots.

    Tokens with slot -1 are skipped; values are cast to the cache dtype.
    """
    valid, blk, off = _split_slots(slot_mapping, k_cache.shape[1])
    k_cache[blk, off] = k[valid].to(k_cache.dtype)
    v_cache[blk, off] = v[valid].to(v_cache.dtype)


def write_mla_cache_ref(
    kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``[kv_c | k_pe]`` ([T, R] and [T, P]) into ``cache`` [NB, BS, R + P] at their slots."""
    valid, blk, off = _split_slots(slot_mapping, cache.shape[1])
    r = kv_c.shape[-1]
    cache[blk, off, :r] = kv_c[valid].to(cache.dtype)
    cache[blk, off, r:] = k_pe[valid].to(cache.dtype)
