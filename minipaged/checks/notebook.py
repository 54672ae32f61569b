"""Exercise notebooks as data: find the cells of each exercise, make student copies.

Concept
    An exercise notebook marks its cells in cell metadata, so tools find them whatever
    the student does to the text::

        cell.metadata["minipaged"] = {"role": "spec" | "solution" | "check" | "setup",
                                      "exercise": "ex2.3"}       # no "exercise" for setup
        notebook.metadata["minipaged"] = {"chapter": "ch02"}

    A solution cell holds the authored solution between ``### BEGIN SOLUTION`` and
    ``### END SOLUTION`` lines; a check cell calls ``minipaged.checks.check`` and its
    stored output is the one line ``✅ ex2.3 passed``.

Inputs / outputs
    ``load_authored(directory)`` -> ``{chapter: AuthoredNotebook}`` (validated).
    ``stub_source(source)`` -> the source with every solution region replaced by
    ``raise NotImplementedError`` at the region's indentation (signatures kept).
    ``make_student_copy(nb)`` -> a new notebook: stubs in solution cells (outputs cleared,
    tagged ``nbval-ignore-output`` so a student's debug prints do not fail nbval), check
    cells with their stored ✅ outputs, so ``pytest --nbval`` passes exactly when every
    exercise is right. ``read_submission(path)`` -> notebook or ``MalformedNotebook``.
    ``identify_chapter(nb, path, known)`` -> chapter id or None.

Invariants
    a student copy contains no line of any solution region; every exercise of an authored
    notebook has exactly one check cell, at least one solution cell, and a stored output
    equal to its pass line.

Failure mode
    an authored notebook that breaks the invariants raises ``ValueError`` saying which
    cell (e.g. "not executed yet: run the generator"); an unreadable submission raises
    ``MalformedNotebook`` with a one-line reason.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import nbformat

from minipaged.checks._harness import pass_line
from minipaged.checks._spec import recorded_line

SOLUTION_BEGIN = "### BEGIN SOLUTION"
SOLUTION_END = "### END SOLUTION"
STUB_LINE = "raise NotImplementedError"
META_KEY = "minipaged"
NBVAL_IGNORE_OUTPUT = "nbval-ignore-output"
_CHAPTER_RE = re.compile(r"ch(\d\d)")


class MalformedNotebook(Exception):
    """A submission that is not a readable notebook; the message is one line for the table."""


def cell_meta(cell) -> dict:
    meta = cell.get("metadata", {}).get(META_KEY, {})
    return meta if isinstance(meta, dict) else {}


def cell_role(cell) -> Optional[str]:
    return cell_meta(cell).get("role")


def cell_exercise(cell) -> Optional[str]:
    ex = cell_meta(cell).get("exercise")
    return ex if isinstance(ex, str) else None


def cell_source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def default_authored_dir() -> Path:
    """``notebooks/exercises`` of the source checkout this package was installed from."""
    import minipaged

    return Path(minipaged.__file__).resolve().parent.parent / "notebooks" / "exercises"


# -- solution regions ------------------------------------------------------------------


def stub_source(source: str) -> str:
    """Replace each BEGIN/END SOLUTION region (markers included) by ``raise NotImplementedError``."""
    out, inside, n_regions = [], False, 0
    for lineno, line in enumerate(source.splitlines(keepends=True), start=1):
        stripped = line.strip()
        if stripped == SOLUTION_BEGIN:
            if inside:
                raise ValueError(f"line {lineno}: {SOLUTION_BEGIN} inside another solution region")
            inside = True
            n_regions += 1
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{STUB_LINE}\n")
        elif stripped == SOLUTION_END:
            if not inside:
                raise ValueError(f"line {lineno}: {SOLUTION_END} without {SOLUTION_BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{SOLUTION_BEGIN} without {SOLUTION_END}")
    if n_regions == 0:
        raise ValueError(f"no {SOLUTION_BEGIN} / {SOLUTION_END} region")
    return "".join(out)


# -- authored notebooks ------------------------------------------------------------------


@dataclass
class AuthoredNotebook:
    path: Path
    nb: nbformat.NotebookNode
    chapter: str
    exercises: list[str] = field(default_factory=list)  # in notebook order
    check_cells: dict = field(default_factory=dict)  # exercise id -> check cell

    @property
    def name(self) -> str:
        return self.path.name


def _stdout_text(cell) -> str:
    return "".join(
        cell_source({"source": o.get("text", "")})
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )


def parse_authored(
    nb, path: Path, require_outputs: bool = True, require_solutions: bool = True
) -> AuthoredNotebook:
    """Index and validate an authored exercise notebook (``require_solutions=False``: a
    student copy, whose solution cells hold stubs)."""
    chapter = nb.metadata.get(META_KEY, {}).get("chapter")
    if not isinstance(chapter, str) or not _CHAPTER_RE.fullmatch(chapter):
        raise ValueError(f"{path}: notebook metadata.minipaged.chapter must be like 'ch02', got {chapter!r}")
    a = AuthoredNotebook(path=Path(path), nb=nb, chapter=chapter)
    solutions: dict[str, int] = {}
    for i, cell in enumerate(nb.cells):
        role, ex = cell_role(cell), cell_exercise(cell)
        if role in ("solution", "check", "spec") and not ex:
            raise ValueError(f"{path}: cell {i} has role {role!r} but no exercise id")
        if role == "solution":
            if cell.cell_type != "code":
                raise ValueError(f"{path}: solution cell {i} ({ex}) is not a code cell")
            if require_solutions:
                try:
                    stub_source(cell_source(cell))
                except ValueError as e:
                    raise ValueError(f"{path}: solution cell {i} ({ex}): {e}") from None
            solutions[ex] = solutions.get(ex, 0) + 1
        elif role == "check":
            if ex in a.check_cells:
                raise ValueError(f"{path}: exercise {ex} has two check cells")
            if ex not in solutions:
                raise ValueError(f"{path}: check cell {i} ({ex}) comes before any solution cell of {ex}")
            # NOTE: a measuring check prints its figures first; the verdict is the last line
            if require_outputs and not (
                _stdout_text(cell).endswith(pass_line(ex) + "\n")
                or _stdout_text(cell).endswith(recorded_line(ex) + "\n")
            ):
                raise ValueError(
                    f"{path}: check cell {i} ({ex}) does not hold the output {pass_line(ex)!r}; "
                    "execute the authored notebook first (see notebooks/exercises/_build/)"
                )
            a.check_cells[ex] = cell
            a.exercises.append(ex)
    missing = set(solutions) - set(a.check_cells)
    if missing:
        raise ValueError(f"{path}: exercises without a check cell: {sorted(missing)}")
    if not a.exercises:
        raise ValueError(f"{path}: no exercises (cells with metadata.minipaged.role == 'check')")
    return a


def load_authored(
    directory: Optional[Path] = None, require_outputs: bool = True
) -> dict[str, AuthoredNotebook]:
    """Every authored exercise notebook in ``directory``, keyed by chapter."""
    directory = Path(directory) if directory is not None else default_authored_dir()
    if not directory.is_dir():
        raise ValueError(
            f"authored exercise notebooks not found in {directory}; pass --source DIR "
            "(the notebooks/exercises folder of a minipaged checkout)"
        )
    out: dict[str, AuthoredNotebook] = {}
    for path in sorted(directory.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if META_KEY not in nb.metadata:
            continue
        a = parse_authored(nb, path, require_outputs=require_outputs)
        if a.chapter in out:
            raise ValueError(f"two authored notebooks for {a.chapter}: {out[a.chapter].path} and {path}")
        out[a.chapter] = a
    if not out:
        raise ValueError(f"no exercise notebooks (with metadata.minipaged) in {directory}")
    return out


# -- student copies ----------------------------------------------------------------------


def _literal(data):
    """Plain data (lists from JSON) as the Python literal a setup cell holds (tuples inside)."""
    if isinstance(data, list) and data and all(isinstance(x, list) for x in data):
        return "[" + ", ".join(repr(tuple(x)) for x in data) + "]"
    return repr(data)


def apply_variants(nb, seed) -> None:
    """Write the workloads ``seed`` draws into the setup cell and the spec's table (in place),
    for each prediction exercise of the chapter that has per-student variants."""
    import importlib

    from minipaged.checks import get_spec
    from minipaged.checks._spec import make_cases

    chapter = nb.metadata.get(META_KEY, {}).get("chapter")
    module = importlib.import_module(f"minipaged.checks.{chapter}")
    _apply_question_variants(nb, module, seed)
    variants = getattr(module, "VARIANTS", {})
    for ex, variant in variants.items():
        # (name, event_text): a two-column "| event | what happens |" table; (name, row_text,
        # header): a table of that header (its two first lines), one row_text(item) per item
        name, event_text = variant[0], variant[1]
        header = variant[2] if len(variant) > 2 else None
        events = make_cases(get_spec(ex), None, student_seed=seed)[0]
        line_re = re.compile(rf"^{name} = .*$", re.M)
        for cell in nb.cells:
            src = cell_source(cell)
            if cell.cell_type == "code" and cell_role(cell) == "setup" and line_re.search(src):
                cell.source = line_re.sub(lambda m: f"{name} = {_literal(events)}", src)
            elif cell.cell_type == "markdown" and cell_role(cell) == "spec" and cell_exercise(cell) == ex:
                if header is None:
                    rows = "\n".join(f"| {k} | {event_text(tuple(e))} |" for k, e in enumerate(events))
                    table = r"(\| event \| what happens \|\n\|---\|---\|\n)(\|.*\|\n?)+"
                else:
                    rows = "\n".join(event_text(tuple(e)) for e in events)
                    table = "(" + re.escape(header + "\n") + r")(\|.*\|\n?)+"
                cell.source = re.sub(table, lambda m: m.group(1) + rows + "\n", src)


def _apply_question_variants(nb, module, seed) -> None:
    """In each concept exercise's spec cell, the student's variant of each question (the
    bullet ``- `qN`: ...``) in place of the shipped one (variant 0, left as written)."""
    from minipaged.checks._harness import question_variants
    from minipaged.checks._spec import make_cases

    for ex, spec in getattr(module, "SPECS", {}).items():
        if spec.kind != "secret" or not getattr(spec.cases, "per_student", False):
            continue
        drawn = make_cases(spec, None, student_seed=seed)[0]
        texts = question_variants(module.QUESTIONS)
        for cell in nb.cells:
            if cell.cell_type != "markdown" or cell_role(cell) != "spec" or cell_exercise(cell) != ex:
                continue
            src = cell_source(cell)
            for qid, k in drawn.items():
                if k == 0:
                    continue
                item = re.compile(rf"^- `{re.escape(qid)}`: .*?(?=\n- `|\n\n|\Z)", re.M | re.S)
                if not item.search(src):
                    raise ValueError(f"{ex}: the spec cell has no bullet for {qid}")
                src = item.sub(lambda m: f"- `{qid}`: {texts[qid][k][0]}", src, count=1)
            cell.source = src


def make_student_copy(nb, seed=None) -> nbformat.NotebookNode:
    """The notebook a student gets: stubs for solutions, check cells with their ✅ outputs.
    ``seed`` (an int or a string, e.g. the student's id): that student's variant, recorded in
    the metadata; the grader draws that student's graded cases and workloads from it."""
    out = copy.deepcopy(nb)
    out.metadata[META_KEY] = dict(out.metadata.get(META_KEY, {}), copy="student")
    if seed is not None:
        out.metadata[META_KEY]["seed"] = seed
        apply_variants(out, seed)
    for cell in out.cells:
        if cell.cell_type != "code":
            continue
        role = cell_role(cell)
        if role == "solution":
            cell.source = stub_source(cell_source(cell))
            cell.outputs = []
            cell.execution_count = None
            tags = list(cell.metadata.get("tags", []))
            if NBVAL_IGNORE_OUTPUT not in tags:
                tags.append(NBVAL_IGNORE_OUTPUT)
            cell.metadata["tags"] = tags
        elif role != "check":
            # setup and other cells keep their outputs (nbval compares them; they are
            # deterministic), but no execution counts that would hint at a run order.
            cell.execution_count = None
            for o in cell.get("outputs", []):
                if "execution_count" in o:
                    o["execution_count"] = None
    for cell in out.cells:
        if SOLUTION_BEGIN in cell_source(cell) or SOLUTION_END in cell_source(cell):
            raise ValueError("a solution marker outside a solution cell would leak into the student copy")
    return out


# -- submissions -------------------------------------------------------------------------


def read_submission(path) -> nbformat.NotebookNode:
    """Read a student's notebook, or raise ``MalformedNotebook`` with a one-line reason."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MalformedNotebook("file not found") from None
    except IsADirectoryError:
        raise MalformedNotebook("is a directory, not a notebook file") from None
    except UnicodeDecodeError:
        raise MalformedNotebook("not a notebook: the file is not UTF-8 text") from None
    except OSError as e:
        raise MalformedNotebook(f"cannot read the file: {e.strerror or e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedNotebook(
            f"not a notebook: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        raise MalformedNotebook("not a notebook: no list of cells")
    if raw.get("nbformat") != 4:
        raise MalformedNotebook(f"not a version-4 notebook (nbformat={raw.get('nbformat')!r})")
    for i, cell in enumerate(raw["cells"]):
        if not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown", "raw"):
            raise MalformedNotebook(f"not a notebook: cell {i} has no valid cell_type")
        src = cell.get("source", "")
        if not isinstance(src, str) and not (isinstance(src, list) and all(isinstance(s, str) for s in src)):
            raise MalformedNotebook(f"not a notebook: cell {i} has no text source")
        if not isinstance(cell.get("metadata", {}), dict):
            raise MalformedNotebook(f"not a notebook: cell {i} has bad metadata")
    raw.setdefault("metadata", {})
    if not isinstance(raw["metadata"], dict):
        raw["metadata"] = {}
    return nbformat.from_dict(raw)


def identify_chapter(nb, path, known) -> Optional[str]:
    """Which chapter a submission belongs to: notebook metadata, then its cells' exercise
    ids, then a ``chNN`` in the file name. ``known``: the chapters that have exercises."""
    meta = nb.get("metadata", {}).get(META_KEY, {})
    ch = meta.get("chapter") if isinstance(meta, dict) else None
    if ch in known:
        return ch
    votes: dict[str, int] = {}
    for cell in nb.cells:
        ex = cell_exercise(cell)
        m = re.fullmatch(r"ex(\d+)\.\d+", ex or "")
        if m:
            c = f"ch{int(m.group(1)):02d}"
            votes[c] = votes.get(c, 0) + 1
    if votes:
        best = max(votes, key=votes.get)
        if best in known:
            return best
    m = _CHAPTER_RE.search(Path(path).name)
    if m and f"ch{m.group(1)}" in known:
        return f"ch{m.group(1)}"
    return None
