"""minipaged.entrypoints: ways in from outside the process (today: the OpenAI HTTP server).

Mirrors vLLM ``vllm/entrypoints`` (``llm.py`` is ``minipaged.engine.llm`` here).
"""
