"""``minipaged grade SUBMISSION... [--csv FILE] [--timeout S] [--budget S] [--jobs N]``.

Concept
    A submission is a student's copy of an exercise notebook. The student's own check
    cells are dropped; in place of each exercise's check the grader puts a *driver cell*
    right after the student's last solution cell of that exercise (or at the end). The
    cells run one by one in a fresh Jupyter kernel inside a throw-away sandbox
    (``sandbox.py``: bubblewrap, an unprivileged user per concurrent slot, rlimits, a
    capped ``/tmp``). A driver cell (``driver.py``) carries only plain-data cases, drawn
    for this grading run by the trusted checker (``trusted.py``, a process outside the
    sandbox, which alone holds the references, the expected values and the instructor's
    key); it calls the student's objects on them and prints the observations as JSON,
    which the trusted side decodes strictly and judges. Nothing the judge holds is ever in
    the student's interpreter, so patching, reflection, frames and lying objects there can
    only change what the kernel prints, never the verdict. Every cell is also *scanned*
    (``scan.py``) for the use of the package's own implementation of the exercise (the one
    thing the boundary cannot tell from the student's work): a finding in an exercise's
    solution cell zeroes that exercise; tampering elsewhere is a flag for a human.

Inputs / outputs
    ``grade_submission(path, authored, timeout, budget=, isolation=)`` ->
    ``SubmissionResult`` (per exercise: passed and a one-line reason; per cell: what
    happened; flags for a human). ``grade_many(..., jobs=, on_result=)`` grades a class;
    ``format_table(results)`` is the printed table; ``write_csv(results, path)``.

Invariants
    a wrong, crashing, hanging or banned exercise scores zero for itself only (a package
    implementation used outside any solution cell: the exercises checked after it); errors
    never stop the run. Cost is
    bounded: each cell has ``timeout``, the submission ``budget`` (cells, restarts and
    replays together); after a kernel death or an ignored interrupt a fresh kernel is
    started and the earlier student cells are replayed once, at most ``MAX_RESTARTS`` times;
    output is capped per cell. The CSV is rewritten after every submission.

Failure mode
    a file that is not a readable notebook, or whose chapter cannot be told, gets a
    one-line message and a row of zeros, never a traceback. Bad options (``--timeout
    nan``, ``--csv /no/such/dir/x.csv``) -> argparse error, exit code 2, before grading.
    What the grader does and does not guarantee: docs/grading.md ("What is guaranteed").
"""

from __future__ import annotations

import csv
import math
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DEFAULT_TIMEOUT = 60.0
DEFAULT_BUDGET = 600.0  # seconds of kernel time per submission, all cells and restarts together
MAX_RESTARTS = 2  # fresh kernels after a death or a hang, per submission
MAX_CELLS = 400  # code cells of one submission the grader runs at most


@dataclass
class ExerciseResult:
    passed: bool
    reason: str = ""  # why it failed, one line (empty when passed)


@dataclass
class CellReport:
    index: Optional[int]  # cell index in the submission; None for a grader cell
    kind: str  # "student" | "check" | "prelude"
    exercise: Optional[str]
    status: str  # ok | error | timeout | hung | died | skipped
    error: str = ""


@dataclass
class SubmissionResult:
    submission: str
    chapter: Optional[str]
    exercises: dict = field(default_factory=dict)  # exercise id -> ExerciseResult
    error: Optional[str] = None  # the whole notebook could not be graded
    cells: list = field(default_factory=list)  # CellReport per executed cell
    flags: list = field(default_factory=list)  # things for a human to look at
    seconds: float = 0.0
    copies: Optional[list] = None  # copy detection's flagged pairs ("ex2.3 ~ bob.ipynb (97%)")

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
    findings: list = field(default_factory=list)  # scan findings (student cells)
    names: list = field(default_factory=list)  # check: the objects handed to the check


