"""Checkers for chapter 09 exercises: a live server, requests that arrive while the engine runs.

Exercises (notebooks/exercises/ch09_live_server.ipynb)
    ex9.1 ``join_step(arrival, step_starts)``: the engine loop applies pending adds right
          before a step starts, so a request joins the first step that starts at or after
          its arrival (``None``: no such step).
    ex9.2 ``predict_latency()`` -> ``{request id: {"ttft_ms", "e2e_ms"}}`` of a small workload
          served by the loop with a step cost of ``STEP_COST`` (a prediction, worked on
          paper; one workload per student).
    ex9.3 ``serve(scheduler, requests, arrivals, step_cost)``: the engine loop itself (vLLM
          v1's ``EngineCoreProc.run_busy_loop`` in miniature, on a clock): adds between
          steps, idle until the next arrival, the first token at the end of the step that
          completes a prefill; measure: the check prints TTFT percentiles at three arrival
          rates.
    ex9.4 ``concept_answers()``: questions with a number or a choice (the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``): plain-data cases; ``observe`` builds
the scheduler and requests a case describes, calls the student's function and returns what
it returned or raised; the trusted side runs ``ref_serve`` (the same rules, written out, on
the package's v1 ``Scheduler``). A prediction's messages name the first wrong entry, never
the answer. Pure Python, no torch.
"""

from __future__ import annotations

import random

from minipaged.checks._scheduler_cases import arrivals_of
from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.core import Scheduler

SPECS: dict = {}


# -- ex9.1: which step a request joins -------------------------------------------------------


def ref_join_step(arrival: float, step_starts: list):
    if any(b < a for a, b in zip(step_starts, step_starts[1:])):
        raise ValueError(f"step_starts must be in increasing order, got {step_starts}")
    return next((i for i, t in enumerate(step_starts) if t >= arrival), None)


def _join_cases(rng):
    cases = [(0.0, [0.0]), (1.0, [0.0]), (0.5, []), (2.0, [1.0, 2.0, 3.0])]
    for _ in range(200):
        starts, t = [], 0.0
        for _ in range(rng.randint(0, 8)):
            t += rng.choice([0.0, 0.01, 0.02, 0.05])
            starts.append(round(t, 3))
        arrival = rng.choice(starts) if starts and rng.random() < 0.3 else round(rng.uniform(0, t + 0.05), 3)
        cases.append((arrival, starts))
    return cases + [(0.1, [0.0, 0.2, 0.1])]  # not in order: ValueError


register(
    SPECS,
    Spec(
        "ex9.1",
        "which step a request joins",
        "join_step(arrival, step_starts)",
        cases=_join_cases,
        observe=lambda c, fn: attempt(lambda: fn(c[0], list(c[1]))),
        reference=lambda: (ref_join_step,),
        describe=lambda c: f"join_step(arrival={c[0]}, step_starts={c[1]})",
        size=lambda c: len(c[1]),
    ),
)


# -- the engine loop on a clock (the reference of ex9.2 and ex9.3) ----------------------------


def ref_serve(scheduler, requests: list, arrivals: dict, step_cost: tuple) -> dict:
    """``{request id: {"ttft": s, "e2e": s}}``: before each step, every request that has
    arrived by the clock joins (in arrival order); an idle engine waits for the next arrival;
    a step of n tokens takes ``step_cost[0] + step_cost[1] * n``; a request's first token comes
    at the end of the step that completes its prefill, its last at the end of its last step."""
    c0, c1 = step_cost
    pending = sorted(requests, key=lambda r: arrivals[r.request_id])
    clock, out = 0.0, {}
    while pending or scheduler.has_unfinished_requests():
        while pending and arrivals[pending[0].request_id] <= clock:
            scheduler.add_request(pending.pop(0))
        if not scheduler.has_unfinished_requests():
            clock = arrivals[pending[0].request_id]  # idle: the loop waits for the next add
            continue
        step = scheduler.schedule()
        clock += c0 + c1 * sum(n for _, n in step.scheduled)
        sampled = {r.request_id: 1 for r, n in step.scheduled if r.num_computed_tokens + n >= r.num_tokens}
        for rid in sampled:
            out.setdefault(rid, {"ttft": clock - arrivals[rid]})
        for r in scheduler.update_from_output(step, sampled):
            if r.request_id in out:  # NOTE: a refused request (it can never fit) has no entry
                out[r.request_id]["e2e"] = clock - arrivals[r.request_id]
    return dict(sorted(out.items()))


