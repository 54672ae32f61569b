"""The student build itself: stripped bodies gone (sources and .pyc), references gone, the
real package untouched, cached per version and content hash, the stub's message; every
chapter's authored solutions get full marks under their build and untouched copies none; the
local check strips what the build strips, so it says what grading says."""

from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import minipaged
from minipaged.checks import CHAPTER_MODULES, ExerciseFailure, _specs, chapter_of, check, get_spec
from minipaged.checks._harness import pass_line
from minipaged.checks._spec import judge, make_cases
from minipaged.checks.notebook import cell_exercise, cell_role, cell_source, load_authored, make_student_copy
from minipaged.grading.codec import dumps, loads_strict
from minipaged.grading.grade import check_call
from minipaged.grading.student_build import (
    PHASE_PLUGS,
    _find_def,
    _resolve,
    as_in_the_build,
    strip_targets,
    student_build,
)

REAL = Path(minipaged.__file__).resolve().parent


@pytest.fixture(scope="module")
def ch02(tmp_path_factory):
    return Path(student_build("ch02", tmp_path_factory.mktemp("builds")))


def test_a_stripped_body_is_in_no_source_and_no_pyc(ch02):
    body = "self.num_free_blocks -= 1"  # a line of FreeKVCacheBlockQueue.remove's body
    assert body in (REAL / "core" / "kv" / "block.py").read_text()
    assert body not in (ch02 / "core" / "kv" / "block.py").read_text()
    pycs = list((ch02 / "core" / "kv" / "__pycache__").glob("block.*.pyc"))
    assert pycs and all(
        b"num_free_blocks" not in p.read_bytes() or b"-= 1" not in p.read_bytes() for p in pycs
    )
    assert "minipaged.core.kv.block:FreeKVCacheBlockQueue.remove" in strip_targets("ch02")


def test_the_checks_references_are_absent(ch02):
    text = (ch02 / "checks" / "ch02.py").read_text()
    assert "def ref_slot_mapping" not in text and "def reference_free_queues" not in text
    assert "def ref_slot_mapping" in (REAL / "checks" / "ch02.py").read_text()


def test_the_real_package_is_untouched(ch02):
    assert "__student_build" not in (REAL / "core" / "kv" / "kv_cache_manager.py").read_text()
    assert not (REAL / "_student_build.py").exists()


def test_cached_per_version_and_content_hash(ch02):
    again = Path(student_build("ch02", ch02.parents[1]))
    assert again == ch02
    assert ch02.parent.name.startswith(f"{minipaged.__version__}-") and ch02.parent.name.endswith("-ch02")


def test_a_stripped_function_raises_the_exercise_message_without_a_notebook_function(ch02):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import minipaged; assert minipaged.__file__.startswith(sys.argv[1])\n"
        "from minipaged.core import KVCacheManager\n"
        "try:\n    KVCacheManager(4, 2).allocate_slots('r', 3)\n"
        "except NotImplementedError as e:\n    print(e)\n"
        "def allocate_slots(manager, request_id, num_new_tokens):\n    return ['mine']\n"
        "print(KVCacheManager(4, 2).allocate_slots('r', 3))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ch02.parent)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ex2.3: your notebook's allocate_slots is used here", "['mine']"]


