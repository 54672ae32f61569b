"""Generate notebooks/07_serving_at_scale.ipynb (run from the repo root, then execute it).

    python notebooks/_build/07_serving_at_scale.py
    jupyter nbconvert --to notebook --execute --inplace notebooks/07_serving_at_scale.ipynb

Sizes are kept small (about a hundred requests per run) so the notebook runs in under a
minute; ``minipaged simulate`` runs the same experiments at full size.
"""

from _nb import code, md, write

md(r"""
# 07 · Serving at scale: the paper's experiments on a laptop

The vLLM paper's headline is a number, and it is worth reading exactly what was measured.

- **What the paper measured** (§6.2, Fig. 12, top row): normalized latency (seconds per
  output token) against request rate, on ShareGPT-like traffic, for three settings:
  OPT-13B on one A100-40GB, OPT-66B on four A100-40GB, OPT-175B on eight A100-80GB.
  Against the paper's **own re-implementations of Orca** (Orca is not public), vLLM
  sustains **1.7–2.7× the request rate of Orca (Oracle)** and 2.7–8× that of Orca (Max) at
  similar latency, and up to 22× that of FasterTransformer. The 1.7–2.7× is a range *over
  the three models*, not a figure for OPT-13B alone.
- **What the 2–4× of the abstract is**: the throughput gain "at the same level of latency"
  over the state of the art. Orca already batches at the iteration level, as vLLM does, so
  the gain over Orca is not continuous batching; §6.2 credits it to memory management:
  PagedAttention fits more requests in a batch (Fig. 13: 2.2× more than Orca (Oracle) for
  OPT-13B).
- **What this chapter measures**: only the first setting, OPT-13B on one A100-40GB,
  *simulated*: the real scheduler and allocators of this course, a cost model for the GPU,
  and our own Orca-like baselines over the same memory. We report two ratios to
  Orca (Oracle): the sustainable request rate (the paper's measure) and the capacity
  (throughput with a full queue).

We cannot rent an A100 for an hour per experiment, but we do not need one to see *where
the number comes from*: the scheduler decides who runs, the KV allocator decides how many
fit, and a GPU only decides how long each step takes. So we run the **real** scheduler of
this course against a **cost model** of the GPU.

**You will learn**

1. how a simulator drives the real `Scheduler` with a clock instead of a model, and what
   its cost model says about one step (weights, KV reads, FLOPs: a roofline);
2. to check the simulator by hand on two requests;
3. to reproduce the shapes of the paper's Fig. 12 (latency per token vs request rate for
   vLLM-like, Orca-like and FasterTransformer-like serving), Fig. 13 (batch sizes) and
   Fig. 18b (block size), and to read a *sustainable rate* off them;
4. why a paper's speedup does not transfer directly to your setting: the **model**, the
   **hardware**, the **prompt and output lengths**, the **concurrency**, the **sampling**
   and the **latency target** each move it, and we vary each one;
5. how the CPU measurements of `minipaged bench` relate to all this.
""")

md("## Setup")

code(r"""
import inspect
import random

import matplotlib.pyplot as plt

from minipaged import viz
from minipaged.sim import (
    GPUS, MODELS, OPT_13B, A100_40GB, POLICY_NAMES, CostModel, GPUConfig,
    block_size_sweep, compare_policies, make_requests, offline_capacity, poisson_arrivals,
    sample_requests, simulate,
)
from minipaged.core.sched.orca import OrcaScheduler
from minipaged.sim.cli import plot_block_size, plot_latency

SEED = 0
""")

md(r"""
## 1. The concept: a clock instead of a GPU

One engine step is: `Scheduler.schedule()` picks the batch, the model runs it, the sampler
picks tokens, `Scheduler.update_from_output()` advances every request. The simulator keeps
every part except the model:

```
while requests remain:
    add the requests that have arrived by time t      (Poisson arrivals, a seeded trace)
    out = scheduler.schedule()                       the REAL scheduler and KV allocator
    t  += cost_model.step_time(batch of out)         instead of running the model
    sampled = token 1, or EOS when a request reaches its trace length
    scheduler.update_from_output(out, sampled)       finish, free blocks
```

Everything that decides *how many requests run together* (block tables, on-demand
allocation, preemption, FCFS admission) is the code of chapters 02–05. Only the duration of
a step is modelled. Five serving policies share the same memory budget:

| policy | batching | KV memory | stands for |
|---|---|---|---|
| `paged` | continuous | blocks on demand, preempt when full | vLLM |
| `orca-oracle` | continuous | one contiguous region of exactly prompt + output | Orca (Oracle) |
| `orca-pow2` | continuous | region rounded up to a power of two | Orca (Pow2) |
| `orca-max` | continuous | region of the maximum length (2048) | Orca (Max) |
| `static` | a new batch only when the last one is done | maximum length per request | FasterTransformer |

The Orca-like policies run `OrcaScheduler` (in `minipaged/core/sched/orca.py`, a sibling of
the paged scheduler reusing its queues and refusal rules) over the
first-fit allocators of chapter 01 (`minipaged/core/kv/contiguous.py`).
""")

