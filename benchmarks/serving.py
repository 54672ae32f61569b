"""Serving benchmark on this machine: continuous+paged vs static+contiguous, same KV memory.

    python benchmarks/serving.py [--json] [--num-requests 64] [--seed 0] [--threads 1] ...

A thin script over ``minipaged.engine.bench`` (also ``minipaged bench``): one process, one
seeded ShareGPT-like workload scaled to the course model, both systems on the same model and
the same number of KV blocks; prints tokens/s (wall and CPU time), steps, sequences per step,
preemptions, the per-step overhead and the throughput ratio. See that module's docstring.
"""

import sys

from minipaged.engine.bench import main

if __name__ == "__main__":
    sys.exit(main())
