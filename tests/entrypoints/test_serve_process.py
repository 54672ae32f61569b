"""``minipaged serve`` as its own processes (the frontend and its engine core), as a user runs
it: Triton is never loaded on a CPU, the frontend's memory comes back after a load, SIGTERM
drains. One server for the module (``serve_process``), stopped by the last test's SIGTERM.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="fastapi is not installed")
pytest.importorskip("uvicorn", reason="uvicorn is not installed")

GRACE = 1.0  # --shutdown-grace of the module's server
RSS_SLACK_MB = 100  # how far above its warm value the frontend's RSS may stay after a load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def loads_triton(pid: int) -> bool:
    """Whether Triton's native library is mapped into process ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        return "libtriton" in f.read()


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "minipaged.cli", "serve", "--port", str(port), "--max-num-seqs", "16"]
    cmd += ["--shutdown-grace", str(GRACE), "--log-level", "warning", "--max-n", "16"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                httpx.get(url + "/health", timeout=2).raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "minipaged serve did not start"
                time.sleep(0.3)
        core_pid = int(re.search(r"engine core process pid (\d+)", log_path.read_text()).group(1))
        yield proc, core_pid, url, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_a_cpu_server_never_loads_triton(serve_process):
    proc, core_pid, url, _ = serve_process
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    assert not loads_triton(proc.pid), "the frontend loaded Triton"
    assert not loads_triton(core_pid), "the engine core loaded Triton"


def test_the_frontends_memory_comes_back_after_a_load(serve_process):
    """Warm-up, RSS; then a load of big answers (8 x n=16 x 20 logprobs, 4 of them streamed
    and left unread until the end); once idle again, the frontend's RSS is within
    ``RSS_SLACK_MB`` of its warm value."""
    proc, _, url, _ = serve_process
    big = {"prompt": "Hi", "n": 16, "logprobs": 20, "max_tokens": 200, "temperature": 1.0, "ignore_eos": True}

    def one(seed: int, stream: bool) -> int:
        body = {**big, "seed": seed, "stream": stream}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if stream:
                time.sleep(3)  # NOTE: a slow reader: its output waits in the server meanwhile
            return len(r.read())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(2), [False, True]))  # warm-up: every path once
    time.sleep(2)
    before = rss_mb(proc.pid)
    with ThreadPoolExecutor(8) as pool:
        sizes = list(pool.map(one, range(8), [False, True] * 4))
    assert min(sizes) > 100_000
    deadline = time.monotonic() + 20
    while (after := rss_mb(proc.pid)) > before + RSS_SLACK_MB and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"frontend RSS: {before:.0f} MB warm, {after:.0f} MB after the load")
    assert after <= before + RSS_SLACK_MB, f"RSS {before:.0f} MB -> {after:.0f} MB after the load"


def test_sigterm_drains_every_request_in_flight(serve_process):
    """SIGTERM with a stream and a non-streamed request in flight: within the grace period
    (and the flush after it) the stream gets an OpenAI error event and ``[DONE]``, the
    other request a JSON 503; the server exits 0 and says nothing about Triton."""
    proc, _, url, log_path = serve_process
    long = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0.0, "ignore_eos": True}

    def streamed():
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    with ThreadPoolExecutor(2) as pool:
        s = pool.submit(streamed)
        p = pool.submit(httpx.post, url + "/v1/completions", json=long, timeout=60)
        time.sleep(0.5)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        events, r = s.result(), p.result()
        took = time.perf_counter() - t0
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2]).get("error")
    assert err is not None and err["code"] == 503 and "shutting down" in err["message"], events[-3:]
    assert r.status_code == 503 and r.json().get("error", {}).get("code") == 503, r.text
    assert took < GRACE + 2.5, f"answered {took:.2f} s after SIGTERM"
    # NOTE: uvicorn re-raises the signal it caught once it has shut down (so that a
    # supervisor sees it): the exit is the SIGTERM's, as vLLM's server's
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    text = log_path.read_text()
    assert "Traceback" not in text and "nanobind" not in text, text


# -- the import graph ---------------------------------------------------------------------------
def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_triton_is_imported_only_where_its_kernels_run():
    """The server's frontend (routes, AsyncLLM, the tokenizer, the kernels package) and an
    engine core on a CPU never import Triton; asking for a Triton kernel does."""
    frontend = """
import sys
from minipaged.entrypoints.openai import api_server, serving
from minipaged.engine import async_llm, core_client
import minipaged.kernels
core_client.load_tokenizer(None)
assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)
import minipaged.kernels as k
k.paged_attention_decode  # a Triton kernel asked for: now it is imported
assert 'triton' in sys.modules
"""
    _run(frontend)
    core = """
import sys
from minipaged.config import EngineConfig
from minipaged.engine.core import EngineCore, load_model_for
from minipaged.kernels.selector import keep_triton_out
config = EngineConfig()
assert keep_triton_out(config)  # what run_engine_core does first
core = EngineCore.from_config(config, load_model_for(config)[0])
loaded = [m for m, v in sys.modules.items() if (m == 'triton' or m.startswith('triton.')) and v is not None]
assert not loaded, loaded[:5]
"""
    _run(core)
