"""Generate notebooks/03_paged_attention.ipynb (run from the repo root, then execute it).

python notebooks/_build/03_paged_attention.py
jupyter nbconvert --to notebook --execute --inplace notebooks/03_paged_attention.ipynb
"""

from _nb import code, md, write

md(r"""
# 03 · PagedAttention: attention through a block table

Chapter 02 cut the KV cache into fixed-size **blocks** and gave every request a **block
table** that maps its logical blocks to physical blocks anywhere in the pool. That solves the
memory problem, but it leaves the attention layer with a new job: a request's keys and
values are no longer one contiguous tensor. This chapter is about the kernel that does
attention anyway, reading K/V *through* the block table. That is the "attention" half of
PagedAttention.

**You will learn**

1. decode attention on a contiguous cache, checked by hand on a tiny example;
2. the same attention when the tokens sit in scattered blocks: the slot formula, by hand;
3. what vLLM's original CUDA kernel does (the logits row in shared memory, a softmax in
   several passes), and the course's Triton decode kernel (one program per sequence and KV
   head, an *online softmax* over tiles of tokens), checked against both;
4. how the split-KV kernel (the **PagedAttention V2 kernel**) spreads one long context over
   many programs and merges them;
5. prefill over a cached prefix: what chunked prefill and prefix caching need;
6. what PagedAttention addresses and what FlashAttention addresses: two different things.

*Names.* "V1" and "V2" in this chapter are **kernels**: vLLM's `paged_attention_v1.cu` (the
paper's kernel) and `paged_attention_v2.cu` (split-KV). They are unrelated to **vLLM V1**,
the engine rewrite of 2025 that later chapters call "vLLM v1" (and the paper's engine,
"v0"). This chapter always says "V1 kernel" / "V2 kernel".
""")

md("## Setup")

code(r"""
import inspect
import json
import math
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minipaged
import minipaged.kernels.paged_attention as pa
from minipaged.kernels import (
    contiguous_attention,
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    paged_attention_ref,
    paged_attention_torch,
    reshape_and_cache,
)

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)
# On a machine without CUDA, importing minipaged.kernels switched Triton to its interpreter
# (TRITON_INTERPRET=1): the kernels run as NumPy code, slowly but exactly, on tiny shapes.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(minipaged.__file__).resolve().parents[1]  # benchmarks/ lives next to the package


# Exercises ex3.2-ex3.4 ask for the reference, the kernel's loop and the partition merge, so
# the code tours show contracts: the signature and docstring (for a kernel, its commented
# arguments and pseudocode). The bodies are in notebooks/99_instructor_appendix.ipynb.
from minipaged.viz.source import contract
""")

md(r"""
## 1. Decode attention on a contiguous cache

At a decode step each sequence has exactly **one** new token. Its query $q$ attends to the
keys and values of all $L$ tokens so far (the new one included, already written to the cache):

$$o = \sum_{i < L} p_i\, v_i, \qquad p = \mathrm{softmax}\!\left(\frac{q K^\top}{\sqrt{d}}\right).$$

A tiny example: one sequence of 6 tokens, 2 query heads that share 1 KV head (grouped-query
attention, GQA), head size 4. Small integers so the scores can be checked by eye.
""")

code(r"""
L, num_heads, num_kv_heads, head_dim = 6, 2, 1, 4
k = torch.randint(-2, 3, (L, num_kv_heads, head_dim)).float()  # [L, KVH, D]
v = torch.randint(-2, 3, (L, num_kv_heads, head_dim)).float()  # [L, KVH, D]
q = torch.randint(-2, 3, (1, num_heads, head_dim)).float()  # [1, H, D]: the new token

scores = (k[:, 0] @ q[0, 0]) / math.sqrt(head_dim)  # head 0 uses kv head 0 // (2 // 1) = 0
p = torch.softmax(scores, dim=0)
print("keys of head 0:\n", k[:, 0])
print("q (head 0)    :", q[0, 0])
print("scores q.k/2  :", scores)
print("softmax       :", p)
print("output head 0 :", p @ v[:, 0])
out_contig = contiguous_attention(q, k, v, causal=False)  # [1, H, D]
print("contiguous_attention, head 0:", out_contig[0, 0])
""")