md(r"""
## 2. The cost model: what one step costs

A decoder step reads **all the weights** once (whatever the batch), reads each sequence's
**KV context** once, and does `2 × parameters` FLOPs per new token plus the attention FLOPs.
On a GPU, time is the larger of compute time and memory time (a roofline), plus a fixed
per-step overhead. The KV budget is what is left of the GPU's memory after the weights.
""")

code(r"""
cm = CostModel(OPT_13B, A100_40GB)
print(cm)
print(f"OPT-13B: {OPT_13B.num_params / 1e9:.2f} B parameters = {OPT_13B.weight_bytes / 2**30:.1f} GiB of weights")
print(f"KV per token: 2 x {OPT_13B.num_layers} layers x {OPT_13B.hidden_size} x 2 bytes = "
      f"{OPT_13B.kv_bytes_per_token} bytes ({OPT_13B.kv_bytes_per_token / 1024:.0f} KiB)")
print(f"KV budget: 40 GiB x 0.9 - weights - 1 GiB activations = {cm.kv_cache_bytes() / 2**30:.2f} GiB "
      f"= {cm.num_kv_tokens()} tokens = {cm.num_gpu_blocks(16)} blocks of 16")
print()
print("decode step, every sequence with 400 tokens of context:")
print(f"{'batch':>6} {'time ms':>8} {'bound':>8} {'ms/token':>9}")
for b in (1, 8, 16, 32, 64, 128, 256):
    c = cm.breakdown([(1, 400)] * b)
    print(f"{b:6d} {c.time_s * 1e3:8.2f} {c.bound:>8} {c.time_s / b * 1e3:9.3f}")
c = cm.breakdown([(2048, 0)])
print(f"prefill of 2048 tokens: {c.time_s * 1e3:.1f} ms, {c.bound}-bound")
ridge_400 = cm.decode_ridge_batch(400)
print(f"decode becomes compute-bound past {cm.decode_ridge_batch(0):.0f} sequences of 0 context; "
      f"with 400 tokens of context: "
      + (f"past {ridge_400:.0f}" if ridge_400 != float("inf") else "never (each sequence's KV read grows with the batch)"))
""")

md(r"""
Read the table: one sequence alone costs ~24 ms per step (20.6 ms to read 24 GiB of weights
at 80% of 1.555 TB/s, plus 3 ms overhead). Thirty-two sequences cost only about a third
more per step, so they get ~24× the throughput: **batching is nearly free while decode is
memory-bound**, and the batch is limited by how many sequences' KV fits in the 11 GiB
left. That is the whole case for PagedAttention: the same memory, more sequences. Note
also the other side: each extra sequence adds its own KV read, so once the KV reads
rival the weights (large batches, long contexts), extra batch slots buy less and less.

Where the model simplifies (the module docstring lists it): perfect overlap of compute and
memory, one efficiency factor per resource, activations not counted, sampling and Python
overheads in one fixed number, one GPU (no tensor parallelism), block size free of cost.
""")

code(r"""
print(inspect.getsource(CostModel.step_costs))  # breakdown(batch) wraps it in a StepCost
""")

md(r"""
## 3. Hand-check: two requests

Request A (prompt 3, output 2) arrives at 0; request B (prompt 2, output 3) arrives at
10 ms, while A's prefill runs. Step by step:

- step 0: A's prompt, 3 tokens from 0 context; ends at `t1`; A has its first token.
- step 1: A decodes (1 token, 3 context) and B's prompt runs (2 tokens): ends at `t2`; A is
  done (2 tokens), B has its first token.
- steps 2 and 3: B decodes (1 token on 2, then 3 context); B is done at `t4`.
""")