def check_call(source: str) -> tuple[str, list[str]]:
    """The exercise id and the names an authored check cell passes to ``check(...)``."""
    import ast

    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "check"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and all(isinstance(a, ast.Name) for a in node.args[1:])
        ):
            return node.args[0].value, [a.id for a in node.args[1:]]
    raise ValueError(f"an authored check cell must call check('exN.M', name, ...): {source!r}")


def build_plan(nb, authored) -> list[_PlanCell]:
    """The cells to run: the student's code cells, with a driver cell for each exercise
    right after the exercise's last solution cell."""
    from minipaged.checks.notebook import cell_exercise, cell_role, cell_source
    from minipaged.grading.scan import scan_cells

    plan: list[_PlanCell] = []
    last_solution_pos: dict[str, int] = {}
    # a check cell that lost its metadata (some editors drop it) is still recognised by its text
    check_texts = {cell_source(c).strip() for c in authored.check_cells.values()}
    for i, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code" or cell_role(cell) == "check":
            continue  # a student's check cell (possibly edited) is never run
        src = cell_source(cell)
        if not src.strip() or src.strip() in check_texts:
            continue
        plan.append(
            _PlanCell(src, "student", cell_exercise(cell) if cell_role(cell) == "solution" else None, i)
        )
        if cell_role(cell) == "solution" and cell_exercise(cell):
            last_solution_pos[cell_exercise(cell)] = len(plan) - 1
    for cell, findings in zip(plan, scan_cells([c.source for c in plan], authored.chapter)):
        cell.findings = findings
    # Insert restored check cells after their solution cell, back to front so the
    # recorded positions stay valid; exercises without a solution cell go at the end.
    from minipaged.checks import has_spec

    at_end = []
    inserts = []
    if len(plan) > MAX_CELLS:
        raise _TooManyCells(len(plan))
    for ex in authored.exercises:
        if not has_spec(ex):
            raise ValueError(f"exercise {ex} of the authored notebook has no spec in minipaged.checks")
        _, names = check_call(cell_source(authored.check_cells[ex]))
        check = _PlanCell("", "check", ex, None, names=names)
        if ex in last_solution_pos:
            inserts.append((last_solution_pos[ex], check))
        else:
            at_end.append(check)
    for pos, check in sorted(inserts, key=lambda t: t[0], reverse=True):
        plan.insert(pos + 1, check)
    return plan + at_end


def banned(plan: list[_PlanCell]) -> dict[str, str]:
    """exercise -> reason, for exercises a scan finding zeroes: any finding in an exercise's
    own solution cell zeroes it (the authored solutions scan clean); in a cell of no
    exercise, a use of the package's implementation (``tamper=False``) zeroes every exercise
    checked after it. Tampering outside a solution cell is a flag for a human only: the
    trusted boundary makes it powerless (the cheat suite shows it with the scan off)."""
    out: dict[str, str] = {}
    for pos, cell in enumerate(plan):
        if cell.kind != "student":
            continue
        found = cell.findings if cell.exercise else [f for f in cell.findings if not f.tamper]
        if not found:
            continue
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        reason = f"banned in cell {cell.index}: {found[0]}{more}"
        if cell.exercise:
            out.setdefault(cell.exercise, reason)
        else:
            for later in plan[pos + 1 :]:
                if later.kind == "check":
                    out.setdefault(later.exercise, reason)
    return out


def _flags(plan: list[_PlanCell]) -> list[str]:
    out = []
    for cell in plan:
        for f in cell.findings:
            out.append(f"cell {cell.index}: {f}")
    return out


class _TooManyCells(Exception):
    pass


@dataclass
class _Run:
    cell: _PlanCell
    run: object
    payload: str = ""  # check: the cases sent (the trusted side's own text)
    result: Optional[str] = None  # check: the JSON text the kernel printed


