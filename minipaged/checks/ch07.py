"""Checkers for chapter 07 exercises: serving at scale, on the simulator.

Exercises (notebooks/exercises/ch07_serving_at_scale.ipynb)
    ex7.1 ``predict_steps()`` -> one ``{request_id: tokens}`` per step of the small run
          ``PREDICT_REQUESTS`` (a prediction, worked on paper; one workload per student),
          compared with ``simulate``'s trace on the trusted side.
    ex7.2 ``sustainable_rate(rates, latencies, factor)``: the request rate at which a
          measured latency curve first passes ``factor`` times its light-load value,
          checked against ``minipaged.sim.simulator.sustainable_rate``.
    ex7.3 ``predict_directions()`` -> ``{change: "up" | "down" | "same"}``: how the
          vLLM-like / Orca (Oracle) capacity ratio moves under each change of ``CHANGES``,
          graded once by running the simulator on the trusted side.
    ex7.4 ``concept_answers()``: the end-of-chapter questions that have a number or a
          choice for an answer (graded once, by the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``): plain-data cases; ``observe`` calls the
student's function in the student's kernel and returns what it returned or raised; the
trusted side computes the expected observation with the simulator (``minipaged.sim``, run
on the real scheduler) or the instructor's key. A prediction's failure names the first wrong
step and what the student predicted, never the simulated run. Pure Python (no torch); ex7.3
runs eight offline simulations of 100 requests on the trusted side (a few seconds).
"""

from __future__ import annotations

import random

from minipaged.checks._harness import ExerciseFailure
from minipaged.checks._spec import Spec, answers_shape, attempt, concept_spec, register, set_answered_by
from minipaged.sim import (
    A100_40GB,
    OPT_13B,
    CostModel,
    make_requests,
    offline_capacity,
    sample_requests,
    simulate,
)
from minipaged.sim.simulator import sustainable_rate as _sim_sustainable_rate

SPECS: dict = {}

# -- ex7.1: predict who runs (one workload per student) --------------------------------------

# (prompt_len, output_len, arrival time in s) of r0, r1, r2; and the engine's knobs
PREDICT_REQUESTS = [(6, 3, 0.0), (5, 2, 0.0), (4, 2, 0.030)]
PREDICT_KNOBS = {"max_num_batched_tokens": 8, "enable_chunked_prefill": True}
ARRIVAL_MARGIN_S = 0.004  # a variant's arrivals keep this far from every step's start


def request_text(k: int, request) -> str:
    p, o, t = request
    return f"r{k}: prompt {p} tokens, output {o} token{'s' if o != 1 else ''}, arrives at {t * 1e3:.0f} ms"


def reference_run(requests=PREDICT_REQUESTS):
    reqs = make_requests([(p, o) for p, o, _ in requests], [t for _, _, t in requests])
    return simulate(
        reqs, "paged", CostModel(OPT_13B, A100_40GB), record_trace=True, check=True, **PREDICT_KNOBS
    )


def reference_steps(requests=PREDICT_REQUESTS) -> list[dict]:
    """``{request id: tokens computed}`` of each step of the simulated run."""
    return [dict(s.scheduled) for s in reference_run(requests).trace.steps]


def requests_variant(rng: random.Random) -> list:
    """Three requests drawn by ``rng``: r0 at time 0, r2 arriving while the run is busy, no
    arrival within ``ARRIVAL_MARGIN_S`` of a step's start (so "arrived by the start of a
    step" is not a coin toss on paper), at most 7 steps in all."""
    while True:
        r1_at = rng.choice([0.0, round(rng.uniform(0.005, 0.045), 3)])
        r2_at = round(rng.uniform(max(r1_at, 0.005), 0.075), 3)
        requests = [
            (rng.randint(2, 10), rng.randint(1, 3), 0.0),
            (rng.randint(2, 8), rng.randint(1, 3), r1_at),
            (rng.randint(2, 8), rng.randint(1, 3), r2_at),
        ]
        steps = reference_run(requests).trace.steps
        starts = [0.0] + [s.time for s in steps[:-1]]
        lengths = [b.time - a for a, b in zip(starts, steps)]
        # NOTE: the engine idles until the next arrival when nothing is left to run: a step
        # that took longer than the others waited; such a run is left out
        busy = all(s.scheduled for s in steps) and max(lengths) < 1.05 * min(lengths)
        clear = all(abs(t - s) >= ARRIVAL_MARGIN_S for _, _, t in requests if t > 0 for s in starts)
        if busy and clear and len(steps) <= 7:
            return requests


