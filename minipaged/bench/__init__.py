"""Benchmarks that run real models (outside the serving path): ``serving.py`` (the
``minipaged bench`` command and ``benchmarks/serving.py``), ``hf_baselines.py``
(transformers' static ``generate`` and continuous batching, and seeded random Llamas),
``result.py`` (``ServeResult``, what each system returns)."""
