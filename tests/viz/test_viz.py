"""Tests for minipaged.viz: the pictures, their text renderings, and `minipaged figures`.

The reference is a trace written by hand (``hand_trace``): ten steps of five requests
that go through every state (waiting, prefill in chunks, decode, running but idle,
preempted, swapped out and in, finished) with a shared block; what each picture must
show is worked out by hand below, independently of the code. Text renderings are pinned
by golden files in tests/golden/ (regenerate with MINIPAGED_UPDATE_GOLDEN=1 after
checking the diff by eye). Traces from the real Scheduler (fake model) and, where the
course model is present, from the engine are drawn too.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minipaged import figures as figures_cmd  # noqa: E402
from minipaged import viz  # noqa: E402
from minipaged.core import BlockSpaceManager  # noqa: E402
from minipaged.trace import EngineTrace, StepRecord  # noqa: E402
from minipaged.viz import figures as F  # noqa: E402
from minipaged.viz import palette  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def hand_trace() -> EngineTrace:
    """6 blocks of 4 slots, at most 3 sequences and 8 tokens per step.

    A (prompt 6) and B (prompt 5) arrive at 0; C at 1; D at 4; C.1 forks from C at 6,
    sharing C's full first block 5. B is swapped out at 5 and back in at 7; D is
    preempted (recompute) at 6 and waits again.
    """
    t = EngineTrace(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    t.requests = {
        "A": {"prompt_len": 6, "arrival_step": 0, "finish_step": 3},
        "B": {"prompt_len": 5, "arrival_step": 0, "finish_step": 8},
        "C": {"prompt_len": 5, "arrival_step": 1, "finish_step": 7},
        "D": {"prompt_len": 3, "arrival_step": 4, "finish_step": 9},
        "C.1": {"prompt_len": 5, "arrival_step": 6, "finish_step": 8},
    }
    S = StepRecord
    steps = [
        S(
            0,
            {"A": 6, "B": 2},
            prefill_ids=["A", "B"],
            arrived_ids=["A", "B"],
            block_tables={"A": [0, 1], "B": [2]},
            num_tokens={"A": 6, "B": 2},
            new_block_ids=[0, 1, 2],
            num_free_blocks=3,
        ),
        S(
            1,
            {"A": 1, "B": 3},
            prefill_ids=["B"],
            decode_ids=["A"],
            arrived_ids=["C"],
            waiting_ids=["C"],
            block_tables={"A": [0, 1], "B": [2, 3]},
            num_tokens={"A": 7, "B": 5},
            new_block_ids=[3],
            num_free_blocks=2,
        ),
        S(
            2,
            {"A": 1, "B": 1},
            decode_ids=["A", "B"],
            waiting_ids=["C"],
            block_tables={"A": [0, 1], "B": [2, 3]},
            num_tokens={"A": 8, "B": 6},
            num_free_blocks=2,
        ),
        S(
            3,
            {"A": 1, "B": 1},
            decode_ids=["A", "B"],
            waiting_ids=["C"],
            finished_ids=["A"],
            block_tables={"A": [0, 1, 4], "B": [2, 3]},
            num_tokens={"A": 9, "B": 7},
            new_block_ids=[4],
            num_free_blocks=1,
        ),
        S(
            4,
            {"B": 1, "C": 5},
            prefill_ids=["C"],
            decode_ids=["B"],
            arrived_ids=["D"],
            waiting_ids=["D"],
            block_tables={"B": [2, 3], "C": [5, 0]},
            num_tokens={"B": 8, "C": 5},
            new_block_ids=[5, 0],
            num_free_blocks=2,
        ),
        S(
            5,
            {"C": 1, "D": 3},
            prefill_ids=["D"],
            decode_ids=["C"],
            swapped_out_ids=["B"],
            swapped_ids=["B"],
            block_tables={"C": [5, 0], "D": [2]},
            num_tokens={"C": 6, "D": 3},
            new_block_ids=[2],
            num_free_blocks=3,
        ),
        S(
            6,
            {"C": 1, "C.1": 1},
            decode_ids=["C", "C.1"],
            arrived_ids=["C.1"],
            preempted_ids=["D"],
            waiting_ids=["D"],
            swapped_ids=["B"],
            block_tables={"C": [5, 0], "C.1": [5, 1]},
            num_tokens={"C": 7, "C.1": 7},
            new_block_ids=[1],
            shared_blocks={5: 2},
            num_free_blocks=3,
        ),
        S(
            7,
            {"B": 1, "C": 1},
            decode_ids=["B", "C"],
            swapped_in_ids=["B"],
            waiting_ids=["D"],
            finished_ids=["C"],
            block_tables={"B": [2, 3, 4], "C": [5, 0], "C.1": [5, 1]},
            num_tokens={"B": 9, "C": 8, "C.1": 7},
            new_block_ids=[2, 3, 4],
            shared_blocks={5: 2},
            num_free_blocks=0,
        ),
        S(
            8,
            {"B": 1, "C.1": 1},
            decode_ids=["B", "C.1"],
            waiting_ids=["D"],
            finished_ids=["B", "C.1"],
            block_tables={"B": [2, 3, 4], "C.1": [5, 1]},
            num_tokens={"B": 10, "C.1": 8},
            num_free_blocks=1,
        ),
        S(
            9,
            {"D": 3},
            prefill_ids=["D"],
            finished_ids=["D"],
            block_tables={"D": [0]},
            num_tokens={"D": 3},
            new_block_ids=[0],
            num_free_blocks=5,
        ),
    ]
    for s in steps:
        t.record(s)
    t.check_invariants()
    return t


def manager_with_sharing():
    """A live KVCacheManager: A (10 tokens), B (5), C (2); D came and went, so its block
    is at the back of the free queue; A.1 forked from A and wrote one token, so A's
    partly filled last block was copied (copy-on-write) and the full ones stay shared."""
    m = BlockSpaceManager(12, 4)
    m.allocate_slots("A", 10)
    m.allocate_slots("B", 5)
    m.allocate_slots("D", 3)
    m.free("D")
    m.allocate_slots("C", 2)
    m.fork("A", "A.1")
    new = m.allocate_slots("A.1", 1)
    m.check_invariants()
    return m, [b.block_id for b in new]


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("MINIPAGED_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    assert path.exists(), f"golden file {path} missing (run with MINIPAGED_UPDATE_GOLDEN=1)"
    assert text + "\n" == path.read_text(), f"{name} differs from {path}"


@pytest.fixture(scope="module")
def trace():
    return hand_trace()


@pytest.fixture(scope="module")
def large():
    t = F.scheduler_large_trace()
    t.check_invariants()
    return t


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


# -- the data the pictures are drawn from, against the hand-worked answer --------------


def test_request_order_is_arrival_order(trace):
    assert viz.request_order(trace) == ["A", "B", "C", "D", "C.1"]


def test_timeline_cells_by_hand(trace):
    c = viz.timeline_cells(trace)
    expected = {
        #       0    1    2    3    4    5    6    7    8    9
        "A": "P d d d _ _ _ _ _ _",
        "B": "P P d d d s s d d _",
        "C": "_ w w w P d d d _ _",
        "D": "_ _ _ _ w P X w w P",
        "C.1": "_ _ _ _ _ _ d r d _",
    }
    code = {
        "P": "prefill",
        "d": "decode",
        "_": "absent",
        "w": "waiting",
        "s": "swapped",
        "X": "preempted",
        "r": "running",
    }
    for k, rid in enumerate(c.order):
        assert c.states[k] == [code[x] for x in expected[rid].split()], rid
    assert c.tokens[c.order.index("B")][:2] == [2, 3]  # B's prompt in two chunks
    assert c.arrival == {"A": 0, "B": 0, "C": 1, "D": 4, "C.1": 6}
    assert c.finish == {"A": 3, "B": 8, "C": 7, "D": 9, "C.1": 8}
    assert c.running == [2, 2, 2, 2, 2, 2, 2, 2, 2, 1]
    assert c.prefill_tokens == [8, 3, 0, 0, 5, 3, 0, 0, 0, 3]
    assert c.decode_tokens == [0, 1, 2, 2, 1, 1, 2, 2, 2, 0]


def test_snapshot_by_hand(trace):
    snap = viz.snapshot(trace, 7)
    snap.check_invariants()
    assert list(snap.block_tables) == ["B", "C", "C.1"]
    assert snap.ref_cnt == {2: 1, 3: 1, 4: 1, 5: 2, 0: 1, 1: 1}
    assert snap.free_block_ids == []
    assert snap.owners()[5] == [("C", 0), ("C.1", 0)]
    # B 9 tokens = 4 + 4 + 1; C 8 = 4 + 4; C.1 7 = (shared 5) + 3
    assert snap.tokens_in_block() == {2: 4, 3: 4, 4: 1, 5: 4, 0: 4, 1: 3}
    assert viz.snapshot(trace).step == 9 and viz.snapshot(trace, -1).step == 9


def test_freed_blocks_by_hand(trace):
    """Step 5: B swapped out frees 2 and 3, D gets 2 back: freed [3], new [2]. Step 6: D
    preempted frees 2, C.1's new block 1 is held. Step 8: B and C.1 finish."""
    s5, s6 = viz.snapshot(trace, 5), viz.snapshot(trace, 6)
    assert (s5.new_block_ids, s5.freed_block_ids) == ([2], [3])
    assert (s6.new_block_ids, s6.freed_block_ids) == ([1], [2])
    assert viz.snapshot(trace, 0).freed_block_ids == []
    for i in range(len(trace)):
        snap = viz.snapshot(trace, i)
        snap.check_invariants()
        assert not set(snap.freed_block_ids) & set(snap.ref_cnt)
        assert set(snap.new_block_ids) <= set(snap.ref_cnt)


