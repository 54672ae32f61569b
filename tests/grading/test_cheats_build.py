"""The cheat suite of issue 35: the package's own answers, reached every way a scan misses.

Before the student build, one cell rewiring the kernel-side spec of each exercise
(``[minipaged][0].checks.get_spec(ex).observe = ...``) to report what the package computes
scored 38 of 49 without solving anything, and the static scan let a call of the package's
implementation through whenever its name was reached by a subscript, ``g = getattr``, an
``attrgetter`` of a string built from ``chr()``, ``functools.reduce(getattr, ...)``, a
decorator or a default argument. Here every chapter's authored notebook gets one cheat
notebook: the exercises the package answers (a spec's ``answered_by``) call it, each through
one attack class in turn (``EVASIONS``, rotated so that every class meets several chapters);
the other exercises, and the first the package answers, go through the rewired ``observe``
(the prelude cell, the same in every chapter). They are graded with ``--jobs 2`` and the static scan off:
every exercise scores 0, because the sandbox's package is the student build, which holds no
implementation that answers an exercise and no reference. A control grades the chapter 02
cheat against the real package: there the same attacks pass, so the suite is not vacuous.
"""

from __future__ import annotations

import copy

import nbformat
import pytest

from minipaged.checks import get_spec
from minipaged.checks.notebook import cell_exercise, cell_role, cell_source, load_authored
from minipaged.grading.grade import check_call, grade_many, grade_notebook
from minipaged.grading.sandbox import probe

AUTHORED = load_authored()
ISOLATION = probe()

# the kernel-side spec of every exercise rewired to observe the package's own objects (the
# reference, else the first package function that answers it, else the expected values);
# reached through a subscript chain, the scan sees no name of the package's implementation
REWIRE = """import pkgutil
_mp_checks = [__import__('minipaged.checks')][0].checks
def _mp_package_objects(spec):
    try:
        return tuple(spec.reference())
    except Exception:
        return tuple(pkgutil.resolve_name(t) for t in spec.answered_by[:1])
def _mp_rewire(ex):
    spec = _mp_checks.get_spec(ex)
    observe = spec.observe
    if spec.reference is None and spec.expected is not None:
        spec.observe = lambda case, *mine: spec.expected(case, {})
    else:
        spec.observe = lambda case, *mine: observe(case, *_mp_package_objects(spec))
for _mp_ex in %r:
    _mp_rewire(_mp_ex)
"""


def _parts(target: str) -> tuple[str, list[str]]:
    module, qualname = target.split(":")
    return module, qualname.split(".")


def _subscript(name, target):
    module, quals = _parts(target)
    return (
        f"__import__({module!r})\n"
        f"def {name}(*args, **kwargs):\n"
        f"    return [__import__('sys').modules[{module!r}]][0].{'.'.join(quals)}(*args, **kwargs)\n"
    )


def _getattr_alias(name, target):
    module, quals = _parts(target)
    expr = f"__import__({module!r})"
    for attr in module.split(".")[1:] + quals:
        expr = f"_mp_g({expr}, {attr!r})"
    return f"_mp_g = getattr\ndef {name}(*args, **kwargs):\n    return {expr}(*args, **kwargs)\n"


def _attrgetter_chr(name, target):
    module, quals = _parts(target)
    codes = [ord(c) for c in ".".join(module.split(".")[1:] + quals)]
    return (
        "import operator\n"
        f"def {name}(*args, **kwargs):\n"
        f"    path = ''.join(map(chr, {codes!r}))\n"
        f"    return operator.attrgetter(path)(__import__({module!r}))(*args, **kwargs)\n"
    )


def _reduce_getattr(name, target):
    module, quals = _parts(target)
    path = ".".join(module.split(".")[1:] + quals)
    return (
        "import functools\n"
        f"def {name}(*args, **kwargs):\n"
        f"    return functools.reduce(getattr, {path!r}.split('.'), __import__({module!r}))(*args, **kwargs)\n"
    )


def _imported(target):
    module, quals = _parts(target)
    rest = "".join("." + q for q in quals[1:])
    return f"from {module} import {quals[0]} as _mp_T\n", f"_mp_T{rest}"


def _decorator(name, target):
    head, expr = _imported(target)
    return f"{head}@(lambda _f: {expr})\ndef {name}(*args, **kwargs):\n    raise NotImplementedError\n"


def _default_arg(name, target):
    head, expr = _imported(target)
    return f"{head}def {name}(*args, _impl={expr}, **kwargs):\n    return _impl(*args, **kwargs)\n"


def _direct_call(name, target):
    head, expr = _imported(target)
    return f"{head}def {name}(*args, **kwargs):\n    return {expr}(*args, **kwargs)\n"