def _steps_cases(rng):
    # NOTE: rng is None for the shipped notebook (the PREDICT_REQUESTS of its setup cell); a
    # student copy made with --seed gets the requests its seed draws, written into its setup cell
    return [PREDICT_REQUESTS if rng is None else requests_variant(rng)]


def observe_steps(case, predict_steps):
    """The student's prediction as data; a request listed with 0 tokens is dropped."""
    got = predict_steps()
    if type(got) is not list:
        return got
    return [{str(k): v for k, v in step.items() if v} if type(step) is dict else step for step in got]


register(
    SPECS,
    Spec(
        "ex7.1",
        "predict which requests run, with how many tokens, step by step",
        "predict_steps()",
        cases=_steps_cases,
        observe=observe_steps,
        expected=lambda case, key: reference_steps([tuple(r) for r in case]),
        describe=lambda c: (
            "the requests of PREDICT_REQUESTS: " + "; ".join(request_text(k, r) for k, r in enumerate(c))
        ),
        kind="prediction",
    ),
)
# NOTE: the workload is the setup cell's list (printed there); the spec has no events table
VARIANTS = {"ex7.1": ("PREDICT_REQUESTS", lambda r: request_text(0, r))}


# -- ex7.2: the sustainable rate of a latency curve ------------------------------------------


def ref_sustainable_rate(rates, latencies, factor) -> float:
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    if len(rates) != len(latencies) or not rates:
        raise ValueError("rates and latencies must be non-empty and of equal length")
    return _sim_sustainable_rate(list(rates), list(latencies), factor * latencies[0])


def _rate_cases(rng):
    cases = [
        ([1.0, 2.0, 3.0], [0.10, 0.15, 0.30], 2.0),  # crosses 0.2 between 2 and 3: 2 + 0.05/0.15
        ([1.0, 2.0], [0.10, 0.12], 2.0),  # never crosses: the highest rate (a lower bound)
        ([0.5], [0.3], 2.0),
    ]
    for _ in range(80):
        n = rng.randint(1, 8)
        rates, r = [], 0.0
        for _ in range(n):
            r += rng.choice([0.25, 0.5, 1.0, 2.5])
            rates.append(r)
        lat, latencies = rng.uniform(0.02, 0.2), []
        for _ in range(n):
            lat *= rng.choice([1.0, 1.05, 1.3, 1.8, 3.0, 0.95])
            latencies.append(round(lat, 6))
        cases.append((rates, latencies, rng.choice([1.5, 2.0, 3.0])))
    return cases + [
        ([1.0, 2.0], [0.1], 2.0),
        ([2.0, 1.0], [0.1, 0.2], 2.0),
        ([1.0, 2.0], [0.1, 0.3], 1.0),
        ([], [], 2.0),
    ]


register(
    SPECS,
    Spec(
        "ex7.2",
        "the sustainable request rate of a measured latency curve",
        "sustainable_rate(rates, latencies, factor)",
        cases=_rate_cases,
        observe=lambda c, fn: attempt(lambda: fn(list(c[0]), list(c[1]), c[2])),
        reference=lambda: (ref_sustainable_rate,),
        describe=lambda c: f"sustainable_rate(rates={c[0]}, latencies={c[1]}, factor={c[2]})",
        size=lambda c: (len(c[0]) != len(c[1]) or not c[0], len(c[0])),
        abs_tol=1e-12,
    ),
)


