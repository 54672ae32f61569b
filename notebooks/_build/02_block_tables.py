"""Generate notebooks/02_block_tables.ipynb (run from the repo root, then execute it).

python notebooks/_build/02_block_tables.py
jupyter nbconvert --to notebook --execute --inplace notebooks/02_block_tables.ipynb
"""

from _nb import code, md, write

md(r"""
# 02 · Block tables: paging the KV cache

Chapter 01 measured the problem: reserving one contiguous region per request leaves most
of the KV memory without a token in it. vLLM's answer is the operating system's: **paging**.
The cache is cut into fixed-size *blocks*; a request's tokens fill *logical* blocks
0, 1, 2, ... and a **block table** says where each logical block lives in physical memory.
Blocks are taken only when a request needs one, and any free block will do.

**You will learn**

1. logical vs physical blocks, and the formula that turns a token position into a cache slot;
2. the block pool and its free queue;
3. on-demand allocation, and why a request never wastes more than `block_size - 1` slots;
4. slot mapping, computed by hand on a 3-request example and then checked against
   `KVCacheManager`;
5. the invariants the allocator keeps, and its failure mode when the pool runs out;
6. the block-size trade-off (waste vs block-table size), measured over a workload.
""")

md("## Setup")

code(r"""
import inspect

import matplotlib.pyplot as plt

from minipaged import viz
from minipaged.core import BlockPool, BlockTable, KVCacheManager, cdiv, hash_block_tokens
from minipaged.sim.memory_waste import run_memory_experiment
from minipaged.sim.workloads import sample_requests
""")

md(r"""
## 1. Logical and physical blocks

With `block_size` tokens per block, token `i` of a request sits in logical block
`i // block_size`, at offset `i % block_size`. The block table maps logical block `j` to a
physical block id `block_table[j]`, and the physical cache is one flat array of
`num_blocks × block_size` slots, so

$$\text{slot}(i) = \text{block\_table}[\,i \,/\!/\, \text{block\_size}\,] \times \text{block\_size} + i \bmod \text{block\_size}.$$

The K/V of token `i` are written at that slot (in every layer's cache tensor,
`[num_blocks, block_size, num_kv_heads, head_dim]`), and the attention kernel of chapter 03
reads them back through the same table. Logical blocks are contiguous; physical blocks need
not be, which is the whole point: no region has to be reserved in advance, and there are
no holes too small to use.

## 2. The pool and its free queue

`BlockPool` owns the physical blocks. Each `KVCacheBlock` carries a `ref_cnt`: how many
block tables hold it (more than one once blocks are shared, chapter 06). Free blocks wait
in `FreeKVCacheBlockQueue`, a doubly linked list: blocks are handed out from the front; a
freed block goes back to the front or to the back, depending on whether it is cached.

**Contract card · block pool and free queue** (`minipaged.core.kv.block_pool.BlockPool`,
`minipaged.core.kv.block.FreeKVCacheBlockQueue`; vLLM v1 `vllm/v1/core/block_pool.py`,
`vllm/v1/core/kv_cache_utils.py`)

| | |
|---|---|
| **inputs** | `get_new_blocks(n)`; `free_blocks(blocks)`, a request's blocks tail first; `touch(blocks)` to share blocks that other tables hold |
| **outputs** | `get_new_blocks` returns `n` blocks with `ref_cnt == 1`, taken from the front of the free queue; `free_blocks` drops one reference from each block; a block reaching 0 goes to the *front* of the queue if it has no hash (in the order given), to the *back* if it is cached (vLLM 0.32's order) |
| **invariants** | the free queue holds exactly the blocks with `ref_cnt == 0`, each once; `ref_cnt` equals the number of tables holding the block; free + used = `num_blocks` (`check_invariants()`) |
| **failure modes** | asking for more blocks than are free -> `ValueError`, nothing taken; a negative count -> `ValueError`; the silent ones: a block freed twice, or still in a table after it was freed, is handed to two requests that overwrite each other's K/V |
| **hand-check** | the next cell: eight blocks, take three, take two, free the first three, and predict the queue before you run it; then the same with one of them cached |
""")

