"""Checkers for chapter 05 exercises: scheduling under a token budget and memory pressure.

Exercises (notebooks/exercises/ch05_scheduling.ipynb)
    ex5.1 ``num_new_tokens(request, token_budget, enable_chunked_prefill,
          max_num_batched_tokens)``: how many tokens a request gets this step (chunked
          prefill, and the rule that keeps an over-long resumed request from starving).
    ex5.2 ``pick_victim(running, arrival_seq)``: the preemption victim, the latest arrival.
    ex5.3 ``preempt_recompute(scheduler, victim)``: recompute preemption: free, reset,
          requeue at the front in arrival order.
    ex5.4 ``schedule_running(scheduler, token_budget)``: the running phase of
          ``schedule()``: grow every running request, preempting the latest arrivals
          when the pool runs dry.
    ex5.5 ``predict_run()`` -> per step ``{"scheduled": {id: tokens}, "preempted": [ids]}``
          of ``PREDICT_REQUESTS`` on a tiny pool (a prediction, worked on paper; one
          workload per student).
    ex5.6 ``can_admit(scheduler, request) -> bool``: an admission rule the student designs,
          run through the ``PaperScheduler._can_admit`` hook on workloads; judged against
          a bar (at most half the default rule's preemptions, steps within 10%).
    ex5.7 ``concept_answers()``: the end-of-chapter questions with a number or a choice.

Each exercise is a spec (``minipaged.checks._spec``). Inputs: scheduler states as plain
data (``_scheduler_cases.Recipe`` as a dict), requests as numbers, workloads as tuples.
``observe`` builds the state in the student's kernel (a ``Scheduler`` whose own
``_preempt`` / ``schedule`` are switched off), calls the student's function once and
returns what it returned and the scheduler's state afterwards (queues, statuses, token
counts, block tables, free queue) as data; the trusted side runs the same ``observe`` with
the package's ``Scheduler`` (``_num_new_tokens``, ``_preempt`` in recompute mode,
``schedule``) and compares. ex5.5 is judged against the v1 scheduler's trace, computed on
the trusted side; its failure messages name the first wrong step, never the answer.

ex5.6 (design): the student's rule must run in the student's kernel, so ``observe`` runs
the whole workload there and returns every decision the rule made (in order) with the
counts it saw. The trusted side replays those decisions on its own ``PaperScheduler``
(so every count it judges is its own), checks the run's invariants (no request lost,
every ``max_tokens`` produced, FCFS admission, ``check_invariants`` every step, an end),
recomputes the default rule's steps and preemptions and applies the bar.

Failure mode: the student's code raising becomes data (the failure message shows it);
a result that is not plain data of the stated shape is wrong.
"""

from __future__ import annotations

import dataclasses

from minipaged.checks._harness import is_not_implemented
from minipaged.checks._scheduler_cases import Recipe, ReqSpec, arrivals_of, build, random_recipe, snapshot
from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.core import Request, Scheduler
from minipaged.core.sched import utils as sched_utils
from minipaged.core.sched.output import SchedulerOutput

SPECS: dict = {}


class _NoPreempt(Scheduler):
    """The scheduler handed to the student's code: its own preemption and loop are off."""

    def _preempt(self, request, out):
        raise RuntimeError("scheduler._preempt() is switched off in this check: write it yourself")

    def schedule(self):
        raise RuntimeError("scheduler.schedule() is switched off in this check")


def recipe_data(recipe: Recipe) -> dict:
    """A ``Recipe`` as plain data (the case that crosses into the kernel)."""
    return dataclasses.asdict(recipe)


def recipe_from(data: dict) -> Recipe:
    fields = {k: v for k, v in data.items() if k != "requests"}
    reqs = [ReqSpec(**dict(r, stop_token_ids=tuple(r.get("stop_token_ids", ())))) for r in data["requests"]]
    return Recipe(**fields, requests=reqs)


def _describe_recipe(data: dict) -> str:
    return recipe_from(data).describe()


