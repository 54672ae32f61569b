"""Generate notebooks/06_sharing.ipynb (run from the repo root, then execute it).

python notebooks/_build/06_sharing.py
jupyter nbconvert --to notebook --execute --inplace notebooks/06_sharing.ipynb
"""

from _nb import code, md, write

md(r"""
# 06 · Sharing blocks: fork, copy-on-write, prefix caching

Paging's third gift (after no fragmentation and on-demand growth): blocks can be **shared**.
Two sequences with the same prefix can point their block tables at the same physical blocks,
exactly as two processes share memory pages after `fork()`. The paper (section 4.4) uses it
for parallel sampling and beam search; vLLM later added *automatic prefix caching*, which
shares blocks between requests that merely start with the same tokens.

**You will learn**

1. the reference count (`ref_cnt`) that makes sharing safe, and `fork`;
2. **copy-on-write**: the moment a sequence writes into a block someone else still reads,
   step by step;
3. parallel sampling (`SamplingParams(n > 1)`): the prompt prefilled **once**, then n sequences;
4. beam search: beams forked and freed at every step, token for token equal to transformers;
5. prefix caching: chained block hashes, cache hits, and LRU eviction;
6. how much it saves, measured, against the paper's Fig. 15.
""")

md("## Setup")

code(r"""
import inspect

import matplotlib.pyplot as plt
import torch
from transformers.utils import logging as hf_logging

from minipaged import LLM, BeamSearchParams, SamplingParams, viz
from minipaged.core import BlockSpaceManager, PaperScheduler, KVCacheManager, Request, hash_block_tokens
from minipaged.core.sched import PaperScheduler
from minipaged.trace import run_scheduler

torch.set_num_threads(1)  # a small model: one thread is fastest, and the output is the same
hf_logging.disable_progress_bar()  # no loading bars in the output


def make(rid, prompt_len, max_tokens):
    prompt = [(7 * j + 3) % 50 for j in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens))


fake_model = lambda request: 7  # every "sampled" token is 7 (no model needed for the bookkeeping)
""")

md(r"""
## 1. The concept: a block held by several tables

Every physical block carries `ref_cnt`, the number of block tables that hold it. The invariant
`check_invariants()` checks after every operation is exactly that: **a block's `ref_cnt` equals
the number of tables holding it, and the free queue holds exactly the blocks with `ref_cnt == 0`.**

`fork(parent, child)` gives the child a new table listing the *same* blocks; each block's
`ref_cnt` goes up by one and no K/V is copied. Freeing a shared block only drops its count.

**Contract card · fork** (`minipaged.core.kv.BlockSpaceManager.fork`, the paper's block manager; the paper's (v0)
`BlockSpaceManager.fork` in `vllm/core/block_manager.py`; vLLM v1 has no fork, see the box
at the end of section 3)

| | |
|---|---|
| **inputs** | `parent`, a request (or id) holding a block table; `child`, one holding no blocks |
| **outputs** | `None`; the child's table lists the parent's blocks, in order; every one of them has `ref_cnt + 1`; no block is taken from the free queue and no K/V is copied |
| **invariants** | for every block, `ref_cnt` == the number of tables that hold it; the free queue holds exactly the blocks with `ref_cnt == 0`; free + held (counted once) == `num_blocks`; after a later append, the first write into a block with `ref_cnt > 1` allocates a new block and records `(src, dst)` in `blocks_to_copy` (copy-on-write), and a full block is never copied |
| **failure modes** | a child that already holds blocks, or an unknown parent -> `ValueError`; silent ones: a fork that forgets `ref_cnt + 1` lets the parent's free hand a block still in use to another request (two sequences writing the same slots: wrong tokens, no error); a write into a shared block without the copy corrupts the sibling's K/V |
| **hand-check** | the cell below: fork a 6-token table with blocks of 4 |

### Hand check

Blocks of 4 slots. `A` holds 6 tokens: blocks 0 (full) and 1 (2 of 4 slots). Fork `B` from `A`.
Predict: both tables are `[0, 1]`, both blocks have `ref_cnt` 2, and the fork took no block
(6 of 8 still free).
""")

