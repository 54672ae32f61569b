"""The cheat suite of issue 24: one submission per attack class, graded with the trusted checker.

Each cheat is an authored chapter notebook (every chapter whose exercises are all judged
by the trusted checker) with every solution replaced by an attack (so no exercise is solved): reaching the checker's state in the kernel, reading answers
from the call stack, lying values, lookup tables of the local-practice cases. Each must
score 0 on every exercise, with the static scan off (the trusted boundary must hold on its
own). The resource attacks are all in one notebook now, graded beside an honest classmate
by a grader whose peak RSS is measured: ``test_cheats_walls.py``. The sandbox is this
machine's (``sandbox.probe()``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import nbformat
import pytest

from minipaged.checks import has_spec
from minipaged.checks.notebook import cell_exercise, cell_role, cell_source, load_authored
from minipaged.grading.grade import check_call, grade_notebook
from minipaged.grading.sandbox import probe
from minipaged.grading.trusted import TrustedChecker

ROOT = Path(__file__).resolve().parents[2]
AUTHORED = load_authored()
CH02 = AUTHORED["ch02"]
ISOLATION = probe()


def graded_names(authored) -> dict[str, list[str]]:
    """exercise -> the names its check cell hands to ``check(...)`` (what a solution defines)."""
    return {ex: check_call(cell_source(authored.check_cells[ex]))[1] for ex in authored.exercises}


# every chapter whose exercises are all judged by the trusted checker (ported chapters join
# the suite on their own)
TRUSTED_CHAPTERS = [ch for ch, a in AUTHORED.items() if all(has_spec(ex) for ex in a.exercises)]
FUNCS = {
    "ex2.1": "remove(queue, block)",
    "ex2.2": "popleft(queue)",
    "ex2.3": "allocate_slots(manager, request_id, num_new_tokens)",
    "ex2.4": "slot_mapping(block_table, block_size, start, end)",
    "ex2.5": "predict_free_queue()",
    "ex2.6": "max_concurrent(seq_lens, num_blocks, block_size)",
    "ex2.7": "concept_answers()",
}


def cheat_notebook(body: str, prelude: str = "", chapter: str = "ch02") -> nbformat.NotebookNode:
    """The chapter's authored notebook with every solution cell replaced by functions that
    return ``body`` (an expression, whatever the arguments), one per name the exercise's
    check hands over, after a ``prelude`` cell of the attacker's own."""
    authored = AUTHORED[chapter]
    names = graded_names(authored)
    nb = copy.deepcopy(authored.nb)
    for cell in nb.cells:
        if cell_role(cell) == "solution":
            cell.source = "".join(
                f"def {n}(*args, **kwargs):\n    return {body}\n" for n in names[cell_exercise(cell)]
            )
    if prelude:
        first_solution = next(i for i, c in enumerate(nb.cells) if cell_role(c) == "solution")
        nb.cells.insert(first_solution, nbformat.v4.new_code_cell(prelude))
    return nb


ATTACKS = {
    # the checker's state, reached in the same interpreter: patch the judge, the spec, the
    # driver's encoder, under names a scan cannot see (attrgetter, resolve_name, exec)
    "reach_checker_state": (
        "_mp_fake()",
        "import operator, pkgutil\n"
        "spec = pkgutil.resolve_name('minipaged.checks._spec')\n"
        "setattr(spec, 'judge', lambda *a, **k: (True, 'passed'))\n"
        "setattr(spec, 'diff', lambda *a, **k: None)\n"
        "drv = operator.attrgetter('grading.driver')(__import__('minipaged.grading.driver'))\n"
        "exec('drv.drive = lambda ex, payload, *objs: print(\"MPRESULT x\")', {'drv': drv})\n"
        "def _mp_fake():\n"
        "    return None\n",
    ),
    # the answer read off the call stack while the student's function runs
    "frames": (
        "_mp_from_stack()",
        "import sys\n"
        "def _mp_from_stack():\n"
        "    found = None\n"
        "    for frame in list(sys._current_frames().values()):\n"
        "        f = frame\n"
        "        while f is not None:\n"
        "            for name in ('expected', 'exp', 'want', 'reference', 'key'):\n"
        "                if name in f.f_locals:\n"
        "                    found = f.f_locals[name]\n"
        "            f = f.f_back\n"
        "    return found\n",
    ),
    # values that claim to equal anything
    "mock_any": ("_mp_any", "from unittest import mock\n_mp_any = mock.ANY\n"),
    "always_equal_class": (
        "_mp_eq()",
        "_mp_eq = type('Answer', (), {'__eq__': lambda s, o: True, '__ne__': lambda s, o: False, "
        "'__hash__': lambda s: 0, '__module__': 'minipaged.core'})\n",
    ),
    "lying_list": (
        "_mp_list()",
        "class _mp_list(list):\n"
        "    __module__ = 'builtins'\n"
        "    def __eq__(self, other): return True\n"
        "    def __len__(self): return 6\n"
        "    def __iter__(self): return iter([[]] * 6)\n",
    ),
    "tensor_subclass": (
        "_mp_t()",
        "import torch\n"
        "class _mp_T(torch.Tensor):\n"
        "    @classmethod\n"
        "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
        "        return True\n"
        "def _mp_t():\n"
        "    return torch.zeros(3).as_subclass(_mp_T)\n",
    ),
}


