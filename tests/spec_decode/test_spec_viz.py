"""spec_decode/viz.py: the slot characters by hand, bad records refused, the figure draws."""

import pytest

from minipaged.spec_decode.viz import BlockTableStep, block_table_text, draw_block_table_steps


def test_slots_by_hand():
    # 5 tokens computed, the last sampled at position 5, 3 drafts, 1 accepted, 2 lookahead
    s = BlockTableStep(
        step=4,
        block_ids=[7, 2, 9],
        block_size=4,
        num_computed=5,
        num_drafts=3,
        num_accepted=1,
        num_lookahead=2,
    )
    assert s.slot_kinds() == "####" + "#xAR" + "RLL."
    assert s.num_kept == 7
    text = block_table_text([s])
    assert (
        text.splitlines()[0]
        == "step  4  [ 7: ####] [ 2: #xAR] [ 9: RLL.]  drafts 3, accepted 1, kept 7 slots"
    )


def test_bad_records():
    with pytest.raises(ValueError, match="num_accepted"):
        BlockTableStep(0, [1], 4, 0, num_drafts=1, num_accepted=2)
    with pytest.raises(ValueError, match="slots used"):
        BlockTableStep(0, [1], 4, 2, num_drafts=2, num_accepted=0)


def test_figure_draws():
    import matplotlib.pyplot as plt

    steps = [BlockTableStep(i, [3, 5], 4, 2 + i, 2, i % 3, 0) for i in range(3)]
    fig = draw_block_table_steps(steps)
    assert len(fig.axes[0].patches) == 3 * 8
    plt.close(fig)