def test_block_allocated_and_freed_in_one_step_is_marked_freed():
    """A dead beam's copy: allocated during the step, free after it. It must not be framed
    as allocated this step (solid black edge) but as freed (dashed edge), in text and figure."""
    from matplotlib.patches import Rectangle

    t = EngineTrace(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=4)
    t.requests = {"a": {"arrival_step": 0}, "b": {"arrival_step": 0}}
    t.record(StepRecord(0, {"a": 2, "b": 2}, block_tables={"a": [0], "b": [1]}, new_block_ids=[0, 1]))
    t.record(StepRecord(1, {"a": 1, "b": 1}, block_tables={"a": [0, 2]}, new_block_ids=[2, 3]))
    snap = viz.snapshot(t, 1)
    assert snap.new_block_ids == [2] and snap.freed_block_ids == [1, 3]
    text = viz.block_tables_text(t, 1)
    assert "new: 2 | freed: 1 3" in text and "3 -" in text and "3 -*" not in text
    fig = viz.block_tables(t, 1, managed=False)
    ax_p = fig.get_axes()[1]
    frames = [
        (round(r.get_x()), r.get_linestyle())
        for r in ax_p.patches
        if isinstance(r, Rectangle) and not r.get_fill()
    ]
    solid = sorted(x for x, ls in frames if ls in ("-", "solid"))
    dashed = sorted(x for x, ls in frames if ls not in ("-", "solid"))
    ncols = round(ax_p.get_xlim()[1])
    assert solid == [2 % ncols] and dashed == sorted([1 % ncols, 3 % ncols])
    assert "freed this step" in {tx.get_text() for tx in fig.legends[0].get_texts()}


