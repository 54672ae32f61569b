"""Shared test setup.

On a machine without CUDA the Triton kernels run in Triton's interpreter; the variable
must be set before triton is first imported, so it is set here, at collection time.
(Notebook kernels inherit it too, which is what we want.)

The fixtures ``llm``, ``server`` and ``client`` are the ``minipaged serve`` tests'
(``test_serve*.py``): the offline ``LLM`` (the reference), a ``BackgroundServer`` on its model
and an ``openai`` client, one each per module (``_serve_helpers``). A module's own fixture of
the same name takes precedence.

NOTE: matplotlib's backend is chosen in-process with ``matplotlib.use`` rather than by
exporting MPLBACKEND: an exported MPLBACKEND=Agg leaks into the nbval notebook kernels,
where ``plt.show()`` would then display nothing and every figure cell would differ.
"""

import os

import pytest

try:
    import matplotlib

    matplotlib.use("Agg")
except ImportError:
    pass

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # core tests run without torch
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def llm():
    from minipaged import LLM

    return LLM()


@pytest.fixture(scope="module")
def server(llm):
    from _serve_helpers import serve_engine

    with serve_engine(llm) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from _serve_helpers import openai_client

    return openai_client(server)
