"""The slot formula ``table[i // bs] * bs + i % bs`` is written once on the worker side
(``minipaged.model.input.compute_slot_mapping``), and the runner, the draft model and a
tensor-parallel shard all build their ``slot_mapping`` with it. The scheduler side keeps its
own teaching copy (``core/kv/block_table.py``'s ``BlockTable.slot``)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from minipaged.model.input import build_model_input, compute_slot_mapping

ROOT = Path(__file__).resolve().parents[2] / "minipaged"
WORKER_SIDE = ("worker", "model", "spec_decode", "distributed", "executor", "engine", "sample", "kernels")
# table[i // bs] * bs + i % bs (or table[i // bs].block_id * bs + ...), any names, any spacing
FORMULA = re.compile(r"\w+\s*\[\s*(\w+)\s*//\s*(\w+)\s*\](?:\s*\.\s*\w+)?\s*\*\s*\2\s*\+\s*\1\s*%\s*\2")


def _code(path: Path) -> str:
    """The file's code without its comments and strings (docstrings state the formula too)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            out.append(tok.string)
    return " ".join(out)


def _hits(folders) -> list[str]:
    return [
        str(p.relative_to(ROOT.parent))
        for folder in folders
        for p in sorted((ROOT / folder).rglob("*.py"))
        for _ in FORMULA.finditer(_code(p))
    ]


def test_the_slot_formula_is_written_once_on_the_worker_side():
    assert _hits(WORKER_SIDE) == ["minipaged/model/input.py"]


def test_the_search_finds_the_scheduler_side_teaching_copy():
    assert "minipaged/core/kv/block_table.py" in _hits(["core"])


def test_compute_slot_mapping_and_build_model_input():
    assert compute_slot_mapping([7, 2, 5], 3, 9, 4) == [7 * 4 + 3, 8, 9, 10, 11, 20]
    with pytest.raises(RuntimeError, match="cannot hold position 12"):
        compute_slot_mapping([7, 2, 5], 10, 13, 4)
    inp = build_model_input([([7, 2], 5, [11, 12]), ([3], 0, [13])], 4)
    assert inp.slot_mapping.tolist() == [9, 10, 12]
    assert inp.positions.tolist() == [5, 6, 0] and inp.seq_lens.tolist() == [7, 1]
    assert inp.block_tables.tolist() == [[7, 2], [3, 0]] and inp.cu_seqlens_q.tolist() == [0, 2, 3]
    assert inp.logits_indices.tolist() == [1, 2] and (inp.max_query_len, inp.max_seq_len) == (2, 7)