md(r"""
## 2. The same tokens, scattered in blocks

Now put those 6 tokens into a paged cache with `block_size = 2`. The cache of one layer is
`[num_blocks, block_size, num_kv_heads, head_dim]`; the sequence's block table is
`[5, 1, 6]`: logical block 0 (tokens 0, 1) is physical block 5, logical block 1 (tokens 2, 3)
is block 1, logical block 2 is block 6. Token $i$ lives at

$$\text{slot}(i) = \text{block\_table}[i \,/\!/\, \text{block\_size}] \cdot \text{block\_size} + i \bmod \text{block\_size}.$$

`reshape_and_cache` is the op the model calls every step to write new K/V at their slots.
""")

code(r"""
block_size, num_blocks = 2, 8
k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)  # [N, bs, KVH, D]
v_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
block_table = torch.tensor([5, 1, 6], dtype=torch.int32)
slot_mapping = torch.tensor([int(block_table[i // block_size]) * block_size + i % block_size for i in range(L)])
print("slot_mapping:", slot_mapping.tolist())
reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
print("which physical blocks hold data:", [b for b in range(num_blocks) if k_cache[b].abs().sum() > 0])
""")

code(r"""
fig, ax = plt.subplots(figsize=(6, 1.6))
grid = torch.full((block_size, num_blocks), float("nan"))
for i, slot in enumerate(slot_mapping.tolist()):
    grid[slot % block_size, slot // block_size] = i
ax.imshow(grid, cmap="viridis", vmin=0, vmax=L)
for i, slot in enumerate(slot_mapping.tolist()):
    ax.text(slot // block_size, slot % block_size, f"t{i}", ha="center", va="center", color="white")
ax.set_xticks(range(num_blocks))
ax.set_xlabel("physical block")
ax.set_yticks(range(block_size))
ax.set_ylabel("slot")
ax.set_title("tokens t0..t5 of one sequence in a paged cache (block table [5, 1, 6])")
plt.show()
plt.close(fig)
""")

md(r"""
By hand: read each token back through the block table, then attend exactly as before.
The answer cannot depend on *where* the blocks are, only on which tokens they hold.
""")

code(r"""
k_gathered = torch.stack([k_cache[block_table[i // block_size], i % block_size] for i in range(L)])  # [L, KVH, D]
v_gathered = torch.stack([v_cache[block_table[i // block_size], i % block_size] for i in range(L)])
print("gathered K equals the contiguous K:", torch.equal(k_gathered, k))
by_hand = contiguous_attention(q, k_gathered, v_gathered, causal=False)
seq_lens = torch.tensor([L], dtype=torch.int32)
out_ref = paged_attention_ref(q, k_cache, v_cache, block_table[None], seq_lens)
print("by hand            :", by_hand[0, 0])
print("paged_attention_ref:", out_ref[0, 0])
print("same as contiguous :", torch.allclose(out_ref, out_contig, atol=1e-6))
""")

md(r"""
### Code tour: the reference

`paged_attention_ref` is the readable version every kernel is graded against: for each
sequence, gather its tokens through the block table, then plain softmax attention. Writing
it is exercise ex3.2, so here is its contract (the body is in the instructor's appendix):
""")

code(r"""
print(contract(paged_attention_ref))
""")