code(r"""
pool = BlockPool(num_blocks=8)


def free_queue(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


print("free queue:", free_queue(pool))
a = pool.get_new_blocks(3)
print("took", [b.block_id for b in a], "ref_cnt", [b.ref_cnt for b in a], "-> free queue:", free_queue(pool))
b = pool.get_new_blocks(2)
pool.free_blocks(reversed(a))  # a request frees its blocks tail first
print("freed", [b.block_id for b in reversed(a)], "-> free queue:", free_queue(pool))
print("next two handed out:", [x.block_id for x in pool.get_new_blocks(2)])
pool.check_invariants()

# the same three blocks again, the first one full and cached (prefix caching, chapter 06)
pool = BlockPool(num_blocks=8, enable_caching=True)
a = pool.get_new_blocks(3)
pool.cache_block(a[0], hash_block_tokens(None, [1, 2, 3, 4]))
pool.free_blocks(reversed(a))
print("cached block 0, freed", [b.block_id for b in reversed(a)], "-> free queue:", free_queue(pool))
pool.check_invariants()
""")

md(r"""
Why two ends? A freed block *without a hash* holds K/V that no request can ever find
again (prefix caching is off, or the block is a partly filled tail), so it is as good as
empty: it goes to the **front** and is reused first ("LIFO reuse of non-cached blocks for
better GPU locality", says vLLM's source). A freed *cached* block (chapter 06)
still holds K/V that a later request with the same prefix may hit, so it goes to the
**back**: the blocks handed out, and so evicted, first are the ones freed longest ago (LRU),
and uncached blocks are always spent before any cached one. This is vLLM 0.32's order
(`BlockPool.free_blocks`) and `BlockPool`'s default; `free_uncached_first=False` puts
every freed block at the back (the paper's scheduler keeps that order), and chapter 04's
differential test against vLLM's own scheduler tells the two apart. The queue is a linked
list rather than a `deque` because a cached block must be pulled out of the *middle* when
it is hit again, in O(1).

## 3. On-demand allocation

`KVCacheManager.allocate_slots(request, num_new_tokens)` makes room for more tokens of one
request and returns the blocks it had to take (often none).

**Contract card · the KV-cache manager** (`minipaged.core.kv.kv_cache_manager.KVCacheManager`;
vLLM v1 `vllm/v1/core/kv_cache_manager.py`)

| | |
|---|---|
| **inputs** | a request (or its id) and `num_new_tokens > 0`: the tokens this step will write |
| **outputs** | the blocks newly taken for it (often `[]`), appended to its `BlockTable`; `None` if the pool cannot hold them; `free(request)` gives every block of its table back |
| **invariants** | it alone counts blocks; after each call `len(block_table) == ceil(num_tokens / block_size)` for every request, so at most `block_size - 1` slots per request are empty; the pool's invariants hold (`check_invariants()`) |
| **failure modes** | pool exhausted -> `None` and nothing half-allocated: the scheduler decides whom to preempt; a request needing more blocks than the whole pool, or `num_new_tokens <= 0` -> `ValueError`; the silent one: a table shorter than its tokens, whose next write lands in someone else's block |
| **hand-check** | the next cell: one request with a 5-token prompt decodes 8 tokens, blocks of 4; the empty slots are asserted below `block_size` at every step |

Watch it:
""")

code(r"""
mgr = KVCacheManager(num_blocks=8, block_size=4)
new = mgr.allocate_slots("r", 5)  # the prompt
print(f"prefill 5 tokens: new blocks {[b.block_id for b in new]}, table {mgr.get_block_ids('r')}")
for step in range(8):
    new = mgr.allocate_slots("r", 1)  # one decoded token
    n = mgr.block_tables["r"].num_tokens
    table = mgr.get_block_ids("r")
    waste = len(table) * mgr.block_size - n
    print(f"decode -> {n:2d} tokens: new {[b.block_id for b in new]!s:4}  table {table!s:10}  "
          f"empty slots {waste}")
    assert waste < mgr.block_size
""")

