"""``minipaged grade SUBMISSION... [--csv FILE] [--timeout S]``: tamper-proof grading.

Concept
    A submission is a student's copy of an exercise notebook. Before it runs, every check
    cell is *restored from the authored notebook* (source and metadata, matched by
    exercise id): the student's own check cells are dropped, and each authored check cell
    is put right after the student's last solution cell of that exercise (or at the end
    if the student deleted it). Faking, editing, moving or deleting a check cell therefore
    changes nothing. Then the cells run one by one in a fresh Jupyter kernel, each with a
    time limit. An exercise scores 1 when its restored check cell printed its
    ``✅ exN.M passed`` line and raised nothing, else 0.

Inputs / outputs
    ``grade_submission(path, authored, timeout)`` -> ``SubmissionResult`` (per exercise:
    passed and a one-line reason; per cell: what happened). ``format_table(results)`` is
    the score table the command prints; ``write_csv(results, path)`` writes it.

Invariants
    a wrong, crashing or hanging exercise scores zero for itself only: errors never stop
    the run; a cell that outlives the timeout is interrupted; if the kernel ignores the
    interrupt or dies, a fresh kernel is started, the student's earlier cells are replayed
    (skipping the ones that hung or killed a kernel) and grading goes on. Output printed
    by the student's own cells never counts: only the restored check cell's does.

Failure mode
    a file that is not a readable notebook, or whose chapter cannot be told, gets a
    one-line message and a row of zeros, never a traceback. Missing authored notebooks
    -> exit code 2 with a message.

Limits (stated in docs/instructor_guide.md): the student's code runs in the same Python
process as the checker, so code written to monkeypatch ``minipaged.checks`` could fool
it; the grader flags cells that mention ``minipaged.checks`` for a human to look at.
"""

from __future__ import annotations

import csv
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from minipaged.checks._harness import pass_line

DEFAULT_TIMEOUT = 60.0


@dataclass
class ExerciseResult:
    passed: bool
    reason: str = ""  # why it failed, one line (empty when passed)


@dataclass
class CellReport:
    index: Optional[int]  # cell index in the submission; None for a restored check cell
    kind: str  # "student" | "check"
    exercise: Optional[str]
    status: str  # ok | error | timeout | hung | died
    error: str = ""


@dataclass
class SubmissionResult:
    submission: str
    chapter: Optional[str]
    exercises: dict = field(default_factory=dict)  # exercise id -> ExerciseResult
    error: Optional[str] = None  # the whole notebook could not be graded
    cells: list = field(default_factory=list)  # CellReport per executed cell
    flags: list = field(default_factory=list)  # things for a human to look at

    @property
    def score(self) -> int:
        return sum(r.passed for r in self.exercises.values())

    @property
    def max_score(self) -> Optional[int]:
        return len(self.exercises) if self.exercises or self.chapter else None


@dataclass
class _PlanCell:
    source: str
    kind: str  # "student" | "check"
    exercise: Optional[str]
    index: Optional[int]


def build_plan(nb, authored) -> list[_PlanCell]:
    """The cells to run: the student's code cells, with the authored check cells restored."""
    from minipaged.checks.notebook import cell_exercise, cell_role, cell_source

    plan: list[_PlanCell] = []
    last_solution_pos: dict[str, int] = {}
    for i, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code" or cell_role(cell) == "check":
            continue  # a student's check cell (possibly edited) is never run
        src = cell_source(cell)
        if not src.strip():
            continue
        plan.append(_PlanCell(src, "student", cell_exercise(cell), i))
        if cell_role(cell) == "solution" and cell_exercise(cell):
            last_solution_pos[cell_exercise(cell)] = len(plan) - 1
    # Insert restored check cells after their solution cell, back to front so the
    # recorded positions stay valid; exercises without a solution cell go at the end.
    at_end = []
    inserts = []
    for ex in authored.exercises:
        check = _PlanCell(cell_source(authored.check_cells[ex]), "check", ex, None)
        if ex in last_solution_pos:
            inserts.append((last_solution_pos[ex], check))
        else:
            at_end.append(check)
    for pos, check in sorted(inserts, key=lambda t: t[0], reverse=True):
        plan.insert(pos + 1, check)
    return plan + at_end


def _flags(nb) -> list[str]:
    from minipaged.checks.notebook import cell_role, cell_source

    out = []
    for i, cell in enumerate(nb.cells):
        if cell.get("cell_type") == "code" and cell_role(cell) != "check":
            src = cell_source(cell)
            if re.search(r"minipaged\s*\.\s*checks|from\s+minipaged\s+import\s+checks", src):
                out.append(f"cell {i} mentions minipaged.checks (look at it)")
    return out


