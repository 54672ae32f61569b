"""Tests for minipaged.viz.beams: beams keep their names across steps, forks are children.

The reference is the engine itself, spied on: every ``fork_request(parent, child)`` that
``LLM.beam_search`` makes is recorded with the step it happens in (a tiny random Llama,
a small pool with chunked prefills and several prompts, block sizes 2 and 4). The
lineage that ``beam_lineage`` reads back from the trace's block tables alone must name
each child's true parent. A hand-built trace checks the names and the pictures.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from _tiny_llama import make_tiny_llama  # noqa: E402
from test_viz import _drawn_texts, assert_readable  # noqa: E402

from minipaged import LLM, BeamSearchParams, viz  # noqa: E402
from minipaged.trace import EngineTrace, StepRecord  # noqa: E402
from minipaged.viz.beams import beam_lineage, beam_tables, beam_tables_text  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("beam_viz_llama"))


def spied_beam_search(path, prompts, k, max_tokens, **engine):
    from minipaged.core import PaperScheduler  # beam search runs the paper's scheduler

    llm = LLM(model=path, seed=0, **engine)
    forks = []  # (step, parent id, child id)
    real = PaperScheduler.fork_request

    def fork_request(self, parent, child):
        forks.append((len(llm.llm_engine.trace.steps), parent.request_id, child.request_id))
        return real(self, parent, child)

    PaperScheduler.fork_request = fork_request
    try:
        llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=max_tokens))
    finally:
        PaperScheduler.fork_request = real
    return llm.llm_engine.trace, forks


@pytest.mark.parametrize(
    "bs,k,engine",
    [
        (4, 4, dict(num_blocks=64)),
        (2, 3, dict(num_blocks=40, max_num_seqs=6, max_num_batched_tokens=8)),
    ],
)
def test_lineage_names_the_true_parent(tiny, bs, k, engine):
    prompts = [[5, 9, 17, 33, 8, 61, 7], [40, 41, 42], [70 + i for i in range(11)]]
    trace, forks = spied_beam_search(tiny, prompts, k, 10, block_size=bs, **engine)
    lineage = beam_lineage(trace)
    assert len(lineage) == len(trace.steps)
    prompt_ids = {str(i) for i in range(len(prompts))}
    checked = 0
    for step, parent, child in forks:
        now = lineage[step]
        if child not in now.name:  # forked in the prompt's last step, freed before the record
            assert trace.requests[child.split(".")[0]]["finish_step"] == step, (step, child)
            continue
        if parent in prompt_ids:  # the first beams: roots of their prompt
            assert now.parent[child] is None and child not in now.forked
            continue
        before = lineage[step - 1].name[parent]
        if child in now.forked:
            assert now.forked[child] == before, (step, parent, child)
        else:
            assert now.name[child] == before, (step, parent, child)  # it continues its parent
        checked += 1
    assert checked > 10
    # a pruned name never comes back; a new name is never reused
    gone: set = set()
    for st in lineage:
        assert not gone & set(st.name.values()), st.step
        gone |= set(st.pruned)
    # each step's forked beams and continuing beams have distinct names
    for st in lineage:
        assert len(set(st.name.values())) == len(st.name)


def hand_beams() -> EngineTrace:
    """Blocks of 2. Step 0: prompt of 3 forks into x, y (both [0, 1]). Step 1: x copies
    block 1 to 2 (first writer), y writes in place; x has children a, b; y is pruned
    (its block 1 freed). Step 2: a and b share [0, 2]; both grow (block 2 full): a gets 3,
    b gets 4; a continues, b is pruned (4 freed)."""
    t = EngineTrace(num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=8)
    t.requests = {"0": {"prompt_len": 3, "arrival_step": 0}}
    t.meta["beam_search"] = True
    S = StepRecord
    t.record(
        S(
            0,
            {"0": 3},
            block_tables={"x": [0, 1], "y": [0, 1]},
            num_tokens={"x": 3, "y": 3},
            new_block_ids=[0, 1],
        )
    )
    t.record(
        S(
            1,
            {"x": 1, "y": 1},
            block_tables={"a": [0, 2], "b": [0, 2]},
            num_tokens={"a": 4, "b": 4},
            new_block_ids=[2],
        )
    )
    t.record(S(2, {"a": 1, "b": 1}, block_tables={"c": [0, 2, 3]}, num_tokens={"c": 5}, new_block_ids=[3, 4]))
    return t


def test_lineage_by_hand():
    lin = beam_lineage(hand_beams())
    assert lin[0].name == {"x": "b0", "y": "b1"} and lin[0].parent == {"x": None, "y": None}
    assert lin[1].name == {"a": "b0", "b": "b2"} and lin[1].forked == {"b": "b0"} and lin[1].pruned == ["b1"]
    assert lin[2].name == {"c": "b0"} and lin[2].pruned == ["b2"] and lin[2].forked == {}
    assert lin[1].label("b") == "b2 (from b0)"
    # the colours follow the names: b0 keeps colour 0 at every step
    assert [st.color[r] for st, r in zip(lin, ("x", "a", "c"))] == [0, 0, 0]


def test_beam_text_and_figure_by_hand():
    t = hand_beams()
    text = beam_tables_text(t, [1, 2])
    assert "after step 1 (b2 forked from b0; pruned: b1): 2 beams, 2 blocks held, freed 1" in text
    assert "  b0            [0(x2), 2(x2)*]  (a)" in text
    assert "  b2 (from b0)  [0(x2), 2(x2)*]  (b)" in text
    assert "after step 2 (pruned: b2): 1 beams, 3 blocks held, freed 4" in text
    fig = beam_tables(t, [0, 1, 2], managed=False)
    texts = {s for s, _ in _drawn_texts(fig)[0]}
    assert {"b0", "b2 (from b0)", "x2 b0:1", "b0:2"} <= texts
    assert_readable(fig)


def test_bad_steps():
    t = hand_beams()
    for bad in (3, [], 1, [7]):
        with pytest.raises(ValueError):
            beam_tables_text(t, bad)
    with pytest.raises(ValueError):
        beam_lineage(EngineTrace(num_blocks=1, block_size=1, max_num_seqs=1, max_num_batched_tokens=1))
    assert viz.beam_tables is beam_tables
