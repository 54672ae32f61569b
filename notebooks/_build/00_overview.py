"""Generate notebooks/00_overview.ipynb (run from the repo root, then execute it).

    python notebooks/_build/00_overview.py
    jupyter nbconvert --to notebook --execute --inplace notebooks/00_overview.ipynb

The end-to-end run uses the engine on the course model (``minipaged.LLM()``) where the
course model is present when this script runs; otherwise the real scheduler driven by a
fake model (same pictures, no text). Re-run this script once the course model lands.
"""

from _nb import code, md, write

from minipaged.viz.figures import DEMO_ENGINE_KWARGS, DEMO_MAX_TOKENS, DEMO_PROMPTS, course_model_available

ENGINE = course_model_available()


md(r"""
# 00 · Overview: one engine, three ideas

vLLM serves many requests on one GPU at once. Three ideas make that work, and this course
builds each of them, small enough to read, in the `minipaged` package:

| idea | what it is | kind of thing | where it lives |
|---|---|---|---|
| **KV cache** | per layer, the keys and values of every token seen so far | *data* | `minipaged/model/`, cache tensors `[num_blocks, block_size, num_kv_heads, head_dim]` |
| **PagedAttention** | a request's logical blocks map through a *block table* to physical blocks anywhere in the cache; attention reads through that map | *addressing* | `minipaged/core/` (pool, manager, tables), `minipaged/kernels/` |
| **continuous batching** | the batch is rebuilt at every step as requests arrive, finish or are preempted | *scheduling* | `minipaged/core/sched/scheduler.py` |

They are easy to blur together. Keep them apart: the KV cache is *what* is stored, paging
is *where* it is stored and how it is found, scheduling is *who* runs at each step. (And
PagedAttention is not FlashAttention: paging is about where KV lives; FlashAttention is
about memory traffic inside one attention computation. Chapter 03 shows both.)

**You will learn**

1. the three ideas and the words for them (`block_table`, `slot_mapping`, `ref_cnt`,
   `max_num_seqs`, `max_num_batched_tokens`), the same words vLLM uses;
2. to read the two pictures of the course: the **active sequences** at every step, and the
   **block tables** after a step, side by side;
3. to step through a real run like a debugger;
4. where each idea is taught: a map of the course.
""")

md("## Setup")

code(
    r"""
%matplotlib inline
import inspect

import matplotlib.pyplot as plt

from minipaged import viz
from minipaged.core import KVCacheManager
from minipaged.viz.figures import interesting_step, scheduler_trace
"""
    + (
        "from minipaged import LLM, SamplingParams\n"
        if ENGINE
        else "from minipaged.viz.figures import scheduler_demo_trace\n"
    )
)

md(r"""
## 1. Data: the KV cache

Generating token *t* needs attention over tokens 0 .. *t*−1, and attention needs their
keys and values at every layer. Computing them once and keeping them is the **KV cache**.
Its size per token is fixed by the model: `2 (K and V) × layers × kv_heads × head_dim ×
bytes per number`. Chapter 01 counts it for real models (800 KB per token for OPT-13B);
what matters here is that it is the biggest thing a server holds besides the weights,
and that it grows by one token per request per step.

## 2. Addressing: block tables

The cache is cut into **blocks** of `block_size` token slots. A request's tokens fill its
*logical* blocks 0, 1, 2, ...; its **block table** lists the *physical* block behind each.
Token `i` lives in slot `block_table[i // block_size] * block_size + i % block_size`.

**Contract card · block table and slot mapping** (`minipaged.core.KVCacheManager`:
`allocate_slots`, `get_slot_mapping`, `free`; vLLM v1 `vllm/v1/core/kv_cache_manager.py`)

| | |
|---|---|
| **inputs** | a request id and the number of new tokens to make room for; a pool of `num_blocks` blocks of `block_size` slots |
| **outputs** | `allocate_slots` -> the newly allocated blocks (maybe none), or `None` if the pool cannot hold them; `get_slot_mapping(rid, start, end)` -> the slot of each token `start .. end-1` |
| **invariants** | `len(block_table) == ceil(num_tokens / block_size)`; slot of token `i` = `block_table[i // block_size] * block_size + i % block_size`; no two requests hold the same block (without sharing); at most `block_size - 1` slots per request hold no token; free blocks + held blocks = `num_blocks` |
| **failure modes** | pool exhausted -> `None` and nothing half-allocated (the scheduler decides whom to preempt); an unknown request, a non-positive token count or a span outside the allocated tokens -> `ValueError`; the silent one: a wrong slot makes attention read another token's K/V, with no error |
| **hand-check** | the next cell: two requests in a pool of 8 blocks of 4, their tables and two slots worked out on paper first |

A hand check first. With `block_size = 4`, request A gets 10 tokens and B 5, from an
empty pool of 8 blocks. The pool hands out blocks 0, 1, 2 to A (⌈10/4⌉ = 3) and 3, 4 to B
(⌈5/4⌉ = 2). So A's token 9 is in logical block 2, offset 1: slot 2·4 + 1 = **9**; B's
token 4 is in logical block 1 (physical 4), offset 0: slot 4·4 + 0 = **16**.
""")

