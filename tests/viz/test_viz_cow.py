"""viz.block_tables(copies=...): the copy-on-write copy drawn in the pool."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from minipaged import viz  # noqa: E402
from minipaged.core import BlockSpaceManager  # noqa: E402


def _forked():
    m = BlockSpaceManager(num_blocks=8, block_size=4)
    m.allocate_slots("A", 6)
    m.fork("A", "B")
    m.allocate_slots("B", 1)  # B writes into the shared, partly filled block 1: copy first
    return m, m.take_pending_copies()


def test_the_copy_is_one_arrow_with_its_label():
    m, copies = _forked()
    assert copies == [(1, 2)]
    fig = viz.block_tables(m, new_block_ids=[2], copies=copies, managed=False)
    pool = fig.axes[1]
    assert len([p for p in pool.patches if isinstance(p, FancyArrowPatch)]) == 1
    assert any(t.get_text() == "copy 1 -> 2" for t in pool.texts)


def test_a_copy_outside_the_pool_names_the_argument():
    m, _ = _forked()
    with pytest.raises(ValueError, match="copies"):
        viz.block_tables(m, copies=[(1, 99)], managed=False)