md(r"""
## 3. The decode kernel

A GPU cannot afford the gather: it would copy every sequence's K/V into a new tensor at every
step of every layer. A paged kernel instead computes attention **while** it walks the block
table.

**Contract card · paged decode attention** (`minipaged.kernels.paged_attention_decode`;
vLLM `csrc/attention/paged_attention_v1.cu`, `paged_attention_v2.cu`)

| | |
|---|---|
| **inputs** | `q [num_seqs, num_heads, head_dim]` (one new token per sequence); `k_cache`, `v_cache [num_blocks, block_size, num_kv_heads, head_dim]`; `block_tables [num_seqs, max_blocks]` int32; `seq_lens [num_seqs]` int32 (the new token's K/V already written) |
| **outputs** | `[num_seqs, num_heads, head_dim]`: for each sequence and head, softmax attention over its `seq_lens[b]` tokens |
| **invariants** | token `n` of sequence `b` is read from `cache[block_tables[b, n // block_size], n % block_size]`; entries of `block_tables` past `ceil(seq_len / block_size)` are never read; query head `h` reads KV head `h // (num_heads // num_kv_heads)`; the result does not depend on which physical blocks hold the tokens; scores and sums in fp32 |
| **failure modes** | wrong shapes, dtypes or devices, block ids outside the cache (checked on CPU) -> `ValueError` naming the argument; a block table that points at the wrong blocks gives *wrong numbers, no error*: that is what the hand-checks and tests guard |
| **hand-check** | the cells below run the kernel on the 6 tokens of section 2 and compare it with the contiguous and by-hand results; then a batch in a shuffled pool for every block size |

### What vLLM's original kernel does

The paper's CUDA kernel (the **PagedAttention V1 kernel**) runs one thread block per
*query* head and sequence (`dim3 grid(num_heads, num_seqs)` in `paged_attention_v1.cu`).
It does *not* use an online softmax. It makes several passes over the
sequence:

1. walk the block table block by block, compute every score $q \cdot k_i$ and write it to a
   **logits row in shared memory**, one fp32 number per token of the context;
2. reduce that row to its max $m$ (a block-wide reduction);
3. replace each logit by $e^{s_i - m}$ and reduce the row to its sum $\ell$;
4. walk the blocks again, reading V, and accumulate $\sum_i (e^{s_i - m} / \ell)\, v_i$.

That is exact and simple, but the row grows with the context: 4 bytes per token, so a
32k-token context needs 128 KiB of shared memory for one thread block. That is more than
the 48 KiB a thread block gets without asking, so vLLM's launcher asks: it sets the
kernel's `cudaFuncAttributeMaxDynamicSharedMemorySize` to the row's size. The real limit
is the device's opt-in maximum per thread block (`cudaDevAttrMaxSharedMemoryPerBlockOptin`):
163 KiB on an A100, 227 KiB on an H100, so a 32k row fits on both, and the V1 kernel's
ceiling is about 41k tokens on an A100 and 58k on an H100 (vLLM's kernel tests derive
their `MAX_SEQ_LEN` from that attribute the same way). vLLM does not go near it: it runs
the V1 kernel only when `max_seq_len <= 8192` and either one partition suffices or
`num_seqs * num_heads > 512` (`use_v1` in vLLM's `paged_attn.py`), the V2 kernel otherwise.
The **PagedAttention V2 kernel** (section 4) partitions the sequence into 512-token
pieces: each thread block's logits row is then bounded by the partition size (2 KiB), and
the partitions of one long sequence run in parallel, which also fills the GPU when there
are few sequences. A reduce kernel merges the pieces.

The same four passes in torch, on the scores of section 1 (`logits` plays the shared-memory
row):
""")

code(r"""
logits = scores.clone()  # pass 1: the whole row of scores, one per token
m_row = logits.max()  # pass 2: the row's max
e = torch.exp(logits - m_row)  # pass 3: exponentiate and sum
l_row = e.sum()
out_multipass = (e / l_row) @ v[:, 0]  # pass 4: weighted sum of V
print("multi-pass (V1 kernel style):", out_multipass)
print("one-shot softmax            :", p @ v[:, 0])
OPT_IN_KIB = {"A100": 163, "H100": 227}  # cudaDevAttrMaxSharedMemoryPerBlockOptin, KiB
for L_ctx in (2048, 8192, 32768, 65536):
    row = 4 * L_ctx // 1024
    fits = ", ".join(f"{gpu} {'fits' if row <= kib else 'too big'}" for gpu, kib in OPT_IN_KIB.items())
    print(f"logits row for a {L_ctx:>5}-token context: {row:>3} KiB of shared memory ({fits}; "
          f"V2 kernel, 512-token partitions: 2 KiB)")
""")