def test_snapshot_from_manager():
    m, new = manager_with_sharing()
    snap = viz.snapshot(m, new_block_ids=new)
    snap.check_invariants()
    # A.1's copy of A's last block is the next block of the free queue, 7
    assert snap.block_tables == {"A": [0, 1, 2], "B": [3, 4], "C": [6], "A.1": [0, 1, 7]}
    assert snap.ref_cnt[0] == snap.ref_cnt[1] == 2 and snap.ref_cnt[2] == 1
    # the free queue in hand-out order: never-used blocks first, D's freed block 5 last
    assert snap.free_block_ids == [8, 9, 10, 11, 5]
    assert snap.new_block_ids == [7]
    assert snap.tokens_in_block() == {0: 4, 1: 4, 2: 2, 3: 4, 4: 1, 6: 2, 7: 3}


def test_memory_series_by_hand(trace):
    m = viz.memory_series(trace)
    assert m.tokens == [8, 12, 14, 16, 13, 9, 10, 20, 18, 3]
    assert m.reserved == [4, 4, 2, 4, 3, 3, 2, 4, 2, 1]
    assert m.free == [12, 8, 8, 4, 8, 12, 12, 0, 4, 20]
    assert all(t + r + f == 24 for t, r, f in zip(m.tokens, m.reserved, m.free))
    assert m.preemptions == [0, 0, 0, 0, 0, 0, 1, 0, 0, 0]  # D preempted at 6
    assert m.swapped_out == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]  # B swapped out at 5


