"""Generate notebooks/08_vllm_today.ipynb (run from the repo root, then execute it).

python notebooks/_build/08_vllm_today.py
jupyter nbconvert --to notebook --execute --inplace notebooks/08_vllm_today.ipynb
"""

from _nb import code, md, write

md(r"""
# 08 · The paper and vLLM today

The vLLM paper (Kwon et al., SOSP 2023) describes what is now called **vLLM v0**. vLLM
**v1** (the engine rewritten in 2024–2025, `vllm/v1/`) keeps its two ideas, paged KV memory
and continuous batching, and changes most of the policies around them. minipaged's base
`Scheduler` is v1's loop (`core/sched/scheduler.py`); the paper's scheduler is its own loop
beside it (`core/sched/paper.py`, `PaperScheduler`, with its block manager
`core/kv/block_manager_v0.py`). This chapter runs each pair side by side on the same
workload.

**You will learn**

1. what v1 changed and why, each shown by a run: admission, preemption (victim, swap vs
   recompute), chunked prefill with one token budget, parallel sampling (copy-on-write
   fork vs child requests sharing the prompt through prefix caching), prefix caching;
2. what came after the paper, in words with numbers: speculative decoding's lookahead
   slots, prefill/decode disaggregation, sliding-window layers;
3. where to read each one in the paper and in vLLM's source.

As in chapter 05, a fake model "samples" the tokens, so every run is instant and exact.
""")

md("## Setup")

code(r"""
import math

import matplotlib.pyplot as plt

from minipaged import SamplingParams, viz
from minipaged.core import PaperScheduler, Request, Scheduler
from minipaged.trace import run_scheduler
from minipaged.viz.loops import diff_outlines_text


def make(rid, prompt_len, max_tokens, prompt=None):
    prompt = prompt if prompt is not None else [(7 * j + 3) % 50 for j in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


fake_model = lambda request: 7  # the "model": every sampled token is 7


def stats(trace):
    # tokens computed, of which recomputed, preemptions, peak blocks in use
    computed = sum(sum(st.scheduled.values()) for st in trace.steps)
    useful = sum(r["prompt_len"] + r["output_len"] - 1 for r in trace.requests.values())
    preemptions = sum(len(st.preempted_ids) for st in trace.steps)
    peak = trace.num_blocks - min(st.num_free_blocks for st in trace.steps)
    return computed, computed - useful, preemptions, peak


def side_by_side(traces):
    # each pair's timelines on one step axis
    fig = viz.timelines(traces)
    plt.show()
    plt.close(fig)
""")

