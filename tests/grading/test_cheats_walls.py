"""The all-walls notebook of issue 35: every resource and kernel-client attack in one submission.

One chapter 02 notebook (every solution ``return None``) whose first cells fork until the
process limit, start 10000 threads, allocate 20 GiB, fill ``/tmp`` with 2 GiB, write to
``/dev/shm``, print 256 MiB, raise a 100 MiB exception, then attack the grader's Jupyter client itself: a validly signed
message whose header is not JSON, a re-keyed session (every later message fails
jupyter_client's signature check: the ``Invalid Signature`` error that used to stop the
grader on this file) and the kernel's own sockets closed. It is graded with ``--jobs 2``
beside an honest classmate, by a grader process whose peak RSS is measured: the attacker
gets 0 with a reason on its row, the classmate 7/7, the grader stays under 500 MB. The
executor's part (any client exception -> "died", never raised) is also tested on its own,
outside the sandbox, so it runs where bubblewrap is missing.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minipaged.checks.notebook import cell_exercise, cell_role, cell_source, load_authored
from minipaged.grading.grade import check_call
from minipaged.grading.sandbox import probe

ROOT = Path(__file__).resolve().parents[2]
AUTHORED = load_authored()
ISOLATION = probe()

WALLS = {
    "forks": "import os, time\n"
    "kids = 0\n"
    "try:\n"
    "    for _ in range(100000):\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(3600)\n"
    "            os._exit(0)\n"
    "        kids += 1\n"
    "except OSError as e:\n"
    "    print('forks stopped after', kids, type(e).__name__)\n",
    "threads": "import threading, time\n"
    "for _ in range(10000):\n"
    "    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n",
    "memory": "hoard = bytearray(20 * 2**30)\n",
    "tmpfs_2gib": "with open('/tmp/fill', 'wb') as f:\n    for _ in range(2048):\n        f.write(b'x' * 2**20)\n",
    "dev_shm": "with open('/dev/shm/fill', 'wb') as f:\n    f.write(b'x' * 2**30)\n",
    "print_256mib": "import sys\nchunk = 'y' * 2**20\nfor _ in range(256):\n    sys.stdout.write(chunk)\n",
    "exception_100mib": "raise ValueError('z' * (100 * 2**20))\n",
    # a validly signed IOPub message whose header is not JSON: the client's decode fails
    "not_json": "k = get_ipython().kernel\n"
    "parts = [b'not json', b'{}', b'{}', b'{}']\n"
    "k.iopub_socket.send_multipart([b'kernel.x.status', b'<IDS|MSG>', k.session.sign(parts), *parts])\n"
    "import time\ntime.sleep(1)\n",
    # every later message of this kernel fails the client's signature check
    "rekey": "get_ipython().kernel.session.key = b'not the key'\n",
    "close_sockets": "k = get_ipython().kernel\nk.shell_stream.close()\nk.iopub_socket.close()\n",
}


def walls_notebook() -> nbformat.NotebookNode:
    """Chapter 02's authored notebook, every solution ``return None``, the walls first."""
    authored = AUTHORED["ch02"]
    nb = copy.deepcopy(authored.nb)
    for cell in nb.cells:
        if cell_role(cell) == "solution":
            _, names = check_call(cell_source(authored.check_cells[cell_exercise(cell)]))
            cell.source = "".join(f"def {n}(*args, **kwargs):\n    return None\n" for n in names)
    first = next(i for i, c in enumerate(nb.cells) if cell_role(c) == "solution")
    for code in reversed(list(WALLS.values())):
        nb.cells.insert(first, nbformat.v4.new_code_cell(code))
    return nb


def test_any_client_exception_is_a_dead_kernel_not_a_grader_error(tmp_path):
    """Outside the sandbox too: a re-keyed session and a non-JSON message read as "died"."""
    from minipaged.grading.executor import KernelRunner

    for attack in ("not_json", "rekey"):
        runner = KernelRunner(cwd=str(tmp_path), timeout=20)
        runner.start()
        try:
            run = runner.run(WALLS[attack] + "print('after')\n")
            assert run.status == "died", (attack, run)
            assert "could not read the kernel's messages" in run.error, run.error
            assert not runner.running
        finally:
            runner.shutdown()


_GRADER = """
import json, sys
from minipaged.checks.notebook import load_authored
from minipaged.grading.grade import grade_many
from minipaged.grading.sandbox import probe
res = grade_many(sys.argv[1:], load_authored(), timeout=15, budget=240, jobs=2, isolation=probe(), scan=False)
print("MPOUT " + json.dumps({r.submission: [r.score, r.error, {ex: x.reason for ex, x in r.exercises.items()}] for r in res}))
# NOTE: VmHWM, this process's own peak RSS (ru_maxrss would carry the forking pytest's)
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
print("MAXRSS_KB", int(hwm.split()[1]))
"""


@pytest.mark.skipif(
    ISOLATION.bwrap is None or ISOLATION.user is None, reason="; ".join(ISOLATION.missing) or "-"
)
def test_all_walls_notebook_is_graded_zero_beside_an_honest_classmate(tmp_path):
    walls, honest = tmp_path / "ch02_all_walls.ipynb", tmp_path / "ch02_honest.ipynb"
    nbformat.write(walls_notebook(), walls)
    nbformat.write(AUTHORED["ch02"].nb, honest)
    out = subprocess.run(
        [sys.executable, "-c", _GRADER, str(walls), str(honest)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("MPOUT "))[6:])
    rss_kb = int(next(ln for ln in out.stdout.splitlines() if ln.startswith("MAXRSS_KB")).split()[1])
    score, error, reasons = got[str(walls)]
    assert error is None, error  # graded exercise by exercise, not a whole-file failure
    assert score == 0, reasons
    assert all(reasons.values()), reasons  # every exercise says why
    said = " | ".join(reasons.values())
    assert "could not read the kernel's messages" in said or "kernel died" in said, said
    assert got[str(honest)][0] == 7, got[str(honest)]
    print(f"grader peak RSS {rss_kb / 1024:.0f} MB; reasons: {reasons}")
    assert rss_kb < 500 * 1024, f"grader peak RSS {rss_kb / 1024:.0f} MB"
