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
3. how to read the scheduler loop of `minipaged` line by line, and the engine step around it;
4. how to **measure** the difference without a stopwatch: output tokens per engine step,
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
from minipaged.engine.llm_engine import LLMEngine

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
`.` waiting, `|` finished). The `seqs` strip underneath is the batch size at each step:
static batching runs half-empty from step 2 to step 7.
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
Scheduling changes *when* each token is computed, never *which* token: greedy outputs are
identical (the test suite checks this against Hugging Face transformers too).

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
(with its size), light blue for each decode, a bar at the finish. The strips underneath
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
And one decode step of the continuous run up close, with the block tables of the sequences
in the batch: every request holds only the blocks its tokens fill (the last one partly),
which is what lets six sequences share 48 blocks.
""")

code(r"""
cont_trace = runs["continuous"][0]
busy = max((s for s in cont_trace.steps if s.decode_ids), key=lambda s: (len(s.scheduled), -s.step)).step
fig = viz.step(cont_trace, busy)
plt.show()
plt.close(fig)
print(viz.step_text(cont_trace, busy))
""")

md(r"""
## 5. Code tour: the two schedulers, line by line

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

`Scheduler.schedule` (`minipaged/core/sched/scheduler.py`, vLLM v1's rule) does more,
because it has more freedom: chunked prefill and preemption by recompute (chapter 05). The
paper's other mechanisms (swap, the admission watermark, sequence groups) are *layers*
that extend this class in their own modules (chapters 05 and 06); the base names none of
them. For now follow the two passes.
""")

code(r"""
print(inspect.getsource(Scheduler.schedule))
""")

md(r"""
* `budget = self.max_num_batched_tokens` — a step has a budget of tokens, shared by
  decodes (1 token each) and prefills (many).
* **Pass 1, `# 1. RUNNING first`** — every running request gets its next token (or its
  next prefill chunk) *before* anybody new is admitted, in arrival order. `_allocate` asks
  the `KVCacheManager` for the blocks; when it answers `None`, `self._preempt(out)` takes
  blocks back from the last request of `running` and retries (chapter 05).
* `while not preempted ...` — a step that had to preempt admits nobody.
* **Pass 2, `# 2. WAITING`** — then the queue, strictly in arrival order (FCFS):
  `_admit_next` looks up the prefix cache and asks for the first chunk's blocks, while
  `max_num_seqs`, the token budget and the free blocks allow. The first one that does not
  fit stops admission: nobody jumps the queue.
* The `# hook` methods (`_units`, `_plan`, `_allocate`, `_evict`, `_admit_next`, ...) are
  where the layers of chapters 05 and 06 plug in.

There is no `if not self.running` here: **the batch is rebuilt at every call.** A request
that finished at the previous step simply is not in `self.running` any more, and its place
(and its blocks, freed by `update_from_output`) goes to the next in line.

### The engine step around the scheduler

`LLMEngine.step` is one iteration of the serving loop: schedule, move blocks if the
scheduler asked for it, build the flat batch, one forward pass, sample, hand the tokens
back to the scheduler, record the step for the pictures.
""")

code(r"""
print(inspect.getsource(LLMEngine.step))
""")

md(r"""
`ModelRunner.prepare` turns the scheduler's `(request, num_new_tokens)` list into the flat
tensors of chapter 03 (`input_ids`, `positions`, `slot_mapping`, `block_tables`,
`seq_lens`, `cu_seqlens_q`); `update_from_output` advances `num_computed_tokens`, appends
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
the spread, the more steps a static batch spends half empty, and the larger the gain. Real
traffic (chat, the ShareGPT lengths of the vLLM paper) has a very wide spread: this is
where the paper's 2–4× (and up to 22× against FasterTransformer) comes from.

On a CPU, the stopwatch tells a smaller story than the step count, because a CPU step is
not free of batch size: its cost grows with the tokens in it. `minipaged bench` (or
`python benchmarks/serving.py`) measures both on this machine; chapter 07 discusses why
a paper's speedup does not transfer one to one.
""")

md(r"""
## Recap

* **Static batching** forms a batch, runs it until the longest member finishes, and only
  then admits anyone else; each member reserves its maximum length up front.
* **Continuous batching** rebuilds the batch at every step: running requests first, then
  waiting ones in arrival order under `max_num_seqs`, the token budget and free KV blocks.
  It changes *when* tokens are computed, never *which*: outputs are identical.
* Measured in **tokens per step**, continuous batching wins by more the more output lengths
  vary; paged KV memory is what lets it admit requests as soon as a few blocks free up.
* Next, chapter 05 opens the scheduler further: token budgets and chunked prefill, and what
  happens when memory runs out (preemption by recompute or swap).
""")

write("04_continuous_batching")
