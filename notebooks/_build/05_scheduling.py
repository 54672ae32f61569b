"""Generate notebooks/05_scheduling.ipynb (run from the repo root, then execute it).

python notebooks/_build/05_scheduling.py
jupyter nbconvert --to notebook --execute --inplace notebooks/05_scheduling.ipynb
"""

from _nb import code, md, write

md(r"""
# 05 · Scheduling: token budgets, chunked prefill, memory pressure

Chapter 04 showed *that* continuous batching beats static batching. This chapter opens the
scheduler and pushes on it until it hurts.

**You will learn**

1. how one step's batch is built: running requests first, then waiting ones in arrival
   order (FCFS), under three limits: `max_num_seqs`, `max_num_batched_tokens` and free KV blocks;
2. **chunked prefill**: why a long prompt is cut into pieces and mixed with other requests' decodes;
3. what happens when the blocks run out: **preemption** by *recompute* or by *swap*, step by step;
4. the failure modes: **thrash** (counted in recomputed tokens, and its cure), **head-of-line
   blocking**, and **a request too big to ever fit**; and how a stop string frees memory mid-block.

No model is needed: the scheduler only decides *who computes how many tokens*. We drive it
with a fake model that always "samples" token 7, so every run is instant and exact.
""")

md("## Setup")

code(r"""
import inspect

import matplotlib.pyplot as plt

from minipaged import viz
from minipaged.core import PaperScheduler, Request, RequestStatus, Scheduler
from minipaged.trace import run_scheduler
from minipaged.sampling_params import SamplingParams


def make(rid, prompt_len, max_tokens):
    # A request with a deterministic prompt; no EOS, so it runs to max_tokens.
    prompt = [(7 * j + 3) % 50 for j in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens))


fake_model = lambda request: 7  # the "model": every sampled token is 7
""")

md(r"""
## 1. The concept: one step

Prefill and decode are one mechanism. A request has `num_tokens` (prompt + output so far)
and `num_computed_tokens` (those whose K/V are in the cache). Each step the scheduler gives it
`num_tokens - num_computed_tokens` more, capped by the token budget: a whole prompt,
a *chunk* of a prompt, or 1 token (a decode). When its computed count catches up with its
token count, the model's output at the last position is its next token.

`schedule()` builds the batch in two passes (as in vLLM v1):

1. **running requests first**, in arrival order: each gets its decode token or its next
   prefill chunk, and `allocate_slots` finds blocks for it. If the pool is full, the
   *last* request of `running` is preempted to make room (possibly the asking one); under
   FCFS that is always the latest arrival, the paper's victim (an experiment after
   section 5 shows it);
2. **then waiting requests, in arrival order (FCFS)**, while there is room in all three
   limits. The first one that does not fit stops admission: nobody jumps the queue.

`update_from_output` then advances `num_computed_tokens`, appends the sampled tokens and
frees the blocks of finished requests.

Most runs of this chapter drive the paper's loop, `PaperScheduler`
(`minipaged/core/sched/paper.py`, shaped like vLLM v0's), because it can also *swap*
(section 4), which vLLM v1 removed. On the workloads of sections 1–3 and 5b it makes
exactly the decisions of v1's `Scheduler` (`core/sched/scheduler.py`; section 3 checks
it); where v1's own options are the point (section 5a) the chapter runs `Scheduler`. Here
is one step by hand:
""")

code(r"""
s = PaperScheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
a = make("A", 5, 3)
s.add_request(a)
out = s.schedule()
print("scheduled:", out.num_scheduled_tokens, "| total", out.total_num_scheduled_tokens)
print("A's block table:", s.kv_cache_manager.get_block_ids("A"))
finished = s.update_from_output(out, {"A": fake_model(a)})
print(a, "| finished:", finished)
s.check_invariants()
""")

md(r"""
## 2. Token budget and chunked prefill

### Hand check

Budget `max_num_batched_tokens = 6`, blocks of 4 tokens. A (prompt 5, 3 tokens to
generate) and B (prompt 4, 2 tokens) arrive together. Predict before running:

| step | A | B | why |
|---|---|---|---|
| 0 | 5 (whole prompt) | 1 (chunk) | A takes 5 of the 6 tokens; B's prompt is *split*: 1 now |
| 1 | 1 (decode) | 3 (rest of prompt) | B finishes its prefill and samples its 1st token |
| 2 | 1 (decode) | 1 (decode) | A reaches 3 tokens, B 2: both finish |

Block tables: A's 5 prompt tokens need 2 blocks (0, 1), B's first token 1 block (2).
""")

code(r"""
s = PaperScheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
trace = run_scheduler(s, [make("A", 5, 3), make("B", 4, 2)], fake_model)
print([st.scheduled for st in trace.steps])
assert [st.scheduled for st in trace.steps] == [{"A": 5, "B": 1}, {"A": 1, "B": 3}, {"A": 1, "B": 1}]
assert trace[0].block_tables == {"A": [0, 1], "B": [2]}
print(viz.step_text(trace, 0))
""")

