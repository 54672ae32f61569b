"""The committed figures are what the code draws now.

Every PNG that ``minipaged figures`` draws (``minipaged.figures.FIGURES``) is redrawn
here and must equal the committed ``figures/NAME`` byte for byte (the PNG writer drops
every date and version, so a seeded run gives the same bytes). The figures it cannot redraw
cheaply (``minipaged simulate``'s ``sim_*.png``, a sweep of many minutes) must carry a
stamp of the palette they were drawn in (``figures/palette_stamps.json``: the palette's
fingerprint and each file's sha256), and that palette must be today's. Regenerate with
``minipaged figures``, and ``minipaged simulate`` then ``minipaged figures --stamp``.
"""

import hashlib
import json
import os

from minipaged import figures
from minipaged.viz import palette

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIG = os.path.join(REPO, "figures")


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_every_drawn_figure_is_committed_as_drawn(tmp_path):
    drawn = figures.write_figures(tmp_path, log=lambda _: None)
    assert drawn, "minipaged figures drew nothing"
    stale = [name for name, sha in drawn.items() if _sha(os.path.join(FIG, name)) != sha]
    assert not stale, f"figures/ differs from what `minipaged figures` draws now: {stale} (run it and commit)"


def test_simulated_figures_are_stamped_with_the_current_palette():
    stamps_path = os.path.join(FIG, figures.STAMPS)
    assert os.path.exists(stamps_path), (
        f"figures/{figures.STAMPS} is missing: run `minipaged figures --stamp`"
    )
    stamps = json.load(open(stamps_path))
    assert stamps["palette"] == palette.fingerprint(), (
        "minipaged/viz/palette.py changed since the sim_*.png were drawn: "
        "run `minipaged simulate`, then `minipaged figures --stamp`"
    )
    for name in figures.PALETTE_FIGURES:
        assert _sha(os.path.join(FIG, name)) == stamps["figures"][name], (
            f"figures/{name} is not the file that was stamped: run `minipaged figures --stamp` after `minipaged simulate`"
        )
