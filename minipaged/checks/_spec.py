"""An exercise as data: cases in, observations out, judged where the student's code is not.

Concept
    A *spec* splits a checker in three parts that can live in different processes:

    * ``cases(rng)`` (trusted side): the inputs, plain data, drawn from a seeded RNG;
    * ``observe(case, *student_objects)`` (the student's kernel): builds the state a case
      describes, calls the student's code on it, and returns what can be seen afterwards
      (return values, exceptions raised, the state) as plain data;
    * ``expected(case, key)`` (trusted side): the same observation with the reference's
      objects (``observe(case, *reference())``), or the answer in the instructor's key.

    ``judge`` compares the two on the trusted side, after both went through JSON text
    (``minipaged.grading.codec``), so no object of the student's interpreter takes part.
    The local ``check(...)`` in a notebook runs the same three parts in one process, on the
    local-practice seed: it is advisory; the graded run keeps them apart.

Kinds
    ``"function"``: failure messages show the smallest failing case, expected and got.
    ``"prediction"``: the message names the first wrong step and what the student
    predicted, never the expected answer. ``"secret"`` (concept questions, ex0.1, ex7.3):
    graded once, by the instructor's key; the local check only checks the answer's shape
    and prints ``recorded_line``; a graded failure says how many answers are wrong, no more.

Invariants
    ``observe`` never holds an expected value; an observation key starting with ``_`` is a
    note (what the student printed, an exception's message) and is never compared; floats
    compare within ``spec.rel_tol`` / ``spec.abs_tol`` (the trusted spec's, never the
    kernel's); ``True`` never equals ``1``.

Failure mode
    a spec without ``reference`` or ``expected`` raises ``ValueError`` at definition.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from minipaged.checks._harness import is_not_implemented, pass_line
from minipaged.grading.codec import TENSOR, UNENCODABLE, dumps, loads_strict, to_data

_redirect_stdout = contextlib.redirect_stdout
_StringIO = io.StringIO
PRINTED_BYTES = 2000  # what a case's printing keeps, in its note
LOCAL_SEED = "local"  # the seed of the local-practice cases (the graded seed is never this)


def recorded_line(exercise_id: str) -> str:
    """What the local check of a ``"secret"`` exercise prints: the answers' shape is right."""
    return f"📝 {exercise_id} answers recorded: the instructor's grading checks them"


@dataclass
class Spec:
    exercise_id: str
    title: str
    signature: str  # "remove(queue, block)": what the student passes, for messages
    cases: Callable[[random.Random], list]
    observe: Callable[..., Any]
    reference: Optional[Callable[[], tuple]] = None
    expected: Optional[Callable[[Any, dict], Any]] = None  # (case, key) -> expected observation
    describe: Callable[[Any], str] = repr
    size: Optional[Callable[[Any], Any]] = None
    kind: str = "function"  # function | prediction | secret
    rel_tol: float = 1e-9
    abs_tol: float = 0.0
    shape: Optional[Callable[[Any], Optional[str]]] = None  # secret: what is wrong with the shape
    report: Optional[Callable[..., str]] = None  # local check: figures printed above the verdict
    # a bar rather than an equality (ex5.6): (cases, expected records, the student's records)
    # -> None when every case clears it, else the failure message; trusted side only
    verdict: Optional[Callable[[list, list, list], Optional[str]]] = None
    answered_by: tuple = ()  # "module:qualname" of package callables that compute this exercise's graded result; stripped from the student build

    def __post_init__(self):
        if self.reference is None and self.expected is None:
            raise ValueError(f"spec {self.exercise_id}: give reference or expected")
        if self.kind not in ("function", "prediction", "secret"):
            raise ValueError(f"spec {self.exercise_id}: kind must be function/prediction/secret")

    @property
    def line(self) -> str:
        return recorded_line(self.exercise_id) if self.kind == "secret" else pass_line(self.exercise_id)