def _size_recipe(data: dict):
    return recipe_from(data).size


def _rid(x):
    """A returned request as data: its id (an id given as a str is taken as is)."""
    if isinstance(x, Request) and type(x.request_id) is str:
        return x.request_id
    if type(x) is str:
        return x
    return {"not a request": type(x).__name__}


# -- ex5.1 -------------------------------------------------------------------------------


def _budget_cases(rng):
    cases = []
    for _ in range(300):
        mnbt = rng.choice([4, 8, 16])
        prompt = rng.randint(1, 3 * mnbt)
        num_output = rng.choice([0, 0, rng.randint(1, 2 * mnbt)])
        computed = rng.choice([0, 0, rng.randint(0, prompt + num_output - 1)])
        cases.append(
            dict(
                prompt=prompt,
                num_output=num_output,
                computed=computed,
                budget=rng.randint(1, mnbt),
                chunked=rng.random() < 0.5,
                mnbt=mnbt,
            )
        )
    return cases


def observe_num_new_tokens(c, fn):
    r = Request("r", list(range(10, 10 + c["prompt"])))
    r.output_token_ids.extend(range(60, 60 + c["num_output"]))
    r.num_computed_tokens = c["computed"]
    return attempt(lambda: fn(r, c["budget"], c["chunked"], c["mnbt"]))


def ref_num_new_tokens(request, token_budget, enable_chunked_prefill, max_num_batched_tokens) -> int:
    """The package's rule (``Scheduler._num_new_tokens``)."""
    left = request.num_tokens - request.num_computed_tokens
    return sched_utils.num_new_tokens(left, token_budget, enable_chunked_prefill, max_num_batched_tokens)


def _describe_budget(c) -> str:
    left = c["prompt"] + c["num_output"] - c["computed"]
    return (
        f"request with prompt={c['prompt']}, {c['num_output']} output tokens, num_computed_tokens="
        f"{c['computed']} ({left} left to compute); token_budget={c['budget']}, "
        f"enable_chunked_prefill={c['chunked']}, max_num_batched_tokens={c['mnbt']}"
    )


register(
    SPECS,
    Spec(
        "ex5.1",
        "the token budget: how many tokens a request gets this step",
        "num_new_tokens(request, token_budget, enable_chunked_prefill, max_num_batched_tokens)",
        cases=_budget_cases,
        observe=observe_num_new_tokens,
        reference=lambda: (ref_num_new_tokens,),
        describe=_describe_budget,
        size=lambda c: (c["mnbt"], c["prompt"] + c["num_output"]),
    ),
)


# -- ex5.2 -------------------------------------------------------------------------------


def _victim_cases(rng):
    cases = [[], []]  # an empty running list: a caller's bug, ValueError
    for _ in range(200):
        n = rng.randint(1, 8)
        ranks = rng.sample(range(3 * n + 2), n)
        order = list(range(n))
        if rng.random() < 0.7:
            rng.shuffle(order)  # batch order need not be arrival order
        cases.append([(f"r{ranks[i]}", ranks[i]) for i in order])
    return cases


def observe_pick_victim(case, fn):
    running = [Request(rid, [1]) for rid, _ in case]
    before = list(running)
    box = []
    call = attempt(lambda: box.append(fn(running, {rid: seq for rid, seq in case})))
    if "returned" in call:
        got = box[0]
        mine = [r for r in before if r is got]
        call = {"returned": mine[0].request_id if mine else {"not one of the requests in running": _rid(got)}}
    return {
        "call": call,
        "running afterwards (pick_victim only chooses)": [_rid(r) for r in running]
        if type(running) is list
        else "not a list",
    }


def ref_pick_victim(running: list, arrival_seq: dict) -> Request:
    """The package's rule: ``Scheduler.running`` is in arrival order and ``schedule()``
    preempts its last element."""
    if not running:
        raise ValueError("running must not be empty")
    return sorted(running, key=lambda r: arrival_seq[r.request_id])[-1]


