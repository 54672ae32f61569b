"""ADDRESSING: where each token's K/V lives (blocks, the pool, block tables, the manager
that alone does block accounting) and, for comparison, contiguous reservation."""

from minipaged.core.kv.block import NONE_HASH, FreeKVCacheBlockQueue, KVCacheBlock, cdiv, hash_block_tokens
from minipaged.core.kv.block_manager_v0 import BlockSpaceManager
from minipaged.core.kv.block_pool import BlockPool
from minipaged.core.kv.block_table import PAD_SLOT_ID, BlockTable
from minipaged.core.kv.contiguous import ContiguousAllocator
from minipaged.core.kv.kv_cache_manager import KVCacheManager, KVCacheUsage

__all__ = [
    "BlockPool",
    "BlockSpaceManager",
    "BlockTable",
    "ContiguousAllocator",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheUsage",
    "NONE_HASH",
    "PAD_SLOT_ID",
    "cdiv",
    "hash_block_tokens",
]