md(r"""
`run_scheduler(scheduler, arrivals, next_token)` is the loop of section 1 with arrivals, and
it records an `EngineTrace` with `record_step`, the same record the real engine writes, so all
of `minipaged.viz` works on it. The timeline has a row per request and a column per step
(`P` prefill, `d` decode; `-`, "running, idle", would be a request in `running` that holds
its blocks but got no tokens in that step); the `tokens` row is the work done per step:
""")

code(r"""
print(viz.timeline_text(trace))
""")

md(r"""
### Why chunk?

Four short requests are decoding when a 40-token prompt `L` arrives at step 3.

* **Chunking on, budget 16**: `L` is prefilled in chunks of at most 12 (16 minus the 4
  decodes: 12 + 12 + 12 + 4) over 4 steps, and the decodes never stop.
* **Chunking off**: the prompt must run *whole*, so the budget must be at least 40
  (we use 48). The step that prefills `L` computes 44 tokens.

Both finish in the same number of steps, but a step's time grows with its tokens: the four
decoding requests wait for the whole 44-token step to get their next token. Chunked
prefill keeps every step under the budget, so the time between two tokens stays flat.
""")

code(r"""
def workload():
    return {0: [make(f"s{i}", 4, 12) for i in range(4)], 3: [make("L", 40, 4)]}


for chunked, budget in ((True, 16), (False, 48)):
    s = PaperScheduler(num_blocks=64, block_size=4, max_num_batched_tokens=budget,
                  enable_chunked_prefill=chunked)
    t = run_scheduler(s, workload(), fake_model)
    per_step = [sum(st.scheduled.values()) for st in t.steps]
    print(f"chunked prefill {'on ' if chunked else 'off'} budget {budget}: {len(t)} steps, "
          f"tokens per step {per_step}")
    print(viz.timeline_text(t))
""")

md(r"""
## 3. Memory pressure

**Contract card · preemption** (`Scheduler._preempt` in `minipaged.core.sched.scheduler`,
recompute only, as vLLM v1; swap in the paper's loop, `PaperScheduler._preempt` in
`minipaged.core.sched.paper`;
vLLM v1 `vllm/v1/core/sched/scheduler.py`, the paper's v0 `vllm/core/scheduler.py`)

| | |
|---|---|
| **inputs** | a running request whose `allocate_slots` returned `None` (the pool is full); the `running` list; `preemption_mode` (`"recompute"`, or the paper's `"swap"` with `num_cpu_blocks`) |
| **outputs** | the victim, the last of `running` (in minipaged `running` is kept in arrival order, so this is the latest arrival), leaves `running`, `num_preemptions += 1`: recompute frees its blocks, sets `num_computed_tokens = 0` and puts it back at the *front* of `waiting` (status `PREEMPTED`); swap copies its blocks to the CPU pool (`blocks_to_swap_out`, pairs device -> cpu) and puts it into the `swapped` queue, in arrival order (status `SWAPPED`). The allocation is retried; nothing new is admitted in that step |
| **invariants** | after the step, the victim holds no device blocks; free + used blocks == `num_blocks`; the first request of `running` is never a victim unless it is alone; a recomputed request later prefills `prompt + outputs so far` and produces the same tokens (greedy) |
| **failure modes** | no exception in normal operation (a request too big for the pool is refused on arrival instead); silent ones: **thrash** (the same request preempted again and again, its work recomputed: section 5a), a swap with too few CPU blocks falls back to recompute |
| **hand-check** | below: six requests on 16 blocks; which request is preempted at which step, read off the timeline |

Six requests, prompt 8, up to 24 new tokens each: at full length one needs
8 + 24 - 1 = 31 slots, 8 blocks of 4. The pool has 16 blocks. All six prompts fit at step 0
(2 blocks each), but they grow one token per step and the pool fills up. The scheduler
then preempts the **latest arrival** (`X` on the timeline): its blocks are freed and it waits
at the front of the queue.
""")

code(r"""
def pressure():
    return [make(f"r{i}", 8, 24) for i in range(6)]


s = PaperScheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
pressure_trace = run_scheduler(s, pressure(), fake_model)
print(viz.timeline_text(pressure_trace))
print(viz.memory_text(pressure_trace, max_rows=12))
v1_trace = run_scheduler(Scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64), pressure(), fake_model)
same = [(st.scheduled, st.preempted_ids) for st in v1_trace.steps] == [
    (st.scheduled, st.preempted_ids) for st in pressure_trace.steps]
print("vLLM v1's Scheduler on the same workload: the same batches and the same victims:", same)
""")

