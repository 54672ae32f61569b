"""BlockTable: one request's blocks and token count, and the slot-mapping formula.

Mirrors vLLM ``vllm/v1/worker/block_table.py`` (the per-request rows the model runner
reads). The ``KVCacheManager`` owns the tables (``block_tables`` in the device pool,
``cpu_block_tables`` while swapped out: swapping moves a table between the two) and is the
only one that changes them; the model runner reads them (``get_block_table(request)``) to
build ``slot_mapping`` and the padded ``block_tables`` tensor.

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
