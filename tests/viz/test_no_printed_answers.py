"""No chapter prints the code an exercise asks a student to write.

A chapter's stored outputs (what a student sees without running anything) must not
contain the body of a package function named in ``minipaged.viz.source.EXERCISE_BODIES``,
nor the reference solution of any exercise notebook (its ``### BEGIN SOLUTION`` block).
"Contain" means: some run of consecutive significant lines (stripped; blank lines, bare
comments and lines under 8 characters ignored) appears, in order, in one output. The run
is three lines, or the whole body if it is shorter. The instructor's appendix
(``notebooks/99_instructor_appendix.ipynb``) is the one notebook allowed to print them.
A chapter's stored output also never shows ``inf`` or ``nan`` as a number.
"""

import glob
import json
import os
import re

import pytest

from minipaged.viz.source import EXERCISE_BODIES, body, contract, resolve, source

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAPTERS = sorted(glob.glob(os.path.join(REPO, "notebooks", "0[0-9]_*.ipynb")))
EXERCISES = sorted(glob.glob(os.path.join(REPO, "notebooks", "exercises", "ch*.ipynb")))
WINDOW = 3


def significant(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        s = " ".join(line.split())
        if len(s) < 8 or s.startswith("#"):
            continue
        out.append(s)
    return out


def windows(text: str) -> set[tuple[str, ...]]:
    lines = significant(text)
    n = min(WINDOW, len(lines))
    return {tuple(lines[i : i + n]) for i in range(len(lines) - n + 1)} if n else set()


def contains(haystack: str, needle: str) -> bool:
    """True if a run of ``needle``'s significant lines appears consecutively in ``haystack``."""
    lines = significant(haystack)
    for w in windows(needle):
        n = len(w)
        if any(tuple(lines[i : i + n]) == w for i in range(len(lines) - n + 1)):
            return True
    return False


def stored_outputs(path: str) -> list[tuple[int, str]]:
    nb = json.load(open(path))
    outs = []
    for i, cell in enumerate(nb["cells"]):
        for o in cell.get("outputs", []):
            text = o.get("text") or o.get("data", {}).get("text/plain") or ""
            outs.append((i, "".join(text) if isinstance(text, list) else text))
    return outs


def solution_blocks() -> dict[str, str]:
    blocks = {}
    for path in EXERCISES:
        for i, cell in enumerate(json.load(open(path))["cells"]):
            src = "".join(cell["source"])
            if "### BEGIN SOLUTION" in src and "### END SOLUTION" in src:
                sol = src.split("### BEGIN SOLUTION", 1)[1].split("### END SOLUTION", 1)[0]
                blocks[f"{os.path.basename(path)} cell {i}"] = sol
    return blocks


def test_there_is_something_to_check():
    assert len(CHAPTERS) >= 10, CHAPTERS
    assert len(solution_blocks()) >= 20, "the exercise notebooks' solution blocks were not found"


@pytest.mark.parametrize("exercise", sorted(EXERCISE_BODIES))
def test_detector_sees_a_printed_body_and_not_a_contract(exercise):
    for path in EXERCISE_BODIES[exercise]:
        fn = resolve(path)
        assert significant(body(fn)), f"{path}: empty body"
        assert contains(source(fn), body(fn)), f"{path}: the detector misses the printed source"
        assert not contains(contract(fn), body(fn)), f"{path}: its contract shows its body"


@pytest.mark.parametrize("chapter", [os.path.basename(p) for p in CHAPTERS])
def test_chapter_prints_no_exercise_body(chapter):
    outs = stored_outputs(os.path.join(REPO, "notebooks", chapter))
    bodies = {f"{ex} ({p})": body(resolve(p)) for ex, ps in EXERCISE_BODIES.items() for p in ps}
    bodies.update({f"solution of {k}": v for k, v in solution_blocks().items()})
    found = [
        f"cell {i} prints the body of {name}"
        for i, text in outs
        for name, b in bodies.items()
        if contains(text, b)
    ]
    assert not found, f"{chapter}: " + "; ".join(found)


INF_NAN = re.compile(r"(?<![A-Za-z_\"'])(inf|nan|infx)(?![A-Za-z_\"'(])")


@pytest.mark.parametrize("chapter", [os.path.basename(p) for p in CHAPTERS])
def test_chapter_prints_no_inf_or_nan(chapter):
    # a number a student reads is never inf or nan: a chapter says what it means instead
    found = [
        f"cell {i}: ...{text[max(0, m.start() - 40) : m.end() + 10]!r}..."
        for i, text in stored_outputs(os.path.join(REPO, "notebooks", chapter))
        for m in INF_NAN.finditer(text)
    ]
    assert not found, f"{chapter} prints inf or nan: " + "; ".join(found)
