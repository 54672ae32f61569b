"""Chapters 05 and 06 on the trusted checker: what their specs judge beyond "equals the reference".

- ex5.6 (design): the bar is judged on the trusted side from a replay of the rule's
  decisions; always admitting fails it, the authored rule clears it on every grading
  seed tried, and an observation whose counts do not match its decisions fails.
- ex5.5 / ex6.5 (predictions): one workload per student seed, each valid for the exercise
  (ex5.5 preempts; ex6.5 forks and copies on write); the expected run is the reference's
  on that workload; a wrong prediction's message names the step and what was given,
  never the expected answer.
- the stateful function exercises (ex5.3, ex5.4, ex6.1, ex6.2, ex6.4) return the state
  after each operation as plain data, and the graded cases are not the local ones.
"""

from __future__ import annotations

import json
import random

import pytest

from minipaged.checks import get_spec
from minipaged.checks._spec import LOCAL_SEED, judge, make_cases, observe_all
from minipaged.checks.ch05 import PREDICT_REQUESTS, reference_run, reference_steps, run_admission
from minipaged.checks.ch06 import SHARE_EVENTS, reference_sharing
from minipaged.core import BlockSpaceManager
from minipaged.core.kv.block import cdiv
from minipaged.grading.codec import dumps, loads_strict


def reserve_rule(scheduler, request) -> bool:
    """The authored design of ex5.6: admit while every running request can still reach its
    max_tokens after this one took its whole prompt."""
    if not scheduler.running:
        return True
    kv, bs = scheduler.kv_cache_manager, scheduler.block_size
    reserved = sum(
        cdiv(r.num_prompt_tokens + r.max_tokens - 1, bs) - len(kv.get_block_ids(r.request_id))
        for r in scheduler.running
    )
    return kv.get_num_free_blocks() - reserved >= cdiv(request.num_tokens, bs)


def _graded(exercise_id, objects, seed="run1", student="s1"):
    spec = get_spec(exercise_id)
    cases = make_cases(spec, f"{seed}|{student}", student)
    got = dumps(observe_all(spec, cases, objects))
    return (spec, cases, got, *judge(spec, cases, got))


@pytest.mark.parametrize("seed", ["run1", "run2", "run3"])
def test_ex5_6_the_bar_is_judged_on_the_trusted_side(seed):
    *_, ok, msg = _graded("ex5.6", (reserve_rule,), seed)
    assert ok, msg
    *_, ok, msg = _graded("ex5.6", (lambda s, r: True,), seed)
    assert not ok and "does not clear the bar" in msg, msg


def test_ex5_6_the_authored_rule_clears_the_bar_on_every_draw():
    """The bar is judged on totals over many workloads, so a sound rule passes whatever the
    grading run draws (a bar per workload, over 12, failed the authored rule on 4% of draws:
    CI's ch05 full-marks test failed on one). 10 draws here; 100 more were tried by hand."""
    for k in range(10):
        *_, ok, msg = _graded("ex5.6", (reserve_rule,), f"draw{k}", f"student{k}")
        assert ok, (k, msg)


def test_ex5_6_counts_that_do_not_match_the_decisions_fail():
    spec, cases, got, ok, _ = _graded("ex5.6", (lambda s, r: True,))
    records = loads_strict(got)
    for rec in records:
        rec["value"]["preemptions"] = 0  # the always-admit run, claiming no preemption
    ok, msg = judge(spec, cases, dumps(records))
    assert not ok and "replay of its decisions differ" in msg, msg
    for rec in records:  # decisions that are not booleans are not a run
        rec["value"]["decisions"] = ["yes"]
    ok, msg = judge(spec, cases, dumps(records))
    assert not ok and "did not come back as data" in msg, msg


def test_ex5_6_a_rule_that_changes_the_scheduler_fails():
    def meddler(scheduler, request):
        scheduler.max_num_seqs = 1  # reads are allowed; this is not
        return reserve_rule(scheduler, request)

    *_, ok, msg = _graded("ex5.6", (meddler,))
    assert not ok, msg


def test_ex5_6_the_replay_reproduces_the_default_and_a_rule():
    case = make_cases(get_spec("ex5.6"), "run1")[0]
    run = run_admission(reserve_rule, case["workload"], case["knobs"])
    assert run["problem"] is None and run["preemptions"] == 0
    it = iter(run["decisions"])
    replay = run_admission(lambda s, r: next(it), case["workload"], case["knobs"])
    assert {k: replay[k] for k in ("steps", "preemptions", "admitted")} == {
        k: run[k] for k in ("steps", "preemptions", "admitted")
    }
    assert run_admission(None)["preemptions"] > 0  # DESIGN_WORKLOAD: the default preempts


