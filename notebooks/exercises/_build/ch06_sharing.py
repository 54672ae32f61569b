"""Generator of notebooks/exercises/ch06_sharing.ipynb (chapter 06 exercises)."""

from _common import ExerciseNotebook

nb = ExerciseNotebook(
    chapter="ch06",
    filename="ch06_sharing.ipynb",
    title="Chapter 06 exercises: sharing blocks",
    minutes=50,
    intro="""
    Companion to `notebooks/06_sharing.ipynb`. Paging lets sequences share physical blocks,
    like processes share pages after `fork()`. You will write the fork itself,
    copy-on-write when a shared block is written, the chained block hash, and the
    prefix-cache lookup. The checks run your code and a reference side by side on random
    sequences of allocations, forks, appends and frees, and call
    `KVCacheManager.check_invariants()` (a block's `ref_cnt` equals the number of block
    tables holding it; the free queue holds exactly the blocks with `ref_cnt == 0`) after
    every step.

    A `KVCacheManager` keeps `block_tables[request_id]` (its `BlockTable`: `.blocks`, a
    list of `KVCacheBlock`, and `.num_tokens`), `block_size`, and a `block_pool`:
    `get_num_free_blocks()`, `get_new_blocks(n)` (each with `ref_cnt == 1`),
    `touch(blocks)` (`ref_cnt += 1`, leaving the free queue if it was there),
    `free_blocks(blocks)` (`ref_cnt -= 1`, back to the free queue at 0), and for prefix
    caching `get_cached_block(block_hash)` -> a block or `None`. The package's own
    `KVCacheManager.fork` and `allocate_slots` (which does copy-on-write itself) are the
    reference here, so they are switched off on the manager your code gets.
    """,
)

nb.setup("""
from minipaged.core import BlockPool, BlockTable, KVCacheBlock, KVCacheManager, hash_block_tokens
""")

nb.exercise(
    "ex6.1", "fork: share every block",
    """
    Parallel sampling and beam search start several sequences from one prompt. Write
    `fork(kv_cache_manager, parent_id, child_id)`: the child gets a block table of its own
    (a new `BlockTable` with a new list) holding the *same* blocks as the parent, every one
    of them gets one more reference (`ref_cnt`), and the child's `num_tokens` is the
    parent's. No KV is copied.
    Raise `ValueError` if the parent holds no blocks or the child already does.
    """,
    """
    def fork(kv_cache_manager: KVCacheManager, parent_id: str, child_id: str) -> None:
        \"\"\"The child shares every block of the parent.\"\"\"
        ### BEGIN SOLUTION
        m = kv_cache_manager
        if parent_id not in m.block_tables:
            raise ValueError(f"unknown parent {parent_id!r}")
        if child_id in m.block_tables:
            raise ValueError(f"{child_id!r} already has blocks")
        parent = m.block_tables[parent_id]
        blocks = list(parent.blocks)
        m.block_pool.touch(blocks)
        m.block_tables[child_id] = BlockTable(blocks, parent.num_tokens, m.block_size)
        ### END SOLUTION
    """,
    ["fork"],
)

nb.exercise(
    "ex6.2", "append a token, with copy-on-write",
    """
    Write `append_slot(kv_cache_manager, request_id)`: make room for one more token of the
    request (`n = block_tables[request_id].num_tokens` tokens so far) and return the block copies the
    engine must do before the model writes, as a list of `(src_block_id, dst_block_id)`:

    - if `n % block_size == 0` the last block is full: take one new block (`[]` copies);
    - else if the last block's `ref_cnt == 1` it is ours alone: write in place (`[]`);
    - else it is shared and partly filled, and writing into it would change the other
      sequences' KV: *copy on write*. Take a new block, drop our reference to the old one
      (`block_pool.free_blocks([old])`), put the new block in its place in our table, and
      return `[(old.block_id, new.block_id)]`.

    If a new block is needed and none is free, return `None` and change nothing. Otherwise
    the table's `num_tokens` grows by one.
    """,
    """
    def append_slot(kv_cache_manager: KVCacheManager, request_id: str):
        \"\"\"Room for one more token: the copies to do, or None if no block is free.\"\"\"
        ### BEGIN SOLUTION
        m = kv_cache_manager
        t = m.block_tables[request_id]
        table, n = t.blocks, t.num_tokens
        copies = []
        if n % m.block_size == 0:
            if m.block_pool.get_num_free_blocks() == 0:
                return None
            table.extend(m.block_pool.get_new_blocks(1))
        elif table[-1].ref_cnt > 1:
            if m.block_pool.get_num_free_blocks() == 0:
                return None
            old, new = table[-1], m.block_pool.get_new_blocks(1)[0]
            m.block_pool.free_blocks([old])
            table[-1] = new
            copies.append((old.block_id, new.block_id))
        t.num_tokens = n + 1
        return copies
        ### END SOLUTION
    """,
    ["append_slot"],
)

nb.exercise(
    "ex6.3", "the chained block hash",
    """
    Prefix caching keys each *full* block by a hash of its tokens *and of everything
    before it*, so equal hashes mean equal prefixes. Write `block_hashes(token_ids,
    block_size)`: for blocks `j = 0, 1, ...` that are full,
    `h_j = hash_block_tokens(h_{j-1}, token_ids[j * block_size:(j + 1) * block_size])`
    with `h_{-1} = None`. A last, partly filled block has no hash. Return `[h_0, h_1, ...]`.
    """,
    """
    def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
        \"\"\"The chained hash of every full block of `token_ids`.\"\"\"
        ### BEGIN SOLUTION
        hashes, parent = [], None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = hash_block_tokens(parent, token_ids[start : start + block_size])
            hashes.append(parent)
        return hashes
        ### END SOLUTION
    """,
    ["block_hashes"],
)

nb.exercise(
    "ex6.4", "the prefix-cache lookup",
    """
    Write `find_cached_blocks(block_pool, token_ids, block_size)`: the blocks already
    holding the longest cached prefix of a new prompt. Walk its full blocks in order, look
    each hash up with `block_pool.get_cached_block(h)`, and stop at the first miss (a later
    block cannot be reused without the ones before it). Look at no more than
    `(len(token_ids) - 1) // block_size` blocks: the last token must always be computed,
    because its logits give the first output token. Return the list of blocks found; do
    not change the pool (the allocator takes references later).
    """,
    """
    def find_cached_blocks(block_pool: BlockPool, token_ids: list[int], block_size: int) -> list[KVCacheBlock]:
        \"\"\"Cached blocks of the longest cached prefix (at most len(token_ids) - 1 tokens).\"\"\"
        ### BEGIN SOLUTION
        max_blocks = (len(token_ids) - 1) // block_size
        found = []
        for block_hash in block_hashes(token_ids, block_size)[:max_blocks]:
            block = block_pool.get_cached_block(block_hash)
            if block is None:
                break
            found.append(block)
        return found
        ### END SOLUTION
    """,
    ["find_cached_blocks"],
)

nb.outro("""
## Recap

A fork costs no KV at all: only reference counts. The first write into a shared, partly
filled block copies just that block. Prefix caching is the same sharing across requests,
found by a chained hash instead of a fork; freed cached blocks stay findable until the
free queue hands them out again, which makes eviction LRU.
""")

if __name__ == "__main__":
    nb.build()