code(r"""
kv = KVCacheManager(num_blocks=8, block_size=4)
kv.allocate_slots("A", 10)
kv.allocate_slots("B", 5)
print("A:", kv.get_block_ids("A"), " B:", kv.get_block_ids("B"))
print("slot of A's token 9:", kv.get_slot_mapping("A", 9, 10), " slot of B's token 4:", kv.get_slot_mapping("B", 4, 5))
assert kv.get_slot_mapping("A", 9, 10) == [9] and kv.get_slot_mapping("B", 4, 5) == [16]
""")

md(r"""
Now B grows by 4 tokens and A finishes. B's new block is the next one in the free
queue, block 5: nothing needs to be contiguous, so any free block will do.
""")

code(r"""
new = kv.allocate_slots("B", 4)
kv.free("A")
fig = viz.block_tables(kv, new_block_ids=[b.block_id for b in new], arrows=True)
plt.show()
plt.close(fig)
print(viz.block_tables_text(kv, new_block_ids=[b.block_id for b in new]))
""")

md(r"""
On the left, each request's logical blocks, filled in proportion to the tokens they hold
and labelled with the physical block they map to; on the right, the physical blocks,
labelled `owner:logical block`. The pale tail of B's last block is reserved but holds no
token yet: with paging, that tail (fewer than `block_size` slots per request) is all the
memory a request can waste. The free queue hands out blocks from its front. A's blocks
went to the front when A finished, tail first: they hold no hash (no prefix cache here),
so they are handed out next, before the never-used ones (vLLM's order, chapter 02).

## 3. Scheduling: continuous batching

Every engine step the scheduler rebuilds the batch: running requests first (one token
each when decoding, a chunk of the prompt when prefilling), then waiting ones in arrival
order, as long as there are seats (`max_num_seqs`), token budget
(`max_num_batched_tokens`) and free blocks. When a running request needs a block and none
is free, the latest arrival is **preempted**: its blocks are freed and it waits to be
recomputed.

## 4. The whole engine, end to end
""")

if ENGINE:
    md(rf"""
Eight story openings on the course model (a small Llama trained for this course), through
a KV pool of only {DEMO_ENGINE_KWARGS["num_blocks"]} blocks of {DEMO_ENGINE_KWARGS["block_size"]}
slots, at most {DEMO_ENGINE_KWARGS["max_num_seqs"]} sequences and
{DEMO_ENGINE_KWARGS["max_num_batched_tokens"]} tokens per step, so that requests queue,
prompts are chunked, and the pool runs out. Greedy decoding, so the texts are the same on
every run.
""")
    kw = ", ".join(f"{k}={v}" for k, v in DEMO_ENGINE_KWARGS.items())
    code(rf"""
prompts = {DEMO_PROMPTS!r}
llm = LLM({kw})
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens={DEMO_MAX_TOKENS}, ignore_eos=True), use_tqdm=False)
for o in outs:
    print(f"{{o.prompt!r:32}} -> {{o.outputs[0].text!r}}")
trace = llm.trace  # one StepRecord per engine step: what the pictures are drawn from
print(len(trace), "steps")
""")
else:
    md(r"""
*The course model is not in this checkout yet, so this run uses the real `Scheduler` and
`KVCacheManager` with a stand-in for the model that always emits the same token (that is
all scheduling needs: lengths, not words). Once the engine ships its model, this cell
becomes `LLM(...).generate(...)` and the pictures below are drawn from `llm.trace`.*

Eight requests with seeded prompt and output lengths arrive over the first steps, through
a pool of only 24 blocks of 4 slots, at most 4 sequences and 16 tokens per step, so that
requests queue, prompts are chunked, and the pool runs out.
""")
    code(r"""
print(inspect.getsource(scheduler_demo_trace))
trace = scheduler_demo_trace()  # one StepRecord per engine step: what the pictures are drawn from
print(len(trace), "steps;", {rid: (r["prompt_len"], r["output_len"]) for rid, r in trace.requests.items()})
""")

