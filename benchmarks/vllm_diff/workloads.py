"""Random scheduler workloads shared by both sides of the vLLM differential test.

Plain Python (no torch, no minipaged, no vLLM): it is imported by ``run_vllm.py`` inside
vLLM's own virtual environment and by ``run_minipaged.py`` inside the course's.

Inputs / outputs
    ``make_workload(seed) -> dict``: ``config`` (block_size, num_blocks = usable KV blocks,
    max_num_seqs, max_num_batched_tokens, enable_prefix_caching, max_model_len) and
    ``requests`` (request_id, arrival_step, prompt token ids, max_tokens), in arrival
    order. ``fake_token(request_id, position)`` is the fake model: the token sampled at
    ``position`` (0-based index in prompt + output) of a request, never EOS.
    ``run_workload(side, workload) -> list[dict]`` drives one scheduler (an adapter with
    ``add_request(dict)``, ``step() -> dict``, ``has_unfinished_requests()``) step by step:
    the requests of step s are added before that step's ``schedule()``. A step record is
    ``{"scheduled": {id: [num_computed_tokens before, num_scheduled_tokens]},
    "admitted": {id: num_cached_tokens}, "preempted": [ids], "finished": {id:
    num_output_tokens}}`` (JSON-ready; ids sorted where order carries no meaning).
Invariants
    Same seed -> same workload on both sides. Every request fits the whole pool alone
    (``ceil((prompt + max_tokens - 1) / block_size) <= num_blocks``) and the model's
    context (``prompt + max_tokens <= max_model_len``), so neither scheduler refuses one.
    Pools are small and budgets tight so that recompute preemptions happen; prompts are
    drawn from a few shared prefixes so that prefix-cache hits happen.
Failure mode
    None at run time; a workload that never preempts or never hits is still valid (the
    comparison reports how many did).
"""

from __future__ import annotations

import hashlib
import random

# The course model (minipaged/data/course_model): vocab 788, bos 0, eos 1, pad 2,
# 512 positions.
VOCAB_SIZE = 788
EOS_TOKEN_ID = 1
MAX_MODEL_LEN = 512
FIRST_TOKEN = 3  # tokens are drawn from [3, VOCAB_SIZE): never bos / eos / pad


def fake_token(request_id: str, position: int) -> int:
    """The fake model's token at ``position`` of ``request_id`` (deterministic, not EOS)."""
    digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
    return FIRST_TOKEN + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_TOKEN)


def make_workload(seed: int) -> dict:
    """One random workload (see the module docstring)."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8, 16])
    num_blocks = rng.randint(6, 40)
    max_num_seqs = rng.randint(1, 8)
    max_num_batched_tokens = rng.choice([8, 12, 16, 24, 32, 48, 64, 128])
    max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
    enable_prefix_caching = rng.random() < 0.5
    capacity = num_blocks * block_size  # KV tokens the whole pool holds

    # a few shared prefixes, so that prompts hit each other's cached blocks
    prefixes = [
        [rng.randrange(FIRST_TOKEN, VOCAB_SIZE) for _ in range(rng.randint(1, 3 * block_size))]
        for _ in range(rng.randint(1, 3))
    ]
    num_requests = rng.randint(2, 14)
    last_arrival = rng.choice([0, 3, 10, 25])
    requests = []
    for i in range(num_requests):
        # prompt + max_tokens - 1 <= capacity (fits alone) and <= MAX_MODEL_LEN
        limit = min(capacity, MAX_MODEL_LEN - 1)
        prompt_len = rng.randint(1, max(1, min(limit, rng.choice([8, 24, 64]))))
        if rng.random() < 0.6:
            prefix = rng.choice(prefixes)[: prompt_len]
            prompt = prefix + [rng.randrange(FIRST_TOKEN, VOCAB_SIZE)
                               for _ in range(prompt_len - len(prefix))]
        else:
            prompt = [rng.randrange(FIRST_TOKEN, VOCAB_SIZE) for _ in range(prompt_len)]
        max_tokens = rng.randint(1, max(1, min(limit + 1 - prompt_len, 40)))
        requests.append({
            "request_id": f"r{i}",
            "arrival_step": rng.randint(0, last_arrival),
            "prompt_token_ids": prompt,
            "max_tokens": max_tokens,
        })
    requests.sort(key=lambda r: (r["arrival_step"], int(r["request_id"][1:])))
    return {
        "seed": seed,
        "config": {
            "block_size": block_size,
            "num_blocks": num_blocks,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": enable_prefix_caching,
            "max_model_len": MAX_MODEL_LEN,
        },
        "requests": requests,
    }


def arrivals_by_step(workload: dict) -> dict[int, list[dict]]:
    """``{step: [request dicts added before that step's schedule()]}``, arrival order."""
    out: dict[int, list[dict]] = {}
    for r in workload["requests"]:
        out.setdefault(r["arrival_step"], []).append(r)
    return out


MAX_STEPS = 20_000


def run_workload(side, workload: dict) -> list[dict]:
    """Drive ``side`` through ``workload``; return one record per step (see above)."""
    arrivals = arrivals_by_step(workload)
    last_arrival = max(arrivals, default=0)
    records = []
    step = 0
    while step <= last_arrival or side.has_unfinished_requests():
        if step >= MAX_STEPS:
            raise RuntimeError(f"workload {workload['seed']}: not finished after {MAX_STEPS} steps")
        for r in arrivals.get(step, ()):
            side.add_request(r)
        records.append(side.step())
        step += 1
    return records