code(r"""
reqs = make_requests([(3, 2), (2, 3)], [0.0, 0.010])
res = simulate(reqs, "paged", cm, check=True)
t1 = cm.step_time([(3, 0)])
t2 = t1 + cm.step_time([(1, 3), (2, 0)])
t3 = t2 + cm.step_time([(1, 2)])
t4 = t3 + cm.step_time([(1, 3)])
a, b = res.records
print(f"A: first token {a.first_token_time * 1e3:.3f} ms (by hand {t1 * 1e3:.3f}), "
      f"done {a.finish_time * 1e3:.3f} ms (by hand {t2 * 1e3:.3f})")
print(f"B: first token {b.first_token_time * 1e3:.3f} ms (by hand {t2 * 1e3:.3f}), "
      f"done {b.finish_time * 1e3:.3f} ms (by hand {t4 * 1e3:.3f})")
norm = ((t2 - 0.0) / 2 + (t4 - 0.010) / 3) / 2
print(f"normalized latency: {res.metrics.normalized_latency * 1e3:.3f} ms/token (by hand {norm * 1e3:.3f})")
assert abs(res.metrics.normalized_latency - norm) < 1e-12
""")

md(r"""
**Normalized latency** (the paper's metric) is each request's end-to-end latency divided by
its output length, averaged over requests: seconds per token, queueing included. **TTFT**
is the time to the first token, **TPOT** the time per output token after it.

## 4. Picture: a simulated trace

The simulator returns the same `EngineTrace` as the engine, with `StepRecord.time` in
simulated seconds, so the pictures of chapter 05 work on it. Here eight short requests
arrive at 40 req/s on a pretend A100 with room for only 320 tokens of KV (and, so that
the strips under the timeline are readable, at most 8 sequences and 256 tokens per step):
watch requests wait for memory, and one get preempted (X) and recomputed.
""")

code(r"""
tiny_gpu = GPUConfig("A100, 320 KV slots", A100_40GB.peak_flops, A100_40GB.mem_bandwidth,
                     memory_bytes=OPT_13B.weight_bytes + 320 * OPT_13B.kv_bytes_per_token)
tiny = CostModel(OPT_13B, tiny_gpu, gpu_memory_utilization=1.0, activation_reserve_bytes=0)
rng = random.Random(SEED)
small = make_requests([(rng.randint(20, 90), rng.randint(4, 30)) for _ in range(8)],
                      poisson_arrivals(8, 40.0, SEED))
res = simulate(small, "paged", tiny, max_num_seqs=8, max_num_batched_tokens=256,
               record_trace=True, check=True)
trace = res.trace
fig = viz.timeline(trace)
plt.show()
plt.close(fig)
print(viz.timeline_text(trace, width=100))
print(f"simulated time at the end of steps 0..4: {[round(s.time * 1e3, 1) for s in trace.steps[:5]]} ms")
""")

md(r"""
## 5. Code tour: the Orca-like scheduler

Iteration-level batching as in Orca, but each request must get **one contiguous region for
its whole reservation** at admission. It never needs memory later, so nobody is preempted,
and the price is paid up front: memory reserved for tokens not generated yet.
""")

code(r"""
print(inspect.getsource(OrcaScheduler.schedule))
""")

md(r"""
## 6. Experiment: the paper's Fig. 12, small

For each policy: the same seeded requests (ShareGPT-like lengths, means 161 / 338 tokens)
arriving as a Poisson process at a sweep of rates, placed at fractions of that policy's
*capacity* (its throughput when the queue is always full). The **sustainable rate** is where
the latency per token reaches twice its light-load value (the knee, marked ×; see the
`simulator` docstring for why this and not a fixed level). The token budget is
`max_model_len + max_num_seqs`, so a whole prompt always fits beside the decodes.
""")

