"""Post-process executed notebooks for nbval (run from the repo root).

    python notebooks/_build/finalize.py notebooks/*.ipynb

Code-tour cells print source with ``inspect.getsource``. Their output is the code itself,
so it changes whenever the code is edited, which would make nbval fail on a correct
package. They get the ``nbval-ignore-output`` tag: nbval still runs them (a renamed
function still fails) but does not compare what they print.
"""

import sys

import nbformat

TAG = "nbval-ignore-output"


def finalize(path: str) -> int:
    nb = nbformat.read(path, as_version=4)
    n = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and "getsource(" in cell.source:
            tags = cell.metadata.setdefault("tags", [])
            if TAG not in tags:
                tags.append(TAG)
                n += 1
    nbformat.write(nb, path)
    return n


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"{p}: tagged {finalize(p)} code-tour cell(s)")
