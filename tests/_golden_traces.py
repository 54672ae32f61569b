"""Pinned scheduler behaviour: seeded runs whose EngineTraces are stored in
``tests/golden/scheduler_traces.json`` and compared by ``tests/core/test_golden_traces.py``.

The traces were recorded before the core was split into ``minipaged/core/kv`` and
``minipaged/core/sched`` (issue 11), so the test proves the split changed no step.
Regenerate (only for an intended, explained change)::

    python tests/_golden_traces.py --write
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden" / "scheduler_traces.json"


def _token(request) -> int:
    """A deterministic fake model: a token from the request id and its output position."""
    key = f"{request.request_id}:{request.num_output_tokens}".encode()
    return 3 + hashlib.sha256(key).digest()[0] % 60


def _workload(
    seed: int,
    num_requests: int,
    prompt_range,
    output_range,
    span: int,
    group_every: int = 0,
    shared_prefix: int = 0,
    eos: bool = False,
):
    """{arrival step: [Request | [Request, ...] (a group)]}, seeded."""
    from minipaged.core import Request
    from minipaged.sampling_params import SamplingParams

    rng = random.Random(seed)
    prefix = [rng.randint(3, 62) for _ in range(shared_prefix)]
    arrivals: dict[int, list] = {}
    for k in range(num_requests):
        at = rng.randint(0, span)
        prompt = prefix + [rng.randint(3, 62) for _ in range(rng.randint(*prompt_range))]
        params = SamplingParams(max_tokens=rng.randint(*output_range), ignore_eos=not eos)
        n = 1 + (k % 3 == 0) * 2 if group_every and k % group_every == 0 else 1
        seqs = [
            Request(f"R{k:02d}" + (f".{j}" if n > 1 else ""), prompt, params, eos_token_id=7 if eos else None)
            for j in range(n)
        ]
        arrivals.setdefault(at, []).append(seqs if n > 1 else seqs[0])
    return arrivals


# name -> (scheduler kwargs, workload kwargs). kind "static" is the static baseline.
SCHEDULER_CASES = {
    "recompute": (
        {"num_blocks": 14, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16},
        {"seed": 1, "num_requests": 12, "prompt_range": (3, 20), "output_range": (3, 14), "span": 10},
    ),
    "recompute_v1_admission": (
        {
            "num_blocks": 20,
            "block_size": 4,
            "max_num_seqs": 6,
            "max_num_batched_tokens": 12,
            "watermark": None,
        },
        {
            "seed": 2,
            "num_requests": 14,
            "prompt_range": (2, 24),
            "output_range": (2, 16),
            "span": 8,
            "eos": True,
        },
    ),
    "no_chunking": (
        {
            "num_blocks": 28,
            "block_size": 2,
            "max_num_seqs": 5,
            "max_num_batched_tokens": 20,
            "enable_chunked_prefill": False,
        },
        {"seed": 3, "num_requests": 12, "prompt_range": (2, 18), "output_range": (2, 12), "span": 12},
    ),
    "swap": (
        {
            "num_blocks": 20,
            "block_size": 4,
            "max_num_seqs": 6,
            "max_num_batched_tokens": 16,
            "preemption_mode": "swap",
            "num_cpu_blocks": 12,
        },
        {"seed": 4, "num_requests": 14, "prompt_range": (3, 20), "output_range": (4, 18), "span": 6},
    ),
    "groups": (
        {"num_blocks": 20, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 16},
        {
            "seed": 5,
            "num_requests": 10,
            "prompt_range": (3, 18),
            "output_range": (3, 14),
            "span": 8,
            "group_every": 2,
            "eos": True,
        },
    ),
    "groups_swap": (
        {
            "num_blocks": 26,
            "block_size": 4,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 16,
            "preemption_mode": "swap",
            "num_cpu_blocks": 16,
        },
        {
            "seed": 6,
            "num_requests": 10,
            "prompt_range": (3, 18),
            "output_range": (4, 16),
            "span": 5,
            "group_every": 2,
        },
    ),
    "prefix_caching": (
        {
            "num_blocks": 16,
            "block_size": 4,
            "max_num_seqs": 6,
            "max_num_batched_tokens": 16,
            "enable_prefix_caching": True,
        },
        {
            "seed": 7,
            "num_requests": 12,
            "prompt_range": (1, 10),
            "output_range": (2, 12),
            "span": 10,
            "shared_prefix": 9,
        },
    ),
    "prefix_caching_groups": (
        {
            "num_blocks": 30,
            "block_size": 4,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 16,
            "enable_prefix_caching": True,
        },
        {
            "seed": 8,
            "num_requests": 10,
            "prompt_range": (1, 10),
            "output_range": (2, 12),
            "span": 6,
            "shared_prefix": 8,
            "group_every": 2,
        },
    ),
    "static": (
        {
            "kind": "static",
            "num_blocks": 40,
            "block_size": 4,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 32,
        },
        {
            "seed": 9,
            "num_requests": 10,
            "prompt_range": (2, 16),
            "output_range": (2, 12),
            "span": 6,
            "eos": True,
        },
    ),
}

SIM_CASES = {  # name -> simulate() kwargs (the paper-scale simulator, small pools)
    "sim_paged": {"policy": "paged"},
    "sim_paged_n3": {"policy": "paged", "n": 3},
    "sim_paged_swap": {"policy": "paged", "preemption_mode": "swap"},
    "sim_orca": {"policy": "orca-oracle"},
    "sim_static": {"policy": "static"},
}


def make_scheduler(kwargs: dict):
    """The scheduler of a case (the only place that knows the scheduler constructors)."""
    from minipaged.core import PaperScheduler, StaticBatchScheduler

    kwargs = dict(kwargs)
    if kwargs.pop("kind", None) == "static":
        return StaticBatchScheduler(**kwargs)
    return PaperScheduler(**kwargs)


def scheduler_trace(name: str) -> dict:
    from minipaged.trace import run_scheduler

    sched_kwargs, work_kwargs = SCHEDULER_CASES[name]
    sched = make_scheduler(sched_kwargs)
    trace = run_scheduler(sched, _workload(**work_kwargs), next_token=_token)
    trace.meta.pop("scheduler", None)  # NOTE: class names may change; behaviour may not
    return trace.to_dict()


def sim_trace(name: str) -> dict:
    from minipaged.sim.arrivals import TraceRequest
    from minipaged.sim.cost_model import CostModel
    from minipaged.sim.simulator import simulate

    rng = random.Random(11)
    reqs, t = [], 0.0
    for k in range(30):
        t += rng.expovariate(40.0)
        reqs.append(TraceRequest(f"S{k:02d}", t, rng.randint(20, 600), rng.randint(10, 400)))
    cm = CostModel(gpu_memory_utilization=0.76)  # a small KV pool: ~5000 token slots
    res = simulate(
        reqs, cost_model=cm, block_size=16, max_num_seqs=16, record_trace=True, check=True, **SIM_CASES[name]
    )
    steps = res.trace.to_dict()["steps"]
    for s in steps:
        s["time"] = round(s["time"], 9)
    # NOTE: thousands of steps: a short digest per step keeps the file small and still
    # names the first step that differs.
    digests = [hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:10] for s in steps]
    metrics = {k: (round(v, 9) if isinstance(v, float) else v) for k, v in res.metrics.to_dict().items()}
    return {"steps": digests, "metrics": metrics}


def all_traces() -> dict:
    out = {name: scheduler_trace(name) for name in SCHEDULER_CASES}
    out.update({name: sim_trace(name) for name in SIM_CASES})
    return out


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python tests/_golden_traces.py --write")
    data = all_traces()
    GOLDEN.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")
    for k, v in data.items():
        print(k, len(v["steps"]), "steps")
