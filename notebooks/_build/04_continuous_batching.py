"""Generate notebooks/04_continuous_batching.ipynb (run from the repo root, then execute it).

python notebooks/_build/04_continuous_batching.py
jupyter nbconvert --to notebook --execute --inplace notebooks/04_continuous_batching.ipynb
"""

from _nb import code, md, write

md(r"""
# 04 · Continuous batching

Chapters 01–03 were about the *data* (the KV cache) and its *addressing* (block tables,
PagedAttention). This chapter is about the third idea, kept apart from the other two:
**scheduling**. Which requests run at each step of the engine?

**You will learn**

1. **static batching**: a batch is formed, runs until its *last* member is done, and only
   then does the next batch start (FasterTransformer-style serving);
2. **continuous batching** (iteration-level scheduling, from Orca; the core of vLLM): the
   batch is rebuilt at *every* step, so a finished request's place is refilled at once;
3. how the scheduler loop of `minipaged` is built, and the engine step around it;
4. what one step is for the model: the packed batch of tokens, positions, cache slots and
   block tables that the model runner builds and the paged attention kernel reads;
5. how to **measure** the difference without a stopwatch: output tokens per engine step,
   a number that is the same on every machine.

Everything runs on the course model on a CPU, in a few seconds.
""")

md("## Setup")

code(r"""
import inspect
import random

import matplotlib.pyplot as plt
import torch

from minipaged import LLM, SamplingParams, viz
from minipaged.core import Request
from minipaged.core import Scheduler, StaticBatchScheduler
from minipaged.trace import run_scheduler
from minipaged.engine.core import EngineCore
from minipaged.viz.loops import outline_text
from minipaged.worker import ModelRunner

torch.set_num_threads(1)  # the course model is tiny: one thread is fastest and steadiest
""")

md(r"""
## 1. The concept

A language model produces one token per sequence per forward pass. A serving engine
therefore runs in **steps**: each step is one forward pass over a *batch* of sequences.
Requests differ wildly in how many tokens they want, so the question is what to do when one
member of the batch is done and the others are not.

| | static batching | continuous batching |
|---|---|---|
| when is the batch formed? | when the previous batch is completely done | at every step |
| a finished request's place | stays empty until the whole batch is done | refilled at the next step |
| a new request waits for | the current batch's *longest* request | a free place (a sequence slot, tokens, KV blocks) |
| KV memory per request | reserved up front for its maximum length | grows block by block (paging) |

The last row is why the two ideas of vLLM go together: continuous batching admits requests
whenever memory is free, and paging makes memory free in small pieces, as soon as tokens
are actually produced.

The tables below come from the real schedulers of `minipaged.core.sched` (`static.py` and
`scheduler.py`, vLLM v1's rule), driven by a
fake model (`run_scheduler`, every sampled token is 7): the scheduler only decides *who
computes how many tokens*, so no model is needed to count steps.
""")

md(r"""
**Contract card · the scheduler step, `Scheduler.schedule()` + `update_from_output()`**
(`minipaged.core.sched.scheduler.Scheduler`; vLLM v1 `vllm/v1/core/sched/scheduler.py`)

| | |
|---|---|
| **inputs** | the queues `waiting` (FCFS, arrival order) and `running`; the knobs `max_num_seqs`, `max_num_batched_tokens` (one token budget per step), `enable_chunked_prefill`; free blocks, asked from the `KVCacheManager` (`allocate_slots`) |
| **outputs** | a `SchedulerOutput`: `scheduled` = `[(request, num_new_tokens)]` (a decode is 1 token, a prefill chunk many), `admitted`, `preempted`, `finished`, `refused`; after the forward, `update_from_output(output, sampled_token_ids)` advances `num_computed_tokens`, appends the sampled tokens and frees the blocks of finished requests |
| **invariants** | `len(running) <= max_num_seqs`; `sum(num_new_tokens) <= max_num_batched_tokens`; every request sits in exactly one queue with a matching status; exactly the running requests hold blocks, `ceil(num_computed_tokens / block_size)` of them between steps; running requests are served before any waiting one, and waiting ones strictly in arrival order; exactly one `update_from_output` per `schedule` (`check_invariants()` asserts these) |
| **failure modes** | a malformed request -> `ValueError` from `add_request`; a request that can never fit -> `FINISHED_IGNORED`, reported in `refused`; `update_from_output` without a token for a finished prefill -> `ValueError`; silent ones: over-admission makes preemption thrash (work recomputed, chapter 05), a long prompt at the head blocks those behind it, a scheduler that never refills a freed seat (static batching) wastes steps without any error |
| **hand-check** | the cell below: three requests, `max_num_seqs=2`, step counts worked out on paper first |
""")

md(r"""
## 2. A hand check on a tiny example

Three requests with 4-token prompts want **2**, **8** and **3** output tokens; the batch
holds at most **2** sequences (`max_num_seqs=2`). Work it out on paper first:

* **static**: step 0 prefills A and B (each prefill also yields the first output token).
  A needs 1 more decode (step 1), B needs 7 more (steps 1–7). Only at step 8 can C start:
  prefill at 8, decodes at 9 and 10. **11 steps.**
* **continuous**: as above until A finishes at step 1. At step 2 C takes A's place
  (prefill), decodes at steps 3 and 4; B finishes at step 7. **8 steps.**

Both produce 2 + 8 + 3 = 13 tokens. The code agrees:
""")

