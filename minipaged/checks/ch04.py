"""Checkers for chapter 04 exercises: continuous batching, the scheduler loop.

Exercises (notebooks/exercises/ch04_continuous_batching.ipynb)
    ex4.1 ``schedule_waiting(scheduler, token_budget)``: the admission loop: bring waiting
          requests into the running batch in arrival order while seats, tokens and KV
          blocks last (chunked prefill on).
    ex4.2 ``check_stop(request, max_model_len)``: does the newest token finish the request,
          and with which status (vLLM's order of checks).
    ex4.3 ``update_from_output(scheduler, scheduled, sampled_token_ids)``: after the model
          ran: advance, append tokens, finish requests and free their blocks.
    ex4.4 ``predict_steps()`` -> one ``{request_id: tokens}`` per step of ``PREDICT_RUN``
          (a prediction, worked on paper), compared with the scheduler's trace; the first
          difference is shown as the course's step picture (``viz.step_text``).
    ex4.5 ``serve(scheduler, arrivals)`` -> ``{request_id: finish step}``: the engine loop
          around the scheduler with a fake model; checked against ``trace.run_scheduler``
          on ``SERVE_WORKLOAD`` for several ``max_num_seqs``, then the measured mean
          finish step per ``max_num_seqs`` is printed (deterministic).
    ex4.6 ``concept_answers()``: the end-of-chapter questions with a number or a choice.

Reference: the package's ``minipaged.core.Scheduler`` itself. Each case builds the same
scheduler state twice (``_scheduler_cases.build``): the reference runs ``schedule()`` /
``_check_stop`` / ``update_from_output`` on one, the student's function acts on the
other (a subclass whose own method for the exercise is switched off), and the two states
are compared: queues, statuses, token counts, block tables, the free queue.
"""

from __future__ import annotations

import random

from minipaged.checks._harness import (
    check_step_predictions,
    exercise,
    expect_equal,
    expect_true,
    require_callable,
    run_cases,
)
from minipaged.checks._scheduler_cases import (
    EOS,
    SNAPSHOT_WHAT,
    Recipe,
    build,
    random_recipe,
    snapshot,
)
from minipaged.checks._spec import concept_spec, register
from minipaged.core import Request, RequestStatus, Scheduler
from minipaged.core.sched.utils import check_stop as pkg_check_stop

CHECKS: dict = {}


class _NoSchedule(Scheduler):
    def schedule(self):
        raise RuntimeError("scheduler.schedule() is switched off in this check: write the loop yourself")


class _NoUpdate(Scheduler):
    def update_from_output(self, output, sampled_token_ids):
        raise RuntimeError("scheduler.update_from_output() is switched off in this check")


def compare_snapshots(what: str, ref, stu) -> None:
    a, b = snapshot(ref), snapshot(stu)
    for key in a:
        expect_equal(f"{what}: {SNAPSHOT_WHAT[key]}", a[key], b[key])


def _pairs(scheduled) -> list:
    out = []
    for item in scheduled:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Request)):
            return [repr(item)]
        out.append((item[0].request_id, item[1]))
    return out


# -- ex4.1 -------------------------------------------------------------------------------


def _admission_cases(n: int) -> list[Recipe]:
    rng = random.Random("ex4.1")
    cases = []
    while len(cases) < n:
        recipe = random_recipe(rng, running=(0, 3), preempted=(0, 2), waiting=(1, 5), chunked=True)
        if not any(s.state != "running" for s in recipe.requests):
            continue
        ref = build(recipe)
        if ref.schedule().preempted:
            continue  # the running phase preempted: nothing is admitted in such a step
        cases.append(recipe)
    return cases


