"""``minipaged serve`` under the clients of issue 37: every token its own event, streams that
are never read, a stopped engine core, a drain, a big logprobs answer beside a stream,
``echo`` with ``max_tokens=0``, ``/tokenize`` and ``/detokenize``.

The server runs in this process (``serve_engine``: ``BackgroundServer`` with
``check_invariants=True``); where the engine core's own process matters (a stopped core, a
big answer's pause) it runs in one, as ``minipaged serve`` does by default. Each test takes
seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="fastapi is not installed")
pytest.importorskip("uvicorn", reason="uvicorn is not installed")

from _serve_helpers import ENGINE_MODES, serve_engine, wait_idle  # noqa: E402

PROMPT = "Once upon a time"


def stream_events(url: str, body: dict, timeout: float = 60) -> list:
    """``(arrival time, data)`` of every event of one streamed completion, ``[DONE]`` included."""
    out = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append((time.perf_counter(), data if data == "[DONE]" else json.loads(data)))
    return out


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} is not in /metrics")


# -- 1. every token its own event ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_every_sampled_token_is_its_own_event(llm, mode):
    """As vLLM's ``--stream-interval 1``: one event per token, for a reader that keeps up and
    for one that reads nothing until the answer is done; ``stream_interval=4`` sends the
    first token, then every 4 more, then the rest."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    with serve_engine(llm, engine_process=mode == "engine-process") as srv:
        events = [e for _, e in stream_events(srv.url, body) if e != "[DONE]"]
        assert len(events) == 24
        assert all(len(e["choices"][0]["logprobs"]["tokens"]) == 1 for e in events)
        # a reader that comes late: still one event per step, in order
        with httpx.stream(
            "POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            wait_idle(srv)  # the whole answer is made before the first byte is read
            late = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert [e["choices"][0]["text"] for e in late] == [e["choices"][0]["text"] for e in events]
    with serve_engine(llm, engine_process=mode == "engine-process", stream_interval=4) as srv:
        events = [e for _, e in stream_events(srv.url, body) if e != "[DONE]"]
        sizes = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events]
        assert sizes == [1, 4, 4, 4, 4, 4, 3], sizes


