"""Chapters 03 and 04 on the trusted checker: per-student prediction workloads, messages
that never state a prediction's answer, and graded results that fit the codec's limits.

The prediction exercises (ex3.5, ex4.4) are judged against the workload written into the
student's own copy (``minipaged exercises --student DIR --seed S``); the tensor exercises
(ex3.1-ex3.4) send their outputs back as JSON text, which must stay well under
``codec.MAX_RESULT_BYTES`` for every case set a grading run can draw.
"""

from __future__ import annotations

import copy
import json

import pytest

from minipaged.checks import get_spec
from minipaged.checks._spec import expected_records, judge, make_cases, observe_all
from minipaged.checks.ch03 import READ_SEQUENCES, reference_reads
from minipaged.checks.ch04 import PREDICT_REQUESTS, predicted_steps
from minipaged.checks.notebook import cell_role, cell_source, load_authored, make_student_copy
from minipaged.grading.codec import MAX_RESULT_BYTES, dumps

AUTHORED = load_authored()
PREDICTIONS = {
    "ex3.5": (
        "ch03",
        "READ_SEQUENCES",
        lambda case: reference_reads([tuple(s) for s in case]),
        READ_SEQUENCES,
    ),
    "ex4.4": (
        "ch04",
        "PREDICT_REQUESTS",
        lambda case: predicted_steps([tuple(r) for r in case]),
        PREDICT_REQUESTS,
    ),
}


def _setup_value(nb, name):
    """The value the setup cell of ``nb`` binds to ``name`` (the setup cells hold literals)."""
    (src,) = [cell_source(c) for c in nb.cells if cell_role(c) == "setup"]
    line = next(ln for ln in src.splitlines() if ln.startswith(f"{name} = "))
    ns: dict = {}
    exec(line, ns)
    return ns[name]


@pytest.mark.parametrize("exercise_id", list(PREDICTIONS))
def test_prediction_is_judged_on_the_students_own_workload(exercise_id):
    chapter, name, answer_of, shipped = PREDICTIONS[exercise_id]
    spec = get_spec(exercise_id)
    assert make_cases(spec, "any-run")[0] == json.loads(json.dumps(shipped))  # no seed: the shipped one
    copies = {s: make_student_copy(AUTHORED[chapter].nb, seed=s) for s in ("alice", "bob")}
    cases = {s: make_cases(spec, "run1", student_seed=s) for s in copies}
    assert cases["alice"] != cases["bob"]
    assert cases["alice"] == make_cases(spec, "run2", student_seed="alice")  # the copy's, every run
    for s, nb in copies.items():
        # the workload in the student's setup cell is the one the grader judges
        assert json.loads(json.dumps(_setup_value(nb, name))) == cases[s][0]
        spec_cell = next(
            c
            for c in nb.cells
            if c.cell_type == "markdown"
            and cell_role(c) == "spec"
            and c.metadata["minipaged"]["exercise"] == exercise_id
        )
        for item in cases[s][0]:
            assert f"| {item[0]} |" in cell_source(spec_cell)
    # the right answer for alice's workload passes; the shipped notebook's answer does not
    right = answer_of(cases["alice"][0])
    ok, msg = judge(spec, cases["alice"], dumps(observe_all(spec, cases["alice"], (lambda: right,))))
    assert ok, msg
    shipped_answer = answer_of(shipped)
    assert shipped_answer != right
    ok, _ = judge(spec, cases["alice"], dumps(observe_all(spec, cases["alice"], (lambda: shipped_answer,))))
    assert not ok


@pytest.mark.parametrize("exercise_id", list(PREDICTIONS))
def test_a_wrong_prediction_names_the_place_never_the_answer(exercise_id):
    _, _, answer_of, _ = PREDICTIONS[exercise_id]
    spec = get_spec(exercise_id)
    cases = make_cases(spec, "run1", student_seed="carol")
    right = answer_of(cases[0])
    wrong = copy.deepcopy(right)
    if exercise_id == "ex4.4":
        rid = sorted(wrong[1])[0]
        wrong[1][rid] += 7  # one step's token count off
        where, given = f"[1].{rid}", wrong[1][rid]
    else:
        wrong["B"][0][0][1] += 7  # one read's token count off
        where, given = "B[0][0][1]", wrong["B"][0][0][1]
    ok, msg = judge(spec, cases, dumps(observe_all(spec, cases, (lambda: wrong,))))
    assert not ok and msg.startswith(f"{exercise_id} failed on case 1 of 1")
    # the place and what the student gave: nothing of the expected answer
    assert msg.splitlines()[-1] == f"  {where}: not right (you gave {given})", msg
    assert "expected" not in msg


@pytest.mark.parametrize("exercise_id", ["ex3.1", "ex3.2", "ex3.3", "ex3.4"])
@pytest.mark.parametrize("seed", ["local", "run-a", "run-b"])
def test_tensor_results_fit_the_codec_limit(exercise_id, seed):
    spec = get_spec(exercise_id)
    cases = make_cases(spec, seed)
    # a right answer has the expected records' size (same shapes and dtypes)
    size = len(dumps(expected_records(spec, cases, None)))
    assert size < MAX_RESULT_BYTES // 2, (exercise_id, size)


def test_the_admission_case_carries_the_running_phase_never_the_admitted():
    spec = get_spec("ex4.1")
    for case in make_cases(spec, "run1")[:40]:
        assert set(case) == {"recipe", "running phase"}
        running = {r["request_id"] for r in case["recipe"]["requests"] if r["state"] == "running"}
        assert {rid for rid, _ in case["running phase"]} <= running  # only what already ran


@pytest.mark.parametrize("exercise_id", list(PREDICTIONS))
def test_the_local_check_judges_the_workload_of_the_students_notebook(exercise_id, monkeypatch, capsys):
    import sys

    from minipaged.checks import ExerciseFailure, check

    _, name, answer_of, shipped = PREDICTIONS[exercise_id]
    variant = make_cases(get_spec(exercise_id), "run1", student_seed="dave")[0]
    # the notebook's namespace (__main__ in a kernel) holds the copy's workload
    monkeypatch.setattr(sys.modules["__main__"], name, [tuple(x) for x in variant], raising=False)
    # NOTE: worked out before the check: the check strips the package's run_scheduler (it
    # answers ex4.4) while the student's function runs, as grading's student build does
    right, shipped_answer = answer_of(variant), answer_of(shipped)
    check(exercise_id, lambda: right)
    assert capsys.readouterr().out == f"✅ {exercise_id} passed\n"
    with pytest.raises(ExerciseFailure, match="not right"):
        check(exercise_id, lambda: shipped_answer)