code(r"""
def tiny_requests():
    return [Request(name, [3, 4, 5, 6], SamplingParams(max_tokens=m, ignore_eos=True))
            for name, m in (("A", 2), ("B", 8), ("C", 3))]

tiny = {}
for cls in (StaticBatchScheduler, Scheduler):
    sched = cls(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    tiny[cls.__name__] = run_scheduler(sched, tiny_requests(), next_token=lambda r: 7)

assert len(tiny["StaticBatchScheduler"]) == 11 and len(tiny["Scheduler"]) == 8
for name, t in tiny.items():
    finish = {rid: info["finish_step"] for rid, info in t.requests.items()}
    print(f"{name:22s} {len(t):2d} steps, 13 tokens -> {13 / len(t):.2f} tokens/step; finish steps {finish}")
""")

md(r"""
The timelines in text: a row per request, a column per step (`P` prefill, `d` decode,
`.` waiting, `|` finished). The legend also names `-` **running, idle**: the request is in
`running` and keeps its blocks, but got no tokens in that step (for example when the token
budget ran out before its turn); it is not waiting and loses nothing. These runs have none.
The `seqs` strip underneath is the batch size at each step: static batching runs half-empty
from step 2 to step 7.
""")

code(r"""
print(viz.timeline_text(tiny["StaticBatchScheduler"]))
print()
print(viz.timeline_text(tiny["Scheduler"]))
""")

md(r"""
## 3. One workload on the course model, both ways

Now the real engine: twelve story openings on the course model, each asking for a different
number of tokens (`ignore_eos=True`, so the lengths are exactly the ones drawn below).
Both engines get the **same KV memory** (48 blocks of 8 token slots) and the same
`max_num_seqs=6`; they differ only in `scheduling`.

* `scheduling="static"` uses `StaticBatchScheduler`: a batch starts only when the previous
  one is done, and each member reserves blocks for `prompt + max_tokens` up front (the
  contiguous reservation of a pre-paging server, and the *best* case of it: it knows each
  request's exact maximum);
* `scheduling="continuous"` uses `Scheduler`: blocks on demand, the batch rebuilt every step.
""")

code(r"""
PROMPTS = [
    "Once upon a time", "The little dog", "One day, a girl named Lily", "The old man walked to the",
    "There was a big red ball", "In the morning, the cat", "Tom and his friend", "The bird sang a song",
    "Mia found a box", "The sun was hot and", "A small bird sat on", "At the end of the day",
]
rng = random.Random(4)
MAX_TOKENS = [rng.choice([6, 10, 16, 24, 40, 60]) for _ in PROMPTS]
params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
print("max_tokens per request:", MAX_TOKENS)

ENGINE = dict(block_size=8, num_blocks=48, max_num_seqs=6, max_num_batched_tokens=256)
runs = {}
for scheduling in ("static", "continuous"):
    llm = LLM(scheduling=scheduling, **ENGINE)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    runs[scheduling] = (llm.trace, outs)

same = [o.outputs[0].token_ids for o in runs["static"][1]] == [o.outputs[0].token_ids for o in runs["continuous"][1]]
print("identical outputs under both schedulers:", same)
for i in (0, 2):
    print(f"  {PROMPTS[i]!r} -> {runs['continuous'][1][i].outputs[0].text!r}")
""")

md(r"""
Scheduling changes *when* each token is computed, not *which* token: greedy outputs are
identical (the test suite checks this against Hugging Face transformers too). That holds
here because the course model runs in fp32, where the differences are too small to flip an
argmax. They are not zero: a CPU GEMM also picks its kernel (blocking, vector width, the
order of a reduction) by the matrix's shape, so a row's logits can differ in the last bits
between a batch of 3 and of 30. On a GPU in bf16 or fp16 the same holds with larger
differences: matmul and attention kernels pick different tilings and reduction orders for
different batch shapes, and where two tokens are nearly tied a greedy output can change. vLLM offers batch-invariant kernels
(`VLLM_BATCH_INVARIANT=1`, in beta) for when outputs must not depend on the batch.

### Throughput, measured in tokens per step

Wall-clock time depends on the machine and on whatever else it is doing. The number of
engine steps does not. Since a GPU runs a small decode batch in about the same time as a
single sequence (decoding is memory-bound: the weights are read once per step either way),
**fewer steps for the same tokens is higher throughput**, and the ratio below is the
throughput ratio to expect where a step costs the same whatever the batch.
""")

