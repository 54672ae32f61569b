"""The student builds of chapters 03-05: what answers an exercise is gone, the notebook's
own functions power the rest (issue 35, items 1, 2 and 5 for these chapters).

* every ``ANSWERED_BY`` target of ch03-ch05 is stripped in its chapter's build: a stub, or,
  for a phase of ``schedule()`` (``student_build.PHASE_PLUGS``), that one loop replaced by
  a call of ``grading/plug_ins.py``; the checks' helpers that computed an answer in the
  kernel (ex3.4's ``split_kv_partials``: one partition *is* ex3.2; ex4.3's ``schedule()``)
  are not in the build;
* with the authored functions plugged in, the builds' schedulers make the package's
  decisions (v1's and the paper's, on the exercises' workloads);
* authored solutions get full marks under the build, untouched copies 0; a wrong ex4.1
  makes ex4.5 fail (its scheduler admits with the notebook's ``schedule_waiting``), a
  missing ex5.4 makes ex5.6 fail with the ex5.4 message; the ``ch04_package_update`` cheat
  (ex4.3 by the package's own ``update_from_output``) scores 0 with the scan off and
  passes against the real package (the attack is real).
"""

from __future__ import annotations

import ast
import copy
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import minipaged
from minipaged.checks.notebook import cell_exercise, cell_role, cell_source, load_authored, make_student_copy
from minipaged.grading.grade import grade_notebook
from minipaged.grading.sandbox import probe
from minipaged.grading.student_build import PHASE_PLUGS, strip_targets, student_build

CHAPTERS = ("ch03", "ch04", "ch05")
REAL = Path(minipaged.__file__).resolve().parent
CHEATS = Path(__file__).resolve().parents[1] / "fixtures" / "cheats"
AUTHORED = load_authored()
ISOLATION = probe()


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    cache = tmp_path_factory.mktemp("builds-ch03-ch05")
    return {ch: Path(student_build(ch, cache)) for ch in CHAPTERS}


def _function(path: Path, qualname: str):
    """The ``def`` of ``qualname`` in ``path`` (under ``if``/``try`` blocks too), or the
    assignment that replaced a Triton kernel."""
    parts = qualname.split(".")

    def find(body, name):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                return node
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                return node
            if isinstance(node, (ast.If, ast.Try)):
                hit = find(node.body + node.orelse + getattr(node, "finalbody", []), name)
                if hit is None:
                    for h in getattr(node, "handlers", []):
                        hit = hit or find(h.body, name)
                if hit is not None:
                    return hit
        return None

    node = ast.parse(path.read_text(encoding="utf-8"))
    for name in parts:
        node = find(node.body, name)
        assert node is not None, f"{qualname} not in {path}"
    return node