code(r"""
FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
sharegpt = compare_policies("sharegpt", num_requests=200, seed=SEED, cost_model=cm, rate_fractions=FRACTIONS)
fig = plot_latency(sharegpt.to_dict())
plt.show()
plt.close(fig)

def table(cmp_):
    d = cmp_.to_dict()
    print(f"{'policy':28s} {'capacity':>9s} {'sustainable':>12s} {'vLLM x':>7s} {'batch':>6s}")
    for p, sw in cmp_.sweeps.items():
        ratio = d["ratios"].get(f"paged/{p}")
        plus = "+" if sw.saturated(cmp_.factor) else " "  # no knee in the sweep: a lower bound
        print(f"{POLICY_NAMES[p]:28s} {sw.capacity:9.3f} {sw.sustainable_rate(cmp_.factor):11.3f}{plus} "
              f"{'' if ratio is None else f'{ratio:6.2f}x':>7s} {sw.metrics[-1].mean_loaded_batch_size:6.1f}")

table(sharegpt)
""")

md(r"""
(capacity and sustainable rate in req/s; a `+` marks a rate where the sweep ended before
the knee, a lower bound; batch: sequences per step while requests were waiting, at the
highest rate of the sweep.)

The shapes are the paper's: every curve is flat (no queueing), then turns up sharply
once the arrival rate passes what the policy can serve, and the vLLM-like curve turns up
last. The **batch** column is the paper's Fig. 13, which reports 7.00 / 9.81 / 13.62 /
30.42 requests for Orca (Max) / Pow2 / Oracle / vLLM on ShareGPT: Orca (Max) can never
hold more than `14526 // 2048 = 7` requests, whatever they need, and paging fits about
twice as many as even the Oracle.

Compare the vLLM-like / Orca (Oracle) ratio with the paper's **OPT-13B panel** (Fig. 12a),
not with the 1.7–2.7× range, which spans three models and three GPU setups. The ratio also
depends on the run: short runs like this one (200 requests) overstate it a little, because
the queue has less time to build; `minipaged simulate` runs 500 requests per point. Our
Oracle is the strongest possible Orca (exact lengths, an ideal first-fit allocator); the
paper's own Orca (Oracle) batched fewer requests (13.6 in Fig. 13a against about 15 here).

Alpaca-like requests are short (19 / 58 tokens). The paged cache could hold more of them
than `max_num_seqs = 256` allows, so for vLLM-like serving the cap, not memory, is the
limit; the contiguous Oracle is still limited by its reservations. Against max-length
reservation the gap is enormous: Orca (Max) still fits only 7 requests of ~80 tokens.

Short requests also finish fast enough that a finite run keeps its latency flat well past
the full-queue throughput: on a sweep that stops at 1.5x capacity, as the one above, the
vLLM-like and Oracle curves never reach their knee, and the ratio would be the sweep's
ceiling (1.5 / 1.5) times the capacity ratio, not a measurement. The Alpaca sweep below
therefore runs to 4x capacity, and the check after the table asserts that every knee the
ratio uses lies inside it.

""")

code(r"""
ALPACA_FRACTIONS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # short requests: the knees lie past 1.5x
alpaca = compare_policies("alpaca", num_requests=400, seed=SEED, cost_model=cm, rate_fractions=ALPACA_FRACTIONS)
fig = plot_latency(alpaca.to_dict())
plt.show()
plt.close(fig)
table(alpaca)
assert not any(alpaca.sweeps[p].saturated(alpaca.factor) for p in ("paged", "orca-oracle"))
""")

md(r"""
### Block size (the paper's Fig. 18b)

Bigger blocks waste more of each request's last block (internal fragmentation), which
matters most for short requests. The paper also finds that very small blocks slow the
attention kernel down; our cost model does not charge for block size, so only the memory
side shows here.
""")

code(r"""
blocks = {wl: block_size_sweep(wl, (16, 64, 256), num_requests=n, seed=SEED, cost_model=cm)
          for wl, n in (("sharegpt", 100), ("alpaca", 200))}
fig = plot_block_size(blocks)
plt.show()
plt.close(fig)
for wl, b in blocks.items():
    caps = ", ".join(f"{bs}: {c:.2f}" for bs, c in zip(b["block_sizes"], b["capacity"]))
    print(f"{wl:8s} capacity (req/s) by block size: {caps}")
""")

md(r"""
## 7. Why a paper's speedup does not transfer directly

A speedup is a ratio of two systems *in one setting*. Change the setting and the ratio
moves. Below, each factor is varied alone. To keep this quick we compare capacities (the
throughput with a full queue, `offline_capacity`) of vLLM-like and Orca (Oracle)-like
serving: the same requests, the same memory. (Runs of a few hundred requests: read the
trends, not the second decimal.)
""")