md(r"""
Read the timeline: r5 (the last arrival) is preempted at step 1, r4 at step 5, r3 at
step 9, r2 at step 13. r0 and r1, the earliest arrivals, are never touched: **the earliest
running request is never the victim unless it runs alone**, so it makes progress every step.
That is the scheduler's no-livelock argument: every request that fits in the pool on its own
eventually finishes. After a recompute preemption the request's prompt *and* its output so far
are prefilled again (the `P` in the middle of a row).

The picture of the same run (the memory plot shows the pool filling and emptying):
""")

code(r"""
fig = viz.timeline(pressure_trace)
plt.show()
plt.close(fig)
fig = viz.memory(pressure_trace)
plt.show()
plt.close(fig)
""")

md(r"""
## 4. Recompute vs swap, step by step

The smallest case that preempts: 4 blocks of 2 slots, A and B with 3-token prompts and
4 tokens to generate each. After their first decode (step 1) they hold all 4 blocks. At
step 2 A needs a third block.

* **recompute**: B (the later arrival) loses its blocks (`num_computed_tokens = 0`) and waits.
  At step 4, after A finishes, B prefills its prompt *and* its 2 output tokens again: 5 tokens.
* **swap**: B's two blocks are copied to the CPU pool (`blocks_to_swap_out`); at step 4
  they are copied back (`blocks_to_swap_in`) and B simply decodes.

Hand check: both take 6 steps; recompute computes 5 + 1 = 6 tokens for B after the
preemption, swap only 2 (two decodes) but copies 2 blocks each way.
""")

code(r"""
def ab():
    return [make("A", 3, 4), make("B", 3, 4)]


rec = run_scheduler(PaperScheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16), ab(), fake_model)
swp = run_scheduler(
    PaperScheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16,
              preemption_mode="swap", num_cpu_blocks=4),
    ab(), fake_model,
)
print("recompute:", [st.scheduled for st in rec.steps])
print("swap:     ", [st.scheduled for st in swp.steps])
assert [st.scheduled for st in rec.steps][4] == {"B": 5}
assert [st.scheduled for st in swp.steps][4] == {"B": 1}
""")

code(r"""
for i in (1, 2, 4):
    print("--- recompute ---")
    print(viz.step_text(rec, i))
    print("--- swap ---")
    print(viz.step_text(swp, i))
    print()
""")

md(r"""
Step 2 under recompute as a picture: the victim B holds no device blocks after the step and
waits to be prefilled again (vermillion at step 2, then light grey). In the block tables,
the block A took in the same step has the black "allocated this step" frame; a block B gave
back that nobody took has a dashed edge, "freed this step".
""")

code(r"""
print("recompute: step 2, B preempted")
fig = viz.step(rec, 2)
plt.show()
plt.close(fig)
""")

md(r"""
Under swap the device side looks the same after step 2 (B holds no device blocks), but B's
data is not gone: its blocks were *copied* to the CPU pool, and at step 4 they are copied
back. The engine's worker (`PaperModelRunner`) does the copies before the model runs; the
step's `PaperSchedulerOutput` says what to copy, as `(source, destination)` block ids:
""")

code(r"""
s = PaperScheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16,
              preemption_mode="swap", num_cpu_blocks=4)
for r in ab():
    s.add_request(r)
copies = {}  # step -> (blocks_to_swap_out, blocks_to_swap_in)
for step in range(5):
    out = s.schedule()
    if out.blocks_to_swap_out or out.blocks_to_swap_in:
        copies[step] = (list(out.blocks_to_swap_out), list(out.blocks_to_swap_in))
        print(f"step {step}: swap out (device, cpu) {out.blocks_to_swap_out} | "
              f"swap in (cpu, device) {out.blocks_to_swap_in}")
    s.update_from_output(out, {r.request_id: 7 for r, n in out.scheduled
                               if r.num_computed_tokens + n == r.num_tokens})
""")

md(r"""
The two swap steps as pictures, the device pool over the CPU pool, an arrow per copied
block in its owner's colour. At step 2 B's blocks 2 and 3 go down to CPU blocks 0 and 1,
and device block 3, freed by the copy, goes straight to A (blocks are freed tail first, so
3 is handed out before 2). At step 4, after A has finished, they come back up, to device
blocks that need not be the ones they left:
""")

code(r"""
from minipaged.viz.swap import swap_blocks, swap_blocks_text

for step, (swap_out, swap_in) in copies.items():
    print(swap_blocks_text(swp, step, swap_out, swap_in, num_cpu_blocks=4))
    fig = swap_blocks(swp, step, swap_out, swap_in, num_cpu_blocks=4)
    plt.show()
    plt.close(fig)
""")