def set_answered_by(specs: dict, answered_by: dict) -> dict:
    """``spec.answered_by`` of each exercise of ``answered_by`` (``{exercise: ("module:qualname",
    ...)}``: the package callables that compute its graded result, stripped from the student
    build and, during its local check, from the student's interpreter); what a chapter module
    ends with. Returns ``answered_by``."""
    for exercise_id, names in answered_by.items():
        specs[exercise_id].answered_by = tuple(names)
    return answered_by


# what a stripped package callable raises (``minipaged.grading.student_build``): the message
# grading gives, and the local check too, when a student's code calls the package's own
STRIPPED_MESSAGE = re.compile(r"ex\d+\.\d+: your notebook's [A-Za-z_][A-Za-z0-9_]* is used here")


def not_implemented_message(exercise_id: str, record: dict) -> str:
    """Why a record that raised ``NotImplementedError`` fails: the stripped callable's own
    message (the student's code called the package's implementation), else the stub's."""
    message = record.get("_message")
    if type(message) is str and STRIPPED_MESSAGE.fullmatch(message):
        return message
    return f"{exercise_id}: not implemented yet (replace `raise NotImplementedError` with your code)"


def _withheld(*args, **kwargs):
    """What the student build has in place of a spec's reference, cases and expected values:
    they are the grader's (``minipaged.grading.student_build``)."""
    raise RuntimeError("not in the student build: the grader's trusted process holds this part of the check")


def case_rng(exercise_id: str, seed: Any) -> random.Random:
    """The RNG of an exercise's cases for ``seed`` (``LOCAL_SEED`` locally; per run and student
    when graded). sha256, not ``hash()``: the same in every process."""
    digest = hashlib.sha256(f"{seed}|{exercise_id}".encode()).hexdigest()
    return random.Random(int(digest[:16], 16))


def make_cases(spec: Spec, seed: Any, student_seed: Any = None) -> list:
    """The cases of ``spec`` as plain data. A function exercise draws them from ``seed`` (the
    grading run's and the student's); a prediction exercise from ``student_seed`` alone (the
    workload printed in that student's copy), ``None`` being the shipped notebook's."""
    if spec.kind == "prediction" or getattr(spec.cases, "per_student", False):
        rng = None if student_seed is None else case_rng(spec.exercise_id, f"student|{student_seed}")
    else:
        rng = case_rng(spec.exercise_id, seed)
    return [to_data(c) for c in spec.cases(rng)]


# -- observing (the student's kernel, or the trusted side with the reference) --------------


def attempt(thunk: Callable[[], Any]) -> dict:
    """What a call did, as data: ``{"returned": value}`` or ``{"raised": "ValueError"}``."""
    try:
        value = thunk()
    except Exception as e:
        if is_not_implemented(e):
            raise
        return {"raised": type(e).__name__, "_message": str(e)[:300]}
    return {"returned": to_data(value)}


def observe_one(spec: Spec, case: Any, objects: tuple) -> dict:
    """One case's observation record: ``{"value": ...}`` or ``{"raised": ...}``, plus notes."""
    buf = _StringIO()
    try:
        with _redirect_stdout(buf):
            rec = {"value": to_data(spec.observe(case, *objects))}
    except Exception as e:
        rec = {"raised": type(e).__name__, "_message": str(e)[:300]}
        if is_not_implemented(e):
            rec["_not_implemented"] = True
    printed = buf.getvalue()
    if printed.strip():
        rec["_printed"] = printed[:PRINTED_BYTES]
    return rec


def observe_all(spec: Spec, cases: list, objects: tuple) -> list:
    return [observe_one(spec, c, objects) for c in cases]


# -- judging (trusted side) ---------------------------------------------------------------


def _num(x: Any) -> Optional[float]:
    if type(x) is dict and set(x) == {"__float__"}:
        return float(x["__float__"])
    if type(x) in (int, float):
        return float(x)
    return None