@exercise(CHECKS, "ex4.1", "the admission loop: waiting requests join the running batch")
def check_schedule_waiting(schedule_waiting) -> None:
    require_callable("ex4.1", schedule_waiting, "schedule_waiting(scheduler, token_budget)")

    def run_one(recipe: Recipe):
        ref = build(recipe)
        out = ref.schedule()  # running requests first, then admission: the reference
        admitted = set(map(id, out.admitted))
        first_phase = [(r, n) for r, n in out.scheduled if id(r) not in admitted]
        expected = [(r.request_id, n) for r, n in out.scheduled if id(r) in admitted]
        stu = build(recipe, _NoSchedule)
        for r, n in first_phase:  # the running phase, done for the student
            stu.kv_cache_manager.allocate_slots(r.request_id, n)
        budget = recipe.max_num_batched_tokens - sum(n for _, n in first_phase)
        got = schedule_waiting(stu, budget)
        expect_true(
            "schedule_waiting must return a list of (request, num_new_tokens) pairs",
            isinstance(got, list),
            f"got {type(got).__name__}",
        )
        expect_equal(f"admitted (request id, tokens) with token_budget={budget}", expected, _pairs(got))
        compare_snapshots("after admission", ref, stu)

    def describe(recipe: Recipe) -> str:
        return recipe.describe()

    run_cases("ex4.1", _admission_cases(150), run_one, size=lambda r: r.size, describe=describe)


# -- ex4.2 -------------------------------------------------------------------------------


def _stop_cases(n: int) -> list[dict]:
    rng = random.Random("ex4.2")
    cases = []
    for _ in range(n):
        prompt = rng.randint(1, 6)
        num_output = rng.randint(1, 6)
        last = rng.choice([EOS, 3, 4, 17, 17])
        cases.append(
            dict(
                prompt=prompt,
                outputs=[17 + i for i in range(num_output - 1)] + [last],
                max_tokens=rng.randint(num_output, num_output + 2),
                eos=rng.choice([EOS, EOS, None]),
                ignore_eos=rng.random() < 0.25,
                stop_token_ids=rng.sample([3, 4, 5], rng.randint(0, 2)),
                max_model_len=rng.choice([None, None, prompt + num_output, prompt + num_output + 1]),
            )
        )
    return cases


def _stop_request(c: dict) -> Request:
    from minipaged.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=c["max_tokens"], ignore_eos=c["ignore_eos"], stop_token_ids=list(c["stop_token_ids"])
    )
    r = Request("r", list(range(10, 10 + c["prompt"])), sampling_params=params, eos_token_id=c["eos"])
    r.output_token_ids.extend(c["outputs"])
    r.status = RequestStatus.RUNNING
    return r


@exercise(CHECKS, "ex4.2", "check_stop: does the newest token finish the request?")
def check_check_stop(check_stop) -> None:
    require_callable("ex4.2", check_stop, "check_stop(request, max_model_len)")

    def run_one(c):
        ref_req, stu_req = _stop_request(c), _stop_request(c)
        expected = pkg_check_stop(ref_req, c["max_model_len"])
        got = check_stop(stu_req, c["max_model_len"])
        expect_equal("return value (finished?)", expected, got)
        expect_equal("request.status afterwards", ref_req.status.name, stu_req.status.name)
        if expected:
            expect_true(
                "request.stop_reason must say why it finished (a non-empty string)",
                isinstance(stu_req.stop_reason, str) and bool(stu_req.stop_reason),
                f"got {stu_req.stop_reason!r}",
            )
        expect_equal(
            "request.output_token_ids (check_stop must not change them)",
            ref_req.output_token_ids,
            stu_req.output_token_ids,
        )

    def describe(c):
        return (
            f"prompt of {c['prompt']} tokens, output_token_ids={c['outputs']}, max_tokens={c['max_tokens']}, "
            f"eos_token_id={c['eos']}, ignore_eos={c['ignore_eos']}, stop_token_ids={c['stop_token_ids']}, "
            f"max_model_len={c['max_model_len']}"
        )

    run_cases(
        "ex4.2",
        _stop_cases(200),
        run_one,
        size=lambda c: (c["prompt"] + len(c["outputs"]),),
        describe=describe,
    )


# -- ex4.3 -------------------------------------------------------------------------------


