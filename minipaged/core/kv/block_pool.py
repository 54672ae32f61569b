"""BlockPool: the physical KV blocks, who holds them, and which are free.

Mirrors vLLM ``vllm/v1/core/block_pool.py``.

Inputs / outputs
    ``get_new_blocks(n)`` -> ``n`` blocks taken from the front of the free queue, each with
    ``ref_cnt == 1``; ``free_blocks(blocks)`` drops one reference from each and returns
    the blocks that reached zero to the free queue; ``touch(blocks)`` adds a
    reference (sharing: a fork, or a prefix-cache hit), pulling the block out of the free
    queue if it was there. ``get_num_free_blocks()`` and ``get_usage()`` report occupancy.

    With ``enable_caching`` the pool also keeps ``cached_blocks``: full blocks keyed by
    ``hash_block_tokens``, several per hash when two requests computed the same prefix
    (as vLLM: a block is cached when it is filled, even if a copy is cached already, so a
    block table never changes; ``get_cached_block`` gives the first cached copy still
    there; ``cached_block_hash_to_block`` is that view). A cached block whose ``ref_cnt``
    falls to zero stays cached (and in the free queue) so it can be hit again, until
    ``get_new_blocks`` hands it out to someone else: that is LRU eviction, because the
    free queue is in free order.

    The free order (``free_uncached_first``, default True: vLLM 0.32's, chapter 02): a
    freed block without a hash holds nothing anyone can hit again, so it goes to the
    *front* of the free queue (reused first); a cached one goes to the back, so cached
    blocks are evicted least recently used first. ``False`` puts every freed block at the
    back (the paper's scheduler keeps that order; a negative control for vLLM's).

Invariants (``check_invariants``)
    every block is either in the free queue with ``ref_cnt == 0`` or out of it with
    ``ref_cnt > 0``; a block carries a hash iff it is cached under that hash.
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
    def __init__(
        self, num_blocks: int, enable_caching: bool = False, free_uncached_first: bool = True
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_uncached_first = bool(free_uncached_first)
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}, the copies in the order they were cached
        self.cached_blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}

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
        """Drop one reference from each block; blocks reaching 0 go to the free queue:
        without a hash to the front, in the order given (the first given is handed out
        first), cached ones to the back (``free_uncached_first``, vLLM 0.32's order).

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
        front = []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if self.free_uncached_first and b.block_hash is None:
                    front.append(b)
                else:
                    self.free_block_queue.append(b)
        for b in reversed(front):
            self.free_block_queue.appendleft(b)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (sharing); a free block leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    # -- prefix caching -----------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        """The first cached copy of ``block_hash`` still cached, or None."""
        copies = self.cached_blocks.get(block_hash)
        return next(iter(copies.values())) if copies else None

    @property
    def cached_block_hash_to_block(self) -> dict[BlockHash, KVCacheBlock]:
        """hash -> the block a hit gets (``get_cached_block``); a new dict, for reading."""
        return {h: next(iter(copies.values())) for h, copies in self.cached_blocks.items()}

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record a full block under ``block_hash``, also when a copy is cached already."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, {})[block.block_id] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            copies = self.cached_blocks[block.block_hash]
            del copies[block.block_id]
            if not copies:
                del self.cached_blocks[block.block_hash]
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
        num_cached = 0
        for h, copies in self.cached_blocks.items():
            assert copies, "cache map: a hash with no block"
            for i, b in copies.items():
                assert b is self.blocks[i], f"cache map: block {i} is not the pool's"
                assert b.block_hash == h, f"cache map points at {b} under another hash"
            num_cached += len(copies)
        hashed = sum(b.block_hash is not None for b in self.blocks)
        assert hashed == num_cached, f"{hashed} blocks carry a hash, {num_cached} are cached"

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, free={self.get_num_free_blocks()})"