code(r"""
m = BlockSpaceManager(num_blocks=8, block_size=4)
m.allocate_slots("A", 6)
m.fork("A", "B")
print(viz.block_tables_text(m))
assert m.get_block_ids("B") == m.get_block_ids("A") == [0, 1]
assert [m.get_ref_cnt(b) for b in (0, 1)] == [2, 2] and m.get_num_free_blocks() == 6
m.check_invariants()
""")

md(r"""
## 2. The copy-on-write moment, step by step

`B` now generates its 7th token. Its slot is offset 2 of block 1, but block 1 is also `A`'s:
writing there would overwrite what `A` reads next. So `allocate_slots` **copies first**:

1. take a fresh block (2) for `B`;
2. record `(1, 2)`: the engine copies block 1 into block 2 (`kernels.cache_ops.copy_blocks`)
   *before* the model writes;
3. drop `B`'s reference to block 1 (`ref_cnt` 2 → 1) and put block 2 in `B`'s table.

Then `A` writes its 7th token: block 1 is now `A`'s alone (`ref_cnt` 1), so it writes in place.
Block 0 is full: nobody writes into it again, so it stays shared forever.
""")

code(r"""
new = m.allocate_slots("B", 1)
print("B's new blocks:", [b.block_id for b in new])
print(viz.block_tables_text(m, new_block_ids=[b.block_id for b in new]))
assert m.get_block_ids("B") == [0, 2] and m.get_ref_cnt(1) == 1

print("\nA's new blocks:", m.allocate_slots("A", 1))
copies = m.take_pending_copies()  # what the scheduler puts into PaperSchedulerOutput.blocks_to_copy
print("copies for the engine (src, dst):", copies)
assert copies == [(1, 2)]
m.check_invariants()
""")

md(r"""
The same picture as a figure, at the copy-on-write moment: `x2` marks a block with
`ref_cnt` 2, the thick edge the block just allocated, and the arrow the copy the engine
does before the model writes B's token (block 1, A's and until now B's, into B's new
block 2):
""")

code(r"""
fig = viz.block_tables(m, new_block_ids=[2], copies=copies)
plt.show()
plt.close(fig)
""")

md(r"""
Why copy only the *partly filled last* block? Because tokens are only ever appended: a full
block is never written again, so sharing it costs nothing forever. At most one block per
sequence is ever copied per fork, the one the fork happened in.

## 3. Parallel sampling: prefill once, fork n

`SamplingParams(n=3)` asks for three samples of one prompt. In the paper (vLLM v0) the three
sequences form a **sequence group** (the layer `minipaged/core/sched/paper.py`, selected with
`LLM(parallel_sampling="fork")`; vLLM v1 does it differently, see the end of this section). The scheduler queues only the first (the *leader*); in the step that
completes its prompt it forks the others from it, and they draw their first token from the
leader's logits row. So the prompt is computed **once**. A group is scheduled, preempted and
swapped all or nothing.

### Hand check

Prompt of 6 tokens, blocks of 4, n = 3. Step 0 computes 6 tokens (the leader only) and forks:
all three tables are `[0, 1]` with `ref_cnt` 3. Step 1: three decodes. `g.0` writes into
block 1 (shared by 3): copy into 2. `g.1`: block 1 still shared by 2: copy into 3. `g.2`: alone
now, writes in place. `blocks_to_copy = [(1, 2), (1, 3)]`.
""")

code(r"""
s = PaperScheduler(num_blocks=16, block_size=4)
group = [Request(f"g.{j}", list(range(10, 16)), SamplingParams(max_tokens=4)) for j in range(3)]
trace = run_scheduler(s, [group], fake_model)  # a list inside the arrivals = a sequence group
print([st.scheduled for st in trace.steps])
print(viz.block_tables_text(trace, 0))
print()
print(viz.block_tables_text(trace, 1))
assert trace[0].scheduled == {"g.0": 6} and trace[0].shared_blocks == {0: 3, 1: 3}
assert trace[1].block_tables == {"g.0": [0, 2], "g.1": [0, 3], "g.2": [0, 1]}
""")

md(r"""
In the engine the copies are applied by the paper's worker, `PaperModelRunner.apply_cache_ops`
(`minipaged/worker/paper_runner.py`), before the forward; here they are in each step's
`PaperSchedulerOutput.blocks_to_copy`:
""")