code(r"""
def capacity_ratio(lengths, cost_model=cm, **kw):
    paged = offline_capacity(lengths, "paged", cost_model, **kw)
    oracle = offline_capacity(lengths, "orca-oracle", cost_model, **kw)
    return paged, oracle, paged / oracle

SHAREGPT = sample_requests("sharegpt", 300, SEED)
ALPACA = sample_requests("alpaca", 300, SEED)
BASE = capacity_ratio(SHAREGPT)  # OPT-13B, A100-40GB, ShareGPT-like, max_num_seqs 256, n = 1
BASE_ALPACA = capacity_ratio(ALPACA)
print(f"base setting: vLLM-like {BASE[0]:.2f} req/s, Orca (Oracle) {BASE[1]:.2f} req/s, ratio {BASE[2]:.2f}x")
cap6 = sharegpt.sweeps["paged"].capacity / sharegpt.sweeps["orca-oracle"].capacity
print(f"vLLM-like / Orca (Oracle), ShareGPT-like: sustainable rate {sharegpt.ratio():.2f}x and "
      f"capacity {cap6:.2f}x (section 6, 200 requests); capacity {BASE[2]:.2f}x (here, 300 requests)")
assert sharegpt.ratio() > cap6 > BASE[2] > 1
""")

md(r"""
**Two ratios, one comparison.** The line above splits the gap between the two ratios to
Orca (Oracle): on the same 200 requests the sustainable rate (the arrival rate that keeps
latency under twice its light-load value) gives a larger ratio than the capacity
(throughput with every request queued at once), because in a finite run the vLLM-like
server stays fast a little past its full-queue throughput and the Orca-like one barely
does (compare the capacity and sustainable columns of section 6's table), and the
rest is run length (200 vs 300 requests).
""")

md(r"""
### 7a. The model

Llama-2-7B has half the weights of OPT-13B and a KV cache 64% the size per token; on the
same A100 it leaves 3× more KV memory for the batch.

Two things set the ratio, and the model changes both: *how many more sequences* paging fits
in the memory left (KV bytes per token against the memory left after the weights), and
*what one more sequence is worth*, which depends on what dominates a step (reading the
weights, reading the KV, or recomputing after a preemption).
""")

code(r"""
for name, model in MODELS.items():
    c = CostModel(model, A100_40GB)
    try:
        c.num_kv_tokens()
    except ValueError:  # NOTE: OPT-66B / 175B need 4 / 8 GPUs: chapter 11
        print(f"{name:9s} does not fit one A100-40GB (tensor parallelism: chapter 11)")
        continue
    p, o, r = BASE if model is OPT_13B else capacity_ratio(SHAREGPT, c)
    print(f"{name:9s} KV budget {c.num_kv_tokens():6d} tokens: vLLM-like {p:6.2f} req/s, "
          f"Orca (Oracle) {o:6.2f} req/s, ratio {r:.2f}x")
""")

md(r"""
### 7b. The hardware

More memory holds more sequences for *both* systems, and faster memory shortens every
step, so the absolute rates grow a lot. The *ratio* does not follow the memory size in any
simple way: with a big cache a step is dominated by reading the KV of a big batch rather
than the weights, the batch may hit `max_num_seqs`, and a big paged batch preempts and
recomputes more. (300 requests: the biggest GPU's cache holds most of them at once, so
its row has the least queue; read the trend, the last digit is noise.)
""")

code(r"""
for name, gpu in GPUS.items():
    c = CostModel(OPT_13B, gpu)
    p, o, r = BASE if gpu is A100_40GB else capacity_ratio(SHAREGPT, c)
    print(f"{name:10s} KV {c.num_kv_tokens():6d} tokens: vLLM-like {p:6.2f} req/s, "
          f"Orca (Oracle) {o:6.2f} req/s, ratio {r:.2f}x")
""")

md(r"""
### 7c. Prompt and output lengths

Contiguous reservation wastes the room it keeps for *future output* tokens. That room is a
large share of a request's footprint when outputs are long relative to prompts (both
ShareGPT and Alpaca have outputs 2–3× their prompts). Flip the same ShareGPT lengths into
long prompts with short answers (summarization-like) and the reserved share drops, and so
does the ratio: a prompt's KV is needed at once by both systems.
""")