def _run_plan(
    plan: list[_PlanCell],
    chapter: str,
    exercises: list[str],
    timeout: float,
    cwd: str,
    budget: float = DEFAULT_BUDGET,
    isolation=None,
    max_restarts: int = MAX_RESTARTS,
    checker=None,
    seed: str = "",
    student_seed=None,
    env: Optional[dict] = None,
) -> list[_Run]:
    from minipaged.grading import driver
    from minipaged.grading.codec import MAX_RESULT_BYTES
    from minipaged.grading.executor import CellRun, KernelRunner

    runner = KernelRunner(cwd=cwd, timeout=timeout, isolation=isolation, env=env)
    results: list[_Run] = []
    deadline = time.monotonic() + budget
    state = {"restarts": 0}
    bad: set[int] = set()  # plan positions that hung or killed a kernel: never replayed
    # the grader's first cell: the kernel is up and imports the driver (it holds nothing)
    prelude = "import minipaged.grading.driver"

    def left() -> float:
        return deadline - time.monotonic()

    def start_kernel() -> bool:
        runner.restart() if runner.km is not None else runner.start()
        run = runner.run(prelude, timeout=max(1.0, min(120.0, left())), store_history=False)
        if run.status != "ok":
            raise RuntimeError(f"the grader's first cell failed in the kernel: {run.status} {run.error}")
        return True

    def stopped(why: str) -> CellRun:
        return CellRun("skipped", "", why)

    stop_reason = ""
    try:
        start_kernel()
        for pos, cell in enumerate(plan):
            if not stop_reason and left() <= 0:
                stop_reason = f"the submission's time budget ({budget:g} s) ran out before this cell"
            if not stop_reason and not runner.running:
                if state["restarts"] >= max_restarts:
                    last = f" (last: {state['last']})" if state.get("last") else ""
                    stop_reason = (
                        f"the kernel died or hung {state['restarts'] + 1} times{last}; grading of this "
                        "submission stopped there"
                    )
                else:
                    state["restarts"] += 1
                    try:
                        _restart_and_replay(runner, plan, pos, bad, start_kernel, left)
                    except Exception as e:  # a fresh kernel did not start: the rest is skipped
                        stop_reason = f"a fresh kernel could not be started ({e})"
                    if not stop_reason and left() <= 0:
                        stop_reason = f"the submission's time budget ({budget:g} s) ran out before this cell"
            if stop_reason:
                results.append(_Run(cell, stopped(stop_reason)))
                continue
            payload = nonce = ""
            source = cell.source
            if cell.kind == "check":
                payload, nonce = checker.payload(cell.exercise, seed, student_seed)
                source = driver.check_source(cell.exercise, payload, cell.names)
            run = runner.run(
                source,
                timeout=max(0.1, min(timeout, left())),
                store_history=cell.kind == "student",
                max_output_bytes=MAX_RESULT_BYTES + 2**16 if cell.kind == "check" else None,
            )
            if not run.alive:
                bad.add(pos)
                state["last"] = f"cell {cell.index}: {run.error}" if cell.index is not None else run.error
            result = driver.extract(run.stdout, nonce) if cell.kind == "check" else None
            results.append(_Run(cell, run, payload, result))
    finally:
        runner.shutdown()
    return results


def _restart_and_replay(runner, plan: list[_PlanCell], upto: int, bad: set[int], start_kernel, left) -> None:
    """Fresh kernel; re-run the student's cells before ``upto`` that did not hang
    or crash, once each, within the submission's budget."""
    start_kernel()
    for pos in range(upto):
        if pos in bad or plan[pos].kind == "check":
            continue
        if left() <= 0:
            return
        run = runner.run(plan[pos].source, timeout=max(0.1, min(runner.timeout, left())))
        if not run.alive:
            bad.add(pos)  # it hangs or crashes now: never again
            if not runner.running:
                return  # the next cell sees a dead kernel and counts it as a restart


def _reason(run) -> str:
    if run.status in ("timeout", "hung", "died", "skipped"):
        return run.error
    if run.status == "error":
        lines = run.error.splitlines()[:4] if run.error else ["raised an error"]
        lines[0] = lines[0].removeprefix("ExerciseFailure: ")
        return " | ".join(line.strip() for line in lines)
    return "the check printed no verdict (the grader's check did not run to its end)"