code(r"""
s = PaperScheduler(num_blocks=16, block_size=4)
s.add_request_group([Request(f"g.{j}", list(range(10, 16)), SamplingParams(max_tokens=4)) for j in range(3)])
for step in range(3):
    out = s.schedule()
    print(f"step {step}: scheduled {out.num_scheduled_tokens}  forks {[(p.request_id, c.request_id) for p, c in out.forks]}"
          f"  blocks_to_copy {out.blocks_to_copy}")
    sampled = {r.request_id: 7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    sampled.update({c.request_id: 7 for _, c in out.fork_samples})
    s.update_from_output(out, sampled)
    s.check_invariants()
""")

md(r"""
### On the course model

Three samples of one prompt, seeded: the same call gives the same texts. The trace shows the
prompt computed once and its blocks shared by the three sequences.
""")

code(r"""
llm = LLM(block_size=4, num_blocks=64, seed=0, parallel_sampling="fork")  # a small pool: short pictures


def tables_only(text):
    return text.split("physical blocks")[0].rstrip()  # the block tables, without the pool grid

(out,) = llm.generate(["Once upon a time"], SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=1),
                      use_tqdm=False)
for c in out.outputs:
    print(c.index, repr(c.text))
print("prompt tokens:", len(out.prompt_token_ids), "| step 0 computed:", llm.trace[0].scheduled)
print(tables_only(viz.block_tables_text(llm.trace, 0)))
""")

md(r"""
### vLLM v1's way: n child requests and prefix caching

vLLM v1 has no sequence groups: `n > 1` becomes n independent child requests, and the prompt is
shared only through **prefix caching** (section 5): the first child's full prompt blocks are
cached as they are allocated, so the children admitted after it in the same step find them and
skip their prefill (all but the last, partly filled block, which each child computes itself).
This is minipaged's default (`parallel_sampling="prefix"`). Side by side on the same request,
with the same seeds, so the samples are the same:
""")

code(r"""
prompt = ["Once upon a time there was a little girl who"]
params4 = SamplingParams(n=4, temperature=0.8, max_tokens=20, seed=1)
samples = []
print(f"{'parallel_sampling':18s}{'prefix caching':>15s}{'prompt tokens computed':>24s}{'peak blocks':>13s}")
for mode, caching in (("fork", False), ("prefix", True), ("prefix", False)):
    llm_m = LLM(block_size=4, num_blocks=64, seed=0, parallel_sampling=mode, enable_prefix_caching=caching)
    (o,) = llm_m.generate(prompt, params4, use_tqdm=False)
    t = llm_m.trace
    computed = sum(n for st in t.steps for rid, n in st.scheduled.items() if rid in st.prefill_ids)
    peak = max(t.num_blocks - st.num_free_blocks for st in t.steps)
    samples.append([c.token_ids for c in o.outputs])
    print(f"{mode:18s}{caching!s:>15s}{computed:>24d}{peak:>13d}")
print("prompt length:", len(o.prompt_token_ids))
assert all(s_ == samples[0] for s_ in samples), "the same samples, seed for seed"
""")

md(r"""
The fork computes the prompt once and shares even its partly filled last block (copied on the
first write). Prefix caching shares only *full* blocks, so each child recomputes the tail of the
prompt and holds its own copy of the last block; without caching, each child prefills the whole
prompt. vLLM v1 accepts that small cost for a simpler scheduler: no groups, nothing scheduled or
preempted "all or nothing", and the same mechanism also shares prefixes *between* requests.

> **The paper (vLLM v0) and vLLM v1 today, on sharing.**
>
> | | the paper (vLLM v0, §4.4) | vLLM v1 |
> |---|---|---|
> | `n > 1` | one sequence group; the prompt prefilled once; the samples **fork** its block table, copy-on-write on the partly filled last block | n independent child requests (`vllm/v1/engine/parallel_sampling.py`); the prompt's *full* blocks shared through the prefix cache, each child computes its own tail |
> | beam search | inside the engine: sequence groups forked and freed at every step | outside the scheduler, on top of child requests (`LLM.beam_search`) |
> | prefix sharing across requests | a given shared prefix (§4.4), later automatic prefix caching as an option | automatic prefix caching, on by default (`enable_prefix_caching=True`) |
> | scheduling unit | the group: scheduled, preempted, swapped all or nothing | the request |
>
> The table above measured the cost of v1's choice on this prompt: the tail tokens each child
> recomputes, and the blocks at the peak. Chapter 08 runs the pair on the scheduler alone.

## 4. Beam search: fork and free at every step

Beam search keeps the `beam_width` best partial sequences. At each step every beam proposes
continuations; the best `beam_width` over all of them survive. A surviving candidate's beam is
**forked from its parent** (sharing all its blocks); parents with no surviving child are
**freed**; a parent with several children has its last block copied for all but one. Beams that
descend from one ancestor share its blocks, so memory holds one copy of each common prefix
(the paper's Fig. 9).

`LLM.beam_search` reproduces transformers' beam search exactly (its candidate pool of
`2 x beam_width`, EOS handling, length penalty and early-stop test; see the module docstring of
`minipaged/engine/beam_search.py`), so the result is token for token `generate(num_beams=...)`:
""")