register(
    SPECS,
    Spec(
        "ex5.2",
        "the preemption victim: the latest arrival",
        "pick_victim(running, arrival_seq)",
        cases=_victim_cases,
        observe=observe_pick_victim,
        reference=lambda: (ref_pick_victim,),
        describe=lambda case: (
            f"running (batch order) = {[rid for rid, _ in case]}, "
            f"arrival_seq = {{{', '.join(f'{rid!r}: {s}' for rid, s in case)}}}"
        ),
        size=len,
    ),
)


# -- ex5.3 -------------------------------------------------------------------------------


def _preempt_cases(rng):
    cases = []
    while len(cases) < 150:
        recipe = random_recipe(rng, running=(1, 4), preempted=(0, 2), waiting=(0, 3), chunked=None)
        if any(s.state == "running" for s in recipe.requests):
            cases.append(recipe_data(recipe))
    return cases


def observe_preempt(case, fn):
    """The victim is the last of ``running`` (vLLM v1's choice, ex5.2)."""
    s = build(recipe_from(case), _NoPreempt)
    victim = s.running[-1]
    call = attempt(lambda: fn(s, victim))
    return {"victim": victim.request_id, "call": call, "state": snapshot(s)}


def ref_preempt_recompute(scheduler, victim) -> None:
    scheduler.running.remove(victim)
    Scheduler._preempt(scheduler, victim, SchedulerOutput())


register(
    SPECS,
    Spec(
        "ex5.3",
        "preemption by recompute",
        "preempt_recompute(scheduler, victim)",
        cases=_preempt_cases,
        observe=observe_preempt,
        reference=lambda: (ref_preempt_recompute,),
        describe=lambda c: (
            _describe_recipe(c) + "\n  then: preempt_recompute(scheduler, scheduler.running[-1])"
        ),
        size=_size_recipe,
    ),
)


# -- ex5.4 -------------------------------------------------------------------------------


def _running_cases(rng):
    cases, n_preempting = [], 0
    while len(cases) < 150:
        recipe = random_recipe(rng, running=(1, 6), preempted=(0, 0), waiting=(0, 0), chunked=True)
        if not recipe.requests:
            continue
        preempts = bool(build(recipe).schedule().preempted)
        if not preempts and n_preempting < len(cases) // 2:
            continue  # keep at least half the cases under memory pressure
        n_preempting += preempts
        cases.append(recipe_data(recipe))
    return cases


def _pairs_data(scheduled):
    if type(scheduled) not in (list, tuple):
        return {"not a list of (request, n) pairs": type(scheduled).__name__}
    out = []
    for item in scheduled:
        if not (type(item) in (tuple, list) and len(item) == 2 and isinstance(item[0], Request)):
            return {"not a list of (request, n) pairs": type(item).__name__}
        out.append([_rid(item[0]), item[1]])
    return out


def observe_schedule_running(case, fn):
    s = build(recipe_from(case), _NoPreempt)
    box = []
    call = attempt(lambda: box.append(fn(s, case["max_num_batched_tokens"])))
    if "returned" in call:
        got = box[0]
        if type(got) is tuple and len(got) == 2:
            scheduled, preempted = got
            call = {
                "scheduled (request id, tokens), in batch order": _pairs_data(scheduled),
                "preempted request ids, in the order preempted": [_rid(r) for r in preempted]
                if type(preempted) in (list, tuple)
                else {"not a list": type(preempted).__name__},
            }
        else:
            call = {"returned": {"not a (scheduled, preempted) tuple": type(got).__name__}}
    return {"call": call, "state": snapshot(s)}


def ref_schedule_running(scheduler, token_budget):
    """The package's ``schedule()``: nothing waits, so it is the running phase alone."""
    scheduler.__class__ = Scheduler  # NOTE: the trusted side's twin: its methods back on
    out = scheduler.schedule()
    return list(out.scheduled), list(out.preempted)


