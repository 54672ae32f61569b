"""``minipaged grade --gradescope OUT.zip``: the zip, and its run_autograder run as Gradescope runs it.

The zip is unpacked into a temporary folder laid out as Gradescope's ``/autograder``
(``source/`` holds the zip, ``run_autograder`` is copied beside it, ``submission/`` and
``submission_metadata.json`` are the upload) and ``run_autograder`` runs there against the
package installed in this environment (``$MINIPAGED_GRADESCOPE_PYTHON``; setup.sh's install
is skipped, setup.sh itself is checked with ``bash -n``). results.json is validated against
Gradescope's specification (https://gradescope-autograders.readthedocs.io/en/latest/specs/),
independently of the code that writes it. The solved notebook answers ex2.5 and ex2.7 for
the seed ``HMAC(secret, Gradescope user id)`` and the shipped variants' answers differ, so
its full marks show the metadata's id is the one used.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from minipaged.checks import get_spec
from minipaged.checks._spec import make_cases
from minipaged.checks.notebook import cell_exercise, cell_role, load_authored, make_student_copy
from minipaged.cli import main
from minipaged.grading import gradescope, roster
from minipaged.grading.student_build import default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
KEY_PATH = ROOT / "notebooks/exercises/_instructor/key.json"
CH02 = load_authored()["ch02"]
SECRET = b"gradescope-course-secret"
USER_ID = 4242  # Gradescope's users[0].id of the submitter
VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}
TOP_KEYS = {"score", "execution_time", "output", "visibility", "stdout_visibility", "extra_data", "tests"}
TEST_KEYS = {"score", "max_score", "name", "number", "output", "tags", "visibility", "extra_data"}


@pytest.fixture(scope="module")
def autograder_zip(tmp_path_factory):
    d = tmp_path_factory.mktemp("gradescope")
    (d / "secret.txt").write_bytes(SECRET + b"\n")
    out = d / "autograder.zip"
    argv = ["grade", "--gradescope", str(out), "--chapter", "ch02", "--secret", str(d / "secret.txt")]
    assert main(argv + ["--timeout", "30", "--no-copy-detection"]) == 0
    return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_results(results: dict) -> None:
    """Gradescope's results.json format: types of every field, score = the tests' sum."""
    assert set(results) <= TOP_KEYS, set(results) - TOP_KEYS
    assert _number(results["score"]) and isinstance(results["tests"], list) and results["tests"]
    assert isinstance(results.get("output", ""), str)
    assert results.get("visibility", "visible") in VISIBILITY
    assert results.get("stdout_visibility", "hidden") in VISIBILITY
    assert isinstance(results.get("execution_time", 0), int)
    assert isinstance(results.get("extra_data", {}), dict)
    for t in results["tests"]:
        assert set(t) <= TEST_KEYS, set(t) - TEST_KEYS
        assert isinstance(t["name"], str) and t["name"]
        assert isinstance(t["output"], str) and t["output"]
        assert _number(t["score"]) and _number(t["max_score"]) and 0 <= t["score"] <= t["max_score"]
        assert t.get("visibility", "visible") in VISIBILITY
        assert isinstance(t.get("number", ""), str)
    assert results["score"] == sum(t["score"] for t in results["tests"])
    assert len({t["name"] for t in results["tests"]}) == len(results["tests"])


def _strict_load(path: Path) -> dict:
    def bad(name):
        raise ValueError(f"results.json holds {name}: not JSON")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=bad)


def gradescope_root(tmp_path: Path, zip_path: Path, nb=None, user_id=USER_ID) -> Path:
    """A folder laid out as Gradescope's /autograder, with ``nb`` uploaded."""
    root = tmp_path / "autograder"
    for sub in ("source", "submission", "results"):
        (root / sub).mkdir(parents=True)
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(root / "source")
        for info in z.infolist():  # zipfile drops the mode bits; Gradescope keeps them
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(root / "source" / info.filename, mode)
    shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")
    if nb is not None:
        nbformat.write(nb, root / "submission" / "my_notebook.ipynb")
    meta = {"id": 1, "users": [{"email": "s@example.edu", "id": user_id, "name": "S"}], "assignment": {}}
    (root / "submission_metadata.json").write_text(json.dumps(meta))
    return root


