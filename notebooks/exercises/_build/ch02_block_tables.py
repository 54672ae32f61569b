"""Generator of notebooks/exercises/ch02_block_tables.ipynb (chapter 02 exercises)."""

from _common import ExerciseNotebook

from minipaged.checks.ch02 import FIT_BLOCK_SIZES, FIT_LENS, FIT_SLOTS, QUEUE_EVENTS, QUEUE_KNOBS

nb = ExerciseNotebook(
    chapter="ch02",
    filename="ch02_block_tables.ipynb",
    title="Chapter 02 exercises: the free queue, block tables, slot mapping",
    minutes=65,
    intro="""
    Companion to `notebooks/02_block_tables.ipynb`. You will write the four operations
    that make PagedAttention's memory work: taking a block out of the free queue (from the
    middle and from the front), growing a request's block table, and turning token
    positions into cache slots. The checks run your code side by side with
    `minipaged.core` on hundreds of random operation sequences; the package's own
    `popleft` / `remove` / `allocate_slots` are switched off on the objects your code gets.
    """,
)

# NOTE: the setup cell holds the data as literals: a submission may not import minipaged.checks
nb.setup(f"""
from minipaged.core import BlockTable, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager, cdiv

# ex2.5: the manager's knobs; (request id, tokens to add) or (request id, None) = it finishes
QUEUE_KNOBS = {QUEUE_KNOBS!r}
QUEUE_EVENTS = {QUEUE_EVENTS!r}
# ex2.6: final lengths of a workload, the pool's slots, the block sizes measured
FIT_LENS = {FIT_LENS!r}
FIT_SLOTS = {FIT_SLOTS!r}
FIT_BLOCK_SIZES = {FIT_BLOCK_SIZES!r}
""")

nb.exercise(
    "ex2.1",
    "remove a block from the middle of the free queue",
    """
    `FreeKVCacheBlockQueue` is a doubly linked list threaded through the blocks
    themselves: each `KVCacheBlock` has `prev_free_block` and `next_free_block`, and the
    queue has two sentinel blocks, `queue._head` (before the first free block) and
    `queue._tail` (after the last), plus a counter `queue.num_free_blocks`. A block that
    is not in the queue has both links `None`.

    Write `remove(queue, block)`: unlink `block` from wherever it is, in O(1) (no walking
    the list), set both of its links to `None`, and decrement `num_free_blocks`. If the
    block is not in the queue, raise `RuntimeError` and change nothing.

    (Prefix caching needs this: a cached block that is free gets hit again and must leave
    the queue from the middle.)
    """,
    """
    def remove(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
        \"\"\"Unlink `block` from the free queue in O(1).\"\"\"
        ### BEGIN SOLUTION
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = None
        block.next_free_block = None
        queue.num_free_blocks -= 1
        ### END SOLUTION
    """,
    ["remove"],
)

nb.exercise(
    "ex2.2",
    "popleft: hand out the least recently freed block",
    """
    Write `popleft(queue)`: take the first block (the one right after `queue._head`) out
    of the queue and return it. Freed cached blocks go to the back (uncached ones to the
    front, reused first), so of the cached blocks the first handed out is the one freed
    longest ago: with prefix caching that makes eviction LRU. If the queue is
    empty, raise `ValueError`. You may call your `remove` from ex2.1.
    """,
    """
    def popleft(queue: FreeKVCacheBlockQueue) -> KVCacheBlock:
        \"\"\"Remove and return the first free block.\"\"\"
        ### BEGIN SOLUTION
        block = queue._head.next_free_block
        if block is queue._tail:
            raise ValueError("no free blocks left")
        remove(queue, block)
        return block
        ### END SOLUTION
    """,
    ["popleft"],
)

