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
here because the course model runs in fp32 on a CPU, where a row's result does not depend
on what else is in the batch. On a GPU in bf16 or fp16 it need not: matmul and attention
kernels pick different tilings and reduction orders for different batch shapes, so the
same request can get slightly different logits in a batch of 3 and of 30, and where two
tokens are nearly tied a greedy output can change. vLLM offers batch-invariant kernels
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
> them identical (with vLLM's free-queue order turned on: `free_uncached_first=True`).
""")

md(r"""
## Recap

* **Static batching** forms a batch, runs it until the longest member finishes, and only
  then admits anyone else; each member reserves its maximum length up front.
* **Continuous batching** rebuilds the batch at every step: running requests first, then
  waiting ones in arrival order under `max_num_seqs`, the token budget and free KV blocks.
  It changes *when* tokens are computed, not *which*: outputs are identical here (fp32 on a
  CPU; on a GPU in bf16, batch-dependent kernels can change a nearly tied greedy token).
* Measured in **tokens per step**, continuous batching wins by more the more output lengths
  vary. Paged memory is a *separate* gain: the 2×2 shows each on its own, and the vLLM
  paper's 2–4× over Orca is the memory one (Orca already batches continuously).
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
  `minipaged/engine/llm_engine.py`.
* The baselines have no vLLM file: `minipaged/core/sched/static.py` (static batching),
  `minipaged/core/sched/orca.py` (Orca over contiguous reservation).
""")

write("04_continuous_batching")
