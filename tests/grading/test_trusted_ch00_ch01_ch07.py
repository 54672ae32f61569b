"""The trusted specs of chapters 00, 01 and 07: per-student prediction workloads, and what a
failure may say.

The predictions (ex0.2 block tables, ex1.4 contiguous regions, ex7.1 steps of a simulated
run) are graded on the trusted side on the workload written into that student's copy. Here:
the workload a copy prints is the one its grading uses, two students get different ones,
each drawn workload is well formed, and the trusted side's expected answers agree with
small independent models written here (a free list, a first-fit slot map, a chunked-prefill
step loop). A failure names the first wrong step and what the student gave, never the
expected answer.
"""

from __future__ import annotations

import ast
import re

import pytest

from minipaged.checks import get_spec
from minipaged.checks._spec import judge, make_cases, observe_all, observe_one
from minipaged.checks.notebook import cell_role, cell_source, load_authored, make_student_copy
from minipaged.grading.codec import dumps

AUTHORED = load_authored()
PREDICTIONS = {
    "ex0.2": ("ch00", "EVENTS"),
    "ex1.4": ("ch01", "CONTIG_EVENTS"),
    "ex7.1": ("ch07", "PREDICT_REQUESTS"),
}
SEEDS = [f"student{i}" for i in range(25)]


def _workload(exercise_id: str, seed) -> list:
    return [tuple(e) for e in make_cases(get_spec(exercise_id), None, student_seed=seed)[0]]


def _setup_literal(nb, name: str):
    setup = "\n".join(cell_source(c) for c in nb.cells if cell_role(c) == "setup")
    (line,) = [ln for ln in setup.splitlines() if ln.startswith(f"{name} = ")]
    return ast.literal_eval(line.split(" = ", 1)[1])


@pytest.mark.parametrize("exercise_id", list(PREDICTIONS))
def test_a_copy_prints_the_workload_its_grading_uses(exercise_id):
    chapter, name = PREDICTIONS[exercise_id]
    nb = AUTHORED[chapter].nb
    module = __import__(f"minipaged.checks.{chapter}", fromlist=[name])
    assert _setup_literal(nb, name) == getattr(module, name) == _workload(exercise_id, None)
    a, b = make_student_copy(nb, seed="alice"), make_student_copy(nb, seed="bob")
    assert _setup_literal(a, name) == _workload(exercise_id, "alice")
    assert _setup_literal(b, name) == _workload(exercise_id, "bob")
    assert _workload(exercise_id, "alice") != _workload(exercise_id, "bob")
    # the graded run draws the same workload whatever the run's seed
    spec = get_spec(exercise_id)
    assert make_cases(spec, "run1", student_seed="alice") == make_cases(spec, "run2", student_seed="alice")


# -- independent models of the three predictions ---------------------------------------------


