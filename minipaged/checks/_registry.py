"""The exercise registry: which chapter module holds an exercise, and its spec.

Imports no checker: a chapter's module (``ch00`` .. ``ch11``) is loaded by name when one of
its specs is asked for. ``minipaged.checks`` re-exports these; the grader's student build
(``minipaged.grading.student_build``) reads specs from here, so that the local check (which
uses the build's transform) and the build do not import each other in a circle.
"""

from __future__ import annotations

import importlib
import re

CHAPTER_MODULES = tuple(f"ch{n:02d}" for n in range(12))  # ch00 .. ch11
_EXERCISE_RE = re.compile(r"^ex(\d+)\.(\d+)$")


def chapter_of(exercise_id: str) -> str:
    """``"ex2.3"`` -> ``"ch02"``."""
    m = _EXERCISE_RE.match(str(exercise_id))
    if not m:
        raise ValueError(f"exercise_id must look like 'ex2.3', got {exercise_id!r}")
    return f"ch{int(m.group(1)):02d}"


def _specs(chapter: str) -> dict:
    if chapter not in CHAPTER_MODULES:
        raise ValueError(f"no checkers for chapter {chapter!r} (known: {', '.join(CHAPTER_MODULES)})")
    return importlib.import_module(f"minipaged.checks.{chapter}").SPECS


def get_spec(exercise_id: str):
    """The exercise's spec (cases / observe / expected: ``minipaged.checks._spec``), or
    ``None`` for an id no chapter defines."""
    return _specs(chapter_of(exercise_id)).get(exercise_id)


def has_spec(exercise_id: str) -> bool:
    return get_spec(exercise_id) is not None
