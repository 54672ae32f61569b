"""Copy detection (issue 35, item 4): a verbatim or renamed copy of the package's code in a
solution cell, and two students' identical solutions, are flagged in the CSV and the report."""

from __future__ import annotations

import copy
import csv
import inspect
import textwrap

import nbformat

from minipaged.checks.notebook import cell_exercise, cell_role, load_authored, make_student_copy
from minipaged.core.kv import block_pool
from minipaged.grading.grade import SubmissionResult, copy_report_path, detect_copies, write_csv

AUTHORED = load_authored()
CH02 = AUTHORED["ch02"]
PACKAGE_CODE = textwrap.dedent(inspect.getsource(block_pool.BlockPool.free_blocks))
# the identifiers renamed: what a copier does to hide it
RENAMED = PACKAGE_CODE.replace("ordered_blocks", "my_list").replace("block", "thing").replace("front", "head")


def _with(nb, ex, text):
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell_role(cell) == "solution" and cell_exercise(cell) == ex:
            cell.source = text
    return nb


def test_package_copies_and_identical_classmates_are_flagged(tmp_path):
    student = make_student_copy(CH02.nb)
    own = "def allocate_slots(manager, request_id, num_new_tokens):\n    return None  # my own\n"
    subs = {
        "verbatim": _with(student, "ex2.3", PACKAGE_CODE),
        "renamed": _with(student, "ex2.3", RENAMED),
        "twin_a": _with(student, "ex2.6", _solution(CH02.nb, "ex2.6")),
        "twin_b": _with(student, "ex2.6", _solution(CH02.nb, "ex2.6")),
        "untouched": student,
        "own": _with(student, "ex2.3", own),
    }
    results = []
    for name, nb in subs.items():
        path = tmp_path / f"{name}.ipynb"
        nbformat.write(nb, path)
        results.append(SubmissionResult(submission=str(path), chapter="ch02"))
    csv_path = tmp_path / "grades.csv"
    report = copy_report_path(csv_path)
    detect_copies(results, AUTHORED, report)
    write_csv(results, csv_path)
    rows = {r["submission"]: r["copies"] for r in csv.DictReader(csv_path.open())}
    col = {name: rows[str(tmp_path / f"{name}.ipynb")] for name in subs}
    assert "ex2.3 ~ package:minipaged/core/kv/block_pool.py" in col["verbatim"]
    assert "ex2.3 ~ package:minipaged/core/kv/block_pool.py" in col["renamed"]
    assert f"ex2.6 ~ {tmp_path / 'twin_b.ipynb'}" in col["twin_a"]
    assert f"ex2.6 ~ {tmp_path / 'twin_a.ipynb'}" in col["twin_b"]
    assert col["untouched"] == "" and col["own"] == ""  # the handed-out stub is boilerplate
    html = report.read_text()
    for name in ("verbatim", "renamed", "twin_a", "twin_b"):
        assert f"{name}.ipynb" in html
    assert "untouched.ipynb" not in html and "own.ipynb" not in html
    assert "<mark>" in html


def _solution(nb, ex):
    return "\n\n".join(c.source for c in nb.cells if cell_role(c) == "solution" and cell_exercise(c) == ex)
