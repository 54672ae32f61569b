"""Checkers for chapter 04 exercises: continuous batching, the scheduler loop.

Exercises (notebooks/exercises/ch04_continuous_batching.ipynb)
    ex4.1 ``schedule_waiting(scheduler, token_budget)``: the admission loop: bring waiting
          requests into the running batch in arrival order while seats, tokens and KV
          blocks last (chunked prefill on).
    ex4.2 ``check_stop(request, max_model_len)``: does the newest token finish the request,
          and with which status (vLLM's order of checks).
    ex4.3 ``update_from_output(scheduler, scheduled, sampled_token_ids)``: after the model
          ran: advance, append tokens, finish requests and free their blocks.
    ex4.4 ``predict_steps()`` -> one ``{request_id: tokens}`` per step of the run of
          ``PREDICT_REQUESTS`` (a per-student workload; a prediction, worked on paper),
          judged against the scheduler's trace; a failure names the first wrong step.
    ex4.5 ``serve(scheduler, arrivals)`` -> ``{request_id: finish step}``: the engine loop
          around the scheduler with a fake model; judged against ``trace.run_scheduler`` on
          ``SERVE_WORKLOAD`` for several ``max_num_seqs`` and on seeded workloads; the
          local check then prints the measured steps and mean finish step per
          ``max_num_seqs`` (deterministic).
    ex4.6 ``concept_answers()``: the end-of-chapter questions (answers in the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``). A case is plain data: a scheduler
state as a ``Recipe`` (``_scheduler_cases.recipe_data``), a request's tokens and sampling
parameters, or a workload. ``observe`` (the student's kernel) builds the real
``minipaged.core.Scheduler`` / ``Request`` the case describes (``_scheduler_cases.build``:
deterministic, down to block ids) with the scheduler's own method for the exercise
switched off, runs the student's function on it, and returns what can be seen afterwards
as data: what it returned, the queues, statuses, token counts, block tables and the free
queue (``snapshot_data``), the output tokens. The trusted side builds the same state,
runs the package's scheduler (``schedule()`` / ``check_stop`` / ``update_from_output`` /
``run_scheduler``) and compares. What the case needs that only the reference knows (ex4.1:
the running phase of the step, done before admission; ex4.3: the step ``schedule()`` made,
replayed in the kernel by ``_replay_step``) is computed on the trusted side and sent as
part of the case, never the answer. In this chapter's student build ``schedule()`` admits
with the notebook's ``schedule_waiting`` and ``update_from_output`` is the notebook's (see
``ANSWERED_BY`` at the end): ex4.5's loop drives that scheduler, when graded and locally.

Failure mode: the student's code raising becomes data, reported with the smallest case.
"""

from __future__ import annotations

from minipaged.checks._harness import expect_equal
from minipaged.checks._scheduler_cases import (
    EOS,
    SNAPSHOT_WHAT,
    arrivals_of,
    build,
    random_recipe,
    recipe_data,
    recipe_from_data,
    snapshot,
    snapshot_data,
)
from minipaged.checks._spec import Spec, concept_spec, register, set_answered_by
from minipaged.core import Request, RequestStatus, Scheduler
from minipaged.core.sched.utils import check_stop as pkg_check_stop

SPECS: dict = {}


class _NoSchedule(Scheduler):
    def schedule(self):
        raise RuntimeError("scheduler.schedule() is switched off in this check: write the loop yourself")


class _NoUpdate(Scheduler):
    def update_from_output(self, output, sampled_token_ids):
        raise RuntimeError("scheduler.update_from_output() is switched off in this check")


def compare_snapshots(what: str, ref, stu) -> None:
    """In-process comparison of two schedulers' snapshots (chapter 05's old-style checks)."""
    a, b = snapshot(ref), snapshot(stu)
    for key in a:
        expect_equal(f"{what}: {SNAPSHOT_WHAT[key]}", a[key], b[key])


def _pairs(scheduled) -> list:
    out = []
    for item in scheduled:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Request)):
            return [repr(item)[:200]]
        out.append((item[0].request_id, item[1]))
    return out


def _returned_pairs(got):
    """What an admission returned, as data: ``[[request id, n], ...]``."""
    if type(got) is not list:
        return {"not a list of (request, num_new_tokens) pairs": type(got).__name__}
    return _pairs(got)


