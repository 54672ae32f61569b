"""minipaged.engine: the loop that serves requests on a real model.

``LLM`` (front door) -> ``LLMEngine`` (offline) or ``AsyncLLM`` (the server), each with a
``Processor`` (prompts in) and an ``OutputProcessor`` (outputs out) -> an engine-core
client (``core_client.py``) -> ``EngineCore(scheduler, executor)`` (``core.py``: one step
= schedule, execute, update) -> the executor's worker, ``minipaged.worker.ModelRunner``
(its own block tables from SchedulerOutput, cache moves, forward, and the samplers of
``minipaged.sample``). Mirrors vLLM ``vllm/v1/engine`` + ``vllm/v1/worker``.

NOTE: names are imported lazily, so that importing this package (the ``minipaged`` CLI
builds every command's parser) does not pay for importing torch.
"""

import importlib

_LAZY = {
    "LLM": "minipaged.engine.llm",
    "LLMEngine": "minipaged.engine.llm_engine",
    "ModelRunner": "minipaged.worker.model_runner",
    "RequestOutput": "minipaged.engine.outputs",
    "CompletionOutput": "minipaged.engine.outputs",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minipaged.engine' has no attribute {name!r}")


__all__ = list(_LAZY)