def grade_notebook(
    nb,
    authored,
    timeout: float = DEFAULT_TIMEOUT,
    submission: str = "",
    budget: float = DEFAULT_BUDGET,
    isolation=None,
    scan: bool = True,
    checker=None,
    seed: Optional[str] = None,
    student_seed: Optional[str] = None,
    use_student_build: bool = True,
) -> SubmissionResult:
    """Grade an in-memory notebook of ``authored.chapter``. ``scan=False`` ignores the static
    scan's findings (used by the tests to show what the other layers hold on their own).
    The kernel imports the chapter's student build of the package (``student_package``);
    ``use_student_build=False`` gives it the real package (the tests' comparison only).
    ``checker``: the ``TrustedChecker`` (one is started when ``None``); ``seed``: this grading
    run's seed (a fresh random one when ``None``); ``student_seed``: the student's seed from
    the instructor (``roster.student_seed``), ``None`` for the shipped variants. The seed in
    the notebook's metadata is never read: it is the student's to edit."""
    t0 = time.monotonic()
    result = SubmissionResult(submission=submission, chapter=authored.chapter)
    try:
        plan = build_plan(nb, authored)
    except _TooManyCells as e:
        msg = f"the notebook has {e.args[0]} code cells; the grader runs at most {MAX_CELLS}"
        result.error = msg
        result.exercises = {ex: ExerciseResult(False, msg) for ex in authored.exercises}
        return result
    if checker is None:
        from minipaged.grading.trusted import TrustedChecker

        with TrustedChecker() as own:
            return grade_notebook(
                nb,
                authored,
                timeout,
                submission,
                budget,
                isolation,
                scan,
                own,
                seed,
                student_seed,
                use_student_build,
            )
    seed = seed if seed is not None else new_seed()
    result.flags = _flags(plan)
    zeroed = banned(plan) if scan else {}
    env = None
    if use_student_build:
        try:
            build = student_package(authored.chapter, isolation)
        except Exception as e:  # a bad answered_by: every row says so, the run goes on
            msg = f"the grader could not make the student build of {authored.chapter}: {e}"
            result.error = msg
            result.exercises = {ex: ExerciseResult(False, msg) for ex in authored.exercises}
            return result
        if isolation is not None:
            isolation = isolation.with_package(build)
        else:  # no sandbox at all: the build first on the kernel's path
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(build).parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
            )
    with tempfile.TemporaryDirectory(prefix="minipaged-grade-") as cwd:
        try:
            runs = _run_plan(
                plan,
                authored.chapter,
                authored.exercises,
                timeout,
                cwd,
                budget=budget,
                isolation=isolation,
                checker=checker,
                seed=seed,
                student_seed=student_seed,
                env=env,
            )
        except Exception as e:  # the first kernel did not start (RuntimeError) or worse
            result.error = str(e) if isinstance(e, RuntimeError) else f"the grader failed on this file: {e}"
            result.exercises = {ex: ExerciseResult(False, str(e)) for ex in authored.exercises}
            result.seconds = time.monotonic() - t0
            return result
    solution_trouble: dict[str, str] = {}  # exercise -> what went wrong in its solution cell
    for r in runs:
        cell, run = r.cell, r.run
        result.cells.append(CellReport(cell.index, cell.kind, cell.exercise, run.status, run.error))
        if cell.kind == "student" and cell.exercise and run.status != "ok":
            solution_trouble.setdefault(
                cell.exercise, f"its solution cell (cell {cell.index}): {_reason(run)}"
            )
        if cell.kind == "check":
            ok, reason = False, ""
            if run.status != "ok":
                reason = _reason(run)
            elif r.result is None:
                reason = "the check printed no results (the driver cell did not run to its end)"
            else:
                ok, reason = checker.judge(cell.exercise, r.payload, r.result)
                # one line for the table and the CSV
                reason = "" if ok else " | ".join(ln.strip() for ln in reason.splitlines()[:6])
                if reason.startswith("the grader's checker failed"):
                    result.flags.append(f"{cell.exercise}: {reason}")
            if cell.exercise in zeroed:
                ok, reason = False, zeroed[cell.exercise]
            elif not ok:
                reason = reason or _reason(run)
                if cell.exercise in solution_trouble and reason not in solution_trouble[cell.exercise]:
                    reason = f"{solution_trouble[cell.exercise]}; then the check: {reason}"
                elif cell.exercise in solution_trouble:
                    reason = solution_trouble[cell.exercise]
            result.exercises[cell.exercise] = ExerciseResult(ok, reason)
    # authored order, whatever order the cells ran in
    result.exercises = {ex: result.exercises[ex] for ex in authored.exercises}
    result.seconds = time.monotonic() - t0
    return result


