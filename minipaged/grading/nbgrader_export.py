"""``minipaged exercises --nbgrader OUT``: the exercise notebooks as an nbgrader source assignment.

For classes on JupyterHub that grade with nbgrader (https://nbgrader.readthedocs.io):
``OUT`` becomes an nbgrader course directory holding ``source/<assignment>/chNN_*.ipynb``.

Inputs / outputs
    ``to_nbgrader(nb)`` -> a new notebook whose cells carry nbgrader's metadata
    (``metadata.nbgrader``, schema 3): solution cells are ``solution`` cells (our
    ``### BEGIN SOLUTION`` / ``### END SOLUTION`` markers are nbgrader's own), each check
    cell is an autograded test cell (``grade``, ``locked``, 1 point; it raises when the
    exercise is wrong, which is how nbgrader scores), and every other cell (intro, specs,
    setup) is read-only (``locked``). ``write_assignment(authored, out, assignment)``
    writes them; nbgrader's ``generate_assignment`` then makes the student release and
    ``autograde`` scores submissions.

Invariants
    one grade cell per exercise, worth 1 point, so nbgrader's total equals
    ``minipaged grade``'s score for an honest submission; grade ids are unique
    (``ex2_3_check``, ``ex2_3_solution``, ``ch02_cell_4``).

Failure mode
    an authored notebook that breaks the exercise invariants raises ``ValueError`` (from
    ``parse_authored``). nbgrader's own guarantees and limits apply to its grading (it runs
    the student's code in the same kernel as the tests, without this package's sandbox).
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat

from minipaged.checks.notebook import cell_exercise, cell_role

SCHEMA_VERSION = 3


def _meta(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    m = {
        "grade": grade,
        "grade_id": grade_id,
        "locked": locked,
        "schema_version": SCHEMA_VERSION,
        "solution": solution,
        "task": False,
    }
    if grade:
        m["points"] = points
    return m


def to_nbgrader(nb, chapter: str) -> nbformat.NotebookNode:
    """A copy of an authored exercise notebook with nbgrader cell metadata."""
    out = copy.deepcopy(nb)
    for i, cell in enumerate(out.cells):
        role, ex = cell_role(cell), cell_exercise(cell)
        slug = ex.replace(".", "_") if ex else None
        if role == "solution" and cell.cell_type == "code":
            meta = _meta(f"{slug}_solution", solution=True)
            cell.outputs = []
            cell.execution_count = None
        elif role == "check":
            meta = _meta(f"{slug}_check", grade=True, locked=True, points=1)
        else:
            meta = _meta(f"{chapter}_cell_{i}", locked=True)
        if (
            role == "solution"
            and sum(1 for c in out.cells if cell_role(c) == "solution" and cell_exercise(c) == ex) > 1
        ):
            meta["grade_id"] = f"{slug}_solution_{i}"
        cell.metadata["nbgrader"] = meta
        if meta["locked"]:
            cell.metadata["editable"] = False
            cell.metadata["deletable"] = False
        tags = [t for t in cell.metadata.get("tags", []) if t != "nbval-ignore-output"]
        if tags:
            cell.metadata["tags"] = tags
        elif "tags" in cell.metadata:
            del cell.metadata["tags"]
        if cell.cell_type == "code" and role != "solution":
            cell.execution_count = None
            for o in cell.get("outputs", []):
                if "execution_count" in o:
                    o["execution_count"] = None
    return out


def write_assignment(
    authored: dict, out, assignment: str = "minipaged", chapters=None, force: bool = False
) -> list[Path]:
    """Write ``out/source/<assignment>/<notebook>`` for each chapter; return the paths."""
    if not assignment or "/" in assignment or assignment.startswith("."):
        raise ValueError(f"assignment must be a plain folder name, got {assignment!r}")
    folder = Path(out) / "source" / assignment
    chapters = sorted(authored) if chapters is None else list(chapters)
    targets = [(authored[ch], folder / authored[ch].name) for ch in chapters]
    existing = [str(t) for _, t in targets if t.exists()]
    if existing and not force:
        raise FileExistsError(", ".join(existing))
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for a, target in targets:
        nbformat.write(to_nbgrader(a.nb, a.chapter), target)
        written.append(target)
    return written
