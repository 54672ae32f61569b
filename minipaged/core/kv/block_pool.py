"""BlockPool: the physical KV blocks, who holds them, and which are free.

Mirrors vLLM ``vllm/v1/core/block_pool.py``.

Inputs / outputs
    ``get_new_blocks(n)`` -> ``n`` blocks taken from the front of the free queue, each with
    ``ref_cnt == 1``; ``free_blocks(blocks)`` drops one reference from each and returns
    the blocks that reached zero to the back of the free queue; ``touch(blocks)`` adds a
    reference (sharing: a fork, or a prefix-cache hit), pulling the block out of the free
    queue if it was there. ``get_num_free_blocks()`` and ``get_usage()`` report occupancy.

    With ``enable_caching`` the pool also keeps ``cached_block_hash_to_block``: full blocks
    keyed by ``hash_block_tokens``. A cached block whose ``ref_cnt`` falls to zero stays in
    the map (and in the free queue) so it can be hit again, until ``get_new_blocks`` hands
    it out to someone else: that is LRU eviction, because the free queue is in free order.

Invariants (``check_invariants``)
    every block is either in the free queue with ``ref_cnt == 0`` or out of it with
    ``ref_cnt > 0``; every cached hash maps to a block carrying that hash.
    (That ``ref_cnt`` equals the number of block tables holding a block is checked by
    ``KVCacheManager.check_invariants``, which owns the tables.)

Failure mode
    asking for more blocks than are free raises ``ValueError`` and takes nothing;
    freeing a block whose ``ref_cnt`` is already 0 (a double free) raises ``ValueError``
    and frees nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from minipaged.core.kv.block import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    # -- allocation ---------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks (ref_cnt becomes 1). All or nothing."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free queue.

        NOTE: callers pass a request's blocks *tail first*, so that when caching is on the
        tail blocks (least likely to be shared by another prefix) are evicted first.
        """
        blocks = list(ordered_blocks)
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for b in blocks:
            if counts[b.block_id] > b.ref_cnt:
                raise ValueError(f"double free: block {b.block_id} has ref_cnt {b.ref_cnt}")
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_block_queue.append(b)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (sharing); a free block leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    # -- prefix caching -----------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record a full block under ``block_hash`` (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return  # the same prefix is already cached in another block
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    # -- reporting ----------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def check_invariants(self) -> None:
        self.free_block_queue.check_invariants()
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"{b} has a negative ref_cnt"
            in_queue = b in self.free_block_queue
            assert in_queue == (b.ref_cnt == 0), f"{b}: in free queue={in_queue} but ref_cnt={b.ref_cnt}"
        for h, b in self.cached_block_hash_to_block.items():
            assert b.block_hash == h, f"cache map points at {b} under another hash"

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, free={self.get_num_free_blocks()})"