md(r"""
## 0. The two schedulers

Every pair below runs the same requests through two loops. Their contracts:

**Contract card · the paper's scheduler (vLLM v0)** (`minipaged.core.PaperScheduler`:
`core/sched/paper.py` over `core/kv/block_manager_v0.py`; vLLM v0
`vllm/core/scheduler.py`, `vllm/core/block_manager.py`)

| | |
|---|---|
| **inputs** | sequence groups (a request, or its `n` samples / beams) arriving over time; `max_num_seqs`, `max_num_batched_tokens`, a device pool and a CPU pool of blocks, `watermark`, `preemption_mode` (`"recompute"` or `"swap"`) |
| **outputs** | per step a `PaperSchedulerOutput` (a `SchedulerOutput` plus): the groups that run and their tokens, the blocks to swap out / in / copy (copy-on-write), the preempted and finished requests |
| **invariants** | each group is in exactly one of waiting / running / swapped / finished; a waiting group is admitted only when its whole (re)prefill fits beside the blocks the running groups still need for theirs, with `watermark` of the pool spare (`watermark=None`: its first chunk fits); the victim is the latest-arrived running group, preempted all or nothing (its blocks to the CPU pool, or freed for recompute); of the heads of `swapped` and `waiting` the earlier arrival comes back first (FCFS), and nothing is brought back in a step that preempted; a block's `ref_cnt` equals the tables holding it |
| **failure modes** | a request that can never fit is refused (`FINISHED_IGNORED`), the others run; a full CPU pool falls back to recompute; the silent one: a watermark too small for the pool, and swap traffic that costs more than recompute would |
| **hand-check** | the cell below: A and B, 3-token prompts, 4 blocks of 2; B is swapped out at step 2 and back in at step 4, so it decodes 1 token there |

**Contract card · vLLM v1's scheduler** (`minipaged.core.Scheduler`, options of vLLM's
names; vLLM `vllm/v1/core/sched/scheduler.py`)

| | |
|---|---|
| **inputs** | requests arriving over time (`n > 1` is `n` child requests); `max_num_seqs`, one token budget `max_num_batched_tokens`, one pool of blocks; vLLM's options `scheduler_reserve_full_isl` (default `True`), `watermark` (default 0), `enable_chunked_prefill` (default on), `enable_prefix_caching` |
| **outputs** | per step a `SchedulerOutput`: `num_scheduled_tokens` per request (a decode, or a prefill chunk), the new block ids, the preempted and finished request ids; no swap lists |
| **invariants** | running first, then waiting in FCFS order; tokens scheduled <= `max_num_batched_tokens`, running <= `max_num_seqs`; when `allocate_slots` returns `None` the last of `running` is preempted (recompute: its blocks freed, `num_computed_tokens = 0`) and the allocation retried; no admission in a step that preempted; a finished request is forgotten |
| **failure modes** | a request that can never fit is refused; the silent one: with `scheduler_reserve_full_isl=False` and a tight pool, over-admission and thrash (section 1) |
| **hand-check** | the same cell: B is preempted at step 2 and recomputed at step 4, prompt and its 2 output tokens, 5 tokens |
""")

code(r"""
def ab():
    return [make("A", 3, 4), make("B", 3, 4)]


paper = run_scheduler(PaperScheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16,
                                      preemption_mode="swap", num_cpu_blocks=4), ab(), fake_model)
v1 = run_scheduler(Scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16), ab(), fake_model)
print("paper (swap):", [st.scheduled for st in paper.steps])
print("v1 (recompute):", [st.scheduled for st in v1.steps])
assert paper.steps[2].swapped_out_ids == ["B"] and paper.steps[4].scheduled == {"B": 1}
assert v1.steps[2].preempted_ids == ["B"] and v1.steps[4].scheduled == {"B": 5}
""")

md(r"""
## 0b. The two loops, diffed

Both `schedule()` loops have the same two phases, running first, then admission, and
share their helpers (`core/sched/utils.py`: the token count, the stop check, the queue
invariants). Diffing them shows what vLLM v1 removed. Exercises ex4.1 and ex5.4 ask for
the phases of v1's loop, so the course prints their shape, not their lines: the phases and
the calls each makes, read off both sources (`minipaged.viz.loops`), then what each step
does in each. Read the two files side by side for the lines
(`minipaged/core/sched/scheduler.py`, `minipaged/core/sched/paper.py`).
""")

code(r"""
# a code tour: viz.loops reads inspect.getsource(fn); nbval does not compare it
print(diff_outlines_text(Scheduler.schedule, PaperScheduler.schedule, ("v1", "paper")))
""")