code(r"""
cases = {
    "ShareGPT-like (161 in / 338 out)": BASE,
    "Alpaca-like (19 in / 58 out)": BASE_ALPACA,
    "flipped ShareGPT (338 in / 161 out)": capacity_ratio([(o, p) for p, o in SHAREGPT]),
}
for name, (p, o, r) in cases.items():
    print(f"{name:36s} vLLM-like {p:6.2f} req/s, Orca (Oracle) {o:6.2f} req/s, ratio {r:.2f}x")
""")

md(r"""
### 7d. Concurrency

Paging lets more sequences share the GPU, but only if the server lets them. With
`max_num_seqs = 8` both systems run 8 sequences and the advantage is gone; a benchmark at
low concurrency (or a CPU run with a small batch) cannot show a memory win.
""")

code(r"""
for max_num_seqs in (8, 32, 256):
    p, o, r = BASE if max_num_seqs == 256 else capacity_ratio(SHAREGPT, max_num_seqs=max_num_seqs)
    print(f"max_num_seqs {max_num_seqs:3d}: vLLM-like {p:6.2f} req/s, Orca (Oracle) {o:6.2f} req/s, ratio {r:.2f}x")
""")

md(r"""
### 7e. Sampling

Two things about sampling change the ratio. First, *what the baseline knows about the
output length*: greedy decoding with `ignore_eos` (what benchmarks do) makes lengths fixed
and knowable; real sampling stops at a random EOS, so a contiguous system must reserve for
the worst case. The Oracle ratio above is the *conservative* comparison; against Orca
(Max), which knows nothing, the same run gives:
""")

code(r"""
d = sharegpt.to_dict()
for p in ("orca-oracle", "orca-pow2", "orca-max", "static"):
    print(f"vLLM-like / {POLICY_NAMES[p]:27s} {d['ratios'][f'paged/{p}']:6.2f}x")
""")

md(r"""
Second, *parallel sampling* (`n` samples per prompt): vLLM prefills the prompt once and
shares its blocks (chapter 06); the contiguous baseline keeps `n` copies. On Alpaca-like
requests the prompts are short, so sharing saves little (the paper's Fig. 15: 6–10% of
memory for parallel sampling; beam search shares far more), and a group of `n` sequences
is admitted, preempted and recomputed as a whole, which costs more as `n` grows:
""")

code(r"""
for n in (1, 2, 4):
    p, o, r = BASE_ALPACA if n == 1 else capacity_ratio(ALPACA, n=n)
    print(f"n = {n}: vLLM-like {p:6.2f} req/s, Orca (Oracle) {o:6.2f} req/s, ratio {r:.2f}x")
""")

md(r"""
### 7f. The latency target

"Sustainable" depends on how much latency you accept. The same ShareGPT sweep as in
section 6, read at different levels (a multiple of each policy's light-load latency, or one
absolute level in s/token for everyone):
""")

code(r"""
def vs_static(ratio):
    # FasterTransformer-like static batching may meet a tight target at no rate at all
    return f"{ratio:.1f}x" if ratio != float("inf") else "none: it meets the target at no rate swept"


for factor in (1.5, 2.0, 3.0, 4.0):
    sharegpt.factor, sharegpt.threshold = factor, None
    print(f"latency <= {factor:.1f} x light load: vLLM-like / Orca (Oracle) = {sharegpt.ratio():.2f}x, "
          f"/ FasterTransformer = {vs_static(sharegpt.ratio('paged', 'static'))}")
for threshold in (0.05, 0.1, 0.2):
    sharegpt.factor, sharegpt.threshold = 2.0, threshold
    print(f"latency <= {threshold:.2f} s/token:    vLLM-like / Orca (Oracle) = {sharegpt.ratio():.2f}x, "
          f"/ FasterTransformer = {vs_static(sharegpt.ratio('paged', 'static'))}")
sharegpt.factor, sharegpt.threshold = 2.0, None
""")

