"""The fixed snippet a graded check cell runs inside the student's kernel: call, encode, print.

Concept
    The trusted side puts one cell in place of each authored check cell::

        from minipaged.grading.driver import drive as _mp_drive
        _mp_drive("ex2.1", '{"nonce": "...", "cases": [...]}', remove)

    ``drive`` decodes the cases (plain JSON), calls the exercise's ``observe`` with the
    student's objects on each, and prints the observations as JSON between two marker
    lines. That is all it does: it holds no expected value, no reference, no key, so
    whatever the student's code does to it (patch it, read its frames, replace it) can
    only change the text it prints, and that text is judged on the trusted side.

Inputs / outputs
    ``drive(exercise_id, payload_json, *objects)`` prints
    ``MPRESULT <nonce>`` / one line of JSON / ``MPEND <nonce>``.
    ``extract(stdout, nonce)`` (trusted side) -> the JSON text, or ``None``.

Invariants
    the observations are the only output of a graded check cell that the grader reads.

Failure mode
    an exception inside ``drive`` itself is the cell's error: the exercise scores 0.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

BEGIN, END = "MPRESULT", "MPEND"


def drive(exercise_id: str, payload_json: str, *objects) -> None:
    from minipaged.checks import get_spec
    from minipaged.checks._spec import observe_all
    from minipaged.grading.codec import dumps

    payload = json.loads(payload_json)
    spec = get_spec(exercise_id)
    records = observe_all(spec, payload["cases"], objects)
    sys.stdout.write(f"\n{BEGIN} {payload['nonce']}\n{dumps(records)}\n{END} {payload['nonce']}\n")
    sys.stdout.flush()


def check_source(exercise_id: str, payload_json: str, names: list) -> str:
    """The graded check cell's source."""
    args = "".join(", " + n for n in names)
    return (
        "from minipaged.grading.driver import drive as _mp_drive\n"
        f"_mp_drive({exercise_id!r}, {payload_json!r}{args})"
    )


def extract(stdout: str, nonce: str) -> Optional[str]:
    """The JSON text between the last pair of markers carrying ``nonce``."""
    begin, end = f"\n{BEGIN} {nonce}\n", f"\n{END} {nonce}\n"
    i = stdout.rfind(begin)
    if i < 0:
        return None
    j = stdout.find(end, i + len(begin))
    if j < 0:
        return None
    return stdout[i + len(begin) : j]