md(r"""
### The same passes on your CPU: the `"cpu"` backend

`minipaged/kernels/csrc/paged_attention_cpu.c` is this V1 structure in C, for a CPU (vLLM's
CPU backend, `csrc/cpu/attention.cpp`, is the same idea). One loop per
sequence walks the block table block by block and writes every logit of every head into a
buffer (the shared-memory row), then max, exp and sum, normalise, and a second walk over the
blocks reads V. Keys and values are read **in place**: no gather, no copy. The torch backend
cannot do that (torch has no op that reads through an index while it multiplies), so on a
CPU it gathers every block first and pays a dozen small ops per layer;
`LLM(attention_backend="cpu")` (or `"auto"`, which picks it on a CPU) runs this kernel instead.
It is compiled on first use with the machine's C compiler and checked here against the
reference, on the six tokens of section 2 and on a shuffled batch. Its listing, its GQA
refinement and the small layers the same backend runs in C (RMSNorm with its fused residual
add, RoPE, SiLU-and-mul) are in the appendix `notebooks/03a_cpu_backend.ipynb`: this
chapter is about attention through a block table.
""")

code(r"""
from minipaged.kernels import cpu as cpu_kernels

if cpu_kernels.available():
    out_c = cpu_kernels.paged_attention_decode_cpu(q, k_cache, v_cache, block_table[None], seq_lens)
    print("C kernel, head 0             :", out_c[0, 0])
    print("matches paged_attention_ref  :", torch.allclose(out_c, out_ref, atol=1e-5))
    g = torch.Generator().manual_seed(3)
    kc8 = torch.randn(40, 16, 2, 32, generator=g)
    vc8 = torch.randn(40, 16, 2, 32, generator=g)
    bt8 = torch.randperm(40, generator=g)[:32].view(4, 8).int()
    sl8 = torch.tensor([1, 16, 17, 100], dtype=torch.int32)
    q8 = torch.randn(4, 8, 32, generator=g)
    diff = (cpu_kernels.paged_attention_decode_cpu(q8, kc8, vc8, bt8, sl8) - paged_attention_ref(q8, kc8, vc8, bt8, sl8))
    print("shuffled batch of 4, GQA 8/2 (four query heads per key row):", bool(diff.abs().max() < 1e-5))
else:
    print("no C compiler here:", cpu_kernels.build_error())
""")

md(r"""
### The course's Triton kernel: one pass, online softmax

The Triton kernel of this course follows the later, FlashAttention-style formulation
(as vLLM's Triton attention backend does): it walks the block table tile by tile and never
stores the score row:

- one *program* per (sequence, KV head); the query heads of the GQA group are the rows of one
  tile, so each K/V tile is loaded once per group;
- each iteration takes `BLOCK_N` token positions, looks up `block_table[n // block_size]` for
  each, loads the K tile, computes scores, then the V tile;
- the softmax is **online**: it keeps a running max $m$, running sum $\ell$ and running
  output, and rescales them by $e^{m_{old} - m_{new}}$ when a larger score appears. So one
  pass over the tokens suffices and the $1 \times L$ score row is never stored.

The online softmax first, in plain torch, on the scores of section 1 split into tiles of 4:
""")

