"""minipaged/viz/batch.py: one step's packed ragged batch, drawn and printed.

The ModelInput comes from the real worker (``ModelRunner.prepare_inputs``) fed a
hand-written ``SchedulerOutput`` (plain data, no scheduler): a 5-token prefill in blocks
[3, 6], one decode, and a 2-token chunk at positions 4-5. The slots are worked out by hand
(``table[i // 4] * 4 + i % 4``), independently of both the runner and the module.
"""

from __future__ import annotations

import dataclasses

import pytest
from _counting_model import CountingModel

from minipaged import SamplingParams
from minipaged.core.sched.output import NewRequestData, SchedulerOutput
from minipaged.viz.batch import packed_batch, packed_batch_rows, packed_batch_text
from minipaged.worker import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _input():
    out = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("a", [1, 2, 3, 4, 5], [], GREEDY, [3, 6], 0),
            NewRequestData("b", [7, 8, 9], [11], GREEDY, [1], 3),  # decodes its token 11 at position 3
            NewRequestData("c", [2] * 6, [], GREEDY, [0, 5], 4),  # chunk: positions 4, 5
        ],
        num_scheduled_tokens={"a": 5, "b": 1, "c": 2},
        total_num_scheduled_tokens=8,
    )
    runner = ModelRunner(CountingModel(), num_blocks=8, block_size=4)
    runner.update_states(out)
    return runner.prepare_inputs(out), list(out.num_scheduled_tokens)


def test_rows_and_slots_by_hand():
    inp, ids = _input()
    rows = packed_batch_rows(inp, ids, 4)
    assert [r["req"] for r in rows] == ["a"] * 5 + ["b"] + ["c"] * 2
    assert [r["position"] for r in rows] == [0, 1, 2, 3, 4, 3, 4, 5]
    # a: 3*4+0..3, then 6*4+0; b: position 3 in block 1 -> 7; c: positions 4, 5 in block 5
    assert [r["slot"] for r in rows] == [12, 13, 14, 15, 24, 7, 20, 21]
    assert [r["block"] for r in rows] == [3, 3, 3, 3, 6, 1, 5, 5]
    assert [r["token"] for r in rows] == [1, 2, 3, 4, 5, 11, 2, 2]


def test_text_names_every_sequence_and_its_blocks():
    inp, ids = _input()
    text = packed_batch_text(inp, ids, 4)
    assert "T = 8 rows from B = 3 sequences" in text
    assert "cu_seqlens_q [0, 5, 6, 8]" in text
    assert "rows 6:8 (2 rows: positions 4..5), seq_len 6, block_tables row [0, 5]" in text
    assert "rows 5:6 (1 row: positions 3..3), seq_len 4, block_tables row [1]" in text  # padding not shown


def test_figure_draws_every_row_and_every_used_block():
    inp, ids = _input()
    fig = packed_batch(inp, ids, 4, managed=False)
    cells = [p for p in fig.axes[0].patches if p.get_width() == 1]  # 3 strip cells per row
    blocks = [p for p in fig.axes[0].patches if p.get_width() != 1]
    assert len(cells) == 3 * 8 and len(blocks) == 2 + 1 + 2


def test_bad_input_names_the_argument():
    inp, ids = _input()
    with pytest.raises(ValueError, match="req_ids"):
        packed_batch_rows(inp, ids[:2], 4)
    bad = dataclasses.replace(inp, slot_mapping=inp.slot_mapping.clone())
    bad.slot_mapping[0] = 3
    with pytest.raises(ValueError, match="inp: row 0"):
        packed_batch_rows(bad, ids, 4)
    short = dataclasses.replace(inp, positions=inp.positions[:-1])
    with pytest.raises(ValueError, match="inp:"):
        packed_batch_text(short, ids, 4)
