"""Shared by the chapter generators in this folder: collect cells, write the notebook.

    from _nb import code, md, write
    md("# Title"); code("print(1)")
    write("01_kv_cache")        # -> notebooks/01_kv_cache.ipynb, without outputs

Then execute and finalize it (``bash notebooks/_build/build_all.sh 01_kv_cache``).
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

cells = []


def md(text: str) -> None:
    cells.append(new_markdown_cell(text.strip("\n")))


def code(text: str) -> None:
    cells.append(new_code_cell(text.strip("\n")))


def write(name: str, note: str = "") -> Path:
    """Write the collected cells to ``notebooks/NAME.ipynb`` and say so."""
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    out = Path(__file__).resolve().parents[1] / f"{name}.ipynb"
    nbformat.write(nb, out)
    print(f"wrote {out}" + (f" ({note})" if note else ""))
    return out