md(r"""
| step | v1 `Scheduler.schedule` | the paper's `PaperScheduler.schedule` | what v1 removed, and why |
|---|---|---|---|
| unit | a request (`n > 1` fans out into child requests) | a sequence group, scheduled all or nothing (`_units`, `_plan`, `_allocate`) | groups: children are ordinary requests, sharing prompts through the prefix cache (section 4) |
| 1. running | each request gets its tokens; `allocate_slots` is `None` -> `running.pop()` is preempted, retry | each group gets its tokens, all or nothing; no room -> the last group (`units.pop()`) is preempted, retry | nothing: the same loop, and the same victim under FCFS (section 2) |
| preemption | recompute only (`_preempt`: free, `num_computed_tokens = 0`, front of `waiting`) | swap to the CPU pool (`blocks_to_swap_out`) or recompute | swap: no CPU pool, no `swapped` queue, one state less; recompute is cheap on a GPU (section 2) |
| 2. admission | the head of `waiting`, prefix cache looked up; `allocate_slots(..., full_sequence_must_fit=scheduler_reserve_full_isl, watermark)` | the earlier of the heads of `swapped` (`_swap_in_next`) and `waiting` (`_admit_next`: watermark rule `_can_admit`) | the swapped queue; the admission rule became an option of `allocate_slots` (section 1) |
| end of step | `finish_step`: the output checked, nothing else | also `take_pending_copies`: the copy-on-write copies for the worker | copy-on-write: with no fork there is no shared block to write into (section 4) |
| worker | `scheduled_new_reqs` once, then only new block ids | a request's whole table again whenever copy-on-write changed it | tables the worker can keep: it appends, never rewrites |

What the diff leaves unchanged is the point of chapter 04: one token budget, running
before waiting, FCFS, preemption of the last when the pool is full. The paper's extra
machinery (groups, swap, copy-on-write, the watermark) is what v1 either dropped (swap) or
moved into the KV cache (sharing through the prefix cache; the admission rule as options of
`allocate_slots`), which is why `Scheduler` alone equals vLLM 0.32's (`benchmarks/vllm_diff`).
""")

md(r"""
## 1. Admission: whole prompt + watermark (v0) vs `scheduler_reserve_full_isl` (v1)

The paper's scheduler admits a waiting request only when the blocks for its whole prompt
fit and a watermark of the pool stays free (v0 `BlockSpaceManager.can_allocate`, 1 % by
default). v1 names its rule by one setting. With `scheduler_reserve_full_isl=True`, vLLM's
default, a request is admitted only when the blocks for its whole sequence are free,
although only its first chunk runs this step (`allocate_slots(...,
full_sequence_must_fit=True)`). With `False` it is admitted as soon as the blocks for the
chunk it computes *this step* are free. The second rule starts work sooner; with long
prompts and a tight pool it starts prefills the pool cannot finish, and the preemptions
that follow throw the chunks away (chapter 05, section 5a): that over-admission is why the
first is the default. Eight 40-token prompts, 16 output tokens each, a budget of 32 tokens
per step, 20 blocks of 4:
""")

code(r"""
def long_prompts():
    return [make(f"r{i}", 40, 16) for i in range(8)]


print(f"{'admission':42s}{'steps':>6s}{'computed':>10s}{'recomputed':>12s}{'preemptions':>13s}")
KNOBS = dict(num_blocks=20, block_size=4, max_num_batched_tokens=32)
admission = {}
for label, make_scheduler in (
    ("v0: whole prompt, watermark 5%", lambda: PaperScheduler(watermark=0.05, **KNOBS)),
    ("v1: reserve_full_isl=True (the default)", lambda: Scheduler(**KNOBS)),
    ("v1: reserve_full_isl=False (first chunk)", lambda: Scheduler(scheduler_reserve_full_isl=False, **KNOBS)),
):
    t = admission[label] = run_scheduler(make_scheduler(), long_prompts(), fake_model)
    computed, recomputed, preemptions, _ = stats(t)
    print(f"{label:42s}{len(t):6d}{computed:10d}{recomputed:12d}{preemptions:13d}")
side_by_side(admission)
""")

md(r"""
First-chunk admission recomputes more than twice the tokens it needs; reserving the whole
sequence recomputes fewer, and the watermark on top none. First-chunk admission pays only
when the pool is tight for the prompts in flight, and with prefix caching on a re-admitted
request finds its full prompt blocks still cached unless they were evicted in between; but
a serving engine cannot know when its pool is tight, so vLLM reserves by default.
The course's paper scheduler keeps a 5 % watermark because the course runs small pools.

## 2. Preemption: swap or recompute, and who is the victim

The paper offers two ways to take blocks back (§4.5): **swap** the victim's blocks to CPU
memory and back, or **recompute** them later from the tokens. vLLM v1 removed swap: a
preempted request frees its blocks and resets `num_computed_tokens` to 0
(`Scheduler._preempt_request` in `vllm/v1/core/sched/scheduler.py`). Six requests with
8-token prompts and 24 output tokens on 16 blocks of 4:
""")

