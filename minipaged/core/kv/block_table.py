"""BlockTable: one request's blocks and token count, and the slot-mapping formula.

The scheduler side of a block table: vLLM v1 keeps these rows in its KV-cache manager
(``vllm/v1/core/single_type_kv_cache_manager.py``, ``req_to_blocks``). Our
``KVCacheManager`` (and the paper's ``BlockSpaceManager``, which also holds
``cpu_block_tables`` for swapped-out requests) owns the tables and is the only one that
changes them. The model runner never reads them: it keeps its own rows from each step's
``SchedulerOutput`` (as vLLM's ``vllm/v1/worker/block_table.py``) and builds
``slot_mapping`` with the same formula.

The formula (chapter 02): token ``i`` of the request lives in slot::

    slot(i) = block_ids[i // block_size] * block_size + i % block_size

Invariants: ``len(blocks) == ceil(num_tokens / block_size)``.
Failure mode: a token outside ``[0, num_tokens)`` raises ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipaged.core.kv.block import KVCacheBlock

PAD_SLOT_ID = -1  # slot id for padding tokens: reshape_and_cache skips it


@dataclass(slots=True)
class BlockTable:
    blocks: list[KVCacheBlock]  # logical block j -> physical block blocks[j]
    num_tokens: int  # tokens its slots are allocated for
    block_size: int
    num_cached_blocks: int = 0  # prefix caching: its leading blocks registered in the cache

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def slot(self, i: int) -> int:
        """The slot of token ``i`` in the flat cache."""
        bs = self.block_size
        return self.blocks[i // bs].block_id * bs + i % bs

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Slots of tokens ``start .. end - 1``."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"token span [{start}, {end}) outside the {self.num_tokens} allocated tokens")
        return [self.slot(i) for i in range(start, end)]