code(r"""
def summary(trace, outs):
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_steps = [s for s in trace.steps if s.decode_ids]
    mean_batch = sum(len(s.scheduled) for s in trace.steps) / len(trace)
    return tokens, len(trace), tokens / len(trace), mean_batch

rows = {name: summary(*runs[name]) for name in ("static", "continuous")}
print(f"{'scheduling':12s}{'tokens':>8s}{'steps':>7s}{'tokens/step':>13s}{'mean batch':>12s}")
for name, (tokens, steps, tps, batch) in rows.items():
    print(f"{name:12s}{tokens:8d}{steps:7d}{tps:13.2f}{batch:12.2f}")
ratio = rows["continuous"][2] / rows["static"][2]
print(f"\ncontinuous / static throughput (tokens per step): {ratio:.2f}x")
""")

md(r"""
## 4. The picture: active sequences at each step

A row per request, a column per engine step: grey while waiting, dark blue for a prefill
(with its size), light blue for each decode, pale blue for "running, idle" (in `running`,
holding its blocks, no tokens this step), a bar at the finish. Blues mean in `running`,
greys not. The request names on the left carry each request's own colour, the colour of its
blocks in the block tables below: greens, yellows, oranges, browns, purples, never a colour
that means a state. The strips underneath
are the batch size and the tokens computed per step. Static batching shows its
*staircase*: each batch lingers until its longest member ends, while everyone behind it
waits. Continuous batching refills a place the step after it frees.
""")

code(r"""
for name in ("static", "continuous"):
    fig = viz.timeline(runs[name][0])
    fig.suptitle(f"{name} batching: {len(runs[name][0])} steps", x=0.01, ha="left")
    plt.show()
    plt.close(fig)
""")

md(r"""
The same pictures as text (this is what the tests compare):
""")

code(r"""
print(viz.timeline_text(runs["static"][0]))
print()
print(viz.timeline_text(runs["continuous"][0]))
""")

md(r"""
And one step of the continuous run up close, with the block tables of the sequences in the
batch. The step is the first where continuous batching does what static batching cannot: a
request finished at the previous step, and a newcomer is prefilled in its seat *next to*
the running decodes, in the same forward pass. Every request holds only the blocks its
tokens fill (the last one partly), which is what lets six sequences share 48 blocks.
""")

code(r"""
cont_trace = runs["continuous"][0]
# the first step at which a newcomer is prefilled next to running decodes: a seat freed by
# a finished request is refilled at once, and the newcomer takes fresh blocks
busy = next(s.step for s in cont_trace.steps if s.step > 0 and s.prefill_ids and s.decode_ids)
print(f"step {busy}: prefill {cont_trace.steps[busy].prefill_ids}, "
      f"decode {cont_trace.steps[busy].decode_ids}, finished the step before "
      f"{cont_trace.steps[busy - 1].finished_ids}")
fig = viz.step(cont_trace, busy)
plt.show()
plt.close(fig)
print(viz.step_text(cont_trace, busy))
""")

md(r"""
### The same kind of step as tensors: what the model runner hands the model

The step picture is the scheduler's view: who runs, how many tokens, which blocks. The
model sees none of that. Between the two sits the worker (`minipaged/worker/model_runner.py`,
vLLM v1's `gpu_model_runner.py`): it receives the plain half of the step's output,
`SchedulerOutput.for_worker()` (ids, token ids, block ids; no `Request` objects), keeps
its own copy of each request and its block table, and packs every scheduled token of every
request into **one flat batch**, with no padding between requests
(`ModelRunner.prepare_inputs`). This is where the three ideas meet: the scheduler chose the
rows (continuous batching), the block tables say where each row's K/V go and where its
context is (paging), and one attention call reads them all (PagedAttention).

A small run, blocks of 4 tokens, a budget of 10 tokens per step, on the course model
itself. A and B (4-token prompts) start at step 0; C (an 11-token prompt) arrives at step
2 and gets 8 tokens there, the budget minus A's and B's decodes; D (3 tokens) arrives at
step 3. Driving a real `Scheduler` and a `ModelRunner` by hand, step 3 mixes all three
kinds of row: two decodes, the last chunk of C's prompt, and D's whole prompt.
""")

code(r"""
model = llm.llm_engine.model_runner.model  # the course model, loaded in section 3
tokenizer = llm.llm_engine.tokenizer
BS = 4


def story(rid, text):
    return Request(rid, tokenizer.encode(text), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


A, B, C, D = (story("A", "Once upon a"), story("B", "The dog"),
              story("C", "One day, a girl named Lily went to the"), story("D", "Tom"))
sched = Scheduler(num_blocks=16, block_size=BS, max_num_seqs=4, max_num_batched_tokens=10)
runner = ModelRunner(model, num_blocks=16, block_size=BS)  # the worker: its own tables
arrivals = {0: [A, B], 2: [C], 3: [D]}
for step in range(4):
    for r in arrivals.get(step, []):
        sched.add_request(r)
    out = sched.schedule()
    plain = out.for_worker()  # all the worker ever sees
    print(f"step {step}: num_scheduled_tokens {plain.num_scheduled_tokens}")
    if step < 3:
        result = runner.execute_model(plain)  # a ModelRunnerOutput: one token list per request
        sched.update_from_output(out, result)

print("\nstep 3, the plain data the worker receives:")
for new in plain.scheduled_new_reqs:
    print(f"  NewRequestData    {new.req_id}: prompt_token_ids {new.prompt_token_ids}, "
          f"block_ids {new.block_ids}, num_computed_tokens {new.num_computed_tokens}")
for cached in plain.scheduled_cached_reqs:
    print(f"  CachedRequestData {cached.req_id}: new_block_ids {cached.new_block_ids}, "
          f"num_computed_tokens {cached.num_computed_tokens}")
print(f"  finished_req_ids {sorted(plain.finished_req_ids)}, preempted_req_ids {sorted(plain.preempted_req_ids)}")
""")