code(r"""
params = BeamSearchParams(beam_width=4, max_tokens=16)
(beams,) = llm.beam_search(["One day, a girl named Lily went"], params)
for s_ in beams.sequences:
    print(f"{s_.score:8.4f}  {s_.text!r}")

from transformers import AutoModelForCausalLM
from minipaged.model import COURSE_MODEL_DIR

hf = AutoModelForCausalLM.from_pretrained(COURSE_MODEL_DIR, local_files_only=True).eval()
ids = torch.tensor([beams.prompt_token_ids])
with torch.no_grad():
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, num_return_sequences=4,
                      max_new_tokens=16, do_sample=False, pad_token_id=hf.config.pad_token_id,
                      return_dict_in_generate=True, output_scores=True)
P = ids.shape[1]
lengths = (ref.beam_indices != -1).sum(-1).tolist()  # a hypothesis ended by EOS is padded
want = [ref.sequences[i, P:P + n].tolist() for i, n in enumerate(lengths)]
assert [s_.token_ids for s_ in beams.sequences] == want
print("equal to transformers' generate(num_beams=4):", [s_.token_ids for s_ in beams.sequences] == want)
""")

md(r"""
The block tables during the search (from `llm.trace`, one record per step, after that step's
forks and frees). The engine replaces every beam at every step, so request ids (`0.33`,
`0.34`, ...) say nothing about who descends from whom; `viz.beam_tables` reads the descent
back from the block tables and gives the beams stable names: a beam that continues keeps its
name and colour from step to step, a second child of a parent gets a new name and sits right
below it, drawn as its child (`b11 (from b7)`), and a beam with no surviving child is
**pruned**. `*` marks a block allocated during the step (the copy made when a beam wrote into a
shared, partly filled block, or a new block); `freed` lists the blocks given back: a pruned
beam's own blocks, and copies made for a beam that did not survive the step. Early on the four
beams share almost everything; later they diverge, but the prompt blocks (and often much
more) stay shared.
""")

code(r"""
print(viz.beam_tables_text(llm.trace, [1, 8, 14]))
lineage = viz.beam_lineage(llm.trace)
assert all(len(st.name) == 4 for st in lineage[:-1])  # beam_width beams after every step
""")

code(r"""
fig = viz.beam_tables(llm.trace, [1, 8, 14])
plt.show()
plt.close(fig)
""")

md(r"""
## 5. Prefix caching

Requests often start with the same tokens: a system prompt, few-shot examples, a document. With
`enable_prefix_caching=True` a **full** block is registered under
`hash_block_tokens(parent_hash, its tokens)`. The hash is *chained*: it covers the block and
everything before it, so equal hashes mean equal prefixes (an equal block after a different
prefix has different K/V and must not match). It is sha256, never Python's salted `hash()`.
""")

code(r"""
h0 = hash_block_tokens(None, [1, 2, 3, 4])
h1 = hash_block_tokens(h0, [5, 6, 7, 8])
h1_other = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
print(h0.hex()[:16], h1.hex()[:16], h1_other.hex()[:16])
assert h1 != h1_other  # same tokens, different prefix: a different key
""")

