"""``minipaged serve`` under load: many streaming clients, some of them hanging up.

200 streaming requests from 32 concurrent clients (the official async ``openai``
client) on a pool small enough that requests get preempted; 20 of them close their
stream at a random point. ``check_invariants()`` runs after every engine step. Checked:
every completed greedy text equals offline ``LLM.generate`` for the same prompt; once
the load ends no block is held; ``/v1/models`` answered 200 throughout. Bounded: a fixed
number of requests, each with a timeout; no timed assertion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install openai)")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="fastapi is not installed")

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.entrypoints.openai.api_server import BackgroundServer  # noqa: E402

NUM_REQUESTS, NUM_CLIENTS, NUM_DISCONNECTS = 200, 32, 20
STARTS = [
    "Once upon a time",
    "The little dog",
    "Lily wanted to",
    "One day, a big",
    "Tom and Sue",
    "The sun was",
    "A small bird",
    "Max found a",
    "In the park,",
    "The cat said",
]
MAX_TOKENS = [8, 28]


def test_load_with_disconnects():
    llm = LLM()
    prompts = [(p, m) for p in STARTS for m in MAX_TOKENS]
    ref = {}
    for m in MAX_TOKENS:
        outs = llm.generate(STARTS, SamplingParams(temperature=0.0, max_tokens=m), use_tqdm=False)
        for p, o in zip(STARTS, outs):
            ref[(p, m)] = o.outputs[0].text

    from minipaged.engine.llm_engine import LLMEngine

    e = llm.llm_engine
    # NOTE: 20 blocks of 16 tokens for up to 16 running requests of up to 2 blocks each:
    # the scheduler has to preempt, and greedy outputs must not change.
    config = dataclasses.replace(e.config, num_blocks=20, max_num_seqs=16)
    engine = LLMEngine(config, model=e.model, tokenizer=e.tokenizer)
    rng = random.Random(0)
    plan = [prompts[rng.randrange(len(prompts))] for _ in range(NUM_REQUESTS)]
    quitters = dict.fromkeys(rng.sample(range(NUM_REQUESTS), NUM_DISCONNECTS))
    for i in quitters:
        quitters[i] = rng.randrange(0, plan[i][1] - 1)  # chunks read before hanging up

    with BackgroundServer(engine, check_invariants=True, max_waiting_requests=NUM_REQUESTS) as srv:
        model = srv.serving.model_name
        results: dict[int, tuple[str, str]] = {}
        model_polls: list[int] = []

        async def client_task(queue: asyncio.Queue, client) -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                prompt, max_tokens = plan[i]
                stream = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
                )
                text, reason, n = "", None, 0
                async for ch in stream:
                    if i in quitters and n == quitters[i]:
                        break
                    n += 1
                    text += ch.choices[0].text
                    reason = ch.choices[0].finish_reason or reason
                await stream.close()
                if i not in quitters:
                    results[i] = (text, reason)

        async def poll_models(done: asyncio.Event) -> None:
            async with httpx.AsyncClient(timeout=30) as h:
                while not done.is_set():
                    model_polls.append((await h.get(srv.url + "/v1/models")).status_code)
                    await asyncio.sleep(0.25)

        async def main() -> None:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
            queue: asyncio.Queue = asyncio.Queue()
            for i in range(NUM_REQUESTS):
                queue.put_nowait(i)
            done = asyncio.Event()
            poller = asyncio.create_task(poll_models(done))
            await asyncio.gather(*(client_task(queue, client) for _ in range(NUM_CLIENTS)))
            done.set()
            await poller
            await client.close()

        t0 = time.monotonic()
        asyncio.run(main())
        elapsed = time.monotonic() - t0

        # every completed greedy output equals the offline one
        assert len(results) == NUM_REQUESTS - NUM_DISCONNECTS
        wrong = [(i, plan[i], results[i][0], ref[plan[i]]) for i in results if results[i][0] != ref[plan[i]]]
        assert not wrong, wrong[:3]
        assert all(reason in ("stop", "length") for _, reason in results.values())
        # /v1/models answered throughout
        assert model_polls and all(code == 200 for code in model_polls)
        # no block leaked once the load ended, no request left, no step raised
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() or srv.serving.engine_client.streams:
            assert time.monotonic() < deadline, "requests left in the engine after the load"
            time.sleep(0.05)
        assert engine.kv_cache_manager.get_num_free_blocks() == engine.num_blocks
        assert srv.serving.engine_client.errors == []
        engine.check_invariants()
        steps = srv.serving.engine_client.num_steps
        from prometheus_client.parser import text_string_to_metric_families

        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
        preemptions = fams["vllm:num_preemptions"].samples[0].value
        print(
            f"\n{NUM_REQUESTS} requests, {NUM_CLIENTS} clients, {NUM_DISCONNECTS} hang-ups: "
            f"{steps} steps, {preemptions:.0f} preemptions in {elapsed:.1f} s"
        )
        assert preemptions > 0, "the pool was meant to be small enough to force preemptions"
    assert steps > 0
