"""Generate notebooks/01_kv_cache.ipynb (run from the repo root, then execute it).

python notebooks/_build/01_kv_cache.py
jupyter nbconvert --to notebook --execute --inplace notebooks/01_kv_cache.ipynb
"""

from _nb import code, md, write

md(r"""
# 01 · The KV cache: the data PagedAttention manages

A language model writes one token at a time, and every new token attends to all the tokens
before it. The **KV cache** keeps, for every token seen so far, the *keys* and *values* that
attention needs, so they are computed once instead of at every step. It is the largest
thing a serving system holds besides the weights, and how it is laid out in memory decides
how many requests can run at once. That is the whole story of vLLM's first idea.

**You will learn**

1. what K and V are, per layer and per head, and why a decoder may keep them;
2. how many bytes one token costs in real models (OPT-13B, Llama-2-7B, Llama-2-13B,
   Llama-3-8B with grouped-query attention), and how many tokens fit in a GPU;
3. what caching saves, counted in FLOPs;
4. why reserving one *contiguous* region per request wastes most of that memory, measured
   on the allocators of this package: the vLLM paper's Figure 2;
5. how a quantized KV cache (vLLM's `kv_cache_dtype="fp8"`) halves the bytes per token again,
   what that does to the sequences per step, and what it costs in accuracy.
""")

md("## Setup")

code(r"""
import inspect

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from minipaged.core.kv.contiguous import ContiguousAllocator
from minipaged.sim.cost_model import OPT_13B, CostModel
from minipaged.sim.memory_waste import format_table, plot_memory_waste, run_memory_experiment
from minipaged.sim.workloads import WORKLOADS

_ = torch.manual_seed(0)
""")

md(r"""
## 1. What K and V are

In every attention layer, each token's hidden state $x_i$ (a vector of `hidden_size`
numbers) is projected three ways: a query $q_i = x_i W_Q$, a key $k_i = x_i W_K$ and a
value $v_i = x_i W_V$. Each is split into `num_heads` heads of `head_dim` numbers. Token $t$'s
output in head $h$ is a weighted mix of the values of tokens $0..t$:

$$o_t^h = \sum_{i \le t} \mathrm{softmax}_i\!\left(\frac{q_t^h \cdot k_i^h}{\sqrt{d}}\right) v_i^h .$$

The mask is *causal*: token $i$ never looks at later tokens, so its $k_i, v_i$ depend on
tokens $0..i$ only and **never change** once computed. That is what makes caching them
correct. Per request, the cache holds, for every layer, a K and a V tensor of shape
`[num_tokens, num_kv_heads, head_dim]`.

Check it on one random attention layer: 4 heads of size 8, a 10-token sequence. Computing
the last token's output from the cached K/V of tokens 0..8 plus its own gives the same
numbers as recomputing the whole sequence.
""")

code(r"""
hidden, num_heads, head_dim, T = 32, 4, 8, 10
W_q, W_k, W_v = (torch.randn(hidden, num_heads * head_dim) / hidden**0.5 for _ in range(3))
x = torch.randn(T, hidden)  # [T, hidden]: the layer's input, one row per token


def heads(t):  # [T, H * D] -> [H, T, D]
    return t.view(-1, num_heads, head_dim).transpose(0, 1)


# Without a cache: project every token, causal attention over all of them.
q, k, v = heads(x @ W_q), heads(x @ W_k), heads(x @ W_v)  # [H, T, D] each
full = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [H, T, D]

# With a cache: K/V of tokens 0..T-2 were stored at earlier steps; only the new token is projected.
k_cache, v_cache = k[:, : T - 1], v[:, : T - 1]  # [H, T-1, D]: what the KV cache holds
x_new = x[T - 1 :]  # [1, hidden]
k_all = torch.cat([k_cache, heads(x_new @ W_k)], dim=1)  # [H, T, D]
v_all = torch.cat([v_cache, heads(x_new @ W_v)], dim=1)  # [H, T, D]
out_new = F.scaled_dot_product_attention(heads(x_new @ W_q), k_all, v_all)  # [H, 1, D]

print("K cache per layer:", tuple(k_cache.transpose(0, 1).shape), "= [tokens, kv heads, head_dim]")
print("same output with and without the cache:", torch.allclose(out_new[:, 0], full[:, -1], atol=1e-6))
""")

