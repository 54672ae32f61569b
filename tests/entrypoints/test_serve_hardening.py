"""``minipaged serve`` against a hostile client (issue 30): no request takes it down or
starves the others.

Checked, each against an independent reference (offline ``LLM.generate``, a brute-force
search, a per-row torch computation):

- every reproducing request of the issue gets a 400 naming the field, or the greedy text
  where vLLM samples greedily, and the next normal request gets the baseline text;
- a step that raises (each known trigger, injected) fails that step's requests with a
  500, frees every block, and the server goes on; an engine that keeps failing answers
  503 on ``/health`` and on new requests;
- per-step costs are bounded: streamed logprob dicts are built once per token, stop
  strings are searched in a window, an unread stream holds one merged output and is
  aborted after ``max_unread_steps``;
- transport: a lying ``Content-Length`` gets a 408 and a closed connection, headers that
  never end a closed connection; every error is the OpenAI shape; ``/trace`` can be off.

No timed assertion: waits have generous timeouts only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import socket

import pytest

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install openai)")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="fastapi is not installed")
pytest.importorskip("uvicorn", reason="uvicorn is not installed")

from _serve_helpers import offline, wait_idle  # noqa: E402

from minipaged import SamplingParams  # noqa: E402
from minipaged.entrypoints.openai.api_server import BackgroundServer  # noqa: E402
from minipaged.entrypoints.openai.protocol import error_body  # noqa: E402

NORMAL = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0}


def _post(server, body, path="/v1/completions"):
    if isinstance(body, (str, bytes)):
        return httpx.post(
            server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60
        )
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.fixture(scope="module")
def baseline(llm):
    return offline(llm, [NORMAL["prompt"]], temperature=0.0, max_tokens=8)[0].outputs[0].text


def _serves_normally(server, baseline):
    r = _post(server, NORMAL)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == baseline
    assert httpx.get(server.url + "/health").status_code == 200


# -- the reproducing requests ----------------------------------------------------------
HI = {"prompt": "Hi", "max_tokens": 4}
DEEP = "[" * 980 + "]" * 980
# name -> (body, path, the field the 400 names)
REFUSED = {
    "top_k over int64": ({**HI, "temperature": 1, "top_k": 9223372036854775808}, None, "top_k"),
    "top_k over the vocabulary": ({**HI, "temperature": 1, "top_k": 100_000}, None, "top_k"),
    "lone surrogate prompt": ('{"prompt": "\\ud800", "max_tokens": 4}', None, "prompt"),
    "lone surrogate chat": (
        '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}',
        "/v1/chat/completions",
        "messages",
    ),
    "JSON nested 980 deep": ('{"prompt": ' + DEEP + ', "max_tokens": 4}', None, "prompt"),
    "stop nested 980 deep": ('{"prompt": "x", "stop": ' + DEEP + "}", None, "stop"),
    "repetition_penalty 1e-300": ({**HI, "repetition_penalty": 1e-300}, None, "repetition_penalty"),
    "100,000 stop strings": ({**HI, "stop": [f"zz{i}" for i in range(100_000)]}, None, "stop"),
    "stop strings too long together": ({**HI, "stop": ["y" * 3000, "z" * 3000]}, None, "stop"),
    "4 MB prompt": ({**HI, "prompt": "a" * (4 * 1024 * 1024 - 100)}, None, "prompt"),
    "logprobs over max_logprobs": ({**HI, "logprobs": 21}, None, "logprobs"),
    "seed over int64": ({**HI, "seed": 2**64}, None, "seed"),
    "an int of 5000 digits": ('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", None, None),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_reproducing_request_is_a_400_naming_the_field(server, baseline, case):
    body, path, field = REFUSED[case]
    r = _post(server, body, path or "/v1/completions")
    assert r.status_code in (400, 413), (case, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] in ("BadRequestError", "RequestEntityTooLargeError", "ContentTooLargeError")
    if field is not None:
        assert field in err["message"] and err["param"] == field, err
    assert "Traceback" not in r.text
    _serves_normally(server, baseline)


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 1e-39}, {"temperature": 5e-324}, {"temperature": 1.0, "top_p": 1e-320}],
    ids=["temperature 1e-39", "temperature 5e-324", "top_p 1e-320"],
)
def test_below_vllms_epsilon_is_greedy(server, baseline, extra):
    r = _post(server, {**NORMAL, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == baseline
    _serves_normally(server, baseline)


def test_keep_alive_survives_a_refused_request(server, baseline):
    """The lone surrogate used to drop the keep-alive connection with its 500."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post(
            "/v1/completions", content='{"prompt": "\\ud800"}', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400
        r = c.post("/v1/completions", json=NORMAL)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == baseline