def diff(expected: Any, got: Any, rel_tol: float, abs_tol: float, path: str = "") -> Optional[tuple]:
    """The first place where ``got`` differs from ``expected``: ``(path, expected, got)``."""
    te, tg = type(expected), type(got)
    if te is dict and set(expected) == {TENSOR}:
        if tg is not dict or set(got) != {TENSOR}:
            return (path, "a tensor", got)
        e, g = expected[TENSOR], got[TENSOR]
        if e["shape"] != g.get("shape") or e["dtype"] != g.get("dtype"):
            return (path + ".shape/dtype", (e["shape"], e["dtype"]), (g.get("shape"), g.get("dtype")))
        vals_e, vals_g = e["values"], g.get("values")
        if type(vals_g) is not list or len(vals_g) != len(vals_e):
            return (path + ".values", f"{len(vals_e)} values", "other values")
        for i, (a, b) in enumerate(zip(vals_e, vals_g)):
            d = diff(a, b, rel_tol, abs_tol, f"{path}[flat {i}]")
            if d:
                return d
        return None
    if te is bool or tg is bool:
        return None if te is tg and expected == got else (path, expected, got)
    ne, ng = _num(expected), _num(got)
    if ne is not None:
        if ng is None:
            return (path, expected, got)
        if math.isnan(ne) or math.isnan(ng):
            return None if math.isnan(ne) and math.isnan(ng) else (path, expected, got)
        if te is int and tg is int:
            return None if expected == got else (path, expected, got)
        return None if math.isclose(ne, ng, rel_tol=rel_tol, abs_tol=abs_tol) else (path, expected, got)
    if te is dict:
        if tg is not dict:
            return (path, expected, got)
        ke = sorted(k for k in expected if not k.startswith("_"))
        kg = sorted(k for k in got if not k.startswith("_"))
        if ke != kg:
            return (path, expected, got)
        for k in ke:
            d = diff(expected[k], got[k], rel_tol, abs_tol, f"{path}.{k}" if path else k)
            if d:
                return d
        return None
    if te is list:
        if tg is not list:
            return (path, expected, got)
        if len(expected) != len(got):
            return (path or "length", expected, got)
        for i, (a, b) in enumerate(zip(expected, got)):
            d = diff(a, b, rel_tol, abs_tol, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if te is tg and expected == got else (path, expected, got)


def _show(x: Any, limit: int = 400) -> str:
    if type(x) is dict and set(x) == {UNENCODABLE}:
        return f"an object of type {x[UNENCODABLE]} (return plain values: ints, lists, dicts, tensors)"
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + " ..."


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in str(text).splitlines())


def expected_records(spec: Spec, cases: list, key: Optional[dict]) -> list:
    """The reference's observation records, through JSON like the student's."""
    if spec.expected is not None:
        recs = [{"value": to_data(spec.expected(c, key or {}))} for c in cases]
    else:
        recs = observe_all(spec, cases, spec.reference())
    return loads_strict(dumps(recs), max_bytes=1 << 30)


