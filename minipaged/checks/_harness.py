"""What every exercise's check shares: the one pass line, the failure exception, the stub test.

Inputs / outputs
    ``pass_line(exercise_id)`` -> ``"✅ exN.M passed"``, the one line a passing check cell
    prints (nbval and the grader compare on it). ``ExerciseFailure`` (an ``AssertionError``,
    so nbval sees an error) carries the failure message. ``is_not_implemented(exc)`` tells
    the untouched stub from real code. ``expect_equal`` compares two plain values (the
    trusted side's observations) and raises ``Mismatch`` with both.

Invariants
    ``True`` never equals ``1`` (a count is not a yes/no).

Failure mode
    none of its own: these are the pieces ``_spec.py`` builds checks from.
"""

from __future__ import annotations

from typing import Any, Optional

PASS_TEMPLATE = "✅ {} passed"


def pass_line(exercise_id: str) -> str:
    """The one line a passing check cell prints (without the newline)."""
    return PASS_TEMPLATE.format(exercise_id)


class ExerciseFailure(AssertionError):
    """The student's code is not right yet; the message says on which case and how."""


class Mismatch(Exception):
    """Two observations differ (the message shows both)."""


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


def expect_equal(what: str, expected: Any, got: Any) -> None:
    """Plain values (what crossed as JSON) equal, ``True`` and ``1`` apart; else ``Mismatch``."""
    try:
        same = bool(expected == got)
    except Exception:  # e.g. a tensor compared with a list
        same = False
    if same and isinstance(expected, bool) != isinstance(got, bool):
        same = False  # True == 1 in Python, but a count is not a yes/no
    if not same:
        raise Mismatch(f"{what}:\n    expected {expected!r}\n    got      {got!r}")


# -- concept questions: variants per student ------------------------------------------------


def question_variants(questions: dict) -> dict:
    """``{question id: [(text, choices), ...]}`` from a chapter's ``QUESTIONS``, whose values
    are one ``(text, choices)`` (the old form: one variant) or a list of them (variant 0 is
    the one the shipped notebook asks)."""
    out = {}
    for qid, item in questions.items():
        variants = list(item) if isinstance(item, list) else [item]
        if not variants or not all(isinstance(v, tuple) and len(v) == 2 for v in variants):
            raise ValueError(f"question {qid}: give (text, choices) or a list of them")
        out[qid] = variants
    return out


def draw_questions(questions: dict, rng) -> dict:
    """``{question id: variant index}``: all 0 (the shipped notebook's) when ``rng`` is None,
    else one variant per question drawn from ``rng`` (the student's seed)."""
    variants = question_variants(questions)
    return {q: 0 if rng is None else rng.randrange(len(v)) for q, v in variants.items()}


def key_answer(key_item: dict, variant: int, where: str) -> dict:
    """The key's ``{"answer", "how"}`` of one variant: ``{"variants": [...]}`` per variant,
    or (the old form) one item for a question with a single variant."""
    if not isinstance(key_item, dict):
        raise ValueError(f"the instructor's key: {where} must be a dict")
    if "variants" in key_item:
        items = key_item["variants"]
        if not isinstance(items, list) or not 0 <= variant < len(items):
            raise ValueError(f"the instructor's key has no answer for {where} variant {variant}")
        return items[variant]
    if variant != 0:
        raise ValueError(f"the instructor's key has one answer for {where}, not variant {variant}")
    return key_item