def _sampled(recipe: Recipe, scheduled, seed: int) -> dict:
    """The fake model's tokens for every request whose prefill completes this step."""
    rng = random.Random(seed)
    return {
        r.request_id: rng.choice([EOS, 3, 4, 21, 22, 23])
        for r, n in scheduled
        if r.num_computed_tokens + n == r.num_tokens
    }


def _update_cases(n: int) -> list[tuple[Recipe, int]]:
    rng = random.Random("ex4.3")
    cases = []
    while len(cases) < n:
        recipe = random_recipe(
            rng, running=(1, 4), preempted=(0, 1), waiting=(0, 3), chunked=True, stops=True
        )
        ref = build(recipe)
        if not ref.schedule().scheduled:
            continue
        cases.append((recipe, rng.randrange(2**31)))
    return cases


@exercise(CHECKS, "ex4.3", "update_from_output: advance, append, finish, free")
def check_update_from_output(update_from_output) -> None:
    require_callable(
        "ex4.3", update_from_output, "update_from_output(scheduler, scheduled, sampled_token_ids)"
    )

    def run_one(case):
        recipe, seed = case
        ref = build(recipe)
        out = ref.schedule()
        sampled = _sampled(recipe, out.scheduled, seed)
        stu = build(recipe, _NoUpdate)
        stu_out = Scheduler.schedule(stu)
        assert _pairs(stu_out.scheduled) == _pairs(out.scheduled), "checker bug: twins diverged"
        expected = [r.request_id for r in ref.update_from_output(out, dict(sampled))]
        got = update_from_output(stu, list(stu_out.scheduled), dict(sampled))
        expect_true(
            "update_from_output must return the list of finished requests",
            isinstance(got, list),
            f"got {type(got).__name__}",
        )
        expect_equal(
            "finished request ids (in batch order)",
            expected,
            [r.request_id if isinstance(r, Request) else r for r in got],
        )
        compare_snapshots("after update_from_output", ref, stu)
        for rid, r in ref.requests.items():
            expect_equal(f"{rid}.output_token_ids", r.output_token_ids, stu.requests[rid].output_token_ids)

    def describe(case):
        recipe, seed = case
        ref = build(recipe)
        out = ref.schedule()
        sampled = _sampled(recipe, out.scheduled, seed)
        return (
            recipe.describe()
            + f"\n  scheduled this step: {_pairs(out.scheduled)}"
            + f"\n  sampled_token_ids: {sampled} (eos is {EOS})"
        )

    run_cases("ex4.3", _update_cases(150), run_one, size=lambda c: c[0].size, describe=describe)


# -- ex4.4: predict the steps ---------------------------------------------------------------