def _module_file(root: Path, module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    path = (root / rel).with_suffix(".py")
    return path if path.is_file() else root / rel / "__init__.py"


def _loops(fn) -> int:
    return sum(isinstance(n, ast.While) for n in fn.body)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_answered_by_target_is_stripped(builds, chapter):
    targets = strip_targets(chapter)
    assert targets, chapter
    for target, (ex, _name, _arity) in targets.items():
        module, qual = target.split(":")
        built = _function(_module_file(builds[chapter], module), qual)
        text = ast.unparse(built)
        if (target, ex) in PHASE_PLUGS:
            real = _function(_module_file(REAL, module), qual)
            assert _loops(built) == _loops(real) - 1, target
            assert "minipaged.grading.plug_ins" in text, target
        else:
            body = built.body if isinstance(built, ast.FunctionDef) else [built]
            assert len(body) == 1 and "minipaged._student_build" in text, (target, text[:300])


def test_the_scheduler_phases_are_the_chapters_own(builds):
    """ch04's build takes out the admission loop (ex4.1) and keeps the running phase;
    ch05's takes out the running phase (ex5.4) of both schedulers and keeps admission."""
    v1 = {ch: (builds[ch] / "core" / "sched" / "scheduler.py").read_text() for ch in CHAPTERS}
    paper = {ch: (builds[ch] / "core" / "sched" / "paper.py").read_text() for ch in CHAPTERS}
    running, waiting = "victim = self.running.pop()", "self.waiting.popleft()"
    assert running in v1["ch03"] and waiting in v1["ch03"]
    assert running in v1["ch04"] and "v1_waiting_phase" in v1["ch04"] and waiting not in v1["ch04"]
    assert running not in v1["ch05"] and "v1_running_phase" in v1["ch05"] and waiting in v1["ch05"]
    assert "paper_running_phase" in paper["ch05"] and "victims = units.pop()" not in paper["ch05"]
    assert "def _admit_next" in paper["ch05"] and "self.waiting.popleft()" in paper["ch05"]


def test_no_check_helper_computes_an_answer_in_the_kernel(builds):
    ch03 = (builds["ch03"] / "checks" / "ch03.py").read_text()
    assert "def split_kv_partials" not in ch03 and "def reference_reads" not in ch03
    assert "def split_kv_partials" in (REAL / "checks" / "ch03.py").read_text()
    ch04 = (builds["ch04"] / "checks" / "ch04.py").read_text()
    assert "Scheduler.schedule(" not in ch04 and "def reference_steps" not in ch04
    ch05 = (builds["ch05"] / "checks" / "ch05.py").read_text()
    assert "def reference_run" not in ch05 and "def ref_schedule_running" not in ch05


def _solutions(chapter: str) -> str:
    return "\n\n".join(
        cell_source(c) for c in AUTHORED[chapter].nb.cells if cell_role(c) in ("setup", "solution")
    )


# run in a child interpreter on the chapter's build, the authored functions in __main__:
# the plugged schedulers against the decisions the real package made (sent as JSON)
_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import minipaged
assert minipaged.__file__.startswith(sys.argv[1]), minipaged.__file__
exec(compile(open(sys.argv[2]).read(), "<solutions>", "exec"), globals())
from minipaged.checks._scheduler_cases import arrivals_of
from minipaged.core import PaperScheduler, Scheduler

def steps(sched, workload):
    arrivals, out, step = arrivals_of(workload), [], 0
    while step <= max(arrivals) or sched.has_unfinished_requests():
        for r in arrivals.get(step, ()):
            sched.add_request(r)
        o = sched.schedule()
        sampled = {r.request_id: 1 for r, n in o.scheduled if r.num_computed_tokens + n == r.num_tokens}
        sched.update_from_output(o, sampled)
        sched.check_invariants()
        out.append([dict(o.num_scheduled_tokens), [r.request_id for r in o.preempted]])
        step += 1
    return out

job = json.loads(sys.argv[3])
knobs = dict(job["knobs"])
kinds = {"v1": Scheduler, "paper": PaperScheduler}
res = {}
for kind in job["kinds"]:
    k = dict(knobs)
    extra = {"watermark": None} if kind == "paper" else {"scheduler_reserve_full_isl": False}
    s = kinds[kind](k.pop("num_blocks"), k.pop("block_size"), **k, **extra)
    res[kind] = steps(s, [tuple(w) for w in job["workload"]])
print(json.dumps(res))
"""


def _package_steps(kind, knobs, workload):
    from minipaged.checks._scheduler_cases import arrivals_of
    from minipaged.core import PaperScheduler, Scheduler

    k = dict(knobs)
    cls, extra = (
        (PaperScheduler, {"watermark": None})
        if kind == "paper"
        else (Scheduler, {"scheduler_reserve_full_isl": False})
    )
    s = cls(k.pop("num_blocks"), k.pop("block_size"), **k, **extra)
    arrivals, out, step = arrivals_of(workload), [], 0
    while step <= max(arrivals) or s.has_unfinished_requests():
        for r in arrivals.get(step, ()):
            s.add_request(r)
        o = s.schedule()
        s.update_from_output(
            o, {r.request_id: 1 for r, n in o.scheduled if r.num_computed_tokens + n == r.num_tokens}
        )
        out.append([dict(o.num_scheduled_tokens), [r.request_id for r in o.preempted]])
        step += 1
    return out


@pytest.mark.parametrize(
    "chapter,kinds,workload,knobs",
    [
        (
            "ch04",
            ["v1"],
            "SERVE_WORKLOAD",
            {"num_blocks": 12, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16},
        ),
        ("ch04", ["v1"], "PREDICT_REQUESTS", "PREDICT_KNOBS"),
        ("ch05", ["v1", "paper"], "PREDICT_REQUESTS", "PREDICT_KNOBS"),
        ("ch05", ["v1", "paper"], "DESIGN_WORKLOAD", "DESIGN_KNOBS"),
    ],
)
def test_the_authored_functions_plugged_in_make_the_packages_decisions(
    builds, tmp_path, chapter, kinds, workload, knobs
):
    import importlib

    mod = importlib.import_module(f"minipaged.checks.{chapter}")
    workload = [list(w) for w in getattr(mod, workload)]
    knobs = getattr(mod, knobs) if isinstance(knobs, str) else knobs
    src = tmp_path / "solutions.py"
    src.write_text(_solutions(chapter), encoding="utf-8")
    job = json.dumps({"knobs": knobs, "workload": workload, "kinds": kinds})
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(builds[chapter].parent), str(src), job],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    preempting = False
    for kind in kinds:
        want = _package_steps(kind, knobs, [tuple(w) for w in workload])
        assert got[kind] == json.loads(json.dumps(want)), kind
        preempting |= any(p for _, p in want)
    assert preempting or chapter == "ch04"  # ch05's runs exercise the preemption path


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_authored_full_marks_untouched_copy_zero_under_the_build(chapter):
    authored = AUTHORED[chapter]
    r = grade_notebook(authored.nb, authored, timeout=120, isolation=ISOLATION, scan=False)
    assert r.error is None, r.error
    assert all(x.passed for x in r.exercises.values()), {ex: x.reason for ex, x in r.exercises.items()}
    r = grade_notebook(make_student_copy(authored.nb), authored, timeout=120, isolation=ISOLATION, scan=False)
    assert not [ex for ex, x in r.exercises.items() if x.passed]


def _with_solution(chapter: str, ex: str, source: str):
    nb = copy.deepcopy(AUTHORED[chapter].nb)
    for c in nb.cells:
        if cell_role(c) == "solution" and cell_exercise(c) == ex:
            c.source = source
    return nb


# admits one request per step at most (a wrong ex4.1): ex4.5's serve runs on it when graded
ONE_PER_STEP = """
def schedule_waiting(scheduler, token_budget):
    if not scheduler.waiting or len(scheduler.running) >= scheduler.max_num_seqs:
        return []
    request = scheduler.waiting[0]
    n = min(request.num_tokens - request.num_computed_tokens, token_budget)
    if scheduler.kv_cache_manager.allocate_slots(request, n) is None:
        return []
    scheduler.waiting.popleft()
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return [(request, n)]
"""


def test_your_code_powers_the_rest():
    authored = AUTHORED["ch04"]
    r = grade_notebook(
        _with_solution("ch04", "ex4.1", ONE_PER_STEP), authored, timeout=120, isolation=ISOLATION, scan=False
    )
    passed = {ex: x.passed for ex, x in r.exercises.items()}
    assert passed == {
        "ex4.1": False,
        "ex4.2": True,
        "ex4.3": True,
        "ex4.4": True,
        "ex4.5": False,
        "ex4.6": True,
    }
    authored = AUTHORED["ch05"]
    stub = "def schedule_running(scheduler, token_budget):\n    raise NotImplementedError\n"
    r = grade_notebook(
        _with_solution("ch05", "ex5.4", stub), authored, timeout=120, isolation=ISOLATION, scan=False
    )
    failed = {ex: x.reason for ex, x in r.exercises.items() if not x.passed}
    assert set(failed) == {"ex5.4", "ex5.6"}, failed
    assert failed["ex5.6"] == "ex5.4: your notebook's schedule_running is used here", failed["ex5.6"]


def test_the_package_update_cheat_scores_zero_and_is_real():
    nb = nbformat.read(CHEATS / "ch04_package_update.ipynb", as_version=4)
    authored = AUTHORED["ch04"]
    graded = grade_notebook(nb, authored, timeout=120, isolation=ISOLATION, scan=False)
    assert {ex for ex, x in graded.exercises.items() if x.passed} == {"ex4.1", "ex4.2"}
    real = grade_notebook(nb, authored, timeout=120, isolation=ISOLATION, scan=False, use_student_build=False)
    assert real.exercises["ex4.3"].passed, real.exercises["ex4.3"].reason


# -- item 5: the local check says what grading says --------------------------------------------


def _local(chapter: str, ex: str, replace: dict):
    """The local check of ``ex`` (in this interpreter, the real package) with the chapter's
    authored setup and solutions, ``replace`` (exercise -> source) instead of some:
    ``None`` when it passes, else its message."""
    import contextlib
    import io

    from minipaged.checks import ExerciseFailure, check
    from minipaged.grading.grade import check_call

    ns: dict = {}
    for c in AUTHORED[chapter].nb.cells:
        if cell_role(c) in ("setup", "solution"):
            src = (
                replace.get(cell_exercise(c), cell_source(c))
                if cell_role(c) == "solution"
                else cell_source(c)
            )
            exec(compile(src, f"<{cell_exercise(c) or 'setup'}>", "exec"), ns)
    _, names = check_call(cell_source(AUTHORED[chapter].check_cells[ex]))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check(ex, *[ns[n] for n in names])
    except ExerciseFailure as e:
        return str(e)
    return None


def test_the_local_check_of_the_engine_loop_runs_on_the_notebooks_scheduler():
    """ex4.5's local check drives a scheduler whose admission is the notebook's ex4.1, as
    grading does: a wrong ex4.1 fails ex4.5 locally too (the authored serve, unchanged)."""
    assert _local("ch04", "ex4.5", {}) is None
    message = _local("ch04", "ex4.5", {"ex4.1": ONE_PER_STEP})
    assert message is not None and message.startswith("ex4.5 failed on case"), message


def test_the_package_update_cheat_fails_locally_with_gradings_message():
    nb = nbformat.read(CHEATS / "ch04_package_update.ipynb", as_version=4)
    cheat = next(
        cell_source(c) for c in nb.cells if cell_role(c) == "solution" and cell_exercise(c) == "ex4.3"
    )
    assert (
        _local("ch04", "ex4.3", {"ex4.3": cheat}) == "ex4.3: your notebook's update_from_output is used here"
    )


def test_the_local_check_of_the_rule_needs_the_notebooks_running_phase():
    stub = "def schedule_running(scheduler, token_budget):\n    raise NotImplementedError\n"
    assert _local("ch05", "ex5.6", {}) is None
    assert _local("ch05", "ex5.6", {"ex5.4": stub}) == "ex5.4: your notebook's schedule_running is used here"