md(r"""
The ratio moves with the level at which it is read. A strict absolute target
(0.05 s/token) is one the FasterTransformer-like server cannot meet at any rate (late
arrivals wait for a whole batch), so there is no ratio to print; a loose one (0.2 s/token)
lets every system queue a lot, and the ratio drifts toward the ratio of capacities
(compare the capacity column of section 6). With a couple of hundred requests per point
the interpolation between sweep points also adds noise. A headline number is one point
of this curve.

### 7g. What users are judged by: TTFT, ITL and goodput

Normalized latency (seconds per output token, end to end) is the paper's measure; a user
feels two latencies instead, and a service states a target for each: the **time to first
token** (TTFT: queueing plus prefill) and the **inter-token latency** (ITL, the gaps between
the tokens that follow; TPOT is one request's mean ITL). **Goodput** is the rate of requests
that met both targets (DistServe's measure; `vllm bench serve --goodput ttft:1000 tpot:100`
computes it from a real server). `minipaged.bench.goodput` reads both latencies off the same
trace the pictures use: a request samples a token in each decode step and in the step that
ends its prefill, at that step's end time. Hand-check first, on the two requests of section 3:
"""
)

code(r"""
from minipaged.bench.goodput import SLO, drive_engine, latency_report, token_times

res = simulate(make_requests([(3, 2), (2, 3)], [0.0, 0.010]), "paged", cm, record_trace=True)
times = token_times(res.trace)
print({rid: [f"{t * 1e3:.3f}" for t in ts] for rid, ts in times.items()}, "ms")
print(f"by hand: A at {t1 * 1e3:.3f}, {t2 * 1e3:.3f}; B at {t2 * 1e3:.3f}, {t3 * 1e3:.3f}, {t4 * 1e3:.3f} ms")
assert times["r0"] == [t1, t2] and times["r1"] == [t2, t3, t4]
""")

md(r"""
Now the ShareGPT-like requests of section 6 at fixed rates, against two targets an
interactive service might state: TTFT at most 1 s and TPOT at most 100 ms (the FasterTransformer-like
server is left out: it meets the TTFT target for almost no request at any of these rates):
""")

code(r"""
slo = SLO(ttft_s=1.0, tpot_s=0.1)
lens = sample_requests("sharegpt", 200, SEED)
print(f"targets: TTFT <= {slo.ttft_s:.1f} s, TPOT <= {slo.tpot_s * 1e3:.0f} ms; 200 requests per point")
print(f"{'policy':14s} {'req/s':>5s} {'TTFT p50':>9s} {'p99':>7s} {'TPOT p99':>9s} {'met':>8s} {'goodput':>8s} {'thruput':>8s}")
highest = {}
for pol in ("paged", "orca-oracle"):
    for rate in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0):
        run = simulate(make_requests(lens, poisson_arrivals(len(lens), rate, SEED)), pol, cm, record_trace=True)
        rep = latency_report({r.request_id: r.arrival_time for r in run.records}, token_times(run.trace),
                             slo, run.metrics.duration)
        if rep.num_good >= 0.9 * rep.num_requests:
            highest[pol] = rate
        print(f"{POLICY_NAMES[pol]:14s} {rate:5.1f} {rep.ttft[50]:8.2f}s {rep.ttft[99]:6.2f}s "
              f"{rep.tpot[99] * 1e3:7.0f}ms {rep.num_good:4d}/{rep.num_requests} {rep.goodput:7.2f}  {rep.throughput:7.2f}")
print(f"highest rate swept with >= 90% of requests meeting both targets: vLLM-like {highest['paged']} req/s, "
      f"Orca (Oracle) {highest['orca-oracle']} req/s")
""")

md(r"""
Both servers keep TPOT far under its target at every rate: a decode step of OPT-13B costs
about the same whatever the batch, so a token's wait barely grows. What fails first is TTFT:
once the Oracle's reservations fill the memory, arrivals queue, and their first token waits
for others to finish; paging fits about twice as many requests, so its queue starts later.
That is the same memory effect as section 6 read in the unit a user feels, and the ratio of
the highest rates that meet the targets is one more reading of the "vLLM x" column that
depends on where the targets are set (7f).

The real engine on this CPU, measured the same way: the course model, requests arriving as a
Poisson process in wall-clock time (the engine steps while requests wait, as a server's loop
does). The numbers are this machine's and change from run to run; the targets are scaled to a
CPU:
""")

code(r"""
# NBVAL_IGNORE_OUTPUT
# (wall-clock times: they change from run to run)
from minipaged import LLM, SamplingParams

cpu_engine = LLM(max_num_seqs=8, num_blocks=128).llm_engine
rng = random.Random(SEED)
live = [(f"q{i}", [rng.randrange(10, 500) for _ in range(rng.randint(8, 32))],
         SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 24), ignore_eos=True)) for i in range(16)]
arrived, times, duration = drive_engine(cpu_engine, live, poisson_arrivals(len(live), 4.0, SEED))
cpu_slo = SLO(ttft_s=0.5, tpot_s=0.05)
print(f"targets: TTFT <= {cpu_slo.ttft_s} s, TPOT <= {cpu_slo.tpot_s * 1e3:.0f} ms")
print(latency_report(arrived, times, cpu_slo, duration).line("course model, 16 requests at 4 req/s: "))
""")