# (request id, prompt tokens, max_tokens, arrival step); the knobs of the scheduler
PREDICT_REQUESTS = [("A", 6, 4, 0), ("B", 5, 2, 0), ("C", 4, 3, 0), ("D", 5, 2, 1)]
PREDICT_KNOBS = {"num_blocks": 16, "block_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 8}


def _arrivals(requests) -> dict:
    from minipaged.sampling_params import SamplingParams

    arrivals: dict = {}
    for rid, prompt, max_tokens, at in requests:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(rid, [10 + i for i in range(prompt)], sampling_params=params)
        arrivals.setdefault(at, []).append(req)
    return arrivals


def reference_steps(requests=PREDICT_REQUESTS, **knobs):
    """The trace of the v1 ``Scheduler`` (fake model: token 1) on ``requests``."""
    from minipaged.core import Scheduler
    from minipaged.trace import run_scheduler

    k = dict(PREDICT_KNOBS, **knobs)
    sched = Scheduler(k.pop("num_blocks"), k.pop("block_size"), **k)
    return run_scheduler(sched, _arrivals(requests), next_token=lambda r: 1)


@exercise(CHECKS, "ex4.4", "predict which requests run, with how many tokens, step by step")
def check_predict_steps(predict_steps) -> None:
    require_callable("ex4.4", predict_steps, "predict_steps")
    from minipaged import viz

    trace = reference_steps()
    check_step_predictions(
        "ex4.4",
        predict_steps,
        "predict_steps",
        [dict(s.scheduled) for s in trace.steps],
        _scheduled,
        lambda i: viz.step_text(trace, i),
        "the scheduler's picture of this step",
    )


def _scheduled(step):
    """A predicted step as the reference writes it: request id (str) -> tokens, zeros dropped."""
    return {str(k): v for k, v in step.items() if v} if isinstance(step, dict) else step


# -- ex4.5: the engine loop, and what max_num_seqs buys ---------------------------------------

# (request id, prompt tokens, max_tokens, arrival step)
SERVE_WORKLOAD = [
    ("r0", 12, 9, 0),
    ("r1", 5, 3, 0),
    ("r2", 20, 6, 0),
    ("r3", 7, 12, 1),
    ("r4", 9, 4, 2),
    ("r5", 3, 8, 2),
    ("r6", 15, 5, 4),
    ("r7", 6, 10, 6),
]
SERVE_KNOBS = {"num_blocks": 40, "block_size": 4, "max_num_batched_tokens": 32}
SERVE_SEATS = (1, 2, 4, 8)


def _serve_case(max_num_seqs: int):
    from minipaged.core import Scheduler

    k = dict(SERVE_KNOBS)
    return Scheduler(k.pop("num_blocks"), k.pop("block_size"), max_num_seqs=max_num_seqs, **k)


@exercise(CHECKS, "ex4.5", "the engine loop, and what max_num_seqs buys (measure)")
def check_serve(serve) -> None:
    require_callable("ex4.5", serve, "serve(scheduler, arrivals)")
    from minipaged.checks._harness import Mismatch, _print, _redirect_stdout, _StringIO

    measured = {}

    def run_one(seats):
        ref = reference_steps(SERVE_WORKLOAD, max_num_seqs=seats, **SERVE_KNOBS)
        expected = {rid: info["finish_step"] for rid, info in ref.requests.items()}
        sched = _serve_case(seats)
        arrivals = _arrivals(SERVE_WORKLOAD)
        got = serve(sched, arrivals)
        if not isinstance(got, dict):
            raise Mismatch(f"serve() must return a dict request id -> finish step, got {type(got).__name__}")
        lost = sorted(r.request_id for reqs in arrivals.values() for r in reqs if not r.is_finished)
        if lost or sched.has_unfinished_requests():
            raise Mismatch(f"requests lost or unfinished when serve() returned: {lost or 'some'}")
        for reqs in arrivals.values():
            for r in reqs:
                expect_equal(f"{r.request_id}: output tokens", r.max_tokens, r.num_output_tokens)
        expect_equal("finish step of each request", expected, {str(k): v for k, v in got.items()})
        measured[seats] = (len(ref.steps), sum(expected.values()) / len(expected))

    verdict = _StringIO()
    with _redirect_stdout(verdict):
        run_cases("ex4.5", SERVE_SEATS, run_one, describe=lambda n: f"SERVE_WORKLOAD with max_num_seqs={n}")
    for seats, (steps, mean) in measured.items():  # the measurement, then the verdict line
        _print(f"max_num_seqs={seats}: {steps} steps, mean finish step {mean:.2f}")
    _print(verdict.getvalue(), end="")


# -- ex4.6: concept questions ----------------------------------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
QUESTIONS = {
    "q1": ("steps of the PREDICT_RUN with max_num_seqs=1 instead of 3", None),
    "q2": (
        "a finished request's blocks are reused by another request in the same step or the next: 'same' or 'next'",
        ("same", "next"),
    ),
    "q3": ("tokens in a step that runs 3 decodes and a 5-token prefill chunk", None),
    "q4": (
        "the request at the head of waiting does not fit; may the scheduler admit the one behind it? 'yes' or 'no'",
        ("yes", "no"),
    ),
}
SPECS: dict = {}
register(SPECS, concept_spec("ex4.6", "concept questions (numbers and choices)", QUESTIONS))


__all__ = ["CHECKS", "PREDICT_KNOBS", "PREDICT_REQUESTS", "SERVE_WORKLOAD", "compare_snapshots"]