code(r"""
m, l, acc = float("-inf"), 0.0, torch.zeros(head_dim)
for start in range(0, L, 4):
    s = scores[start : start + 4]  # this tile's scores
    m_new = max(m, s.max().item())
    alpha = math.exp(m - m_new)  # rescale what was accumulated under the old max
    p_tile = torch.exp(s - m_new)
    l = l * alpha + p_tile.sum().item()
    acc = acc * alpha + p_tile @ v[start : start + 4, 0]
    m = m_new
print("online softmax, 2 tiles:", acc / l)
print("one-shot softmax       :", p @ v[:, 0])
""")

md(r"""
The kernel's inner loop does exactly this, with `exp2` (scores are pre-multiplied by
$\log_2 e$) and on tiles of query rows. Its contract, each argument commented, and the
pseudocode of its docstring: the line marked "the paging" is the only difference from a
FlashAttention loop. Writing the loop is exercise ex3.3; the body is in the instructor's
appendix.
""")

code(r"""
print(contract(pa._attend_kv_range))
""")

code(r"""
q_d, kc_d, vc_d, bt_d, sl_d = (t.to(DEVICE) for t in (q, k_cache, v_cache, block_table[None], seq_lens))
out_kernel = paged_attention_decode(q_d, kc_d, vc_d, bt_d, sl_d, use_v2=False).cpu()
print("Triton decode kernel, head 0:", out_kernel[0, 0])
print("matches paged_attention_ref :", torch.allclose(out_kernel, out_ref, atol=1e-5))
print("matches contiguous          :", torch.allclose(out_kernel, out_contig, atol=1e-5))
""")

md(r"""
A bigger check: a batch of 4 sequences of lengths 1, 16, 17 and 100 (a length of one block,
one block + 1, and several tiles) in a shuffled pool, 8 query heads over 2 KV heads, head
size 80 (not a power of two: the kernel pads the tile to 128 and masks), for every block
size from 1 to 256.
""")

code(r"""
def random_paged(seq_lens, block_size, num_kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    kc = torch.randn(sum(need) + 2, block_size, num_kv_heads, head_dim, generator=g)
    vc = torch.randn(sum(need) + 2, block_size, num_kv_heads, head_dim, generator=g)
    ids = torch.randperm(sum(need) + 2, generator=g)
    bt = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        bt[b, :n], ids = ids[:n], ids[n:]
    return kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32)


lens = [1, 16, 17, 100]
q4 = torch.randn(4, 8, 80, generator=torch.Generator().manual_seed(1))
for bs in [1, 4, 16, 64, 256]:
    kc, vc, bt, sl = random_paged(lens, bs, 2, 80, seed=bs)
    want = paged_attention_ref(q4, kc, vc, bt, sl)
    got = paged_attention_decode(*(t.to(DEVICE) for t in (q4, kc, vc, bt, sl)), use_v2=False, block_n=16).cpu()
    print(f"block_size {bs:>3}: blocks per sequence {[-(-n // bs) for n in lens]}, "
          f"max |kernel - ref| < 1e-5: {bool((got - want).abs().max() < 1e-5)}")
""")

md(r"""
## 4. Split-KV: the PagedAttention V2 kernel

Without a partition axis, one thread block (or program) walks the *whole* context of its
sequence. vLLM's V1 kernel launches one per query head and sequence
(`grid(num_heads, num_seqs)`); the course's Triton kernel one per sequence and KV head, the
GQA group as the rows of its tile. With a batch of 1 and a 32k context on an H100's 132 SMs,
for a Llama-3-8B-shaped layer (32 query heads over 8 KV heads), that is 32 thread blocks, or
8 Triton programs, for 132 SMs: most of the chip idles while each streams 32k tokens. The V2
kernel cuts each context into **partitions** (512 tokens by default) and adds them to the
grid: vLLM's `grid(num_heads, num_seqs, max_num_partitions)`; the course's Triton kernel one
program per (sequence, KV head, partition). Each writes
its partition's normalized output $o_p$, its max $m_p$ and its exp-sum $\ell_p$; a **reduce**
kernel merges them with the same rescaling the online softmax uses:

$$o = \frac{\sum_p \ell_p\, e^{m_p - M}\, o_p}{\sum_p \ell_p\, e^{m_p - M}}, \qquad M = \max_p m_p .$$
""")