register(
    SPECS,
    Spec(
        "ex5.4",
        "the running phase of schedule(), with preemption",
        "schedule_running(scheduler, token_budget)",
        cases=_running_cases,
        observe=observe_schedule_running,
        reference=lambda: (ref_schedule_running,),
        describe=lambda c: (
            _describe_recipe(c)
            + f"\n  then: schedule_running(scheduler, token_budget={c['max_num_batched_tokens']})"
        ),
        size=_size_recipe,
    ),
)


# -- ex5.5: predict a run with preemption (one workload per student) -------------------------

# (request id, prompt tokens, max_tokens, arrival step); the knobs of the v1 scheduler
PREDICT_REQUESTS = [("A", 4, 5, 0), ("B", 3, 4, 0), ("C", 2, 3, 1)]
PREDICT_KNOBS = {"num_blocks": 5, "block_size": 2, "max_num_seqs": 3, "max_num_batched_tokens": 8}
_PREDICT_MAX_STEPS = 12  # a variant stays small enough to work on paper


def reference_steps(requests=PREDICT_REQUESTS, knobs=PREDICT_KNOBS):
    """The trace of the v1 ``Scheduler`` (fake model: token 1) on ``requests``."""
    from minipaged.trace import run_scheduler

    k = dict(knobs)
    sched = Scheduler(k.pop("num_blocks"), k.pop("block_size"), **k)
    return run_scheduler(sched, arrivals_of(requests), next_token=lambda r: 1)


def reference_run(requests=PREDICT_REQUESTS) -> list[dict]:
    """Per step: ``{"scheduled": {id: tokens}, "preempted": [ids]}`` of the v1 scheduler."""
    trace = reference_steps([tuple(r) for r in requests])
    return [{"scheduled": dict(s.scheduled), "preempted": list(s.preempted_ids)} for s in trace.steps]


def predict_request_text(req) -> str:
    rid, prompt, max_tokens, at = req
    return f"{rid} arrives before step {at}: prompt {prompt} token{'' if prompt == 1 else 's'}, max_tokens {max_tokens}"


def predict_variant(rng) -> list:
    """Three requests on ``PREDICT_KNOBS``, drawn by ``rng``: each fits the pool alone, the
    run preempts at least once and takes at most ``_PREDICT_MAX_STEPS`` steps."""
    slots = PREDICT_KNOBS["num_blocks"] * PREDICT_KNOBS["block_size"]
    while True:
        reqs = []
        for rid, at in (("A", 0), ("B", 0), ("C", rng.randint(0, 2))):
            prompt = rng.randint(1, 5)
            reqs.append((rid, prompt, rng.randint(2, min(6, slots - prompt + 1)), at))
        trace = reference_steps(reqs)
        if len(trace.steps) <= _PREDICT_MAX_STEPS and any(s.preempted_ids for s in trace.steps):
            return reqs


def _predict_cases(rng):
    # NOTE: rng is None for the shipped notebook (the requests of its setup cell); a student
    # copy made with --seed gets the requests its seed draws, written into its setup cell
    return [PREDICT_REQUESTS if rng is None else predict_variant(rng)]


def _normalize_step(step):
    """A predicted step as the reference writes it: ids (str) -> tokens, zeros dropped."""
    if type(step) is not dict:
        return step
    scheduled, preempted = step.get("scheduled") or {}, step.get("preempted") or []
    return {
        "scheduled": {str(k): v for k, v in scheduled.items() if v} if type(scheduled) is dict else scheduled,
        "preempted": list(preempted) if type(preempted) in (list, tuple) else preempted,
    }


def observe_predict_run(case, fn):
    got = fn()
    return [_normalize_step(s) for s in got] if type(got) is list else got