# -- 2. unread streams ------------------------------------------------------------------------------
def test_a_finished_unread_stream_is_dropped_after_its_time_and_counted(llm, caplog):
    """A client that sends a big streamed request and never reads (a tiny receive buffer):
    once the answer is finished and ``unread_timeout`` has passed, its output is dropped,
    the connection closed and ``minipaged:unread_streams_dropped_total`` counts it. The drop
    is by design: uvicorn's "returned without completing response" error is not logged."""
    import logging

    uvicorn_log = logging.getLogger("uvicorn.error")
    # NOTE: 2.9 MB of events: more than the sockets' buffers on loopback take (~1 MB)
    body = {
        "prompt": "Hi",
        "n": 16,
        "logprobs": 20,
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with serve_engine(llm, unread_timeout=0.5, max_n=16) as srv:
        # NOTE: after uvicorn configured its loggers (which resets their handlers); they do not propagate
        uvicorn_log.addHandler(caplog.handler)
        assert metric(srv.url, "minipaged:unread_streams_dropped_total") == 0
        ae = srv.serving.engine_client
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((srv.host, srv.port))
        data = json.dumps(body).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        try:
            deadline = time.monotonic() + 60
            while ae.num_unread_dropped == 0:
                assert time.monotonic() < deadline, "the unread stream was never dropped"
                time.sleep(0.05)
            assert not ae._unread and ae._unread_size == 0
            assert metric(srv.url, "minipaged:unread_streams_dropped_total") == 1
            sock.settimeout(10)
            while sock.recv(65536):  # the server closed the connection: EOF after the buffered bytes
                pass
        finally:
            sock.close()
        wait_idle(srv)
        uvicorn_log.removeHandler(caplog.handler)
    errors = [
        r.getMessage() for r in caplog.records if r.name == "uvicorn.error" and r.levelno >= logging.ERROR
    ]
    assert not errors, errors


def test_finished_unread_outputs_are_bounded_in_size(llm):
    """Finished outputs nobody reads may hold ``max_unread_tokens`` entries together; beyond
    it the oldest is dropped (its reader gets ``StreamOverflow``), the newest kept."""
    import asyncio

    from minipaged import SamplingParams
    from minipaged.engine.async_llm import AsyncLLM, StreamOverflow, output_size
    from minipaged.engine.llm_engine import LLMEngine

    e = llm.llm_engine
    engine = LLMEngine(e.config, model=e.model, tokenizer=e.tokenizer)
    ids = list(e.tokenizer(PROMPT)["input_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)

    async def run():
        # one answer is 40 tokens x (1 + 5 entries) = 240 (greedy: the sampled token is in
        # the top 5): two do not fit in 400
        ae = AsyncLLM(engine, max_unread_tokens=400)
        await ae.start()
        try:
            (a,) = ae.add_requests([("a", ids, params)])
            while "a" in ae.streams:
                await asyncio.sleep(0.01)
            (b,) = ae.add_requests([("b", ids, params)])
            while "b" in ae.streams:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            return ae, a, b
        finally:
            await ae.shutdown()

    ae, a, b = asyncio.run(run())
    items = [a.queue.get_nowait() for _ in range(a.queue.qsize())]
    assert len(items) == 1 and isinstance(items[0], StreamOverflow) and a.queue.dropped.is_set()
    assert not b.queue.dropped.is_set() and ae.num_unread_dropped == 1
    assert ae._unread_size == output_size([x for x in b.queue._items if hasattr(x, "outputs")][-1]) == 240


# -- 3. a stopped engine core ------------------------------------------------------------------------
def test_a_stopped_core_turns_health_503_and_the_frontend_keeps_answering(llm):
    """SIGSTOP the engine core: ``/health`` is 503 within ``health_timeout``; ``/health``,
    ``/v1/models`` and ``/metrics`` keep answering at once, also while requests whose
    prompts overfill the pipe to the core are sent (the writes wait in the sender thread,
    never on the event loop); after SIGCONT everything is answered and ``/health`` is 200."""
    with serve_engine(llm, engine_process=True, health_timeout=0.5, max_waiting_requests=64) as srv:
        url, pid = srv.url, srv.serving.engine.pid
        assert httpx.get(url + "/health").status_code == 200
        os.kill(pid, signal.SIGSTOP)
        pool = ThreadPoolExecutor(32)
        try:
            # 32 prompts of 400 token ids: ~100 KB of adds, more than a pipe holds (64 KB)
            prompt = [int(t) % 200 + 10 for t in range(400)]
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0}
            futs = [
                pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120) for _ in range(32)
            ]
            time.sleep(0.5)
            for path in ("/health", "/v1/models", "/metrics"):
                t0 = time.perf_counter()
                r = httpx.get(url + path, timeout=5)
                took = time.perf_counter() - t0
                assert took < 2.0, f"{path} took {took:.2f} s with the core stopped"
                assert r.status_code == (503 if path == "/health" else 200), (path, r.text)
            err = httpx.get(url + "/health").json()["error"]
            assert "did not answer a ping within 0.5 s" in err["message"], err
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(f.result().status_code == 200 for f in futs)
        pool.shutdown()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        wait_idle(srv)


# -- 4. a drain ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_stopping_drains_streams_with_an_error_event_and_done(llm, mode):
    """``BackgroundServer.stop()`` drains as SIGTERM does (``test_serve_process.py`` sends
    the signal itself): after ``shutdown_grace`` a stream in flight gets an OpenAI error
    event then ``[DONE]``, a non-streamed request a JSON 503; a short request in flight
    finishes normally."""
    long = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0.0, "ignore_eos": True}
    with serve_engine(llm, engine_process=mode == "engine-process", shutdown_grace=1.0) as srv:
        pool = ThreadPoolExecutor(3)
        streamed = pool.submit(stream_events, srv.url, long)
        plain = pool.submit(httpx.post, srv.url + "/v1/completions", json=long, timeout=60)
        short = pool.submit(
            httpx.post,
            srv.url + "/v1/completions",
            json={**long, "max_tokens": 4, "prompt": "Hi"},
            timeout=60,
        )
        time.sleep(0.5)
        t0 = time.perf_counter()
        srv.stop()
        took = time.perf_counter() - t0
        events = streamed.result()
        assert events[-1][1] == "[DONE]"
        err = events[-2][1]["error"]
        assert err["code"] == 503 and "shutting down" in err["message"], err
        r = plain.result()
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert short.result().status_code == 200
        assert took < 1.0 + 3.0, f"the drain took {took:.2f} s"
        pool.shutdown()


