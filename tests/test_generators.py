"""Every chapter generator still produces its notebook's cells.

A notebook edited by hand (with nbformat, or in Jupyter) and not in its generator
``notebooks/_build/NN_name.py`` loses that edit at the next ``build_all.sh NN_name``.
Here each generator runs without writing or executing anything (``_nb.write`` is replaced),
and its cells (type and source) must equal those of the stored ``notebooks/NN_name.ipynb``.
Outputs are nbval's business; chapters 10 and 11 have no generator.
"""

from __future__ import annotations

import difflib
import runpy
from pathlib import Path

import nbformat
import pytest

BUILD = Path(__file__).resolve().parents[1] / "notebooks" / "_build"
GENERATORS = sorted(p.stem for p in BUILD.glob("[0-9]*.py"))


def generator_cells(name: str, monkeypatch) -> tuple[str, list[tuple[str, str]]]:
    """(the notebook name the generator writes, its cells as (cell_type, source))."""
    monkeypatch.syspath_prepend(str(BUILD))
    import _nb

    written = []
    monkeypatch.setattr(_nb, "write", lambda out, note="": written.append(out))
    _nb.cells.clear()
    try:
        runpy.run_path(str(BUILD / f"{name}.py"), run_name="__main__")
        cells = [(c.cell_type, c.source) for c in _nb.cells]
    finally:
        _nb.cells.clear()
    assert len(written) == 1, f"{name}.py called write() {len(written)} times"
    return written[0], cells


def _lines(cells: list[tuple[str, str]]) -> list[str]:
    return [
        line for i, (kind, src) in enumerate(cells) for line in [f"--- cell {i} ({kind})", *src.split("\n")]
    ]


@pytest.mark.parametrize("name", GENERATORS)
def test_generator_matches_notebook(name, monkeypatch):
    written, generated = generator_cells(name, monkeypatch)
    assert written == name, f"notebooks/_build/{name}.py writes {written}.ipynb, not {name}.ipynb"
    stored_nb = nbformat.read(BUILD.parent / f"{name}.ipynb", as_version=4)
    stored = [(c.cell_type, c.source) for c in stored_nb.cells]
    if generated != stored:
        diff = "\n".join(
            list(
                difflib.unified_diff(_lines(stored), _lines(generated), "notebook", "generator", lineterm="")
            )[:60]
        )
        pytest.fail(
            f"notebooks/_build/{name}.py is out of date with notebooks/{name}.ipynb "
            f"({len(generated)} cells generated, {len(stored)} stored); a rebuild would lose the "
            f"notebook's side. Bring the generator up to date, then bash notebooks/_build/build_all.sh "
            f"{name}.\n{diff}",
            pytrace=False,
        )


def test_every_generator_has_its_notebook():
    missing = [n for n in GENERATORS if not (BUILD.parent / f"{n}.ipynb").is_file()]
    assert not missing, f"generators without a notebook (run build_all.sh): {missing}"
