"""Tests of ``minipaged grade``: restored check cells, per-exercise scores, robustness, cheats.

The prepared submissions in tests/fixtures/submissions/ (made by make_submissions.py from
the authored chapter 02 notebook) are graded in real kernels with a 5 s cell timeout:
a wrong, a crashing (one exercise kills the kernel), a hanging (one loop is interrupted,
one ignores the interrupt and its kernel is killed), a tampered and a malformed one.
Student copies of every chapter must score zero, failing only in the check cells.

The cheat suite in tests/fixtures/cheats/ (made by make_cheats.py) holds one submission per
attack of issue 15 and per attack defended before it: each must get the score an honest
grader gives and be flagged by the scan rule named in expected.json. Kernels run in the
sandbox this machine gives (``sandbox.probe()``); the tests that need bubblewrap or a
separate user skip, saying why, where it is missing.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import nbformat
import pytest

from minipaged.checks.notebook import (
    cell_source,
    load_authored,
    make_student_copy,
    read_submission,
)
from minipaged.grading.grade import (
    build_plan,
    check_call,
    format_table,
    grade_many,
    grade_submission,
    write_csv,
)
from minipaged.grading.sandbox import probe

SUBMISSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "submissions"
EXPECTED = json.loads((SUBMISSIONS / "expected.json").read_text())
CHEATS = Path(__file__).resolve().parents[1] / "fixtures" / "cheats"
CHEAT_EXPECTED = json.loads((CHEATS / "expected.json").read_text())
AUTHORED = load_authored()
TIMEOUT = 5.0
ISOLATION = probe()


@pytest.fixture(scope="module")
def graded():
    paths = [str(SUBMISSIONS / name) for name in EXPECTED]
    results = grade_many(paths, AUTHORED, timeout=TIMEOUT, jobs=3, isolation=ISOLATION)
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
    # NOTE: ex2.1..ex2.4 are the ones these submissions fill; the later ones are stubs
    statuses = [(c.kind, c.exercise, c.status) for c in cells if c.kind == "check"][:4]
    assert statuses == [
        ("check", "ex2.1", "timeout"),
        ("check", "ex2.2", "ok"),
        ("check", "ex2.3", "hung"),
        ("check", "ex2.4", "ok"),
    ]
    cells = graded["ch02_crashing.ipynb"].cells
    # NOTE: the driver cell of ex2.4 runs to its end ("ok"): its verdict is the trusted side's
    assert [c.status for c in cells if c.kind == "check"][:4] == ["ok", "ok", "died", "ok"]
    assert not graded["ch02_crashing.ipynb"].exercises["ex2.4"].passed


def test_tampered_check_cells_are_restored_in_place():
    authored = AUTHORED["ch02"]
    nb = read_submission(SUBMISSIONS / "ch02_tampered.ipynb")
    plan = build_plan(nb, authored)
    checks = [(i, c) for i, c in enumerate(plan) if c.kind == "check"]
    assert [c.exercise for _, c in checks] == authored.exercises
    for i, c in checks:
        # the grader's check for the original cell, not the fake: a driver cell of the trusted
        # checker, handed the names the authored check cell hands over
        assert c.source == ""
        assert c.names == check_call(cell_source(authored.check_cells[c.exercise]))[1]
        prev = plan[i - 1]
        assert prev.kind == "student" and prev.exercise == c.exercise  # right after its solution
    fakes = [c for c in plan if c.kind == "student" and "✅" in c.source]
    assert len(fakes) == 1  # the unmarked fake print runs as a student cell and counts for nothing


def test_table_and_csv(graded, tmp_path):
    results = [graded[name] for name in EXPECTED]
    table = format_table(results)
    assert "chapter ch02" in table
    row = next(line for line in table.splitlines() if "ch02_hanging.ipynb " in line)
    assert row.split()[-8:] == ["0", "1", "0", "1", "0", "0", "0", "2/7"]
    assert "why:" in table and "ignored the interrupt" in table
    path = tmp_path / "scores.csv"
    write_csv(results, path)
    rows = list(csv.DictReader(path.open()))
    by_name = {Path(r["submission"]).name: r for r in rows}
    for name, scores in EXPECTED.items():
        r = by_name[name]
        assert {ex: int(r[ex]) for ex in scores} == scores
        assert int(r["score"]) == sum(scores.values()) and r["max_score"] == "7"
    assert "invalid JSON" in by_name["ch02_malformed.ipynb"]["note"]


def test_cli_malformed_and_unknown_files_get_a_message_not_a_traceback(tmp_path, capsys):
    from minipaged.cli import main

    (tmp_path / "notes.ipynb").write_text('{"just": "json"}')
    (tmp_path / "empty.ipynb").write_text("")
    (tmp_path / "other.ipynb").write_text(json.dumps(nbformat.v4.new_notebook()))
    csv_path = tmp_path / "out.csv"
    argv = [
        "grade",
        str(SUBMISSIONS / "ch02_malformed.ipynb"),
        str(tmp_path / "notes.ipynb"),
        str(tmp_path / "empty.ipynb"),
        str(tmp_path / "other.ipynb"),
        str(tmp_path / "missing.ipynb"),
        "--csv",
        str(csv_path),
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    out = captured.out
    assert "ch02_malformed.ipynb" in out and "0/7" in out
    assert "not a notebook: no list of cells" in out
    assert "not a notebook: invalid JSON" in out
    assert "cannot tell which chapter" in out
    assert "file not found" in out
    assert len(list(csv.DictReader(csv_path.open()))) == 5
    assert main(["grade", "x.ipynb", "--source", str(tmp_path / "none")]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--timeout", "0"],
        ["--timeout", "nan"],
        ["--timeout", "inf"],
        ["--timeout", "-1"],
        ["--timeout", "abc"],
        ["--budget", "nan"],
        ["--jobs", "0"],
        ["--jobs", "two"],
        ["--csv", "/no/such/dir/x.csv"],
    ],
)
def test_cli_bad_options_are_argparse_errors_before_grading(argv, capsys):
    from minipaged.cli import main

    with pytest.raises(SystemExit) as e:
        main(["grade", str(SUBMISSIONS / "ch02_wrong.ipynb"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and argv[0] in err and "Traceback" not in err
    assert "grading" not in err  # nothing was graded


def test_student_copies_fail_at_every_exercise_and_nowhere_else(tmp_path):
    paths = []
    for _chapter, authored in sorted(AUTHORED.items()):
        path = tmp_path / authored.name
        nbformat.write(make_student_copy(authored.nb), path)
        paths.append(str(path))
    results = grade_many(paths, AUTHORED, timeout=120, jobs=3, isolation=ISOLATION)
    for r, (chapter, authored) in zip(results, sorted(AUTHORED.items())):
        assert r.error is None and r.chapter == chapter
        assert list(r.exercises) == authored.exercises
        assert all(not e.passed and "not implemented yet" in e.reason for e in r.exercises.values()), [
            (ex, e.reason) for ex, e in r.exercises.items() if "not implemented yet" not in e.reason
        ]
        assert [c.status for c in r.cells if c.kind == "student"] == ["ok"] * sum(
            c.kind == "student" for c in r.cells
        ), "a setup or stub cell failed"
        # the driver cells run to their end; the verdict is the trusted side's
        assert all(c.status == "ok" for c in r.cells if c.kind == "check")


# -- the cheat suite (issue 15) -------------------------------------------------------------


def _grade_cheat(name, scan=True):
    e = CHEAT_EXPECTED[name]
    return grade_submission(
        CHEATS / name,
        AUTHORED,
        timeout=e.get("timeout", 20.0),
        budget=e.get("budget", 300.0),
        isolation=ISOLATION,
        scan=scan,
    )


@pytest.fixture(scope="module")
def cheats():
    from concurrent.futures import ThreadPoolExecutor

    names = list(CHEAT_EXPECTED)
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(names, pool.map(_grade_cheat, names)))


def test_cheat_fixtures_are_up_to_date(tmp_path):
    sys.path.insert(0, str(CHEATS))
    try:
        import make_cheats
    finally:
        sys.path.remove(str(CHEATS))
    assert make_cheats.build(tmp_path) == CHEAT_EXPECTED
    for name in CHEAT_EXPECTED:
        assert (tmp_path / name).read_text() == (CHEATS / name).read_text(), (
            f"{name} is stale: run python {CHEATS / 'make_cheats.py'}"
        )


@pytest.mark.parametrize("name", list(CHEAT_EXPECTED))
def test_cheat_scores_what_an_honest_grader_gives_and_is_flagged(cheats, name):
    e, r = CHEAT_EXPECTED[name], cheats[name]
    assert r.error is None, r.error
    assert {ex: int(x.passed) for ex, x in r.exercises.items()} == e["scores"], r.exercises
    rules = {f.rsplit("[", 1)[-1].rstrip("]") for f in r.flags if f.endswith("]")}
    assert set(e["rules"]) <= rules, r.flags
    if not e["rules"]:
        assert not [f for f in r.flags if f.endswith("]")], r.flags  # honest code is not flagged
    if e["reason"]:
        reasons = " | ".join(x.reason for x in r.exercises.values() if not x.passed)
        assert e["reason"] in reasons, reasons
    if name in ("ch02_exits.ipynb", "ch02_sleepers.ipynb"):
        assert any(c.status == "skipped" for c in r.cells)  # bounded: the rest was not run


@pytest.mark.parametrize("name", [n for n, e in CHEAT_EXPECTED.items() if e.get("holds_without_scan")])
def test_cheat_fails_even_without_the_scan(name):
    """The layers under the scan hold on their own: the trusted checker (a judge in another
    process, plain data across) for patching and hooks, the sandbox for files and /proc."""
    e = CHEAT_EXPECTED[name]
    if e["holds_without_scan"] == "sandbox" and not (ISOLATION.bwrap and ISOLATION.user):
        pytest.skip("needs the bubblewrap sandbox and a separate user: " + "; ".join(ISOLATION.missing))
    r = _grade_cheat(name, scan=False)
    assert {ex: int(x.passed) for ex, x in r.exercises.items()} == e["scores"], r.exercises


def _package_digest():
    import hashlib

    import minipaged

    h = hashlib.sha256()
    root = Path(minipaged.__file__).resolve().parent
    for p in sorted([*root.rglob("*.py"), *(root.parent / "notebooks" / "exercises").glob("*.ipynb")]):
        h.update(str(p).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_a_poisoned_submission_changes_nothing_for_others_now_or_later():
    before = _package_digest()
    honest = [str(CHEATS / "ch02_honest.ipynb"), str(SUBMISSIONS / "ch02_wrong.ipynb")]
    paths = [honest[0], str(CHEATS / "ch02_poison.ipynb"), honest[1], str(CHEATS / "ch02_importlib.ipynb")]
    results = grade_many(paths, AUTHORED, timeout=20, jobs=2, isolation=ISOLATION)
    scores = {Path(r.submission).name: {ex: int(x.passed) for ex, x in r.exercises.items()} for r in results}
    assert scores["ch02_honest.ipynb"] == CHEAT_EXPECTED["ch02_honest.ipynb"]["scores"]
    assert scores["ch02_wrong.ipynb"] == EXPECTED["ch02_wrong.ipynb"]
    assert scores["ch02_poison.ipynb"] == CHEAT_EXPECTED["ch02_poison.ipynb"]["scores"]
    assert _package_digest() == before  # the package and the authored notebooks are untouched
    later = grade_many(honest, AUTHORED, timeout=20, jobs=1, isolation=ISOLATION)  # a later run
    assert [{ex: int(x.passed) for ex, x in r.exercises.items()} for r in later] == [
        scores["ch02_honest.ipynb"],
        scores["ch02_wrong.ipynb"],
    ]
    stub = grade_many([str(CHEATS / "ch02_printed_ticks.ipynb")], AUTHORED, timeout=20, isolation=ISOLATION)[
        0
    ]
    assert stub.score == 0  # nothing the poison tried was left behind for a later stub


def test_sandbox_hides_the_grader_the_notebooks_and_the_package_files(tmp_path):
    if not (ISOLATION.bwrap and ISOLATION.user):
        pytest.skip("needs the bubblewrap sandbox and a separate user: " + "; ".join(ISOLATION.missing))
    import minipaged
    from minipaged.grading.executor import KernelRunner

    pkg = Path(minipaged.__file__).resolve().parent
    probe_src = f"""