# -- ex4.1 -------------------------------------------------------------------------------

ADMITTED = "admitted (request id, num_new_tokens), in order"


def _admission_cases(rng, n: int = 150) -> list:
    cases = []
    while len(cases) < n:
        recipe = random_recipe(rng, running=(0, 3), preempted=(0, 2), waiting=(1, 5), chunked=True)
        if not any(s.state != "running" for s in recipe.requests):
            continue
        out = build(recipe).schedule()
        if out.preempted:
            continue  # the running phase preempted: nothing is admitted in such a step
        admitted = set(map(id, out.admitted))
        running_phase = [[r.request_id, n] for r, n in out.scheduled if id(r) not in admitted]
        cases.append({"recipe": recipe_data(recipe), "running phase": running_phase})
    return cases


def _admission_budget(case) -> int:
    return case["recipe"]["max_num_batched_tokens"] - sum(n for _, n in case["running phase"])


def observe_schedule_waiting(case, schedule_waiting) -> dict:
    s = build(recipe_from_data(case["recipe"]), _NoSchedule)
    for rid, n in case["running phase"]:  # the first half of the step, done for the student
        s.kv_cache_manager.allocate_slots(rid, n)
    got = schedule_waiting(s, _admission_budget(case))
    return {ADMITTED: _returned_pairs(got), **snapshot_data(s)}


def expected_admission(case, key) -> dict:
    s = build(recipe_from_data(case["recipe"]))
    out = s.schedule()  # the running phase, then admission: the package's scheduler
    admitted = set(map(id, out.admitted))
    return {ADMITTED: [(r.request_id, n) for r, n in out.scheduled if id(r) in admitted], **snapshot_data(s)}


def _describe_admission(case) -> str:
    return (
        recipe_from_data(case["recipe"]).describe()
        + f"\n  the running phase (done before your function): allocate_slots for {case['running phase']}"
        + f"\n  schedule_waiting(scheduler, token_budget={_admission_budget(case)})"
    )


register(
    SPECS,
    Spec(
        "ex4.1",
        "the admission loop: waiting requests join the running batch",
        "schedule_waiting(scheduler, token_budget)",
        cases=_admission_cases,
        observe=observe_schedule_waiting,
        expected=expected_admission,
        describe=_describe_admission,
        size=lambda c: recipe_from_data(c["recipe"]).size,
    ),
)


# -- ex4.2 -------------------------------------------------------------------------------


def _stop_cases(rng, n: int = 200) -> list[dict]:
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


def observe_check_stop(c, check_stop) -> dict:
    r = _stop_request(c)
    got = check_stop(r, c["max_model_len"])
    status = r.status
    finished = type(status) is RequestStatus and status.name.startswith("FINISHED")
    return {
        "return value (finished?)": got,
        "request.status afterwards": status.name if type(status) is RequestStatus else repr(status)[:100],
        "request.stop_reason says why it finished (a non-empty string)": (
            type(r.stop_reason) is str and r.stop_reason != "" if finished else None
        ),
        "request.output_token_ids (check_stop must not change them)": r.output_token_ids,
    }


def _describe_stop(c) -> str:
    return (
        f"prompt of {c['prompt']} tokens, output_token_ids={c['outputs']}, max_tokens={c['max_tokens']}, "
        f"eos_token_id={c['eos']}, ignore_eos={c['ignore_eos']}, stop_token_ids={c['stop_token_ids']}, "
        f"max_model_len={c['max_model_len']}"
    )


register(
    SPECS,
    Spec(
        "ex4.2",
        "check_stop: does the newest token finish the request?",
        "check_stop(request, max_model_len)",
        cases=_stop_cases,
        observe=observe_check_stop,
        reference=lambda: (pkg_check_stop,),
        describe=_describe_stop,
        size=lambda c: (c["prompt"] + len(c["outputs"]),),
    ),
)


# -- ex4.3 -------------------------------------------------------------------------------


def _sampled(scheduled, seed: int) -> dict:
    """The fake model's tokens for every request whose prefill completes this step."""
    import random

    rng = random.Random(seed)
    return {
        r.request_id: rng.choice([EOS, 3, 4, 21, 22, 23])
        for r, n in scheduled
        if r.num_computed_tokens + n == r.num_tokens
    }