code(r"""
def grid_size(batch, heads, context, partition=512):
    # thread blocks (vLLM, heads = query heads) or programs (course Triton, heads = KV heads)
    return batch * heads, batch * heads * math.ceil(context / partition)

print("a Llama-3-8B-shaped layer: 32 query heads over 8 KV heads; an H100 has 132 SMs")
for batch, context in [(1, 32768), (8, 4096), (64, 4096)]:
    v1, v2 = grid_size(batch, 32, context)
    t1, t2 = grid_size(batch, 8, context)
    print(f"batch {batch:>2} x context {context:>5}: vLLM V1 kernel {v1:>5} thread blocks, V2 {v2:>6} | "
          f"course Triton {t1:>4} programs, split-KV {t2:>5}")
""")

md(r"""
The merge by hand, on one sequence of 50 tokens split into partitions of 16 (the reference
gives each partition's attention; the log-sum-exp bookkeeping is done here), then the V2
kernel with the same partition size:
""")

code(r"""
kc, vc, bt, sl = random_paged([50], 4, 1, 16, seed=7)
q1 = torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(8))
k_seq, v_seq = kc[bt[0].long()].reshape(-1, 1, 16)[:50], vc[bt[0].long()].reshape(-1, 1, 16)[:50]
partials = []
for start in range(0, 50, 16):
    s = (k_seq[start : start + 16, 0] @ q1[0, 0]) / 4.0  # scores in this partition
    m_p, l_p = s.max(), torch.exp(s - s.max()).sum()
    o_p = contiguous_attention(q1, k_seq[start : start + 16], v_seq[start : start + 16], causal=False)[0, 0]
    partials.append((m_p, l_p, o_p))
M = max(m_p for m_p, _, _ in partials)
w = [l_p * torch.exp(m_p - M) for m_p, l_p, _ in partials]
merged = sum(w_p * o_p for w_p, (_, _, o_p) in zip(w, partials)) / sum(w)
want = paged_attention_ref(q1, kc, vc, bt, sl)[0, 0]
v2 = paged_attention_decode(*(t.to(DEVICE) for t in (q1, kc, vc, bt, sl)), use_v2=True, partition_size=16, block_n=16)
print("partitions:", len(partials), "| merged by hand == reference:", torch.allclose(merged, want, atol=1e-5))
print("V2 kernel == reference:", torch.allclose(v2.cpu()[0, 0], want, atol=1e-5))
""")

md(r"""
`paged_attention_decode` picks the V2 kernel by itself when contexts are long (over 8192
tokens, vLLM's own threshold) or when the V1 kernel's grid would leave the GPU's SMs idle;
`use_v2=True/False` forces a path (the tests run both). The reduce kernel's contract (the
merge itself is exercise ex3.4):
""")

code(r"""
print(contract(pa._paged_attention_reduce_kernel))
""")

md(r"""
## 5. Prefill over a cached prefix

A prefill computes many query tokens at once, causally. With **chunked prefill** a long
prompt is processed in pieces, and with **prefix caching** the first blocks of a prompt may
already be in the cache from another request. Either way the queries are the *last* `q_len`
of a sequence's `seq_len` tokens, and query $j$ sees keys $0 .. (\text{seq\_len} - \text{q\_len} + j)$.
`paged_attention_prefill` takes a whole batch of such spans packed into one tensor, with
`cu_seqlens_q` marking where each sequence's rows start (decode rows are spans of 1).

Check: a 10-token sequence whose first 6 tokens are cached, queried for its last 4, must give
the last 4 rows of plain causal attention over all 10.
""")