md(r"""
**Contract card · the prefix cache** (`KVCacheManager.get_computed_blocks` and
`cache_blocks`, the pool's `cached_block_hash_to_block`; vLLM v1
`vllm/v1/core/kv_cache_manager.py`, `vllm/v1/core/block_pool.py`, `kv_cache_utils.py`)

| | |
|---|---|
| **inputs** | `get_computed_blocks(request, max_num_tokens=None)`: the request's tokens, hashed block by block (`hash_block_tokens(parent_hash, tokens)`); `cache_blocks(request, num_computed_tokens)`: a request whose full blocks are about to be written |
| **outputs** | `get_computed_blocks` -> `(blocks, num_computed_tokens)`: the cached blocks of the longest cached prefix, `num_computed_tokens == len(blocks) * block_size`, at most `num_tokens - 1` tokens; `([], 0)` with caching off; nothing is shared yet (`allocate_slots` takes them, each `ref_cnt + 1`, and `touch` pulls a free one out of the free queue). `cache_blocks` registers full blocks under their hash |
| **invariants** | only full blocks are cached; a hash maps to one block; the hash of block j covers blocks 0..j (chained), so a hit means an equal prefix; a freed cached block keeps its hash in the free queue until it is handed out again (evicted, least recently used first); the last prompt token is always computed (its logits give the next token) |
| **failure modes** | no exception for a miss (`([], 0)`); silent ones: an unchained hash matches an equal block after a different prefix (wrong K/V, plausible-looking wrong text); Python's salted `hash()` makes hits differ between processes; returning the whole prompt leaves no logits for the first sampled token |
| **hand-check** | the cell below: hits, the last-token rule, eviction, on blocks of 4 |
""")

md(r"""
### Hand check: hits, the last-token rule, eviction

Blocks of 4, 6 blocks. `A` (10 tokens) is computed; its full blocks 0 and 1 are cached.

* `B` starts with the same 8 tokens: `get_computed_blocks` finds blocks 0 and 1, so `B`'s prefill
  starts at token 8.
* `C` is *exactly* those 8 tokens: only block 0 is reused. The last token is always computed,
  because its logits give the next token (at most `num_tokens - 1` tokens come from the cache).
""")

code(r"""
m = KVCacheManager(num_blocks=6, block_size=4, enable_caching=True)
A = Request("A", list(range(100, 110)))
m.allocate_slots(A, 10)
A.num_computed_tokens = 10
m.cache_blocks(A)  # the scheduler does this after the model wrote the blocks
B = Request("B", list(range(100, 108)) + [1, 2, 3])
C = Request("C", list(range(100, 108)))
hits_b, n_b = m.get_computed_blocks(B)
hits_c, n_c = m.get_computed_blocks(C)
print("B:", [b.block_id for b in hits_b], n_b, "tokens | C:", [b.block_id for b in hits_c], n_c, "tokens")
assert n_b == 8 and n_c == 4
m.allocate_slots(B, B.num_tokens - n_b, hits_b)  # shares blocks 0 and 1
print(viz.block_tables_text(m))
""")

md(r"""
When both finish, their blocks return to the free queue **with their hashes**: a later request
with the same prefix still finds them (`~` below). They are evicted only when the pool hands
them out to someone else. Cached blocks go to the *back* of the free queue, in free order
(blocks without a hash to the front, chapter 02), and requests free tail first, so the
least recently used blocks, and the tail of a prefix before its head, go first: LRU.

Hand check: the free queue after both frees is `3 2 4 5 1 0` (the uncached tails at the
front, `B`'s 3 freed last so first, then `A`'s 2; then the never used 4, 5; then at the back
the shared cached blocks as their last holder frees them, tail first). A
request `E` needing 5 blocks takes `3 2 4 5 1`: block 1 is evicted, block 0 survives, so `D`
(same 8-token prefix) now finds 4 tokens instead of 8.
""")

code(r"""
m.free(A)
m.free(B)
print(viz.block_tables_text(m))
D = Request("D", list(range(100, 108)) + [5])
print("D hits:", m.get_computed_blocks(D)[1], "tokens")
m.allocate_slots("E", 20)  # 5 blocks from the front of the free queue
print(viz.block_tables_text(m))
print("D hits now:", m.get_computed_blocks(D)[1], "tokens")
assert m.get_block_ids("E") == [3, 2, 4, 5, 1] and m.get_computed_blocks(D)[1] == 4
m.check_invariants()
""")

md(r"""
### In the scheduler

At admission the scheduler looks up the longest cached prefix and starts `num_computed_tokens`
there: the prefill skips it. Four requests share a 12-token prefix and arrive one after another:
""")