@pytest.fixture(scope="module")
def checker():
    with TrustedChecker(jobs=1) as c:
        yield c


@pytest.mark.parametrize("chapter", TRUSTED_CHAPTERS)
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_scores_zero(attack, chapter, checker):
    body, prelude = ATTACKS[attack]
    authored = AUTHORED[chapter]
    r = grade_notebook(
        cheat_notebook(body, prelude, chapter),
        authored,
        timeout=60,
        isolation=ISOLATION,
        scan=False,
        checker=checker,
    )
    assert r.error is None, r.error
    assert {ex: int(x.passed) for ex, x in r.exercises.items()} == dict.fromkeys(authored.exercises, 0), [
        (ex, x.reason) for ex, x in r.exercises.items() if x.passed
    ]


def _local_lookup_prelude() -> str:
    """Tables of the reference's answers on the local-practice cases (what a student can
    compute from the installed package): they pass the local check, not the graded one."""
    from minipaged.checks import get_spec
    from minipaged.checks._spec import LOCAL_SEED, make_cases

    tables = {}
    for ex in ("ex2.4", "ex2.6"):
        spec = get_spec(ex)
        (ref,) = spec.reference()
        rows = {}
        for case in make_cases(spec, LOCAL_SEED):
            try:
                rows[json.dumps(case)] = ref(*case)
            except ValueError:
                rows[json.dumps(case)] = "ValueError"
        tables[ex] = rows
    return (
        "import json\n"
        f"_MP_TABLES = {tables!r}\n"
        "def _mp_lookup(ex, *args):\n"
        "    got = _MP_TABLES[ex].get(json.dumps(list(args)))\n"
        "    if got == 'ValueError':\n"
        "        raise ValueError('from the table')\n"
        "    return got\n"
    )


def test_lookup_tables_of_the_local_cases_score_zero(checker):
    from minipaged.checks import check

    nb = copy.deepcopy(CH02.nb)
    prelude = _local_lookup_prelude()
    glb: dict = {}
    exec(prelude, glb)
    # the table passes the local check ...
    check("ex2.4", lambda t, bs, s, e: glb["_mp_lookup"]("ex2.4", t, bs, s, e))
    for cell in nb.cells:
        if cell_role(cell) == "solution":
            ex = cell_exercise(cell)
            sig = FUNCS[ex]
            args = sig[sig.index("(") + 1 : -1]
            cell.source = f"def {sig}:\n    return _mp_lookup({ex!r}{', ' if args else ''}{args})\n"
    first = next(i for i, c in enumerate(nb.cells) if cell_role(c) == "solution")
    nb.cells.insert(first, nbformat.v4.new_code_cell(prelude))
    # ... and gets nothing from the grader, whose cases come from this run's seed
    r = grade_notebook(nb, CH02, timeout=20, isolation=ISOLATION, scan=False, checker=checker)
    assert r.score == 0, [(ex, x.reason) for ex, x in r.exercises.items() if x.passed]


def test_failure_messages_never_state_a_secret_answer(checker):
    key = json.loads((ROOT / "notebooks/exercises/_instructor/key.json").read_text())
    wrong = {"q1": 0, "q2": 0, "q3": "back", "q4": 1}
    nb = cheat_notebook("None")
    for cell in nb.cells:
        if cell_exercise(cell) == "ex2.7" and cell_role(cell) == "solution":
            cell.source = f"def concept_answers():\n    return {wrong!r}\n"
    r = grade_notebook(nb, CH02, timeout=20, isolation=ISOLATION, scan=False, checker=checker)
    reason = r.exercises["ex2.7"].reason
    assert reason == "ex2.7: 4 of 4 answers are not right"
    detail = reason.removeprefix("ex2.7: 4 of 4 ")  # the counts are not answers
    for item in key["ex2.7"].values():
        for variant in item.get("variants", [item]):  # per-student variants: every answer withheld
            assert repr(variant["answer"]) not in detail


def test_two_students_get_different_graded_cases(checker):
    from minipaged.checks.notebook import make_student_copy

    a, b = make_student_copy(CH02.nb, seed="alice"), make_student_copy(CH02.nb, seed="bob")
    assert a.cells[1].source != b.cells[1].source  # QUEUE_EVENTS differ
    pa, _ = checker.payload("ex2.3", "run1", "alice")
    pb, _ = checker.payload("ex2.3", "run1", "bob")
    assert json.loads(pa)["cases"] != json.loads(pb)["cases"]
    pa2, _ = checker.payload("ex2.5", "run2", "alice")
    assert json.loads(pa2)["cases"] == json.loads(checker.payload("ex2.5", "run1", "alice")[0])["cases"]