code(r"""
print(f"{'mode':10s}{'steps':>6s}{'computed':>10s}{'recomputed':>12s}{'recompute preemptions':>23s}{'swap-outs':>11s}")
preemption = {}
for mode in ("swap", "recompute"):
    s = (PaperScheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64, preemption_mode="swap",
                        num_cpu_blocks=64) if mode == "swap"  # the paper's loop, swapping
         else Scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64))  # v1: recompute only
    t = preemption[f"v0: {mode}" if mode == "swap" else f"v1: {mode}"] = run_scheduler(
        s, [make(f"r{i}", 8, 24) for i in range(6)], fake_model)
    computed, recomputed, preemptions, _ = stats(t)
    swap_outs = sum(len(st.swapped_out_ids) for st in t.steps)
    print(f"{mode:10s}{len(t):6d}{computed:10d}{recomputed:12d}{preemptions:23d}{swap_outs:11d}")
side_by_side(preemption)
""")

md(r"""
Swap computes nothing twice but moves each swapped-out request's blocks over PCIe, out and
back in; recompute moves nothing but redoes prefill work, which on a GPU
is fast (many tokens per forward pass). v1 chose recompute for simplicity: no CPU block
pool, no swap queue, one less state per request.

**The victim.** v0 preempts the *latest-arrived* running sequence group (lowest FCFS
priority). v1 preempts `self.running.pop()`, the last of `running`. Under FCFS these are
the same request: a preempted request goes back to the front of `waiting`, nothing
overtakes it, so `running` stays in arrival order (chapter 05 checks it on 200 random
workloads: zero preemptions where the two rules differ). They differ under priority
scheduling (`policy="priority"`), where v1 preempts the least important running request,
`max(running, key=(priority, arrival_time))`. In v1's run above the victims were, each the
latest arrival still running:
""")

code(r"""
t = preemption["v1: recompute"]  # v1's Scheduler: the victim is running.pop()
for st in t.steps:
    if st.preempted_ids:
        running = [r for r in st.scheduled]
        print(f"step {st.step:2d}: preempted {st.preempted_ids}, still running {running}")
""")

md(r"""
## 3. Chunked prefill and the unified token budget

The paper's scheduler ran a step of prompts *or* a step of decodes; a long prompt ran
whole. vLLM v1 has no such distinction: a request is just "`num_computed_tokens` so far,
`num_tokens` in total", and every step gives each scheduled request
`min(num_tokens - num_computed_tokens, budget left)` tokens from **one** budget,
`max_num_batched_tokens`. A long prompt is thereby split into chunks that ride along with
the running decodes. Chunked prefill is on by default (`enable_chunked_prefill=True`); v1
still has the switch, and with it off a prompt must fit the budget whole. (minipaged's
`PaperScheduler` does not model the paper's prompt-only steps: it shares one budget too,
as vLLM v0 did once chunked prefill was added to it.) Both runs are v1's `Scheduler`, with
the switch on and off. Four decoding requests; a 100-token prompt arrives at step 5:
""")

code(r"""
def decodes_and_a_long_prompt():
    return {0: [make(f"d{i}", 4, 40) for i in range(4)], 5: [make("long", 100, 4)]}


chunking = {}
for chunked, budget in ((True, 32), (False, 128)):
    s = Scheduler(num_blocks=128, block_size=4, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    t = chunking[f"v1, chunked prefill {'on' if chunked else 'off'}, budget {budget}"] = run_scheduler(
        s, decodes_and_a_long_prompt(), fake_model)
    with_decodes = [st for st in t.steps if st.decode_ids]
    worst = max(with_decodes, key=lambda st: sum(st.scheduled.values()))
    print(f"chunked prefill {'on ' if chunked else 'off'} (budget {budget:3d}): {len(t)} steps; "
          f"largest step with decodes: step {worst.step}, {sum(worst.scheduled.values())} tokens {worst.scheduled}")
side_by_side(chunking)
""")

