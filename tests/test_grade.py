"""Tests of ``minipaged grade``: restored check cells, per-exercise scores, robustness.

The prepared submissions in tests/fixtures/submissions/ (made by make_submissions.py from
the authored chapter 02 notebook) are graded in real kernels with a 5 s cell timeout:
a wrong, a crashing (one exercise kills the kernel), a hanging (one loop is interrupted,
one ignores the interrupt and its kernel is killed), a tampered and a malformed one.
Student copies of every chapter must score zero, failing only in the check cells.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import nbformat
import pytest

from minipaged.checks.grade import build_plan, format_table, grade_many, write_csv
from minipaged.checks.notebook import cell_source, load_authored, make_student_copy, read_submission

SUBMISSIONS = Path(__file__).parent / "fixtures" / "submissions"
EXPECTED = json.loads((SUBMISSIONS / "expected.json").read_text())
AUTHORED = load_authored()
TIMEOUT = 5.0


@pytest.fixture(scope="module")
def graded():
    paths = [str(SUBMISSIONS / name) for name in EXPECTED]
    results = grade_many(paths, AUTHORED, timeout=TIMEOUT, jobs=3)
    return {Path(r.submission).name: r for r in results}


def test_fixtures_are_up_to_date_with_the_authored_notebook(tmp_path):
    sys.path.insert(0, str(SUBMISSIONS))
    try:
        import make_submissions
    finally:
        sys.path.remove(str(SUBMISSIONS))
    assert make_submissions.build(tmp_path) == EXPECTED
    for name in EXPECTED:
        fresh, committed = (tmp_path / name).read_text(), (SUBMISSIONS / name).read_text()
        assert fresh == committed, f"{name} is stale: run python {SUBMISSIONS / 'make_submissions.py'}"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_prepared_submission_scores(graded, name):
    result = graded[name]
    assert result.chapter == "ch02"
    got = {ex: int(r.passed) for ex, r in result.exercises.items()}
    assert got == EXPECTED[name]


def test_reasons_say_what_happened(graded):
    hanging = graded["ch02_hanging.ipynb"].exercises
    assert hanging["ex2.1"].reason == "did not finish within 5 s (interrupted)"
    assert hanging["ex2.3"].reason == "did not finish within 5 s and ignored the interrupt"
    crashing = graded["ch02_crashing.ipynb"].exercises
    assert "kernel died" in crashing["ex2.3"].reason
    assert "your code raised ZeroDivisionError" in crashing["ex2.4"].reason
    wrong = graded["ch02_wrong.ipynb"].exercises
    assert wrong["ex2.4"].reason.startswith("ex2.4 failed on case")
    tampered = graded["ch02_tampered.ipynb"].exercises
    assert "not implemented yet" in tampered["ex2.1"].reason
    malformed = graded["ch02_malformed.ipynb"]
    assert malformed.error.startswith("not a notebook: invalid JSON")


def test_hang_and_kernel_death_do_not_stop_the_rest(graded):
    # after the kernel was killed (ex2.3 ignored the interrupt), ex2.4 still ran and passed
    cells = graded["ch02_hanging.ipynb"].cells
    statuses = [(c.kind, c.exercise, c.status) for c in cells if c.kind == "check"]
    assert statuses == [("check", "ex2.1", "timeout"), ("check", "ex2.2", "ok"),
                        ("check", "ex2.3", "hung"), ("check", "ex2.4", "ok")]
    cells = graded["ch02_crashing.ipynb"].cells
    assert [c.status for c in cells if c.kind == "check"] == ["ok", "ok", "died", "error"]


def test_tampered_check_cells_are_restored_in_place():
    authored = AUTHORED["ch02"]
    nb = read_submission(SUBMISSIONS / "ch02_tampered.ipynb")
    plan = build_plan(nb, authored)
    checks = [(i, c) for i, c in enumerate(plan) if c.kind == "check"]
    assert [c.exercise for _, c in checks] == authored.exercises
    for i, c in checks:
        assert c.source == cell_source(authored.check_cells[c.exercise])  # the original, not the fake
        prev = plan[i - 1]
        assert prev.kind == "student" and prev.exercise == c.exercise  # right after its solution
    fakes = [c for c in plan if c.kind == "student" and "✅" in c.source]
    assert len(fakes) == 1  # the unmarked fake print runs as a student cell and counts for nothing


def test_table_and_csv(graded, tmp_path):
    results = [graded[name] for name in EXPECTED]
    table = format_table(results)
    assert "chapter ch02" in table
    row = next(line for line in table.splitlines() if "ch02_hanging.ipynb " in line)
    assert row.split()[-5:] == ["0", "1", "0", "1", "2/4"]
    assert "why:" in table and "ignored the interrupt" in table
    path = tmp_path / "scores.csv"
    write_csv(results, path)
    rows = list(csv.DictReader(path.open()))
    by_name = {Path(r["submission"]).name: r for r in rows}
    for name, scores in EXPECTED.items():
        r = by_name[name]
        assert {ex: int(r[ex]) for ex in scores} == scores
        assert int(r["score"]) == sum(scores.values()) and r["max_score"] == "4"
    assert "invalid JSON" in by_name["ch02_malformed.ipynb"]["note"]


def test_cli_malformed_and_unknown_files_get_a_message_not_a_traceback(tmp_path, capsys):
    from minipaged.cli import main

    (tmp_path / "notes.ipynb").write_text('{"just": "json"}')
    (tmp_path / "empty.ipynb").write_text("")
    (tmp_path / "other.ipynb").write_text(json.dumps(nbformat.v4.new_notebook()))
    csv_path = tmp_path / "out.csv"
    argv = ["grade", str(SUBMISSIONS / "ch02_malformed.ipynb"), str(tmp_path / "notes.ipynb"),
            str(tmp_path / "empty.ipynb"), str(tmp_path / "other.ipynb"), str(tmp_path / "missing.ipynb"),
            "--csv", str(csv_path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    out = captured.out
    assert "ch02_malformed.ipynb" in out and "0/4" in out
    assert "not a notebook: no list of cells" in out
    assert "not a notebook: invalid JSON" in out
    assert "cannot tell which chapter" in out
    assert "file not found" in out
    assert len(list(csv.DictReader(csv_path.open()))) == 5
    assert main(["grade", "x.ipynb", "--timeout", "0"]) == 2
    assert main(["grade", "x.ipynb", "--source", str(tmp_path / "none")]) == 2


def test_student_copies_fail_at_every_exercise_and_nowhere_else(tmp_path):
    paths = []
    for chapter, authored in sorted(AUTHORED.items()):
        path = tmp_path / authored.name
        nbformat.write(make_student_copy(authored.nb), path)
        paths.append(str(path))
    results = grade_many(paths, AUTHORED, timeout=120, jobs=3)
    for r, (chapter, authored) in zip(results, sorted(AUTHORED.items())):
        assert r.error is None and r.chapter == chapter
        assert list(r.exercises) == authored.exercises
        assert all(not e.passed and "not implemented yet" in e.reason for e in r.exercises.values()), r.exercises
        assert [c.status for c in r.cells if c.kind == "student"] == ["ok"] * sum(
            c.kind == "student" for c in r.cells), "a setup or stub cell failed"
        assert all(c.status == "error" for c in r.cells if c.kind == "check")