nb.exercise(
    "ex2.3",
    "allocate_slots: grow a block table on demand",
    """
    A `KVCacheManager` keeps, per request id, its block table `manager.block_tables[rid]`:
    a `BlockTable` with `.blocks` (a list of `KVCacheBlock`, logical block `j` at index `j`)
    and `.num_tokens`, the number of tokens it has room for. A request not seen before has
    no table.
    `manager.block_size` is the tokens per block, `manager.num_blocks` the pool's size, and
    `manager.block_pool` hands out blocks: `get_num_free_blocks()`, and
    `get_new_blocks(n)`, which takes `n` blocks from the front of the free queue.

    Write `allocate_slots(manager, request_id, num_new_tokens)`: make room for
    `num_new_tokens` more tokens of the request and return the list of blocks newly
    added to its table (`[]` if its last block still had room).

    - Raise `ValueError` if `num_new_tokens <= 0`, or if the request would then need more
      blocks than the whole pool has (it could never run).
    - If there are not enough free blocks right now, return `None` and change nothing:
      all or nothing, so the scheduler can decide whom to preempt.
    - Otherwise append the new blocks to the table and update its `num_tokens` (a new
      request gets `BlockTable(new_blocks, num_new_tokens, manager.block_size)`).

    Hand check: block size 4, a request with 6 tokens holds 2 blocks; 3 more tokens make
    9, which needs `cdiv(9, 4) = 3` blocks, so one new block.
    """,
    """
    def allocate_slots(manager: KVCacheManager, request_id: str, num_new_tokens: int):
        \"\"\"Room for `num_new_tokens` more tokens: the new blocks, or None if the pool is short.\"\"\"
        ### BEGIN SOLUTION
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        table = manager.block_tables.get(request_id)
        total = (0 if table is None else table.num_tokens) + num_new_tokens
        blocks_needed = cdiv(total, manager.block_size)
        if blocks_needed > manager.num_blocks:
            raise ValueError(f"{request_id!r} would need {blocks_needed} blocks, the pool has {manager.num_blocks}")
        num_new_blocks = blocks_needed - (0 if table is None else len(table.blocks))
        if num_new_blocks > manager.block_pool.get_num_free_blocks():
            return None
        new_blocks = manager.block_pool.get_new_blocks(num_new_blocks)
        if table is None:
            manager.block_tables[request_id] = BlockTable(new_blocks, total, manager.block_size)
        else:
            table.blocks.extend(new_blocks)
            table.num_tokens = total
        return new_blocks
        ### END SOLUTION
    """,
    ["allocate_slots"],
)

nb.exercise(
    "ex2.4",
    "slot mapping: where each token's K/V goes",
    """
    The KV cache is one tensor of `num_blocks * block_size` slots. Token `i` of a request
    lives in its logical block `i // block_size`, at offset `i % block_size` inside it; the
    block table says which physical block that logical block is.

    Write `slot_mapping(block_table, block_size, start, end)`: the list of flat slot
    indices of tokens `start, ..., end - 1`. Raise `ValueError` unless
    `0 <= start <= end <= len(block_table) * block_size`.

    Hand check: `block_table=[2, 0]`, `block_size=2`, tokens 1..2 are at slots `[5, 0]`.
    """,
    """
    def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
        \"\"\"Flat cache slot of each token in [start, end).\"\"\"
        ### BEGIN SOLUTION
        if not 0 <= start <= end <= len(block_table) * block_size:
            raise ValueError(f"tokens [{start}, {end}) are outside the block table")
        return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]
        ### END SOLUTION
    """,
    ["slot_mapping"],
)

nb.exercise(
    "ex2.5",
    "predict the free queue (on paper first)",
    """
    A `KVCacheManager(num_blocks=6, block_size=2)`, empty at first, sees these events in
    order (`QUEUE_EVENTS`):

    | event | what happens |
    |---|---|
    | 0 | A allocates 3 tokens |
    | 1 | B allocates 4 tokens |
    | 2 | A allocates 2 more tokens |
    | 3 | B finishes: its blocks are freed |
    | 4 | C allocates 5 tokens |
    | 5 | A finishes |

    Write `predict_free_queue()`: a list of six lists, one per event, each the free block
    ids *front to back* (the front is handed out next) after that event. Work it out on
    paper, from what your `popleft`, `remove` and `allocate_slots` do and from chapter 02's
    rule for freeing (a finished request's blocks go to the *front*, last block first: with
    no prefix cache none of them has a hash).
    Example: had event 0 been "A allocates 3 tokens" in a fresh pool of six blocks of 2, A
    would hold blocks 0 and 1 and the answer after it would be `[2, 3, 4, 5]` (your copy's
    events may differ). The check shows the manager's picture at your first mistake.
    """,
    """
    def predict_free_queue() -> list[list[int]]:
        \"\"\"The free queue, front to back, after each event of QUEUE_EVENTS.\"\"\"
        ### BEGIN SOLUTION
        return [[2, 3, 4, 5], [4, 5], [5], [3, 2, 5], [], [4, 1, 0]]
        ### END SOLUTION
    """,
    ["predict_free_queue"],
)

