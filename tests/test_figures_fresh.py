"""The committed figures are what the code draws now.

Every PNG that ``minipaged figures`` draws (``minipaged.viz.figures.FIGURES``) is redrawn
here and must equal the committed ``figures/NAME`` byte for byte (the PNG writer drops
every date and version, so a seeded run gives the same bytes). The figures it cannot redraw
cheaply (``minipaged simulate``'s ``sim_*.png``, a minutes-long sweep) must at least have
been committed after the palette they are drawn in (``minipaged/viz/palette.py``), read from
git; the test skips that part outside a git checkout. Regenerate with
``minipaged figures`` and ``minipaged simulate``.
"""

import hashlib
import os
import shutil
import subprocess

import pytest

from minipaged.viz import figures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIG = os.path.join(REPO, "figures")
# drawn with minipaged.viz.palette but not by `minipaged figures`
PALETTE_FIGURES = ["sim_latency_sharegpt.png", "sim_latency_alpaca.png", "sim_block_size.png"]


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_every_drawn_figure_is_committed_as_drawn(tmp_path):
    drawn = figures.write_figures(tmp_path, log=lambda _: None)
    assert drawn, "minipaged figures drew nothing"
    stale = [name for name, sha in drawn.items() if _sha(os.path.join(FIG, name)) != sha]
    assert not stale, f"figures/ differs from what `minipaged figures` draws now: {stale} (run it and commit)"


def _commit_time(path: str) -> int:
    out = subprocess.run(
        ["git", "log", "-1", "--format=%ct", "--", path], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    return int(out) if out else 0


@pytest.mark.skipif(
    shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")),
    reason="needs a git checkout",
)
@pytest.mark.parametrize("name", PALETTE_FIGURES)
def test_simulated_figures_postdate_their_palette(name):
    assert os.path.exists(os.path.join(FIG, name)), f"figures/{name} is missing"
    palette_time = _commit_time("minipaged/viz/palette.py")
    fig_time = _commit_time(f"figures/{name}")
    if fig_time == 0:  # not committed yet: the working tree's file is the new one
        pytest.skip(f"figures/{name} is not committed yet")
    assert fig_time >= palette_time, (
        f"figures/{name} was committed before minipaged/viz/palette.py: run minipaged simulate"
    )
