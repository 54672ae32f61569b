"""The "operating system" of minipaged: blocks, block tables, requests, schedulers.

Pure Python, importable without torch.
"""

from minipaged.core.block_pool import BlockPool
from minipaged.core.contiguous import ContiguousAllocator
from minipaged.core.kv_cache_manager import PAD_SLOT_ID, KVCacheManager, KVCacheUsage
from minipaged.core.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    cdiv,
    hash_block_tokens,
)
from minipaged.core.request import Request, RequestStatus
from minipaged.core.sched_output import SchedulerOutput
from minipaged.core.sched_utils import get_max_num_kv_tokens, record_step, run_scheduler

# NOTE: scheduler before static_scheduler (static_scheduler subclasses its base)
from minipaged.core.scheduler import Scheduler
from minipaged.core.static_scheduler import StaticBatchScheduler

__all__ = [
    "BlockPool",
    "ContiguousAllocator",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheUsage",
    "NONE_HASH",
    "PAD_SLOT_ID",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "StaticBatchScheduler",
    "cdiv",
    "get_max_num_kv_tokens",
    "hash_block_tokens",
    "record_step",
    "run_scheduler",
]
