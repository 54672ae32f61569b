"""The "operating system" of minipaged: ``kv/`` (addressing: blocks, block tables, the
KV-cache manager) and ``sched/`` (scheduling: requests, vLLM v1's scheduler, the paper's
scheduler, the baselines). Pure Python, importable without torch.
"""

from minipaged.core.kv import (
    NONE_HASH,
    BlockPool,
    BlockSpaceManager,
    BlockTable,
    ContiguousAllocator,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    KVCacheUsage,
    cdiv,
    hash_block_tokens,
)
from minipaged.core.sched import (
    PaperScheduler,
    PaperSchedulerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    StaticBatchScheduler,
    StaticPagedScheduler,
)

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
    "PaperScheduler",
    "PaperSchedulerOutput",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "StaticBatchScheduler",
    "StaticPagedScheduler",
    "cdiv",
    "hash_block_tokens",
]
