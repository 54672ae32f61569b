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
        == "step  4  [ 7: ####] [ 2: #xAR] [ 9: RLL.]  drafts 3, accepted 1, num_computed_tokens -> 7"
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
    ax = fig.axes[0]
    assert len(ax.patches) == 3 * 8
    # the course palette, and every "block N" label clear of the row above it
    assert {p.get_facecolor()[:3] for p in ax.patches} <= {to_rgb(c) for c in palette_colors()}
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text().startswith("block ")]
    assert len(labels) == 3 * 2
    for t in labels:
        box = t.get_window_extent(renderer)
        for p in ax.patches:
            assert not box.overlaps(p.get_window_extent(renderer)), (t.get_text(), t.get_position())
    plt.close(fig)


def palette_colors():
    from minipaged.viz import palette

    return [v for k, v in vars(palette).items() if k.isupper() and isinstance(v, str) and v.startswith("#")]


def to_rgb(c):
    from matplotlib.colors import to_rgb as rgb

    return rgb(c)
