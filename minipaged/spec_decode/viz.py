"""One request's block table across speculative steps: what each slot held, and lost.

Inputs
    ``BlockTableStep`` records (plain data, one per step of one request): its block ids
    after the step's allocation, the slots holding computed K/V before the step, the
    tokens scheduled (the last sampled token + the drafts), how many drafts were accepted,
    and the lookahead slots reserved past them.
Outputs
    ``block_table_text(steps)``: one line per step, one character per slot::

        #  K/V computed before this step          x  the last sampled token, computed now
        A  a draft, computed and accepted          R  a draft, computed and rejected
        L  a lookahead slot (the draft model's)    .  an empty slot of a held block

    and ``draw_block_table_steps(steps)``, the same as a matplotlib figure. After a step the
    request's ``num_computed_tokens`` is ``num_computed + 1 + num_accepted`` (``num_kept``:
    the slots whose K/V it keeps, printed as ``num_computed_tokens -> N``); the R and L slots stay in its blocks, as vLLM v1's (no block is given back),
    and the next step writes those positions again.
Failure mode
    ``ValueError`` for a record that does not fit its table (more tokens than slots,
    more accepted than drafted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minipaged.viz.palette import (
    BLACK,
    BLUE,
    BLUISH_GREEN,
    EMPTY,
    ORANGE,
    SKY_BLUE,
    VERMILLION,
    text_color_on,
)

LEGEND = {
    "#": "computed before",
    "x": "last token",
    "A": "draft accepted",
    "R": "draft rejected",
    "L": "lookahead",
    ".": "empty",
}
# The course palette (minipaged.viz.palette): K/V held in blue as in the memory picture, the
# token computed now in the decode sky blue, accepted green, rejected in the one alarm colour,
# lookahead in the memory picture's "reserved" orange, an empty slot white.
COLORS = {
    "#": BLUE,
    "x": SKY_BLUE,
    "A": BLUISH_GREEN,
    "R": VERMILLION,
    "L": ORANGE,
    ".": EMPTY,
}
ROW_PITCH = 1.7  # rows apart (a slot is 0.8 high): room for the "block N" labels above a row


@dataclass
class BlockTableStep:
    step: int
    block_ids: list[int]
    block_size: int
    num_computed: int  # slots with K/V before the step
    num_drafts: int  # scheduled drafts (the step computes 1 + num_drafts tokens)
    num_accepted: int
    num_lookahead: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_accepted <= self.num_drafts:
            raise ValueError(f"num_accepted={self.num_accepted} must be in [0, num_drafts={self.num_drafts}]")
        used = self.num_computed + 1 + self.num_drafts + self.num_lookahead
        if used > len(self.block_ids) * self.block_size:
            raise ValueError(f"{used} slots used but {len(self.block_ids)} blocks of {self.block_size} held")

    def slot_kinds(self) -> str:
        """One character per slot of the held blocks (see the module docstring)."""
        c, a, d = self.num_computed, self.num_accepted, self.num_drafts
        kinds = "#" * c + "x" + "A" * a + "R" * (d - a) + "L" * self.num_lookahead
        return kinds + "." * (len(self.block_ids) * self.block_size - len(kinds))

    @property
    def num_kept(self) -> int:
        """Slots whose K/V the request keeps after the step."""
        return self.num_computed + 1 + self.num_accepted


def block_table_text(steps: Sequence[BlockTableStep]) -> str:
    lines = []
    for s in steps:
        kinds = s.slot_kinds()
        bs = s.block_size
        cells = " ".join(f"[{b:>2}: {kinds[i * bs : (i + 1) * bs]}]" for i, b in enumerate(s.block_ids))
        lines.append(
            f"step {s.step:>2}  {cells}  drafts {s.num_drafts}, accepted {s.num_accepted}, "
            f"num_computed_tokens -> {s.num_kept}"
        )
    lines.append("  ".join(f"{k} {v}" for k, v in LEGEND.items()))
    return "\n".join(lines)


def draw_block_table_steps(steps: Sequence[BlockTableStep]):
    """A figure: one row per step, one square per slot (its letter inside, as in the text),
    grouped by physical block, each group labelled with its block id just above it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    bs = steps[0].block_size
    width = max(len(s.block_ids) for s in steps) * (bs + 1)
    fig, ax = plt.subplots(figsize=(0.32 * width + 1.5, 0.85 * len(steps) + 1.0))
    for row, s in enumerate(steps):
        y = (len(steps) - 1 - row) * ROW_PITCH
        kinds = s.slot_kinds()
        for i, b in enumerate(s.block_ids):
            x0 = i * (bs + 1)
            ax.text(x0 + bs / 2 - 0.05, y + 0.9, f"block {b}", ha="center", va="bottom", fontsize=7)
            for j in range(bs):
                k = kinds[i * bs + j]
                ax.add_patch(Rectangle((x0 + j, y), 0.9, 0.8, facecolor=COLORS[k], edgecolor=BLACK, lw=0.5))
                if k != ".":
                    ax.text(
                        x0 + j + 0.45,
                        y + 0.4,
                        k,
                        ha="center",
                        va="center",
                        fontsize=6,
                        color=text_color_on(COLORS[k]),
                    )
        ax.text(-0.5, y + 0.4, f"step {s.step}", ha="right", va="center", fontsize=8)
    ax.set_xlim(-3.5, width)
    ax.set_ylim(-0.3, (len(steps) - 1) * ROW_PITCH + 1.4)
    ax.axis("off")
    ax.legend(
        handles=[Patch(facecolor=COLORS[k], edgecolor=BLACK, label=f"{k}  {v}") for k, v in LEGEND.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=len(LEGEND),
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    return fig