def judge(spec: Spec, cases: list, got_text: str, key: Optional[dict] = None) -> tuple[bool, str]:
    """``(passed, message)`` for the student's records (JSON text) on ``cases``."""
    ex = spec.exercise_id
    try:
        got = loads_strict(got_text)
    except ValueError as e:
        return False, f"{ex}: the results of your code could not be read ({e})"
    if type(got) is not list or len(got) != len(cases) or any(type(r) is not dict for r in got):
        return False, f"{ex}: the check did not return one result per case"
    for r in got:
        if r.get("_not_implemented") is True:
            return False, not_implemented_message(ex, r)
    if spec.kind == "secret":
        return _judge_secret(spec, cases, got, key)
    exp = expected_records(spec, cases, key)
    if spec.verdict is not None:
        message = spec.verdict(cases, exp, got)
        return (False, message) if message else (True, pass_line(ex))
    order = list(range(len(cases)))
    if spec.size is not None:
        order.sort(key=lambda i: spec.size(cases[i]))
    n = len(order)
    for pos, i in enumerate(order):
        d = diff(exp[i], got[i], spec.rel_tol, spec.abs_tol)
        if d is None:
            continue
        head = (
            f"{ex} failed on case {pos + 1} of {n} (cases run smallest first):\n"
            f"{_indent(spec.describe(cases[i]))}"
        )
        printed = got[i].get("_printed")
        tail = f"\n  your code printed:\n{_indent(printed)}" if type(printed) is str and printed else ""
        if "raised" in got[i] and "raised" not in exp[i]:
            msg = got[i].get("_message", "")
            return False, f"{head}\n  your code raised {got[i]['raised']}: {msg}{tail}"
        where, e, g = d
        where = where.removeprefix("value.").removeprefix("value")
        if where.split(".")[-1] == "raised":  # both raised, not the same exception
            where = where.removesuffix("raised").rstrip(".")
            return False, f"{head}\n  {where or 'result'}: expected {e}, but your code raised {g}{tail}"
        if type(g) is dict and "raised" in g and not (type(e) is dict and "raised" in e):
            return (
                False,
                f"{head}\n  {where or 'result'}: your code raised {g['raised']}: {g.get('_message', '')}{tail}",
            )
        if (
            type(e) is dict
            and "raised" in e
            and not (type(g) is dict and "raised" in g)
            and spec.kind == "function"
        ):
            shown = _show(g.get("returned", g)) if type(g) is dict else _show(g)
            return (
                False,
                f"{head}\n  {where or 'result'}: expected {e['raised']} (a caller error), but your code returned {shown}{tail}",
            )
        if type(g) is dict and type(e) is dict and "raised" in g and "raised" in e:
            return (
                False,
                f"{head}\n  {where or 'result'}: expected {e['raised']}, but your code raised {g['raised']}: {g.get('_message', '')}{tail}",
            )
        if spec.kind == "prediction":
            return False, f"{head}\n  {where or 'your answer'}: not right (you gave {_show(g)}){tail}"
        return (
            False,
            f"{head}\n  {where or 'result'}:\n    expected {_show(e)}\n    got      {_show(g)}{tail}",
        )
    return True, pass_line(ex)


def _judge_secret(spec: Spec, cases: list, got: list, key: Optional[dict]) -> tuple[bool, str]:
    ex = spec.exercise_id
    wrong = total = 0
    for case, rec in zip(cases, got):
        if "raised" in rec:
            return False, f"{ex}: your function raised {rec['raised']}: {rec.get('_message', '')}"
        answers = rec.get("value")
        problem = spec.shape(answers) if spec.shape else None
        if problem:
            return False, f"{ex}: {problem}"
        expected = spec.expected(case, key)
        for qid, item in expected.items():
            total += 1
            want, how = item["answer"], item.get("how", "choice")
            given = answers.get(qid) if type(answers) is dict else None
            tol = 0.0 if how == "choice" else float(how)
            if diff(want, given, tol, 1e-9 if how != "choice" else 0.0):
                wrong += 1
    if wrong:
        return False, f"{ex}: {wrong} of {total} answers are not right"
    return True, pass_line(ex)


# -- the local check (advisory; one process) ------------------------------------------------


def printed_workload(spec: Spec) -> Optional[list]:
    """A prediction's workload as the notebook's setup cell defines it (the name in the
    chapter's ``VARIANTS``, read from ``__main__``): a student's copy made with ``--seed``
    prints its own, and its local check must judge that one. ``None`` elsewhere (pytest, a
    script), where the shipped workload is the one."""
    import importlib
    import sys

    from minipaged.checks import chapter_of

    if spec.kind != "prediction":
        return None
    chapter = importlib.import_module(f"minipaged.checks.{chapter_of(spec.exercise_id)}")
    name = getattr(chapter, "VARIANTS", {}).get(spec.exercise_id, (None,))[0]
    main = sys.modules.get("__main__")
    if name is None or not hasattr(main, name):
        return None
    return [to_data(getattr(main, name))]


