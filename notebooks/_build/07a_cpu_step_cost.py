"""Generate notebooks/07a_cpu_step_cost.ipynb, an appendix of chapter 07 (run from the repo root).

    bash notebooks/_build/build_all.sh 07a_cpu_step_cost
"""

from _nb import code, md, write

md(r"""
# 07a · Appendix to chapter 07: where a CPU step's time goes

Chapter 07 simulates the paper's GPUs; its section 8 says why CPU measurements of the real
engine answer a different question. This appendix makes that exact on a recorded run of the
engine on a CPU: one decode step split into weight matmuls, attention and the rest, and the
two equations that split what a whole run spends beyond its matmuls into a cost per step and
a cost per sequence-step. Nothing in later chapters depends on it.
""")

code(r"""
import matplotlib.pyplot as plt
""")

md(r"""
## 1. Where a decode step's time goes

The simulator's cost model says a step costs "read the weights, plus attention over the
context, plus overhead". On the CPU the real engine's decode step can be split the same
way: `minipaged.bench.serving.forward_breakdown` times one decode forward at 64 running
sequences, then the same weight matmuls alone (the **floor**: no step can be faster than
its matmuls), then the attention layers; the rest is everything else (norms, activations,
embedding, sampling's logits). `benchmarks/results/cpu_profile.json` holds a recorded run of
one such step through both CPU backends: `"torch"`, the readable reference, and `"cpu"`,
chapter 03's C kernel with the step's small layers (RMSNorm with the residual add, RoPE,
SiLU-and-mul) in C as well, as vLLM's CPU backend runs them. The figure is drawn from it and
the numbers below are read from it (the command that rewrites it is in the file):
""")

code(r"""
import json
from pathlib import Path

import minipaged
from minipaged.bench.serving import plot_forward_breakdown

profile = json.loads((Path(minipaged.__file__).parents[1] / "benchmarks/results/cpu_profile.json").read_text())
ax = plot_forward_breakdown(profile["runs"])
plt.show()
plt.close(ax.figure)
for label, b in profile["runs"].items():
    print(f"{label}:")
    print(f"  {b['num_seqs']} sequences, mean context {b['mean_context']:.0f} tokens: forward {b['forward_ms']:.1f} ms "
          f"= {b['ratio_to_floor']:.2f}x the weight-matmul floor; matmuls {b['floor_share']:.0%}, "
          f"attention {b['attention_share']:.0%}, everything else {b['other_share']:.0%}")
print(f"measured on: {profile['machine']}, torch {profile['torch']}, the course model")
""")

md(r"""
With the torch backend (the top bar) attention is nearly as large as the weight matmuls:
torch has no op that multiplies through an index, so every layer first gathers every block of
every sequence into a new tensor and then runs a dozen small ops over it. The C kernel (the
bottom bar) reads the same keys and values in place, once per group of four query heads, and
the small layers each make one pass in C instead of a handful of torch ops; the step comes
close to its floor: the matmuls, the part every batched engine pays and the part a GPU does
best, are most of it. What attention still costs is mostly memory traffic: each decode step reads every
cached key and value of every running sequence once per layer, so on a CPU a bigger batch is
not free (chapter 07's section 2: its "nearly free" regime does not hold), and longer contexts shift time to
attention. These are CPU numbers of one process on a shared machine (the line above: an
x86_64 with 2 cores, one torch thread, the course model); a GPU splits the same step very
differently. GPU numbers go to `benchmarks/results/` once a GPU run exists
(`benchmarks/gpu_check.sh`, README "The GPU check"); none is recorded yet, and
`minipaged.viz.gpu_results` says so.

The same recorded run also served the whole benchmark workload twice, continuous+paged (a)
and static+contiguous (b), and summed each run's weight matmuls alone. It shows why
continuous batching wins less on a CPU than on a GPU:
""")

code(r"""
sv = profile["serving"]
wall, steps, floor = sv["wall_s"], sv["steps"], sv["matmul_floor_s"]
print(f"steps            : a {steps['a']:>5}  b {steps['b']:>5}   b/a {steps['b'] / steps['a']:.2f}x")
print(f"computed tokens  : a {sv['computed_tokens']['a']:>5}  b {sv['computed_tokens']['b']:>5}")
print(f"wall s           : a {wall['a']:5.2f}  b {wall['b']:5.2f}   b/a {wall['b'] / wall['a']:.2f}x")
print(f"matmuls alone, s : a {floor['a']:5.2f}  b {floor['b']:5.2f}   b/a {floor['b'] / floor['a']:.2f}x")
sp = sv["beyond_matmuls"]  # minipaged.bench.serving.step_cost_split of the two runs
print(f"beyond the matmuls: {sp['per_step_ms']:.2f} ms per step + {sp['per_seq_step_ms']:.3f} ms per sequence-step "
      f"(sequence-steps: a {sp['seq_steps']['a']}, b {sp['seq_steps']['b']})")
print(f"a/b if the per-sequence work cost nothing: {sp['a/b_if_free_per_seq']:.2f}x; "
      f"a/b >= 2x would need {sp['per_step_ms_for_2x']:.2f} ms per step")
""")

md(r"""
(a) takes far fewer steps, but both compute about the same tokens, and on a CPU the weight
matmuls are compute-bound: they cost mostly per token, not per step, so they cost (a) and
(b) nearly the same. Fewer steps save only what a step costs beyond its matmuls (the small ops,
the attention calls, the engine's own work), so (a)'s advantage in time lands between the
two ratios above. The last two lines make that exact. What each run spends beyond its matmuls
is a cost per step times its steps plus a cost per sequence-step times its sequence-steps
(a sequence in a step: sampling it, scheduling it, its attention); the two runs give two
equations for the two costs. Both runs decode every request once per output token, so their
sequence-steps are nearly equal and the per-sequence cost is paid the same by both: only the
per-step cost can separate them. In the recorded run, a/b stays below 2x even with the
per-sequence work free, and 2x would need each step to cost more beyond its matmuls than it
does now: a slower engine, not a faster one. The faster that per-step work gets, the closer a/b comes to the matmul ratio. On a
GPU a decode step reads the weights once whatever the batch (chapter 07, section 2), so it costs about the
same at 4 sequences as at 64, and the time ratio comes close to the step ratio instead.
""")

md(r"""
## Recap

- On a CPU the weight matmuls cost per token, not per step; continuous batching's time win
  lands between the ratio of the runs' weight matmuls and the ratio of their steps.
- The rest of a step (small ops, attention calls, the engine's own work) is what fewer steps
  save; the two runs' equations say how much per step and per sequence-step.
- Code: `minipaged/bench/serving.py` (`forward_breakdown`, `matmul_floors`, `step_cost_split`);
  the recorded run: `benchmarks/results/cpu_profile.json` (the command that rewrites it is
  in the file).
""")

write("07a_cpu_step_cost")
