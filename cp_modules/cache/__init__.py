"""Paged KV cache with DCP sharding: allocator, block tables, slot mapping, local lengths."""

from cp_modules.cache.dcp import (
    dcp_local_offset,
    dcp_max_local_len,
    dcp_num_blocks,
    dcp_query_kv_len,
    dcp_rank_of,
    dcp_scheduler_block_size,
    dcp_slot_mapping,
    local_seq_len,
)
from cp_modules.cache.paged import (
    BlockAllocator,
    BlockTable,
    NoFreeBlocksError,
    allocate_kv_cache,
    allocate_mla_cache,
    dcp_token_capacity,
    is_token_minor,
    kv_cache_bytes_per_block,
    num_blocks_for_memory,
    to_token_minor,
)

__all__ = [
    "BlockAllocator",
    "BlockTable",
    "NoFreeBlocksError",
    "allocate_kv_cache",
    "allocate_mla_cache",
    "dcp_local_offset",
    "dcp_max_local_len",
    "dcp_num_blocks",
    "dcp_query_kv_len",
    "dcp_rank_of",
    "dcp_scheduler_block_size",
    "dcp_slot_mapping",
    "dcp_token_capacity",
    "is_token_minor",
    "kv_cache_bytes_per_block",
    "local_seq_len",
    "num_blocks_for_memory",
    "to_token_minor",
]