md(r"""
D is new to the worker, so it comes whole (`NewRequestData`: its tokens and its block
table). A, B and C are known: each `CachedRequestData` carries only the blocks added this
step (C's third block) and the count of tokens already computed; the worker appends them to
its own table. Now the step itself. A forward hook on the model's first attention layer
records exactly what that layer was handed: the step's `ModelInput` and the layer's
queries, keys and values, after the runner built the batch.
""")

code(r"""
from minipaged.model.attention import PagedAttention

attn = next(m for m in model.modules() if isinstance(m, PagedAttention))  # layer 0's attention
seen = {}
hook = attn.register_forward_hook(lambda module, args, output: seen.update(args=args, out=output))
result = runner.execute_model(plain)  # update states, prepare_inputs, forward, sample
hook.remove()
sched.update_from_output(out, result)
q, k, v, (k_cache, v_cache), inp = seen["args"]  # q [T, H, D], k / v [T, KVH, D]
req_ids = list(plain.num_scheduled_tokens)  # the batch order: running first, then admitted

for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "cu_seqlens_q"):
    print(f"{name:13s} {getattr(inp, name).tolist()}")
print(f"{'block_tables':13s} {inp.block_tables.tolist()}  (one row per sequence, padded with 0)")
print(f"q {list(q.shape)}  k_cache {list(k_cache.shape)} = [num_blocks, block_size, num_kv_heads, head_dim]")
print()
print(viz.packed_batch_text(inp, req_ids, BS))
fig = viz.packed_batch(inp, req_ids, BS, order=["A", "B", "C", "D"])
plt.show()
plt.close(fig)
""")

md(r"""
Read it as the model does. `T = 8` rows, one per token computed this step; no row is
padding. `cu_seqlens_q` cuts them into the four sequences: a decode is one row, C's chunk
three rows (positions 8–10: its first 8 tokens were computed at step 2 and their K/V are in
blocks 4 and 5, grey in the picture, read but not written), D's prompt three rows.
`seq_lens` is each sequence's context after this step, so a query row sees keys
`0 .. seq_len - q_len + j`: C's row at position 8 sees 9 keys, 8 of them from the cache.

**Hand-check one slot.** C's first row this step has position `i = 8`. Its block table is
`[4, 5, 6]` and `block_size = 4`, so its K/V go to
`slot = table[i // bs] * bs + i % bs = table[2] * 4 + 0 = 6 * 4 + 0 = 24`, the first slot
of the block the scheduler gave C this step. The cell checks that against `slot_mapping`
and against the cache itself: the key the layer computed for that row now sits in slot 24.
""")

code(r"""
row = req_ids.index("C")  # C's first row: cu_seqlens_q[b] for b = C's place in the batch
row = int(inp.cu_seqlens_q[row])
i, table = int(inp.positions[row]), inp.block_tables[req_ids.index("C")].tolist()
slot = table[i // BS] * BS + i % BS
print(f"row {row}: position {i}, table {table} -> slot {table[i // BS]} * {BS} + {i % BS} = {slot}")
assert slot == int(inp.slot_mapping[row]) == 24
written = k_cache.view(-1, *k_cache.shape[2:])[slot]  # [KVH, D]: the cache seen as slots
print("the key of that row is in k_cache slot", slot, ":", torch.equal(written, k[row]))
""")

md(r"""
**The kernel, checked against the reference.** The layer's attention ran on the engine's
default backend (`paged_attention_torch`). The same tensors go to the course's Triton
kernel `paged_attention_prefill` (run by Triton's interpreter on a CPU), which takes the
whole mixed batch, decodes and prefill rows together, in one call; and both are compared
with the readable reference `paged_attention_prefill_ref` (`minipaged/kernels/reference.py`),
which loops over the sequences, gathers each one's K/V through its block table and runs
plain causal attention.
""")

code(r"""
from minipaged.kernels import paged_attention_prefill, paged_attention_prefill_ref

ref = paged_attention_prefill_ref(q, k_cache, v_cache, inp.block_tables, inp.cu_seqlens_q, inp.seq_lens,
                                  scale=attn.scale)  # [T, H, D]
triton_out = paged_attention_prefill(q, k_cache, v_cache, inp.block_tables, inp.cu_seqlens_q, inp.seq_lens,
                                     attn.scale, max_query_len=inp.max_query_len)
print(f"output {list(ref.shape)} = [T, num_heads, head_dim]")
print("the model's attention (torch backend) == reference:", torch.allclose(seen["out"], ref, atol=1e-5))
print("Triton paged_attention_prefill == reference:       ", torch.allclose(triton_out, ref, atol=1e-5))
print("tokens sampled this step (rows", inp.logits_indices.tolist(), "):",
      dict(zip(result.req_ids, result.sampled_token_ids)))
""")