def test_memory_series_matches_manager_usage():
    """On a scheduler run, the picture's numbers equal KVCacheManager.usage() arithmetic:
    paged waste stays below one block per running request."""
    t = F.scheduler_demo_trace()
    m = viz.memory_series(t)
    for s, r in zip(t.steps, m.reserved):
        assert 0 <= r < t.block_size * max(1, len(s.block_tables))
    assert [f // t.block_size for f in m.free] == [s.num_free_blocks for s in t.steps]


# -- text renderings: pinned --------------------------------------------------------------


def test_timeline_text_golden(trace):
    check_golden("timeline_hand.txt", viz.timeline_text(trace))


def test_step_text_golden(trace):
    for i in (0, 6, 7):
        check_golden(f"step_hand_{i}.txt", viz.step_text(trace, i))


def test_memory_text_golden(trace):
    check_golden("memory_hand.txt", viz.memory_text(trace))


def test_block_tables_text_manager_golden():
    m, new = manager_with_sharing()
    check_golden("block_tables_manager.txt", viz.block_tables_text(m, new_block_ids=new))


def test_timeline_text_wraps_large_traces(large):
    """20 requests x ~200 steps from the real scheduler: panels of 100 steps, every
    request's row shown in the panels where it is active. (Not a golden file: the
    schedule itself belongs to the scheduler's tests.)"""
    text = viz.timeline_text(large)
    lines = text.splitlines()
    assert all(len(line) <= 110 for line in lines)
    panels = [k for k, line in enumerate(lines) if line.startswith("step ")]
    assert len(panels) == -(-len(large) // 100)
    assert lines[panels[1]].split()[1] == "100"
    c = viz.timeline_cells(large)
    for k, rid in enumerate(c.order):
        first = next(j for j, st in enumerate(c.states[k]) if st != "absent")
        panel = lines[panels[first // 100] :]
        row = next(line for line in panel if line.startswith(rid + " "))
        assert row[len("step") + 4 + first % 100] in ".Pd"


def test_text_marks_what_the_hand_trace_says(trace):
    text = viz.step_text(trace, 6)
    assert "preempted: D" in text and "in CPU pool: B" in text
    assert "5(x2)" in text  # the shared block and its ref count
    tl = viz.timeline_text(trace).splitlines()
    row = next(line for line in tl if line.startswith("D "))
    assert row.split(None, 1)[1] == ".PX..P|"  # waiting, prefill, preempted, ..., finish


def test_texts_survive_json_round_trip(trace, tmp_path):
    again = EngineTrace.from_json(trace.to_json())
    assert viz.timeline_text(again) == viz.timeline_text(trace)
    assert viz.step_text(again, 6) == viz.step_text(trace, 6)
    assert viz.memory_text(again) == viz.memory_text(trace)


def test_memory_text_samples_long_traces(large):
    text = viz.memory_text(large, max_rows=10)
    rows = [line for line in text.splitlines()[2:-1]]
    assert len(rows) == 10
    assert rows[0].split()[0] == "0" and rows[-1].split()[0] == str(len(large) - 1)


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda t: viz.block_tables_text(t, 10),
        lambda t: viz.block_tables_text(t, -11),
        lambda t: viz.step_text(t, 99),
        lambda t: viz.step(t, 10),
        lambda t: viz.block_tables(t, "3"),
        lambda t: viz.timeline(t, cursor=10),
        lambda t: viz.timeline_text(t, width=0),
        lambda t: viz.memory_text(t, max_rows=0),
        lambda t: viz.block_tables_text(t, 1, columns=0),
    ],
)
def test_bad_arguments_raise_value_error(trace, call):
    with pytest.raises(ValueError):
        call(trace)


def test_bad_sources_raise_value_error():
    empty = EngineTrace(4, 4, 2, 8)
    for call in (viz.timeline, viz.memory, viz.timeline_text, viz.memory_text, viz.block_tables_text):
        with pytest.raises(ValueError, match="no steps"):
            call(empty)
    with pytest.raises(ValueError, match="EngineTrace or a KVCacheManager"):
        viz.block_tables_text({"A": [0]})
    m, _ = manager_with_sharing()
    with pytest.raises(ValueError, match="step"):
        viz.block_tables_text(m, 3)


# -- figures: drawn, and readable ------------------------------------------------------------


def _drawn_texts(fig):
    """(text, window bbox) of every text that is actually drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    hidden = set()  # tick labels outside the view limits exist but are not drawn
    for ax in fig.get_axes():
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    hidden.update({id(tick.label1), id(tick.label2)})
    out = []
    for t in fig.findobj(Text):
        if id(t) in hidden or not t.get_visible() or not t.get_text().strip():
            continue
        bb = t.get_window_extent(renderer)
        if bb.width > 0 and bb.height > 0:
            out.append((t.get_text(), bb))
    return out, renderer


def assert_readable(fig, min_font: float = 4.0):
    """No two drawn texts overlap, every text is inside the figure, no legend covers an
    axes, and no text is smaller than ``min_font`` points."""
    texts, renderer = _drawn_texts(fig)
    fb = fig.bbox
    for (a, A), (b, B) in itertools.combinations(texts, 2):
        overlap = A.x0 < B.x1 - 1 and B.x0 < A.x1 - 1 and A.y0 < B.y1 - 1 and B.y0 < A.y1 - 1
        assert not overlap, f"texts {a!r} and {b!r} overlap"
    for a, A in texts:
        assert A.x0 >= -1 and A.y0 >= -1 and A.x1 <= fb.x1 + 1 and A.y1 <= fb.y1 + 1, (
            f"text {a!r} is cut off at the figure's edge"
        )
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.get_axes() if ax.get_legend()]
    for sub in getattr(fig, "subfigs", []):
        legends += list(sub.legends)
    for leg in legends:
        L = leg.get_window_extent(renderer)
        for ax in fig.get_axes():
            P = ax.get_window_extent(renderer)
            assert not (L.x0 < P.x1 - 1 and P.x0 < L.x1 - 1 and L.y0 < P.y1 - 1 and P.y0 < L.y1 - 1), (
                "a legend covers a plot"
            )
    from matplotlib.text import Text

    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip()]
    assert min(sizes) >= min_font, f"a text of {min(sizes)} pt"


def test_figures_on_hand_trace_are_readable(trace):
    from matplotlib.figure import Figure

    for fig in (
        viz.timeline(trace, managed=False),
        viz.block_tables(trace, 7, managed=False),
        viz.step(trace, 6, managed=False),
        viz.memory(trace, managed=False),
    ):
        assert isinstance(fig, Figure)
        assert_readable(fig)


def test_block_tables_figure_shows_the_state(trace):
    """Every held block is labelled owner:logical in the grid, the shared one with x2."""
    fig = viz.block_tables(trace, 7, managed=False)
    texts = {t for t, _ in _drawn_texts(fig)[0]}
    assert {"B:0", "B:1", "B:2", "C:1", "C.1:1", "x2 C:0"} <= texts
    assert "Block tables after step 7 (6 blocks of 4 slots)" in texts


def test_timeline_figure_writes_prefill_chunks(trace):
    fig = viz.timeline(trace, managed=False)
    grid = fig.axes[0]
    cells = sorted((round(t.get_position()[0]), round(t.get_position()[1]), t.get_text()) for t in grid.texts)
    order = viz.request_order(trace)
    # (step, row, tokens) of every prefill cell: A 6; B 2 then 3; C 5; D 3 and again 3
    assert cells == sorted(
        [
            (0, order.index("A"), "6"),
            (0, order.index("B"), "2"),
            (1, order.index("B"), "3"),
            (4, order.index("C"), "5"),
            (5, order.index("D"), "3"),
            (9, order.index("D"), "3"),
        ]
    )


def test_figures_readable_at_20_requests_200_steps(large):
    assert len(viz.request_order(large)) == 20 and len(large) >= 180
    i = F.interesting_step(large)
    for fig in (
        viz.timeline(large, managed=False),
        viz.block_tables(large, i, managed=False),
        viz.step(large, i, managed=False),
        viz.memory(large, managed=False),
    ):
        assert_readable(fig)


def test_block_tables_from_manager_figure():
    m, new = manager_with_sharing()
    fig = viz.block_tables(m, new_block_ids=new, managed=False, arrows=True)
    assert_readable(fig)
    texts = {t for t, _ in _drawn_texts(fig)[0]}
    assert {"x2 A:0", "x2 A:1", "A:2", "A.1:2", "C:0"} <= texts


def test_small_pool_mapping_draws_one_arrow_per_table_entry():
    """arrows=True on a small pool: two rows, an arrow from every logical block to the
    centre of its physical block (x = block id + 0.5), in its request's colour family."""
    from matplotlib.patches import FancyArrowPatch

    m, new = manager_with_sharing()
    fig = viz.block_tables(m, new_block_ids=new, managed=False, arrows=True)
    (ax,) = fig.get_axes()
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    tables = {r: m.get_block_ids(r) for r in m.block_tables}
    assert len(arrows) == sum(len(t) for t in tables.values()) == 9
    landing = sorted(round(a._posA_posB[1][0] - 0.5) for a in arrows)
    assert landing == sorted(b for t in tables.values() for b in t)  # shared 0 and 1 twice
    assert_readable(fig)


def test_managed_figures_are_pyplot_figures(trace):
    import matplotlib.pyplot as plt

    fig = viz.timeline(trace)
    assert plt.fignum_exists(fig.number)
    plt.close(fig)
    free = viz.timeline(trace, managed=False)
    assert free not in [plt.figure(n) for n in plt.get_fignums()]


def test_short_names():
    assert palette.short_name("A.1", 4) == "A.1"
    assert palette.short_name("0", 0) == "r0"  # "r0:1", not "0:1"
    assert palette.short_name("request-7", 3) == "r3"


def test_owner_colours_are_distinct_and_stable():
    colours = [palette.owner_color(k) for k in range(21)]
    assert len(set(colours)) == 21
    assert palette.owner_color(1) == palette.YELLOW  # see tests/viz/test_palette.py
    with pytest.raises(ValueError):
        palette.owner_color(-1)


# -- real runs ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_traces_draw(mode):
    """Traces recorded by the real Scheduler (fake model) in both preemption modes."""
    t = F.scheduler_demo_trace(preemption_mode=mode)
    t.check_invariants()
    for i in range(len(t)):
        viz.snapshot(t, i).check_invariants()
    c = viz.timeline_cells(t)
    assert any("preempted" in row or "swapped" in row for row in c.states), (
        "the demo pool is meant to force a preemption"
    )
    i = F.interesting_step(t)
    assert viz.step_text(t, i).startswith(f"step {i} / {len(t) - 1}")
    for fig in (viz.timeline(t, managed=False), viz.step(t, i, managed=False), viz.memory(t, managed=False)):
        assert fig.axes


def test_engine_trace_draws():
    if not F.course_model_available():
        pytest.skip(
            "the course model (minipaged/data/course_model) or the engine is not available yet: issue 4"
        )
    t = F.engine_demo_trace()
    t.check_invariants()
    assert len(viz.request_order(t)) == len(F.DEMO_PROMPTS)
    i = F.interesting_step(t)
    assert viz.step_text(t, i).startswith(f"step {i} / {len(t) - 1}")
    for fig in (viz.timeline(t, managed=False), viz.step(t, i, managed=False), viz.memory(t, managed=False)):
        assert_readable(fig)


def test_simulator_trace_draws():
    """The simulator (issue 7) records the same EngineTrace at paper scale: hundreds of
    blocks, many requests, simulated times. Every picture stays readable."""
    sim = pytest.importorskip(
        "minipaged.sim.simulator", reason="the simulator (issue 7) is not available yet"
    )
    import random

    from minipaged.sim.arrivals import TraceRequest

    rng = random.Random(0)
    reqs = [TraceRequest(f"q{k}", k * 0.05, rng.randint(50, 400), rng.randint(20, 200)) for k in range(60)]
    t = sim.simulate(reqs, "paged", record_trace=True).trace
    t.check_invariants()
    assert t.num_blocks > 100 and len(viz.request_order(t)) == 60
    i = len(t) // 2
    viz.snapshot(t, i).check_invariants()
    assert viz.step_text(t, i).splitlines()[0].startswith(f"step {i} / {len(t) - 1} | t = ")
    m = viz.memory_series(t)
    assert all(a + b + c == t.num_blocks * t.block_size for a, b, c in zip(m.tokens, m.reserved, m.free))
    for fig in (viz.timeline(t, managed=False), viz.step(t, i, managed=False), viz.memory(t, managed=False)):
        assert_readable(fig)


# -- minipaged figures ----------------------------------------------------------------------


def test_figures_are_byte_identical_twice(tmp_path):
    """Two runs (each its own seeded scheduler run) give the same bytes. The engine's
    figures are checked the same way by `minipaged figures --check`."""
    names = ["step_20x200.png", "memory_20x200.png"]
    a = figures_cmd.write_figures(tmp_path / "a", names, log=lambda _: None)
    b = figures_cmd.write_figures(tmp_path / "b", names, log=lambda _: None)
    assert set(a) == set(names) and a == b
    for n in names:
        data = (tmp_path / "a" / n).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"Software" not in data and b"matplotlib" not in data.lower()
        assert hashlib.sha256(data).hexdigest() == a[n]


def test_figures_cli_list_and_unknown(capsys):
    from minipaged.cli import main

    assert main(["figures", "--list"]) == 0
    out = capsys.readouterr().out
    assert "timeline.png" in out and "memory_waste.png" in out
    assert main(["figures", "--only", "nope.png"]) == 2


def test_figures_skip_missing_modules(tmp_path, monkeypatch):
    lines = []
    monkeypatch.setitem(figures_cmd.FIGURES, "ghost.png", ("minipaged.sim.not_there", None, "missing"))
    assert figures_cmd.write_figures(tmp_path, ["ghost.png"], log=lines.append) == {}
    assert lines == ["skip ghost.png: minipaged.sim.not_there is not available in this version"]