md(r"""
A new block is taken only when the last one is full, so the empty slots of a request are
the tail of its last block: **always fewer than `block_size`**. Contiguous reservation
wasted up to `max_model_len - 1` per request.

## 4. Slot mapping, by hand first

The block table and the slot formula have their contract card in chapter 00; here is its
hand-check at full size. Twelve blocks of 4 slots, three requests. Work out the block
tables and slots on paper before running anything. The free queue starts as 0, 1, ..., 11.

| # | event | tables after it | free queue (front first) |
|---|---|---|---|
| 1 | A arrives with 6 tokens: 2 blocks | A [0, 1] | 2 ... 11 |
| 2 | B arrives with 3 tokens: 1 block | B [2] | 3 ... 11 |
| 3 | C arrives with 9 tokens: 3 blocks | C [3, 4, 5] | 6 ... 11 |
| 4 | B grows by 2 to 5 tokens: a 2nd block | B [2, 6] | 7 ... 11 |
| 5 | A grows by 3 to 9 tokens: a 3rd block | A [0, 1, 7] | 8 ... 11 |
| 6 | B finishes: blocks freed tail first, to the front (no hash) | (B gone) | 6, 2, 8, 9, 10, 11 |
| 7 | C grows by 4 to 13 tokens: a 4th block | C [3, 4, 5, 6] | 2, 8, 9, 10, 11 |

Slots, with `slot(i) = table[i // 4] * 4 + i % 4`:

- A, tokens 0..8: block 0 holds slots 0-3, block 1 slots 4-7, token 8 is in block 7 at
  offset 0: slot 28.
- C, tokens 0..12: blocks 3, 4, 5 hold slots 12-23, token 12 is in block 6 at offset 0: slot 24.
""")

code(r"""
# Written down by hand, before running the manager:
expected_tables = {"A": [0, 1, 7], "C": [3, 4, 5, 6]}
expected_slots = {
    "A": [0, 1, 2, 3, 4, 5, 6, 7, 28],
    "C": [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
}
expected_free_queue = [2, 8, 9, 10, 11]
""")

code(r"""
mgr = KVCacheManager(num_blocks=12, block_size=4)
mgr.allocate_slots("A", 6)
mgr.allocate_slots("B", 3)
mgr.allocate_slots("C", 9)
mgr.allocate_slots("B", 2)
mgr.allocate_slots("A", 3)
mgr.free("B")
mgr.allocate_slots("C", 4)

for rid in ("A", "C"):
    table = mgr.get_block_ids(rid)
    slots = mgr.get_slot_mapping(rid, 0, mgr.block_tables[rid].num_tokens)
    print(f"{rid}: table {table}, slots {slots}")
    assert table == expected_tables[rid] and slots == expected_slots[rid]
assert free_queue(mgr.block_pool) == expected_free_queue
print("hand computation confirmed")
""")

md(r"""
In a decode step the model writes only the newest token of each request, so the engine asks
for the last slot: A's token 8 goes to slot 28 and C's token 12 to slot 24. This list,
one slot per token of the batch, is the `slot_mapping` the model runner hands to the
cache-write kernel.
""")

code(r"""
print("slot_mapping for this decode step:",
      [mgr.get_slot_mapping(rid, mgr.block_tables[rid].num_tokens - 1, mgr.block_tables[rid].num_tokens)[0] for rid in ("A", "C")])
""")

md(r"""
The same state as a picture: each request's logical blocks on top (its block table, entry
j), the physical blocks beneath in id order, an arrow in the request's colour per
block-table entry. Light shading is the reserved, still empty tail of a last block; grey
blocks are free. The arrows cross wherever a request's blocks are not in order: nothing
needs to be contiguous.
""")

