"""The seeded runs the course's figures are drawn from (``minipaged figures``, chapter 00).

- the engine on the course model (``minipaged.LLM()``), where the course model is present:
  the run of chapter 00 (``engine_demo_trace``);
- otherwise, and for the large picture, the real ``Scheduler`` driven by a fake model
  (``minipaged.trace.run_scheduler``; ``scheduler_demo_trace``, ``scheduler_large_trace``:
  20 requests x about 200 steps); ``interesting_step`` picks the step worth drawing.

The same seed gives the same trace. The ``minipaged figures`` command that draws them
(and the simulator's own figures) is ``minipaged/figures.py``, above both ``viz`` and
``sim``: viz imports no simulator module. This module must not import torch or
matplotlib at import time. vLLM has no counterpart.
"""

from __future__ import annotations

import random
from pathlib import Path

DEMO_PROMPTS = [
    "Once upon a time",
    "The little dog",
    "One day, Mia found a",
    "In the big forest there was",
    "Tom and his friend",
    "The sun was hot and",
    "A small bird sat on",
    "At the end of the day",
]
# the engine run of chapter 00 and of figures/: a pool small enough that requests queue,
# and at least one is preempted (see notebooks/00_overview.ipynb)
DEMO_ENGINE_KWARGS = dict(block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=24, seed=0)
DEMO_MAX_TOKENS = 24


def course_model_available() -> bool:
    """True where ``minipaged.LLM()`` can load the shipped course model."""
    try:
        import minipaged.engine.llm  # noqa: F401
        from minipaged.model import COURSE_MODEL_DIR
    except Exception:  # noqa: BLE001 - any import failure means: not available yet
        return False
    return (Path(COURSE_MODEL_DIR) / "config.json").is_file()


def engine_demo_trace():
    """The engine on the course model: eight prompts through a small paged pool."""
    from minipaged import LLM, SamplingParams

    llm = LLM(**DEMO_ENGINE_KWARGS)
    llm.generate(
        DEMO_PROMPTS,
        SamplingParams(temperature=0.0, max_tokens=DEMO_MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return llm.trace


def scheduler_trace(
    num_requests: int,
    *,
    seed: int = 0,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    arrival_span: int,
    preemption_mode: str = "recompute",
    num_cpu_blocks: int = 0,
):
    """The real ``Scheduler`` on seeded requests, a fake model appending token 1."""
    from minipaged.core import PaperScheduler, Request
    from minipaged.sampling_params import SamplingParams
    from minipaged.trace import run_scheduler

    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    steps = sorted(rng.randint(0, arrival_span) for _ in range(num_requests))
    width = len(str(num_requests - 1))
    for k, at in enumerate(steps):
        req = Request(
            request_id=f"R{k:0{width}d}",
            prompt_token_ids=[rng.randint(2, 99) for _ in range(rng.randint(*prompt_range))],
            sampling_params=SamplingParams(max_tokens=rng.randint(*output_range), ignore_eos=True),
        )
        arrivals.setdefault(at, []).append(req)
    sched = PaperScheduler(
        num_blocks,
        block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        preemption_mode=preemption_mode,
        num_cpu_blocks=num_cpu_blocks,
    )
    trace = run_scheduler(sched, arrivals, next_token=lambda r: 1)
    trace.meta["source"] = f"Scheduler + fake model, seed {seed}"
    return trace


def scheduler_demo_trace(seed: int = 0, preemption_mode: str = "recompute"):
    """8 requests, 24 blocks of 4 slots: requests queue, chunk and get preempted."""
    return scheduler_trace(
        8,
        seed=seed,
        num_blocks=24,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        prompt_range=(4, 22),
        output_range=(4, 16),
        arrival_span=8,
        preemption_mode=preemption_mode,
        num_cpu_blocks=24 if preemption_mode == "swap" else 0,
    )


def scheduler_large_trace(seed: int = 3):
    """20 requests over about 200 steps: the readability check of every picture."""
    return scheduler_trace(
        20,
        seed=seed,
        num_blocks=96,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        prompt_range=(20, 90),
        output_range=(30, 80),
        arrival_span=120,
    )


def demo_trace():
    """The run the main figures are drawn from: the engine where it can run, else the
    scheduler with a fake model."""
    return engine_demo_trace() if course_model_available() else scheduler_demo_trace()


def interesting_step(trace) -> int:
    """A step worth drawing: the first preemption if any, else the fullest pool."""
    for s in trace.steps:
        if s.preempted_ids or s.swapped_out_ids:
            return s.step
    return min(trace.steps, key=lambda s: (s.num_free_blocks, s.step)).step