def test_ex5_5_variants_preempt_and_differ_per_student():
    spec = get_spec("ex5.5")
    assert make_cases(spec, "any", None) == [json.loads(json.dumps(PREDICT_REQUESTS))]
    workloads = [make_cases(spec, "any", f"student{k}")[0] for k in range(8)]
    assert len({json.dumps(w) for w in workloads}) > 4
    for k, w in enumerate(workloads):
        trace = reference_steps([tuple(r) for r in w])
        assert any(s.preempted_ids for s in trace.steps) and len(trace.steps) <= 12
        assert make_cases(spec, "another run", f"student{k}")[0] == w  # the student's, every run


def test_ex6_5_variants_fork_copy_and_differ_per_student():
    spec = get_spec("ex6.5")
    assert make_cases(spec, "any", None) == [json.loads(json.dumps(SHARE_EVENTS))]
    events = [make_cases(spec, "any", f"student{k}")[0] for k in range(8)]
    assert len({json.dumps(e) for e in events}) > 4
    for ev in events:
        ev = [tuple(e) for e in ev]
        assert len(ev) == 6 and sum(op == "fork" for op, _, _ in ev) >= 2
        kv, copies = BlockSpaceManager(num_blocks=8, block_size=4), 0
        for op, a, b in ev:
            if op == "alloc":
                assert kv.allocate_slots(a, b) is not None
                copies += len(kv.take_pending_copies())
            elif op == "fork":
                kv.fork(a, b)
            else:
                kv.free(a)
        assert copies >= 1
        assert len(reference_sharing(ev)) == 6


@pytest.mark.parametrize(
    "exercise_id,student,answer",
    [("ex5.5", "alice", reference_run), ("ex6.5", "bob", reference_sharing)],
)
def test_predictions_are_graded_on_the_students_workload_and_never_state_the_answer(
    exercise_id, student, answer
):
    spec = get_spec(exercise_id)
    cases = make_cases(spec, "run1", student)
    right = answer([tuple(x) for x in cases[0]])
    ok, msg = judge(spec, cases, dumps(observe_all(spec, cases, (lambda: right,))))
    assert ok, msg
    shipped = answer()  # the shipped notebook's answer is not this student's
    ok, msg = judge(spec, cases, dumps(observe_all(spec, cases, (lambda: shipped,))))
    assert not ok and "not right (you gave" in msg, msg
    wrong = [dict(s) for s in right]
    wrong[-1] = {k: {} for k in right[-1]}
    ok, msg = judge(spec, cases, dumps(observe_all(spec, cases, (lambda: wrong,))))
    assert not ok and f"[{len(right) - 1}]" in msg, msg
    for step in right:  # no expected step, nor any of its parts, is in the message
        for part in step.values():
            if part:
                assert repr(part) not in msg and json.dumps(part) not in msg, msg


@pytest.mark.parametrize("exercise_id", ["ex5.1", "ex5.3", "ex5.4", "ex6.1", "ex6.2", "ex6.4", "ex6.6"])
def test_graded_cases_are_not_the_local_ones_and_observations_are_plain_data(exercise_id):
    spec = get_spec(exercise_id)
    local = make_cases(spec, LOCAL_SEED)
    graded = make_cases(spec, "run1|alice", "alice")
    assert local != graded and graded != make_cases(spec, "run1|bob", "bob")
    (ref,) = spec.reference()
    records = observe_all(spec, graded[:5], (ref,))
    assert loads_strict(dumps(records)) == json.loads(dumps(records))
    assert all("value" in r for r in records), records


def test_ex6_1_state_is_compared_after_every_operation():
    """A fork that forgets one reference is caught at that operation, by the state."""
    spec = get_spec("ex6.1")

    def lazy_fork(m, parent, child):
        BlockSpaceManager.fork(m, parent, child)
        blocks = m.block_tables[child].blocks
        if blocks:
            m.block_pool.free_blocks(blocks[:1])

    rng = random.Random(0)
    cases = [c for c in make_cases(spec, "run1") if any(op[0] == "fork" for op in c[2])]
    rng.shuffle(cases)
    ok, msg = judge(spec, cases[:20], dumps(observe_all(spec, cases[:20], (lazy_fork,))))
    assert not ok and ("ref_cnt" in msg or "invariants" in msg), msg
