"""How tensor-parallel workers start (``minipaged.distributed.workers.worker_start_method``):
``LLM(tensor_parallel_size=2)`` from a script without an ``if __name__ == "__main__":``
guard and from ``python - <<EOF`` works (fork, as vLLM on Linux without a CUDA context),
and where spawn is used (``MINIPAGED_WORKER_MULTIPROC_METHOD=spawn``, as with a CUDA
context) both fail with an error that names the guard. The reference for the tokens is
``LLM(tensor_parallel_size=1)`` in the test's process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minipaged.distributed import workers
from minipaged.model.parallel import available_devices

GUARD = 'if __name__ == "__main__":'
SCRIPT = """
from minipaged import LLM, SamplingParams

llm = LLM(tensor_parallel_size=2, num_blocks=16, block_size=4)
out = llm.generate(["Once upon a time there was"], SamplingParams(temperature=0.0, max_tokens=4))
print("TOKENS", out[0].outputs[0].token_ids)
"""


def _run(tmp_path, how: str, method: str | None):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MINIPAGED_WORKER_MULTIPROC_METHOD"}
    if method:
        env["MINIPAGED_WORKER_MULTIPROC_METHOD"] = method
    args = [sys.executable, str(script)] if how == "file" else [sys.executable, "-"]
    return subprocess.run(
        args,
        input=None if how == "file" else SCRIPT,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tp1_tokens():
    from minipaged import LLM, SamplingParams

    out = LLM(num_blocks=16, block_size=4).generate(
        ["Once upon a time there was"], SamplingParams(temperature=0.0, max_tokens=4)
    )
    return out[0].outputs[0].token_ids


needs_two_cores = pytest.mark.skipif(available_devices("cpu") < 2, reason="needs 2 CPU cores")


@needs_two_cores
@pytest.mark.skipif(sys.platform != "linux", reason="fork is the default on Linux only")
@pytest.mark.parametrize("how", ["file", "stdin"])
def test_unguarded_script_and_stdin_start_with_fork(tmp_path, how, tp1_tokens):
    proc = _run(tmp_path, how, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS"))
    assert line == f"TOKENS {tp1_tokens}" and len(tp1_tokens) == 4


def test_spawn_from_stdin_is_refused_before_any_worker_starts(tmp_path):
    proc = _run(tmp_path, "stdin", "spawn")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError") and "'<stdin>'" in last and GUARD in last, proc.stderr[-3000:]


@needs_two_cores
def test_spawn_of_an_unguarded_script_names_the_guard(tmp_path):
    proc = _run(tmp_path, "file", "spawn")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "WorkerDiedError" in last and "while starting" in last and GUARD in last, proc.stderr[-3000:]
    # the worker itself says why it stopped: it was building the LLM again
    assert "is re-importing __main__, which creates an LLM again" in proc.stderr


def test_start_method_rule(monkeypatch):
    import torch

    monkeypatch.delenv("MINIPAGED_WORKER_MULTIPROC_METHOD", raising=False)
    cuda = torch.cuda.is_initialized()
    assert workers.worker_start_method() == ("fork" if sys.platform == "linux" and not cuda else "spawn")
    monkeypatch.setenv("MINIPAGED_WORKER_MULTIPROC_METHOD", "spawn")
    assert workers.worker_start_method() == "spawn"
    monkeypatch.setenv("MINIPAGED_WORKER_MULTIPROC_METHOD", "threads")
    with pytest.raises(ValueError, match="MINIPAGED_WORKER_MULTIPROC_METHOD"):
        workers.worker_start_method()
    # a process that holds a CUDA context: spawn, and fork is refused
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delenv("MINIPAGED_WORKER_MULTIPROC_METHOD")
    assert workers.worker_start_method() == "spawn"
    monkeypatch.setenv("MINIPAGED_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(ValueError, match="CUDA context"):
        workers.worker_start_method()