# -- ex7.3: why a speedup moves --------------------------------------------------------------

NUM_REQUESTS = 100  # ShareGPT-like, seed 0: enough for a queue on one A100-40GB
SAME_WITHIN = 0.10  # a ratio within 10% of the base ratio counts as "same"
CHANGES = {
    "max_num_seqs=8": "the server admits at most 8 sequences at once (was 256)",
    "max_num_seqs=32": "the server admits at most 32 sequences at once (was 256)",
    "flipped lengths": "every request's prompt and output lengths are swapped (long prompts, short answers)",
}


def capacity_ratio(change: str | None = None) -> float:
    """vLLM-like / Orca (Oracle) capacity on NUM_REQUESTS ShareGPT-like requests, OPT-13B, A100-40GB."""
    lengths = sample_requests("sharegpt", NUM_REQUESTS, 0)
    kw = {}
    if change == "flipped lengths":
        lengths = [(o, p) for p, o in lengths]
    elif change is not None:
        kw["max_num_seqs"] = int(change.split("=")[1])
    cm = CostModel(OPT_13B, A100_40GB)
    return offline_capacity(lengths, "paged", cm, **kw) / offline_capacity(lengths, "orca-oracle", cm, **kw)


def measured_directions() -> tuple[float, dict]:
    base = capacity_ratio()
    out = {}
    for change in CHANGES:
        r = capacity_ratio(change)
        rel = r / base - 1
        out[change] = (r, "same" if abs(rel) < SAME_WITHIN else "up" if rel > 0 else "down")
    return base, out


def _expected_directions(case, key) -> dict:
    _, measured = measured_directions()
    return {change: {"answer": direction, "how": "choice"} for change, (_, direction) in measured.items()}


# NOTE: predict first: the answers are recorded as data and graded once, against the
# simulator's measurement run on the trusted side; no message says which way a ratio went
# (a failure says how many predictions are wrong), so the measurement cannot be read off
# the check and copied back into the prediction.
register(
    SPECS,
    Spec(
        "ex7.3",
        "why a speedup moves: predict, then the simulator measures",
        "predict_directions()",
        cases=lambda rng: [None],
        observe=lambda case, fn: fn(),
        expected=_expected_directions,
        kind="secret",
        shape=answers_shape(list(CHANGES), {c: ("up", "down", "same") for c in CHANGES}),
    ),
)


# -- ex7.4: concept questions with a number or a choice ----------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
QUESTIONS = {
    "q1": (
        "the paper's 1.7-2.7x over Orca (Oracle) is a range over: 'a' request rates of one model, 'b' three models (OPT-13B, 66B, 175B), 'c' two datasets",
        ("a", "b", "c"),
    ),
    "q2": (
        "what the paper credits for vLLM's gain over Orca: 'continuous batching' or 'memory management'",
        ("continuous batching", "memory management"),
    ),
    "q3": (
        "Orca (Max) on OPT-13B / A100-40GB (14,526 KV slots, 2048 reserved per request): at most how many requests at once",
        None,
    ),
    "q4": ("vLLM-like / Orca (Oracle) capacity ratio with max_num_seqs = 8", None),
}
register(SPECS, concept_spec("ex7.4", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "CHANGES",
    "PREDICT_REQUESTS",
    "QUESTIONS",
    "SPECS",
    "VARIANTS",
    "ExerciseFailure",
    "reference_steps",
    "request_text",
    "capacity_ratio",
    "measured_directions",
    "ref_sustainable_rate",
    "reference_run",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex7.2": (
        "minipaged.sim.simulator:sustainable_rate",
        "minipaged.sim.simulator:RateSweep.sustainable_rate",
    ),
}
set_answered_by(SPECS, ANSWERED_BY)
