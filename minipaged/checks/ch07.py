"""Checkers for chapter 07 exercises: serving at scale, on the simulator.

Exercises (notebooks/exercises/ch07_serving_at_scale.ipynb)
    ex7.1 ``predict_steps()`` -> one ``{request_id: tokens}`` per step of the small run
          ``PREDICT_RUN`` (a prediction, worked on paper), compared with ``simulate``'s trace.
    ex7.2 ``sustainable_rate(rates, latencies, factor)``: the request rate at which a
          measured latency curve first passes ``factor`` times its light-load value,
          checked against ``minipaged.sim.simulator.sustainable_rate``.
    ex7.3 ``predict_directions()`` -> ``{change: "up" | "down" | "same"}``: how the
          vLLM-like / Orca (Oracle) capacity ratio moves under each change of ``CHANGES``,
          graded by running the simulator.
    ex7.4 ``concept_answers()``: the end-of-chapter questions that have a number or a
          choice for an answer.

Reference: the simulator (``minipaged.sim``), run on the real scheduler; ex7.4 holds an
answer key here. Pure Python (no torch); ex7.3 runs eight offline simulations of 100
requests (a few seconds).
"""

from __future__ import annotations

import random

from minipaged.checks._harness import (
    ExerciseFailure,
    check_step_predictions,
    exercise,
    expect_close_to_reference,
    require_callable,
    run_cases,
)
from minipaged.checks._spec import Spec, answers_shape, concept_spec, register
from minipaged.checks.ch04 import _scheduled
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

CHECKS: dict = {}
SPECS: dict = {}

# -- ex7.1: predict who runs -----------------------------------------------------------------

# (prompt_len, output_len, arrival time in s) of r0, r1, r2; and the engine's knobs
PREDICT_REQUESTS = [(6, 3, 0.0), (5, 2, 0.0), (4, 2, 0.030)]
PREDICT_KNOBS = {"max_num_batched_tokens": 8, "enable_chunked_prefill": True}


def reference_run():
    reqs = make_requests([(p, o) for p, o, _ in PREDICT_REQUESTS], [t for _, _, t in PREDICT_REQUESTS])
    return simulate(
        reqs, "paged", CostModel(OPT_13B, A100_40GB), record_trace=True, check=True, **PREDICT_KNOBS
    )


@exercise(CHECKS, "ex7.1", "predict which requests run, with how many tokens, step by step")
def check_predict_steps(predict_steps) -> None:
    require_callable("ex7.1", predict_steps, "predict_steps")
    from minipaged import viz

    trace = reference_run().trace
    expected = [dict(s.scheduled) for s in trace.steps]

    check_step_predictions(
        "ex7.1",
        predict_steps,
        "predict_steps",
        expected,
        _scheduled,
        lambda i: viz.timeline_text(trace),
        "the simulator's run",
        "one per step of the run, until every request is done",
    )


# -- ex7.2: the sustainable rate of a latency curve ------------------------------------------


def ref_sustainable_rate(rates, latencies, factor) -> float:
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    if len(rates) != len(latencies) or not rates:
        raise ValueError("rates and latencies must be non-empty and of equal length")
    return _sim_sustainable_rate(list(rates), list(latencies), factor * latencies[0])


@exercise(CHECKS, "ex7.2", "the sustainable request rate of a measured latency curve")
def check_sustainable_rate(sustainable_rate) -> None:
    require_callable("ex7.2", sustainable_rate, "sustainable_rate")
    rng = random.Random("ex7.2")
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
    cases += [
        ([1.0, 2.0], [0.1], 2.0),
        ([2.0, 1.0], [0.1, 0.2], 2.0),
        ([1.0, 2.0], [0.1, 0.3], 1.0),
        ([], [], 2.0),
    ]

    def run_one(c):
        rates, latencies, factor = c
        expect_close_to_reference(
            "sustainable rate",
            lambda: ref_sustainable_rate(rates, latencies, factor),
            lambda: sustainable_rate(list(rates), list(latencies), factor),
            abs_tol=1e-12,
        )

    def describe(c):
        return f"sustainable_rate(rates={c[0]}, latencies={c[1]}, factor={c[2]})"

    run_cases(
        "ex7.2",
        cases,
        run_one,
        size=lambda c: (len(c[0]) != len(c[1]) or not c[0], len(c[0])),
        describe=describe,
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
    "CHECKS",
    "QUESTIONS",
    "SPECS",
    "PREDICT_REQUESTS",
    "ExerciseFailure",
    "capacity_ratio",
    "measured_directions",
    "ref_sustainable_rate",
    "reference_run",
]