md(r"""
Only the last row of each sequence is turned into logits (`logits_indices`), and a row
samples only if its request has then computed all its known tokens: A, B and C (whose
prompt is now complete) get a token, and so does D, whose whole prompt ran. A prompt's
earlier chunks produce no token; they only fill the cache.
""")

md(r"""
## 5. Code tour: the two schedulers

### Static batching

`StaticBatchScheduler.schedule` is short. Read it with these questions: *when* is a batch
formed, and what does a member reserve?
""")

code(r"""
print(inspect.getsource(StaticBatchScheduler.schedule))
""")

md(r"""
* `if not self.running:` — **the** line of static batching: a new batch is formed only when
  the previous one is entirely finished.
* `kv.allocate_slots(request, self._reservation(request))` — each member reserves KV slots
  for its whole maximum length (`prompt + max_tokens - 1`) before computing anything. When
  the pool cannot hold the next one, the batch is closed (`break`): memory, not
  `max_num_seqs`, is often what limits the batch.
* the `for request in self.running` loop — every member computes what it lacks: the whole
  prompt in the first step, then one token per step.

### Continuous batching

`Scheduler.schedule` (`minipaged/core/sched/scheduler.py`, vLLM v1's loop) does more,
because it has more freedom: chunked prefill and preemption by recompute (chapter 05). It
is one loop, read top to bottom without leaving the file except into the `KVCacheManager`.
Its two phases are exactly what exercises ex4.1 (the waiting phase) and ex5.4 (the running
phase) ask you to write, so this chapter shows its shape, not its lines; open the file once
you have handed them in. In pseudocode:

```text
schedule() -> SchedulerOutput
    budget = max_num_batched_tokens
    1. RUNNING, front to back, while budget > 0:
         n = tokens it lacks (1 for a decode, the next chunk of a prefill), at most budget
         until kv.allocate_slots(request, n) gives blocks:
             preempt the LAST of running (recompute: free its blocks, back to the front of
             waiting); if that was the request itself, stop this phase
         schedule (request, n); the worker gets its new block ids; budget -= n
    2. WAITING, front to back (FCFS), unless this step preempted,
       while budget > 0 and len(running) < max_num_seqs:
         look up the prefix cache; n = tokens it lacks, at most budget
         kv.allocate_slots(request, n, cached blocks,
                           full_sequence_must_fit=scheduler_reserve_full_isl, watermark)
         None -> stop: nobody behind it may overtake
         move it to running; schedule (request, n); the worker gets it whole; budget -= n
    return the output (its plain half, for_worker(), is all the worker sees)
```

The phases and the calls each makes, read off the real source (`minipaged.viz.loops`, so
this cannot drift from the code):
""")

code(r"""
# a code tour: viz.loops reads inspect.getsource(fn); nbval does not compare it
print(outline_text(Scheduler.schedule))
""")

md(r"""
* `budget = self.max_num_batched_tokens`: a step has one budget of tokens, shared by
  decodes (1 token each) and prefill chunks (many).
* **Phase 1, running first**: every running request gets its next token or its next
  prefill chunk *before* anybody new is admitted. When `allocate_slots` answers `None` the
  last of `running` is popped and preempted (`_preempt`, recompute), and the allocation
  retried: going front to back, the victim is never one already scheduled this step.
* **Phase 2, waiting**: only if nothing was preempted, then strictly in arrival order: the
  first request that does not fit stops admission. `allocate_slots` applies vLLM's
  admission options (`scheduler_reserve_full_isl`, `watermark`, chapter 05).
* `_schedule` records `(request, n)` and caches the blocks the step fills; the two
  `append`s of `scheduled_cached_reqs` / `scheduled_new_reqs` are what the worker of the
  previous section received.

There is no `if not self.running` here: **the batch is rebuilt at every call.** A request
that finished at the previous step simply is not in `self.running` any more, and its place
(and its blocks, freed by `update_from_output`) goes to the next in line. The paper's own
loop (`PaperScheduler`, `core/sched/paper.py`: sequence groups, swap, copy-on-write) is a
separate loop of the same shape; chapter 08 diffs the two.

### The engine step around the scheduler

`EngineCore.step` (`minipaged/engine/core.py`, as vLLM v1's `EngineCore.step`) is one
iteration of the serving loop: schedule, hand the batch to the executor (the worker builds
the flat batch, runs one forward pass and samples), hand the tokens back to the scheduler,
record the step for the pictures. The core sees token ids only: `LLMEngine.step` around it
(`minipaged/engine/llm_engine.py`) turns them into text and `RequestOutput`s
(`OutputProcessor`).
""")

code(r"""
print(inspect.getsource(EngineCore.step))
""")

md(r"""
`self.executor.execute_model(out)` hands the worker `out.for_worker()`, and
`ModelRunner.prepare_inputs` turns it into the flat tensors of section 4 (`input_ids`,
`positions`, `slot_mapping`, `block_tables`, `seq_lens`, `cu_seqlens_q`);
`update_from_output` advances `num_computed_tokens`, appends
the sampled tokens, and frees the blocks of requests that hit EOS, a stop token or their
`max_tokens`. Nothing else is needed for continuous batching: it is a scheduling decision
made fresh at every step.
""")

