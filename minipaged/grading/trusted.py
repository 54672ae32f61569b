"""The trusted checker: case generator, references, keys and the judge, in their own process.

Concept
    The grader never runs a checker in the student's kernel. For each graded exercise it
    asks this process for the cases (``payload``: plain JSON, drawn from the seed of this
    grading run and of the student), sends them into the kernel inside a fixed driver cell
    (``minipaged.grading.driver``), and hands the JSON text the kernel printed back here
    (``judge``). References, expected values and the instructor's key (``--key FILE``)
    exist only in this process: the kernel runs in the sandbox, as another user, and
    never sees them.

    It is a ``ProcessPoolExecutor`` of spawned Python processes (no fork of the grader's
    threads and sockets), one per grading job, so a slow reference (ex7.3 runs the
    simulator) does not hold the others, and the grader's own memory stays small (torch
    is imported here, not in the grader).

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


def make_payload(exercise_id: str, seed: str) -> tuple[str, str]:
    from minipaged.checks import get_spec
    from minipaged.checks._spec import make_cases
    from minipaged.grading.codec import dumps

    nonce = secrets.token_hex(8)
    return dumps({"nonce": nonce, "cases": make_cases(get_spec(exercise_id), seed)}), nonce


def judge_result(exercise_id: str, payload_json: str, result_text: str, key_path: Optional[str]):
    from minipaged.checks import get_spec
    from minipaged.checks._spec import judge

    try:
        cases = json.loads(payload_json)["cases"]
        return judge(get_spec(exercise_id), cases, result_text, _load_key(key_path))
    except Exception as e:  # the checker's own failure: say so, never crash the run
        return False, f"the grader's checker failed: {type(e).__name__}: {e}"


class TrustedChecker:
    """A pool of trusted checker processes (``jobs`` of them)."""

    def __init__(self, key_path: Optional[str] = None, jobs: int = 1) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.key_path = str(key_path) if key_path else None
        self.pool = ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("spawn"))

    def payload(self, exercise_id: str, seed: str) -> tuple[str, str]:
        return self.pool.submit(make_payload, exercise_id, seed).result()

    def judge(self, exercise_id: str, payload_json: str, result_text: str) -> tuple[bool, str]:
        return self.pool.submit(judge_result, exercise_id, payload_json, result_text, self.key_path).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