register(
    SPECS,
    Spec(
        "ex5.5",
        "predict a run under memory pressure, step by step",
        "predict_run()",
        cases=_predict_cases,
        observe=observe_predict_run,
        expected=lambda case, key: reference_run(case),
        describe=lambda c: (
            "predict_run() for PREDICT_REQUESTS ("
            + "; ".join(predict_request_text(r) for r in c)
            + f") on Scheduler({PREDICT_KNOBS}); [i] is step i"
        ),
        kind="prediction",
    ),
)
VARIANTS = {"ex5.5": ("PREDICT_REQUESTS", predict_request_text)}


# -- ex5.6: design an admission rule, measured -----------------------------------------------

# (request id, prompt tokens, max_tokens, arrival step), arrival order
DESIGN_WORKLOAD = [
    ("r0", 9, 20, 0),
    ("r1", 4, 9, 0),
    ("r2", 5, 11, 0),
    ("r3", 16, 16, 1),
    ("r4", 15, 10, 3),
    ("r5", 7, 16, 4),
    ("r6", 13, 12, 5),
    ("r7", 11, 11, 5),
    ("r8", 9, 19, 6),
    ("r9", 8, 9, 6),
]
DESIGN_KNOBS = {"num_blocks": 24, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 32}
_MAX_STEPS = 2000
PREEMPTION_BAR = 0.5  # a rule's preemptions, all workloads together, at most this share of the default's
STEPS_MARGIN = 0.10  # and its steps (throughput) at most this much more than the default's
# NOTE: judged on totals over many random workloads, a sound rule clears the bar on every
# draw: the authored rule's totals over 200 are 1.04 +- 0.006 of the default's steps and
# 0.22 +- 0.04 of its preemptions. A bar per workload, over 12, failed it on 4% of draws:
# a rule that passed the local check could fail grading.
RANDOM_DESIGN_WORKLOADS = 200


class _Stop(Exception):
    """The rule's run cannot go on (the rule raised or returned a non-bool; a replay ran out)."""