import os, json
out = {{}}
out["uid"] = os.getuid()
out["procs"] = sorted(p for p in os.listdir("/proc") if p.isdigit())
out["authored"] = os.path.exists({str(pkg.parent / "notebooks" / "exercises")!r})
out["submissions"] = os.path.exists({str(SUBMISSIONS)!r})
try:
    open("/opt/minipaged/minipaged/checks/_harness.py", "a")
    out["write_pkg"] = "allowed"
except OSError as e:
    out["write_pkg"] = type(e).__name__
out["ppid_cmdline"] = open(f"/proc/{{os.getppid()}}/cmdline").read().replace("\\0", " ")
print(json.dumps(out))
"""
    runner = KernelRunner(cwd=str(tmp_path), timeout=30, isolation=ISOLATION)
    runner.start()
    try:
        run = runner.run(probe_src)
    finally:
        runner.shutdown()
    assert run.status == "ok", run.error
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["uid"] != 0
    assert len(got["procs"]) <= 3  # bwrap's init and the kernel (and its helper), not the grader
    assert got["authored"] is False and got["submissions"] is False
    assert got["write_pkg"] in ("PermissionError", "OSError")
    assert "pytest" not in got["ppid_cmdline"] and ".ipynb" not in got["ppid_cmdline"]


def test_output_is_capped_per_cell(tmp_path):
    from minipaged.grading.executor import MAX_OUTPUT_BYTES, KernelRunner

    runner = KernelRunner(cwd=str(tmp_path), timeout=300, isolation=ISOLATION)
    runner.start()
    try:
        run = runner.run(
            'for _ in range(30):\n    print("x" * 1_000_000)\nfor i in range(2000):\n    display(i)'
        )
        assert run.status == "ok", (run.status, run.error)
        after = runner.run("print('still here')")
    finally:
        runner.shutdown()
    kept = sum(len(o.get("text", "").encode()) for o in run.outputs)
    assert kept <= MAX_OUTPUT_BYTES + 2000
    assert after.stdout == "still here\n"


def test_one_oversize_output_message_is_dropped_and_the_kernel_replaced(tmp_path):
    from minipaged.grading.executor import MAX_MESSAGE_BYTES, KernelRunner

    runner = KernelRunner(cwd=str(tmp_path), timeout=300, isolation=ISOLATION)
    runner.start()
    try:
        run = runner.run(f'print("y" * {MAX_MESSAGE_BYTES + 2**20})')
        assert run.status == "died" and "MiB" in run.error and not runner.running
        runner.start()
        assert runner.run("print('fresh')").stdout == "fresh\n"
    finally:
        runner.shutdown()


def test_csv_is_written_after_each_submission(tmp_path):
    path = tmp_path / "scores.csv"
    seen = []

    def save(done):
        write_csv(done, path)
        seen.append(len(list(csv.DictReader(path.open()))))

    paths = [str(SUBMISSIONS / "ch02_malformed.ipynb"), str(CHEATS / "ch02_printed_ticks.ipynb")]
    grade_many(paths, AUTHORED, timeout=20, jobs=1, isolation=ISOLATION, on_result=save)
    assert seen == [1, 2]


def test_scan_passes_every_authored_solution_and_setup():
    from minipaged.checks.notebook import cell_role
    from minipaged.grading.scan import scan_cells

    for chapter, a in AUTHORED.items():
        cells = [cell_source(c) for c in a.nb.cells if c.cell_type == "code" and cell_role(c) != "check"]
        assert scan_cells(cells, chapter) == [[] for _ in cells], chapter


@pytest.mark.parametrize(
    "src,rule",
    [
        ("import contextlib\ncontextlib.redirect_stdout = print", "patch"),
        ("import importlib\nimportlib.import_module('minipaged.' + 'checks')", "banned-module"),
        ("__import__('minipaged.checks')", "banned-builtin"),
        ("m = __builtins__", "dunder-name"),
        ("getattr(q, name)", "getattr"),
        ("getattr(q, '__class__')", "dunder-attribute"),
        ("def f(q):\n    type(q).popleft(q)", "type-attribute"),
        ("def f(q):\n    super(type(q), q).popleft()", "super-args"),
        ("def f(q):\n    return type(q).mro()[1]", "frame-attribute"),
        ("import sys\nsys.meta_path.insert(0, None)", "sys-internals"),
        ("import sys\nsys.modules['minipaged.checks'] = None", "sys-internals"),
        ("get_ipython().events.register('pre_run_cell', print)", "ipython-hook"),
        ("!cat /etc/passwd", "ipython-hook"),
        ("%load notebooks/exercises/ch02_block_tables.ipynb", "ipython-magic"),
        ("import builtins\nbuiltins.print = None", "banned-module"),
        ("import os\nos.system('ls')", "files-processes"),
        ("from minipaged.core import KVCacheManager as K\nK.allocate_slots(m, 'r', 1)", "reference"),
        ("import minipaged.core as c\nx = c.KVCacheManager.allocate_slots", "reference"),
        ("from minipaged.core import KVCacheManager\nclass M(KVCacheManager): pass", "reference"),
        ("import torch\ntorch.allclose = lambda *a, **k: True", "patch"),
        ("import sys\nsys.stdout = open", "patch"),
        ("import sys\nsys.stdout.write = len", "patch"),
    ],
)
def test_scan_finds_banned_constructs(src, rule):
    from minipaged.grading.scan import scan_source

    found = scan_source(src, "ch02")
    assert rule in {f.rule for f in found}, found


def test_every_chapter_reference_names_a_package_object():
    """A reference that names nothing (a module renamed or deleted) guards nothing."""
    from minipaged.grading.scan import REFERENCES, _resolve_object

    missing = [name for refs in REFERENCES.values() for name in refs if _resolve_object(name) is None]
    assert missing == []


def test_scan_flags_the_engine_loop_in_ch09():
    from minipaged.grading.scan import scan_source

    src = "from minipaged.engine.core import EngineCoreProc\nEngineCoreProc.run_busy_loop"
    assert "reference" in {f.rule for f in scan_source(src, "ch09")}


def test_scan_allows_what_solutions_need():
    from minipaged.grading.scan import scan_cells

    cells = [
        "from minipaged.core import FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager, cdiv",
        "%time x = 1\nimport sys\nprint('debug', file=sys.stderr)",
        "def remove(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:\n"
        "    assert isinstance(queue, FreeKVCacheBlockQueue)\n"
        "    block.prev_free_block.next_free_block = block.next_free_block\n"
        "    queue.num_free_blocks -= 1\n"
        "    print(type(block).__name__, getattr(block, 'block_id', None))",
    ]
    assert scan_cells(cells, "ch02") == [[], [], []]


# -- nbgrader export (issue 15, item 6) ----------------------------------------------------


def test_nbgrader_metadata_one_grade_cell_per_exercise():
    from minipaged.grading.nbgrader_export import to_nbgrader

    for chapter, a in AUTHORED.items():
        nb = to_nbgrader(a.nb, chapter)
        metas = [c.metadata["nbgrader"] for c in nb.cells]
        grades = [m for m in metas if m["grade"]]
        assert [m["grade_id"] for m in grades] == [f"{ex.replace('.', '_')}_check" for ex in a.exercises]
        assert all(m["points"] == 1 and m["locked"] and not m["solution"] for m in grades)
        assert len({m["grade_id"] for m in metas}) == len(metas)  # unique ids
        for c, m in zip(nb.cells, metas):
            if m["solution"]:
                assert "### BEGIN SOLUTION" in cell_source(c) and not m["locked"]
            else:
                assert m["locked"] and c.metadata["editable"] is False


def test_nbgrader_round_trip_scores_solved_and_unsolved(tmp_path):
    pytest.importorskip("nbgrader", reason="nbgrader is in the test extra; install it to run this test")
    import shutil
    import subprocess

    from minipaged.cli import main

    course = tmp_path / "course"
    assert main(["exercises", "--nbgrader", str(course), "--chapter", "ch02"]) == 0
    name = AUTHORED["ch02"].name

    def nbgrader(*args):
        r = subprocess.run(
            [sys.executable, "-m", "nbgrader", *args, "--course-dir", str(course)],
            cwd=course,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    nbgrader("generate_assignment", "minipaged")
    release = course / "release" / "minipaged" / name
    text = release.read_text()
    assert "### BEGIN SOLUTION" not in text and "queue.num_free_blocks -= 1" not in text
    for student, src in (("solved", course / "source" / "minipaged" / name), ("unsolved", release)):
        (course / "submitted" / student / "minipaged").mkdir(parents=True)
        shutil.copy(src, course / "submitted" / student / "minipaged" / name)
    nbgrader("autograde", "minipaged", "--create")
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {
            s: (gb.find_submission("minipaged", s).score, gb.find_submission("minipaged", s).max_score)
            for s in ("solved", "unsolved")
        }
    assert scores == {"solved": (7.0, 7.0), "unsolved": (0.0, 7.0)}