md(r"""
Without chunking the budget must hold the whole prompt, and the four decodes wait through
a 104-token step (their inter-token latency spikes); with chunking no step exceeds 32
tokens, and the prompt is done a few steps later. The cost of a step grows with its tokens,
so a bounded budget is a bound on every request's inter-token latency.

## 4. Parallel sampling: copy-on-write fork (v0) vs child requests with prefix caching (v1)

The paper's `n > 1` (§4.4) keeps the n samples in one *sequence group*: the prompt is
prefilled once, the samples **fork** its block table (`ref_cnt` > 1), and the first write
into the shared, partly filled last block is copied (copy-on-write). vLLM v1 fans the
request out into n independent child requests (`vllm/v1/engine/parallel_sampling.py`); they
share the prompt's *full* blocks through the prefix cache, and each computes the partial
tail block itself. One request, n = 4, a 30-token prompt, blocks of 4 (7 full blocks and
2 tokens in an eighth), 10 output tokens each:
""")

code(r"""
print(f"{'parallel_sampling':18s}{'steps':>6s}{'tokens computed':>17s}{'peak blocks':>13s}{'cache hits':>12s}")
sampling = {}
for mode in ("fork", "prefix"):
    s = (PaperScheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, parallel_sampling="fork")
         if mode == "fork"  # the paper: one sequence group, forked
         else Scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True))
    group = [make(f"a.{i}", 30, 10) for i in range(4)]
    t = run_scheduler(s, [group], lambda r: 7 + int(r.request_id[-1]))  # each sample draws its own token
    sampling["v0: copy-on-write fork" if mode == "fork" else "v1: children over the prefix cache"] = t
    computed, _, _, peak = stats(t)
    print(f"{mode:18s}{len(t):6d}{computed:17d}{peak:13d}{s.prefix_cache_hits:12d}")
    if mode == "prefix":  # the 3 children after the first find the 7 full prompt blocks cached
        assert s.prefix_cache_hits == 3 * 7 * 4
side_by_side(sampling)
""")

md(r"""
Both keep one copy of the 7 full prompt blocks. The fork prefills the prompt once (30
tokens) and copies the shared partial block on the first write; the children prefill only
what the cache lacks, 2 tokens each after the first (the `cache hits` column counts the
tokens found cached). The blocks used are the same at the peak; v1 trades a few recomputed
tail tokens for one mechanism (the prefix cache) instead of two (fork and copy-on-write),
and children that are ordinary requests for the scheduler.

## 5. Prefix caching, on by default in v1

The paper shares blocks only within a request (§4.4's shared prefix is a given system
prompt). v1 hashes every full block (`hash_block_tokens`: the parent block's hash and the
block's tokens), keeps freed blocks in the cache until they are evicted (LRU), and looks up
each new request's prompt on admission. Eight requests with the same 32-token system prompt
and 8 tokens of their own:
""")

code(r"""
SYSTEM = [(11 * j + 5) % 50 for j in range(32)]
caching_runs = {}
for caching in (False, True):
    s = (Scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
         if caching else PaperScheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64))
    reqs = {k: [make(f"q{k}", 40, 4, SYSTEM + [k] * 8)] for k in range(8)}  # one arrival per step
    t = caching_runs[f"{'v1: ' if caching else 'v0: no '}prefix caching"] = run_scheduler(s, reqs, fake_model)
    computed, _, _, peak = stats(t)
    prompt_tokens = sum(r.num_prompt_tokens for rs in reqs.values() for r in rs)
    print(f"prefix caching {'on ' if caching else 'off'}: {computed:4d} tokens computed, "
          f"{s.prefix_cache_hits:3d} of {prompt_tokens} prompt tokens found cached, peak {peak} blocks")
side_by_side(caching_runs)
""")