md(r"""
Which is cheaper depends on the hardware: recompute spends GPU FLOPs (prefill is fast,
many tokens per step), swap spends PCIe bandwidth (proportional to the blocks). The paper
(section 7.3, Fig. 19) finds recompute better for small blocks, swap for large ones. On the
memory-pressure workload of section 3:
""")

code(r"""
def costs(trace):
    computed = sum(sum(st.scheduled.values()) for st in trace.steps)
    useful = sum(r["prompt_len"] + r["output_len"] - 1 for r in trace.requests.values())
    moved = sum(len(st.swapped_out_ids) + len(st.swapped_in_ids) for st in trace.steps)
    return computed, computed - useful, moved


print(f"{'mode':>9}  steps  tokens computed  recomputed  preemptions  swap-outs")
for mode in ("recompute", "swap"):
    s = PaperScheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64,
                  preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0)
    t = run_scheduler(s, pressure(), fake_model)
    computed, wasted, _ = costs(t)
    print(f"{mode:>9}  {len(t):5d}  {computed:15d}  {wasted:10d}  "
          f"{sum(len(st.preempted_ids) for st in t.steps):11d}  "
          f"{sum(len(st.swapped_out_ids) for st in t.steps):9d}")
""")

md(r"""
## 5. Failure modes

### 5a. Thrash

Admit too much for the memory and the scheduler spends its time preempting and redoing
work. vLLM v1 names its admission rule by one setting, `scheduler_reserve_full_isl`
("reserve the full input sequence length"):

* **`scheduler_reserve_full_isl=False`, first-chunk admission**: a waiting request is
  admitted as soon as the blocks for the chunk it computes *this step* are free. With
  chunked prefill and long prompts, that starts prefills the pool cannot finish: the running
  decodes grow, the pool fills, and the victim is the last of `running`, often the
  half-prefilled newcomer, whose chunks are thrown away. Next step it is admitted again (its
  first chunk fits), and the cycle repeats: over-admission, and KV-cache thrash.
* **`scheduler_reserve_full_isl=True`, vLLM's default**: a request is admitted only when
  the free blocks hold its whole sequence (prompt and any output so far), although only its
  first chunk is computed this step. vLLM made it the default for exactly the thrash this
  section measures.
* **a `watermark`** on top (a fraction of the pool kept free at admission; vLLM's
  `watermark` option, off by default in v1; the paper's v0 block manager kept 1 %, the
  course's paper scheduler 5 %, because the course runs small pools).

In minipaged these are options of vLLM v1's loop under vLLM's names:
`Scheduler(scheduler_reserve_full_isl=False)`, `Scheduler()` and `Scheduler(watermark=0.05)`.
The workload: eight requests with 40-token prompts and 16 output
tokens, a token budget of 32 per step (so a prompt takes two chunks), blocks of 4. One
request at full length needs 14 blocks. Count the **recomputed tokens** (computed tokens
minus the ones a run without preemption computes) and the preemptions under each rule:
""")

code(r"""
def long_prompts():
    return [make(f"r{i}", 40, 16) for i in range(8)]


# admission rule -> the scheduler's keyword arguments
RULES = {
    "reserve_full_isl=False": {"scheduler_reserve_full_isl": False},  # first chunk
    "reserve_full_isl=True": {},  # whole sequence: vLLM's default
    "True + watermark 5%": {"watermark": 0.05},
}


def thrash_run(num_blocks, rule):
    s = Scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32, **RULES[rule])
    t = run_scheduler(s, long_prompts(), fake_model)
    computed, wasted, _ = costs(t)
    preemptions = sum(len(st.preempted_ids) for st in t.steps)
    worst = max(r["num_preemptions"] for r in t.requests.values())
    return len(t), wasted, preemptions, worst


print(f"{'':>6}  " + "  ".join(f"{rule:^32}" for rule in RULES))
print(f"{'blocks':>6}  " + "  ".join([f"{'steps':>6}{'recomp.':>9}{'preempt':>9}{'worst':>8}"] * 3))
thrash = {}
for num_blocks in (48, 32, 24, 20, 16):
    thrash[num_blocks] = {rule: thrash_run(num_blocks, rule) for rule in RULES}
    cols = "  ".join(f"{st:6d}{rc:9d}{pe:9d}{wo:8d}" for st, rc, pe, wo in thrash[num_blocks].values())
    print(f"{num_blocks:6d}  {cols}")
# the thrash, and its cure, on 20 blocks: hundreds of recomputed tokens, then none
assert thrash[20]["reserve_full_isl=False"][1] > 500 and thrash[20]["reserve_full_isl=False"][2] > 20
assert thrash[20]["reserve_full_isl=True"][1] < thrash[20]["reserve_full_isl=False"][1]
assert thrash[20]["True + watermark 5%"][1] == 0 and thrash[20]["True + watermark 5%"][2] == 0
""")