code(r"""
fig = viz.block_tables(mgr, arrows=True)
plt.show()
plt.close(fig)
print(viz.block_tables_text(mgr))
""")

md(r"""
## 5. Invariants

After every operation the manager can check what must hold:

- a block's `ref_cnt` equals the number of block tables holding it;
- the free queue holds exactly the blocks with `ref_cnt == 0`;
- `len(block_table) == ceil(num_tokens / block_size)` for every request, hence fewer than
  `block_size` empty slots per request.

The tests run thousands of random allocate / grow / free / swap sequences and call
`check_invariants()` after each step.
""")

code(r"""
mgr.check_invariants()
for rid in ("A", "C"):
    assert len(mgr.get_block_ids(rid)) == cdiv(mgr.block_tables[rid].num_tokens, mgr.block_size)
print(inspect.getsource(KVCacheManager.check_invariants).split("        # swap space")[0])
""")

md("Break a copy on purpose and the check says what broke:")

code(r"""
broken = KVCacheManager(num_blocks=4, block_size=4)
broken.allocate_slots("x", 5)
broken.block_pool.blocks[1].ref_cnt += 1  # as if a second table held block 1: nobody does
try:
    broken.check_invariants()
except AssertionError as e:
    print("AssertionError:", e)
""")

md(r"""
## 6. The failure mode: the pool runs out

When there are too few free blocks, `allocate_slots` returns `None` and changes
**nothing**: no half-allocated request is left behind. Deciding what to do then (wait,
or preempt another request) is the scheduler's job (chapter 05). Caller errors raise a
`ValueError` that names the problem, and also change nothing.
""")

code(r"""
full = KVCacheManager(num_blocks=4, block_size=4)
full.allocate_slots("x", 10)  # 3 blocks
full.allocate_slots("y", 4)  # the last block


def state(m):
    return ({r: m.get_block_ids(r) for r in m.block_tables}, {r: t.num_tokens for r, t in m.block_tables.items()}, free_queue(m.block_pool))


before = state(full)
print("x grows by 3 (needs a 4th block, 0 free):", full.allocate_slots("x", 3))
print("z arrives with 2 tokens:", full.allocate_slots("z", 2))
assert state(full) == before
print("state unchanged:", state(full) == before)

for bad in (lambda: full.allocate_slots("x", 0), lambda: full.allocate_slots("big", 17),
            lambda: full.free("nobody")):
    try:
        bad()
    except ValueError as e:
        print("ValueError:", e)
assert state(full) == before
full.check_invariants()
""")

md(r"""
## 7. The block-size trade-off

Small blocks waste less (the empty tail of the last block is shorter), but every block is
one more entry in the block table: more table memory, and more indirection for the
attention kernel, which gathers K/V one block at a time (chapter 03 measures the kernel
side; the paper settles on 16). Measure the memory side: replay the ShareGPT-like workload
of chapter 01 through the same KV budget (16,384 slots) with different block sizes, and
count the share of memory holding tokens and the length of the block tables.
""")

code(r"""
requests = sample_requests("sharegpt", 400, seed=0)
rows = []
print(f"{'block_size':>10}{'holding tokens':>16}{'not holding tokens':>20}{'table entries/request':>23}{'preemptions':>13}")
for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256):
    s = run_memory_experiment("sharegpt", num_requests=400, seed=0, num_slots=16_384,
                              block_size=bs, policies=("paged",)).policies["paged"]
    entries = sum(cdiv(p + o, bs) for p, o in requests) / len(requests)  # at the final length
    rows.append((bs, s.token_states, entries))
    print(f"{bs:>10}{s.token_states:>16.1%}{1 - s.token_states:>20.1%}{entries:>23.1f}{s.num_preemptions:>13}")
""")