md(r"""
## 6. What came after the paper

Three mechanisms in today's vLLM that the paper does not have, each a new use of the same
block table.

**Speculative decoding: lookahead slots.** A draft (a small model, n-grams, or extra heads)
proposes `k` tokens; the target model verifies them in one forward pass, so the scheduler
must give the request slots for `1 + k` tokens at once (`allocate_slots(...,
num_lookahead_tokens=k)` in `vllm/v1/core/kv_cache_manager.py`). After the pass,
`update_from_output` keeps the accepted tokens and rolls `num_computed_tokens` back over
the rejected ones: their slots stay in the request's table and are overwritten by the next
step's tokens, so rejected tokens cost compute, not memory beyond the lookahead.
""")

code(r"""
block_size, k = 16, 4
for num_tokens in (29, 30, 31, 32):
    plain = math.ceil((num_tokens + 1) / block_size)
    spec = math.ceil((num_tokens + 1 + k) / block_size)
    print(f"{num_tokens:4d} tokens held, one decode needs {plain:3d} blocks; with {k} lookahead slots {spec:3d} "
          f"(+{spec - plain})")
print(f"at most ceil({k} / {block_size}) = {math.ceil(k / block_size)} extra block per request")
""")

md(r"""
**Prefill/decode disaggregation: moving a request's blocks.** Prefill is compute-bound and
decode memory-bound, so some deployments run them on different GPUs: a prefill instance
computes the prompt's KV and sends the request's **blocks** to a decode instance, which
writes them into blocks of its own pool and continues decoding (vLLM's KV connectors,
`vllm/distributed/kv_transfer/`). The unit of transfer is exactly this course's block: the
decode side needs only the block table to be rewritten. The size, for Llama-3-8B
(32 layers, 8 KV heads of dimension 128, fp16):
""")

code(r"""
layers, kv_heads, head_dim, bytes_per = 32, 8, 128, 2
per_token = 2 * layers * kv_heads * head_dim * bytes_per  # K and V
for prompt in (1_000, 8_000, 32_000):
    mib = prompt * per_token / 2**20
    print(f"{prompt:6d}-token prompt: {mib:7.0f} MiB of KV, {math.ceil(prompt / 16):5d} blocks of 16 to move")
print(f"per token: {per_token // 1024} KiB")
""")

md(r"""
**Sliding-window layers.** Models such as Mistral-7B (window 4,096) and Gemma 2/3
(local layers with a window, interleaved with global ones) attend, in some layers, only to
the last `W` tokens. vLLM v1's hybrid KV-cache manager gives each kind of layer its own
block tables (`vllm/v1/core/single_type_kv_cache_manager.py`: `FullAttentionManager`,
`SlidingWindowManager`) and frees a sliding layer's blocks once they fall out of the
window, so those layers hold about `W / block_size` blocks per request however long it
grows:
""")

code(r"""
block_size, window = 16, 4096
for num_tokens in (4_096, 32_000, 128_000):
    full = math.ceil(num_tokens / block_size)
    sliding = min(full, math.ceil(window / block_size) + 1)  # the window may straddle a block
    print(f"{num_tokens:7d} tokens: full-attention layer {full:5d} blocks, sliding-window layer {sliding:4d}")
""")

md(r"""
**The CPU side of a step: the persistent batch, CUDA graphs, async scheduling.** A step is
not only the forward. Before it, the scheduler decides who runs and the runner builds the
step's inputs (token ids, positions, `slot_mapping`, block tables); after it, the scheduler
appends the sampled tokens, checks stops and frees blocks. On a GPU that host work runs while
the GPU waits, unless it is hidden, and a decode forward of a small model can take only a few
milliseconds, so it matters. vLLM v1 attacks it three ways: the **persistent batch**
(`vllm/v1/worker/gpu_input_batch.py`: the runner keeps its input tensors between steps and
applies only what changed, as this course's runner keeps its own block tables), **CUDA graphs**
(one launch replays the hundreds of kernels of a decode forward, so launching them stops
costing CPU time; `vllm/v1/worker/gpu_model_runner.py`, `capture_model`) and **async
scheduling** (`--async-scheduling`: the scheduler plans step N + 1 while the GPU runs step N).
This engine does none of the three; its own stopwatch shows what they would have to hide, on
32 running sequences of the course model (wall-clock shares of this machine, different every
run):
""")