md(r"""
Read the 20-block row: with first-chunk admission the engine recomputes more tokens than
the eight prompts hold, and one request is preempted again and again (`worst`); reserving
the whole sequence, vLLM's default, cuts that down, and with the watermark on top the same
requests finish in as many steps with **no** recomputed token. That is the cure: admit a
prefill only when it can complete. With larger pools (24 blocks and up) the rules still
leave preemptions, fewer of them: those come from *decodes* outgrowing the pool once all
eight requests run, and no admission rule prevents them.

The cure has limits. On the memory-pressure workload of section 3 (short prompts, long
outputs) every prompt fits when it is admitted, and all preemptions come later, from
*decodes* outgrowing the pool: there the two rules give the same numbers, since no rule
that looks at prompts can foresee how long outputs will be (the whole problem of chapter
01). What helps there is admitting fewer sequences: `max_num_seqs` caps the batch. With 8
blocks and v1's loop with first-chunk admission (`scheduler_reserve_full_isl=False`, so
that admission does not hide the effect), fewer sequences at once means fewer preemptions
and less recomputed work, at the price of less batching (one at a time takes the most steps).
""")

code(r"""
print(f"{'max_num_seqs':>12}  steps  recomputed  preemptions")
for max_num_seqs in (6, 3, 2, 1):
    s = Scheduler(num_blocks=8, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                  scheduler_reserve_full_isl=False)
    t = run_scheduler(s, pressure(), fake_model)
    computed, wasted, _ = costs(t)
    print(f"{max_num_seqs:12d}  {len(t):5d}  {wasted:10d}  {sum(len(st.preempted_ids) for st in t.steps):11d}")
""")

md(r"""
### 5b. Head-of-line blocking

FCFS is fair but rigid. A (prompt 32, 24 new tokens) is running. At step 1 a big request
`BIG` (prompt 32) arrives, followed by four small ones. `BIG`'s prompt needs 8 blocks but only
7 are free, so it waits, and **the small requests wait behind it although each would fit**.
The same arrivals with `BIG` last:
""")

code(r"""
for big_first in (True, False):
    smalls = [make(f"s{i}", 4, 4) for i in range(4)]
    big = make("BIG", 32, 8)
    arrivals = {0: [make("A", 32, 24)], 1: [big] + smalls if big_first else smalls + [big]}
    t = run_scheduler(PaperScheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64),
                      arrivals, fake_model)
    done = {rid: r["finish_step"] for rid, r in t.requests.items()}
    print(("BIG first" if big_first else "BIG last "), "finish steps:", done)
    print(viz.timeline_text(t))
""")

md(r"""
The small requests finish at steps 27-30 instead of 4-7, and `BIG` finishes at step 31
either way. Schedulers that let small requests overtake (shortest-job-first, or vLLM's
priority scheduling) trade this latency for fairness and the risk of starving `BIG`.

### 5c. A request too big to ever fit

A request whose K/V can never fit in the whole pool (prompt + max_tokens - 1 tokens), or
whose prompt exceeds the token budget when chunking is off, is **refused**: it finishes at
once with `FINISHED_IGNORED` and a reason, and the others run as if it had never come.
Without this rule it would be admitted, grow, preempt everyone, and finally preempt itself,
forever. A prompt longer than `max_model_len` is a caller error: `add_request` raises
`ValueError` and nothing changes.
""")

code(r"""
s = PaperScheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32, max_model_len=128)
huge = make("huge", 60, 20)  # 79 tokens of K/V > 64 slots
reqs = [make("ok1", 8, 4), huge, make("ok2", 8, 4)]
t = run_scheduler(s, reqs, fake_model)
for r in reqs:  # NOTE: the scheduler forgot them when they finished; the caller keeps them
    rid = r.request_id
    print(f"{rid:5} {r.status.name:17} out={r.num_output_tokens}  {r.stop_reason}")
print([st.scheduled for st in t.steps])

try:
    s.add_request(make("too-long", 200, 1))
except ValueError as e:
    print("ValueError:", e)

s_off = PaperScheduler(num_blocks=64, block_size=4, max_num_batched_tokens=32, enable_chunked_prefill=False)
long_prompt = make("L", 40, 4)
run_scheduler(s_off, [long_prompt], fake_model)
print(long_prompt.stop_reason)
""")