md(r"""
## 2. Bytes per token, from real model configs

One token costs, in every layer, one K and one V vector per KV head:

$$\text{KV bytes per token} = 2 \times \text{layers} \times \text{kv heads} \times \text{head dim} \times \text{bytes per number}.$$

The numbers below are copied from each model's `config.json` on the Hugging Face hub
(nothing is downloaded here). `head_dim = hidden_size / num_attention_heads`. Llama-3-8B uses
**grouped-query attention** (GQA): its 32 query heads share 8 KV heads, so it stores 4x less
KV per token than a model of the same width with one KV head per query head.
""")

code(r"""
# From config.json (num_key_value_heads absent = one KV head per query head); fp16/bf16 = 2 bytes.
configs = {
    "OPT-13B":    dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=40),
    "Llama-2-7B": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32),
    "Llama-2-13B": dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=40),
    "Llama-3-8B": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8),
}
dtype_bytes = 2
KiB, GiB = 1024, 1024**3
budget = 12 * GiB  # about what is left for KV next to OPT-13B's weights on a 40 GB A100

print(f"{'model':<12}{'head_dim':>9}{'KV/token':>12}{'2048-token request':>20}{'tokens in 12 GiB':>18}")
kv_per_token = {}
for name, c in configs.items():
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    kv = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * dtype_bytes
    kv_per_token[name] = kv
    print(f"{name:<12}{head_dim:>9}{kv / KiB:>8.0f} KiB{2048 * kv / GiB:>16.2f} GiB{budget // kv:>18,}")
""")

md(r"""
OPT-13B needs **800 KiB per token**: the vLLM paper's "800 KB" (§3) is OPT-13B's figure.
Llama-2-13B has the same shape where it matters (40 layers, 40 KV heads of 128), so it
costs the same 800 KiB; that is a coincidence of shapes, not the paper's model. A single request at
OPT's full 2048-token context holds 1.6 GB (1.56 GiB) of KV, so a 40 GB A100 that keeps 26 GB for the
weights has room for only a handful of such requests. GQA is one answer (Llama-3-8B: 128 KiB);
wasting less of the memory we do have is the other, and the subject of this course.

The simulator's cost model (`minipaged.sim.cost_model`) carries the same formula; the two
must agree:
""")

code(r"""
assert OPT_13B.kv_bytes_per_token == kv_per_token["OPT-13B"] == 800 * KiB
print("OPT_13B.kv_bytes_per_token =", OPT_13B.kv_bytes_per_token, "bytes")
""")

md(r"""
## 3. Why cache at all: the FLOPs

Without a cache, every new token needs a forward pass over the *whole* sequence so far, to
rebuild every layer's K and V. With a cache, each step runs the model on one token and only
*reads* the old K/V. Count the FLOPs of generating a ShareGPT-sized answer (338 tokens after
a 161-token prompt) on OPT-13B, with the cost model's FLOP count
(`2 × parameters` per token through the linear layers, plus `4 × layers × heads × head_dim`
per (query, key) pair in attention):
""")

code(r"""
cost = CostModel(OPT_13B)
prompt_len, output_len = 161, 338

no_cache = with_cache = 0.0
for t in range(output_len):  # step t produces output token t
    seq = prompt_len + t  # tokens before the one being produced
    if t == 0:
        with_cache += cost.breakdown([(prompt_len, 0)]).flops  # the prefill, computed once
    else:
        with_cache += cost.breakdown([(1, seq - 1)]).flops  # 1 new token, seq-1 cached
    no_cache += cost.breakdown([(seq, 0)]).flops  # recompute the whole sequence

print(f"no KV cache  : {no_cache / 1e12:8,.0f} TFLOP")
print(f"with KV cache: {with_cache / 1e12:8,.0f} TFLOP")
print(f"recomputation costs {no_cache / with_cache:.0f}x more")
print(f"the cache for this request: {(prompt_len + output_len) * OPT_13B.kv_bytes_per_token / GiB:.2f} GiB")
""")