def _update_cases(rng, n: int = 150) -> list:
    cases = []
    while len(cases) < n:
        recipe = random_recipe(
            rng, running=(1, 4), preempted=(0, 1), waiting=(0, 3), chunked=True, stops=True
        )
        out = build(recipe).schedule()
        if not out.scheduled or out.preempted:
            continue  # NOTE: a step without preemption: the kernel replays it (_replay_step)
        step = [[r.request_id, n] for r, n in out.scheduled]
        cases.append({"recipe": recipe_data(recipe), "seed": rng.randrange(2**31), "scheduled": step})
    return cases


def _replay_step(s: Scheduler, scheduled) -> list:
    """The step ``schedule()`` made (computed on the trusted side, sent in the case), done
    again on ``s`` in batch order: each request's slots for its tokens, a waiting one moved
    to running. The kernel never runs a ``schedule()`` for ex4.3 (in this chapter's student
    build its admission is the notebook's ex4.1). -> the ``(request, n)`` pairs."""
    pairs = []
    for rid, n in scheduled:
        request = s.requests[rid]
        if request in s.waiting:
            s.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            s.running.append(request)
        if s.kv_cache_manager.allocate_slots(request, n) is None:
            raise RuntimeError(f"checker bug: the replayed step does not fit ({rid}, {n})")
        pairs.append((request, n))
    s.finished_req_ids = set()
    return pairs


FINISHED = "finished request ids (in batch order)"
OUTPUTS = "output_token_ids of every request of the step"


def _after_update(s: Scheduler, everyone: dict, finished) -> dict:
    if type(finished) is list:
        ids = [r.request_id if type(r) is Request else r for r in finished]
    else:
        ids = {"not a list of the finished requests": type(finished).__name__}
    return {
        FINISHED: ids,
        **snapshot_data(s),
        OUTPUTS: {rid: list(r.output_token_ids) for rid, r in sorted(everyone.items())},
    }


def observe_update_from_output(case, update_from_output) -> dict:
    s = build(recipe_from_data(case["recipe"]), _NoUpdate)
    scheduled = _replay_step(s, case["scheduled"])
    sampled = _sampled(scheduled, case["seed"])
    everyone = dict(s.requests)
    got = update_from_output(s, list(scheduled), dict(sampled))
    return _after_update(s, everyone, got)


def expected_update(case, key) -> dict:
    s = build(recipe_from_data(case["recipe"]))
    out = s.schedule()
    sampled = _sampled(out.scheduled, case["seed"])
    everyone = dict(s.requests)
    return _after_update(s, everyone, list(s.update_from_output(out, dict(sampled))))


def _describe_update(case) -> str:
    recipe = recipe_from_data(case["recipe"])
    out = build(recipe).schedule()
    return (
        recipe.describe()
        + f"\n  scheduled this step: {_pairs(out.scheduled)}"
        + f"\n  sampled_token_ids: {_sampled(out.scheduled, case['seed'])} (eos is {EOS})"
    )


register(
    SPECS,
    Spec(
        "ex4.3",
        "update_from_output: advance, append, finish, free",
        "update_from_output(scheduler, scheduled, sampled_token_ids)",
        cases=_update_cases,
        observe=observe_update_from_output,
        expected=expected_update,
        describe=_describe_update,
        size=lambda c: recipe_from_data(c["recipe"]).size,
    ),
)


# -- ex4.4: predict the steps (one workload per student) --------------------------------------

