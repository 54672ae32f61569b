"""``minipaged serve``: several prompts in one ``/v1/completions`` request, and ``echo``.

The server runs in this process (``BackgroundServer``, 127.0.0.1, a free port) with
``check_invariants=True``. Clients: the official ``openai`` package and plain ``httpx``.
The reference for every output is offline ``LLM.generate`` on the same prompts and
sampling parameters; the reference for the choice numbering is OpenAI's and vLLM's
(prompt ``p``, sample ``j`` -> ``index = p * n + j``); for echo, the prompt's text (a
token-id prompt: ``tokenizer.decode(ids)``, as vLLM detokenizes it).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install openai)")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="fastapi is not installed")
pytest.importorskip("uvicorn", reason="uvicorn is not installed")

from _serve_helpers import (  # noqa: E402
    ENGINE_MODES,
    check_engine,
    free_blocks,
    num_unfinished,
    offline,
    serve_engine,
    wait_idle,
)

from minipaged import SamplingParams  # noqa: E402
from minipaged.entrypoints.openai.api_server import BackgroundServer  # noqa: E402
from minipaged.entrypoints.openai.protocol import PromptError, split_prompts  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big"]


@pytest.fixture(scope="module", params=ENGINE_MODES)
def server(request, llm):
    """Every test on this fixture runs twice: engine in-process, and an engine-core process."""
    with serve_engine(llm, engine_process=request.param == "engine-process") as srv:
        yield srv


def ids_of(llm, text):
    return list(llm.get_tokenizer()(text)["input_ids"])


def post(server, body, path="/v1/completions"):
    return httpx.post(server.url + path, json=body, timeout=120)


def aborted(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in fam.samples:
            if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort":
                return s.value
    return 0.0


# -- the four forms of prompt -----------------------------------------------------------------
def test_split_prompts_tells_the_four_forms_apart():
    assert split_prompts("a b") == [("prompt", "a b")]
    assert split_prompts([5, 6]) == [("prompt", [5, 6])]
    assert split_prompts(["a", "b"]) == [("prompt[0]", "a"), ("prompt[1]", "b")]
    assert split_prompts([[5], [6, 7]]) == [("prompt[0]", [5]), ("prompt[1]", [6, 7])]
    for bad, param in [
        ([], "prompt"),
        ([1, "a"], "prompt[1]"),
        (["a", [1]], "prompt[1]"),
        ([True], "prompt[0]"),
    ]:
        with pytest.raises(PromptError) as e:
            split_prompts(bad)
        assert e.value.param == param


def test_several_prompts_equal_offline(llm, server, client):
    ref = offline(llm, PROMPTS, temperature=0.0, max_tokens=12)
    r = client.completions.create(
        model=server.serving.model_name, prompt=PROMPTS, max_tokens=12, temperature=0.0
    )
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    for c, want in zip(r.choices, ref):
        assert c.text == want.outputs[0].text
        assert c.finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in ref)
    assert r.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in ref)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    wait_idle(server)


def test_index_is_prompt_major_with_n(llm, server, client):
    """Seeded sampling, n=2: choice p * 2 + j is sample j of prompt p offline."""
    kw = dict(temperature=0.8, top_p=0.9, seed=77, max_tokens=10)
    prompts = PROMPTS[:3]
    ref = offline(llm, prompts, n=2, **kw)
    r = client.completions.create(model=server.serving.model_name, prompt=prompts, n=2, **kw)
    got = {c.index: c.text for c in r.choices}
    assert sorted(got) == list(range(6))
    for p, want in enumerate(ref):
        for j, c in enumerate(want.outputs):
            assert got[p * 2 + j] == c.text, (p, j)
    assert r.usage.completion_tokens == sum(len(c.token_ids) for w in ref for c in w.outputs)
    # streamed: the same six texts under the same indices
    texts = [""] * 6
    for ch in client.completions.create(
        model=server.serving.model_name, prompt=prompts, n=2, stream=True, **kw
    ):
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [c.text for w in ref for c in w.outputs]


def test_token_id_prompts_list_of_lists(llm, server, client):
    ids = [ids_of(llm, p) for p in PROMPTS[:3]]
    ref = offline(llm, ids, temperature=0.0, max_tokens=8)
    r = client.completions.create(model=server.serving.model_name, prompt=ids, max_tokens=8, temperature=0.0)
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in ref]
    assert r.usage.prompt_tokens == sum(len(x) for x in ids)


def test_streaming_several_prompts(llm, server, client):
    ref = offline(llm, PROMPTS, temperature=0.0, max_tokens=16)
    chunks = list(
        client.completions.create(
            model=server.serving.model_name,
            prompt=PROMPTS,
            max_tokens=16,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, order, reasons = [""] * len(PROMPTS), [], {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            order.append(c.index)
            if c.finish_reason is not None:
                assert c.index not in reasons, "two finish reasons for one choice"
                reasons[c.index] = c.finish_reason
    assert texts == [w.outputs[0].text for w in ref]
    assert reasons == {p: w.outputs[0].finish_reason for p, w in enumerate(ref)}
    # the prompts ran together: their chunks interleave (not all of prompt 0 first)
    assert order != sorted(order), order
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in ref)
    assert usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in ref)
    wait_idle(server)


# -- echo -------------------------------------------------------------------------------------
def test_echo_returns_prompt_and_completion(llm, server, client):
    ids = ids_of(llm, "The little dog")
    prompts = ["Once upon a time", "Lily wanted to"]
    ref = offline(llm, prompts, temperature=0.0, max_tokens=10)
    r = client.completions.create(
        model=server.serving.model_name, prompt=prompts, max_tokens=10, temperature=0.0, echo=True
    )
    assert [c.text for c in r.choices] == [p + w.outputs[0].text for p, w in zip(prompts, ref)]
    assert r.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in ref)
    # a token-id prompt echoes its detokenized text (special tokens kept, as vLLM's decode)
    want = offline(llm, [ids], temperature=0.0, max_tokens=6)[0].outputs[0].text
    r = client.completions.create(
        model=server.serving.model_name, prompt=ids, max_tokens=6, temperature=0.0, echo=True
    )
    prompt_text = llm.get_tokenizer().decode(ids)
    assert prompt_text.endswith("The little dog")
    assert r.choices[0].text == prompt_text + want


def test_streaming_echo_first_chunk_carries_the_prompt(llm, server, client):
    prompts = ["Once upon a time", "The little dog"]
    ref = offline(llm, prompts, temperature=0.0, max_tokens=10)
    first, texts = {}, [""] * 2
    for ch in client.completions.create(
        model=server.serving.model_name,
        prompt=prompts,
        max_tokens=10,
        temperature=0.0,
        echo=True,
        stream=True,
    ):
        for c in ch.choices:
            first.setdefault(c.index, c.text)
            texts[c.index] += c.text
    for p, prompt in enumerate(prompts):
        assert first[p].startswith(prompt)
        assert texts[p] == prompt + ref[p].outputs[0].text


def test_echo_with_max_tokens_0_returns_just_the_prompt(llm, server, client):
    prompts = ["Once upon a time", "The little dog"]
    r = client.completions.create(model=server.serving.model_name, prompt=prompts, max_tokens=0, echo=True)
    assert [c.text for c in r.choices] == prompts
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == sum(len(ids_of(llm, p)) for p in prompts)
    chunks = list(
        client.completions.create(
            model=server.serving.model_name,
            prompt=prompts,
            max_tokens=0,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [""] * 2
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == prompts
    assert chunks[-1].usage.completion_tokens == 0
    wait_idle(server)


def test_max_tokens_0_without_echo_and_echo_with_logprobs_are_400(server):
    r = post(server, {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text
    r = post(server, {"prompt": "x", "max_tokens": 4, "echo": True, "logprobs": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and "echo" in err["message"] and "logprobs" in err["message"], r.text


# -- bad input: one bad prompt rejects the whole request, nothing enters the engine -----------
def bad_prompt_cases():
    return {
        "empty string at 2": (["a", "b", "", "c"], "prompt[2]", "empty"),
        "empty id list at 1": ([[5, 6], [], [7]], "prompt[1]", "empty"),
        "id outside the vocabulary at 2": ([[5], [6], [10**6]], "prompt[2]", "vocabulary"),
        "too long at 1": ([[5], list(range(3, 603))], "prompt[1]", "context"),
        "mixed forms": ([[5], "a"], "prompt[1]", "prompt must be"),
        "not a token id inside": ([[5], [6, "x"]], "prompt[1]", "token ids"),
        "empty list": ([], "prompt", "empty"),
    }


@pytest.mark.parametrize("case", list(bad_prompt_cases()))
def test_a_bad_prompt_anywhere_is_a_400_naming_it(server, case):
    prompt, param, word = bad_prompt_cases()[case]
    before = server.serving.engine_client.num_steps
    r = post(server, {"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and word in err["message"], err
    assert server.serving.engine_client.num_steps == before  # no prompt reached the engine
    wait_idle(server)


def test_context_overflow_at_one_prompt_is_a_400(server):
    r = post(server, {"prompt": ["a", "b " * 300], "max_tokens": 300})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens" and "prompt[1]" in err["message"], err
    wait_idle(server)


def test_more_prompts_than_the_waiting_queue_is_a_400(server):
    limit = server.serving.engine_client.max_waiting_requests
    r = post(server, {"prompt": ["a"] * (limit + 1), "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and str(limit) in err["message"], err
    wait_idle(server)


# -- hang-ups --------------------------------------------------------------------------------
def test_hang_up_mid_stream_aborts_every_prompt(server, client):
    before = aborted(server)
    stream = client.completions.create(
        model=server.serving.model_name, prompt=PROMPTS, max_tokens=400, temperature=0.0, stream=True
    )
    seen = set()
    for ch in stream:
        seen |= {c.index for c in ch.choices}
        if len(seen) == len(PROMPTS):
            break
    engine = server.serving.engine
    assert num_unfinished(server) == len(PROMPTS)
    assert free_blocks(server) < engine.num_blocks
    stream.close()
    wait_idle(server)  # every block is free again
    assert aborted(server) == before + len(PROMPTS)
    check_engine(server)


def test_hang_up_while_waiting_for_a_non_streaming_answer(server):
    body = json.dumps({"prompt": PROMPTS, "max_tokens": 400, "temperature": 0.0}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = aborted(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while num_unfinished(server) < len(PROMPTS):
            assert time.monotonic() < deadline, "the requests never started"
            time.sleep(0.02)
    wait_idle(server)
    assert aborted(server) == before + len(PROMPTS)


def test_a_prompt_the_pool_can_never_hold_fails_the_whole_request(llm):
    """prompt[1] needs more KV blocks than the whole pool: the engine refuses it; the
    request is a 400 naming prompt[1] (streamed: an error event), and prompt[0], which
    fits, is aborted rather than left running."""
    import dataclasses

    from minipaged.engine.llm_engine import LLMEngine

    e = llm.llm_engine
    config = dataclasses.replace(e.config, num_blocks=8)  # 8 blocks of block_size tokens
    engine = LLMEngine(config, model=e.model, tokenizer=e.tokenizer)
    long_ids = list(range(3, 3 + 7 * config.block_size))
    body = {"prompt": [ids_of(llm, "Once upon a time"), long_ids], "max_tokens": 2 * config.block_size}
    with BackgroundServer(engine, check_invariants=True) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={**body, "temperature": 0.0}, timeout=120)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt[1]" and "KV" in err["message"], err
        wait_idle(srv)
        with httpx.stream(
            "POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=120
        ) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["param"] == "prompt[1]", events[-1]
        wait_idle(srv)
        engine.check_invariants()
        assert srv.serving.engine_client.errors == []


def test_add_requests_is_all_or_none(llm):
    """``AsyncLLM.add_requests``: with one request waiting in a queue of 3, three more do
    not fit (``QueueFull``, none of them queued); two do, on one shared queue, and their
    outputs there equal offline ``LLM.generate``."""
    import asyncio

    from minipaged.engine.async_llm import AsyncLLM, QueueFull
    from minipaged.engine.llm_engine import LLMEngine

    e = llm.llm_engine
    engine = LLMEngine(e.config, model=e.model, tokenizer=e.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    ids = [ids_of(llm, p) for p in PROMPTS]
    ref = offline(llm, PROMPTS[:3], temperature=0.0, max_tokens=6)

    async def run():
        ae = AsyncLLM(engine, max_waiting_requests=3, check_invariants=True)
        await ae.start()  # NOTE: the loop task runs only once this coroutine awaits
        try:
            first = ae.add_requests([("a", ids[0], params)])
            with pytest.raises(QueueFull):
                ae.add_requests([(f"b{p}", ids[p], params) for p in (1, 2, 3)])
            assert list(ae.streams) == ["a"]
            queue = asyncio.Queue()
            more = ae.add_requests([("c1", ids[1], params), ("c2", ids[2], params)], queue=queue)
            assert all(s.queue is queue for s in more) and ae.num_waiting() == 3
            out = await asyncio.wait_for(first[0].queue.get(), 60)
            while not out.finished:
                out = await asyncio.wait_for(first[0].queue.get(), 60)
            done = {"a": out}
            while len(done) < 3:
                out = await asyncio.wait_for(queue.get(), 60)
                if out.finished:
                    done[out.request_id] = out
            return done
        finally:
            await ae.shutdown()

    done = asyncio.run(run())
    assert [done[r].outputs[0].text for r in ("a", "c1", "c2")] == [w.outputs[0].text for w in ref]
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.num_blocks
