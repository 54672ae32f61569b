"""KV-cache blocks, the free-block queue, and block hashing.

Mirrors vLLM ``vllm/v1/core/kv_cache_utils.py``.

Concept
    The KV cache is cut into fixed-size *blocks* of ``block_size`` token slots. A
    ``KVCacheBlock`` is the bookkeeping for one physical block: its id (its index in the
    cache tensors), how many block tables hold it (``ref_cnt``) and, once it is full and
    prefix caching is on, the hash of the tokens it holds.

Inputs / outputs
    ``FreeKVCacheBlockQueue(blocks)`` holds the blocks nobody uses, in eviction order
    (least recently freed first). ``popleft()`` takes the next block to hand out;
    ``remove(block)`` takes a block out of the middle (a cached block that is reused);
    ``append(block)`` puts a freed block at the back (``appendleft`` at the front: a freed
    block without a hash, in ``BlockPool``'s default order, vLLM 0.32's). All are O(1):
    the queue is a doubly linked list threaded through the blocks themselves, as in vLLM.

    ``hash_block_tokens(parent_hash, token_ids)`` -> bytes: a sha256 chained over the
    parent block's hash, so equal hashes mean equal *prefixes*, not just equal blocks.
    It never uses Python's ``hash()``, which is salted per process and would make prefix
    cache hits (and notebook output) change from run to run.

Invariants (``FreeKVCacheBlockQueue.check_invariants``)
    the links are consistent both ways; ``num_free_blocks`` equals the number of linked
    blocks; no block appears twice.

Failure mode
    ``popleft()`` on an empty queue raises ``ValueError``; removing a block that is not
    in the queue raises ``RuntimeError`` (an internal bookkeeping bug).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

BlockHash = bytes

# The parent hash of a request's first block.
NONE_HASH: BlockHash = hashlib.sha256(b"minipaged:none").digest()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Bookkeeping for one physical KV block."""

    block_id: int
    ref_cnt: int = 0
    # Set when the block is full and cached (prefix caching); None otherwise.
    block_hash: Optional[BlockHash] = None
    # Links of the free queue; None when the block is not in the queue.
    prev_free_block: Optional[KVCacheBlock] = None
    next_free_block: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        h = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft / remove / append.

    NOTE: a ``collections.deque`` would do for popleft/append, but prefix caching must
    pull a *specific* free block out of the middle when a cached block is hit again, and
    ``deque.remove`` is O(n). Threading the links through the blocks makes it O(1).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels: head.next is the first free block, tail.prev the last.
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the first (least recently freed) block."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (it will be evicted last)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front (it will be handed out next)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        first = self._head.next_free_block
        assert first is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        block.next_free_block = first
        first.prev_free_block = block
        self.num_free_blocks += 1

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None

    def __len__(self) -> int:
        return self.num_free_blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in queue order (for tests and pictures)."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out

    def check_invariants(self) -> None:
        seen: set[int] = set()
        prev = self._head
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None, "free queue: broken forward link"
            assert block.prev_free_block is prev, f"free queue: back link of {block} is wrong"
            assert block.block_id not in seen, f"free queue: {block} appears twice"
            seen.add(block.block_id)
            prev, block = block, block.next_free_block
        assert self._tail.prev_free_block is prev, "free queue: tail link is wrong"
        assert len(seen) == self.num_free_blocks, (
            f"free queue: num_free_blocks={self.num_free_blocks} but {len(seen)} linked"
        )


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: Iterable[int]) -> BlockHash:
    """sha256 of (parent block hash, this block's token ids): a key for the whole prefix."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else NONE_HASH)
    for t in token_ids:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.digest()


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens at ``b`` tokens per block."""
    return -(-a // b)


def check_positive_int(name: str, value, minimum: int = 1) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= ``minimum`` (default 1: > 0;
    the one such check)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
