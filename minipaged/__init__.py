"""minipaged: the KV cache, PagedAttention and continuous batching, small enough to read.

``from minipaged import LLM, SamplingParams`` is the public API (see README). The engine
and everything that needs torch is imported lazily, so ``minipaged.core`` works without it.
"""

from minipaged.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "LLM": "minipaged.engine.llm",
    "RequestOutput": "minipaged.engine.outputs",
    "CompletionOutput": "minipaged.engine.outputs",
    "EngineConfig": "minipaged.config",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minipaged' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