def grade_submission(
    path,
    authored_by_chapter: dict,
    timeout: float = DEFAULT_TIMEOUT,
    chapter: Optional[str] = None,
    budget: float = DEFAULT_BUDGET,
    isolation=None,
    scan: bool = True,
    checker=None,
    seed: Optional[str] = None,
    student_seed: Optional[str] = None,
    use_student_build: bool = True,
) -> SubmissionResult:
    """Grade one notebook file; never raises for a bad submission."""
    from minipaged.checks.notebook import (
        MalformedNotebook,
        identify_chapter,
        read_submission,
    )

    name = str(path)
    try:
        nb = read_submission(path)
    except MalformedNotebook as e:
        ch = chapter or _chapter_from_name(name, authored_by_chapter)
        return _zero_row(name, ch, authored_by_chapter, str(e))
    ch = chapter or identify_chapter(nb, path, set(authored_by_chapter))
    if ch is None:
        return _zero_row(
            name,
            None,
            authored_by_chapter,
            "cannot tell which chapter this is (no minipaged metadata, no chNN in the name); pass --chapter",
        )
    if ch not in authored_by_chapter:
        return _zero_row(name, None, authored_by_chapter, f"no authored exercises for chapter {ch!r}")
    return grade_notebook(
        nb,
        authored_by_chapter[ch],
        timeout=timeout,
        submission=name,
        budget=budget,
        isolation=isolation,
        scan=scan,
        checker=checker,
        seed=seed,
        student_seed=student_seed,
        use_student_build=use_student_build,
    )