md(r"""
## 8. How the CPU measurements relate

`minipaged bench` runs the real engine on this machine's CPU: real tokens, real
attention, the same scheduler. What carries over from this chapter and what does not:

- **The scheduling and memory effects are the same code.** How many sequences fit, when a
  request is preempted, how long a request waits: identical, because it is the same
  `Scheduler` and `KVCacheManager`. The bench's "continuous + paged vs static + contiguous
  at the same KV memory" is this chapter's `paged` vs `static` at a small scale.
- **The step cost is not.** On a CPU a small model's decode step is dominated by compute
  and by Python overhead (scheduling, input preparation), not by reading the weights from
  HBM, so the "batching is nearly free" regime of section 2 is much narrower: doubling
  the batch costs more on a CPU. Memory-driven speedups measured on a CPU are therefore
  smaller than on a GPU, and overhead-driven differences (which this cost model lumps into
  3 ms per step) are larger.
- **Concurrency and lengths** (7c, 7d) apply as they are: a CPU benchmark with a few
  short requests has no memory pressure and cannot show a paging win.

So a CPU number and a GPU number answer different questions; neither is the paper's
number, and each is honest only together with its setting.

## 9. Where a CPU step's time goes: the appendix

Why continuous batching wins less on a CPU than on a GPU, measured on a recorded run of the
real engine (the split of a decode step into weight matmuls, attention and the rest, and the
algebra that separates a step's fixed cost from its per-sequence cost), is the appendix
notebook `07a_cpu_step_cost.ipynb`. Nothing later depends on it.

## Recap

- The simulator runs the real scheduler and allocators; only step time comes from a model:
  `max(FLOPs / peak, bytes / bandwidth) + overhead`, with bytes = weights + KV context.
- Decode is memory-bound: reading 24 GiB of OPT-13B weights costs ~21 ms on an A100
  whatever the batch, so more sequences in the same memory means more throughput.
- Reproduced shapes: flat-then-exploding latency curves (Fig. 12), Orca (Max) capped at
  7 requests and vLLM-like batching about twice Orca (Oracle) (Fig. 13), big blocks
  hurting short requests (Fig. 18b).
- The paper's 1.7–2.7× over Orca (Oracle) spans OPT-13B, 66B and 175B on their GPUs;
  here, for OPT-13B on one simulated A100-40GB, the sustainable-rate ratio and the
  capacity ratio are printed in sections 6 and 7. The gain over Orca is memory management,
  not continuous batching: both batch at the iteration level.
- On a CPU, continuous batching's time win lands between the ratio of the runs' weight
  matmuls and the ratio of their steps (appendix 07a): the matmuls cost per token there.
- A speedup is a ratio in one setting: the model, the GPU's memory and bandwidth, the
  lengths, the allowed concurrency, what the baseline knows about sampling, and the
  latency target all move it.
""")

md(r"""
## Readings

* **The paper** (Kwon et al., SOSP 2023): §6.1 Experimental Setup (models, ShareGPT and
  Alpaca traces, the Orca and FasterTransformer baselines, normalized latency); §6.2 Basic
  Sampling (Fig. 12); §7.2 Impact of Block Size (Fig. 18b); §4.6 Distributed Execution
  (how OPT-66B and OPT-175B span GPUs).
* **Orca** (Yu et al., OSDI 2022): the system the baselines re-implement:
  `minipaged/core/sched/orca.py` over `minipaged/core/kv/contiguous.py`.
* The policy the simulator runs is vLLM v1's `vllm/v1/core/sched/scheduler.py` ↔
  `minipaged/core/sched/scheduler.py`; the clock and the GPU: `minipaged/sim/simulator.py`,
  `minipaged/sim/cost_model.py` (no vLLM counterpart).
* Measuring a server: vLLM's `vllm/benchmarks/serve.py` (`vllm bench serve`) ↔
  `minipaged/bench/serving.py`.
""")

write("07_serving_at_scale")