nb.exercise(
    "ex2.6",
    "how many requests fit (measure)",
    """
    Paging lets a pool hold as many requests as their tokens allow, give or take the last
    block of each. Measure it.

    - **Write** `max_concurrent(seq_lens, num_blocks, block_size)`: requests of final
      lengths `seq_lens` arrive in order and each asks for all its slots at once; return
      how many of them, counted from the first, fit together in a fresh pool of
      `num_blocks` blocks before the first that does not (a prefix: FCFS, no skipping).
    - **Invariants**: the answer is between 0 and `len(seq_lens)`; more blocks never fit
      fewer requests.
    - **Failure mode**: a length that is not an int >= 1 -> `ValueError`.
    - **How** is yours: a real `KVCacheManager` and `allocate_slots`, or arithmetic.

    Worked example: lengths `[5, 3, 4]`, 4 blocks of 2 slots: the first takes 3 blocks, the
    second needs 2 of the 1 left: answer `1`.

    The check then prints what your function measures on `FIT_LENS` in a pool of
    `FIT_SLOTS` slots cut into blocks of each size of `FIT_BLOCK_SIZES`. Predict first:
    at which block size does the count drop, and why so late?
    """,
    """
    def max_concurrent(seq_lens: list[int], num_blocks: int, block_size: int) -> int:
        \"\"\"How many requests, from the first, fit together in a fresh pool.\"\"\"
        ### BEGIN SOLUTION
        if any(not isinstance(n, int) or n < 1 for n in seq_lens):
            raise ValueError(f"seq_lens must be positive ints, got {seq_lens!r}")
        free = num_blocks
        for k, n in enumerate(seq_lens):
            free -= cdiv(n, block_size)
            if free < 0:
                return k
        return len(seq_lens)
        ### END SOLUTION
    """,
    ["max_concurrent"],
)

nb.exercise(
    "ex2.7",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure
    every question has an answer of the right kind, and a graded failure says how many
    are wrong, never which.

    - `q1`: the flat slot of token 5 with `block_table = [3, 1, 4]` and `block_size = 4`?
    - `q2`: how many blocks does a request hold after allocating 3 tokens and then 2 more,
      with `block_size = 2`?
    - `q3`: from which end of the free queue does a newly allocated block come: `"front"`
      or `"back"`?
    - `q4`: the largest block size of `FIT_BLOCK_SIZES` that still fits as many `FIT_LENS`
      requests as `block_size = 1` does (use your ex2.6).

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 5, "q2": 3, "q3": "front", "q4": 64}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. In ex2.6, how does the number of `FIT_LENS` requests that fit change as the block
   size grows, and why so late? What else limits the block size in vLLM (think of
   prefix sharing and of the kernel)?
2. vLLM v1 puts a freed request's blocks that hold a cached prefix at the *back* of the
   free queue, and blocks with no hash at the front: why each (think of the prefix cache
   of chapter 06)?
3. ex2.6 asks for all of a request's slots at once; what does vLLM do instead, and how
   does that change the count?

## Recap

The free queue hands out blocks in O(1) from the front and takes them back from anywhere;
block tables grow one block at a time, all or nothing; a token's slot is one multiply and
one add away from its position. That is the whole memory manager: the rest of vLLM decides
*whom* to give blocks to.
""")

if __name__ == "__main__":
    nb.build()