def grade_many(
    paths,
    authored_by_chapter: dict,
    timeout: float = DEFAULT_TIMEOUT,
    chapter: Optional[str] = None,
    jobs: int = 1,
    progress: bool = False,
    budget: float = DEFAULT_BUDGET,
    isolation=None,
    on_result=None,
    key_path=None,
    seed: Optional[str] = None,
    student_seeds: Optional[dict] = None,
    scan: bool = True,
    use_student_build: bool = True,
) -> list[SubmissionResult]:
    """Grade several submissions (``jobs`` at a time, one sandboxed kernel each, each job with
    its own sandbox uid and its own trusted checker process); results in input order.
    ``on_result(results_so_far)`` is called after each submission (in input order of those
    done), e.g. to rewrite the CSV. ``student_seeds``: ``{path: the student's seed}`` from
    the roster (``roster.py``); when given, a path it lacks gets a row of zeros saying so.
    ``scan=False``: the static scan's findings zero nothing (they stay flags). Each chapter's
    student build is made once, before the first submission of it is graded."""

    from minipaged.grading.trusted import TrustedChecker

    paths = list(paths)
    seed = seed if seed is not None else new_seed()
    done: dict[int, SubmissionResult] = {}
    lock = threading.Lock()

    def one(i_path):
        # NOTE: each concurrent submission takes a slot: its own sandbox uid, so its process
        # limit and whatever it leaves behind are its own (``sandbox.Isolation.for_slot``)
        slot = free_slots.get()
        try:
            return graded(i_path, slot)
        finally:
            free_slots.put(slot)

    def graded(i_path, slot):
        i, path = i_path
        if progress:
            print(f"grading {path} ...", file=sys.stderr, flush=True)
        if student_seeds is not None and student_seeds.get(str(path)) is None:
            r = _zero_row(
                str(path),
                chapter or _chapter_from_name(str(path), authored_by_chapter),
                authored_by_chapter,
                "not in the roster: the grader cannot tell whose submission this is",
            )
            with lock:
                done[i] = r
                if on_result is not None:
                    on_result([done[k] for k in sorted(done)])
            return r
        try:
            r = grade_submission(
                path,
                authored_by_chapter,
                timeout=timeout,
                chapter=chapter,
                budget=budget,
                isolation=None if isolation is None else isolation.for_slot(slot),
                scan=scan,
                checker=checker,
                seed=seed,
                student_seed=None if student_seeds is None else student_seeds[str(path)],
                use_student_build=use_student_build,
            )
        except Exception as e:  # never lose the rest of the class to one submission
            r = _zero_row(str(path), None, authored_by_chapter, f"the grader failed on this file: {e}")
        with lock:
            done[i] = r
            if on_result is not None:
                on_result([done[k] for k in sorted(done)])
        return r

    jobs = max(1, min(jobs, len(paths)))
    import queue

    free_slots: queue.Queue = queue.Queue()
    for k in range(jobs):
        free_slots.put(k)
    with TrustedChecker(key_path, jobs=jobs) as checker:
        if jobs <= 1:
            return [one(p) for p in enumerate(paths)]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, enumerate(paths)))


_BUILDS: dict = {}  # (chapter, cache folder) -> the student build's path, made once per process
_BUILD_LOCK = threading.Lock()


def student_package(chapter: str, isolation=None) -> str:
    """The folder of ``chapter``'s student build (``student_build.py``) the kernels import,
    made once per process (and cached on disk per package version). A sandbox user without
    bubblewrap must read it by its own path: then the build goes in a fresh root-owned
    folder of this process that every user can read, not in root's cache."""
    from minipaged.grading.student_build import student_build

    with _BUILD_LOCK:
        cache = None
        if isolation is not None and isolation.user and not isolation.bwrap:
            cache = _BUILDS.get("readable folder")
            if cache is None:
                cache = _BUILDS["readable folder"] = tempfile.mkdtemp(prefix="minipaged-builds-")
                os.chmod(cache, 0o755)
                import atexit
                import shutil

                atexit.register(shutil.rmtree, cache, True)
        key = (chapter, cache)
        if key not in _BUILDS:
            _BUILDS[key] = student_build(chapter, cache_dir=cache)
        return _BUILDS[key]


def new_seed() -> str:
    """A fresh seed for one grading run: the graded cases are drawn from it."""
    import secrets

    return secrets.token_hex(8)


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
        with_copies = any(r.copies is not None for r in results)
        w.writerow(["submission", "chapter", *exs, "score", "max_score", "note"] + ["copies"] * with_copies)
        for r in results:
            row = [r.submission, r.chapter or ""]
            for ex in exs:
                res = r.exercises.get(ex)
                row.append("" if res is None else int(res.passed))
            reasons = [f"{ex}: {res.reason}" for ex, res in r.exercises.items() if not res.passed]
            note = r.error or "; ".join(reasons + r.flags)
            row += [r.score, "" if r.max_score is None else r.max_score, note]
            if with_copies:
                row.append("; ".join(r.copies or []))
            w.writerow(row)


def copy_report_path(csv_path) -> Path:
    """Where the copy-detection report goes: beside the CSV, ``NAME.copies.html``."""
    p = Path(csv_path)
    return p.with_name(p.stem + ".copies.html")


