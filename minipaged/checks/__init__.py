"""minipaged.checks: the checkers behind the exercise notebooks (``notebooks/exercises/``).

Concept
    Each exercise in an exercise notebook is three cells: a markdown spec, a *solution*
    cell where the student writes the real thing (a function, a Triton kernel), and a
    *check* cell that calls ``check("ex2.3", student_function)``. Every exercise is a
    ``Spec`` (``_spec.py``): cases as plain data, an ``observe`` that runs the student's
    code on them, and the reference's expected observations, judged apart from the
    student's objects. Locally (``check``) all three run in the notebook, on the
    local-practice cases; ``minipaged grade`` judges them in a trusted process on cases
    drawn for the grading run (``minipaged.grading.trusted``).

Inputs / outputs
    ``check(exercise_id, *student_objects)`` prints exactly one line, ``✅ ex2.3 passed``,
    or raises ``ExerciseFailure`` (an ``AssertionError``) that names the smallest failing
    case, what was expected and what the student's code gave. Whatever the student's code
    prints during the check is captured (and shown only in a failure message), so a
    passing check cell always has the same output: nbval and the grader compare on it.
    ``list_exercises()`` -> ``{exercise_id: title}`` for every registered exercise.

Invariants
    Checks are deterministic: the local cases come from a RNG seeded with the exercise id
    (and the student's seed, for per-student variants), so a failure is reproducible; the
    graded cases come from the grading run's seed and are never these. One chapter module per
    chapter (``ch00`` .. ``ch11``), imported lazily: ``check("ex2.1", ...)`` never imports
    torch; ``ex3.*`` do.

Failure mode
    an unknown exercise id raises ``ValueError``; the student's code raising, returning the
    wrong thing or breaking an invariant raises ``ExerciseFailure`` with the case.

Mirrors the idea of Triton-Puzzles / tiny-llm: one test harness grades the student's code
and the reference alike. The notebook tooling is ``minipaged exercises`` (student copies)
and ``minipaged grade`` (sandboxed grading); see docs/instructor_guide.md.
"""

from __future__ import annotations

from minipaged.checks._harness import PASS_TEMPLATE, ExerciseFailure, pass_line
from minipaged.checks._registry import CHAPTER_MODULES, _specs, chapter_of, get_spec, has_spec


def check(exercise_id: str, *student_objects) -> None:
    """Run the checker of ``exercise_id`` on the student's objects; print the ✅ line or raise.

    This is the local, advisory check (local-practice cases, one process); ``minipaged
    grade`` judges the same spec in a trusted process on cases drawn for the grading run."""
    spec = get_spec(exercise_id)
    if spec is None:
        known = ", ".join(_specs(chapter_of(exercise_id)))
        raise ValueError(f"unknown exercise_id {exercise_id!r} (known: {known})")
    from minipaged.checks._spec import local_check

    local_check(spec, student_objects)


def list_exercises(chapters=CHAPTER_MODULES) -> dict[str, str]:
    """``{exercise_id: title}`` for the given chapters, in course order."""
    out = {}
    for ch in chapters:
        specs = _specs(ch)
        for ex_id in sorted(specs, key=lambda e: int(e.split(".")[1])):
            out[ex_id] = specs[ex_id].title
    return out


__all__ = [
    "CHAPTER_MODULES",
    "ExerciseFailure",
    "PASS_TEMPLATE",
    "chapter_of",
    "check",
    "get_spec",
    "has_spec",
    "list_exercises",
    "pass_line",
]