md(r"""
### 5d. A stop string frees a request's blocks before the next step

The other side of memory pressure: memory comes back as soon as a request ends, even in
the middle of a block. On the course model, `SamplingParams(stop=["."])` ends a request at
its first full stop. The scheduler does not see text: its own stop check (`check_stop`,
inside `update_from_output`) knows only token ids (EOS, `stop_token_ids`, `max_tokens`,
`max_model_len`). Stop *strings* are found by the engine's `OutputProcessor`, in the token
ids the engine core's step returned: it feeds each new token to the request's
detokenizer, and when the text now ends in a stop string `LLMEngine.step` tells the core
(`EngineCore.stop_requests`), which calls
`scheduler.finish_requests([request_id], FINISHED_STOPPED)` before the step returns. That frees
the request's blocks, the last one only partly filled, so they are back in the free queue
**before the next `schedule()`**, which can hand them to someone else.

vLLM v1 does the same across a process boundary: its output processor runs in the
front-end process, finds the stop string in the outputs of an engine-core step, and sends
an abort to the engine core, which frees the blocks when it handles the abort, before its
next `schedule()` after the message arrives. The core runs ahead asynchronously, so the
request may have been scheduled for one more step meanwhile; that token is dropped.
""")

code(r"""
from minipaged import LLM

llm = LLM(block_size=8, num_blocks=32, max_num_seqs=4)
outs = llm.generate(
    ["Once upon a time", "The little dog"],
    [SamplingParams(temperature=0.0, max_tokens=60, stop=["."]),
     SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)],
    use_tqdm=False,
)
for o in outs:
    print(f"{o.outputs[0].finish_reason:7s} {len(o.outputs[0].token_ids):3d} tokens  {o.outputs[0].text[:60]!r}")
stop_trace = llm.trace
rid = next(iter(stop_trace.requests))
info = stop_trace.requests[rid]
fin = info["finish_step"]
before, after = stop_trace.steps[fin - 1], stop_trace.steps[fin]
print(f"request {rid}: {info['stop_reason']}, finished at step {fin}")
print(f"  after step {fin - 1}: holds blocks {before.block_tables[rid]} for {before.num_tokens[rid]} tokens "
      f"(block_size 8: the last block is partly filled); {before.num_free_blocks} blocks free")
print(f"  after step {fin}: holds {after.block_tables.get(rid, 'no blocks')}; {after.num_free_blocks} blocks free; "
      f"new blocks this step {after.new_block_ids}")
assert rid not in after.block_tables and rid in after.finished_ids
assert after.num_free_blocks == before.num_free_blocks + len(before.block_tables[rid]) - len(after.new_block_ids)
""")

md(r"""
> **The paper (vLLM v0) and vLLM v1 today, on preemption.**
>
> | | the paper (vLLM v0) | vLLM v1 (`vllm/v1/core/sched/scheduler.py`) |
> |---|---|---|
> | how | recompute *or* swap to CPU memory (§4.5); recompute for single sequences, swap for groups (beam search, n > 1) | recompute only: swap was removed (`_preempt_request` frees the blocks and resets `num_computed_tokens`) |
> | victim | the latest-arrived sequence group (lowest FCFS priority) | `self.running.pop()`: the last of `running` (with `policy="priority"`: the lowest priority, ties to the latest arrival) |
> | admission | whole prompt plus a watermark (`can_allocate`, 1 % by default) | `scheduler_reserve_full_isl=True` (the default): the whole sequence's blocks must be free; `False`: the first chunk's |
>
> Section 5a measured the admission rules; swap is the paper's loop, toured below.

**Under FCFS the two victims are the same request.** v1 keeps `running` in the order it
admitted requests, and a preempted request goes back to the *front* of `waiting`. Waiting
requests are admitted in queue order and nothing overtakes, so a resumed request comes
back before every request that arrived after it, and `running` stays in arrival order: its
last is its latest arrival. The experiment: 200 random workloads (arrival times, prompt and
output lengths, pool and budget sizes drawn from a seed, first-chunk admission so that
preemption is common), stepping the v1 scheduler and asking at every preemption whether
the paper's rule would have picked another request.
""")

code(r"""
import random


def random_workload(seed):
    rng = random.Random(seed)
    arrivals = {}
    for i in range(rng.randint(3, 10)):
        arrivals.setdefault(rng.randint(0, 12), []).append(make(f"r{i}", rng.randint(1, 40), rng.randint(1, 30)))
    longest = max(r.num_prompt_tokens + r.max_tokens for rs in arrivals.values() for r in rs)
    knobs = dict(block_size=4, num_blocks=-(-longest // 4) + rng.randint(0, 8),
                 max_num_batched_tokens=rng.choice([16, 32, 64]), scheduler_reserve_full_isl=False)
    return arrivals, knobs


def victims_under_both_rules(seed):
    # (preemptions, how many of them the paper's rule would have chosen differently)
    arrivals, knobs = random_workload(seed)
    s = Scheduler(**knobs)  # vLLM v1's loop: running.pop() is the victim
    arrival_rank, preemptions, differ, step = {}, 0, 0, 0
    while step <= max(arrivals) or s.has_unfinished_requests():
        for r in arrivals.get(step, []):
            arrival_rank[r.request_id] = len(arrival_rank)
            s.add_request(r)
        candidates = [r.request_id for r in s.running]  # running, in v1's order
        out = s.schedule()
        for victim in out.preempted:
            paper = max(candidates, key=arrival_rank.get)  # the paper: the latest arrival
            v1 = candidates[-1]  # vLLM v1: the last of running
            assert victim.request_id == v1
            preemptions += 1
            differ += paper != v1
            candidates.remove(victim.request_id)
        s.update_from_output(out, {r.request_id: 7 for r, n in out.scheduled
                                   if r.num_computed_tokens + n == r.num_tokens})
        step += 1
    return preemptions, differ


results = [victims_under_both_rules(seed) for seed in range(200)]
print(f"{len(results)} random workloads, {sum(1 for p, _ in results if p)} of them preempt, "
      f"{sum(p for p, _ in results)} preemptions in all")
print(f"preemptions where the paper's victim differs from v1's: {sum(d for _, d in results)}")
print(f"workloads whose traces would differ: {sum(1 for _, d in results if d)}")
assert sum(p for p, _ in results) > 100 and sum(d for _, d in results) == 0
""")

