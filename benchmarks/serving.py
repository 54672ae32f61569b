"""Serving benchmark on this machine: minipaged against transformers, same workload, same KV memory.

    python benchmarks/serving.py [--json] [--model course|random-llama-20m|tiny-llama|DIR ...]
                                 [--systems a,b,c,d] [--num-requests 64] [--seed 0] [--threads 1]
                                 [--quick] [--profile] ...

A thin script over ``minipaged.bench.serving`` (also ``minipaged bench``): one process, one
seeded ShareGPT-like workload scaled to the model's context, the same number of KV token
slots for every system:

    (a) minipaged continuous batching + paged KV      (b) minipaged static batches + contiguous KV
    (c) transformers ``generate``, padded static batches (d) transformers continuous batching

Prints tokens/s (wall and CPU time), TTFT, TPOT, steps, sequences per step, preemptions, the
per-step overhead, whether the greedy outputs agree pair by pair, and the ratios (a)/(b),
(a)/(c), (a)/(d) (of the fastest run, and with ``--repeats`` > 1 of the median run).
``--profile`` adds the split of one step at 64 running sequences, and of its forward into the
weight matmuls alone (the floor), attention and everything else. See that module's docstring.
"""

import sys

from minipaged.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
