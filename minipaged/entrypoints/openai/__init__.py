"""``minipaged serve``: the OpenAI-compatible HTTP server on one ``LLMEngine``.

=====================  ============================================================
``protocol.py``        request bodies (pydantic, unknown fields refused) and errors
``serving.py``         the request path (over ``minipaged/engine/async_llm.py``): parse, validate, submit, stream text deltas
``metrics.py``         ``/metrics``: Prometheus text with vLLM v1's metric names
``api_server.py``      the FastAPI app and ``minipaged serve``
``live.py``            the live page at ``/`` and the notebook helpers
=====================  ============================================================

Mirrors vLLM ``vllm/entrypoints/openai/`` (``api_server.py``, ``protocol.py``,
``serving_completion.py``, ``serving_chat.py``) over ``vllm/v1/engine/async_llm.py``.
Needs ``fastapi`` and ``uvicorn`` (runtime dependencies of minipaged).
"""
