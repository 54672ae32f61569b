"""The harness every checker uses: cases smallest first, one fixed pass line, clear failures.

Inputs / outputs
    ``run_cases(exercise_id, cases, run_one, size=..., describe=...)`` sorts ``cases`` by
    ``size`` (stable, so equal sizes keep their seeded order), calls ``run_one(case)`` on
    each with the student's stdout captured, and prints ``✅ <id> passed`` when all pass.
    ``run_one`` compares the student's result with the reference and raises ``Mismatch``
    (via ``expect_equal`` / ``expect_close`` / ``expect_raises``) when they differ.

Invariants
    A passing check prints exactly one line. The first failing case in size order is the
    one reported, so the message shows the smallest case that breaks the student's code.

Failure mode
    ``ExerciseFailure`` (an ``AssertionError``, so nbval and the grader see an error) with:
    the case, expected vs got (or the exception the student's code raised, chained so the
    traceback points into the student's code), and what the student's code printed.
    ``NotImplementedError`` anywhere in the student's code (the stub) gives a short
    "not implemented yet" message.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Iterable
from typing import Any, Optional

# NOTE: the harness's own references, bound when it is imported (the grader imports it
# before any student cell runs), so a cell that rebinds contextlib.redirect_stdout,
# io.StringIO or print changes nothing here.
_redirect_stdout = contextlib.redirect_stdout
_StringIO = io.StringIO
_print = print
_isinstance = isinstance
_type = type

PASS_TEMPLATE = "✅ {} passed"


def pass_line(exercise_id: str) -> str:
    """The one line a passing check cell prints (without the newline)."""
    return PASS_TEMPLATE.format(exercise_id)


class ExerciseFailure(AssertionError):
    """The student's code is not right yet; the message says on which case and how."""


class Mismatch(Exception):
    """Raised by a checker's ``run_one`` when the student's result differs from the reference."""


def exercise(registry: dict, exercise_id: str, title: str):
    """Decorator: register a checker ``fn(*student_objects)`` under ``exercise_id``."""

    def deco(fn):
        fn.exercise_id = exercise_id
        fn.title = title
        registry[exercise_id] = fn
        return fn

    return deco


def is_not_implemented(exc: BaseException) -> bool:
    """True if ``exc`` is, wraps or was caused by a ``NotImplementedError`` (the stub).

    NOTE: Triton's interpreter wraps exceptions raised inside a kernel in its own
    ``InterpreterError``, so the cause chain and the message are both looked at.
    """
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NotImplementedError):
            return True
        if type(e).__name__ == "InterpreterError" and "NotImplementedError" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def require_callable(exercise_id: str, obj: Any, what: str) -> None:
    if not callable(obj):
        raise ExerciseFailure(
            f"{exercise_id}: expected {what} (a function), got {type(obj).__name__} {obj!r}"
        )


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in str(text).splitlines())


def _printed(buf: io.StringIO, max_lines: int = 12) -> str:
    text = buf.getvalue()
    if not text.strip():
        return ""
    lines = text.rstrip("\n").splitlines()
    more = len(lines) - max_lines
    shown = lines[:max_lines] + ([f"... ({more} more lines)"] if more > 0 else [])
    return "\n  your code printed:\n" + _indent("\n".join(shown))


def run_cases(
    exercise_id: str,
    cases: Iterable[Any],
    run_one: Callable[[Any], None],
    size: Optional[Callable[[Any], Any]] = None,
    describe: Callable[[Any], str] = repr,
) -> None:
    """Run every case smallest first; print the pass line or raise on the first failure."""
    ordered = list(cases)
    if size is not None:
        ordered.sort(key=size)
    n = len(ordered)
    for i, case in enumerate(ordered):
        buf = _StringIO()
        try:
            with _redirect_stdout(buf):
                run_one(case)
        except Mismatch as m:
            raise ExerciseFailure(
                f"{exercise_id} failed on case {i + 1} of {n} (cases run smallest first):\n"
                f"{_indent(describe(case))}\n{_indent(str(m), '  ')}{_printed(buf)}"
            ) from None
        except ExerciseFailure:
            raise
        except Exception as e:  # the student's code crashed (or broke an invariant)
            if is_not_implemented(e):
                raise ExerciseFailure(
                    f"{exercise_id}: not implemented yet (replace `raise NotImplementedError` with your code)"
                ) from None
            raise ExerciseFailure(
                f"{exercise_id} failed on case {i + 1} of {n} (cases run smallest first):\n"
                f"{_indent(describe(case))}\n  your code raised {type(e).__name__}: {e}"
                f"{_printed(buf)}"
            ) from e
    _print(pass_line(exercise_id))


# -- comparisons used inside run_one ------------------------------------------------------


def _student_eq(value: Any, depth: int = 0) -> Optional[str]:
    """The name of a class defined in the notebook that overrides ``==``/``!=``, found in
    ``value`` (or in its items); such an object could claim to equal anything."""
    t = _type(value)
    for c in t.__mro__:
        if c.__module__ == "__main__" and ("__eq__" in c.__dict__ or "__ne__" in c.__dict__):
            return t.__name__
    if depth < 3:
        if _isinstance(value, dict):
            items = [*list(value.keys())[:1000], *list(value.values())[:1000]]
        elif _isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)[:1000]
        else:
            items = []
        for item in items:
            name = _student_eq(item, depth + 1)
            if name:
                return name
    return None