def _run_plan(plan: list[_PlanCell], timeout: float, cwd: str) -> list[tuple[_PlanCell, object]]:
    from minipaged.checks._executor import CellRun, KernelRunner

    runner = KernelRunner(cwd=cwd, timeout=timeout)
    results: list[tuple[_PlanCell, CellRun]] = []
    bad: set[int] = set()  # plan positions that hung or killed a kernel: never replayed
    try:
        runner.start()
        for pos, cell in enumerate(plan):
            if not runner.running:
                _restart_and_replay(runner, plan, pos, bad)
            run = runner.run(cell.source)
            if not run.alive:
                bad.add(pos)
            results.append((cell, run))
    finally:
        runner.shutdown()
    return results


def _restart_and_replay(runner, plan: list[_PlanCell], upto: int, bad: set[int]) -> None:
    """Fresh kernel; re-run the student's cells before ``upto`` that did not hang or crash."""
    while True:
        runner.restart()
        for pos in range(upto):
            if pos in bad or plan[pos].kind == "check":
                continue
            run = runner.run(plan[pos].source)
            if not run.alive:
                bad.add(pos)
                break  # this one hangs too now: mark it and start over
        else:
            return


def _reason(run) -> str:
    if run.status in ("timeout", "hung", "died"):
        return run.error
    if run.status == "error":
        lines = run.error.splitlines()[:4] if run.error else ["raised an error"]
        lines[0] = lines[0].removeprefix("ExerciseFailure: ")
        return " | ".join(line.strip() for line in lines)
    return "the check printed no ✅ line"


def grade_notebook(nb, authored, timeout: float = DEFAULT_TIMEOUT, submission: str = "") -> SubmissionResult:
    """Grade an in-memory notebook of ``authored.chapter``."""
    result = SubmissionResult(submission=submission, chapter=authored.chapter)
    result.flags = _flags(nb)
    plan = build_plan(nb, authored)
    with tempfile.TemporaryDirectory(prefix="minipaged-grade-") as cwd:
        try:
            runs = _run_plan(plan, timeout, cwd)
        except RuntimeError as e:  # the kernel did not start
            result.error = str(e)
            result.exercises = {ex: ExerciseResult(False, str(e)) for ex in authored.exercises}
            return result
    solution_trouble: dict[str, str] = {}  # exercise -> what went wrong in its solution cell
    for cell, run in runs:
        result.cells.append(CellReport(cell.index, cell.kind, cell.exercise, run.status, run.error))
        if cell.kind == "student" and cell.exercise and run.status != "ok":
            solution_trouble.setdefault(cell.exercise, f"its solution cell (cell {cell.index}): {_reason(run)}")
        if cell.kind == "check":
            ok = run.status == "ok" and pass_line(cell.exercise) in run.stdout.splitlines()
            reason = ""
            if not ok:
                reason = _reason(run)
                if cell.exercise in solution_trouble:
                    reason = f"{solution_trouble[cell.exercise]}; then the check: {reason}"
            result.exercises[cell.exercise] = ExerciseResult(ok, reason)
    # authored order, whatever order the cells ran in
    result.exercises = {ex: result.exercises[ex] for ex in authored.exercises}
    return result


def grade_submission(path, authored_by_chapter: dict, timeout: float = DEFAULT_TIMEOUT,
                     chapter: Optional[str] = None) -> SubmissionResult:
    """Grade one notebook file; never raises for a bad submission."""
    from minipaged.checks.notebook import MalformedNotebook, identify_chapter, read_submission

    name = str(path)
    try:
        nb = read_submission(path)
    except MalformedNotebook as e:
        ch = chapter or _chapter_from_name(name, authored_by_chapter)
        return _zero_row(name, ch, authored_by_chapter, str(e))
    ch = chapter or identify_chapter(nb, path, set(authored_by_chapter))
    if ch is None:
        return _zero_row(name, None, authored_by_chapter,
                         "cannot tell which chapter this is (no minipaged metadata, no chNN in the name); "
                         "pass --chapter")
    if ch not in authored_by_chapter:
        return _zero_row(name, None, authored_by_chapter, f"no authored exercises for chapter {ch!r}")
    return grade_notebook(nb, authored_by_chapter[ch], timeout=timeout, submission=name)


def grade_many(paths, authored_by_chapter: dict, timeout: float = DEFAULT_TIMEOUT,
               chapter: Optional[str] = None, jobs: int = 1, progress: bool = False) -> list[SubmissionResult]:
    """Grade several submissions (``jobs`` at a time, one kernel each); results in input order."""

    def one(path):
        if progress:
            print(f"grading {path} ...", file=sys.stderr, flush=True)
        return grade_submission(path, authored_by_chapter, timeout=timeout, chapter=chapter)

    if jobs <= 1 or len(paths) <= 1:
        return [one(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, paths))