def run_admission(rule, workload=DESIGN_WORKLOAD, knobs=None) -> dict:
    """Run ``workload`` on a ``PaperScheduler`` whose admission asks ``rule(scheduler,
    request)`` (None: the default, always), its watermark off and no groups (then it makes
    v1's first-chunk steps). Returns plain data: ``steps``, ``preemptions``, ``admitted``
    (first admissions, in order), ``decisions`` (what the rule answered, in order) and
    ``problem`` (None, or what broke: a livelock, a lost request, non-FCFS admission, a
    broken invariant, the rule raising)."""
    from minipaged.core import PaperScheduler

    decisions: list = []

    class _Rule(PaperScheduler):
        def _can_admit(self, request, computed_blocks):
            if rule is None:
                return True
            try:
                ok = rule(self, request)
            except Exception as e:
                if is_not_implemented(e):
                    raise
                raise _Stop(f"your rule raised {type(e).__name__}: {str(e)[:200]}") from None
            if type(ok) is not bool:
                raise _Stop(f"can_admit must return a bool, got {type(ok).__name__}")
            decisions.append(ok)
            return ok

    k = dict(DESIGN_KNOBS, **(knobs or {}))
    sched = _Rule(k.pop("num_blocks"), k.pop("block_size"), watermark=None, **k)
    arrivals = arrivals_of([tuple(w) for w in workload])
    everyone = [r for at in sorted(arrivals) for r in arrivals[at]]
    admitted, preemptions, step, problem = [], 0, 0, None
    last = max(arrivals, default=0)
    try:
        while step <= last or sched.has_unfinished_requests():
            if step >= _MAX_STEPS:
                raise _Stop(f"no end after {_MAX_STEPS} steps: livelock (requests that never finish)")
            for r in arrivals.get(step, ()):
                sched.add_request(r)
            try:
                out = sched.schedule()
            except RuntimeError as e:
                if "livelock" not in str(e):
                    raise
                raise _Stop(
                    f"step {step}: {e}: your rule refused a request while nothing was running, "
                    "so nothing can ever change"
                ) from None
            admitted += [r.request_id for r in out.admitted if r.request_id not in admitted]
            preemptions += len(out.preempted)
            sampled = {r.request_id: 1 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
            sched.update_from_output(out, sampled)
            try:
                sched.check_invariants()
            except AssertionError as e:
                raise _Stop(f"step {step}: the scheduler's invariants broke: {str(e)[:200]}") from None
            step += 1
    except _Stop as e:
        problem = str(e)
    if problem is None:
        lost = [r.request_id for r in everyone if not r.is_finished]
        short = [r.request_id for r in everyone if r.num_output_tokens != r.max_tokens]
        order = [r.request_id for r in everyone]
        if lost:
            problem = f"requests lost: {lost}"
        elif short:
            problem = f"requests finished without all their max_tokens tokens: {short}"
        elif admitted != order:
            problem = f"admission is not FCFS: first admitted in the order {admitted}, arrival order {order}"
    return {
        "steps": step,
        "preemptions": preemptions,
        "admitted": admitted,
        "decisions": decisions,
        "problem": problem,
    }


def _design_cases(rng):
    cases = [{"name": "DESIGN_WORKLOAD", "workload": DESIGN_WORKLOAD, "knobs": {}}]
    for k in range(RANDOM_DESIGN_WORKLOADS):
        n = rng.randint(1, 8)
        w = sorted(
            ((rng.randint(1, 14), rng.randint(1, 14), rng.randint(0, 5)) for _ in range(n)),
            key=lambda x: x[2],
        )
        workload = [(f"r{i}", p, o, at) for i, (p, o, at) in enumerate(w)]
        knobs = {"num_blocks": rng.randint(8, 16), "max_num_seqs": rng.randint(1, 6)}
        cases.append({"name": f"random workload {k}", "workload": workload, "knobs": knobs})
    return cases


def _describe_design(case) -> str:
    k = dict(DESIGN_KNOBS, **case["knobs"])
    workload = [tuple(w) for w in case["workload"]]
    return f"{case['name']}: Scheduler({k}), requests (id, prompt, max_tokens, arrival step): {workload}"


def observe_can_admit(case, can_admit):
    """The run of the student's rule on the case's workload (in the student's kernel)."""
    return run_admission(can_admit, case["workload"], case["knobs"])


def _replay(case, decisions) -> dict:
    """The trusted side's own run, the rule answering with the recorded ``decisions``."""
    it = iter(decisions)

    def recorded(scheduler, request):
        ok = next(it, None)
        if ok is None:
            raise RuntimeError("the replay ran out of your rule's decisions")
        return ok

    return run_admission(recorded, case["workload"], case["knobs"])


def judge_design(cases, expected, got) -> str | None:
    """The bar, on the trusted side: every run sound (replayed here from the rule's
    decisions), then at most ``PREEMPTION_BAR`` of the default's preemptions in all and at
    most ``STEPS_MARGIN`` more steps in all."""
    order = sorted(range(len(cases)), key=lambda i: (len(cases[i]["workload"]), i))
    mine = {}
    for pos, i in enumerate(order):
        head = (
            f"ex5.6 failed on case {pos + 1} of {len(cases)} (cases run smallest first):\n"
            f"    {_describe_design(cases[i])}"
        )
        rec = got[i]
        if "raised" in rec:
            return f"{head}\n  your code raised {rec['raised']}: {rec.get('_message', '')}"
        v = rec.get("value")
        decisions = v.get("decisions") if type(v) is dict else None
        if type(decisions) is not list or any(type(d) is not bool for d in decisions):
            return f"{head}\n  the run of your rule did not come back as data"
        if type(v.get("problem")) is str:
            return f"{head}\n  {v['problem']}"
        replay = _replay(cases[i], decisions)
        if replay["problem"]:
            return f"{head}\n  {replay['problem'].replace('your rule raised RuntimeError: ', '')}"
        if (len(replay["decisions"]), replay["steps"], replay["preemptions"]) != (
            len(decisions),
            v.get("steps"),
            v.get("preemptions"),
        ):
            return (
                f"{head}\n  your rule's run and the replay of its decisions differ: a rule may read "
                "the scheduler but must change nothing"
            )
        mine[i] = replay
    base_steps = sum(e["value"]["steps"] for e in expected)
    base_pre = sum(e["value"]["preemptions"] for e in expected)
    my_steps = sum(m["steps"] for m in mine.values())
    my_pre = sum(m["preemptions"] for m in mine.values())
    if my_pre > base_pre * PREEMPTION_BAR or my_steps > base_steps * (1 + STEPS_MARGIN):
        return (
            f"ex5.6: your rule runs, but does not clear the bar on the checker's {len(cases)} workloads: "
            f"at most {PREEMPTION_BAR:.0%} of the default rule's preemptions in all (default {base_pre}, "
            f"yours {my_pre}) and at most {STEPS_MARGIN:.0%} more steps in all (default {base_steps}, "
            f"yours {my_steps})"
        )
    return None


def _design_report(can_admit) -> str:
    base, mine = run_admission(None), run_admission(can_admit)
    return (
        f"DESIGN_WORKLOAD, default (always admit): {base['steps']} steps, {base['preemptions']} preemptions\n"
        f"DESIGN_WORKLOAD, your rule:              {mine['steps']} steps, {mine['preemptions']} preemptions\n"
    )


def _default_run(case, key) -> dict:
    return run_admission(None, case["workload"], case["knobs"])


register(
    SPECS,
    Spec(
        "ex5.6",
        "an admission rule of your design, measured (design)",
        "can_admit(scheduler, request)",
        cases=_design_cases,
        observe=observe_can_admit,
        expected=_default_run,
        describe=_describe_design,
        report=_design_report,
        verdict=judge_design,
    ),
)


# -- ex5.7: concept questions ----------------------------------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package.
# NOTE: q1/q2 name the shipped workload of ex5.5 (a student's copy may have another one)
QUESTIONS = {
    "q1": ("preemptions in the run of A (4, 5), B (3, 4) at step 0 and C (2, 3) at step 1", None),
    "q2": ("tokens the preempted request of that run computes when it is admitted again", None),
    "q3": ("which running request does v1 preempt: 'last' arrival or 'first' arrival", ("last", "first")),
    "q4": (
        "can the default rule (always admit) cause a preemption that a rule reserving every running request's max_tokens avoids: 'yes' or 'no'",
        ("yes", "no"),
    ),
}
register(SPECS, concept_spec("ex5.7", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "DESIGN_KNOBS",
    "DESIGN_WORKLOAD",
    "PREDICT_KNOBS",
    "PREDICT_REQUESTS",
    "QUESTIONS",
    "SPECS",
    "VARIANTS",
    "reference_run",
    "run_admission",
]


# what the package itself computes for each exercise: stripped from the student build.
# ``schedule()``'s running phase is ex5.4 (and, with its preemptions, the run ex5.5 asks
# for): in this chapter's build that loop is taken out of v1's and of the paper
# scheduler's ``schedule`` and the notebook's ``schedule_running`` runs in its place
# (``student_build.PHASE_PLUGS``), so ex5.6 still measures a rule on a paper scheduler that
# steps (on the notebook's running phase) and no loop of the package gives ex5.5's run.
_RUNNING = (
    "minipaged.core.sched.scheduler:Scheduler.schedule",
    "minipaged.core.sched.paper:PaperScheduler.schedule",
)
ANSWERED_BY = {
    "ex5.1": ("minipaged.core.sched.utils:num_new_tokens",),
    "ex5.3": (
        "minipaged.core.sched.scheduler:Scheduler._preempt",
        "minipaged.core.sched.paper:PaperScheduler._preempt",
    ),
    "ex5.4": _RUNNING,
    "ex5.5": ("minipaged.trace:run_scheduler", *_RUNNING),
}
set_answered_by(SPECS, ANSWERED_BY)
