"""Random scheduler workloads shared by both sides of the vLLM differential test.

Plain Python (no torch, no minipaged, no vLLM): it is imported by ``run_vllm.py`` inside
vLLM's own virtual environment and by ``run_minipaged.py`` inside the course's.

Inputs / outputs
    ``make_workload(wid) -> dict`` (``wid``: a seed, or a name of ``CASES``, the
    hand-made workloads): ``config`` (block_size, num_blocks = usable KV blocks,
    max_num_seqs, max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill,
    max_model_len) and
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
    (its KV, ``min(prompt + max_tokens - 1, max_model_len - 1)`` tokens, fits
    ``num_blocks``) and its prompt the model's context (``prompt < max_model_len``), so
    neither scheduler refuses one. Pools are small and budgets tight so that recompute
    preemptions happen; prompts are drawn from a few shared prefixes so that prefix-cache
    hits happen; a fifth of the workloads run without chunked prefill (then
    ``max_model_len = max_num_batched_tokens``, as vLLM requires) and a fifth with a short
    ``max_model_len`` that stops generation before ``max_tokens``.
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

# Admission rules compared (each side's adapter maps a name to its own settings):
#   "first-chunk"    a waiting request is admitted when its first chunk's blocks fit
#                    (vLLM and minipaged's Scheduler: scheduler_reserve_full_isl=False)
#   "full-sequence"  ... when the blocks for all its current tokens fit (vLLM's default,
#                    scheduler_reserve_full_isl=True, watermark=0.0: both schedulers' defaults)
#   "watermark"      ... and WATERMARK of the pool stays free while anything runs
#                    (both: full sequence + watermark=WATERMARK)
ADMISSIONS = ("first-chunk", "full-sequence", "watermark")
WATERMARK = 0.05  # minipaged's DEFAULT_WATERMARK: int(0.05 * num_blocks) blocks


def fake_token(request_id: str, position: int) -> int:
    """The fake model's token at ``position`` of ``request_id`` (deterministic, not EOS)."""
    digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
    return FIRST_TOKEN + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_TOKEN)


def parse_ids(text: str) -> list[str]:
    """Workload ids: ``"0:100"`` -> "0".."99" (random seeds), ``"cases"`` -> the names of
    ``CASES``, a name or a seed as is; comma-separated parts are concatenated."""
    ids: list[str] = []
    for part in filter(None, text.split(",")):
        if part == "cases":
            ids += list(CASES)
        elif ":" in part:
            a, b = part.split(":")
            ids += [str(i) for i in range(int(a), int(b))]
        else:
            ids.append(part)
    return ids


def make_workload(wid) -> dict:
    """The workload ``wid``: a name of ``CASES`` or a seed of a random one."""
    wid = str(wid)
    if wid in CASES:
        return dict(CASES[wid], seed=wid)
    return _random_workload(int(wid))


def _random_workload(seed: int) -> dict:
    """One random workload (see the module docstring)."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8, 16])
    num_blocks = rng.randint(6, 40)
    max_num_seqs = rng.randint(1, 8)
    max_num_batched_tokens = rng.choice([8, 12, 16, 24, 32, 48, 64, 128])
    max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
    enable_prefix_caching = rng.random() < 0.5
    enable_chunked_prefill = True
    max_model_len = MAX_MODEL_LEN
    u = rng.random()
    if u < 0.2:
        # chunked prefill off: vLLM then needs max_num_batched_tokens >= max_model_len
        enable_chunked_prefill = False
        max_model_len = max_num_batched_tokens
    elif u < 0.4:
        max_model_len = rng.randint(12, 96)  # generation stops at the model's context
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
        prompt_len = rng.randint(1, min(max_model_len - 1, capacity, rng.choice([8, 24, 64])))
        if rng.random() < 0.6:
            prefix = rng.choice(prefixes)[:prompt_len]
            prompt = prefix + [
                rng.randrange(FIRST_TOKEN, VOCAB_SIZE) for _ in range(prompt_len - len(prefix))
            ]
        else:
            prompt = [rng.randrange(FIRST_TOKEN, VOCAB_SIZE) for _ in range(prompt_len)]
        max_tokens = rng.randint(1, 40)
        # the KV it may hold, min(prompt + max_tokens - 1, max_model_len - 1), fits the pool
        if min(prompt_len + max_tokens - 1, max_model_len - 1) > capacity:
            max_tokens = capacity + 1 - prompt_len
        requests.append(
            {
                "request_id": f"r{i}",
                "arrival_step": rng.randint(0, last_arrival),
                "prompt_token_ids": prompt,
                "max_tokens": max_tokens,
            }
        )
    requests.sort(key=lambda r: (r["arrival_step"], int(r["request_id"][1:])))
    return {
        "seed": str(seed),
        "config": {
            "block_size": block_size,
            "num_blocks": num_blocks,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": enable_prefix_caching,
            "enable_chunked_prefill": enable_chunked_prefill,
            "max_model_len": max_model_len,
        },
        "requests": requests,
    }


def _case(block_size, num_blocks, prompts, max_num_seqs=1, max_num_batched_tokens=32) -> dict:
    """A hand-made workload: ``prompts`` all arrive at step 0, in order, max_tokens 1."""
    return {
        "config": {
            "block_size": block_size,
            "num_blocks": num_blocks,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
            "max_model_len": MAX_MODEL_LEN,
        },
        "requests": [
            {"request_id": f"r{i}", "arrival_step": 0, "prompt_token_ids": p, "max_tokens": 1}
            for i, p in enumerate(prompts)
        ],
    }


# Minimal workloads, one per prefix-caching detail where minipaged and vLLM 0.32 differed,
# kept as regression cases now that minipaged matches (compare.py says how); worked out by
# hand; block size 2, requests served one at a time unless said otherwise:
CASES = {
    # r0 and r1 are admitted in the same step; r0's blocks [5,6] [7,8] are cached when
    # allocated (vLLM), so r1 hits 4 tokens in that very step: r1 scheduled [4, 1].
    "same-step-hit": _case(2, 10, [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10]], max_num_seqs=2),
    # r0 caches [5,6] in block A; r1 (same prompt; a hit must leave 1 token to compute, so
    # no hit) fills block B with the same tokens: vLLM caches B too. r2 needs 7 of the 8
    # blocks: it evicts A (freed first), not B. r3 hits B: scheduled [2, 1].
    "duplicate-block": _case(2, 8, [[5, 6], [5, 6], list(range(20, 34)), [5, 6, 7]]),
    # r0 caches [5,6] in block A. r1 frees [8,9] (hashed) and [10] (no hash): vLLM puts
    # the block without a hash at the FRONT of the free queue, so r2 (6 blocks of 8)
    # takes it and keeps A. r3 hits A: scheduled [2, 1].
    "lifo-free": _case(2, 8, [[5, 6], [8, 9, 10], list(range(20, 32)), [5, 6, 7]]),
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