def detect_copies(results: list[SubmissionResult], authored_by_chapter: dict, html_path=None) -> list:
    """Fingerprint every submission's solution cells (``copy_detect.py``), set each result's
    ``copies``, write the HTML report to ``html_path``; returns the flagged pairs."""
    from minipaged.checks.notebook import MalformedNotebook, read_submission
    from minipaged.grading import copy_detect

    entries = []
    for r in results:
        try:
            nb = read_submission(r.submission)
        except MalformedNotebook:
            nb = None
        entries.append((r.submission, r.chapter, nb))
    matches, texts = copy_detect.detect(entries, authored_by_chapter)
    flagged = copy_detect.by_submission(matches)
    for r in results:
        r.copies = flagged.get(r.submission, [])
    if html_path is not None:
        copy_detect.write_html(matches, texts, html_path)
    return matches


# -- command line ------------------------------------------------------------------------


def _positive_seconds(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _csv_path(text: str) -> str:
    import argparse

    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}")
    return text


def add_arguments(parser) -> None:
    parser.add_argument(
        "submissions",
        nargs="*",
        metavar="SUBMISSION",
        help="student notebooks (.ipynb) to grade (default with --roster: every notebook it names)",
    )
    parser.add_argument(
        "--roster",
        metavar="FILE",
        help="CSV with the columns student_id and file (a notebook or a folder): whose each "
        "submission is; the student's seed is HMAC(secret, student id), never the notebook's",
    )
    parser.add_argument(
        "--nbgrader-layout",
        action="store_true",
        help="tell the student id from nbgrader's folders: submitted/<student_id>/<assignment>/*.ipynb",
    )
    parser.add_argument(
        "--secret",
        metavar="FILE",
        help="the instructor's secret for the per-student seeds (default: $MINIPAGED_GRADING_SECRET); "
        "needed with --roster or --nbgrader-layout",
    )
    parser.add_argument(
        "--csv",
        metavar="FILE",
        type=_csv_path,
        help="also write the score table as CSV (rewritten after each submission)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds each cell may run before it is interrupted (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--budget",
        type=_positive_seconds,
        default=DEFAULT_BUDGET,
        metavar="S",
        help=f"seconds one submission may take in all, restarts included (default {DEFAULT_BUDGET:g})",
    )
    parser.add_argument(
        "--source",
        metavar="DIR",
        help="folder of the authored exercise notebooks (default: notebooks/exercises of this checkout)",
    )
    parser.add_argument(
        "--chapter",
        metavar="chNN",
        help="grade every submission as this chapter (default: read it from the notebook)",
    )
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        metavar="N",
        help="grade N submissions at a time, each in its own sandboxed kernel (default 1)",
    )
    parser.add_argument(
        "--memory",
        type=_positive_int,
        default=None,
        metavar="MIB",
        help="address-space limit of each kernel in MiB (default 6144)",
    )
    parser.add_argument(
        "--no-sandbox",
        action="store_true",
        help="run kernels without bubblewrap (say so in the printed isolation line)",
    )
    parser.add_argument(
        "--key",
        metavar="FILE",
        help="the instructor's answer key (JSON; default: _instructor/key.json in the --source folder); "
        "concept questions are graded from it, and it never enters a sandbox",
    )
    parser.add_argument(
        "--seed",
        metavar="S",
        help="seed of the graded cases (default: a fresh random one per run, printed)",
    )
    parser.add_argument(
        "--no-copy-detection",
        action="store_true",
        help="skip copy detection (by default every solution cell is fingerprinted against the "
        "package, the authored solutions and the other submissions; flagged pairs go in the CSV's "
        "copies column and NAME.copies.html beside it)",
    )
    parser.add_argument("--quiet", action="store_true", help="print the table without the reasons")
    parser.add_argument(
        "--gradescope",
        metavar="OUT.zip",
        help="write a Gradescope autograder zip (setup.sh, run_autograder) that grades each upload "
        "with this grader (--chapter, --timeout, --budget, --memory, --secret apply) and grade nothing here",
    )
    parser.add_argument(
        "--gradescope-id",
        choices=("id", "email"),
        default="id",
        help="with --gradescope and a secret: the Gradescope user field whose HMAC is the student's seed",
    )