code(r"""
kc, vc, bt, sl = random_paged([10, 3], 4, 2, 16, seed=11)
g = torch.Generator().manual_seed(12)
q_rows = torch.randn(4 + 1, 4, 16, generator=g)  # 4 rows of sequence 0, then 1 decode row of sequence 1
cu_seqlens_q = torch.tensor([0, 4, 5], dtype=torch.int32)
k10, v10 = kc[bt[0].long()].reshape(-1, 2, 16)[:10], vc[bt[0].long()].reshape(-1, 2, 16)[:10]
want = contiguous_attention(q_rows[:4], k10, v10, causal=True)  # queries at positions 6..9
got = paged_attention_prefill(*(t.to(DEVICE) for t in (q_rows, kc, vc, bt, cu_seqlens_q, sl))).cpu()
fast = paged_attention_torch(q_rows, kc, vc, bt, cu_seqlens_q, sl, max_query_len=4, max_seq_len=10)
print("Triton prefill == causal attention over all 10 tokens:", torch.allclose(got[:4], want, atol=1e-5))
print("decode row == paged_attention_ref:", torch.allclose(
    got[4:], paged_attention_ref(q_rows[4:], kc, vc, bt[1:], sl[1:]), atol=1e-5))
print("paged_attention_torch (the engine's default backend) agrees:",
      torch.allclose(fast, paged_attention_prefill_ref(q_rows, kc, vc, bt, cu_seqlens_q, sl), atol=1e-5))
""")

md(r"""
## 6. PagedAttention is not FlashAttention

Both Triton kernels above use an online softmax over tiles, which is FlashAttention's idea
(the paper's V1 kernel did not). It is
easy to conflate the two; they answer different questions.

| | PagedAttention (vLLM, 2023) | FlashAttention (Dao et al., 2022) |
|---|---|---|
| problem | *memory management*: KV caches of unknown final length fragment GPU memory | *IO inside one attention call*: the $T \times T$ score matrix costs HBM traffic |
| idea | store K/V in fixed-size blocks anywhere; a block table maps logical to physical blocks | tile Q, K, V into on-chip SRAM; online softmax so scores never reach HBM |
| what it changes | **where** K/V live and how they are **addressed** | **how** the attention arithmetic is scheduled |
| wins | batch size (less waste, sharing, copy-on-write) -> throughput | speed and memory of one attention call |
| without the other | the paper's V1 kernel: paged reads, the whole logits row in shared memory, a multi-pass softmax | contiguous K/V only (later versions added a paged KV cache) |

A kernel can do both, as modern ones (and this chapter's) do: the tile loop is FlashAttention,
the `block_table[n // block_size]` lookup inside it is PagedAttention. The price of paging is
the indirection: the vLLM paper measured its paged kernel 20-26% slower than FasterTransformer's
contiguous one (§7.1), and paid it many times over in batch size.

## 7. Experiment: the price of paging on a GPU

`benchmarks/attention_kernels.py` times the decode kernel against contiguous attention (torch SDPA, and
flash-attn where installed) over batch x context, and sweeps the block size 8..256 like the
paper's Fig. 18b (end-to-end latency; Fig. 18a is the kernel's latency). On a CPU it can only check correctness in the interpreter, so the cell below
only runs on a GPU (nbval skips it).
""")

code(r"""
# NBVAL_SKIP
import subprocess, sys
if torch.cuda.is_available():
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "attention_kernels.py"), "--quick", "--figure", ""], check=False)
else:
    print("no CUDA GPU: see benchmarks/attention_kernels.py for what it measures")
""")

md("Recorded GPU results, where a run was committed to `benchmarks/results/`:")

code(r"""
from minipaged.viz.gpu_results import price_of_paging_text

print(price_of_paging_text(REPO / "benchmarks" / "results"))
""")


md(r"""
On the CPU the interpreter can still show the *work* a block size implies: how many
block-table lookups and separate memory runs one decode step needs for a 4k context, and how
many slots the last, partly filled block wastes on average (chapter 02's trade-off).
""")