code(r"""
# NBVAL_IGNORE_OUTPUT
# (wall-clock shares: they change from run to run)
from minipaged import LLM, SamplingParams

eng = LLM(max_num_seqs=32, num_blocks=256).llm_engine
for i in range(32):
    eng.add_request(f"s{i}", [(7 * i + j) % 400 + 10 for j in range(16)],
                    SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
for _ in range(8):  # the prefills, then a few decodes
    eng.step()
for phase in eng.step_times:
    eng.step_times[phase] = 0.0
n = 24
for _ in range(n):
    eng.step()
laps = dict(eng.step_times)
total = sum(laps.values())
print(f"decode step, 32 sequences: {total / n * 1e3:.1f} ms on average over {n} steps")
for phase, s in laps.items():
    print(f"  {phase:9s} {s / n * 1e3:6.2f} ms  {s / total:6.1%}")
host = laps["schedule"] + laps["prepare"] + laps["update"]
print(f"host bookkeeping (schedule + prepare + update): {host / total:.0%} of the step")
""")

md(r"""
On this CPU the forward itself is CPU work too, so the bookkeeping is a modest share. On a
GPU the forward shrinks by one or two orders of magnitude and the bookkeeping does not: the
same milliseconds become most of a step, which is why vLLM v1 keeps the batch persistent,
replays CUDA graphs and overlaps scheduling with the forward. (A finer split of this engine's
step, by cProfile: `minipaged bench --profile`, and the CPU appendix of chapter 07.)
""")

md(r"""
## Readings

| topic | the paper (Kwon et al., SOSP 2023) | vLLM source (v1 unless marked) |
|---|---|---|
| paged KV memory, block tables | §4.1–4.3 | `vllm/v1/core/block_pool.py`, `vllm/v1/core/kv_cache_manager.py`, `vllm/v1/core/kv_cache_utils.py` |
| scheduling, admission, preemption | §4.5 | `vllm/v1/core/sched/scheduler.py`; v0: `vllm/core/scheduler.py`, `vllm/core/block_manager.py` |
| swap vs recompute | §4.5, §7.3 (Fig. 19) | v0 only: `vllm/core/scheduler.py` (`_preempt_by_swap`) |
| parallel sampling, beam search | §4.4 | `vllm/v1/engine/parallel_sampling.py`; v0: `vllm/sequence.py` (`SequenceGroup`) |
| prefix caching | §4.4 (shared prefix) | `vllm/v1/core/kv_cache_utils.py` (`hash_block_tokens`), `vllm/v1/core/block_pool.py` |
| chunked prefill, token budget | — (after the paper) | `vllm/v1/core/sched/scheduler.py` (`max_num_batched_tokens`) |
| speculative decoding | — | `vllm/v1/spec_decode/`, `num_lookahead_tokens` in `kv_cache_manager.py` |
| disaggregated prefill | — | `vllm/distributed/kv_transfer/` |
| sliding window, hybrid models | — | `vllm/v1/core/single_type_kv_cache_manager.py` |

## Recap

* v1 keeps the paper's two ideas and simplifies the policies: admission named by
  `scheduler_reserve_full_isl` (default `True`, the whole sequence must fit, against the
  thrash of first-chunk admission), recompute only (the victim, the last of `running`, is
  the paper's latest arrival under FCFS), one token budget with chunked prefill on by
  default, `n > 1` as child requests over the prefix cache, prefix caching on by default.
* Each change was measured above on the same workload as its v0 counterpart: what it costs
  (recomputed tokens, a few tail tokens per child) and what it saves (a CPU pool, a
  copy-on-write path, steps that mix prefill and decode).
* The block table kept absorbing new features: lookahead slots for speculation, blocks
  moved between machines, per-layer tables for sliding windows.
""")

write("08_vllm_today")
