"""A toy serving loop that records an ``EngineTrace``: pictures without a model.

The pictures of ``minipaged.viz`` are drawn from an ``EngineTrace``. The engine
(``minipaged.LLM``) and the simulator record one; this module records one too, from a
*real* ``KVCacheManager`` driven by a deliberately small loop, so that the pictures, their
tests and the synthetic stress case (20 requests x 200 steps) need neither a model nor
the full scheduler. It is not the course's scheduler (``minipaged.core.scheduler``): it
has no swap, no sharing, no refusals; read that one to learn scheduling.

Loop (one step)
    running requests first, in admission order: each gets the tokens it still has to
    compute (1 when decoding, a prompt chunk when prefilling) within the token budget;
    when ``allocate_slots`` returns None the latest-admitted running request is preempted
    (recompute: its blocks freed, it goes back to the front of the waiting queue). Then
    waiting requests are admitted FCFS while seats, budget and blocks last (none after a
    preemption in the same step). A request whose tokens are all computed samples one
    token; after ``output_len`` tokens it finishes and its blocks are freed.

Inputs: ``toy_trace(num_requests, ...)`` with a seed. Output: an ``EngineTrace`` that
passes ``check_invariants()``. Failure mode: a request longer than the pool raises
``ValueError`` (the manager's).
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

from minipaged.core import KVCacheManager
from minipaged.trace import EngineTrace, StepRecord


def toy_trace(
    num_requests: int = 6,
    *,
    num_blocks: int = 24,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 16,
    prompt_lens: Optional[Sequence[int]] = None,
    output_lens: Optional[Sequence[int]] = None,
    arrival_steps: Optional[Sequence[int]] = None,
    seed: int = 0,
    max_steps: int = 10_000,
) -> EngineTrace:
    """Record a seeded toy run; lengths and arrivals are drawn unless given."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    rng = random.Random(seed)
    n = num_requests
    prompt_lens = list(prompt_lens) if prompt_lens else [rng.randint(3, 14) for _ in range(n)]
    output_lens = list(output_lens) if output_lens else [rng.randint(2, 12) for _ in range(n)]
    if arrival_steps is None:
        arrival_steps, t = [], 0
        for _ in range(n):
            arrival_steps.append(t)
            t += rng.choice([0, 0, 1, 1, 2, 3])
    for name, v in (("prompt_lens", prompt_lens), ("output_lens", output_lens),
                    ("arrival_steps", arrival_steps)):
        if len(v) != n:
            raise ValueError(f"{name} has {len(v)} entries for {n} requests")
    rids = [f"R{k}" for k in range(n)] if n <= 26 else [f"R{k:02d}" for k in range(n)]

    kv = KVCacheManager(num_blocks, block_size)
    trace = EngineTrace(num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                        meta={"source": "minipaged.viz.toy", "seed": seed})
    for k, rid in enumerate(rids):
        trace.requests[rid] = {"prompt_len": prompt_lens[k], "output_len": output_lens[k],
                               "arrival_step": arrival_steps[k], "finish_step": None}
    num_tokens = {r: prompt_lens[k] for k, r in enumerate(rids)}  # prompt + output so far
    computed = dict.fromkeys(rids, 0)
    outputs = dict.fromkeys(rids, 0)
    target = dict(zip(rids, output_lens))
    waiting: list[str] = []
    running: list[str] = []
    arrivals = sorted(range(n), key=lambda k: (arrival_steps[k], k))
    done = 0
    step = 0
    while done < n:
        if step >= max_steps:
            raise RuntimeError(f"toy loop did not finish in {max_steps} steps")
        arrived = []
        while arrivals and arrival_steps[arrivals[0]] <= step:
            rid = rids[arrivals.pop(0)]
            waiting.append(rid)
            arrived.append(rid)
        budget = max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_ids: list[int] = []
        preempted: list[str] = []
        queue = list(running)
        while queue and budget > 0:
            rid = queue.pop(0)
            want = min(num_tokens[rid] - computed[rid], budget)
            while True:
                blocks = kv.allocate_slots(rid, want)
                if blocks is not None:
                    break
                victim = running[-1]  # the latest admitted
                running.remove(victim)
                if victim in queue:
                    queue.remove(victim)
                kv.free(victim)
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                computed[victim] = 0
                waiting.insert(0, victim)
                preempted.append(victim)
                if victim == rid:
                    break
            if rid in preempted:
                continue
            new_ids += [b.block_id for b in blocks]
            scheduled[rid] = want
            budget -= want
        while not preempted and waiting and len(running) < max_num_seqs and budget > 0:
            rid = waiting[0]
            want = min(num_tokens[rid] - computed[rid], budget)
            blocks = kv.allocate_slots(rid, want)
            if blocks is None:
                break
            waiting.pop(0)
            running.append(rid)
            new_ids += [b.block_id for b in blocks]
            scheduled[rid] = want
            budget -= want
        # decoding: everything but the last sampled token is computed already
        decode = [r for r in scheduled if num_tokens[r] - computed[r] == 1 and outputs[r] > 0]
        prefill = [r for r in scheduled if r not in decode]
        tables = {r: kv.get_block_ids(r) for r in running}
        held_tokens = {r: kv.num_tokens[r] for r in running}
        finished = []
        for rid, k in scheduled.items():
            computed[rid] += k
            if computed[rid] == num_tokens[rid]:  # all known tokens computed: sample one
                outputs[rid] += 1
                num_tokens[rid] += 1
                if outputs[rid] == target[rid]:
                    finished.append(rid)
        for rid in finished:
            running.remove(rid)
            kv.free(rid)
            trace.requests[rid]["finish_step"] = step
            done += 1
        kv.check_invariants()
        holders: dict[int, int] = {}
        for t in tables.values():
            for b in t:
                holders[b] = holders.get(b, 0) + 1
        trace.record(StepRecord(
            step=step, scheduled=scheduled,
            prefill_ids=prefill, decode_ids=decode,
            waiting_ids=list(waiting), preempted_ids=preempted, finished_ids=finished,
            arrived_ids=arrived, block_tables=tables, num_tokens=held_tokens,
            new_block_ids=new_ids, shared_blocks={b: c for b, c in holders.items() if c > 1},
            num_free_blocks=num_blocks - len(holders),
        ))
        step += 1
    return trace