def run_autograder(root: Path) -> dict:
    env = dict(os.environ)
    env[gradescope.ROOT_ENV] = str(root)
    env[gradescope.PYTHON_ENV] = sys.executable
    env.setdefault("MINIPAGED_BUILD_CACHE", str(default_cache_dir()))  # not setup.sh's /opt
    p = subprocess.run(
        [str(root / "run_autograder")], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout + p.stderr
    results = _strict_load(root / "results" / "results.json")
    validate_results(results)
    return results


def _answers(student_seed) -> dict:
    """The right answers to ex2.5 and ex2.7 for ``student_seed``, from the trusted side's spec."""
    key = json.loads(KEY_PATH.read_text())
    out = {}
    for ex in ("ex2.5", "ex2.7"):
        spec = get_spec(ex)
        want = spec.expected(make_cases(spec, "any-run", student_seed)[0], key)
        out[ex] = {q: item["answer"] for q, item in want.items()} if ex == "ex2.7" else want
    return out


def solved_for(user_id) -> nbformat.NotebookNode:
    """The authored solutions, with ex2.5 and ex2.7 answered for this Gradescope user."""
    seed = roster.student_seed(SECRET, str(user_id))
    answers = _answers(seed)
    assert answers != _answers(None), "the draws must differ, else the test proves nothing"
    nb = copy.deepcopy(CH02.nb)
    nb.cells = make_student_copy(CH02.nb, seed=seed).cells
    fn = {"ex2.5": "predict_free_queue", "ex2.7": "concept_answers"}
    for i, cell in enumerate(nb.cells):
        ex = cell_exercise(cell)
        if cell_role(cell) == "solution":
            if ex in answers:
                cell.source = f"def {fn[ex]}():\n    return {answers[ex]!r}\n"
            else:
                nb.cells[i] = copy.deepcopy(CH02.nb.cells[i])
    return nb


def test_zip_has_gradescopes_layout_and_valid_scripts(autograder_zip, tmp_path):
    with zipfile.ZipFile(autograder_zip) as z:
        names = set(z.namelist())
        modes = {i.filename: (i.external_attr >> 16) & 0o777 for i in z.infolist()}
        config = json.loads(z.read("config.json"))
        setup = z.read("setup.sh").decode()
        pyproject = z.read("package/pyproject.toml").decode()
    # at the root of the archive, not under a folder (Gradescope's specs); scripts executable
    assert {"setup.sh", "run_autograder", "config.json", "secret"} <= names
    assert {f"exercises/{CH02.name}", "exercises/_instructor/key.json"} <= names
    assert {"package/pyproject.toml", "package/minipaged/grading/gradescope.py"} <= names
    assert modes["setup.sh"] == modes["run_autograder"] == 0o755
    assert modes["secret"] == modes["exercises/_instructor/key.json"] == 0o600
    assert (autograder_zip.stat().st_mode & 0o077) == 0  # solutions, key and secret inside
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert config["chapters"] == ["ch02"] and config["exercises"]["ch02"] == CH02.exercises
    assert config["per_student_seeds"] and config["student_id"] == "id"
    assert config["timeout"] == 30.0 and config["copy_detection"] is False
    torch = gradescope.torch_version()
    assert f'"torch=={torch}" --index-url https://download.pytorch.org/whl/cpu' in setup
    assert "/autograder/source/package" in setup
    root = gradescope_root(tmp_path, autograder_zip)
    for script in ("source/setup.sh", "run_autograder"):
        p = subprocess.run(["bash", "-n", str(root / script)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return
    project = tomllib.loads(pyproject)["project"]
    assert project["name"] == "minipaged" and any(d.startswith("copydetect") for d in project["dependencies"])
    assert not any("extra ==" in d for d in project["dependencies"])


def test_run_autograder_solved_full_marks_untouched_zero(autograder_zip, tmp_path):
    full = run_autograder(gradescope_root(tmp_path / "solved", autograder_zip, solved_for(USER_ID)))
    assert [t["name"].split()[0] for t in full["tests"]] == CH02.exercises
    assert full["score"] == len(CH02.exercises) == sum(t["max_score"] for t in full["tests"])
    assert all(t["output"] == "passed" for t in full["tests"])
    assert full["extra_data"]["student"] == f"id {USER_ID}"
    untouched = make_student_copy(CH02.nb, seed=roster.student_seed(SECRET, str(USER_ID)))
    zero = run_autograder(gradescope_root(tmp_path / "untouched", autograder_zip, untouched))
    assert zero["score"] == 0 and len(zero["tests"]) == len(CH02.exercises)
    # one test per exercise, with the grader's reason
    assert all(t["score"] == 0 and t["output"] != "passed" for t in zero["tests"])
    assert any("not implemented" in t["output"].lower() for t in zero["tests"])


def test_no_notebook_or_no_student_id_is_zero_with_a_reason(autograder_zip, tmp_path):
    root = gradescope_root(tmp_path / "empty", autograder_zip)
    results = gradescope.run_autograder(root)  # nothing uploaded: no kernel starts
    validate_results(results)
    assert results["score"] == 0
    assert all(f"upload your {CH02.name}" in t["output"] for t in results["tests"])
    assert _strict_load(root / "results" / "results.json") == results
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"users": []}))
    assert gradescope.student_id(meta, "id")[0] is None
    meta.write_text(json.dumps({"users": [{"id": 7, "email": "a@x"}, {"id": 8, "email": "b@x"}]}))
    sid, note = gradescope.student_id(meta, "email")
    assert sid == "a@x" and "group submission of 2" in note


def test_cli_refuses_what_does_not_apply(tmp_path, capsys):
    out = tmp_path / "a.zip"
    assert main(["grade", "--gradescope", str(out), "x.ipynb"]) == 2
    assert "grades nothing here" in capsys.readouterr().err
    assert main(["grade", "--gradescope", str(tmp_path / "no" / "a.zip"), "--chapter", "ch02"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not out.exists()