def _build(case):
    k = dict(case["knobs"])
    sched = Scheduler(k.pop("num_blocks"), k.pop("block_size"), **k)
    reqs = arrivals_of([(rid, p, m, 0) for rid, p, m, _ in case["requests"]]).get(0, [])
    arrivals = {rid: t for rid, _, _, t in case["requests"]}
    return sched, reqs, arrivals


# -- ex9.2: predict TTFT and end-to-end latency (one workload per student) ----------------------

# (request id, prompt tokens, max_tokens, arrival in ms); the scheduler; a step costs
# STEP_COST[0] ms + STEP_COST[1] ms per token it computes
LATENCY_REQUESTS = [("A", 6, 3, 0), ("B", 5, 2, 5), ("C", 3, 2, 40)]
LATENCY_KNOBS = {"num_blocks": 16, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 8}
STEP_COST = (10, 1)


def reference_latency(requests=LATENCY_REQUESTS) -> dict:
    """``{id: {"ttft_ms", "e2e_ms"}}`` of ``ref_serve`` on ``requests`` (integer ms: exact)."""
    case = {"knobs": LATENCY_KNOBS, "requests": [tuple(r) for r in requests]}
    sched, reqs, arrivals = _build(case)
    got = ref_serve(sched, reqs, arrivals, STEP_COST)
    return {rid: {"ttft_ms": v["ttft"], "e2e_ms": v["e2e"]} for rid, v in got.items()}


def latency_request_row(req) -> str:
    rid, prompt, max_tokens, at = req
    return f"| {rid} | {prompt} | {max_tokens} | {at} |"


def latency_variant(rng) -> list:
    """Three requests drawn by ``rng``: the second arrives while the first is served, the third
    after a while; at most 12 steps in all."""
    while True:
        reqs = [
            ("A", rng.randint(3, 9), rng.randint(1, 4), 0),
            ("B", rng.randint(2, 8), rng.randint(1, 4), rng.randint(1, 15)),
            ("C", rng.randint(2, 6), rng.randint(1, 3), rng.randint(20, 70)),
        ]
        case = {"knobs": LATENCY_KNOBS, "requests": reqs}
        sched, rs, arrivals = _build(case)
        ref_serve(sched, rs, arrivals, STEP_COST)
        if sched.num_steps <= 12:
            return reqs


def _latency_cases(rng):
    # NOTE: rng is None for the shipped notebook (the requests of its setup cell); a student
    # copy made with --seed gets the requests its seed draws, written into its setup cell
    return [LATENCY_REQUESTS if rng is None else latency_variant(rng)]


register(
    SPECS,
    Spec(
        "ex9.2",
        "predict time to first token and end-to-end latency",
        "predict_latency()",
        cases=_latency_cases,
        observe=lambda case, fn: fn(),
        expected=lambda case, key: reference_latency(case),
        describe=lambda c: (
            f"predict_latency() for LATENCY_REQUESTS = {[tuple(r) for r in c]} (id, prompt, max_tokens, "
            f"arrival ms) on Scheduler({LATENCY_KNOBS}), a step costing {STEP_COST[0]} ms + {STEP_COST[1]} ms per token"
        ),
        kind="prediction",
        rel_tol=1e-9,
        abs_tol=1e-6,
    ),
)
VARIANTS = {
    "ex9.2": (
        "LATENCY_REQUESTS",
        latency_request_row,
        "| request | prompt tokens | max_tokens | arrives at (ms) |\n|---|---|---|---|",
    )
}


# -- ex9.3: the engine loop on a clock (measure) -------------------------------------------------


