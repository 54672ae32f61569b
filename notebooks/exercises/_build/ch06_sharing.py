"""Generator of notebooks/exercises/ch06_sharing.ipynb (chapter 06 exercises)."""

from _common import ExerciseNotebook, _md

from minipaged.checks.ch06 import (
    SAMPLING_BLOCK_SIZES,
    SAMPLING_OUTPUTS,
    SAMPLING_PROMPT,
    SHARE_EVENTS,
    SHARE_KNOBS,
    share_event_text,
)

# the table of ex6.5 (a student copy made with --seed gets its own events, written in)
SHARE_TABLE = "\n".join(f"    | {k} | {share_event_text(e)} |" for k, e in enumerate(SHARE_EVENTS))

nb = ExerciseNotebook(
    chapter="ch06",
    filename="ch06_sharing.ipynb",
    title="Chapter 06 exercises: sharing blocks",
    minutes=70,
    intro="""
    Companion to `notebooks/06_sharing.ipynb`. Paging lets sequences share physical blocks,
    like processes share pages after `fork()`. You will write the fork itself,
    copy-on-write when a shared block is written, the chained block hash, and the
    prefix-cache lookup. The checks run your code and a reference side by side on random
    sequences of allocations, forks, appends and frees, and call
    `BlockSpaceManager.check_invariants()` (a block's `ref_cnt` equals the number of block
    tables holding it; the free queue holds exactly the blocks with `ref_cnt == 0`) after
    every step.

    A `BlockSpaceManager` keeps `block_tables[request_id]` (its `BlockTable`: `.blocks`, a
    list of `KVCacheBlock`, and `.num_tokens`), `block_size`, and a `block_pool`:
    `get_num_free_blocks()`, `get_new_blocks(n)` (each with `ref_cnt == 1`),
    `touch(blocks)` (`ref_cnt += 1`, leaving the free queue if it was there),
    `free_blocks(blocks)` (`ref_cnt -= 1`, back to the free queue at 0), and for prefix
    caching `get_cached_block(block_hash)` -> a block or `None`. The package's own
    `BlockSpaceManager.fork` and `allocate_slots` (which does copy-on-write itself) are the
    reference here, so they are switched off on the manager your code gets.
    """,
)

# NOTE: the setup cell holds the data as literals: a submission may not import minipaged.checks
nb.setup(f"""
from minipaged.core import BlockPool, BlockTable, KVCacheBlock, BlockSpaceManager, cdiv, hash_block_tokens

# ex6.5: the manager's knobs and events: ("alloc", id, tokens) | ("fork", parent, child) | ("free", id, None)
SHARE_KNOBS = {SHARE_KNOBS!r}
SHARE_EVENTS = {SHARE_EVENTS!r}
# ex6.6: the parallel-sampling run the check measures
SAMPLING_PROMPT, SAMPLING_OUTPUTS = {SAMPLING_PROMPT!r}, {SAMPLING_OUTPUTS!r}
SAMPLING_BLOCK_SIZES = {SAMPLING_BLOCK_SIZES!r}
""")

