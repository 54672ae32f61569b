"""Generate notebooks/03a_cpu_backend.ipynb, an appendix of chapter 03 (run from the repo root).

    bash notebooks/_build/build_all.sh 03a_cpu_backend
"""

from _nb import code, md, write

md(r"""
# 03a · Appendix to chapter 03: the `"cpu"` backend in C

Chapter 03 is about attention through a block table. This appendix is for the reader who
wants to see how the course runs that attention fast on a CPU: the C kernel behind
`LLM(attention_backend="cpu")` (`minipaged/kernels/csrc/paged_attention_cpu.c`), and the
small layers the same backend runs in C (`csrc/layers_cpu.c`: RMSNorm with its fused
residual add, RoPE, SiLU-and-mul). Nothing in chapters 04 onward depends on it.

**You will learn**

1. how the PagedAttention V1 kernel's structure (a logits row, max, exp-sum, a second walk
   over V) reads in C, with K/V read in place through the block table;
2. the GQA refinement: one load of each key and value row for four query heads;
3. RMSNorm with the residual add fused in, checked by hand on two rows of four.
""")

md("## Setup")

code(r"""
import math

import torch

import minipaged.kernels  # noqa: F401  (first: it sets up Triton's interpreter on a CPU)
from minipaged.kernels import cpu as cpu_kernels
from minipaged.kernels import paged_attention_ref
from minipaged.model.layers import RMSNorm

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)
print("C compiler available:", cpu_kernels.available())
""")

md(r"""
## 1. The attention kernel in C

One loop per sequence walks the block table block by block and writes every logit of every
head into a buffer (the V1 kernel's shared-memory row), then max, exp and sum, normalise,
and a second walk over the blocks reads V. Keys and values are read **in place**: no gather,
no copy. The torch backend cannot do that (torch has no op that reads through an index while
it multiplies), so on a CPU it gathers every block first and pays a dozen small ops per
layer. vLLM's CPU backend (`csrc/cpu/attention.cpp`) is the same idea.

When four query heads share a KV head (the course model has 8 query heads over 2 KV heads),
`logits_x4` and `values_x4` load each key and value row once for all four, in 16-float
vectors, instead of once per head. The arithmetic is the plain loops'; the loads are a
quarter. The listing is the per-sequence body; the plain loops are the fallback for other
head counts.
""")

code(r"""
# a code tour (inspect.getsource(fn) of C): nbval runs it but does not compare the code it prints
c_src = cpu_kernels.SOURCE.read_text()
body = c_src[c_src.index("        /* 1. Logits"): c_src.index("/* Returns 0; b + 1")]
print(body.rstrip())
""")

md(r"""
Checked against the reference on a shuffled batch of four sequences (lengths 1, 16, 17 and
100: one token, one block, one block and one token, several blocks), 8 query heads over 2
KV heads, so the four-head path runs:
""")

code(r"""
if cpu_kernels.available():
    g = torch.Generator().manual_seed(3)
    kc8 = torch.randn(40, 16, 2, 32, generator=g)  # [num_blocks, block_size, KVH, D]
    vc8 = torch.randn(40, 16, 2, 32, generator=g)
    bt8 = torch.randperm(40, generator=g)[:32].view(4, 8).int()  # [num_seqs, max_blocks]
    sl8 = torch.tensor([1, 16, 17, 100], dtype=torch.int32)
    q8 = torch.randn(4, 8, 32, generator=g)  # [num_seqs, H, D]
    diff = cpu_kernels.paged_attention_decode_cpu(q8, kc8, vc8, bt8, sl8) - paged_attention_ref(q8, kc8, vc8, bt8, sl8)
    print("shuffled batch of 4, GQA 8/2 (four query heads per key row), max |C - ref| < 1e-5:",
          bool(diff.abs().max() < 1e-5))
else:
    print("no C compiler here:", cpu_kernels.build_error())
""")

md(r"""
## 2. The small layers in C

The same backend runs the step's small layers in C too, as vLLM's CPU backend does:
RMSNorm, RoPE and SiLU-and-mul each become one pass over the rows instead of a handful of
torch ops. Each layer keeps its torch form as `forward_native`, the reference its
`forward_cpu` is tested against. RMSNorm also takes the residual stream, as vLLM's
`fused_add_rms_norm` does: `norm(x, residual)` returns `(norm(x + residual), x + residual)`,
so the decoder's residual add costs no pass of its own.

A hand-check on two rows of four: row `[1, 2, 3, 4]` has mean square
(1 + 4 + 9 + 16) / 4 = 7.5, so it is divided by sqrt(7.5) = 2.739; with the residual
`[1, 1, 1, 1]` added first it is `[2, 3, 4, 5]`, mean square 13.5, divided by 3.674:
""")

code(r"""
x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.0, 2.0]])
residual = torch.ones(2, 4)
by_hand = torch.tensor([1.0, 2.0, 3.0, 4.0]) / math.sqrt(7.5)
by_hand_fused = torch.tensor([2.0, 3.0, 4.0, 5.0]) / math.sqrt(13.5)
native = RMSNorm(4, eps=0.0).requires_grad_(False)  # weight 1, no eps: the formula alone
print("by hand, row 0             :", by_hand)
print("forward_native, row 0      :", native(x)[0])
print("by hand, row 0 + residual  :", by_hand_fused)
out, stream = native(x, residual.clone())
print("forward_native(x, residual):", out[0], " residual stream:", stream[0])
if cpu_kernels.available():
    c = RMSNorm(4, eps=0.0, impl="cpu").requires_grad_(False)
    print("forward_cpu equals forward_native:", torch.allclose(c(x), native(x), atol=1e-6),
          torch.allclose(c(x, residual.clone())[0], out, atol=1e-6))
""")

md(r"""
Chapter 07 (section 9) measures what the C backend buys on this machine's CPU: on a decode
step of 64 sequences of the course model, attention goes from about as much time as all the
weight matmuls to a fraction of it, and the small layers' share shrinks too.

## Recap

* The C kernel is the V1 kernel's structure on a CPU: a logits buffer, then max, exp-sum and
  a second walk over V, K/V read in place through the block table.
* Four query heads that share a KV head share each load of its rows.
* RMSNorm fuses the residual add; every C layer is tested against its `forward_native`.
""")

write("03a_cpu_backend")