def _chapter_from_name(name: str, authored_by_chapter: dict) -> Optional[str]:
    m = re.search(r"ch(\d\d)", Path(name).name)
    return f"ch{m.group(1)}" if m and f"ch{m.group(1)}" in authored_by_chapter else None


def _zero_row(name, chapter, authored_by_chapter, message) -> SubmissionResult:
    exs = authored_by_chapter[chapter].exercises if chapter in authored_by_chapter else []
    return SubmissionResult(
        submission=name,
        chapter=chapter,
        exercises={ex: ExerciseResult(False, message) for ex in exs},
        error=message,
    )


# -- reporting ---------------------------------------------------------------------------


def _ex_key(ex: str):
    m = re.fullmatch(r"ex(\d+)\.(\d+)", ex)
    return (int(m.group(1)), int(m.group(2))) if m else (10**6, 0)


def format_table(results: list[SubmissionResult], details: bool = True) -> str:
    """One table per chapter (rows: submissions, columns: exercises), then the reasons."""
    lines: list[str] = []
    by_chapter: dict = {}
    for r in results:
        by_chapter.setdefault(r.chapter or "?", []).append(r)
    for ch in sorted(by_chapter, key=lambda c: (c == "?", c)):
        rows = by_chapter[ch]
        exs = sorted({ex for r in rows for ex in r.exercises}, key=_ex_key)
        name_w = max([len("submission")] + [len(r.submission) for r in rows])
        col_w = max([5] + [len(ex) for ex in exs])
        title = f"chapter {ch}" if ch != "?" else "could not tell the chapter"
        lines.append(f"{title}")
        header = "submission".ljust(name_w) + "  " + "  ".join(ex.rjust(col_w) for ex in exs) + "  score"
        lines.append(header)
        lines.append("-" * len(header))
        for r in rows:
            cells = []
            for ex in exs:
                res = r.exercises.get(ex)
                cells.append(("-" if res is None else str(int(res.passed))).rjust(col_w))
            max_score = r.max_score
            score = f"{r.score}/{max_score if max_score is not None else '?'}"
            lines.append(r.submission.ljust(name_w) + "  " + "  ".join(cells) + "  " + score.rjust(5))
        lines.append("")
    if details:
        notes = []
        for r in results:
            if r.error:
                notes.append(f"{r.submission}: {r.error}")
                continue
            for ex, res in r.exercises.items():
                if not res.passed:
                    notes.append(f"{r.submission} {ex}: {res.reason}")
            for flag in r.flags:
                notes.append(f"{r.submission}: note: {flag}")
        if notes:
            lines.append("why:")
            lines.extend("  " + n.replace("\n", " | ") for n in notes)
            lines.append("")
    return "\n".join(lines)


def write_csv(results: list[SubmissionResult], path) -> None:
    exs = sorted({ex for r in results for ex in r.exercises}, key=_ex_key)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["submission", "chapter", *exs, "score", "max_score", "note"])
        for r in results:
            row = [r.submission, r.chapter or ""]
            for ex in exs:
                res = r.exercises.get(ex)
                row.append("" if res is None else int(res.passed))
            reasons = [f"{ex}: {res.reason}" for ex, res in r.exercises.items() if not res.passed]
            note = r.error or "; ".join(reasons + r.flags)
            row += [r.score, "" if r.max_score is None else r.max_score, note]
            w.writerow(row)


# -- command line ------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("submissions", nargs="+", metavar="SUBMISSION",
                        help="student notebooks (.ipynb) to grade")
    parser.add_argument("--csv", metavar="FILE", help="also write the score table as CSV")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds each cell may run before it is interrupted (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--source", metavar="DIR",
                        help="folder of the authored exercise notebooks (default: notebooks/exercises "
                             "of this checkout)")
    parser.add_argument("--chapter", metavar="chNN",
                        help="grade every submission as this chapter (default: read it from the notebook)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="grade N submissions at a time, each in its own kernel (default 1)")
    parser.add_argument("--quiet", action="store_true", help="print the table without the reasons")


def run(args) -> int:
    from minipaged.checks.notebook import load_authored

    if args.timeout <= 0:
        print("minipaged grade: --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        authored = load_authored(args.source)
    except ValueError as e:
        print(f"minipaged grade: {e}", file=sys.stderr)
        return 2
    if args.chapter is not None and args.chapter not in authored:
        print(f"minipaged grade: no exercises for --chapter {args.chapter!r} "
              f"(known: {', '.join(sorted(authored))})", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("minipaged grade: --jobs must be >= 1", file=sys.stderr)
        return 2
    results = grade_many(args.submissions, authored, timeout=args.timeout, chapter=args.chapter,
                         jobs=args.jobs, progress=True)
    print(format_table(results, details=not args.quiet), end="")
    if args.csv:
        write_csv(results, args.csv)
        print(f"wrote {args.csv}")
    return 0