nb.exercise(
    "ex6.1",
    "fork: share every block",
    """
    Parallel sampling and beam search start several sequences from one prompt. Write
    `fork(kv_cache_manager, parent_id, child_id)`: the child gets a block table of its own
    (a new `BlockTable` with a new list) holding the *same* blocks as the parent, every one
    of them gets one more reference (`ref_cnt`), and the child's `num_tokens` is the
    parent's. No KV is copied.
    Raise `ValueError` if the parent holds no blocks or the child already does.
    """,
    """
    def fork(kv_cache_manager: BlockSpaceManager, parent_id: str, child_id: str) -> None:
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
    "ex6.2",
    "append a token, with copy-on-write",
    """
    Write `append_slot(kv_cache_manager, request_id)`: make room for one more token of
    the request, which may share blocks with its forks.

    - **Input**: a manager in which `request_id` holds a block table of
      `n = block_tables[request_id].num_tokens` tokens; some of its blocks may be shared
      (`ref_cnt > 1`) with other sequences.
    - **Output**: the block copies the engine must do before the model writes the token,
      a list of `(src_block_id, dst_block_id)` (often empty); or `None` if a new block is
      needed and none is free, and then nothing has changed.
    - **Invariants**: afterwards the table holds `n + 1` tokens; the slot the new token
      goes to is in a block this request holds *alone* (writing into a shared block would
      change the other sequences' KV); no block is taken that is not needed; every
      block's `ref_cnt` equals the number of tables holding it, and the free queue holds
      exactly the blocks with `ref_cnt == 0` (`check_invariants()` runs after each step).
    - **Tools**: `block_pool.get_num_free_blocks()`, `get_new_blocks(k)`,
      `free_blocks(blocks)` (drops one reference each).

    Worked example (`block_size = 4`): A and B both hold `[0, 1]` with 6 tokens (both
    blocks `ref_cnt == 2`). `append_slot(m, "B")` -> `[(1, 2)]` with B's table `[0, 2]`,
    block 1 now `ref_cnt == 1` (A's alone), block 2 new. A second call for B -> `[]`
    (block 2 is B's alone). With 8 tokens and the last block full, a call takes a new
    block and returns `[]`.
    """,
    """
    def append_slot(kv_cache_manager: BlockSpaceManager, request_id: str):
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

nb.cells.append(
    _md(
        """
<details><summary>Hints for ex6.2 (open only if stuck)</summary>

- Three cases, by where the new token lands: a fresh block (the last one is full), the
  last block held alone, or the last block shared.
- In the shared case, take the new block *before* dropping the reference to the old one,
  so a full pool leaves everything unchanged.
</details>
""",
        "ex6-2-hints",
    )
)

nb.exercise(
    "ex6.3",
    "the chained block hash",
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
    "ex6.4",
    "the prefix-cache lookup",
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

nb.exercise(
    "ex6.5",
    "predict block tables and ref counts (on paper first)",
    """
    A `BlockSpaceManager(num_blocks=8, block_size=4)`, empty at first, sees these events
    (`SHARE_EVENTS`; your copy's may differ from a classmate's); "allocates n tokens" adds
    n tokens to the request's table (a request holding nothing starts one), and its
    `allocate_slots` does copy-on-write itself, exactly as your `append_slot` does, token
    by token:

    | event | what happens |
    |---|---|
{SHARE_TABLE}

    Write `predict_sharing()`: a list of six dicts, one per event, each
    `{"tables": {request id: block ids}, "ref_cnt": {block id: ref_cnt}}` after that
    event, with every request that holds blocks and every block whose `ref_cnt > 0`. New
    blocks come from the front of the free queue (never-used blocks in id order first).
    Example: had event 0 been "A allocates 6 tokens", the answer after it would be
    `{"tables": {"A": [0, 1]}, "ref_cnt": {0: 1, 1: 1}}`. Work it out on paper first: the
    check is graded from what this cell returns, and a wrong answer is told which event is
    wrong and what you gave, not the manager's answer.
    """.replace("{SHARE_TABLE}\n", SHARE_TABLE + "\n"),
    """
    def predict_sharing() -> list[dict]:
        \"\"\"Tables and ref counts after each event of SHARE_EVENTS.\"\"\"
        ### BEGIN SOLUTION
        return [
            {"tables": {"A": [0, 1]}, "ref_cnt": {0: 1, 1: 1}},
            {"tables": {"A": [0, 1], "B": [0, 1]}, "ref_cnt": {0: 2, 1: 2}},
            {"tables": {"A": [0, 1], "B": [0, 1], "C": [0, 1]}, "ref_cnt": {0: 3, 1: 3}},
            {"tables": {"A": [0, 1], "B": [0, 2], "C": [0, 1]}, "ref_cnt": {0: 3, 1: 2, 2: 1}},
            {"tables": {"A": [0, 1], "B": [0, 2], "C": [0, 3, 4]},
             "ref_cnt": {0: 3, 1: 1, 2: 1, 3: 1, 4: 1}},
            {"tables": {"B": [0, 2], "C": [0, 3, 4]}, "ref_cnt": {0: 2, 2: 1, 3: 1, 4: 1}},
        ]
        ### END SOLUTION
    """,
    ["predict_sharing"],
)

nb.exercise(
    "ex6.6",
    "what sharing the prompt saves (measure)",
    """
    Parallel sampling: one prompt of `prompt_len` tokens is prefilled once, then forked
    into `len(output_lens)` sequences that decode one token per step each, sequence `i`
    until it has `output_lens[i]` tokens, with copy-on-write.

    - **Write** `blocks_with_sharing(prompt_len, output_lens, block_size)`: how many
      blocks are in use when every sequence has finished decoding (before any is freed).
    - **Invariants**: never more than the unshared total `sum(cdiv(prompt_len + o,
      block_size))`; never fewer than one sequence's blocks.
    - **Failure mode**: `prompt_len < 1`, an empty `output_lens` or an output length < 1
      -> `ValueError`.
    - **How** is yours: simulate it with a `BlockSpaceManager` (`allocate_slots`, `fork`), or
      find the formula.

    Worked example: prompt 6, outputs `[1, 3]`, `block_size = 4` -> `4` (block 0 shared;
    block 1 copied on write; one sequence needs a third block), against 5 unshared.

    The check prints the saving on `SAMPLING_PROMPT` / `SAMPLING_OUTPUTS` for each of
    `SAMPLING_BLOCK_SIZES`. Predict first: does a larger block save more or less?
    """,
    """
    def blocks_with_sharing(prompt_len: int, output_lens: list[int], block_size: int) -> int:
        \"\"\"Blocks in use after parallel sampling with fork and copy-on-write.\"\"\"
        ### BEGIN SOLUTION
        if not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
        if not output_lens or any(not isinstance(o, int) or o < 1 for o in output_lens):
            raise ValueError(f"output_lens must be non-empty ints >= 1, got {output_lens!r}")
        full = prompt_len // block_size  # the prompt's full blocks stay shared
        return full + sum(cdiv(prompt_len + o, block_size) - full for o in output_lens)
        ### END SOLUTION
    """,
    ["blocks_with_sharing"],
)

nb.exercise(
    "ex6.7",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure
    every question has an answer of the right kind, and a graded failure says how many
    are wrong, never which.

    - `q1`: in a `BlockSpaceManager(num_blocks=8, block_size=4)`, A allocates 6 tokens,
      A forks B, A forks C, B allocates 1 more token, C allocates 3 more, A finishes (the
      shipped `SHARE_EVENTS`; your copy's may differ): how many block copies
      (copy-on-write) happen?
    - `q2`: in that run, the `ref_cnt` of block 0 after A forked C?
    - `q3`: does `fork` copy any K/V: `"yes"` or `"no"`?
    - `q4`: the prefix cache hashes a block together with everything before it; does a
      block of the same tokens at another position get the `"same"` or a `"different"`
      hash?

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 2, "q2": 3, "q3": "no", "q4": "different"}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. In ex6.6, why does the saving shrink as the outputs grow longer than the prompt?
2. Beam search forks and frees sequences every step; what would copy-on-write cost if
   blocks were 256 tokens?
3. In the shipped `SHARE_EVENTS`, why is A's block 1 not copied when A finishes, although B
   and C had shared it?

## Recap

A fork costs no KV at all: only reference counts. The first write into a shared, partly
filled block copies just that block. Prefix caching is the same sharing across requests,
found by a chained hash instead of a fork; freed cached blocks stay findable until the
free queue hands them out again, which makes eviction LRU.
""")

if __name__ == "__main__":
    nb.build()