def run(args) -> int:
    from minipaged.checks.notebook import load_authored
    from minipaged.grading.sandbox import Limits, probe

    if not (math.isfinite(args.timeout) and args.timeout > 0) or not (
        math.isfinite(args.budget) and args.budget > 0
    ):
        print("minipaged grade: --timeout and --budget must be finite and > 0", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("minipaged grade: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:
        authored = load_authored(args.source)
    except ValueError as e:
        print(f"minipaged grade: {e}", file=sys.stderr)
        return 2
    if args.chapter is not None and args.chapter not in authored:
        print(
            f"minipaged grade: no exercises for --chapter {args.chapter!r} "
            f"(known: {', '.join(sorted(authored))})",
            file=sys.stderr,
        )
        return 2
    from minipaged.grading.trusted import default_key_path, load_key

    key_path = args.key or default_key_path(args.source)
    if key_path is None:
        print("minipaged grade: no answer key found; pass --key FILE", file=sys.stderr)
        return 2
    try:
        load_key(key_path)
    except ValueError as e:
        print(f"minipaged grade: {e}", file=sys.stderr)
        return 2
    if args.gradescope:
        # NOTE: gradescope.py grades with this module; the CLI reaches it by name, at run
        # time only, so the import graph keeps one direction (gradescope -> grade)
        import importlib

        return importlib.import_module("minipaged.grading.gradescope").from_args(args, authored, key_path)
    student_seeds = None
    submissions = list(args.submissions)
    if args.roster or args.nbgrader_layout:
        from minipaged.grading import roster as roster_mod

        try:
            secret = roster_mod.load_secret(args.secret)
            roster = roster_mod.load_roster(args.roster) if args.roster else None
        except ValueError as e:
            print(f"minipaged grade: {e}", file=sys.stderr)
            return 2
        if not submissions and roster is not None:
            submissions = [p for p, _ in roster.notebooks()]
        ids = roster_mod.identify(submissions, roster, nbgrader=args.nbgrader_layout)
        student_seeds = {
            p: (None if sid is None else roster_mod.student_seed(secret, sid)) for p, sid in ids.items()
        }
    if not submissions:
        print("minipaged grade: no submissions (name notebooks, or pass --roster FILE)", file=sys.stderr)
        return 2
    seed = args.seed or new_seed()
    print(f"graded cases drawn from seed {seed}", file=sys.stderr, flush=True)
    if args.csv:
        try:  # fail now, not after an hour of grading
            with open(args.csv, "a", encoding="utf-8"):
                pass
        except OSError as e:
            print(f"minipaged grade: cannot write --csv {args.csv}: {e.strerror or e}", file=sys.stderr)
            return 2
    limits = Limits()
    if args.memory:
        limits.memory_bytes = args.memory * 2**20
    isolation = probe(limits=limits, use_bwrap=not args.no_sandbox)
    print(isolation.describe(), file=sys.stderr, flush=True)

    def save(done):
        if args.csv:
            write_csv(done, args.csv)

    results = grade_many(
        submissions,
        authored,
        timeout=args.timeout,
        chapter=args.chapter,
        jobs=args.jobs,
        progress=True,
        budget=args.budget,
        isolation=isolation,
        on_result=save,
        key_path=key_path,
        seed=seed,
        student_seeds=student_seeds,
    )
    if not args.no_copy_detection:
        report = copy_report_path(args.csv) if args.csv else None
        matches = detect_copies(results, authored, report)
        print(f"copy detection: {len(matches)} flagged pairs", file=sys.stderr)
        for r in results:
            for c in r.copies or []:
                print(f"{r.submission}: copy? {c}", file=sys.stderr)
    print(format_table(results, details=not args.quiet), end="")
    if args.csv:
        write_csv(results, args.csv)
        print(f"wrote {args.csv}")
        if not args.no_copy_detection:
            print(f"wrote {copy_report_path(args.csv)}")
    return 0
