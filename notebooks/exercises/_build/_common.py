"""Shared builder for the exercise notebooks (used by the chNN_*.py generators here).

Each generator describes its notebook as an intro, a setup cell and a list of exercises
(spec markdown, solution code with ``### BEGIN SOLUTION`` / ``### END SOLUTION``, the
student objects the check gets); ``ExerciseNotebook.build()`` writes the notebook with
the cell metadata the tools read (see ``minipaged/checks/notebook.py``) and executes it
in place, so the check cells hold their ``✅`` outputs.

Run a generator from the repository root, e.g.::

    python notebooks/exercises/_build/ch02_block_tables.py
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE.parent


def _md(text: str, cell_id: str, **meta) -> nbformat.NotebookNode:
    # NOTE: fixed cell ids (nbformat makes random ones), so a rebuild changes no line
    cell = nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip("\n"), id=cell_id)
    if meta:
        cell.metadata["minipaged"] = meta
    return cell


def _code(src: str, cell_id: str, **meta) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(textwrap.dedent(src).strip("\n"), id=cell_id)
    if meta:
        cell.metadata["minipaged"] = meta
    return cell


def check_source(exercise_id: str, *names: str) -> str:
    return (
        f"# Check {exercise_id}. Do not edit this cell: grading puts the original back.\n"
        "from minipaged.checks import check\n"
        f"check({exercise_id!r}, {', '.join(names)})"
    )


class ExerciseNotebook:
    def __init__(self, chapter: str, filename: str, title: str, minutes: int, intro: str) -> None:
        self.chapter = chapter
        self.path = OUT_DIR / filename
        self.cells = [
            _md(
                f"# {title}\n\n"
                + textwrap.dedent(intro).strip("\n")
                + "\n\n"
                + _HOW_TO.format(minutes=minutes, filename=filename),
                "intro",
            ),
        ]

    def setup(self, src: str) -> None:
        self.cells.append(_code(src, "setup", role="setup"))

    def exercise(self, exercise_id: str, title: str, spec: str, solution: str, names: list[str]) -> None:
        slug = exercise_id.replace(".", "-")
        self.cells.append(
            _md(
                f"## {exercise_id}: {title}\n\n" + textwrap.dedent(spec).strip("\n"),
                f"{slug}-spec",
                role="spec",
                exercise=exercise_id,
            )
        )
        sol = _code(solution, f"{slug}-solution", role="solution", exercise=exercise_id)
        sol.metadata["tags"] = ["nbval-ignore-output"]
        self.cells.append(sol)
        self.cells.append(
            _code(check_source(exercise_id, *names), f"{slug}-check", role="check", exercise=exercise_id)
        )

    def outro(self, text: str) -> None:
        self.cells.append(_md(text, "recap"))

    def build(self, execute: bool = True) -> Path:
        nb = nbformat.v4.new_notebook()
        nb.cells = self.cells
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        nb.metadata["minipaged"] = {"chapter": self.chapter}
        if execute:
            client = NotebookClient(
                nb,
                timeout=600,
                kernel_name="python3",
                record_timing=False,
                resources={"metadata": {"path": str(self.path.parent)}},
            )
            client.execute()
        nbformat.write(nb, self.path)
        print(f"wrote {self.path.relative_to(OUT_DIR.parent.parent)}", file=sys.stderr)
        return self.path


_HOW_TO = """\
**How these exercises work.** Each exercise has three cells: what to build, a cell for
your code (replace `raise NotImplementedError`; keep the function's name and arguments),
and a check cell. The check runs your code against a reference implementation on
many seeded cases, smallest first, and ends with one line, `✅ exN.M passed` (a
measuring check prints what it measured above it), or stops with the smallest case your
code gets wrong. Do not edit the check cells: grading
puts the originals back. When every check passes, `pytest --nbval {filename}` passes too.

Time: about {minutes} minutes."""