def test_every_error_is_the_openai_shape(server):
    r = httpx.get(server.url + "/trace", params={"history": "abc", "format": "json"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "history" and err["type"] == "BadRequestError" and err["code"] == 400
    r = httpx.put(server.url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert error_body("x", 500)["error"]["type"] == "InternalServerError"
    assert error_body("x", 404)["error"]["type"] == "NotFoundError"


# -- a failed step recovers ---------------------------------------------------------------
def _sampler_overflow(engine, monkeypatch):
    """The issue's trigger: a top_k beyond int64 made into a tensor inside the sampler."""
    import torch

    real = engine.model_runner.sampler.sample  # NOTE: the worker samples (vLLM v1)

    def sample(logits, reqs, seeds):
        if not hasattr(sample, "done"):
            sample.done = True
            torch.tensor([9223372036854775808])  # RuntimeError: Overflow when unpacking long
        return real(logits, reqs, seeds)

    engine.model_runner.sampler.sample = sample


def _forward_raises(engine, monkeypatch):
    real, calls = engine.model.forward, []

    def forward(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # the request's first decode
            raise RuntimeError("injected fault in the forward")
        return real(*a, **kw)

    monkeypatch.setattr(engine.model, "forward", forward)


def _stop_check_raises(engine, monkeypatch):
    """Inside update_from_output, after the token was appended: a half-updated step."""
    from minipaged.core.sched import utils

    real = utils.check_stop

    def check(req, max_model_len):
        if req.num_output_tokens == 3 and not hasattr(check, "done"):
            check.done = True
            raise RuntimeError("injected fault in the stop check")
        return real(req, max_model_len)

    monkeypatch.setattr(utils, "check_stop", check)


def _schedule_raises(engine, monkeypatch):
    """schedule() decided the step (blocks allocated, step in flight) and then raised."""
    real = engine.scheduler.schedule
    calls = []

    def schedule():
        out = real()
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault after scheduling")
        return out

    engine.scheduler.schedule = schedule


def _record_raises(engine, monkeypatch):
    """After update_from_output: the step's requests advanced, its outputs never returned."""
    import minipaged.engine.core as mod

    real, calls = mod.record_step, []

    def record(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault in the trace")
        return real(*a, **kw)

    monkeypatch.setattr(mod, "record_step", record)


TRIGGERS = {
    "sampler int64 overflow": _sampler_overflow,
    "forward raises": _forward_raises,
    "stop check raises mid-update": _stop_check_raises,
    "schedule raises with the step in flight": _schedule_raises,
    "trace raises after the update": _record_raises,
}


def _fresh_engine(llm, **config):
    from minipaged.engine.llm_engine import LLMEngine

    e = llm.llm_engine
    cfg = dataclasses.replace(e.config, **config) if config else e.config
    return LLMEngine(cfg, model=e.model, tokenizer=e.tokenizer)


@pytest.mark.parametrize("trigger", list(TRIGGERS))
def test_a_failed_step_fails_its_requests_and_serving_goes_on(llm, baseline, trigger, monkeypatch):
    engine = _fresh_engine(llm)
    TRIGGERS[trigger](engine, monkeypatch)
    with BackgroundServer(engine, check_invariants=True) as srv:
        r = _post(srv, NORMAL)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "InternalServerError" and err["message"] == "internal server error"
        assert "Traceback" not in r.text and "injected" not in r.text and "Overflow" not in r.text
        assert len(srv.serving.engine_client.errors) == 1
        wait_idle(srv)  # every block of the failed request is free again
        assert srv.serving.engine_client.dead is None
        _serves_normally(srv, baseline)
        wait_idle(srv)
        engine.check_invariants()


def test_a_failed_step_leaves_a_waiting_request_alone(llm, baseline, monkeypatch):
    """Two requests; the step that fails runs the first only (max_num_seqs=1): the second,
    still waiting, is served with the baseline text."""
    engine = _fresh_engine(llm, max_num_seqs=1)
    real, calls = engine.model.forward, []

    def forward(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real(*a, **kw)

    monkeypatch.setattr(engine.model, "forward", forward)
    with BackgroundServer(engine, check_invariants=True) as srv:

        async def both():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                return await asyncio.gather(
                    c.post("/v1/completions", json=NORMAL), c.post("/v1/completions", json=NORMAL)
                )

        codes = sorted(
            (r.status_code, r.json().get("choices", [{}])[0].get("text")) for r in asyncio.run(both())
        )
        assert codes == [(200, baseline), (500, None)], codes
        wait_idle(srv)


def test_an_engine_that_keeps_failing_is_unusable_and_health_says_503(llm, monkeypatch):
    engine = _fresh_engine(llm)

    def forward(*a, **kw):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(engine.model, "forward", forward)
    with BackgroundServer(engine, max_step_failures=2) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        for _ in range(2):
            assert _post(srv, NORMAL).status_code == 500
        r = httpx.get(srv.url + "/health", timeout=30)
        assert r.status_code == 503 and "unusable" in r.json()["error"]["message"]
        r = _post(srv, NORMAL)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert srv.serving.engine_client.dead is not None


# -- bounded per-step cost ---------------------------------------------------------------------
def test_streamed_logprobs_are_stored_once_per_token_and_equal_offline(llm, server, client):
    ae = server.serving.engine_client
    before = ae.output_processor.num_logprob_tokens
    n, k, m = 2, 3, 24
    stream = client.completions.create(
        model=server.serving.model_name,
        prompt="The little dog",
        max_tokens=m,
        temperature=1.0,
        seed=7,
        n=n,
        logprobs=k,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = {j: [] for j in range(n)}
    for ch in stream:
        for c in ch.choices:
            if c.logprobs is not None:
                got[c.index] += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs))
    want = offline(
        llm, ["The little dog"], temperature=1.0, seed=7, n=n, logprobs=k, max_tokens=m, ignore_eos=True
    )
    tok = llm.llm_engine.tokenizer
    for j, c in enumerate(want[0].outputs):
        ref = [(tok.decode([t]), d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]
        assert [p for p, _ in got[j]] == [p for p, _ in ref]
        assert [lp for _, lp in got[j]] == pytest.approx([lp for _, lp in ref], abs=1e-4)
    # each token's logprobs were stored once, as it arrived (the old server rebuilt every past
    # token's on every step: n * m * (m + 1) / 2)
    assert ae.output_processor.num_logprob_tokens - before == n * m
    wait_idle(server)


def _brute_force_stop(text, new, stop, include):
    """Every occurrence of every stop string that ends in the last ``new`` characters; the
    earliest start wins (ties: order in ``stop``)."""
    best = None
    for s in stop:
        for i in range(len(text) - len(s) + 1):
            if text.startswith(s, i) and i + len(s) > len(text) - new:
                if best is None or i < best[0]:
                    best = (i, s)
                break
    if best is None:
        return None
    i, s = best
    return s, i + len(s) if include else i


def test_stop_strings_are_found_in_a_window_as_in_the_whole_text():
    from minipaged.engine.detokenizer import find_stop_string

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab ") for _ in range(rng.randrange(0, 30)))
        new = rng.randrange(0, len(text) + 1)
        stop = [
            "".join(rng.choice("ab ") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))
        ]
        include = rng.random() < 0.5
        # occurrences that end before the new characters were found at an earlier token
        assert find_stop_string(text, new, stop, include) == _brute_force_stop(text, new, stop, include), (
            text,
            new,
            stop,
        )


def test_output_queue_keeps_one_output_and_every_step_boundary():
    """Unread partial outputs are merged into the newest (one output held), yet the reader
    still gets one output per step, each cut at that step's tokens and text."""
    from minipaged.engine.async_llm import OutputQueue
    from minipaged.engine.outputs import CompletionOutput, RequestOutput

    def partial(rid, k):
        text = "".join(f"t{i}" for i in range(k))
        return RequestOutput(rid, None, [1], [CompletionOutput(0, text, list(range(k)))], finished=False)

    async def run():
        q = OutputQueue()
        for k in range(1, 6):
            q.put_nowait(partial("a", k))
            q.put_nowait(partial("b", k))
        assert q.qsize() == 2 and q.unread == {"a": 4, "b": 4}
        assert len(q._partial) == 2  # one output held per request, whatever the steps
        last = RequestOutput(
            "a", None, [9], [CompletionOutput(0, "done", [0, 1, 2, 3, 4, 5], "length")], True
        )
        q.put_nowait(last)
        got = [await q.get() for _ in range(11)]
        assert [g.request_id for g in got] == ["a"] * 5 + ["b"] * 5 + ["a"]
        for k, g in enumerate(got[:5], start=1):  # each step as it stood, cut from the newest
            assert g.outputs[0].token_ids == list(range(k))
            assert g.outputs[0].text == partial("a", k).outputs[0].text
        assert got[10] is last and q.empty() and q.unread == {}

    asyncio.run(run())


def test_output_queue_stream_interval_sends_the_first_token_then_every_n():
    from minipaged.engine.async_llm import OutputQueue
    from minipaged.engine.outputs import CompletionOutput, RequestOutput

    async def run():
        q = OutputQueue(stream_interval=3)
        sizes = []
        for k in range(1, 9):
            q.put_nowait(RequestOutput("a", None, [1], [CompletionOutput(0, "x" * k, list(range(k)))], False))
            while not q.empty():
                sizes.append(len(q.get_nowait().outputs[0].token_ids))
        q.put_nowait(
            RequestOutput("a", None, [1], [CompletionOutput(0, "x" * 9, list(range(9)), "length")], True)
        )
        sizes.append(len(q.get_nowait().outputs[0].token_ids))
        return sizes

    assert asyncio.run(run()) == [1, 4, 7, 9]  # vLLM's rule: the first, every 3 more, the last


def test_an_unread_stream_is_aborted_and_holds_one_output(llm):
    """A stream nobody reads: its queue holds one merged partial output, and after
    ``max_unread_steps`` steps the request is aborted and its blocks freed."""
    from minipaged.engine.async_llm import AsyncLLM, StreamOverflow

    engine = _fresh_engine(llm)
    ids = list(llm.llm_engine.tokenizer("Once upon a time")["input_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def run():
        ae = AsyncLLM(engine, check_invariants=True, max_unread_steps=5)
        await ae.start()
        try:
            (stream,) = ae.add_requests([("slow", ids, params)], stream=True)
            for _ in range(600):
                if "slow" not in ae.streams:
                    break
                assert len(stream.queue._partial) <= 1  # merged: one output held, not one per step
                await asyncio.sleep(0.02)
            items = []
            while not stream.queue.empty():
                items.append(stream.queue.get_nowait())
            return ae, items, stream
        finally:
            await ae.shutdown()

    ae, items, stream = asyncio.run(run())
    # the dropped stream's outputs are let go: the reader gets the overflow alone
    assert len(items) == 1 and isinstance(items[0], StreamOverflow), items
    assert stream.queue.dropped.is_set() and ae.num_unread_dropped == 1
    assert not engine.core.has_unfinished_requests()
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.num_blocks
    assert ae.errors == []


# -- transport -----------------------------------------------------------------------------
def _has_httptools() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(
    scope="module",
    params=[
        "h11",
        pytest.param(
            "httptools",
            marks=pytest.mark.skipif(not _has_httptools(), reason="httptools is not installed"),
        ),
    ],
)
def impatient(llm, request):
    """A server with short header and body deadlines, on each HTTP parser it can run."""
    from _serve_helpers import serve_engine

    with serve_engine(llm, body_timeout=0.5, header_timeout=0.5, http=request.param) as srv:
        yield srv


def _read_all(sock) -> bytes:
    sock.settimeout(30)  # a guard, not a measurement: the server must close first
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_a_lying_content_length_gets_408_and_a_closed_connection(impatient, baseline):
    with socket.create_connection((impatient.host, impatient.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "Once'
        )
        data = _read_all(s)
    assert data.startswith(b"HTTP/1.1 408"), data[:100]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408
    _serves_normally(impatient, baseline)


def test_an_endless_chunked_body_is_cut_off(impatient, baseline):
    with socket.create_connection((impatient.host, impatient.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"pro\r\n'
        )
        data = _read_all(s)
    assert data.startswith(b"HTTP/1.1 408"), data[:100]
    _serves_normally(impatient, baseline)


def test_headers_that_never_end_get_the_connection_closed(impatient, baseline):
    with socket.create_connection((impatient.host, impatient.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert _read_all(s) == b""
    _serves_normally(impatient, baseline)


def test_headers_over_the_cap_get_the_connection_closed(impatient, baseline):
    from minipaged.entrypoints.openai.api_server import MAX_HEADER_BYTES

    with socket.create_connection((impatient.host, impatient.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(2 * MAX_HEADER_BYTES // 1024):
                s.sendall(f"x-pad-{i}: ".encode() + b"a" * 1000 + b"\r\n")
        except OSError:
            pass  # the server closed the connection while we sent
        try:
            data = _read_all(s)
        except ConnectionResetError:  # closed with our bytes unread: a reset, no answer
            data = b""
    assert b"200 OK" not in data, data[:100]
    _serves_normally(impatient, baseline)


def test_trace_can_be_turned_off(llm):
    engine = _fresh_engine(llm)
    with BackgroundServer(engine, enable_trace=False) as srv:
        for path in ("/trace", "/trace?format=json", "/"):
            r = httpx.get(srv.url + path, timeout=30)
            assert r.status_code == 404 and "--disable-trace" in r.json()["error"]["message"]


@pytest.mark.parametrize("layers", ["Scheduler", "PaperScheduler swap"])
def test_scheduler_fail_step_frees_the_step_and_schedules_again(layers):
    """``Scheduler.fail_step(output)``: the step's unfinished requests are FINISHED_ABORTED
    with the reason, their blocks free, the in-flight step cleared; a request that was not
    in the step is untouched and the next ``schedule()`` runs it."""
    from minipaged.core import Request, RequestStatus, Scheduler
    from minipaged.core.sched import PaperScheduler

    if layers == "Scheduler":
        sched = Scheduler(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    else:
        sched = PaperScheduler(
            num_blocks=8,
            block_size=4,
            max_num_seqs=2,
            max_num_batched_tokens=64,
            preemption_mode="swap",
            num_cpu_blocks=8,
        )
    params = SamplingParams(temperature=0.0, max_tokens=4)
    reqs = [Request(f"r{i}", [1, 2, 3, 4, 5], params, eos_token_id=None) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    with pytest.raises(RuntimeError, match="twice"):
        sched.schedule()  # what the server hit on every request after the overflow
    failed = sched.fail_step(out, "engine error: RuntimeError: Overflow")
    assert [r.request_id for r in failed] == ["r0", "r1"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED and "Overflow" in r.stop_reason for r in failed)
    assert sched.kv_cache_manager.get_num_free_blocks() == 8
    sched.check_invariants()
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r2"] and reqs[2].status == RequestStatus.RUNNING
    sched.update_from_output(out, {"r2": 7})
    sched.check_invariants()