md(r"""
Zero: under FCFS "the last of `running`" *is* "the latest arrival", at every preemption, so
the two rules give the same trace. They differ under **priority scheduling** (vLLM's
`policy="priority"`): `running` is then ordered by priority, and v1 preempts
`max(running, key=lambda r: (r.priority, r.arrival_time))`, the least important request,
which need not be the latest arrival. Three running requests where the latest arrival is
the most important (lower value = more important):
""")

code(r"""
running = [("a", 0, 1), ("b", 1, 1), ("c", 2, 0)]  # (request, arrival, priority)
paper = max(running, key=lambda r: r[1])[0]
v1_priority = max(running, key=lambda r: (r[2], r[1]))[0]
print(f"paper's rule (latest arrival): {paper}; vLLM v1 with policy='priority': {v1_priority}")
""")

md(r"""
## 6. Code tour

Chapter 04 outlined vLLM v1's `Scheduler.schedule` (recompute preemption included);
exercises ex5.3 and ex5.4 ask you to write its preemption and its running phase, so the
chapters do not print them. The paper's scheduler (`PaperScheduler`,
`minipaged/core/sched/paper.py`) is its own loop, shaped like vLLM v0's, beside v1's.
Swap (removed in vLLM v1) is how it preempts when the CPU pool has room: here is the swap
half of its `_preempt` (the recompute half, after it, is ex5.3's answer), and how swapped
requests come back, in arrival order, merged with `waiting`:
""")

code(r"""
src = inspect.getsource(PaperScheduler._preempt)
swap_half = src[: src.index("# NOTE: the CPU pool is full")].rstrip()  # the recompute half follows: ex5.3
print(swap_half + "\n        # ... else (no room in the CPU pool): recompute, which is exercise ex5.3")
print()
print(inspect.getsource(PaperScheduler._swap_in_next))
""")

md(r"""
Watermark admission (`minipaged/core/sched/paper.py`, vLLM v0's rule: the whole prompt
plus `watermark` of the pool spare; vLLM v1's default, `scheduler_reserve_full_isl=True`,
reserves the whole sequence without a watermark) asks the block manager, which alone counts
blocks, whether the whole prefill fits beside what the running requests still need:
""")

code(r"""
print(inspect.getsource(PaperScheduler._can_admit))
""")

md(r"""
Every step can be checked: `check_invariants()` asserts the budgets, that each request is in
exactly one of waiting / running / swapped / finished with a matching status, that exactly
the running requests hold device blocks (and the swapped ones CPU blocks) for exactly their
computed tokens, and FCFS: every running request arrived before every waiting one.
""")

code(r"""
s = PaperScheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16,
              preemption_mode="swap", num_cpu_blocks=8)
reqs = pressure()
for r in reqs:
    s.add_request(r)
steps = 0
while s.has_unfinished_requests():
    out = s.schedule()
    s.check_invariants()
    s.update_from_output(out, {r.request_id: 7 for r, n in out.scheduled
                               if r.num_computed_tokens + n == r.num_tokens})
    s.check_invariants()
    steps += 1
print(steps, "steps, invariants held after each;",
      "free blocks at the end:", s.kv_cache_manager.get_num_free_blocks(), "of 12")
""")

md(r"""
## 7. Experiment

Change the knobs and rerun: a smaller `num_blocks` (thrash), a smaller
`max_num_batched_tokens` (more chunks), `enable_chunked_prefill=False`,
`preemption_mode="swap"` with a small `num_cpu_blocks` (swap falls back to recompute when the
CPU pool is full).
""")