md(r"""
Recomputing is hundreds of times more work, and it grows with the square of the length.
Every serving system therefore caches, and trades **memory** for compute. The question is
how well it uses that memory.

## 4. Why contiguous reservation wastes memory

Before vLLM, serving systems stored each request's KV cache in **one contiguous region**,
reserved at admission. The output length is unknown then, so the region is sized for a
worst case. Orca itself is not public: the paper compares against **its own
re-implementations of Orca**, three of them, which differ only in how much they reserve.
`minipaged.core.kv.contiguous.ContiguousAllocator` implements those three baselines over a
linear address space with first-fit placement:

| policy | reserves for a request of final length F | knows |
|---|---|---|
| Orca (Max) | `max_model_len` | nothing |
| Orca (Pow2) | the next power of two ≥ F | F within 2x |
| Orca (Oracle) | exactly F | F exactly (impossible in practice) |

**Contract card · contiguous reservation** (`minipaged.core.kv.contiguous.ContiguousAllocator`;
the paper's Orca baselines, §6.1; no vLLM counterpart)

| | |
|---|---|
| **inputs** | a pool of `num_slots` token slots in one address space, `max_model_len`, a policy (`max`, `pow2`, `oracle`); per request: its tokens now and its final length |
| **outputs** | `allocate` -> one region `[start, start + size)` with `size = reservation_size(final_len)` (first-fit), or `None` if no hole is large enough; `free` returns the region to the holes |
| **invariants** | regions and holes never overlap and together cover the pool; adjacent holes are merged; a region's tokens never exceed its `final_len`, nor its `final_len` its size; nothing moves once placed |
| **failure modes** | no hole large enough -> `None`, nothing changed (the request waits: head-of-line blocking); a request longer than `max_model_len` or larger than the pool -> `ValueError`; the silent one: free slots the next request cannot use (external fragmentation) |
| **hand-check** | the next two cells: a pool of 32 slots drawn one character per slot |

Every reserved slot not holding a token is waste of one of three kinds:
**reserved** for tokens the request will write later, **internal fragmentation** (reserved,
never used), and **external fragmentation** (free slots in holes too small for the next
request, though together they would be enough).

A tiny pool of 32 slots (one character per slot: upper case = holds a token, lower case =
reserved for a future token, `-` = internal fragmentation, `.` = free):
""")

code(r"""
def strip(alloc):
    # One character per slot of the pool (display only).
    row = ["."] * alloc.num_slots
    for rid, r in alloc.regions.items():
        for i in range(r.size):
            row[r.start + i] = rid if i < r.num_tokens else rid.lower() if i < r.final_len else "-"
    return "".join(row)


orca_max = ContiguousAllocator(num_slots=32, max_model_len=16, policy="max")
orca_max.allocate("A", 3, 6)  # prompt of 3 tokens, will end at 6
orca_max.allocate("B", 2, 4)
print("Orca (Max):", strip(orca_max))
print("C (prompt 2, final 5) admitted?", orca_max.allocate("C", 2, 5) is not None)
u = orca_max.usage()
print(f"tokens {u.num_token_slots}, reserved {u.num_future_slots}, internal fragmentation "
      f"{u.internal_fragmentation}, free {u.num_free_slots} of {u.num_slots} slots")
""")

md(r"""
Five tokens occupy the whole pool: C must wait although 27 slots hold nothing. Knowing the
exact final length (Oracle) removes internal fragmentation, but regions of different sizes
come and go, and the free space breaks into holes:
""")

code(r"""
oracle = ContiguousAllocator(num_slots=32, max_model_len=16, policy="oracle")
oracle.allocate("A", 4, 10)
oracle.allocate("B", 3, 8)
oracle.allocate("C", 5, 10)
print("Oracle, 3 running:", strip(oracle))
oracle.free("B")  # B finished
print("B finished       :", strip(oracle), " holes (start, size):", oracle.get_holes())
print("D (final 12) admitted?", oracle.allocate("D", 5, 12) is not None)
print("free slots:", oracle.get_num_free_slots(),
      "| external fragmentation for D:", oracle.external_fragmentation(12))
""")

