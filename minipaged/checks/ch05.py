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

Reference: the package's ``Scheduler`` (``_num_new_tokens``, ``_preempt`` in recompute
mode, ``schedule``), run on a twin of the state the student's code gets; ex5.2's rule
(highest ``arrival_seq``) is what ``Scheduler._preempt`` does with its arrival-ordered
``running`` list, and is checked on shuffled lists here.
"""

from __future__ import annotations

import random

from minipaged.checks._harness import (
    Mismatch,
    exercise,
    expect_equal,
    expect_true,
    require_callable,
    run_cases,
)
from minipaged.checks._scheduler_cases import Recipe, build, random_recipe
from minipaged.checks.ch04 import _pairs, compare_snapshots
from minipaged.core import EngineScheduler, Request
from minipaged.core.sched.output import SchedulerOutput

CHECKS: dict = {}


class _NoPreempt(EngineScheduler):
    def _preempt(self, out):
        raise RuntimeError("scheduler._preempt() is switched off in this check: write it yourself")

    def schedule(self):
        raise RuntimeError("scheduler.schedule() is switched off in this check")


# -- ex5.1 -------------------------------------------------------------------------------


@exercise(CHECKS, "ex5.1", "the token budget: how many tokens a request gets this step")
def check_num_new_tokens(num_new_tokens) -> None:
    require_callable(
        "ex5.1",
        num_new_tokens,
        "num_new_tokens(request, token_budget, enable_chunked_prefill, max_num_batched_tokens)",
    )
    rng = random.Random("ex5.1")
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

    def make(c) -> Request:
        r = Request("r", list(range(10, 10 + c["prompt"])))
        r.output_token_ids.extend(range(60, 60 + c["num_output"]))
        r.num_computed_tokens = c["computed"]
        return r

    def run_one(c):
        ref = EngineScheduler(64, 16, max_num_batched_tokens=c["mnbt"], enable_chunked_prefill=c["chunked"])
        expected = ref._num_new_tokens(make(c), c["budget"])
        got = num_new_tokens(make(c), c["budget"], c["chunked"], c["mnbt"])
        expect_equal("tokens to schedule (0 = it must wait)", expected, got)

    def describe(c):
        left = c["prompt"] + c["num_output"] - c["computed"]
        return (
            f"request with prompt={c['prompt']}, {c['num_output']} output tokens, num_computed_tokens="
            f"{c['computed']} ({left} left to compute); token_budget={c['budget']}, "
            f"enable_chunked_prefill={c['chunked']}, max_num_batched_tokens={c['mnbt']}"
        )

    run_cases(
        "ex5.1", cases, run_one, size=lambda c: (c["mnbt"], c["prompt"] + c["num_output"]), describe=describe
    )


# -- ex5.2 -------------------------------------------------------------------------------


@exercise(CHECKS, "ex5.2", "the preemption victim: the latest arrival")
def check_pick_victim(pick_victim) -> None:
    require_callable("ex5.2", pick_victim, "pick_victim(running, arrival_seq)")
    rng = random.Random("ex5.2")
    cases = []
    for _ in range(200):
        n = rng.randint(1, 8)
        ranks = rng.sample(range(3 * n + 2), n)
        order = list(range(n))
        if rng.random() < 0.7:
            rng.shuffle(order)  # batch order need not be arrival order
        cases.append([(f"r{ranks[i]}", ranks[i]) for i in order])

    def run_one(case):
        running = [Request(rid, [1]) for rid, _ in case]
        arrival_seq = {rid: seq for rid, seq in case}
        expected = max(running, key=lambda r: arrival_seq[r.request_id])
        before = list(running)
        got = pick_victim(running, dict(arrival_seq))
        expect_true(
            "pick_victim must return one of the Request objects in running",
            any(got is r for r in before),
            f"got {got!r}",
        )
        expect_equal("the victim's request_id", expected.request_id, got.request_id)
        expect_equal(
            "running afterwards (pick_victim only chooses; it must not change the list)",
            [r.request_id for r in before],
            [r.request_id for r in running],
        )
        # The package agrees: its running list is in arrival order and it pops the last one.
        sched_order = sorted(before, key=lambda r: arrival_seq[r.request_id])
        if sched_order[-1] is not expected:
            raise RuntimeError("checker bug: reference disagrees with Scheduler._preempt")

    def describe(case):
        return (
            f"running (batch order) = {[rid for rid, _ in case]}, "
            f"arrival_seq = {{{', '.join(f'{rid!r}: {s}' for rid, s in case)}}}"
        )

    run_cases("ex5.2", cases, run_one, size=len, describe=describe)


# -- ex5.3 -------------------------------------------------------------------------------


def _preempt_cases(n: int) -> list[Recipe]:
    rng = random.Random("ex5.3")
    cases = []
    while len(cases) < n:
        recipe = random_recipe(rng, running=(1, 4), preempted=(0, 2), waiting=(0, 3), chunked=None)
        if any(s.state == "running" for s in recipe.requests):
            cases.append(recipe)
    return cases


@exercise(CHECKS, "ex5.3", "preemption by recompute")
def check_preempt_recompute(preempt_recompute) -> None:
    require_callable("ex5.3", preempt_recompute, "preempt_recompute(scheduler, victim)")

    def run_one(recipe: Recipe):
        ref = build(recipe)
        victims = ref._preempt(SchedulerOutput())  # recompute mode: the last running request
        assert len(victims) == 1, "checker bug: recipes have no sequence groups"
        expected_victim = victims[0]
        stu = build(recipe, _NoPreempt)
        victim = stu.running[-1]
        got = preempt_recompute(stu, victim)
        expect_equal("return value (preempt_recompute returns nothing)", None, got)
        expect_equal("the victim", expected_victim.request_id, victim.request_id)
        compare_snapshots(f"after preempting {victim.request_id}", ref, stu)

    run_cases("ex5.3", _preempt_cases(150), run_one, size=lambda r: r.size, describe=Recipe.describe)


# -- ex5.4 -------------------------------------------------------------------------------


def _running_cases(n: int) -> list[Recipe]:
    rng = random.Random("ex5.4")
    cases, n_preempting = [], 0
    while len(cases) < n:
        recipe = random_recipe(rng, running=(1, 6), preempted=(0, 0), waiting=(0, 0), chunked=True)
        if not recipe.requests:
            continue
        preempts = bool(build(recipe).schedule().preempted)
        if not preempts and n_preempting < len(cases) // 2:
            continue  # keep at least half the cases under memory pressure
        n_preempting += preempts
        cases.append(recipe)
    return cases


@exercise(CHECKS, "ex5.4", "the running phase of schedule(), with preemption")
def check_schedule_running(schedule_running) -> None:
    require_callable("ex5.4", schedule_running, "schedule_running(scheduler, token_budget)")

    def run_one(recipe: Recipe):
        ref = build(recipe)
        out = ref.schedule()  # nothing waits, so this is the running phase alone
        stu = build(recipe, _NoPreempt)
        got = schedule_running(stu, recipe.max_num_batched_tokens)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(f"schedule_running must return (scheduled, preempted), got {got!r}")
        scheduled, preempted = got
        expect_equal(
            "scheduled (request id, tokens) in batch order", _pairs(out.scheduled), _pairs(scheduled)
        )
        expect_equal(
            "preempted request ids, in the order they were preempted",
            [r.request_id for r in out.preempted],
            [r.request_id if isinstance(r, Request) else r for r in preempted],
        )
        compare_snapshots("after the running phase", ref, stu)

    run_cases("ex5.4", _running_cases(150), run_one, size=lambda r: r.size, describe=Recipe.describe)


__all__ = ["CHECKS"]
