"""``minipaged grade --gradescope OUT.zip``: the grader as a Gradescope autograder.

Concept
    Gradescope (https://gradescope-autograders.readthedocs.io/en/latest/specs/) builds one
    Docker image per assignment from a zip holding ``setup.sh`` (run once, at build time) and
    ``run_autograder`` (run once per submission, as root, in ``/autograder``), then grades
    each student's upload in its own container: a class of hundreds grades on Gradescope's
    workers instead of one machine's ``--jobs``. The zip holds:

    * ``setup.sh``: Ubuntu's python3, bubblewrap and util-linux from apt; a virtual
      environment ``/opt/minipaged-venv`` with the CPU build of the torch this grader runs,
      the course package (``package/``, a copy of the installed one) and the kernel
      libraries at the versions installed here; then each chapter's student build;
    * ``run_autograder``: ``python -m minipaged.grading.gradescope``, which grades the
      notebooks in ``/autograder/submission`` with the same ``grade_many`` as ``minipaged
      grade`` (sandbox, trusted checker, scan, copy detection against the package and the
      authored solutions) and writes ``/autograder/results/results.json``: one test per
      exercise (score 0 or 1, max_score 1, the grader's one-line reason as its output);
    * ``config.json`` (chapters, limits, visibility), ``exercises/`` (the authored notebooks
      of those chapters and ``_instructor/key.json``), and ``secret`` when the instructor
      gives one: the student's seed is then ``HMAC(secret, id)`` of the Gradescope user
      (``users[0]`` of ``/autograder/submission_metadata.json``; ``id`` or ``email``).

Inputs / outputs
    ``write_autograder(out, authored, chapters, key_path, secret=, ...)`` -> the zip's path;
    ``run_autograder(root)`` -> the results dict (also written to ``root/results/results.json``);
    ``python -m minipaged.grading.gradescope [--root DIR]`` is ``run_autograder``, the root
    defaulting to ``$MINIPAGED_GRADESCOPE_ROOT`` or ``/autograder``.

Invariants
    results.json has one test per exercise of the configured chapters, in authored order,
    whatever was uploaded (a missing or unreadable notebook scores 0 with a reason), and its
    ``score`` is the sum of the tests' scores. Before grading, ``source/`` (solutions, key,
    secret) is made readable by root only, so a kernel of the sandbox user cannot read it
    even where bubblewrap cannot start.

Failure mode
    a chapter without authored notebook, an unreadable key, a bad output folder ->
    ``ValueError`` naming it, before anything is written. At grading time, a bad upload gives
    zeros with the reason in each test's output; a broken autograder (bad config.json)
    raises, so Gradescope reports the autograder as failed rather than giving a zero.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import zipfile
from pathlib import Path
from typing import Optional

ROOT_ENV = "MINIPAGED_GRADESCOPE_ROOT"  # where Gradescope's /autograder is (tests point it elsewhere)
PYTHON_ENV = "MINIPAGED_GRADESCOPE_PYTHON"  # the python run_autograder uses (default: setup.sh's venv)
VENV = "/opt/minipaged-venv"
BUILD_CACHE = "/opt/minipaged-build-cache"  # the student builds, made by setup.sh
ID_FIELDS = ("id", "email")  # which field of Gradescope's users[0] is the student id
VISIBILITIES = ("hidden", "after_due_date", "after_published", "visible")
# the kernel side of grading (minipaged.grading.executor) talks to these; pinned to this grader's
KERNEL_PACKAGES = ("ipykernel", "jupyter_client", "nbformat")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same inputs give the same zip

SETUP_SH = """#!/usr/bin/env bash
# Gradescope autograder setup (run once when Gradescope builds the image), written by
# `minipaged grade --gradescope` for minipaged {version}: Ubuntu's python3 (3.10+), bubblewrap
# for the sandbox, a virtual environment with the CPU build of torch {torch}, the course
# package and the kernel libraries at the grader's versions, then each chapter's student build.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends python3 python3-venv python3-pip bubblewrap util-linux
python3 -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] < (3, 13) else 1)' || {{
    echo "minipaged needs Python 3.10 to 3.12; choose an Ubuntu 22.04 base image" >&2
    exit 1
}}
python3 -m venv {venv}
PIP="{venv}/bin/python -m pip"
$PIP install --upgrade pip
$PIP install "torch=={torch}" --index-url https://download.pytorch.org/whl/cpu
$PIP install /autograder/source/package {kernel_pins}
export MINIPAGED_BUILD_CACHE={cache}
{venv}/bin/python -m minipaged.grading.gradescope --prepare --root /autograder
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this once per submission, as root, in /autograder (written by
# `minipaged grade --gradescope`): grade /autograder/submission, write
# /autograder/results/results.json. ${root_env} and ${python_env} point it elsewhere (tests).
set -euo pipefail
ROOT="${{{root_env}:-/autograder}}"
PYTHON="${{{python_env}:-{venv}/bin/python}}"
export MINIPAGED_BUILD_CACHE="${{MINIPAGED_BUILD_CACHE:-{cache}}}"
cd "$ROOT"
exec "$PYTHON" -m minipaged.grading.gradescope --root "$ROOT"
"""


# -- building the zip --------------------------------------------------------------------


def _dist_requirements() -> tuple[str, str, list[str]]:
    """(version, requires-python, dependencies without extras) of the installed minipaged."""
    from importlib import metadata

    dist = metadata.distribution("minipaged")
    reqs = [r for r in (dist.requires or []) if "extra ==" not in r.replace('"', "").replace("'", "")]
    return dist.version, dist.metadata.get("Requires-Python") or ">=3.10", reqs


def _pyproject(version: str, python: str, deps: list[str]) -> str:
    dep_lines = "".join(f"    {json.dumps(d)},\n" for d in deps)
    return (
        "# the course package as the grader had it installed (minipaged grade --gradescope)\n"
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "minipaged"\nversion = {json.dumps(version)}\n'
        f"requires-python = {json.dumps(python)}\ndependencies = [\n{dep_lines}]\n\n"
        '[project.scripts]\nminipaged = "minipaged.cli:main"\n\n'
        '[tool.setuptools.packages.find]\ninclude = ["minipaged*"]\n\n'
        '[tool.setuptools.package-data]\nminipaged = ["**/*"]\n'
    )


def _package_files(pkg: Path):
    skip_dirs = {"__pycache__", ".ipynb_checkpoints"}
    for p in sorted(pkg.rglob("*")):
        rel = p.relative_to(pkg)
        if p.is_dir() or skip_dirs & set(rel.parts) or p.suffix in (".pyc", ".so", ".o"):
            continue
        if any(part.endswith(".egg-info") for part in rel.parts):
            continue
        yield p, rel


def _versions(names) -> dict:
    from importlib import metadata

    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            raise ValueError(f"--gradescope: {n} is not installed here; the grader needs it") from None
    return out


def torch_version() -> str:
    """The installed torch's release (``2.13.0`` of ``2.13.0+cpu``): setup.sh pins it."""
    from importlib import metadata

    return metadata.version("torch").split("+")[0]


def _add(z: zipfile.ZipFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = zipfile.ZipInfo(name, _ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o100000 | mode) << 16  # a regular file with these permission bits
    z.writestr(info, data)


def write_autograder(
    out,
    authored: dict,
    chapters: list,
    key_path,
    secret: Optional[bytes] = None,
    id_field: str = "id",
    timeout: float = 60.0,
    budget: float = 600.0,
    memory_mib: Optional[int] = None,
    sandbox: bool = True,
    copy_detection: bool = True,
    seed: Optional[str] = None,
    visibility: str = "visible",
) -> Path:
    """Write the Gradescope autograder zip for ``chapters`` to ``out``; return its path."""
    from minipaged.grading.student_build import _package_dir
    from minipaged.grading.trusted import load_key

    out = Path(out)
    if not out.parent.is_dir():
        raise ValueError(f"--gradescope {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise ValueError(f"--gradescope {out} is a folder, not a file")
    if not chapters:
        raise ValueError("--gradescope: no chapters to grade")
    missing = [ch for ch in chapters if ch not in authored]
    if missing:
        raise ValueError(f"--gradescope: no authored notebook for {', '.join(missing)}")
    if id_field not in ID_FIELDS:
        raise ValueError(f"--gradescope-id must be one of {', '.join(ID_FIELDS)}, got {id_field!r}")
    if visibility not in VISIBILITIES:
        raise ValueError(f"visibility must be one of {', '.join(VISIBILITIES)}, got {visibility!r}")
    if not key_path:
        raise ValueError("--gradescope: no answer key; pass --key FILE")
    load_key(key_path)  # ValueError when unreadable
    version, python, deps = _dist_requirements()
    torch = torch_version()
    pins = _versions(KERNEL_PACKAGES)
    config = {
        "format": 1,
        "minipaged": version,
        "chapters": list(chapters),
        "notebooks": {ch: authored[ch].name for ch in chapters},
        "exercises": {ch: list(authored[ch].exercises) for ch in chapters},
        "timeout": float(timeout),
        "budget": float(budget),
        "memory_mib": memory_mib,
        "sandbox": bool(sandbox),
        "copy_detection": bool(copy_detection),
        "seed": seed,
        "per_student_seeds": secret is not None,
        "student_id": id_field,
        "visibility": visibility,
    }
    setup = SETUP_SH.format(
        version=version,
        torch=torch,
        venv=VENV,
        cache=BUILD_CACHE,
        kernel_pins=" ".join(shlex.quote(f"{n}=={v}") for n, v in pins.items()),
    )
    run = RUN_AUTOGRADER.format(root_env=ROOT_ENV, python_env=PYTHON_ENV, venv=VENV, cache=BUILD_CACHE)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w") as z:
            _add(z, "setup.sh", setup.encode(), 0o755)
            _add(z, "run_autograder", run.encode(), 0o755)
            _add(z, "config.json", (json.dumps(config, indent=2) + "\n").encode())
            for ch in chapters:
                _add(z, f"exercises/{authored[ch].name}", Path(authored[ch].path).read_bytes())
            _add(z, "exercises/_instructor/key.json", Path(key_path).read_bytes(), 0o600)
            if secret is not None:
                _add(z, "secret", bytes(secret), 0o600)
            _add(z, "package/pyproject.toml", _pyproject(version, python, deps).encode())
            for p, rel in _package_files(_package_dir()):
                _add(z, f"package/minipaged/{rel.as_posix()}", p.read_bytes())
        os.chmod(tmp, 0o600)  # it holds the solutions, the key and the secret
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


# -- grading one Gradescope submission ---------------------------------------------------


def _notebooks(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.rglob("*.ipynb")
        if p.is_file()
        and not any(part.startswith(".") or part == "__MACOSX" for part in p.relative_to(folder).parts)
    )


def _chapter_of(path: Path, chapters: list) -> Optional[str]:
    from minipaged.checks.notebook import MalformedNotebook, identify_chapter, read_submission

    try:
        nb = read_submission(path)
    except MalformedNotebook:
        import re

        m = re.search(r"ch(\d\d)", path.name)
        return f"ch{m.group(1)}" if m and f"ch{m.group(1)}" in chapters else None
    return identify_chapter(nb, path, set(chapters))


def choose_notebooks(submission: Path, config: dict) -> tuple[dict, list]:
    """``({chapter: notebook path}, notes)``: which uploaded notebook is graded as which chapter.
    With one chapter and one notebook, that notebook (whatever its name); else by the chapter
    the notebook's metadata, exercise ids or name tell; of two for one chapter, the one named
    as the authored notebook, else the first by name."""
    chapters = config["chapters"]
    found = _notebooks(submission)
    notes = []
    if len(chapters) == 1 and len(found) == 1:
        return {chapters[0]: found[0]}, notes
    by_chapter: dict = {}
    for p in found:
        ch = _chapter_of(p, chapters)
        if ch is None:
            notes.append(f"{p.relative_to(submission)}: not a notebook of {', '.join(chapters)}; not graded")
        else:
            by_chapter.setdefault(ch, []).append(p)
    chosen = {}
    for ch, paths in by_chapter.items():
        named = [p for p in paths if p.name == config["notebooks"][ch]]
        chosen[ch] = (named or paths)[0]
        for p in paths:
            if p != chosen[ch]:
                notes.append(
                    f"{p.relative_to(submission)}: another notebook of {ch}; "
                    f"{chosen[ch].relative_to(submission)} was graded"
                )
    return chosen, notes


def student_id(metadata_path: Path, field: str) -> tuple[Optional[str], str]:
    """(the student id from Gradescope's submission metadata, a note or "")."""
    try:
        meta = json.loads(metadata_path.read_text(encoding="utf-8"))
        users = meta["users"]
        sid = users[0][field]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return None, f"cannot read users[0].{field} from {metadata_path.name} ({type(e).__name__}: {e})"
    if sid is None or not str(sid).strip():
        return None, f"users[0].{field} in {metadata_path.name} is empty"
    note = ""
    if len(users) > 1:
        note = f"a group submission of {len(users)}: graded with the variants of its first member"
    return str(sid).strip(), note


def _test(ex: str, passed: bool, output: str, visibility: str) -> dict:
    from minipaged.checks import get_spec

    try:
        title = get_spec(ex).title
    except Exception:  # noqa: BLE001 - a name is only a label
        title = ""
    return {
        "name": f"{ex} {title}".strip(),
        "number": ex.removeprefix("ex"),
        "score": 1.0 if passed else 0.0,
        "max_score": 1.0,
        "output": output,
        "visibility": visibility,
    }


def _load_config(source: Path) -> dict:
    path = source / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RuntimeError(f"the autograder is broken: cannot read {path} ({e})") from None
    for k in ("chapters", "notebooks", "exercises", "timeout", "budget", "student_id", "visibility"):
        if k not in config:
            raise RuntimeError(f"the autograder is broken: {path} has no {k!r}")
    if config["visibility"] not in VISIBILITIES or config["student_id"] not in ID_FIELDS:
        raise RuntimeError(f"the autograder is broken: bad visibility or student_id in {path}")
    return config


def _write_results(results_dir: Path, results: dict) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    tmp = results_dir / ".results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, results_dir / "results.json")


def run_autograder(root=None) -> dict:
    """Grade ``root/submission`` as Gradescope's ``run_autograder``; write and return results.json."""
    from minipaged.checks.notebook import load_authored
    from minipaged.grading import roster
    from minipaged.grading.grade import detect_copies, grade_many, new_seed
    from minipaged.grading.sandbox import Limits, probe

    t0 = time.monotonic()
    root = Path(root or os.environ.get(ROOT_ENV) or "/autograder")
    source = root / "source"
    config = _load_config(source)
    if os.geteuid() == 0:
        os.chmod(source, 0o700)  # the solutions, key and secret: not for the sandbox user
    exercises_dir = source / "exercises"
    authored = load_authored(exercises_dir)
    key_path = exercises_dir / "_instructor" / "key.json"
    visibility = config["visibility"]
    notes: list[str] = []
    chosen, more = choose_notebooks(root / "submission", config)
    notes += more
    student_seeds = None
    whose = ""
    if config.get("per_student_seeds"):
        secret = roster.load_secret(source / "secret")
        sid, note = student_id(root / "submission_metadata.json", config["student_id"])
        if note:
            notes.append(note)
        if sid is not None:
            whose = f"{config['student_id']} {sid}"
        student_seeds = {
            str(p): (None if sid is None else roster.student_seed(secret, sid)) for p in chosen.values()
        }
    limits = Limits()
    if config.get("memory_mib"):
        limits.memory_bytes = int(config["memory_mib"]) * 2**20
    isolation = probe(limits=limits, use_bwrap=config.get("sandbox", True))
    print(isolation.describe(), flush=True)
    seed = config.get("seed") or new_seed()
    print(f"graded cases drawn from seed {seed}" + (f"; student {whose}" if whose else ""), flush=True)
    graded = {}
    if chosen:
        paths = [str(chosen[ch]) for ch in config["chapters"] if ch in chosen]
        rs = grade_many(
            paths,
            authored,
            timeout=float(config["timeout"]),
            chapter=config["chapters"][0] if len(config["chapters"]) == 1 else None,
            jobs=1,
            budget=float(config["budget"]),
            isolation=isolation,
            key_path=str(key_path),
            seed=seed,
            student_seeds=student_seeds,
        )
        graded = dict(zip([ch for ch in config["chapters"] if ch in chosen], rs))
    copies: list[str] = []
    if graded and config.get("copy_detection", True):
        try:
            detect_copies(list(graded.values()), authored)
            copies = [f"{Path(r.submission).name}: {c}" for r in graded.values() for c in r.copies or []]
        except Exception as e:  # noqa: BLE001 - a flag for a human; never costs the grades
            print(f"copy detection failed: {type(e).__name__}: {e}", flush=True)
    tests, summary, flags = [], [], []
    for ch in config["chapters"]:
        r = graded.get(ch)
        if r is None:
            why = f"no notebook of chapter {ch} in the submission (upload your {config['notebooks'][ch]})"
            tests += [_test(ex, False, why, visibility) for ex in config["exercises"][ch]]
            summary.append(f"{ch}: {why}")
            continue
        name = Path(r.submission).name
        for ex in config["exercises"][ch]:
            res = r.exercises.get(ex)
            if res is None:
                tests.append(_test(ex, False, r.error or "not graded", visibility))
            else:
                tests.append(_test(ex, res.passed, "passed" if res.passed else res.reason, visibility))
        summary.append(f"{ch} ({name}): {r.score}/{len(config['exercises'][ch])}")
        if r.error:
            summary.append(f"{name}: {r.error}")
        flags += [f"{name}: {f}" for f in r.flags]
    results = {
        "score": float(sum(t["score"] for t in tests)),
        "execution_time": int(round(time.monotonic() - t0)),
        "output": "\n".join(summary + notes),
        "visibility": visibility,
        "stdout_visibility": "hidden",
        "tests": tests,
        "extra_data": {"seed": seed, "student": whose, "flags": flags, "copies": copies},
    }
    for line in flags:
        print(f"note: {line}")
    for line in copies:
        print(f"copy? {line}")
    print("\n".join(summary + notes))
    _write_results(root / "results", results)
    return results


def from_args(args, authored: dict, key_path) -> int:
    """``minipaged grade --gradescope OUT.zip``: write the zip from the command's options."""
    from minipaged.grading import roster

    if args.submissions or args.roster or args.nbgrader_layout:
        raise ValueError(
            "--gradescope writes an autograder and grades nothing here; Gradescope tells whose "
            "each submission is (drop the SUBMISSION, --roster and --nbgrader-layout arguments)"
        )
    secret = None
    if args.secret or os.environ.get(roster.SECRET_ENV, "").strip():
        secret = roster.load_secret(args.secret)
    chapters = [args.chapter] if args.chapter else sorted(authored)
    out = write_autograder(
        args.gradescope,
        authored,
        chapters,
        key_path,
        secret=secret,
        id_field=args.gradescope_id,
        timeout=args.timeout,
        budget=args.budget,
        memory_mib=args.memory,
        sandbox=not args.no_sandbox,
        copy_detection=not args.no_copy_detection,
        seed=args.seed,
    )
    n = sum(len(authored[ch].exercises) for ch in chapters)
    print(f"wrote {out}: a Gradescope autograder for {', '.join(chapters)} ({n} tests, 1 point each)")
    if secret is None:
        print(
            "no instructor secret (--secret FILE or $MINIPAGED_GRADING_SECRET): every student is "
            "graded on the shipped variants"
        )
    else:
        print(
            f"per-student seeds: HMAC(secret, the Gradescope user's {args.gradescope_id}); hand out "
            f"copies made with `minipaged exercises --student OUT --roster FILE` on those ids"
        )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minipaged.grading.gradescope", description="Gradescope's run_autograder"
    )
    p.add_argument("--root", help=f"Gradescope's /autograder (default ${ROOT_ENV} or /autograder)")
    p.add_argument(
        "--prepare",
        action="store_true",
        help="setup.sh's step: make each configured chapter's student build (cached for every submission)",
    )
    args = p.parse_args(argv)
    if args.prepare:
        from minipaged.grading.student_build import student_build

        root = Path(args.root or os.environ.get(ROOT_ENV) or "/autograder")
        for ch in _load_config(root / "source")["chapters"]:
            print(f"student build of {ch}: {student_build(ch)}")
        return 0
    results = run_autograder(args.root)
    print(f"score {results['score']:g}/{sum(t['max_score'] for t in results['tests']):g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