# (request id, prompt tokens, max_tokens, arrival step): the shipped notebook's; a student
# copy made with --seed gets the requests its seed draws (``predict_requests_variant``)
PREDICT_REQUESTS = [("A", 6, 4, 0), ("B", 5, 2, 0), ("C", 4, 3, 0), ("D", 5, 2, 1)]
PREDICT_KNOBS = {"num_blocks": 16, "block_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 8}


def reference_steps(requests=PREDICT_REQUESTS, **knobs):
    """The trace of the v1 ``Scheduler`` (fake model: token 1) on ``requests``."""
    from minipaged.trace import run_scheduler

    k = dict(PREDICT_KNOBS, **knobs)
    sched = Scheduler(k.pop("num_blocks"), k.pop("block_size"), **k)
    return run_scheduler(sched, arrivals_of(requests), next_token=lambda r: 1)


def predicted_steps(requests) -> list:
    """The steps of the run of ``requests`` (trusted side): request id -> tokens, per step."""
    return [{str(k): v for k, v in dict(s.scheduled).items()} for s in reference_steps(requests).steps]


def predict_requests_variant(rng) -> list:
    """Four requests A-D (in arrival order, arriving before steps 0-2) whose run on
    ``PREDICT_KNOBS`` takes 4 to 7 steps and chunks at least one prompt, drawn by ``rng``."""
    while True:
        arrive = sorted(rng.choice([0, 0, 1, 2]) for _ in range(4))
        reqs = [(rid, rng.randint(2, 8), rng.randint(1, 4), at) for rid, at in zip("ABCD", arrive)]
        steps = predicted_steps(reqs)
        prompts = {rid: p for rid, p, _, _ in reqs}
        chunked = any(steps[0].get(rid, p) < p for rid, p in prompts.items() if rid in steps[0])
        if 4 <= len(steps) <= 7 and chunked:
            return reqs


def predict_request_row(req) -> str:
    rid, prompt, max_tokens, at = req
    return f"| {rid} | {prompt} | {max_tokens} | {at} |"


def _scheduled(step):
    """A predicted step as the reference writes it: request id (str) -> tokens, zeros dropped."""
    return {str(k): v for k, v in step.items() if v} if isinstance(step, dict) else step


def observe_predict_steps(case, predict_steps):
    got = predict_steps()
    return [_scheduled(step) for step in got] if type(got) is list else got


register(
    SPECS,
    Spec(
        "ex4.4",
        "predict which requests run, with how many tokens, step by step",
        "predict_steps()",
        cases=lambda rng: [PREDICT_REQUESTS if rng is None else predict_requests_variant(rng)],
        observe=observe_predict_steps,
        expected=lambda case, key: predicted_steps([tuple(r) for r in case]),
        describe=lambda c: (
            f"the requests of PREDICT_REQUESTS on Scheduler({PREDICT_KNOBS}): "
            + "; ".join(f"{r} (prompt {p}, max_tokens {m}, arrives before step {a})" for r, p, m, a in c)
        ),
        kind="prediction",
    ),
)
VARIANTS = {
    "ex4.4": (
        "PREDICT_REQUESTS",
        predict_request_row,
        "| request | prompt tokens | max_tokens | arrives before step |\n|---|---|---|---|",
    )
}


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


def _serve_scheduler(knobs: dict, max_num_seqs: int) -> Scheduler:
    k = dict(knobs)
    # NOTE: first-chunk admission, as ex4.1 teaches: in the student build the notebook's
    # schedule_waiting is this scheduler's admission (it reserves no whole prompt)
    return Scheduler(
        k.pop("num_blocks"),
        k.pop("block_size"),
        max_num_seqs=max_num_seqs,
        scheduler_reserve_full_isl=False,
        **k,
    )


def ref_serve(scheduler, arrivals: dict) -> dict:
    """The package's driver: ``trace.run_scheduler`` with token 1 for every sample."""
    from minipaged.trace import run_scheduler

    trace = run_scheduler(scheduler, arrivals, next_token=lambda r: 1)
    return {rid: info["finish_step"] for rid, info in trace.requests.items()}


def _serve_cases(rng) -> list:
    cases = [{"workload": SERVE_WORKLOAD, "knobs": SERVE_KNOBS, "max_num_seqs": s} for s in SERVE_SEATS]
    while len(cases) < 30:
        knobs = {
            "num_blocks": rng.randint(6, 40),
            "block_size": rng.choice([2, 4]),
            "max_num_batched_tokens": rng.choice([8, 16, 32]),
        }
        cap = knobs["num_blocks"] * knobs["block_size"]
        workload = []
        for k in range(rng.randint(1, 6)):
            prompt = rng.randint(1, min(16, cap - 1))
            workload.append((f"r{k}", prompt, rng.randint(1, min(10, cap - prompt)), rng.randint(0, 6)))
        case = {"workload": workload, "knobs": knobs, "max_num_seqs": rng.randint(1, 4)}
        try:
            ref_serve(_serve_scheduler(knobs, case["max_num_seqs"]), arrivals_of(workload))
        except (ValueError, RuntimeError):
            continue  # a workload the scheduler refuses: not a case for the engine loop
        cases.append(case)
    return cases


def observe_serve(case, serve) -> dict:
    s = _serve_scheduler(case["knobs"], case["max_num_seqs"])
    arrivals = arrivals_of([tuple(r) for r in case["workload"]])
    got = serve(s, arrivals)
    everyone = [r for reqs in arrivals.values() for r in reqs]
    return {
        "finish step of each request": {str(k): v for k, v in got.items()} if type(got) is dict else got,
        "requests lost or unfinished when serve() returned": sorted(
            r.request_id for r in everyone if not r.is_finished
        ),
        "scheduler.has_unfinished_requests() afterwards": bool(s.has_unfinished_requests()),
        "output tokens of each request": {r.request_id: r.num_output_tokens for r in everyone},
    }


def _serve_report(serve) -> str:
    lines = []
    for seats in SERVE_SEATS:
        finish = serve(_serve_scheduler(SERVE_KNOBS, seats), arrivals_of(SERVE_WORKLOAD))
        steps = max(finish.values()) + 1
        lines.append(
            f"max_num_seqs={seats}: {steps} steps, mean finish step {sum(finish.values()) / len(finish):.2f}\n"
        )
    return "".join(lines)


def _describe_serve(case) -> str:
    name = "SERVE_WORKLOAD" if case["workload"] == [list(r) for r in SERVE_WORKLOAD] else "the workload"
    return (
        f"{name} {[tuple(r) for r in case['workload']]} (request id, prompt tokens, max_tokens, arrival step) "
        f"on Scheduler({case['knobs']}, max_num_seqs={case['max_num_seqs']}, scheduler_reserve_full_isl=False)"
    )


register(
    SPECS,
    Spec(
        "ex4.5",
        "the engine loop, and what max_num_seqs buys (measure)",
        "serve(scheduler, arrivals)",
        cases=_serve_cases,
        observe=observe_serve,
        reference=lambda: (ref_serve,),
        describe=_describe_serve,
        size=lambda c: (len(c["workload"]), sum(p + m for _, p, m, _ in c["workload"])),
        report=_serve_report,
    ),
)


# -- ex4.6: concept questions ----------------------------------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
QUESTIONS = {
    "q1": (
        "steps of the ex4.4 scheduler with max_num_seqs=1 on A(6, 4, 0), B(5, 2, 0), C(4, 3, 0), D(5, 2, 1)",
        None,
    ),
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
register(SPECS, concept_spec("ex4.6", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "PREDICT_KNOBS",
    "PREDICT_REQUESTS",
    "SERVE_KNOBS",
    "SERVE_WORKLOAD",
    "SPECS",
    "VARIANTS",
    "compare_snapshots",
]


# what the package itself computes for each exercise: stripped from the student build.
# ``schedule()`` answers ex4.1 with its admission loop: in this chapter's build only that
# loop is taken out of v1's ``Scheduler.schedule`` and the notebook's ``schedule_waiting``
# runs in its place (``student_build.PHASE_PLUGS``); its running phase stays, as every
# check here needs a scheduler that steps. The paper scheduler (the same decisions without
# groups or a watermark) is stripped whole: nothing in this chapter steps it.
_SCHEDULE = (
    "minipaged.core.sched.scheduler:Scheduler.schedule",
    "minipaged.core.sched.paper:PaperScheduler.schedule",
    "minipaged.core.sched.paper:PaperScheduler._admit_next",
)
_UPDATE = (
    "minipaged.core.sched.scheduler:Scheduler.update_from_output",
    "minipaged.core.sched.paper:PaperScheduler.update_from_output",
)
ANSWERED_BY = {
    "ex4.1": _SCHEDULE,
    "ex4.2": ("minipaged.core.sched.utils:check_stop",),
    "ex4.3": _UPDATE,
    # a run of the v1 scheduler: run_scheduler's loop, or a loop of schedule() and
    # update_from_output() (the notebook's own ex4.1 and ex4.3 in this build)
    "ex4.4": ("minipaged.trace:run_scheduler", *_SCHEDULE, *_UPDATE),
    "ex4.5": ("minipaged.trace:run_scheduler", *_SCHEDULE, *_UPDATE),
}
set_answered_by(SPECS, ANSWERED_BY)