md(r"""
Twelve slots are free and D needs twelve, but no single hole holds them: all twelve are
external fragmentation. Only moving live KV data (compaction) would let D in.

## 5. The experiment: where the memory goes (the paper's Figure 2)

`minipaged.sim.memory_waste` replays one seeded workload through the **same KV budget**
under paged allocation (`KVCacheManager`, blocks of 16 tokens) and the three contiguous
policies. The setting is the paper's: OPT-13B on a 40 GB A100, about 12 GiB of KV, that is
15,728 token slots (983 blocks of 16), and `max_model_len = 2048`. The ShareGPT-like
workload has the paper's mean lengths: 161 prompt and 338 output tokens.

All requests wait at step 0 and are admitted first-come-first-served while memory allows.
Each step every running request grows by one token; finished requests free their memory;
when paged allocation runs out of blocks it preempts the latest request (its blocks are
freed and it is recomputed later). The shares are averaged over the steps in which requests
are waiting for memory, when waste costs throughput.
""")

code(r"""
print({name: (d.mean_prompt_len, d.mean_output_len) for name, d in WORKLOADS.items()})
result = run_memory_experiment("sharegpt", num_requests=1000, seed=0)
print(format_table(result))
""")

code(r"""
fig = plot_memory_waste(result)
plt.show()
plt.close(fig)
""")

md(r"""
### The paper's four numbers beside ours

The paper's Fig. 2 gives one number per system: the share of KV memory that holds token
states, averaged over its §6.2 serving runs of OPT-13B on ShareGPT. Beside it, this
replay's share:
""")

code(r"""
PAPER_FIG2 = {"paged": 96.3, "max": 20.4, "pow2": 26.8, "oracle": 38.2}  # % token states, vLLM paper Fig. 2
print(f"{'system':<15}{'paper':>8}{'here':>8}")
for policy, paper in PAPER_FIG2.items():
    s = result.policies[policy]
    print(f"{s.name:<15}{paper:>7.1f}%{s.token_states:>8.1%}")
paged, orca_max = result.policies["paged"], result.policies["max"]
assert paged.token_states >= 0.96 and orca_max.token_states <= 0.40
print(f"so paged runs up to {paged.peak_running} requests at once, Orca (Max) {orca_max.peak_running}")
print(f"what paged paid: {paged.num_preemptions:,} recompute preemptions for {result.num_requests:,} requests")
""")

md(r"""
Paged and Orca (Max) agree with the paper within about a point. Orca (Pow2) and Orca
(Oracle) come out **higher** here, for two reasons we know of:

- **how full memory is.** This replay has no arrival process: all 1,000 requests wait from
  step 0, and only steps with a queue are averaged, so every policy's memory is as full as
  its placement allows. The paper averages over its serving runs, where requests arrive
  over time, and its Fig. 2 counts slots that sit free as waste ("external fragmentation &
  others"). Our Pow2 and Oracle rows are therefore those systems' best case: memory as
  full as first-fit placement can make it.
- **what Pow2 rounds.** The paper's Pow2 over-reserves the *output* by at most 2×; ours
  rounds the *whole* final length (prompt + output) up to a power of two, which wastes
  less on ShareGPT's lengths.

Neither changes the order, or the gap between paged and everything else.

**What paged paid for its share.** The replay admits greedily (no spare blocks kept, unlike
vLLM's watermark), so when a running request needs a block and none is free, the latest
arrival is preempted: its blocks are freed and its whole KV (prompt and output so far) is
recomputed later. That happened nearly twice per request on average (the count above).
A memory share is not free: chapter 05 measures what recompute costs and how admission
limits it.
""")

md(r"""
Read the bars from left to right:

- **Paged**: almost every slot holds a token. The only waste is the unfilled tail of each
  request's last block (fewer than 16 slots per request) and a few blocks too few for the
  next request.
- **Orca (Max)**: every request holds 2048 slots for a few hundred tokens; most of its region
  is internal fragmentation, and 7 requests fill the whole pool.
- **Orca (Pow2)** and **Orca (Oracle)** waste less inside the region but still reserve for the
  future, and their mixed region sizes fragment the free space.

Even an oracle that knows every output length in advance leaves about half the memory
without a token in it. Short requests make it worse for Max and better for paging; the
Alpaca-like workload (19 prompt / 58 output tokens):
""")

