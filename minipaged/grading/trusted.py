"""The trusted checker: case generator, references, keys and the judge, in their own process.

Concept
    The grader never runs a checker in the student's kernel. For each graded exercise it
    asks this process for the cases (``payload``: plain JSON, drawn from the seed of this
    grading run and of the student), sends them into the kernel inside a fixed driver cell
    (``minipaged.grading.driver``), and hands the JSON text the kernel printed back here
    (``judge``). References, expected values and the instructor's key (``--key FILE``)
    exist only in this process: the kernel runs in the sandbox, as another user, and
    never sees them.

    It is a small pool of ``python -m minipaged.grading.trusted`` processes (JSON lines on
    their stdin / stdout), one per grading job, so a slow reference (ex7.3 runs the
    simulator) does not hold the others, and the grader's own memory stays small (torch
    is imported there, not in the grader).

Inputs / outputs
    ``TrustedChecker(key_path, jobs)``; ``payload(exercise_id, seed) -> (json, nonce)``;
    ``judge(exercise_id, payload_json, result_text) -> (passed, message)``; ``close()``.

Invariants
    everything that crosses into this process from a submission is a ``str`` (the JSON
    text the kernel printed), decoded by ``codec.loads_strict``.

Failure mode
    an error of the checker itself (a bug, a key without the exercise) comes back as
    ``(False, "the grader's checker failed: ...")`` and is flagged; it never stops a run.
"""

from __future__ import annotations

import functools
import json
import secrets
from pathlib import Path
from typing import Optional


@functools.lru_cache(maxsize=4)
def _load_key(key_path: Optional[str]) -> dict:
    if not key_path:
        return {}
    return json.loads(Path(key_path).read_text(encoding="utf-8"))


def load_key(key_path) -> dict:
    """The instructor's key file: ``{exercise id: {question id: answer}}``; ValueError if bad."""
    try:
        key = json.loads(Path(key_path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--key {key_path}: cannot read the key file ({e})") from None
    if not isinstance(key, dict) or not all(isinstance(v, dict) for v in key.values()):
        raise ValueError(f"--key {key_path}: must map exercise ids to dicts of answers")
    return key


def default_key_path(source=None) -> Optional[str]:
    """``_instructor/key.json`` in the authored notebooks' folder, if it is there."""
    from minipaged.checks.notebook import default_authored_dir

    path = Path(source) if source else default_authored_dir()
    key = path / "_instructor" / "key.json"
    return str(key) if key.is_file() else None


def make_payload(exercise_id: str, seed: str, student_seed=None) -> tuple[str, str]:
    from minipaged.checks import get_spec
    from minipaged.checks._spec import make_cases
    from minipaged.grading.codec import dumps

    nonce = secrets.token_hex(8)
    return dumps(
        {"nonce": nonce, "cases": make_cases(get_spec(exercise_id), f"{seed}|{student_seed}", student_seed)}
    ), nonce


def judge_result(exercise_id: str, payload_json: str, result_text: str, key_path: Optional[str]):
    from minipaged.checks import get_spec
    from minipaged.checks._spec import judge

    try:
        cases = json.loads(payload_json)["cases"]
        return judge(get_spec(exercise_id), cases, result_text, _load_key(key_path))
    except Exception as e:  # the checker's own failure: say so, never crash the run
        return False, f"the grader's checker failed: {type(e).__name__}: {e}"


class _Worker:
    """One trusted checker process: ``python -m minipaged.grading.trusted``, JSON lines."""

    def __init__(self, key_path: Optional[str]) -> None:
        import os
        import subprocess
        import sys

        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minipaged.grading.trusted"] + ([key_path] if key_path else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
        )

    def call(self, request: dict):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the trusted checker process exited")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # pragma: no cover - best effort
            self.proc.kill()


class TrustedChecker:
    """A pool of ``jobs`` trusted checker processes; thread-safe (one call per process at a time)."""

    def __init__(self, key_path: Optional[str] = None, jobs: int = 1) -> None:
        import queue

        key_path = key_path or default_key_path()
        self.key_path = str(key_path) if key_path else None
        self.jobs = max(1, jobs)
        self._idle: queue.Queue = queue.Queue()
        self._all: list = []
        for _ in range(self.jobs):
            self._idle.put(None)  # started on first use

    def _call(self, request: dict):
        w = self._idle.get()
        try:
            if w is None or w.proc.poll() is not None:
                w = _Worker(self.key_path)
                self._all.append(w)
            return w.call(request)
        except (OSError, RuntimeError, ValueError):
            w = None  # a fresh one next time
            raise
        finally:
            self._idle.put(w)

    def payload(self, exercise_id: str, seed: str, student_seed=None) -> tuple[str, str]:
        r = self._call({"op": "payload", "exercise": exercise_id, "seed": seed, "student_seed": student_seed})
        return r["payload"], r["nonce"]

    def judge(self, exercise_id: str, payload_json: str, result_text: str) -> tuple[bool, str]:
        try:
            r = self._call(
                {"op": "judge", "exercise": exercise_id, "payload": payload_json, "result": result_text}
            )
        except (OSError, RuntimeError, ValueError) as e:
            return False, f"the grader's checker failed: {e}"
        return bool(r["passed"]), str(r["message"])

    def close(self) -> None:
        for w in self._all:
            w.close()
        self._all = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(key_path: Optional[str]) -> None:
    """The worker loop: one JSON request per line on stdin, one JSON answer per line on stdout."""
    import sys

    out = sys.stdout
    sys.stdout = sys.stderr  # NOTE: nothing a reference prints may corrupt the answers
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "payload":
            payload, nonce = make_payload(req["exercise"], req["seed"], req.get("student_seed"))
            answer = {"payload": payload, "nonce": nonce}
        else:
            passed, message = judge_result(req["exercise"], req["payload"], req["result"], key_path)
            answer = {"passed": passed, "message": message}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    import sys

    serve(sys.argv[1] if len(sys.argv) > 1 else None)
