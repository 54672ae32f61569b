"""The student's path from the README: install, open a chapter, get the exercises, check, grade.

What a student does with this checkout: run the README's first command (its ``pip install``
lines: a CPU torch first, then the package, no extras), open chapter 00 in JupyterLab, write
the exercise copies with ``minipaged exercises --student DIR``, solve them and run the local
check (``pytest --nbval --nbval-current-env DIR/chNN_*.ipynb``); the instructor runs
``minipaged grade``.

Checked here:
* (fast, always) the README's first command installs no extra, and it names the chapter to
  open and the exercise commands; every module that the package, the chapter notebooks and
  the exercise notebooks import (outside ``try: ... except ImportError``) is installed by the
  package's *base* requirements, followed through their own requirements as installed here;
* (slow: a fresh venv with torch, transformers and JupyterLab takes minutes) in a fresh venv
  made by the README's ``pip install`` lines in a copy of this checkout's tracked files:
  ``minipaged exercises --student DIR`` writes one copy per authored notebook, the local check
  passes on a solved copy, ``minipaged grade`` gives the untouched copy 0 and the solved one
  full marks, chapter 00 runs headless (``jupyter nbconvert --execute``), ``jupyter lab
  --version`` answers.

The slow test runs where ``MINIPAGED_STUDENT_VENV`` names a folder built by
``python tests/test_student_path.py build DIR`` (``.ci/run`` builds it in the background while
it installs the course, so CI runs it once), or with ``MINIPAGED_STUDENT_PATH=1`` (it builds its
own); otherwise it is skipped with that reason. A failed build fails the test with the log.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# NOTE: `python tests/test_student_path.py build DIR` runs before any test dependency is
# installed (.ci/run starts it first), so pytest is optional at import time and only the
# test functions use it.
try:
    import pytest
except ImportError:
    pytest = None

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FIRST_CHAPTER = "notebooks/00_overview.ipynb"
# a student runs chapter 00 first; it is also the chapter the slow test executes headless
HEADLESS_CHAPTER = FIRST_CHAPTER
SOLVED_EXERCISE = "notebooks/exercises/ch00_overview.ipynb"


# -- the README's first command --------------------------------------------------------------


def readme_first_block(text: str) -> str:
    """The README's first ```bash block: the command a newcomer runs first."""
    m = re.search(r"```bash\n(.*?)```", text, re.S)
    if m is None:
        raise ValueError("README.md has no ```bash block: its first command is missing")
    return m.group(1)


def readme_pip_installs(text: str) -> list[list[str]]:
    """Each ``pip install ...`` of the README's first command, as argument lists, in order."""
    import shlex

    block = readme_first_block(text)
    commands = []
    for line in block.splitlines():
        line = line.split(" #", 1)[0]
        for part in line.split("&&"):
            words = shlex.split(part.strip())
            if words[:2] == ["pip", "install"]:
                commands.append(words[2:])
    if not commands:
        raise ValueError("the README's first command has no `pip install`")
    return commands


# -- building the student's venv --------------------------------------------------------------