md(r"""
## 5. The two pictures

**Active sequences.** A row per request, a column per step: grey while waiting, dark blue
while prefilling (the number is the chunk of prompt tokens computed in that step), light
blue while decoding one token per step, vermillion when preempted; a pale blue cell
(*running, idle*) means the request is in the scheduler's `running` list but got no token
that step, because the step's token budget ran out before its turn. These colours belong to
*states*; each request's own colour (the block tables on the right of the next picture)
is never one of them. The strips beneath count the sequences in each step's batch and the
tokens it used, against the two budgets.
""")

code(r"""
fig = viz.timeline(trace)
plt.show()
plt.close(fig)
""")

md(r"""
**One step, side by side.** The lecture's picture: the same timeline with one step
framed, and the block tables *after* that step. Here the step is the first preemption:
the preempted request's blocks are back in the free pool (grey, with a dashed edge:
*freed this step*), and the blocks just handed out have a black frame.
""")

code(r"""
i = interesting_step(trace)
fig = viz.step(trace, i)
plt.show()
plt.close(fig)
""")

md(r"""
## 6. Step through it

Drag the slider, press ▶ to play, or step with *prev* / *next*: at every step the batch
is rebuilt (left) and blocks are handed out and returned (right). Watch a request's table
grow one block at a time, and watch what happens to the pool just before a preemption.
(Where widgets cannot render, for example in a static viewer, the picture of the first
shown step appears instead.)
""")

code(r"""
viz.stepper(trace, start=i)
""")

md("The same step as text (what the tests and the notebook checks compare):")

code(r"""
print(viz.step_text(trace, i))
""")

md(r"""
And the memory over the whole run: slots holding a token's K/V (blue), reserved in a held
block but not holding a token yet (orange), free (grey). With paging the orange band is
only the tails of last blocks.
""")

code(r"""
fig = viz.memory(trace)
plt.show()
plt.close(fig)
print(viz.memory_text(trace, max_rows=8))
""")

md(r"""
## 7. Code tour

The pictures are drawn from a `StepRecord` per step, recorded after each step by
`minipaged.trace.record_step` (the engine and the simulator use the same one):
plain data, saved and reloaded as JSON, so every picture can be tested.
""")

code(r"""
from minipaged.trace import StepRecord

print(inspect.getsource(StepRecord))
print(trace.steps[i])
""")

md(r"""
## 8. Experiment: how big a pool?

Eight seeded requests (prompts of 4 to 22 tokens, 4 to 16 output tokens, arriving over the
first 8 steps) through pools of different sizes. This runs the real scheduler with a
stand-in for the model that always emits the same token, so it takes milliseconds:
scheduling needs lengths, not words. A smaller pool means fewer requests fit at once:
more steps, more preemptions. *Try*: change `max_num_seqs` or `max_num_batched_tokens`.
""")

code(r"""
print(f"{'num_blocks':>10} {'steps':>6} {'preemptions':>12} {'mean batch':>11}")
for num_blocks in (14, 18, 24, 32, 64):
    t = scheduler_trace(8, seed=0, num_blocks=num_blocks, block_size=4, max_num_seqs=4,
                        max_num_batched_tokens=16, prompt_range=(4, 22), output_range=(4, 16),
                        arrival_span=8)
    cells = viz.timeline_cells(t)
    pre = sum(len(s.preempted_ids) for s in t.steps)
    print(f"{num_blocks:>10} {len(t):>6} {pre:>12} {sum(cells.running) / len(t):>11.2f}")
""")