def _serve_cases(rng):
    cases = [
        {"knobs": {"num_blocks": 8, "block_size": 2, "max_num_seqs": 2, "max_num_batched_tokens": 8},
         "requests": [("r0", 3, 2, 0.0)], "cost": (0.01, 0.001)},
        {"knobs": {"num_blocks": 8, "block_size": 2, "max_num_seqs": 2, "max_num_batched_tokens": 8},
         "requests": [("r0", 3, 2, 0.0), ("r1", 2, 1, 0.5)], "cost": (0.01, 0.001)},
    ]  # fmt: skip
    for _ in range(40):
        n = rng.randint(1, 7)
        times = sorted(round(rng.uniform(0, 0.3), 4) for _ in range(n))
        reqs = [(f"r{i}", rng.randint(1, 20), rng.randint(1, 12), times[i]) for i in range(n)]
        bs = rng.choice([2, 4])
        knobs = {
            "num_blocks": max(rng.randint(12, 40), max(-(-(p + m) // bs) for _, p, m, _ in reqs)),
            "block_size": bs,
            "max_num_seqs": rng.randint(1, 6),
            "max_num_batched_tokens": rng.choice([8, 16, 32]),
        }
        cases.append({"knobs": knobs, "requests": reqs, "cost": (round(rng.uniform(0.005, 0.03), 4), 0.0005)})
    return cases


def observe_serve(case, fn):
    sched, reqs, arrivals = _build(case)
    return attempt(lambda: fn(sched, reqs, dict(arrivals), tuple(case["cost"])))


def _describe_serve(case) -> str:
    return (
        f"serve(Scheduler({case['knobs']}), requests (id, prompt, max_tokens, arrival s) = "
        f"{[tuple(r) for r in case['requests']]}, step_cost={tuple(case['cost'])})"
    )


SERVE_RATES = (2.0, 8.0, 16.0)  # requests per second, Poisson
SERVE_COST = (0.02, 0.0002)  # s per step + s per token


def _serve_report(serve) -> str:
    from minipaged.bench.goodput import percentile

    lines = []
    for rate in SERVE_RATES:
        rng = random.Random(0)
        t, reqs = 0.0, []
        for i in range(60):
            t += rng.expovariate(rate)
            reqs.append((f"r{i}", rng.randint(8, 64), rng.randint(8, 48), round(t, 4)))
        knobs = {"num_blocks": 256, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256}
        sched, rs, arrivals = _build({"knobs": knobs, "requests": reqs})
        got = serve(sched, rs, arrivals, SERVE_COST)
        ttft = [v["ttft"] * 1e3 for v in got.values()]
        lines.append(
            f"{rate:4.0f} requests/s: TTFT p50 {percentile(ttft, 50):6.0f} ms, p90 {percentile(ttft, 90):6.0f} ms\n"
        )
    return "".join(lines)


register(
    SPECS,
    Spec(
        "ex9.3",
        "the engine loop on a clock (measure)",
        "serve(scheduler, requests, arrivals, step_cost)",
        cases=_serve_cases,
        observe=observe_serve,
        reference=lambda: (ref_serve,),
        describe=_describe_serve,
        size=lambda c: (len(c["requests"]), sum(r[1] + r[2] for r in c["requests"])),
        report=_serve_report,
        rel_tol=1e-6,
        abs_tol=1e-9,
    ),
)


# -- ex9.4: concept questions ----------------------------------------------------------------

QUESTIONS = {
    "q1": (
        'a request arrives while step k runs: which step is it first in: `"k"`, `"k+1"` or `"k+2"`?',
        ("k", "k+1", "k+2"),
    ),
    "q2": (
        'a client hangs up mid-stream: are its blocks freed before the next step (`"yes"`) or when it would '
        'have finished (`"no"`)?',
        ("yes", "no"),
    ),
    "q3": [
        (
            "requests arrive at 6 per second and each spends 2 s in the server: how many are in it on average (Little's law)?",
            None,
        ),
        (
            "requests arrive at 10 per second and each spends 0.5 s in the server: how many are in it on average (Little's law)?",
            None,
        ),
    ],
    "q4": (
        'which process finds stop strings in vLLM v1\'s two-process server: `"engine core"` or `"api server"`?',
        ("engine core", "api server"),
    ),
}
register(SPECS, concept_spec("ex9.4", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "LATENCY_KNOBS",
    "LATENCY_REQUESTS",
    "QUESTIONS",
    "SERVE_COST",
    "SERVE_RATES",
    "SPECS",
    "STEP_COST",
    "VARIANTS",
    "reference_latency",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex9.2": ("minipaged.sim.simulator:simulate",),
    "ex9.3": ("minipaged.sim.simulator:simulate",),
}
set_answered_by(SPECS, ANSWERED_BY)