code(r"""
print(format_table(run_memory_experiment("alpaca", num_requests=1000, seed=0)))
""")

md(r"""
With short requests the partly filled last block weighs more (a 16-slot block for a
request of ~50 tokens), so paged drops to about 89% holding tokens, while Orca (Max) reserves
2048 slots for ~80 tokens and keeps only a few per cent of its memory in use.

## 6. Code tour

The contiguous allocator's `allocate`: a first-fit search over the holes, all or nothing.
""")

code(r"""
print(inspect.getsource(ContiguousAllocator.allocate))
""")

md("And the definition of external fragmentation that the experiment uses:")

code(r"""
print(inspect.getsource(ContiguousAllocator.external_fragmentation))
""")

md(r"""
## 6. Fewer bytes per token: a quantized KV cache

Everything above multiplies by *bytes per number*. vLLM's most-used lever on the KV budget after
paging is to make that number smaller: `LLM(kv_cache_dtype="fp8")` (or `"fp8_e4m3"`, the same
thing in vLLM's names) stores every key and value in one byte, `"int8"` too; `"auto"` keeps the
model's dtype. Each layer keeps two scales, `k_scale` and `v_scale`:

$$\text{stored} = \text{round}\!\left(\frac{x}{\text{scale}}\right), \qquad \text{read back} = \text{stored} \times \text{scale}, \qquad \text{scale} = \frac{\max |x|}{\text{top level}}$$

with top level 127 for int8 (uniform steps) and 448 for e4m3 FP8 (3 mantissa bits: steps
relative to the value). `reshape_and_cache` quantizes as it writes; every attention backend
(the torch reference, the tuned torch backend, Triton, the C kernel) dequantizes as it reads,
and the attention arithmetic runs in the model's dtype. **FP8 here is a memory format, not FP8
matmuls**: in this package no tensor core ever multiplies FP8 numbers; the win is bytes, the
cost is rounding. (vLLM v1 on Hopper can do more: its FlashAttention-3 backend quantizes the
query to fp8 and runs the attention matmuls on the fp8 K/V directly.)
The scales are per tensor (one per layer for K, one for V), as vLLM's are, so the cache stays one
plain tensor that block copies, swaps and prefix caching move as bytes. They are calibrated once,
on a fixed text, when the cache is allocated (`PagedCausalLM.calibrate_kv_scales`).

A hand-check on one block of four tokens (one KV head of dimension 2):
""")

code(r"""
from minipaged.kernels import reshape_and_cache
from minipaged.kernels.quant import dequantize, scale_for

block = torch.tensor([[0.50, -1.20], [0.03, 0.90], [-0.44, 0.25], [1.27, -0.61]])  # 4 tokens x dim 2
x = block.view(4, 1, 2)  # [tokens, kv heads, head_dim]
for dtype in (torch.int8, torch.float8_e4m3fn):
    scale = scale_for(x.abs().max(), dtype)  # max |x| = 1.27 -> the top level
    # by hand: divide, then round half up onto the integers (int8) or to the nearest e4m3 number (fp8)
    by_hand = torch.floor(x / scale + 0.5) if dtype == torch.int8 else (x / scale).to(dtype).float()
    cache = torch.zeros(1, 4, 1, 2, dtype=dtype)  # one block of 4 slots
    reshape_and_cache(x, x, cache, cache.clone(), torch.arange(4), k_scale=scale, v_scale=scale)
    stored = cache.view(4, 2).float()
    back = dequantize(cache, scale).view(4, 2)
    print(f"{str(dtype):<20} scale = 1.27 / {1.27 / scale:.0f} = {scale:.5f}")
    print("  stored:   ", stored.tolist(), "| by hand equal:", torch.equal(stored, by_hand.view(4, 2)))
    print("  read back:", [[round(v, 4) for v in row] for row in back.tolist()])
    print("  max error:", f"{(back - block).abs().max():.4f}", f"(int8: at most scale / 2 = {scale / 2:.4f})" if dtype == torch.int8 else "(fp8: at most 1/16 of the value)")
""")