md(r"""
## 6. Experiment: when does continuous batching pay off?

Static batching wastes the steps in which a batch waits for its longest member. So the gain
should grow with the **spread** of output lengths: if every request wants the same number
of tokens, the two schedulers coincide. The sweep uses the real schedulers with the fake
model (exact, instant): 48 requests with 8-token prompts, outputs drawn uniformly from
`[mean - spread, mean + spread]` around a mean of 64.
""")

code(r"""
def tokens_per_step(cls, lengths, num_blocks=96):
    reqs = [Request(str(i), [5] * 8, SamplingParams(max_tokens=m, ignore_eos=True))
            for i, m in enumerate(lengths)]
    sched = cls(num_blocks=num_blocks, block_size=8, max_num_seqs=8, max_num_batched_tokens=256)
    trace = run_scheduler(sched, reqs, next_token=lambda r: 7)
    return sum(lengths) / len(trace)

print(f"{'spread':>7s}{'static':>9s}{'continuous':>12s}{'ratio':>8s}")
spreads = [0, 16, 32, 48, 63]
ratios = []
for spread in spreads:
    rng = random.Random(0)
    lengths = [rng.randint(64 - spread, 64 + spread) for _ in range(48)]
    s = tokens_per_step(StaticBatchScheduler, lengths)
    c = tokens_per_step(Scheduler, lengths)
    ratios.append(c / s)
    print(f"{spread:7d}{s:9.2f}{c:12.2f}{c / s:8.2f}")
""")

code(r"""
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(spreads, ratios, marker="o", color="#0072B2")
ax.axhline(1.0, color="grey", lw=0.8, ls="--")
ax.set_xlabel("spread of output lengths (tokens, mean 64)")
ax.set_ylabel("tokens/step: continuous / static")
ax.set_title("The gain grows with the variance of lengths")
fig.tight_layout()
plt.show()
plt.close(fig)
""")

md(r"""
With equal lengths (`spread 0`) the two coincide, up to the memory each reserves. The wider
the spread, the more steps a static batch spends half empty, and the larger the gain. This
is the gain of **iteration-level scheduling**, which Orca (OSDI 2022) introduced; it is
*not* the 2–4× of the vLLM paper. The paper's 2–4× is its throughput gain at the same
latency over the state of the art, and its main comparison (§6.2) is against its own
re-implementations of **Orca**, which already batch at every iteration (1.7–2.7× the
request rate of Orca (Oracle), over three OPT models). §6.2 credits that gain to **memory
management**: paged KV memory fits more requests into the batch than Orca's contiguous
reservations (Fig. 13: 2.2× more than Orca (Oracle) for OPT-13B). The paper's up-to-22× is
against FasterTransformer, which has neither iteration-level scheduling nor paging.
Section 7 separates the two gains; chapter 07 reads the paper's numbers in detail.
""")

md(r"""
## 7. Experiment: scheduling and memory, each gain on its own

The static baseline of section 3 differs from the continuous scheduler in *two* ways: it
forms batches statically, and it reserves each member's maximum length. To see which
difference buys what, run the 2×2 on **one workload and one KV budget**:

| | contiguous, reserved for `prompt + max_tokens` | paged, a block at a time |
|---|---|---|
| **static batching** | `StaticBatchScheduler` (FasterTransformer-style) | static batches over paged memory (a 6-line subclass below) |
| **continuous batching** | `OrcaScheduler` (`core/sched/orca.py`, the paper's Orca baseline) | `Scheduler` (vLLM) |

The workload: 64 requests with 16-token prompts and `max_tokens=128`, each *stopping
early* at a stop token after a length drawn from an exponential distribution (mean 40),
as chat requests do. A reservation must cover `max_tokens`, because nobody knows where a
request will stop. The KV budget is 96 blocks of 16 slots (1,536 token slots);
`max_num_seqs=32`, so memory, not seats, limits the batch. The fake model plays the stop
token; everything else is the real schedulers.

The static-over-paged cell is not a scheduler anyone ships; it is the missing corner of
the table: the base `Scheduler` with admission allowed only while the batch is being
formed (and no chunked prefill, as the other static baseline).
""")