# -- 5. a big logprobs answer beside a stream ----------------------------------------------------------
def test_a_large_logprobs_answer_never_pauses_another_stream(llm):
    """A ``n=16, logprobs=20`` request (non-streamed: its whole answer is built and sent
    when it finishes, 2.5 MB of JSON, 150 ms of CPU) beside a greedy stream: while it runs
    and ends, no piece of the frontend's work holds the other stream 50 ms: no stretch of
    the event loop's own work (a probe on the loop every 2 ms, in the loop thread's CPU
    time), no step's outputs in the reader thread, no job of the worker thread (a thread
    holds the GIL for a long C call: ``json.dumps`` of the whole answer was 70 ms here).
    The heap is frozen first, as ``minipaged serve`` does after start-up.

    NOTE: in CPU time, not wall time: on a shared machine (load 8 on 2 cores) any thread
    waits 100 ms for a CPU now and then, whatever the server does. The wall-clock numbers
    (the loop's lag, the stream's largest gap) are printed and bounded loosely only."""
    import asyncio
    import gc

    from minipaged.engine.core import freeze_gc_heap

    big = {"prompt": "Hi", "n": 16, "logprobs": 20, "max_tokens": 256, "temperature": 1.0}
    big.update(seed=0, ignore_eos=True)
    with serve_engine(llm, engine_process=True, max_n=16) as srv:
        ae = srv.serving.engine_client
        probes, stop = [], threading.Event()
        jobs = {"reader": [], "worker": []}  # (wall time at the end, CPU seconds) per job

        async def probe():
            while not stop.is_set():
                await asyncio.sleep(0.002)
                probes.append((time.perf_counter(), time.thread_time()))

        def timed(kind, fn):
            def run(*args, **kw):
                t0 = time.thread_time()
                try:
                    return fn(*args, **kw)
                finally:
                    jobs[kind].append((time.perf_counter(), time.thread_time() - t0))

            return run

        op, worker = ae.output_processor, srv.serving._worker
        op.process_outputs = timed("reader", op.process_outputs)
        submit = worker.submit
        worker.submit = lambda fn, *a, **kw: submit(timed("worker", fn), *a, **kw)

        # NOTE: the big answer is read by a process of its own: read by a thread of this
        # process, it would take the GIL from the server's loop, which runs here too
        reader = (
            "import httpx, json, sys, time\n"
            "with httpx.stream('POST', sys.argv[1], json=json.loads(sys.argv[2]), timeout=120) as r:\n"
            "    chunks = list(r.iter_raw())\n"
            "print(time.perf_counter(), json.loads(b''.join(chunks))['usage']['completion_tokens'])\n"
        )

        def send_big():
            argv = [sys.executable, "-c", reader, srv.url + "/v1/completions", json.dumps(big)]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=180)
            assert out.returncode == 0, out.stderr
            done, ntok = out.stdout.split()
            return float(done), int(ntok)

        freeze_gc_heap()
        try:
            asyncio.run_coroutine_threadsafe(probe(), ae._loop)
            other = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0.0, "ignore_eos": True}
            with ThreadPoolExecutor(2) as pool:
                streamed = pool.submit(stream_events, srv.url, other)
                time.sleep(0.3)
                t_big = time.perf_counter()
                done, ntok = pool.submit(send_big).result()
                events = streamed.result()
            stop.set()
        finally:
            gc.unfreeze()
        assert ntok == 16 * 256
        times = [t for t, e in events if e != "[DONE]"]
        assert times[-1] > done + 0.3, "the other stream ended before the big answer: make it longer"

        def window(xs):
            return [x for x in xs if t_big < x[0] < done + 0.3]

        pairs = [(a, b) for a, b in zip(probes, probes[1:]) if t_big < a[0] < done + 0.3]
        loop_cpu = max(b[1] - a[1] for a, b in pairs)
        loop_lag = max(b[0] - a[0] for a, b in pairs) - 0.002
        reader_cpu = max(c for _, c in window(jobs["reader"]))
        worker_cpu = max((c for _, c in window(jobs["worker"])), default=0.0)
        gap = max(b - a for a, b in zip(times, times[1:]) if t_big < b < done + 0.3)
        print(
            f"CPU held: loop {loop_cpu * 1000:.1f} ms, reader {reader_cpu * 1000:.1f} ms, worker "
            f"{worker_cpu * 1000:.1f} ms; wall: loop lag {loop_lag * 1000:.0f} ms, stream gap {gap * 1000:.0f} ms"
        )
        assert loop_cpu < 0.05, f"the event loop worked {loop_cpu * 1000:.0f} ms without a break"
        assert reader_cpu < 0.05, f"one step's outputs took the reader {reader_cpu * 1000:.0f} ms"
        assert worker_cpu < 0.05, f"a job of the worker thread took {worker_cpu * 1000:.0f} ms"
        assert gap < 0.5, f"the stream waited {gap * 1000:.0f} ms"