md(r"""
int8 spends its 255 levels evenly: 0.03 becomes level 3, and every value is within half a step
(0.005) of where it started. e4m3 keeps about two significant digits of *every* value, small or
large: 0.03 / 0.002835 = 10.6 is stored as 11 (steps of 1 between 8 and 16), 1.20 / 0.002835 =
423.3 as 416 (steps of 32 between 256 and 448). One outlier in a layer sets the step of every int8 value in it; FP8 minds less.

Bytes per token of the configs of section 2, per KV format (`minipaged.config.kv_cache_bytes_per_block`,
the one function the engine sizes its pool with):
""")

code(r"""
from minipaged.config import kv_cache_bytes_per_block

formats = {"fp32": ("float32", "auto"), "bf16": ("bfloat16", "auto"), "fp8": ("bfloat16", "fp8"), "int8": ("bfloat16", "int8")}
print(f"{'model':<12}" + "".join(f"{f + ' KV/token':>15}" for f in formats) + f"{'fp8 tokens in 12 GiB':>22}")
for name, c in configs.items():
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    per_token = {f: kv_cache_bytes_per_block(c["num_hidden_layers"], 1, c["num_key_value_heads"], head_dim, dt, kd)
                 for f, (dt, kd) in formats.items()}
    print(f"{name:<12}" + "".join(f"{per_token[f] / KiB:>11.0f} KiB" for f in formats) + f"{budget // per_token['fp8']:>22,}")
""")

md(r"""
### The same KV budget in fp32, bf16 and fp8

Now the course model serves the course workload (ShareGPT lengths scaled to a 96-token
context, 16 requests, fixed output lengths) with **the same KV budget** in each format, 192 KiB.
In fp32 a token costs 2 KiB (K and V x 4 layers x 2 KV heads x 32 dims x 4 bytes), so the budget
holds 96 tokens in fp32, 192 in bf16 and 384 in fp8. The columns are counts from the engine's trace, the same on every machine;
`benchmarks/kv_cache_dtype.py` adds wall-clock tokens / s.
""")

code(r"""
from minipaged.bench.kv_quant import same_budget

torch.set_num_threads(1)  # the counts below do not depend on it; a shared machine runs faster so
settings = [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8")]
rows = same_budget(192 * KiB, settings, num_requests=16, max_model_len=96)
print(f"{'format':<7}{'B/token':>8}{'blocks':>7}{'tokens':>7}{'peak seqs':>10}{'mean seqs':>10}{'preempted':>10}{'steps':>6}{'tok/step':>9}")
for r in rows:
    fmt = "fp8" if r["kv_cache_dtype"] == "fp8" else {"float32": "fp32", "bfloat16": "bf16"}[r["dtype"]]
    print(f"{fmt:<7}{r['bytes_per_token']:>8}{r['num_blocks']:>7}{r['tokens_in_budget']:>7}{r['peak_running']:>10}"
          f"{r['mean_running']:>10.1f}{r['preemptions']:>10}{r['steps']:>6}{r['tokens_per_step']:>9.1f}")
""")

md(r"""
Four times the blocks of fp32 (twice bf16's) means more sequences in every step's batch, fewer
recompute preemptions and fewer steps for the same work: the paper's argument (memory decides
the batch) with the bytes per token halved instead of the waste.

### What it costs: accuracy

The price is rounding. Measured on the course model (fp32 weights): greedy tokens against
transformers' (a plain argmax loop with no cache at all) over prompts taken from held-out stories of
the model's own corpus generator (a seed the training never used), and the perplexity of held-out
stories, each read in one prefill through a paged cache of that format (a prefill reads its own
keys back from the cache, so the rounding is in every logit but the first).
""")