code(r"""
prefix = list(range(200, 212))
for caching in (False, True):
    s = PaperScheduler(num_blocks=32, block_size=4, enable_prefix_caching=caching)
    arrivals = {2 * i: [Request(f"q{i}", prefix + [i, i], SamplingParams(max_tokens=3))] for i in range(4)}
    t = run_scheduler(s, arrivals, fake_model)
    prefill = [(rid, n) for st in t.steps for rid, n in st.scheduled.items() if rid in st.prefill_ids]
    print(f"caching {'on ' if caching else 'off'}: prefill chunks {prefill}")
""")

md(r"""
On the real engine the outputs do not change, only the work: the same prompts, greedy, with
caching off and on.
""")

code(r"""
few_shot = "Once upon a time, there was a little cat. The cat liked to play. One day, "
prompts = [few_shot + q for q in ("the dog", "a bird", "the sun", "a girl named Mia")]
greedy = SamplingParams(temperature=0.0, max_tokens=12)
for caching in (False, True):
    llm_c = LLM(block_size=4, num_blocks=64, enable_prefix_caching=caching)
    outs = [o.outputs[0].text for o in llm_c.generate(prompts, greedy, use_tqdm=False)]
    outs = [o.outputs[0].text for o in llm_c.generate(prompts, greedy, use_tqdm=False)]  # cache warm
    prefill = sum(n for st in llm_c.trace.steps for r, n in st.scheduled.items() if r in st.prefill_ids)
    print(f"caching {'on ' if caching else 'off'}: second call computed {prefill} prompt tokens | {outs[0]!r}")
    if caching:
        assert outs == no_cache
    no_cache = outs
""")

md(r"""
## 6. How much does sharing save?

The paper's Fig. 15 measures the KV blocks saved by sharing while serving OPT-13B on Alpaca:
6.1-9.8% for parallel sampling, 37.6-55.2% for beam search (and 16.2-30.5% / 44.3-66.3% on
ShareGPT). `minipaged sharing` replays the same question on this package's `KVCacheManager`
with the synthetic workloads of `minipaged.sim.workloads`: blocks held with sharing vs block-table
entries (what private copies would hold), summed over every step. Beam search there uses a
synthetic model (random next-token distributions); here is a small run:
""")

code(r"""
from minipaged.sim.sharing import format_report, run_sharing_experiment

result = run_sharing_experiment(num_requests=20, seed=0)
print(format_report(result))
""")

md(r"""
Parallel sampling shares only the full prompt blocks, so its saving is the prompt's share of a
sequence's blocks: small for Alpaca's short prompts, larger for ShareGPT. Beam search shares far
more: beams keep descending from a few ancestors. How much depends on how long beams stay
different, i.e. on the model. The synthetic model lets beams collapse onto one ancestor quickly;
a real model keeps them apart longer. Beam search on the course model, measured from its trace:
""")

code(r"""
prompts = ["Once upon a time", "The little dog", "One day, a girl named Lily went", "Tom and his mom"]
print("beam width  blocks saved (course model, block_size 4, 32 new tokens)")
widths, saved = [], []
for k in range(2, 7):
    llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=32))
    used = sum(llm.trace.num_blocks - st.num_free_blocks for st in llm.trace.steps)
    entries = sum(len(t) for st in llm.trace.steps for t in st.block_tables.values())
    widths.append(k)
    saved.append(100 * (1 - used / entries))
    print(f"{k:10d}  {saved[-1]:5.1f}%")
""")

code(r"""
fig, ax = plt.subplots(figsize=(6, 3.2))
ps = [r["saved_pct"] for r in result["parallel_sampling"]["alpaca"]]
bs_ = [r["saved_pct"] for r in result["beam_search"]["alpaca"]]
ax.plot(widths, ps, "o-", label="parallel sampling (Alpaca-like, simulated)")
ax.plot(widths, bs_, "s-", label="beam search (Alpaca-like, synthetic model)")
ax.plot(widths, saved, "^-", label="beam search (course model)")
ax.axhspan(6.1, 9.8, alpha=0.15, color="C0", label="paper: parallel sampling")
ax.axhspan(37.6, 55.2, alpha=0.15, color="C1", label="paper: beam search")
ax.set_xlabel("n / beam width")
ax.set_ylabel("KV blocks saved (%)")
ax.legend(fontsize=7)
plt.show()
plt.close(fig)
""")

