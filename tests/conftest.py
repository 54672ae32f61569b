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

Parallel runs (pytest-xdist, ``-n 2 --dist loadfile``, as .ci/run runs the suite): every test
file and every notebook runs in one worker, in order (nbval's cells share the notebook's
kernel; module fixtures load their model once); every test that grades (tests/grading,
tests/test_student_path.py) is in one work unit, "grader" (``pytest_xdist_make_scheduler``):
the sandbox users (``minipaged-grader``, ``-1``..) and their per-uid process limits are shared
by all processes of a machine, so two workers must not grade at once. A worker's torch runs on one thread (two
workers share the cores).
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


if os.environ.get("PYTEST_XDIST_WORKER"):
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass

# the tests that run ``minipaged grade`` (kernels as the sandbox users): one xdist work unit
GRADER_PATHS = ("tests/grading/", "tests/test_student_path.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with every grading test file in one work unit (see above).
    NOTE: a scheduler, not ``xdist_group`` marks: pytest 9.2 ignores the node id suffix xdist 3.8
    gives a marked test, so ``--dist loadgroup`` would send each nbval cell anywhere."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GraderAsOneFile(LoadFileScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return "grader" if path.startswith(GRADER_PATHS) else path

    return GraderAsOneFile(config, log)


@pytest.fixture(scope="session")
def student_build_cache(tmp_path_factory):
    """One cache folder of student builds (``student_build(chapter, cache_dir)``) for the tests
    that build into a folder of their own: each chapter is built once per session."""
    return tmp_path_factory.mktemp("student-builds")


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