# -- 6. echo with max_tokens=0 ---------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_takes_no_engine_step(llm, server, stream):
    """The prompt alone comes back and the engine never sees the request: no step, no
    token (vLLM runs one step of max_tokens=1 for the same answer)."""
    ae = server.serving.engine_client
    wait_idle(server)
    steps = ae.num_steps
    body = {"prompt": [PROMPT, "Hi"], "max_tokens": 0, "echo": True, "n": 2}
    if stream:
        body["stream_options"] = {"include_usage": True}
        events = [e for _, e in stream_events(server.url, body) if e != "[DONE]"]
        choices = [c for e in events for c in e["choices"]]
        usage = events[-1]["usage"]
    else:
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices, usage = r.json()["choices"], r.json()["usage"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, PROMPT, "length"),
        (1, PROMPT, "length"),
        (2, "Hi", "length"),
        (3, "Hi", "length"),
    ]
    tok = llm.get_tokenizer()
    num_prompt = len(tok(PROMPT)["input_ids"]) + len(tok("Hi")["input_ids"])  # each prompt once, as vLLM
    assert usage == {"prompt_tokens": num_prompt, "completion_tokens": 0, "total_tokens": num_prompt}
    assert ae.num_steps == steps  # the engine took no step for it


# -- 7. /tokenize and /detokenize --------------------------------------------------------------------------
def test_tokenize_and_detokenize_as_vllm_serves_them(llm, server):
    tok = llm.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT})
    ids = list(tok(PROMPT)["input_ids"])
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
    assert r.json()["token_strs"] == tok.convert_ids_to_tokens(ids)
    from minipaged.entrypoints.openai.protocol import ChatMessage, render_chat

    messages = [{"role": "user", "content": "Hi there"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages})
    rendered = render_chat([ChatMessage(**m) for m in messages], tok)
    assert r.json()["tokens"] == list(tok(rendered, add_special_tokens=False)["input_ids"])
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
    bad = [
        ("/tokenize", {"prompt": PROMPT, "temperature": 1}, "temperature"),
        (
            "/tokenize",
            {"messages": messages, "add_generation_prompt": True, "continue_final_message": True},
            None,
        ),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": PROMPT, "model": "gpt-4"}, "model"),
    ]
    for path, b, param in bad:
        r = httpx.post(server.url + path, json=b)
        assert r.status_code in (400, 404), (path, b, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param, r.json()