code(r"""
context = 4096
print(f"{'block_size':>10} {'blocks/seq':>10} {'contiguous run (bf16, 8x128)':>29} {'avg wasted slots':>17}")
for bs in [8, 16, 32, 64, 128, 256]:
    run_bytes = bs * 8 * 128 * 2  # one block of one layer's K: block_size tokens x 8 kv heads x 128 x 2 B
    print(f"{bs:>10} {context // bs:>10} {run_bytes // 1024:>26} KiB {(bs - 1) / 2:>17.1f}")
""")

md(r"""
Small blocks mean many short reads (poor memory-bandwidth use, and in the paper's kernel,
less parallelism per block); large blocks mean more internal fragmentation and less sharing.
The paper (§7.2, Fig. 18b) found block sizes 16 to 128 work best on the ShareGPT trace,
whose requests are long, but only 16 and 32 on the Alpaca trace: its sequences are short,
shorter than the larger blocks. vLLM picked 16 as its default, which suits both.

## Recap

- PagedAttention's attention half is ordinary attention with one indirection: token $i$'s
  K/V are at `cache[block_table[i // block_size], i % block_size]`.
- `paged_attention_ref` gathers through the table and does plain softmax: the grader.
- vLLM's original V1 kernel keeps the whole logits row in shared memory and makes several
  passes (scores, max, exp-sum, weighted V); the V2 kernel partitions the sequence, which
  bounds that row and adds parallelism for long contexts.
- On a CPU, `attention_backend="cpu"` runs that V1 structure in C (`csrc/paged_attention_cpu.c`),
  reading K/V in place through the table instead of gathering them first (appendix
  `03a_cpu_backend`).
- vLLM's V1 kernel launches one thread block per query head and sequence; the course's Triton
  decode kernel walks the table tile by tile with an online softmax, one program
  per (sequence, KV head) with the GQA group as tile rows; any block size 1..256, odd head
  sizes by masking, fp32 accumulation.
- Split-KV (the V2 kernel) adds a partition axis to the grid and a reduce kernel, for few long sequences.
- "V1/V2 kernel" names kernels; "vLLM v1" names the 2025 engine. They are unrelated.
- The prefill kernel handles causal query spans over a cached prefix, so chunked prefill and
  prefix caching are the same code path.
- PagedAttention decides *where KV lives*; FlashAttention decides *how attention is computed*.

Next, chapter 04: continuous batching, the scheduler that rebuilds the batch every step.
""")

md(r"""
## Readings

* **The paper** (Kwon et al., SOSP 2023): §4.1 PagedAttention (attention block by block),
  §5.1 Kernel-level Optimization (fused reshape and block write, fusing block read and
  attention, fused block copy), §7.1 Kernel Microbenchmark (the price of the block table).
* The PagedAttention V1 kernel as the paper shipped it (v0.2):
  `csrc/attention/attention_kernels.cu`; later split into
  `csrc/attention/attention_kernels.cuh`, `csrc/attention/paged_attention_v1.cu` and
  `csrc/attention/paged_attention_v2.cu` ↔ `minipaged/kernels/paged_attention.py`,
  reference `minipaged/kernels/reference.py`.
* Writing and copying blocks: `csrc/cache_kernels.cu` (`reshape_and_cache`, `copy_blocks`,
  `swap_blocks`) ↔ `minipaged/kernels/cache_ops.py`.
* vLLM v1 the engine: `vllm/v1/attention/backends/triton_attn.py` calls
  `vllm/v1/attention/ops/triton_unified_attention.py` (one Triton kernel over the block
  table, long contexts in segments merged by `reduce_segments`);
  `vllm/v1/attention/backends/flash_attn.py` (FlashAttention with a block table).
* **FlashAttention** (Dao et al., NeurIPS 2022): the online softmax over tiles.
  **Flash-Decoding** (Dao, Haziza, Massa, Sizov, 2023): split the KV sequence, merge the
  partial results, as the V2 kernel and section 4 do.
""")

write("03_paged_attention")