code(r"""
from minipaged.core.sched.orca import OrcaScheduler
from minipaged.core.sched.static import StaticPagedScheduler  # static batches over paged memory


PROMPT_LEN, MAX_TOKENS_2X2, STOP = 16, 128, 2
rng = random.Random(0)
STOP_AT = [min(MAX_TOKENS_2X2, max(4, int(rng.expovariate(1 / 40)))) for _ in range(64)]


def requests_2x2():
    return [Request(str(i), [5] * PROMPT_LEN, SamplingParams(max_tokens=MAX_TOKENS_2X2, stop_token_ids=[STOP]))
            for i in range(len(STOP_AT))]


def fake_model(r):  # the stop token once the request reaches its drawn length
    return STOP if r.num_output_tokens + 1 >= STOP_AT[int(r.request_id)] else 7


BLOCK_SIZE, NUM_BLOCKS = 16, 96
KNOBS = dict(max_num_seqs=32, max_num_batched_tokens=2048)


def run_orca():  # OrcaScheduler.add_request needs the reservation length: drive it by hand
    sched = OrcaScheduler(NUM_BLOCKS * BLOCK_SIZE, max_model_len=PROMPT_LEN + MAX_TOKENS_2X2,
                          policy="oracle", **KNOBS)
    reqs = requests_2x2()
    for r in reqs:
        sched.add_request(r, PROMPT_LEN + MAX_TOKENS_2X2)
    steps, batch = 0, 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        batch = max(batch, len(out.scheduled))
        done = {r.request_id: fake_model(r) for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
        sched.update_from_output(out, done)
        sched.check_invariants()
        steps += 1
    return sum(r.num_output_tokens for r in reqs), steps, batch


def run_blocks(cls):
    reqs = requests_2x2()
    trace = run_scheduler(cls(NUM_BLOCKS, BLOCK_SIZE, **KNOBS), reqs, next_token=fake_model)
    return sum(r.num_output_tokens for r in reqs), len(trace), max(len(s.scheduled) for s in trace.steps)


grid = {
    ("static", "reserved"): run_blocks(StaticBatchScheduler),
    ("static", "paged"): run_blocks(StaticPagedScheduler),
    ("continuous", "reserved"): run_orca(),
    ("continuous", "paged"): run_blocks(Scheduler),
}
tps = {k: tokens / steps for k, (tokens, steps, _) in grid.items()}
assert len({tokens for tokens, _, _ in grid.values()}) == 1, "every cell must produce the same tokens"
# each gain on its own: paging helps under either scheduling, continuous under either memory
assert all(tps[k, "paged"] > tps[k, "reserved"] for k in ("static", "continuous"))
assert all(tps["continuous", m] > tps["static", m] for m in ("reserved", "paged"))
print(f"{len(STOP_AT)} requests, {grid['static', 'paged'][0]} output tokens, KV budget {NUM_BLOCKS * BLOCK_SIZE} slots")
print(f"slots a request uses on average: {PROMPT_LEN + sum(STOP_AT) / len(STOP_AT):.0f}; "
      f"a reservation holds {PROMPT_LEN + MAX_TOKENS_2X2}")
print(f"{'scheduling':12s}{'memory':10s}{'steps':>7s}{'max batch':>11s}{'tokens/step':>13s}")
for (sched_kind, mem), (tokens, steps, batch) in grid.items():
    print(f"{sched_kind:12s}{mem:10s}{steps:7d}{batch:11d}{tps[sched_kind, mem]:13.2f}")
print()
for mem in ("reserved", "paged"):
    print(f"scheduling gain (continuous / static), {mem:8s} memory: {tps['continuous', mem] / tps['static', mem]:.2f}x")
for kind in ("static", "continuous"):
    print(f"memory gain (paged / reserved), {kind:10s} scheduling: {tps[kind, 'paged'] / tps[kind, 'reserved']:.2f}x")
print(f"vLLM over the Orca baseline (continuous, paged / continuous, reserved): "
      f"{tps['continuous', 'paged'] / tps['continuous', 'reserved']:.2f}x")
""")

code(r"""
fig, ax = plt.subplots(figsize=(5.5, 3))
colors = {"reserved": "#E69F00", "paged": "#0072B2"}
for j, mem in enumerate(("reserved", "paged")):
    xs = [i + (j - 0.5) * 0.36 for i in range(2)]
    vals = [tps[kind, mem] for kind in ("static", "continuous")]
    bars = ax.bar(xs, vals, width=0.34, color=colors[mem], label=f"{mem} memory")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
ax.set_xticks([0, 1], ["static batching", "continuous batching"])
ax.set_ylabel("output tokens per step")
ax.set_title("One workload, one KV budget: each gain on its own", fontsize=10)
ax.legend(frameon=False, fontsize=8)
fig.tight_layout()
plt.show()
plt.close(fig)
""")

md(r"""
Read the table by rows and by columns. Along a row, scheduling is fixed and only memory
changes: paging fits many more requests into the batch (the `max batch` column), because a
reservation for 128 output tokens holds 144 slots for a request that uses far fewer
(the average is printed above). Along a column, memory is fixed and only scheduling changes. Both gains are real,
and they multiply; the vLLM paper's comparison is the bottom row (Orca, reserved ->
vLLM, paged), which is why it credits memory management. The size of each gain depends on
the workload (how early requests stop compared with `max_tokens`) and on the budget; the
paper's measurements (OPT models, ShareGPT and Alpaca traces) are in chapter 07.

On a CPU, the stopwatch tells a smaller story than the step count, because a CPU step is
not free of batch size: its cost grows with the tokens in it. `minipaged bench` (or
`python benchmarks/serving.py`) measures both on this machine; chapter 07 discusses why
a paper's speedup does not transfer one to one.
""")