def expect_equal(what: str, expected: Any, got: Any) -> None:
    fake = _student_eq(got)
    if fake:
        raise Mismatch(
            f"{what}: your code returned an object of your own class {fake} that defines "
            "== itself; return plain values (lists, ints, the objects you were given)"
        )
    try:
        same = bool(expected == got)
    except Exception:  # e.g. a tensor compared with a list
        same = False
    if same and isinstance(expected, bool) != isinstance(got, bool):
        same = False  # True == 1 in Python, but a count is not a yes/no
    if not same:
        raise Mismatch(f"{what}:\n    expected {expected!r}\n    got      {got!r}")


def expect_close(what: str, expected: float, got: Any, abs_tol: float = 0.0) -> None:
    """``got`` is a number within 1e-9 (relative) of ``expected``."""
    try:
        ok = math.isclose(float(got), expected, rel_tol=1e-9, abs_tol=abs_tol)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise Mismatch(f"{what}:\n    expected {expected!r}\n    got      {got!r}")


def _against_reference(
    reference: Callable[[], Any], student: Callable[[], Any], compare, caller_error: str
) -> None:
    """``compare(reference(), student())``, or ``student()`` raises ``ValueError`` where the
    reference does (a caller error)."""
    try:
        expected = reference()
    except ValueError:
        expect_raises(caller_error, ValueError, student)
        return
    compare(expected, student())


def expect_close_to_reference(
    what: str, reference: Callable[[], float], student: Callable[[], Any], abs_tol: float = 0.0
) -> None:
    """``student()`` returns ``reference()`` (``expect_close``), or raises ``ValueError`` where
    the reference does (a caller error)."""
    _against_reference(reference, student, lambda e, g: expect_close(what, e, g, abs_tol), "a caller error")


def expect_equal_to_reference(
    what: str, reference: Callable[[], Any], student: Callable[[], Any], caller_error: str = "a caller error"
) -> None:
    """``student()`` returns ``reference()`` (``expect_equal``), or raises ``ValueError`` where
    the reference does (``caller_error`` says what such a case is)."""
    _against_reference(reference, student, lambda e, g: expect_equal(what, e, g), caller_error)


def expect_true(what: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise Mismatch(what + (f"\n    {detail}" if detail else ""))


def expect_raises(what: str, exc_type: type, thunk: Callable[[], Any]) -> None:
    """The student's code must raise ``exc_type`` here (a caller error, or "not in queue")."""
    try:
        result = thunk()
    except exc_type:
        return
    except Exception as e:
        if is_not_implemented(e):
            raise
        raise Mismatch(
            f"{what}: expected {exc_type.__name__}, but your code raised {type(e).__name__}: {e}"
        ) from None
    raise Mismatch(f"{what}: expected {exc_type.__name__}, but your code returned {result!r}")


def expect_invariants(what: str, obj: Any) -> None:
    """Run ``obj.check_invariants()``; a broken invariant is the student's mismatch."""
    try:
        obj.check_invariants()
    except AssertionError as e:
        raise Mismatch(f"{what}: invariant broken: {e}") from None


def check_step_predictions(
    exercise_id: str,
    predict: Callable[[], Any],
    fn_name: str,
    expected: list,
    normalize: Callable[[Any], Any],
    picture: Callable[[int], str],
    picture_title: str,
    length_note: Optional[str] = None,
) -> None:
    """A prediction exercise: ``predict()`` returns one entry per step of a reference run, and
    entry ``i``, after ``normalize``, must equal ``expected[i]``. Case ``i`` checks steps 0..i,
    so the first wrong step is the one reported, with ``picture(i)`` (the run as the engine
    shows it) under ``picture_title``. ``length_note`` says what the list holds (default: one
    entry per step, and how many steps the run takes)."""
    length_note = length_note or f"one per step: the run takes {len(expected)} steps"

    def run_one(i):
        got = predict()
        if not isinstance(got, list) or len(got) != len(expected):
            raise Mismatch(
                f"{fn_name}() must return a list of {len(expected)} dicts ({length_note}), got {got!r}"
            )
        norm = normalize(got[i])
        if norm != expected[i]:
            raise Mismatch(
                f"step {i}:\n    expected {expected[i]!r}\n    got      {norm!r}\n  {picture_title}:\n"
                + _indent(picture(i))
            )

    run_cases(exercise_id, range(len(expected)), run_one, describe=lambda i: f"steps 0..{i} of the run")


def check_concept_questions(exercise_id: str, concept_answers: Any, key: dict) -> None:
    """The concept-questions check every exercise notebook ends with.

    ``key`` maps a question id to (what is asked, the answer, ``"choice"`` or a relative
    tolerance). A wrong choice is named without revealing the key."""
    require_callable(exercise_id, concept_answers, "concept_answers")

    def run_one(qid):
        answers = concept_answers()
        if not isinstance(answers, dict):
            raise Mismatch(f"concept_answers() must return a dict, got {type(answers).__name__}")
        _, answer, how = key[qid]
        got = answers.get(qid)
        if how == "choice":
            if got != answer:
                raise Mismatch(f"{qid}: {got!r} is not right")
            return
        try:
            ok = math.isclose(float(got), answer, rel_tol=how, abs_tol=1e-9)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise Mismatch(f"{qid}: {got!r} is not right" + (f" (within {how:.0%})" if how else ""))

    run_cases(exercise_id, list(key), run_one, describe=lambda q: f"{q}: {key[q][0]}")
