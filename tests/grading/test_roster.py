"""Identity and seeds from the instructor (issue 35, item 3): roster, nbgrader layout, HMAC seeds.

The headline test: Alice's right answers to her prediction (ex2.5) and her concept questions
(ex2.7) score for Alice, and pasted into Bob's notebook score 0 for Bob, whether Bob's
metadata carries Alice's seed or none.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from minipaged.checks import get_spec
from minipaged.checks._spec import make_cases
from minipaged.checks.notebook import cell_exercise, cell_role, load_authored, make_student_copy
from minipaged.grading import roster
from minipaged.grading.grade import grade_notebook
from minipaged.grading.sandbox import probe
from minipaged.grading.trusted import TrustedChecker

ROOT = Path(__file__).resolve().parents[2]
KEY_PATH = ROOT / "notebooks/exercises/_instructor/key.json"
CH02 = load_authored()["ch02"]
SECRET = b"course-secret-2026"


def test_seed_is_hmac_sha256_rfc4231_vector():
    # RFC 4231, test case 2: key "Jefe", data "what do ya want for nothing?"
    want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    assert roster.student_seed(b"Jefe", "what do ya want for nothing?") == want
    assert roster.student_seed(SECRET, "alice") != roster.student_seed(b"other", "alice")


def test_missing_secret_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv(roster.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="no instructor secret"):
        roster.load_secret(None)
    with pytest.raises(ValueError, match="cannot read"):
        roster.load_secret(tmp_path / "nope")
    monkeypatch.setenv(roster.SECRET_ENV, "s3")
    assert roster.load_secret(None) == b"s3"


def test_roster_files_folders_and_nbgrader_layout(tmp_path):
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "ch02.ipynb").write_text("{}")
    (tmp_path / "a.ipynb").write_text("{}")
    r = tmp_path / "roster.csv"
    r.write_text("student_id,file\nalice,a.ipynb\nbob,bob\n")
    ros = roster.load_roster(r)
    assert ros.student_of(tmp_path / "a.ipynb") == "alice"
    assert ros.student_of(tmp_path / "bob" / "ch02.ipynb") == "bob"
    assert ros.student_of(tmp_path / "c.ipynb") is None
    assert [sid for _, sid in ros.notebooks()] == ["alice", "bob"]
    assert roster.nbgrader_student(tmp_path / "submitted" / "carol" / "ch02" / "x.ipynb") == "carol"
    assert roster.nbgrader_student(tmp_path / "x.ipynb") is None
    r.write_text("student_id,file\nalice,a.ipynb\nbob,a.ipynb\n")
    with pytest.raises(ValueError, match="already alice's"):
        roster.load_roster(r)
    r.write_text("id,path\nalice,a.ipynb\n")
    with pytest.raises(ValueError, match="student_id and file"):
        roster.load_roster(r)


def _answers(student_seed) -> dict:
    """The right answers of ex2.5 and ex2.7 for this student, from the trusted side's spec."""
    key = json.loads(KEY_PATH.read_text())
    out = {}
    for ex in ("ex2.5", "ex2.7"):
        spec = get_spec(ex)
        case = make_cases(spec, "any-run", student_seed)[0]
        want = spec.expected(case, key)
        out[ex] = {q: item["answer"] for q, item in want.items()} if ex == "ex2.7" else want
    return out


def _with_answers(nb, answers: dict, meta_seed="keep"):
    nb = copy.deepcopy(nb)
    fn = {"ex2.5": "predict_free_queue", "ex2.7": "concept_answers"}
    for cell in nb.cells:
        ex = cell_exercise(cell)
        if cell_role(cell) == "solution" and ex in answers:
            cell.source = f"def {fn[ex]}():\n    return {answers[ex]!r}\n"
    if meta_seed != "keep":
        if meta_seed is None:
            nb.metadata["minipaged"].pop("seed", None)
        else:
            nb.metadata["minipaged"]["seed"] = meta_seed
    return nb


def test_alices_answers_score_for_alice_and_zero_for_bob():
    alice, bob = roster.student_seed(SECRET, "alice"), roster.student_seed(SECRET, "bob")
    a_ans, b_ans = _answers(alice), _answers(bob)
    # the two draws differ on both exercises (else the test would prove nothing)
    assert a_ans["ex2.5"] != b_ans["ex2.5"] and a_ans["ex2.7"] != b_ans["ex2.7"]
    alice_nb = make_student_copy(CH02.nb, seed=alice)
    # Bob's copy starts as CH02's authored notebook, so its other exercises stay solved
    bob_nb = copy.deepcopy(CH02.nb)
    bob_nb.cells = make_student_copy(CH02.nb, seed=bob).cells
    for i, cell in enumerate(bob_nb.cells):
        if cell_role(cell) == "solution":
            bob_nb.cells[i] = copy.deepcopy(CH02.nb.cells[i])
    iso = probe()
    with TrustedChecker(str(KEY_PATH)) as checker:

        def graded(nb, seed):
            r = grade_notebook(nb, CH02, timeout=30, isolation=iso, checker=checker, student_seed=seed)
            return {ex: r.exercises[ex].passed for ex in ("ex2.5", "ex2.7")}, r

        own, _ = graded(_with_answers(alice_nb, a_ans), alice)
        assert own == {"ex2.5": True, "ex2.7": True}
        for meta in (alice, None):
            got, r = graded(_with_answers(bob_nb, a_ans, meta_seed=meta), bob)
            assert got == {"ex2.5": False, "ex2.7": False}, r.exercises
            assert r.exercises["ex2.1"].passed  # Bob's own work still counts
        # and Bob's own right answers pass, so the zeros above are the copy's
        got, _ = graded(_with_answers(bob_nb, b_ans, meta_seed=alice), bob)
        assert got == {"ex2.5": True, "ex2.7": True}
