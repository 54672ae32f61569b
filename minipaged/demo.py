"""``minipaged demo``: watch continuous batching and paged KV memory on the course model.

No vLLM counterpart (vLLM's ``examples/offline_inference`` prints only the texts).

What it does
    Eight seeded requests (story openings of different lengths, asking for different
    numbers of tokens) arrive over the first steps at a ``LLMEngine`` running the shipped
    course model with a deliberately small KV pool, so that requests join as others
    finish and at least one is preempted. For every step it prints the active sequences,
    what each did (prefill chunk or decode), its block table, and the free blocks; then the
    whole run as a text timeline (``minipaged.viz.timeline_text``) and the busiest step as
    text (``minipaged.viz.step_text``), the generated texts, the throughput, and two
    pictures written to ``--out-dir``:
    ``timeline.png`` (a row per request, a column per step) and ``block_tables.png``
    (the block tables at the busiest step).

Inputs
    ``--out-dir DIR`` (default ``demo_out``), ``--steps N`` (print only the first N steps;
    default all), ``--seed S``, ``--no-pictures``, ``--threads N`` (default 1).
Outputs
    text on stdout, two PNGs, exit code 0. Runs in a few seconds on a laptop CPU.

Failure mode
    an unwritable ``--out-dir`` raises ``OSError`` before the engine starts.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

# The requests: (prompt, arrival step). Output lengths are drawn from the seed.
DEMO_PROMPTS = [
    "Once upon a time",
    "The little dog",
    "One day, a girl named Lily",
    "The old man walked to the",
    "There was a big red ball",
    "In the morning, the cat",
    "Tom and his friend",
    "The bird sang a song",
]
DEMO_ARRIVALS = [0, 0, 1, 2, 4, 7, 10, 14]

# A pool small enough that the eight requests cannot all hold their KV at once.
DEMO_ENGINE = dict(
    block_size=4,
    num_blocks=28,
    max_num_seqs=4,
    max_num_batched_tokens=48,
    preemption_mode="recompute",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from minipaged.cli import non_negative_int

    parser.add_argument("--out-dir", default="demo_out", help="folder for the two pictures")
    parser.add_argument(
        "--steps", type=non_negative_int, default=0, help="print only the first N steps (0 = all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for lengths and sampling")
    parser.add_argument("--no-pictures", action="store_true", help="skip writing the PNGs")
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="torch CPU threads (default 1: the course model is too small to gain from more)",
    )


def demo_requests(seed: int = 0):
    """[(request_id, prompt, SamplingParams, arrival_step)] of the demo."""
    from minipaged import SamplingParams

    rng = random.Random(seed)
    reqs = []
    for i, (prompt, arrival) in enumerate(zip(DEMO_PROMPTS, DEMO_ARRIVALS)):
        params = SamplingParams(
            temperature=0.7, top_p=0.9, max_tokens=rng.randint(12, 40), seed=seed * 1000 + i
        )
        reqs.append((str(i), prompt, params, arrival))
    return reqs


def run_engine_with_arrivals(engine, requests, on_step=None):
    """Step ``engine`` to the end, adding each request at its arrival step.

    Returns {request_id: RequestOutput}. ``on_step(step_record)`` is called after every step.
    """
    pending = sorted(requests, key=lambda r: r[3])
    outputs = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for o in engine.step():
            outputs[o.request_id] = o
        if on_step is not None:
            on_step(engine.trace.steps[-1])
        step += 1
    return outputs


def format_step(trace, rec) -> str:
    """One step as text: who ran (prefill/decode), block tables, preemptions, free blocks."""
    lines = [
        f"step {rec.step:3d}  tokens {sum(rec.scheduled.values()):3d}/{trace.max_num_batched_tokens}"
        f"  free blocks {rec.num_free_blocks:2d}/{trace.num_blocks}"
    ]
    for rid in sorted(set(rec.scheduled) | set(rec.block_tables), key=int):
        n = rec.scheduled.get(rid)
        what = "idle" if n is None else ("decode" if rid in rec.decode_ids else f"prefill {n}")
        table = rec.block_tables.get(rid)
        table_s = "[" + " ".join(str(b) for b in table) + "]" if table is not None else "(finished)"
        held = rec.num_tokens.get(rid)
        held_s = f"{held:3d} tok" if held is not None else "       "
        lines.append(f"    req {rid}  {what:<11s} {held_s}  blocks {table_s}")
    events = []
    for label, ids in (
        ("arrived", rec.arrived_ids),
        ("preempted", rec.preempted_ids),
        ("swapped out", rec.swapped_out_ids),
        ("swapped in", rec.swapped_in_ids),
        ("finished", rec.finished_ids),
        ("waiting", rec.waiting_ids),
    ):
        if ids:
            events.append(f"{label}: {' '.join(ids)}")
    if events:
        lines.append("    " + " | ".join(events))
    return "\n".join(lines)


def busiest_step(trace) -> int:
    """The step to draw: a preemption if any, else the most running sequences."""
    for s in trace.steps:
        if s.preempted_ids or s.swapped_out_ids:
            return s.step
    return max(trace.steps, key=lambda s: (len(s.block_tables), -s.step)).step


def write_pictures(trace, out_dir: Path) -> list[Path]:
    """timeline.png and block_tables.png, drawn by minipaged.viz."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minipaged import viz

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in (
        ("timeline.png", viz.timeline(trace)),
        ("block_tables.png", viz.step(trace, busiest_step(trace))),
    ):
        path = out_dir / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def run(args) -> int:
    import torch

    from minipaged import viz
    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import LLMEngine

    if args.threads > 0:
        torch.set_num_threads(args.threads)

    out_dir = Path(args.out_dir)
    if not args.no_pictures:
        out_dir.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(EngineConfig(seed=args.seed, **DEMO_ENGINE))
    requests = demo_requests(args.seed)
    print(
        f"minipaged demo: {len(requests)} requests on the course model "
        f"({engine.model.num_layers} layers, vocab {engine.model.vocab_size}); KV pool of "
        f"{engine.num_blocks} blocks x {engine.config.block_size} tokens, at most "
        f"{engine.config.max_num_seqs} sequences and {engine.config.max_num_batched_tokens} "
        f"tokens per step\n"
    )
    printed = 0

    def on_step(rec):
        nonlocal printed
        if args.steps <= 0 or printed < args.steps:
            print(format_step(engine.trace, rec))
            printed += 1

    t0 = time.perf_counter()
    outputs = run_engine_with_arrivals(engine, requests, on_step)
    elapsed = time.perf_counter() - t0
    trace = engine.trace
    if 0 < args.steps < len(trace):
        print(f"... ({len(trace) - args.steps} more steps not printed; --steps 0 prints all)")
    print("\nThe whole run (the picture in timeline.png):")
    print(viz.timeline_text(trace))
    shown = busiest_step(trace)
    why = (
        "a preemption" if (trace[shown].preempted_ids or trace[shown].swapped_out_ids) else "the fullest pool"
    )
    print(f"\nStep {shown}, {why}, as text (the picture in block_tables.png):")
    print(viz.step_text(trace, shown))
    print("\nGenerated texts:")
    num_tokens = 0
    for rid, prompt, _, _ in requests:
        c = outputs[rid].outputs[0]
        num_tokens += len(c.token_ids)
        print(f"  [{rid}] {prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
    num_pre = sum(len(s.preempted_ids) + len(s.swapped_out_ids) for s in trace.steps)
    print(
        f"\n{len(trace)} steps, {num_tokens} tokens generated, {num_pre} preemption(s); "
        f"{num_tokens / elapsed:.0f} tokens/s ({elapsed:.2f} s)"
    )
    if not args.no_pictures:
        for p in write_pictures(trace, out_dir):
            print(f"wrote {p}")
    return 0