def _copy_checkout(dest: Path) -> None:
    """This checkout's tracked files (what a clone holds), as they are in the working tree."""
    try:
        files = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        files = None
    if files is None:  # not a git checkout: everything but build outputs and venvs
        shutil.copytree(
            REPO,
            dest,
            ignore=shutil.ignore_patterns(".venv*", "__pycache__", "*.egg-info", ".git", "build"),
        )
        return
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def build_student_venv(root: Path) -> Path:
    """``root/src`` (a copy of the checkout) and ``root/venv``, installed by the README's way.

    Writes ``root/build.log`` and, when every step succeeded, ``root/ok`` (the seconds taken).
    pip's cache is used as it is (no ``--no-cache-dir``). Raises ``RuntimeError`` on a failure."""
    root = Path(root)
    start = time.monotonic()
    src, venv = root / "src", root / "venv"
    if src.exists() or venv.exists():
        raise ValueError(f"{root} already holds a student venv; give an empty folder")
    src.mkdir(parents=True)
    _copy_checkout(src)
    installs = readme_pip_installs((src / "README.md").read_text(encoding="utf-8"))
    log = open(root / "build.log", "w", encoding="utf-8")
    with log:
        steps = [[sys.executable, "-m", "venv", str(venv)]]
        steps += [[str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args] for args in installs]
        for cmd in steps:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            rc = subprocess.run(cmd, cwd=src, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {rc} (see {root / 'build.log'})")
    seconds = time.monotonic() - start
    (root / "ok").write_text(f"{seconds:.0f}\n")
    return venv


# -- fast checks (every run) --------------------------------------------------------------


def test_readme_first_command_is_the_student_install():
    text = README.read_text(encoding="utf-8")
    installs = readme_pip_installs(text)
    flat = [a for args in installs for a in args]
    assert "torch==2.13.0" in flat, f"the README's first command must pin a CPU torch first: {installs}"
    assert "torch==2.13.0" in installs[0], f"torch must be pinned first, before the package: {installs}"
    pkg = [a for a in flat if a in (".", "-e") or a.startswith((".[", "-e."))]
    assert pkg, f"the README's first command does not install this package: {installs}"
    assert not any("[" in a for a in flat), f"the README's first command must need no extra: {installs}"
    for needed in (
        f"jupyter lab {FIRST_CHAPTER}",
        "minipaged exercises --student",
        "minipaged grade",
        "--nbval",
    ):
        assert needed in text, f"README.md does not say `{needed}`"
    assert (REPO / FIRST_CHAPTER).is_file()


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_requirement_closure() -> tuple[set[str], set[str]]:
    """The distributions minipaged's base requirements pull in (no extras), as installed here,
    and the required ones that are not installed."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen, missing, todo = set(), set(), ["minipaged"]
    while todo:
        name = _canon(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        for r in reqs:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen - missing, missing


def _guarded(node: ast.AST, parents: dict) -> bool:
    """Whether an import sits in a ``try`` that catches ImportError (an optional import)."""
    while node in parents:
        node, child = parents[node], node
        if isinstance(node, ast.Try) and child in node.body:
            for h in node.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if h.type is None or any(
                    isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception")
                    for n in names
                ):
                    return True
    return False


def third_party_imports(source: str, where: str) -> dict[str, str]:
    """Top-level module -> where, for every unguarded absolute import outside the standard library."""
    tree = ast.parse(source, filename=where)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "minipaged" or _guarded(node, parents):
                continue
            out.setdefault(top, f"{where}:{node.lineno}")
    return out


def _course_imports() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted((REPO / "minipaged").rglob("*.py")):
        found.update(
            {k: v for k, v in third_party_imports(path.read_text(), str(path.relative_to(REPO))).items()}
        )
    notebooks = sorted((REPO / "notebooks").glob("*.ipynb")) + sorted(
        (REPO / "notebooks/exercises").glob("*.ipynb")
    )
    for path in notebooks:
        nb = json.loads(path.read_text(encoding="utf-8"))
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
            for k, v in third_party_imports(src, f"{path.relative_to(REPO)} cell {i}").items():
                found.setdefault(k, v)
    return found


def test_base_requirements_install_what_the_course_imports():
    from importlib import metadata

    closure, missing = base_requirement_closure()
    assert not missing, f"base requirements not installed here (reinstall the package): {sorted(missing)}"
    for tool in ("jupyterlab", "ipykernel", "nbformat", "nbclient", "nbval", "jupyter-client"):
        assert tool in closure, f"{tool} is not among the base requirements (pyproject.toml dependencies)"
    providers = metadata.packages_distributions()
    wrong = []
    for module, where in sorted(_course_imports().items()):
        dists = {_canon(d) for d in providers.get(module, [])}
        if not dists & closure:
            wrong.append(f"{module} (imported at {where}; from {sorted(dists) or 'nothing installed'})")
    assert not wrong, "imported, but not installed by the base requirements: " + "; ".join(wrong)


def test_import_scan_sees_guarded_and_unguarded_imports():
    src = "import numpy\ntry:\n    import uvloop\nexcept ImportError:\n    pass\nfrom os import path\nimport foo.bar\n"
    assert third_party_imports(src, "x.py") == {"numpy": "x.py:1", "foo": "x.py:7"}


# -- slow: the whole path in a fresh venv --------------------------------------------------


def _student_venv(tmp_path: Path) -> Path:
    prebuilt = os.environ.get("MINIPAGED_STUDENT_VENV")
    if prebuilt:
        root = Path(prebuilt)
        # NOTE: .ci/run builds it while the tests run; DIR/building is there until the build ends
        deadline = time.monotonic() + 1200
        while (root / "building").exists() and time.monotonic() < deadline:
            time.sleep(2)
        if not (root / "ok").is_file():
            log = (
                (root / "build.log").read_text()[-4000:]
                if (root / "build.log").is_file()
                else "(no build.log)"
            )
            pytest.fail(f"the student venv in {root} was not built: {log}")
        return root
    if os.environ.get("MINIPAGED_STUDENT_PATH") != "1":
        pytest.skip(
            "slow (a fresh venv install, minutes): set MINIPAGED_STUDENT_PATH=1, or "
            "MINIPAGED_STUDENT_VENV=DIR built by `python tests/test_student_path.py build DIR` (.ci/run does)"
        )
    build_student_venv(tmp_path / "student")
    return tmp_path / "student"


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_student_path_in_a_fresh_venv(tmp_path):
    root = _student_venv(tmp_path)
    src, bin_ = root / "src", root / "venv" / "bin"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUPYTER", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(root / "venv"))
    work = tmp_path / "student_home"
    work.mkdir()

    def ok(cmd, cwd=work, timeout=600):
        r = _run(cmd, cwd, env, timeout)
        assert r.returncode == 0, (
            f"`{' '.join(map(str, cmd))}` exit {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
        return r

    # the venv is the student's: minipaged and jupyter come from it, not from this test's env
    where = ok([str(bin_ / "python"), "-c", "import minipaged, nbformat; print(minipaged.__file__)"])
    assert Path(where.stdout.strip()).is_relative_to(src), where.stdout

    # jupyter lab is there
    lab = ok([str(bin_ / "jupyter"), "lab", "--version"])
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", lab.stdout.strip()), lab.stdout

    # the exercise copies, one per authored notebook, from any folder
    handout = work / "handout"
    ok([str(bin_ / "minipaged"), "exercises", "--student", str(handout)])
    authored = sorted(p.name for p in (src / "notebooks/exercises").glob("ch*.ipynb"))
    assert sorted(p.name for p in handout.glob("*.ipynb")) == authored

    # the local check: nbval passes on a solved copy (the authored solutions stand in for the student's)
    solved = work / "solved"
    solved.mkdir()
    shutil.copy(src / SOLVED_EXERCISE, solved / Path(SOLVED_EXERCISE).name)
    check = ok(
        [str(bin_ / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
         Path(SOLVED_EXERCISE).name],
        cwd=solved,
    )  # fmt: skip
    assert re.search(r"\b\d+ passed\b", check.stdout) and "failed" not in check.stdout, check.stdout

    # the instructor grades: the untouched copy scores 0, the solved one full marks
    untouched = handout / Path(SOLVED_EXERCISE).name
    csv = work / "scores.csv"
    ok([str(bin_ / "minipaged"), "grade", str(untouched), str(solved / untouched.name), "--csv", str(csv)])
    import csv as csv_mod

    rows = {Path(r["submission"]).parent.name: r for r in csv_mod.DictReader(csv.open())}
    assert rows["handout"]["score"] == "0", rows["handout"]
    assert rows["solved"]["score"] == rows["solved"]["max_score"] != "0", rows["solved"]

    # one chapter, headless, in the venv's own kernel
    out = work / "executed"
    ok([str(bin_ / "jupyter"), "nbconvert", "--to", "notebook", "--execute", "--output-dir", str(out),
        str(src / HEADLESS_CHAPTER)])  # fmt: skip
    nb = json.loads((out / Path(HEADLESS_CHAPTER).name).read_text(encoding="utf-8"))
    errors = [
        o
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if o["output_type"] == "error"
    ]
    assert not errors and any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        sys.exit("usage: python tests/test_student_path.py build DIR   (DIR: an empty folder)")
    t0 = time.monotonic()
    build_student_venv(Path(sys.argv[2]))
    print(f"student venv built in {time.monotonic() - t0:.0f} s: {sys.argv[2]}")