def _tables_by_hand(events, num_blocks=8, block_size=4):
    """A free list: new blocks from the front; a finished request's blocks (none hashed here) go
    back to the front, last first (vLLM 0.32's order)."""
    free, tables, tokens, out = list(range(num_blocks)), {}, {}, []
    for rid, n in events:
        if n is None:
            free = list(reversed(tables.pop(rid))) + free
            tokens.pop(rid)
        else:
            tokens[rid] = tokens.get(rid, 0) + n
            need = -(-tokens[rid] // block_size) - len(tables.get(rid, []))
            assert need <= len(free), "every event of a workload fits"
            tables.setdefault(rid, []).extend(free[:need])
            del free[:need]
        out.append({r: list(t) for r, t in sorted(tables.items())})
    return out


def _regions_by_hand(events, num_slots=32, max_len=16):
    """A slot map: first fit of min(next pow2, max_len) slots; a request that does not fit waits."""
    owner, starts = [None] * num_slots, []
    for rid, final_len in events:
        if final_len is None:
            owner = [None if o == rid else o for o in owner]
            continue
        size = min(1 << (final_len - 1).bit_length(), max_len)
        start = next(
            (s for s in range(num_slots - size + 1) if all(o is None for o in owner[s : s + size])), None
        )
        if start is not None:
            owner[start : start + size] = [rid] * size
        starts.append(start)
    return starts


def _steps_by_hand(requests, step_s, budget=8):
    """Chunked prefill, budget 8: running first (a decode token or the rest of the prompt as the
    budget allows), then arrived waiting requests in arrival order; each step takes ``step_s``."""
    left = {f"r{k}": [p, o, t] for k, (p, o, t) in enumerate(requests)}  # prompt left, outputs left
    running, waiting, steps, now = [], [], [], 0.0
    while left:
        waiting += [r for r in left if left[r][2] <= now and r not in running and r not in waiting]
        step, room = {}, budget
        for r in running + waiting:
            n = 1 if left[r][0] == 0 else min(left[r][0], room)
            if n == 0 or room == 0:
                continue
            step[r], room = n, room - n
            left[r][0] -= n if left[r][0] else 0
            if left[r][0] == 0:
                left[r][1] -= 1  # the step that ends the prompt, or a decode, gives a token
        for r in step:
            if r in waiting:
                waiting.remove(r)
                running.append(r)
        for r in list(running):
            if left[r][1] == 0:
                running.remove(r)
                del left[r]
        steps.append(step)
        now += step_s
    return steps


def test_ex0_2_workloads_fit_and_match_a_free_list():
    from minipaged.checks.ch00 import reference_tables

    for seed in [None, *SEEDS]:
        events = _workload("ex0.2", seed)
        assert len(events) == 6 and any(n is None for _, n in events)
        freed = [rid for rid, n in events if n is None]
        assert len(freed) == len(set(freed))
        assert reference_tables(events) == _tables_by_hand(events), events


def test_ex1_4_workloads_reuse_a_hole_and_match_a_slot_map():
    from minipaged.checks.ch01 import reference_starts

    for seed in [None, *SEEDS]:
        events = _workload("ex1.4", seed)
        assert len(events) == 7 and events[-1][1] is not None
        first_free = next(i for i, (_, n) in enumerate(events) if n is None)
        assert any(n is not None for _, n in events[first_free:])
        assert reference_starts(events) == _regions_by_hand(events), events


def test_ex7_1_workloads_keep_arrivals_off_step_starts_and_match_a_step_loop():
    from minipaged.checks.ch07 import ARRIVAL_MARGIN_S, reference_run, reference_steps

    for seed in [None, *SEEDS]:
        requests = _workload("ex7.1", seed)
        trace = reference_run(requests).trace
        step_s = trace.steps[0].time
        assert len(trace.steps) <= 7
        for k, s in enumerate(trace.steps):  # busy: every step starts where the last ended
            assert s.time == pytest.approx((k + 1) * step_s, rel=0.01)
        for _, _, t in requests:
            if t > 0:
                assert min(abs(t - k * step_s) for k in range(len(trace.steps))) >= ARRIVAL_MARGIN_S * 0.9
        assert reference_steps(requests) == _steps_by_hand(requests, step_s), requests


# -- what a failure says ---------------------------------------------------------------------


def _wrong_answers(exercise_id, expected):
    """The shipped notebook's answer (wrong for another workload) and the right one with its
    last step changed."""
    shipped = get_spec(exercise_id).expected(make_cases(get_spec(exercise_id), None)[0], {})
    last = expected[-1]
    if isinstance(last, dict):
        changed = {**last, "r9": 1} if exercise_id == "ex7.1" else {**last, "Z": [0]}
    else:
        changed = 99 if last is None else None
    return [a for a in (shipped, expected[:-1] + [changed]) if a != expected]


@pytest.mark.parametrize("exercise_id", list(PREDICTIONS))
def test_a_wrong_prediction_names_the_step_not_the_answer(exercise_id):
    spec = get_spec(exercise_id)
    for seed in SEEDS[:8]:
        cases = make_cases(spec, "graded-run", student_seed=seed)
        expected = spec.expected(cases[0], {})
        for wrong in _wrong_answers(exercise_id, expected):
            got = dumps(observe_all(spec, cases, (lambda w=wrong: w,)))
            ok, msg = judge(spec, cases, got)
            assert not ok and msg.startswith(f"{exercise_id} failed on case 1 of 1"), msg
            assert "not right (you gave " in msg and "expected" not in msg, msg
            # the line after the workload's description, less the echo of the student's answer
            verdict = msg.split("\n")[-1].split("(you gave ")[0]
            assert re.fullmatch(r"  (\[\d+\]\S*|your answer): not right ", verdict), msg
            for want, given in zip(expected, wrong):
                if want != given and want is not None:
                    assert repr(want) not in verdict, (want, msg)


def test_observe_returns_only_what_the_student_gave():
    # the kernel side of a prediction holds no expected value: it passes the answer through
    for exercise_id in PREDICTIONS:
        spec = get_spec(exercise_id)
        case = make_cases(spec, "graded-run", student_seed="alice")[0]
        assert observe_one(spec, case, (lambda: "anything",)) == {"value": "anything"}
    # requests listed with no blocks / no tokens are dropped, keys become strings
    assert observe_one(get_spec("ex0.2"), None, (lambda: [{"A": [1], "B": []}],)) == {"value": [{"A": [1]}]}
    assert observe_one(get_spec("ex7.1"), None, (lambda: [{"r0": 2, "r1": 0}],)) == {"value": [{"r0": 2}]}


@pytest.mark.parametrize("exercise_id", ["ex0.3", "ex0.4", "ex1.1", "ex1.2", "ex1.3", "ex1.5", "ex7.2"])
def test_graded_cases_depend_on_the_run_and_the_student(exercise_id):
    spec = get_spec(exercise_id)
    a = make_cases(spec, "run1|alice")
    assert a != make_cases(spec, "run1|bob") and a != make_cases(spec, "run2|alice")
    assert a != make_cases(spec, "local")


@pytest.mark.parametrize("exercise_id", list(PREDICTIONS))
def test_the_local_check_of_a_copy_judges_the_workload_it_prints(exercise_id, monkeypatch, capsys):
    import sys

    from minipaged.checks import ExerciseFailure, check

    chapter, name = PREDICTIONS[exercise_id]
    spec = get_spec(exercise_id)
    mine, shipped = _workload(exercise_id, "alice"), _workload(exercise_id, None)
    right, right_shipped = spec.expected(mine, {}), spec.expected(shipped, {})
    # the copy's setup cell defined NAME in the kernel's __main__
    monkeypatch.setattr(sys.modules["__main__"], name, mine, raising=False)
    check(exercise_id, lambda: right)
    assert capsys.readouterr().out == f"✅ {exercise_id} passed\n"
    with pytest.raises(ExerciseFailure, match="not right"):
        check(exercise_id, lambda: right_shipped)
    monkeypatch.setattr(sys.modules["__main__"], name, [("broken",)], raising=False)
    with pytest.raises(ExerciseFailure, match="the workload in the setup cell was changed"):
        check(exercise_id, lambda: right)
    # without it (pytest, a script): the shipped workload
    monkeypatch.delattr(sys.modules["__main__"], name)
    check(exercise_id, lambda: right_shipped)
