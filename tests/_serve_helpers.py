"""What the ``minipaged serve`` test modules share: a ``BackgroundServer`` on an offline
``LLM``'s model with ``check_invariants=True`` (``serve_engine``), an ``openai`` client, the
offline reference (``offline``) and ``wait_idle`` (no request left, every block free)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from minipaged import SamplingParams


@contextmanager
def serve_engine(llm, **kw):
    """A server in this process on a fresh engine over ``llm``'s model; on exit, the async
    engine must have recorded no error."""
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints.openai.api_server import BackgroundServer

    e = llm.llm_engine
    engine = LLMEngine(e.config, model=e.model, tokenizer=e.tokenizer)
    with BackgroundServer(engine, check_invariants=True, **{"max_n": 4, **kw}) as srv:
        yield srv
    assert srv.serving.async_engine.errors == []


def openai_client(server, timeout=120):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=timeout)


def offline(llm, prompts, **kw):
    """The reference: offline ``LLM.generate`` on the same prompts and sampling parameters."""
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def wait_idle(server, timeout=30.0):
    """Until the engine holds no request and every block is free again."""
    engine = server.serving.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            not server.serving.async_engine.streams
            and not engine.has_unfinished_requests()
            and engine.kv_cache_manager.get_num_free_blocks() == engine.num_blocks
        ):
            return
        time.sleep(0.05)
    raise AssertionError(
        f"not idle after {timeout} s: {engine.get_num_unfinished_requests()} unfinished, "
        f"{engine.num_blocks - engine.kv_cache_manager.get_num_free_blocks()} blocks held"
    )