md(r"""
> **The paper (vLLM v0) and vLLM v1 today.** The scheduler you read above is vLLM v1's.
> The paper's (v0) scheduler differed in four ways, each a layer in minipaged:
>
> | | the paper (vLLM v0) | vLLM v1 (`vllm/v1/core/sched/scheduler.py`) |
> |---|---|---|
> | admission | a request is admitted only if its *whole* prompt's blocks fit, leaving a watermark free (`BlockSpaceManager.can_allocate`; `core/sched/paper.py`) | by default (`scheduler_reserve_full_isl=True`) only when the blocks for its *whole* sequence are free, although only the first chunk runs this step; with `False`, as soon as its *first chunk's* blocks are free |
> | preemption victim | the latest-arrived sequence group | the last request of `running` |
> | token budget | separate prefill and decode steps (a step ran prompts *or* decodes) | one unified budget, `max_num_batched_tokens`, shared by decodes and prefill chunks in the same step |
> | chunked prefill | not in the paper (added later in v0) | on by default (`enable_chunked_prefill=True`; it can still be turned off): a request is just "computed tokens so far"; a prompt is split across steps |
>
> Chapter 05 runs the admission rules and preemption victims side by side; chapter 08
> runs all of them.
>
> **Which vLLM setting each minipaged option is.** `Scheduler` takes vLLM's names. Its
> default, as vLLM's, is `scheduler_reserve_full_isl=True`: a request is admitted only when
> the blocks for its whole sequence are free. vLLM made it the default because the other
> rule, `scheduler_reserve_full_isl=False` (admitted when its first chunk fits),
> over-admits when prefills are chunked, and thrashes (chapter 05, section 5a, measures
> it). `Scheduler(watermark=0.05)` also keeps 5% of the pool free, vLLM's `watermark`
> option (off by default in v1; v0 kept 1%, the course's `PaperScheduler` 5%). `benchmarks/vllm_diff`
> runs each pair through 103 workloads step by step against vLLM's own `Scheduler` and finds
> them identical (with `Scheduler`'s defaults, whose free-queue order is vLLM's: chapter 02).
""")

md(r"""
## Recap

* **Static batching** forms a batch, runs it until the longest member finishes, and only
  then admits anyone else; each member reserves its maximum length up front.
* **Continuous batching** rebuilds the batch at every step: running requests first, then
  waiting ones in arrival order under `max_num_seqs`, the token budget and free KV blocks.
  It changes *when* tokens are computed, not *which*: outputs are identical here (fp32 on a
  CPU: shape-dependent kernels differ only in the last bits; on a GPU in bf16, they can
  change a nearly tied greedy token).
* Measured in **tokens per step**, continuous batching wins by more the more output lengths
  vary. Paged memory is a *separate* gain: the 2×2 shows each on its own, and the vLLM
  paper's 2–4× over Orca is the memory one (Orca already batches continuously).
* For the model, a step is one **packed ragged batch**: every scheduled token of every
  request in one flat tensor (no padding), `cu_seqlens_q` cutting it into sequences,
  `slot_mapping` (`table[i // bs] * bs + i % bs`) saying where each row's K/V go and the
  block tables where each sequence's context is; one paged attention call reads it all,
  and it equals the reference.
* Next, chapter 05 opens the scheduler further: token budgets and chunked prefill, and what
  happens when memory runs out (preemption by recompute or swap).
""")

md(r"""
## Readings

* **Orca** (Yu et al., OSDI 2022): iteration-level scheduling and selective batching, the
  continuous batching of this chapter.
* **The paper** (Kwon et al., SOSP 2023): §2.3 Batching Techniques for LLMs; §4.5 Scheduling
  and Preemption (first come, first served); §6.2 Basic Sampling (the gain over Orca, and
  why: Fig. 13's batch sizes).
* The paper's v0.2: `vllm/core/scheduler.py` (`Scheduler._schedule`) and
  `vllm/engine/llm_engine.py` (`step`).
* vLLM v1: `vllm/v1/core/sched/scheduler.py` (`schedule`, `update_from_output`) ↔
  `minipaged/core/sched/scheduler.py`; `vllm/v1/core/sched/output.py` (`SchedulerOutput`) ↔
  `minipaged/core/sched/output.py`; `vllm/v1/request.py` ↔ `minipaged/core/sched/request.py`.
* The loop around it: `vllm/v1/engine/core.py` (`EngineCore.step`) ↔
  `minipaged/engine/core.py`, under `vllm/v1/engine/llm_engine.py` (`LLMEngine.step`:
  outputs to text) ↔ `minipaged/engine/llm_engine.py`; the worker: `vllm/v1/worker/gpu_model_runner.py`
  (`_update_states`, `_prepare_inputs`) ↔ `minipaged/worker/model_runner.py`.
* The packed batch as vLLM teaches it: the "Paged Attention" page of vLLM's design docs,
  and Hugging Face's blog post on continuous batching (ragged batches, no padding).
* The baselines have no vLLM file: `minipaged/core/sched/static.py` (static batching),
  `minipaged/core/sched/orca.py` (Orca over contiguous reservation).
""")

write("04_continuous_batching")