code(r"""
from minipaged import LLM
from minipaged.bench.kv_quant import greedy_agreement, held_out_stories, hf_greedy, perplexity
from minipaged.model import COURSE_MODEL_DIR, load_model

model, tok = load_model()
stories = held_out_stories(18)
texts = [tok(s)["input_ids"] for s in stories[:10]]
prompts = [tok(s)["input_ids"][:8] for s in stories[10:]]
reference = hf_greedy(COURSE_MODEL_DIR, prompts, 16)
print(f"{len(prompts)} prompts x 16 greedy tokens; perplexity of {len(texts)} held-out stories ({sum(map(len, texts))} tokens)")
print(f"{'kv_cache_dtype':<15}{'identical tokens':>17}{'first divergence':>18}{'perplexity':>11}")
for kd in ("auto", "fp8", "int8"):
    agree = greedy_agreement(LLM(kv_cache_dtype=kd), prompts, reference)
    first = [f for f in agree["first_divergence"] if f is not None]
    print(f"{kd:<15}{agree['identical']:>17.1%}{(', '.join(map(str, first)) or 'none'):>18}{perplexity(model, texts, kd):>11.4f}")
""")

md(r"""
On this model the 8-bit caches cost almost nothing: the perplexity moves by less than 0.001
and the greedy tokens follow transformers' as closely as the fp32 cache does. That is a property
of *this* model (small, low-entropy stories, no outlier channels), not a law: real checkpoints
have keys with a few large channels, which is why vLLM reads calibrated scales from the checkpoint
and why int8 with one scale per tensor is the riskier of the two. `tests/kernels/test_kv_cache_dtype.py`
states the per-layer error on random inputs (max |error| of the attention output <= 0.05 for int8,
<= 0.1 for fp8) and holds every backend to the dequantized reference at 1e-5.
""")

md(r"""
## Recap

- The KV cache holds, per layer, a K and a V vector per KV head for every token; causal
  attention makes them immutable, so caching them is exact.
- KV bytes per token = `2 × layers × kv_heads × head_dim × dtype bytes`: 800 KiB for
  OPT-13B, 512 KiB for Llama-2-7B, 128 KiB for Llama-3-8B (GQA).
- Caching saves a factor of hundreds in FLOPs for a ShareGPT-sized request; the price is memory.
- Reserving one contiguous region per request wastes that memory three ways: reservation
  for future tokens, internal fragmentation, external fragmentation. Measured here, Orca
  (Max) keeps about 21% of KV memory holding tokens, paged allocation about 97% (the paper:
  20.4% and 96.3%); paging paid for it in recompute preemptions.
- A quantized KV cache (`kv_cache_dtype="fp8"` or `"int8"`) stores a token in a quarter of
  fp32's bytes: four times the blocks for the same budget, more sequences per step; here FP8 is
  only the storage format (every backend dequantizes on read and attends in the model's dtype);
  vLLM's FlashAttention-3 path on Hopper goes further and runs attention itself on the fp8 K/V,
  with the query quantized to fp8 too. On the course model it costs almost no accuracy.

**Next**: chapter 02 opens the paged allocator: blocks, block tables, and slot mapping.
""")

md(r"""
## Readings

* **The paper** (Kwon et al., SOSP 2023): §2.1–2.2 (K and V, the prompt phase and the
  generation phase); §3 Memory Challenges in LLM Serving (OPT-13B's 800 KB per token) and
  §3.1 Memory Management in Existing Systems (reservation, internal and external
  fragmentation); Fig. 2, measured in the §6.2 runs.
* The Orca baselines (Max, Pow2, Oracle) are the paper's own re-implementations: §6.1
  Experimental Setup. No vLLM file: `minipaged/core/kv/contiguous.py`,
  `minipaged/sim/memory_waste.py`.
* Bytes per block in vLLM v1: `vllm/v1/kv_cache_interface.py` (`AttentionSpec.page_size_bytes`);
  how many blocks fit: `vllm/v1/core/kv_cache_utils.py` (`check_enough_kv_cache_memory`) ↔
  `minipaged/sim/cost_model.py`.
* The cache tensors themselves: v1 `vllm/v1/worker/gpu_model_runner.py`
  (`initialize_kv_cache`); the paper's v0.2 `vllm/worker/cache_engine.py` ↔
  `minipaged/worker/model_runner.py` (`allocate_kv_caches` in `minipaged/model/layers.py`).
""")

write("01_kv_cache")