md(r"""
## 9. Map of the course

| chapter | idea | you build / measure |
|---|---|---|
| **00 overview** | all three | this notebook: the pictures and the words |
| **01 KV cache** | data | K and V per layer and head; bytes per token of real models; why contiguous reservation wastes memory (the paper's Fig. 2) |
| **02 block tables** | addressing | logical vs physical blocks, the free queue, on-demand allocation, slot mapping, the block-size trade-off |
| **03 PagedAttention** | addressing | attention through a block table: torch reference and Triton kernels (decode, split-KV, prefill); not FlashAttention |
| **04 continuous batching** | scheduling | the scheduler loop line by line; static vs continuous batching, measured |
| **05 scheduling** | scheduling | token budget and chunked prefill; memory pressure; recompute vs swap; thrash and head-of-line blocking |
| **06 sharing** | addressing | copy-on-write forks for parallel sampling and beam search; prefix caching |
| **07 serving at scale** | all three | a simulator running the real scheduler on a GPU cost model: the paper's experiments |
| **08 vLLM today** | scheduling, addressing | the paper (vLLM v0) beside vLLM v1, each pair run on one workload: admission, preemption (swap vs recompute), chunked prefill with one token budget, fork vs child requests over the prefix cache, prefix caching; what came after the paper |
| **09 live server** | all three | `minipaged serve` behind the OpenAI API: requests arriving at Poisson times, streaming, hang-ups, the live trace and `/metrics` |
| **10 speculative decoding** | scheduling, addressing | drafts in the block table, the rejection sampler, rolling back rejected tokens |
| **11 distributed** | all three | tensor parallelism: one block table, N workers each holding its heads of every block |
| **03a, 07a, 09a, 11a** (appendices) | | `03a_cpu_backend`: the `"cpu"` backend in C; `07a_cpu_step_cost`: where a CPU step's time goes; `09a_two_processes`: what the engine-core process buys; `11a_shm_allreduce`: the shared-memory all-reduce |
| **99** (instructor) | | `99_instructor_appendix`: the package's bodies of the exercised functions, after hand-in |
| **exercises/** | | one notebook per chapter, `ch00_overview` .. `ch11_distributed` (ex0–ex11): predict, build and measure, graded automatically |

`docs/course_path.md` lays the chapters and exercises out week by week, with concept
questions for the end of each chapter; `docs/glossary.md` defines every term the course
uses.

## Recap

- **Data**: the KV cache holds every token's keys and values, per layer; it grows one
  token per request per step.
- **Addressing**: block tables map logical blocks to any free physical block, so a request
  wastes less than one block and the pool never fragments.
- **Scheduling**: the batch is rebuilt at every step under `max_num_seqs`,
  `max_num_batched_tokens` and free blocks; when blocks run out, the latest arrival is
  preempted.
- Every picture is drawn from an `EngineTrace`, recorded step by step; each has a text
  twin (`viz.*_text`).

**Next**: chapter 01 measures the KV cache.
""")

md(r"""
## Readings

* **The paper**: Kwon et al., "Efficient Memory Management for Large Language Model Serving
  with PagedAttention" (SOSP 2023). §1 Introduction, §2 Background (2.1 transformers,
  2.2 autoregressive generation, 2.3 batching), and §4 Method's overview (Fig. 4: the
  scheduler, the KV cache manager, the workers): this chapter's engine in one figure.
* **Orca** (Yu et al., OSDI 2022): iteration-level scheduling, the idea behind "scheduling".
* The engine step, schedule → execute → update: vLLM v1 `vllm/v1/engine/core.py`
  (`EngineCore.step`) ↔ `minipaged/engine/core.py`, and the frontend around it (prompts to
  token ids, token ids to text: `Processor`, `OutputProcessor`) `vllm/v1/engine/llm_engine.py`
  ↔ `minipaged/engine/llm_engine.py`; the paper's v0.2: `vllm/engine/llm_engine.py`
  (`LLMEngine.step`).
* The three ideas' homes in vLLM v1: `vllm/v1/core/kv_cache_manager.py` ↔
  `minipaged/core/kv/kv_cache_manager.py`, `vllm/v1/core/sched/scheduler.py` ↔
  `minipaged/core/sched/scheduler.py`, `vllm/v1/worker/gpu_model_runner.py` ↔
  `minipaged/worker/model_runner.py`.
* The user's side (v1): `vllm/entrypoints/llm.py` (`LLM.generate`) and
  `vllm/sampling_params.py` ↔ `minipaged/engine/llm.py`, `minipaged/sampling_params.py`.
""")

write("00_overview", "engine run" if ENGINE else "scheduler + fake model run")