def local_check(spec: Spec, objects: tuple) -> None:
    """What ``check(...)`` in a notebook does: the same observe/judge on the local seed (a
    prediction: on the workload the notebook's setup cell defines, ``printed_workload``)."""
    from minipaged.checks._harness import ExerciseFailure

    cases = printed_workload(spec)
    if cases is not None:
        try:
            expected_records(spec, loads_strict(dumps(cases), max_bytes=1 << 30), None)
        except Exception:
            raise ExerciseFailure(
                f"{spec.exercise_id}: the workload in the setup cell was changed; "
                "run the setup cell as it was handed out"
            ) from None
    else:
        cases = make_cases(spec, LOCAL_SEED)
    cases = loads_strict(dumps(cases), max_bytes=1 << 30)
    from minipaged.grading.student_build import as_in_the_build

    # NOTE: the student's side only, as grading runs it: what the chapter's student build
    # strips (its exercises' ``answered_by``) raises or runs the notebook's own function; the
    # expected side below uses the real package
    with as_in_the_build(spec, objects):
        got_text = dumps(observe_all(spec, cases, objects))
    if spec.kind == "secret":
        got = loads_strict(got_text)
        for rec in got:
            if rec.get("_not_implemented"):
                raise ExerciseFailure(not_implemented_message(spec.exercise_id, rec))
            if "raised" in rec:
                raise ExerciseFailure(
                    f"{spec.exercise_id}: your function raised {rec['raised']}: {rec.get('_message', '')}"
                )
            problem = spec.shape(rec.get("value")) if spec.shape else None
            if problem:
                raise ExerciseFailure(f"{spec.exercise_id}: {problem}")
        print(recorded_line(spec.exercise_id))
        return
    ok, message = judge(spec, cases, got_text)
    if not ok:
        raise ExerciseFailure(message)
    if spec.report is not None:
        print(spec.report(*objects), end="")
    print(message)


def answers_shape(question_ids, choices: Optional[dict] = None) -> Callable[[Any], Optional[str]]:
    """A ``shape`` check for a dict of answers: every id present; a choice among its options."""
    ids = list(question_ids)

    def shape(answers):
        if type(answers) is not dict:
            return f"return a dict with the keys {ids}, got {_show(answers)}"
        missing = [q for q in ids if q not in answers]
        if missing:
            return f"no answer for {missing}"
        for q, options in (choices or {}).items():
            if answers.get(q) not in options:
                return f"{q}: the answer must be one of {list(options)}, got {_show(answers.get(q))}"
        return None

    return shape


def _from_key(key: Optional[dict], exercise_id: str) -> dict:
    if not key or exercise_id not in key:
        raise ValueError(f"the instructor's key has no answers for {exercise_id} (pass --key FILE)")
    return key[exercise_id]


def concept_spec(exercise_id: str, title: str, questions: dict, fn_name: str = "concept_answers") -> Spec:
    """The concept-questions exercise: ``questions`` maps a question id to (what is asked, the
    allowed choices or ``None`` for a number), or to a list of such variants, one drawn per
    student (``_harness.draw_questions``). The answers are in the instructor's key only."""
    from minipaged.checks._harness import draw_questions, key_answer, question_variants

    variants = question_variants(questions)
    choices = {q: opts for q, v in variants.items() for _, opts in v[:1] if opts}

    def observe(case, fn):
        return fn()

    def cases(rng):  # the student's variant of each question (``draw_questions``)
        return [draw_questions(questions, rng)]

    cases.per_student = True  # drawn from the student's seed, as a prediction's workload

    def expected(case, key):
        answers = _from_key(key, exercise_id)
        drawn = case if isinstance(case, dict) else {}
        return {q: key_answer(answers.get(q), drawn.get(q, 0), f"{exercise_id} {q}") for q in variants}

    return Spec(
        exercise_id,
        title,
        f"{fn_name}()",
        cases=cases,
        observe=observe,
        expected=expected,
        kind="secret",
        shape=answers_shape(list(questions), choices),
    )


def register(specs: dict, spec: Spec) -> Spec:
    specs[spec.exercise_id] = spec
    return spec