EVASIONS = {
    "subscript": _subscript,
    "getattr_alias": _getattr_alias,
    "attrgetter_chr": _attrgetter_chr,
    "reduce_getattr": _reduce_getattr,
    "decorator": _decorator,
    "default_arg": _default_arg,
    "direct_call": _direct_call,
}


def _plans() -> dict:
    """chapter -> {exercise: the attack class on it ("rewire" or an ``EVASIONS`` key)}: each
    exercise the package answers but the chapter's first gets the next evasion class, across
    the chapters; the others are rewired."""
    plans, turn = {}, 0
    for chapter in sorted(AUTHORED):
        plans[chapter] = {}
        answered = [ex for ex in AUTHORED[chapter].exercises if get_spec(ex).answered_by]
        for ex in AUTHORED[chapter].exercises:
            if ex in answered[1:]:
                plans[chapter][ex] = list(EVASIONS)[turn % len(EVASIONS)]
                turn += 1
            else:
                plans[chapter][ex] = "rewire"
    return plans


PLANS = _plans()


def cheat_plan(chapter: str) -> dict:
    return PLANS[chapter]


def cheat_notebook(chapter: str, rewire_all: bool = False) -> nbformat.NotebookNode:
    """The chapter's cheat (``rewire_all``: every exercise through the rewired observe)."""
    authored = AUTHORED[chapter]
    plan = dict.fromkeys(authored.exercises, "rewire") if rewire_all else cheat_plan(chapter)
    nb = copy.deepcopy(authored.nb)
    for cell in nb.cells:
        if cell_role(cell) != "solution":
            continue
        ex = cell_exercise(cell)
        _, names = check_call(cell_source(authored.check_cells[ex]))
        rest = names[1:]
        if plan[ex] == "rewire":
            src, rest = "", names
        else:
            src = EVASIONS[plan[ex]](names[0], get_spec(ex).answered_by[0])
        cell.source = src + "".join(f"def {n}(*args, **kwargs):\n    return None\n" for n in rest)
    first = next(i for i, c in enumerate(nb.cells) if cell_role(c) == "solution")
    rewired = [ex for ex, how in plan.items() if how == "rewire"]
    nb.cells.insert(first, nbformat.v4.new_code_cell(REWIRE % (rewired,)))
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cheats35")
    paths = []
    for chapter in sorted(AUTHORED):
        path = folder / f"{chapter}_cheat.ipynb"
        nbformat.write(cheat_notebook(chapter), path)
        paths.append(str(path))
    path = folder / "ch02_rewire_all.ipynb"
    nbformat.write(cheat_notebook("ch02", rewire_all=True), path)
    paths.append(str(path))
    results = grade_many(paths, AUTHORED, timeout=60, jobs=2, isolation=ISOLATION, scan=False)
    return {r.chapter if "rewire_all" not in r.submission else "ch02 rewire_all": r for r in results}


def test_every_attack_class_meets_several_exercises():
    used = {}
    for chapter in AUTHORED:
        for ex, how in cheat_plan(chapter).items():
            used.setdefault(how, []).append(ex)
    assert set(used) == {"rewire", *EVASIONS}, used
    assert all(len(exs) >= 2 for exs in used.values()), used


@pytest.mark.parametrize("chapter", [*sorted(AUTHORED), "ch02 rewire_all"])
def test_the_package_reached_any_way_scores_zero(graded, chapter):
    r = graded[chapter]
    assert r.error is None, r.error
    plan = cheat_plan(chapter.split()[0]) if " " not in chapter else {}
    passed = {ex: (plan.get(ex, "rewire"), x.reason) for ex, x in r.exercises.items() if x.passed}
    assert not passed, passed
    assert all(x.reason for x in r.exercises.values())


def test_control_the_same_attacks_pass_against_the_real_package():
    """Without the student build (the sandbox of issue 24) the rewired observe scores on
    every chapter 02 exercise the package computes, and the evasions where the package's
    function takes the exercise's arguments (ex2.3's allocate_slots): the attacks are real."""
    won = {}
    for rewire_all in (True, False):
        r = grade_notebook(
            cheat_notebook("ch02", rewire_all=rewire_all),
            AUTHORED["ch02"],
            timeout=60,
            isolation=ISOLATION,
            scan=False,
            use_student_build=False,
        )
        won[rewire_all] = sorted(ex for ex, x in r.exercises.items() if x.passed)
    assert won[True] == ["ex2.1", "ex2.2", "ex2.3", "ex2.4", "ex2.5", "ex2.6"], won
    assert {"ex2.1", "ex2.3"} <= set(won[False]), won
