"""Run an exercise notebook's cells in a fresh interpreter, then the graded observations.

Usage: ``python _in_build.py SYS_PATH_DIR|- NOTEBOOK.ipynb PAYLOAD.json`` (``-``: the real package).
Every code cell but the check cells runs in ``__main__`` in order (as a kernel would);
then, for each exercise of the payload (``{exercise id: cases}``), the check cell's objects
go through the spec's ``observe``, as ``minipaged.grading.driver`` does. Prints one line of
JSON: ``{"package": path, "cells": [[index, role, error or null]], "records": {ex: JSON text}}``.
"""

import ast
import contextlib
import io
import json
import sys

if sys.argv[1] != "-":
    sys.path.insert(0, sys.argv[1])

import minipaged  # noqa: E402
from minipaged.checks import get_spec  # noqa: E402
from minipaged.checks._spec import observe_all  # noqa: E402
from minipaged.grading.codec import dumps  # noqa: E402


def main():
    nb = json.loads(open(sys.argv[2], encoding="utf-8").read())
    payload = json.loads(open(sys.argv[3], encoding="utf-8").read())
    ns = sys.modules["__main__"].__dict__
    cells, names = [], {}
    for k, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        meta = cell.get("metadata", {}).get("minipaged", {})
        role = meta.get("role")
        if role == "check":
            call = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)][-1]
            names[call.args[0].value] = [a.id for a in call.args[1:]]
            continue
        src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
        err = None
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(src, f"<cell {k}>", "exec"), ns)
        except BaseException as e:  # noqa: BLE001 - a cell's failure is data here
            err = f"{type(e).__name__}: {str(e)[:200]}"
        cells.append([k, role or meta.get("exercise"), err])
    records = {}
    for ex, cases in payload.items():
        objects = tuple(ns.get(n) for n in names.get(ex, []))
        with contextlib.redirect_stdout(io.StringIO()):
            records[ex] = dumps(observe_all(get_spec(ex), cases, objects))
    print(json.dumps({"package": minipaged.__file__, "cells": cells, "records": records}))


main()