def test_a_stripped_method_runs_the_notebook_function_through_its_adapter(ch02):
    """ch07's build: a sweep's ``sustainable_rate`` (factor, threshold) runs the notebook's
    ``sustainable_rate(rates, latencies, factor)`` on the sweep's own curve; the simulator's
    (an absolute threshold, not a factor) never takes the notebook's function."""
    ch07 = Path(student_build("ch07", ch02.parents[1]))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import minipaged; assert minipaged.__file__.startswith(sys.argv[1])\n"
        "from types import SimpleNamespace\n"
        "from minipaged.sim.simulator import RateSweep, sustainable_rate as threshold_rate\n"
        "sw = RateSweep('paged', 1.0, [1.0, 2.0, 3.0], [SimpleNamespace(normalized_latency=x) for x in (0.1, 0.15, 0.3)])\n"
        "def sustainable_rate(rates, latencies, factor):\n"
        "    return [rates, latencies, round(factor, 12)]\n"
        "print(sw.sustainable_rate(), sw.sustainable_rate(3.0), sw.sustainable_rate(2.0, 0.45))\n"
        "try:\n    threshold_rate([1.0], [0.1], 0.2)\n"
        "except NotImplementedError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ch07.parent)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    curve = "[[1.0, 2.0, 3.0], [0.1, 0.15, 0.3], "
    assert out.stdout.splitlines() == [
        f"{curve}2.0] {curve}3.0] {curve}4.5]",
        "ex7.2: your notebook's sustainable_rate is used here",
    ]


# -- every chapter under its build: full marks for the solutions, none for the copies ---------
#
# Each chapter's authored notebook, its untouched student copy and (for some chapters) a
# copy whose solutions call the package's own implementation run in a fresh interpreter on
# the chapter's build (``_in_build.py``: the cells in ``__main__``, then the driver's
# observations of the graded cases), and the real checker judges the records, as the trusted
# side does. Without the sandbox: 28 runs, about a minute on two cores.

HERE = Path(__file__).resolve().parent
KEY = json.loads((HERE.parents[1] / "notebooks" / "exercises" / "_instructor" / "key.json").read_text())
SEED = "full-marks"
AUTHORED = load_authored()

# solutions that call the package's implementation, each by another route: the message the
# local check gives must be the one grading gives, the stripped callable's own
CALLS_THE_PACKAGE = {
    "ex2.3": (
        "from minipaged.core import KVCacheManager\n"
        "def allocate_slots(kv_cache_manager, request_id, num_new_tokens):\n"
        "    return KVCacheManager.allocate_slots(kv_cache_manager, request_id, num_new_tokens)\n",
        "ex2.3: your notebook's allocate_slots is used here",
    ),
    "ex6.1": (  # captured in a default argument before any check runs
        "def fork(kv_cache_manager, parent_id, child_id, _impl=BlockSpaceManager.fork):\n"
        "    return _impl(kv_cache_manager, parent_id, child_id)\n",
        "ex6.1: your notebook's fork is used here",
    ),
    "ex6.2": (  # two calls: allocate_slots of one token does the copy-on-write
        "def append_slot(kv_cache_manager, request_id):\n"
        "    BlockSpaceManager.allocate_slots(kv_cache_manager, request_id, 1)\n"
        "    return BlockSpaceManager.take_pending_copies(kv_cache_manager)\n",
        "ex6.2: your notebook's append_slot is used here",
    ),
    "ex6.6": (  # the manager run as the checker's reference runs it
        "def blocks_with_sharing(prompt_len, output_lens, block_size):\n"
        "    kv = BlockSpaceManager(sum(cdiv(prompt_len + o, block_size) for o in output_lens) + 1, block_size)\n"
        "    kv.allocate_slots('s0', prompt_len)\n"
        "    for i in range(1, len(output_lens)):\n"
        "        kv.fork('s0', f's{i}')\n"
        "    for t in range(max(output_lens)):\n"
        "        for i, o in enumerate(output_lens):\n"
        "            if t < o:\n"
        "                kv.allocate_slots(f's{i}', 1)\n"
        "    return kv.num_blocks - kv.get_num_free_blocks()\n",
        "ex6.2: your notebook's append_slot is used here",
    ),
    "ex7.2": (
        "from minipaged.sim.simulator import sustainable_rate as _rate\n"
        "def sustainable_rate(rates, latencies, factor):\n"
        "    return _rate(rates, latencies, factor * latencies[0])\n",
        "ex7.2: your notebook's sustainable_rate is used here",
    ),
    "ex10.1": (  # the package's function object itself
        "from minipaged.sample.rejection_sampler import RejectionSampler\n"
        "greedy_verify = RejectionSampler._greedy\n",
        "ex10.1: your notebook's greedy_verify is used here",
    ),
}


def _calling_the_package(nb):
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell_role(cell) == "solution" and cell_exercise(cell) in CALLS_THE_PACKAGE:
            cell.source = CALLS_THE_PACKAGE[cell_exercise(cell)][0]
    return nb


def _run_in_build(build: Path, nb, payload: dict, folder: Path) -> dict:
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / "nb.ipynb")
    (folder / "payload.json").write_text(json.dumps(payload), encoding="utf-8")
    env = dict(os.environ, TRITON_INTERPRET="1", MPLBACKEND="Agg", PYTHONPATH="", HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, str(HERE / "_in_build.py"), str(build), "nb.ipynb", "payload.json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["package"].startswith(str(build)), report["package"]
    return report


@pytest.fixture(scope="module")
def in_build(tmp_path_factory):
    """``{(chapter, "authored" | "copy" | "calls the package"): (cell errors, {exercise: (passed,
    message)})}``, judged by the real checker on the graded cases (``SEED``)."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("in-build")
    cache = root / "builds"
    builds = {ch: Path(student_build(ch, cache)).parent for ch in sorted(AUTHORED)}
    payloads = {
        ch: {
            ex: loads_strict(dumps(make_cases(get_spec(ex), SEED, None)), max_bytes=1 << 30)
            for ex in a.exercises
        }
        for ch, a in AUTHORED.items()
    }
    jobs = []
    for ch, a in sorted(AUTHORED.items()):
        jobs.append((ch, "authored", a.nb))
        jobs.append((ch, "copy", make_student_copy(a.nb)))
        if any(ex in CALLS_THE_PACKAGE for ex in a.exercises):
            jobs.append((ch, "calls the package", _calling_the_package(a.nb)))

    def run(job):
        ch, kind, nb = job
        payload = payloads[ch]
        if kind == "calls the package":  # NOTE: only those exercises: the others are as authored
            payload = {ex: cases for ex, cases in payload.items() if ex in CALLS_THE_PACKAGE}
        report = _run_in_build(builds[ch], nb, payload, root / f"{ch}-{kind.replace(' ', '-')}")
        errors = [(k, role, err) for k, role, err in report["cells"] if err]
        verdicts = {ex: judge(get_spec(ex), payload[ex], report["records"][ex], KEY) for ex in payload}
        return (ch, kind), (errors, verdicts)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, jobs))


@pytest.mark.parametrize("chapter", sorted(AUTHORED))
def test_authored_solutions_get_full_marks_under_the_student_build(in_build, chapter):
    errors, verdicts = in_build[(chapter, "authored")]
    assert not errors, errors
    assert list(verdicts) == AUTHORED[chapter].exercises
    assert {ex: msg for ex, (ok, msg) in verdicts.items() if not ok} == {}


@pytest.mark.parametrize("chapter", sorted(AUTHORED))
def test_untouched_copies_get_nothing_under_the_student_build(in_build, chapter):
    errors, verdicts = in_build[(chapter, "copy")]
    assert not errors, errors  # the setup and the stubs run; every check fails as a stub
    assert {ex: msg for ex, (ok, msg) in verdicts.items() if ok or "not implemented yet" not in msg} == {}


@pytest.mark.parametrize("exercise_id", sorted(CALLS_THE_PACKAGE))
def test_the_local_check_says_what_grading_says_to_a_call_of_the_package(in_build, exercise_id):
    """Item 5 of issue 35: the local check (in this interpreter, the real package) of a
    solution that calls the package's implementation fails with grading's message."""
    chapter = chapter_of(exercise_id)
    source, message = CALLS_THE_PACKAGE[exercise_id]
    _, verdicts = in_build[(chapter, "calls the package")]
    assert verdicts[exercise_id] == (False, message)
    ns: dict = {}
    setup = "\n".join(cell_source(c) for c in AUTHORED[chapter].nb.cells if cell_role(c) == "setup")
    exec(compile(setup, "<setup>", "exec"), ns)
    for cell in AUTHORED[chapter].nb.cells:  # the chapter's other solutions, as authored
        if cell_role(cell) == "solution" and cell_exercise(cell) != exercise_id:
            exec(compile(cell_source(cell), "<solution>", "exec"), ns)
    exec(compile(source, f"<{exercise_id}>", "exec"), ns)
    _, names = check_call(cell_source(AUTHORED[chapter].check_cells[exercise_id]))
    with pytest.raises(ExerciseFailure) as failure, contextlib.redirect_stdout(io.StringIO()):
        check(exercise_id, *[ns[n] for n in names])
    assert str(failure.value) == message
    # and without the call of the package, as authored, it passes
    with contextlib.redirect_stdout(io.StringIO()) as out:
        solution = next(
            c
            for c in AUTHORED[chapter].nb.cells
            if cell_role(c) == "solution" and cell_exercise(c) == exercise_id
        )
        exec(compile(cell_source(solution), f"<{exercise_id}>", "exec"), ns)
        check(exercise_id, *[ns[n] for n in names])
    assert out.getvalue().splitlines()[-1] == pass_line(exercise_id)


# -- the local check's stripping (``as_in_the_build``) --------------------------------------


def _required_args(fn) -> tuple[list, dict]:
    sig = inspect.signature(fn)
    args, kwargs = [], {}
    for p in sig.parameters.values():
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = None
        else:
            args.append(None)
    return args, kwargs


@pytest.mark.parametrize("chapter", CHAPTER_MODULES)
def test_the_local_check_strips_what_the_build_strips_and_puts_it_back(chapter):
    """Every callable the chapter's build strips raises its stub's message inside
    ``as_in_the_build`` of any exercise of the chapter (no notebook function to plug in here),
    and has its own code back after it."""
    info = strip_targets(chapter)
    fns = {t: _resolve(t) for t in info}
    before = {t: getattr(fn, "__code__", None) for t, fn in fns.items()}
    for spec in _specs(chapter).values():
        with as_in_the_build(spec):
            for t, fn in fns.items():
                ex, name, _ = info[t]
                if (t, ex) in PHASE_PLUGS:  # one phase replaced: test_build_ch03_ch05.py runs it
                    assert fn.__code__ is not before[t] and "__import__" in fn.__code__.co_names, t
                    continue
                with pytest.raises(NotImplementedError) as stripped:
                    if hasattr(fn, "run") and hasattr(fn, "fn"):  # a Triton kernel, launched
                        fn[(1,)]()
                    else:
                        args, kwargs = _required_args(fn)
                        fn(*args, **kwargs)
                assert str(stripped.value) == f"{ex}: your notebook's {name} is used here", t
        assert {t: getattr(fn, "__code__", None) for t, fn in fns.items()} == before
        assert all("run" not in vars(fn) for fn in fns.values() if hasattr(fn, "fn"))
        assert "minipaged._student_build" not in sys.modules


def test_every_listed_callable_is_a_stub_in_its_chapters_build(tmp_path):
    """Each ``answered_by`` name of a chapter, in that chapter's build: a body that only calls
    the hook (or a ``StrippedKernel``), whatever the reference hunt can or cannot find."""
    cache = tmp_path / "builds"
    for ch in CHAPTER_MODULES:
        build = Path(student_build(ch, cache))
        for target, (ex, _, _) in strip_targets(ch).items():
            if (target, ex) in PHASE_PLUGS:  # one loop of its body: test_build_ch03_ch05.py
                continue
            module, qualname = target.split(":")
            rel = Path(*module.split(".")[1:])
            path = build / rel.with_suffix(".py")
            path = path if path.is_file() else build / rel / "__init__.py"
            tree = ast.parse(path.read_text(encoding="utf-8"))
            found = _find_def(tree.body, qualname.split("."))
            assert found is not None, (ch, target)
            text = ast.unparse(found)
            assert "_student_build" in text and len(getattr(found, "body", [found])) == 1, (ch, target, text)