md(r"""
## 7. Code tour

`fork`, `get_computed_blocks` and the copy-on-write branch of `allocate_slots` are exercises
of chapter 06 (`ex6.1`, `ex6.4`, `ex6.2`), so here are only their signatures and
docstrings: the contract cards above say what they must do. Their bodies are in the
instructor's appendix (`notebooks/99_instructor_appendix.ipynb`), for after the exercises.
""")

code(r"""
from minipaged.viz.source import contract  # the signature and docstring: an exercise asks for the body

print(contract(BlockSpaceManager.fork), end="\n\n")
print(contract(KVCacheManager.get_computed_blocks), end="\n\n")
print(contract(BlockSpaceManager.allocate_slots))
""")

code(r"""
print(inspect.getsource(PaperScheduler._maybe_fork))
""")

md(r"""
## 8. Experiment

Try a larger `n` or `beam_width`, another `block_size` (bigger blocks: fewer shared full blocks,
bigger copies), or prompts that share a longer prefix. `KVCacheManager.check_invariants()` and
the engine's `check_invariants()` hold after every step.
""")

code(r"""
n, block_size = 4, 4
llm_x = LLM(block_size=block_size, num_blocks=64, parallel_sampling="fork")
(o,) = llm_x.generate(["The little dog"], SamplingParams(n=n, temperature=1.0, max_tokens=16, seed=3),
                      use_tqdm=False)
peak_used = max(llm_x.trace.num_blocks - st.num_free_blocks for st in llm_x.trace.steps)
peak_entries = max(sum(len(t) for t in st.block_tables.values()) for st in llm_x.trace.steps)
print(f"n={n}: peak blocks used {peak_used}, without sharing {peak_entries}")
llm_x.llm_engine.check_invariants()
""")

md(r"""
## Recap

* A block's `ref_cnt` counts the tables holding it; `fork` shares every block of a sequence for
  free, and freeing only drops counts.
* **Copy-on-write**: the first write into a shared, partly filled block copies it
  (`blocks_to_copy`, done before the forward); full blocks are never copied.
* Parallel sampling prefills the prompt once and forks n sequences; a group is scheduled and
  preempted all or nothing.
* Beam search forks the surviving beams from their parents and frees the rest at every step;
  minipaged's result equals transformers' token for token.
* Prefix caching keys full blocks by a chained sha256; hits skip prefill, freed cached blocks
  stay reusable until evicted in LRU order; the last token is always computed.
* Savings: a few % to ~25% for parallel sampling (the prompt's share), 25.8-44.0% for beam search
  on the course model (section 6, beam widths 2 to 6, 32 new tokens),
  and most of the prefill for few-shot prompts (`minipaged sharing`).
""")

md(r"""
## Readings

* **The paper** (Kwon et al., SOSP 2023): §4.4 Application to Other Decoding Scenarios
  (parallel sampling, beam search, shared prefix); §5.2 Supporting Various Decoding
  Algorithms (fork, append, free); §6.3 Parallel Sampling and Beam Search; §6.4 Shared prefix.
* The paper's v0.2: `vllm/core/block_manager.py` (`fork`, copy-on-write in `append_slot`)
  and `vllm/sequence.py` (`SequenceGroup`) ↔ `minipaged/core/kv/kv_cache_manager.py`
  (`fork`), `minipaged/core/sched/paper.py`, `minipaged/engine/beam_search.py`.
* vLLM v1, prefix caching: `vllm/v1/core/kv_cache_utils.py` (`hash_block_tokens`) ↔
  `minipaged/core/kv/block.py`; `vllm/v1/core/block_pool.py` (`cache_full_blocks`,
  `get_cached_block`, `touch`) ↔ `minipaged/core/kv/block_pool.py`.
* The lookup: `vllm/v1/core/kv_cache_manager.py` (`get_computed_blocks`) ↔
  `minipaged/core/kv/kv_cache_manager.py`.
* `n > 1` in v1 as child requests: `vllm/v1/engine/parallel_sampling.py` (`ParentRequest`).
* **SGLang** (Zheng et al., NeurIPS 2024): RadixAttention, prefix sharing in a radix tree.
""")

write("06_sharing")
