"""What the ``minipaged serve`` test modules share: a ``BackgroundServer`` on an offline
``LLM``'s model with ``check_invariants=True`` (``serve_engine``: the engine stepped in this
process, or, with ``engine_process=True``, an engine core in its own process as
``minipaged serve`` runs it), an ``openai`` client, the offline reference (``offline``),
``wait_idle`` (no request left, every block free) and the engine's numbers read the same
way in both modes (``free_blocks``, ``num_unfinished``, ``check_engine``)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from minipaged import SamplingParams

ENGINE_MODES = ["in-process", "engine-process"]


@contextmanager
def serve_engine(llm, engine_process: bool = False, **kw):
    """A server in this process on a fresh engine over ``llm``'s model (with
    ``engine_process``, the engine core runs in a child process built from ``llm``'s
    config); on exit, the async engine must have recorded no error."""
    from minipaged.engine.core_client import MPClient
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints.openai.api_server import BackgroundServer

    e = llm.llm_engine
    if engine_process:
        engine = MPClient(e.config, check_invariants=True)
    else:
        engine = LLMEngine(e.config, model=e.model, tokenizer=e.tokenizer)
    with BackgroundServer(engine, check_invariants=True, **{"max_n": 4, **kw}) as srv:
        yield srv
    assert srv.serving.engine_client.errors == []


def in_core_process(server) -> bool:
    from minipaged.engine.core_client import MPClient

    return isinstance(server.serving.engine, MPClient)


def free_blocks(server) -> int:
    """The pool's free blocks (an engine core's: as of its last step or idle message)."""
    engine = server.serving.engine
    if in_core_process(server):
        return engine.get_num_free_blocks()
    return engine.kv_cache_manager.get_num_free_blocks()


def num_unfinished(server) -> int:
    """The engine core's unfinished sequences (in-process: now; a core process: as of its
    last message)."""
    if in_core_process(server):
        return server.serving.engine.get_num_unfinished_requests()
    return server.serving.engine.core.get_num_unfinished_requests()


def check_engine(server) -> None:
    """``LLMEngine.check_invariants()``; an engine core runs it after every step itself
    (``check_invariants=True``): a failure there is a failed step, recorded in ``errors``."""
    if in_core_process(server):
        assert server.serving.engine_client.errors == []
    else:
        server.serving.engine.check_invariants()


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
            not server.serving.engine_client.streams
            and num_unfinished(server) == 0
            and free_blocks(server) == engine.num_blocks
        ):
            return
        time.sleep(0.05)
    raise AssertionError(
        f"not idle after {timeout} s: {num_unfinished(server)} unfinished, "
        f"{engine.num_blocks - free_blocks(server)} blocks held"
    )