code(r"""
num_blocks, budget, chunked, mode, cpu_blocks = 12, 16, True, "swap", 6
# the paper's admission rule: None = the first chunk fits (as v1's scheduler_reserve_full_isl=False);
# 0.0 = the whole (re)prefill fits, no spare; 0.05 = PaperScheduler's default, 5% spare
watermark = None

s = PaperScheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
              enable_chunked_prefill=chunked, preemption_mode=mode, watermark=watermark,
              num_cpu_blocks=cpu_blocks if mode == "swap" else 0)
t = run_scheduler(s, {0: pressure()[:3], 4: pressure()[3:]}, fake_model)
computed, wasted, moved = costs(t)
print(f"{len(t)} steps, {computed} tokens computed ({wasted} recomputed), "
      f"{sum(len(st.preempted_ids) for st in t.steps)} recompute preemptions, "
      f"{sum(len(st.swapped_out_ids) for st in t.steps)} swap-outs")
print(viz.timeline_text(t))
""")

md(r"""
With these settings (first-chunk admission), look at r1: `XPXPXP`. Each time it is readmitted it gets a first
chunk of its re-prefill (15 of its 25 tokens: the budget minus r0's decode). At the next step
its second chunk needs 3 more blocks while 1 is free, and r1 is the latest arrival running,
so it preempts *itself* and loses the chunk. Admitting chunk by
chunk (vLLM's `scheduler_reserve_full_isl=False`) lets a request start before all its
blocks are free, which can thrash like this; vLLM's default (`True`) admits a request only
when its whole sequence fits, vLLM v0 admitted a prompt only when all of its blocks fit
plus a watermark of spare blocks, and so does minipaged's `PaperScheduler` by default (set
`watermark = 0.0`, then `0.05`, above and rerun: r1 is preempted once instead of four times). Progress is still guaranteed: r0, the earliest arrival, decodes at
every step and finishes, and then r1 fits.

## Recap

* A step's batch = running requests first (decode or next chunk), then FCFS admissions,
  under `max_num_seqs`, `max_num_batched_tokens` and free blocks. Prefill and decode are
  one mechanism: `num_computed_tokens` catches up with `num_tokens`.
* **Chunked prefill** splits long prompts so every step stays under the token budget and
  decodes keep flowing.
* When blocks run out the last of `running` is preempted, which under FCFS is always the
  **latest arrival** (200 random workloads, zero differences): **recompute** frees its blocks
  and prefills prompt + output again; **swap** copies its blocks to a CPU pool and back.
  Same steps, different cost: FLOPs vs PCIe bytes.
* Failure modes: **thrash** (over-admission with first-chunk admission, cured by reserving
  the whole sequence, vLLM's default `scheduler_reserve_full_isl=True`), **head-of-line
  blocking** (FCFS makes small requests wait behind a big one), and the request that can
  **never fit** (refused up front, so nobody livelocks).
* A request stopped by a **stop string** (found by the output processor after
  `update_from_output`, then `finish_requests`) has its blocks back before the next
  `schedule()`; in vLLM v1 the front end finds it and aborts, and the core frees them when
  it handles the abort.

Next: chapter 06 shares blocks between sequences (parallel sampling, beam search, prefixes)
with copy-on-write.
""")

md(r"""
## Readings

* **The paper** (Kwon et al., SOSP 2023): §4.5 Scheduling and Preemption (all-or-nothing
  eviction, swapping, recomputation); §7.3 Comparing Recomputation and Swapping (Fig. 19).
* **Sarathi-Serve** (Agrawal et al., OSDI 2024): chunked prefill and stall-free batching
  under a token budget; vLLM v1 enables chunked prefill by default (`enable_chunked_prefill`,
  which it still lets you turn off).
* The paper's v0.2: `vllm/core/scheduler.py` (`_preempt`, `_preempt_by_recompute`,
  `_preempt_by_swap`) ↔ `minipaged/core/sched/paper.py` (`_preempt`, `_swap_in_next`), over
  `vllm/core/block_manager.py` (`swap_out`, `swap_in`) ↔ `minipaged/core/kv/block_manager_v0.py`;
  the block copies of a swap: `vllm/worker/cache_engine.py` (`swap_in`, `swap_out`) ↔
  `minipaged/kernels/cache_ops.py` (`swap_blocks`).
* vLLM v1: `vllm/v1/core/sched/scheduler.py` (`schedule`: the token budget
  `max_num_batched_tokens`, `_preempt_request`) ↔ `minipaged/core/sched/scheduler.py`.
* Stop strings: `vllm/v1/engine/output_processor.py` (finds them, asks for the abort) and
  `vllm/v1/engine/detokenizer.py` ↔ `minipaged/engine/output_processor.py`,
  `minipaged/engine/llm_engine.py` (`step`: `process_outputs`, then `EngineCore.stop_requests`,
  which calls `Scheduler.finish_requests`).
* The waiting queue (FCFS or priority): `vllm/v1/core/sched/request_queue.py`.
""")

write("05_scheduling")