code(r"""
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
sizes = [r[0] for r in rows]
ax1.plot(sizes, [100 * (1 - r[1]) for r in rows], "o-", color="#D55E00")
ax1.set(xscale="log", xlabel="block size (tokens)", ylabel="KV memory not holding tokens (%)",
        title="waste grows with the block size")
ax2.plot(sizes, [r[2] for r in rows], "s-", color="#0072B2")
ax2.set(xscale="log", yscale="log", xlabel="block size (tokens)",
        ylabel="block-table entries per request", title="tables shrink with the block size")
for ax in (ax1, ax2):
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()
plt.close(fig)
""")

md(r"""
Up to 16 tokens per block the waste stays within a few per cent while the tables shrink
16-fold; past 32 it grows quickly, since a ShareGPT request holds a few hundred tokens and
its last block is half empty on average. Block-table memory itself is tiny in every case
(one 4-byte id per block against 800 KiB of KV per *token* for OPT-13B), so what the small
end really costs is kernel efficiency, not memory.

## 8. Code tour

Allocation is all or nothing: count the blocks needed, return `None` if the pool cannot
supply them, and only then take them. Writing it is exercise ex2.3, so here is its
contract, the signature and docstring (`minipaged.viz.source.contract`); the body is in the
instructor's appendix (`notebooks/99_instructor_appendix.ipynb`), for after the exercises.
""")

code(r"""
from minipaged.viz.source import contract

print(contract(KVCacheManager.allocate_slots))
""")

md(r"""
The manager keeps one `BlockTable` per request (`minipaged/core/kv/block_table.py`: its
blocks and its number of tokens). Its `slot` is the formula of this chapter (exercise
ex2.4 writes it); the model runner calls it to build every step's `slot_mapping`, so there
is one formula in the code.
""")

code(r"""
print(contract(BlockTable.slot))
print(contract(BlockTable.slot_mapping))
""")

md(r"""
## Recap

- A block table maps a request's logical blocks to physical blocks anywhere in the cache;
  `slot(i) = block_table[i // block_size] * block_size + i % block_size`.
- The pool hands out blocks from the front of a free queue; a freed block without a hash
  goes back to the front (reused first), a cached one to the back (evicted least recently
  used first), as vLLM's; `ref_cnt` counts the tables holding each block.
- Blocks are allocated on demand, so each request wastes fewer than `block_size` slots, and
  any free block serves any request: no external fragmentation.
- When the pool is exhausted, `allocate_slots` returns `None` and changes nothing; bad
  input raises `ValueError` and changes nothing.
- Block size trades waste (small is better) against table length and kernel efficiency
  (large is better); 16 keeps the waste within a few per cent.

**Next**: chapter 03 reads the cache *through* the block table: the PagedAttention kernel.
""")

md(r"""
## Readings

* **The paper** (Kwon et al., SOSP 2023): §4.1 PagedAttention (KV blocks), §4.2 KV Cache
  Manager (logical and physical blocks, the block table), §4.3 Decoding with PagedAttention
  and vLLM (blocks allocated on demand), §7.2 Impact of Block Size.
* The paper's v0.2: `vllm/block.py` (`LogicalTokenBlock`, `PhysicalTokenBlock`) and
  `vllm/core/block_manager.py` (`BlockAllocator`, `BlockSpaceManager`; later renamed
  `block_manager_v1.py`, when a second block manager was added).
* vLLM v1, the block and the free queue: `vllm/v1/core/kv_cache_utils.py` (`KVCacheBlock`,
  `FreeKVCacheBlockQueue`) ↔ `minipaged/core/kv/block.py`.
* The pool: `vllm/v1/core/block_pool.py` (`get_new_blocks`, `free_blocks`) ↔
  `minipaged/core/kv/block_pool.py`.
* All or nothing: `vllm/v1/core/kv_cache_manager.py` (`allocate_slots`) ↔
  `minipaged/core/kv/kv_cache_manager.py`.
* Slot mapping on the worker: `vllm/v1/worker/block_table.py` (`BlockTable`) ↔
  `minipaged/core/kv/block_table.py`.
""")

write("02_block_tables")
