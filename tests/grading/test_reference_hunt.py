"""The reference hunt: no callable of a chapter's student build answers one of its exercises.

By construction, not by list: ``_hunt.py`` (a child interpreter, one for every chapter,
its ``minipaged`` modules swapped per chapter) tries every function and method the build
defines as the student's function of each exercise, on the exercise's own decoded inputs
(see its docstring for how: as is, on instances built from the inputs, on the workload);
the records of each candidate that matches on the first case calling it come back here and are judged
by the real package's checker on every case, as grading would. A pass is a leak: the
candidate must be stripped (listed in the chapter's ``ANSWERED_BY``).

What it cannot find: an answer that takes several calls (build a ``BlockTable`` from the
inputs, then ask it) or arguments the inputs do not hold. Those are what ``ANSWERED_BY``
lists by hand; the tests of ``test_student_build.py`` check each listed name is stripped.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minipaged.checks import CHAPTER_MODULES, _specs, chapter_of
from minipaged.checks._spec import expected_records, judge, make_cases
from minipaged.grading.codec import dumps, loads_strict
from minipaged.grading.student_build import student_build

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KEY = ROOT / "notebooks" / "exercises" / "_instructor" / "key.json"
MAX_CASES = 8  # per exercise: a candidate that gets 8 graded cases right answers it
SEED = "reference-hunt"
# NOTE: graded against a simulator measurement of many seconds: the child gets only the
# question ids (the chapter's constant named here), and the measurement is made for a
# candidate that returns an answer with those keys
SLOW_EXPECTED = {"ex7.3": "CHANGES"}


def _key() -> dict:
    return json.loads(KEY.read_text(encoding="utf-8")) if KEY.is_file() else {}


def _job(spec, key: dict) -> dict:
    cases = loads_strict(dumps(make_cases(spec, SEED, None)[:MAX_CASES]), max_bytes=1 << 30)
    job = {"cases": cases}
    if spec.kind == "secret":
        if spec.exercise_id in SLOW_EXPECTED:
            module = importlib.import_module(f"minipaged.checks.{chapter_of(spec.exercise_id)}")
            job["answers"] = {q: [None, 0.0] for q in getattr(module, SLOW_EXPECTED[spec.exercise_id])}
            job["shape_only"] = True
        else:
            exp = spec.expected(cases[0], key)
            job["answers"] = {
                q: [item["answer"], 0.0 if item.get("how", "choice") == "choice" else float(item["how"])]
                for q, item in exp.items()
            }
    elif spec.verdict is None:
        job["expected"] = expected_records(spec, cases, key)
    return job


def run_hunt(chapters: dict, limit_s: float = 0.2, only=None) -> dict:
    """``chapters``: ``{chapter: build folder (the parent of its minipaged)}`` -> the child's report,
    each hit with ``passed`` (the real checker's verdict on its records); ``only``: these
    exercises (default: every one of each chapter)."""
    key = _key()
    request = {"limit_s": limit_s, "chapters": {}}
    for ch, build in chapters.items():
        specs = _specs(ch)
        request["chapters"][ch] = {
            "build": str(build),
            "exercises": {
                ex: _job(spec, key) for ex, spec in sorted(specs.items()) if only is None or ex in only
            },
        }
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    req = tmp / f"hunt-{os.getpid()}.json"
    req.write_text(dumps(request), encoding="utf-8")
    env = dict(os.environ, TRITON_INTERPRET="1", MPLBACKEND="Agg", PYTHONPATH="", HF_HUB_OFFLINE="1")
    work = tmp / f"hunt-cwd-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE / "_hunt.py"), str(req)],
            capture_output=True,
            text=True,
            env=env,
            cwd=work,
            stdin=subprocess.DEVNULL,
            timeout=300,
        )
    finally:
        req.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for ch, rep in report.items():
        specs = _specs(ch)
        for ex, res in rep["exercises"].items():
            cases = request["chapters"][ch]["exercises"][ex]["cases"]
            for hit in res["hits"]:
                hit["passed"], hit["message"] = judge(specs[ex], cases, hit["records"], key)
    return report


def leaks(report: dict) -> list[str]:
    return [
        f"{ex}: {hit['name']}"
        for rep in report.values()
        for ex, res in rep["exercises"].items()
        for hit in res["hits"]
        if hit["passed"]
    ]


@pytest.fixture(scope="session")
def builds(student_build_cache) -> dict:
    return {ch: Path(student_build(ch, student_build_cache)).parent for ch in CHAPTER_MODULES}


@pytest.fixture(scope="session")
def hunt(builds) -> dict:
    return run_hunt(builds)


def test_no_callable_of_a_build_answers_its_chapter(hunt):
    assert not leaks(hunt), "package callables that answer an exercise in the student build: " + "; ".join(
        leaks(hunt)
    )


def test_the_hunt_tries_every_exercise_with_many_candidates(hunt):
    for ch in CHAPTER_MODULES:
        rep = hunt[ch]
        assert set(rep["exercises"]) == set(_specs(ch))
        assert rep["callables"] > 500, (ch, rep["callables"])  # the whole package, methods included
        for ex, res in rep["exercises"].items():
            assert res["tried"] > 0, f"{ex}: no callable of the build accepts its inputs"


def test_the_hunt_finds_a_function_the_build_does_not_strip(builds, tmp_path):
    """Inject an ex2.4 answer and an ex2.1 method into a copy of ch02's build: the hunt flags both."""
    build = tmp_path / "injected"
    shutil.copytree(builds["ch02"], build)
    for p in build.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (build / "minipaged" / "core" / "kv" / "addressing.py").write_text(
        '"""A new helper the ANSWERED_BY lists do not know."""\n\n\n'
        "def flat_slots(table, block_size, start, end):\n"
        "    if not 0 <= start <= end <= len(table) * block_size:\n"
        "        raise ValueError('outside the table')\n"
        "    return [table[i // block_size] * block_size + i % block_size for i in range(start, end)]\n\n\n"
        "class Unlinker:\n"
        "    def unlink(self, block):\n"
        "        prev, nxt = block.prev_free_block, block.next_free_block\n"
        "        if prev is None or nxt is None:\n"
        "            raise RuntimeError('not in the queue')\n"
        "        prev.next_free_block, nxt.prev_free_block = nxt, prev\n"
        "        block.prev_free_block = block.next_free_block = None\n"
        "        self.num_free_blocks -= 1\n",
        encoding="utf-8",
    )
    found = leaks(run_hunt({"ch02": build}))
    assert "ex2.4: minipaged.core.kv.addressing:flat_slots" in found, found
    assert "ex2.1: minipaged.core.kv.addressing:Unlinker.unlink" in found, found


# compositions of package callables that answer ch06 and ch07 exercises, which no single
# callable of the package does: each needs one of the chapter's ``ANSWERED_BY`` entries
COMPOSED = {
    "ch06": (
        "minipaged/core/kv/composed.py",
        "from minipaged.core.kv.block_manager_v0 import BlockSpaceManager\n"
        "from minipaged.core.kv.block import cdiv\n\n\n"
        "def cow_append(kv, request_id):\n"
        "    BlockSpaceManager.allocate_slots(kv, request_id, 1)\n"
        "    return BlockSpaceManager.take_pending_copies(kv)\n\n\n"
        "def shared_blocks(prompt_len, output_lens, block_size):\n"
        "    kv = BlockSpaceManager(sum(cdiv(prompt_len + o, block_size) for o in output_lens) + 1, block_size)\n"
        "    kv.allocate_slots('s0', prompt_len)\n"
        "    for i in range(1, len(output_lens)):\n"
        "        kv.fork('s0', f's{i}')\n"
        "    for t in range(max(output_lens)):\n"
        "        for i, o in enumerate(output_lens):\n"
        "            if t < o:\n"
        "                kv.allocate_slots(f's{i}', 1)\n"
        "    return kv.num_blocks - kv.get_num_free_blocks()\n",
        {"core/kv/block_manager_v0.py", "core/kv/kv_cache_manager.py", "sim/sharing.py"},
        {"ex6.2: minipaged.core.kv.composed:cow_append", "ex6.6: minipaged.core.kv.composed:shared_blocks"},
    ),
    "ch07": (
        "minipaged/sim/composed.py",
        "from minipaged.sim.simulator import sustainable_rate\n\n\n"
        "def knee(rates, latencies, factor):\n"
        "    if not factor > 1:\n"
        "        raise ValueError('factor must be > 1')\n"
        "    return sustainable_rate(list(rates), list(latencies), factor * latencies[0])\n",
        {"sim/simulator.py"},
        {"ex7.2: minipaged.sim.composed:knee"},
    ),
}


def test_the_new_entries_stop_compositions_the_hunt_finds_without_them(builds, tmp_path):
    """Compositions of package callables (the v0 manager's allocate_slots and fork for ex6.2
    and ex6.6, the simulator's sustainable_rate for ex7.2), injected into copies of the ch06
    and ch07 builds: they answer nothing there, and the hunt flags each one in a copy whose
    modules holding the ``ANSWERED_BY`` entries are the real package's (the entries undone)."""
    from minipaged.grading.student_build import _package_dir

    real = _package_dir()
    found = {}
    for undone in (False, True):
        copies = {}
        for ch, (where, source, modules, _) in COMPOSED.items():
            build = tmp_path / f"{ch}-{'undone' if undone else 'stripped'}"
            shutil.copytree(builds[ch], build)
            for p in build.rglob("*"):
                p.chmod(0o755 if p.is_dir() else 0o644)
            (build / where).write_text(source, encoding="utf-8")
            if undone:
                for rel in modules:
                    shutil.copyfile(real / rel, build / "minipaged" / rel)
                    for pyc in (build / "minipaged" / rel).parent.glob(f"__pycache__/{Path(rel).stem}.*.pyc"):
                        pyc.unlink()
            copies[ch] = build
        only = {line.split(":")[0] for _, _, _, lines in COMPOSED.values() for line in lines}
        found[undone] = set(leaks(run_hunt(copies, only=only)))
    assert not found[False], found[False]
    for _, _, _, lines in COMPOSED.values():
        assert lines <= found[True], (lines, found[True])
