"""Colours and marks shared by every minipaged picture.

Two encodings that must never be mistaken for each other, so they share no colour:

* **what a request is doing** (``STATE_COLORS``, the timeline): blues for a request in
  ``running`` (dark blue prefill, sky blue decode, pale blue "running, idle": it holds
  blocks but got no token this step), greys for a request that is not (light grey
  waiting, dark grey swapped out to the CPU), vermillion for the one alarm, preempted.
  All from the Okabe-Ito palette (Okabe & Ito 2008; Wong, Nature Methods 2011).
* **which request** (``owner_color(k)``, block tables, row labels): greens, yellows,
  oranges, browns and purples, never a blue, a grey or a red-orange. The first hues are
  Okabe-Ito's bluish green, yellow and orange, Paul Tol's sand and green and ColorBrewer
  PRGn's purple; then lighter and darker versions.

Colour-blind reasoning, checked by ``tests/viz/test_palette.py``: every request colour is at
least 25 CIELAB units (Delta E 1976) from every state colour for normal vision and at
least 12 when both are seen through the deuteranopia and protanopia simulations of
Machado et al. (2009), the two common forms; the greys and blues of the states differ
in lightness or sit on the blue-yellow axis those viewers keep. Cells are also labelled
(``r3:1``, chunk sizes), so colour is never the only cue. Colours are plain hex strings,
so this module needs no matplotlib and the text renderings can share the same names.

Inputs / outputs
    ``owner_color(k)`` -> the colour of the k-th request (in arrival order), stable across
    steps, so a request keeps its colour from picture to picture; 21 distinct colours,
    then they repeat.
    ``STATE_COLORS`` -> the colour of each request state in the timeline.
    ``short_name(rid, k)`` -> a label that fits in a cell.
    ``text_color_on(colour)`` -> black or white, the text colour for a label on that fill
    (WCAG contrast >= 4.5 for every colour; ``contrast_ratio`` measures it).

Invariants
    the same request gets the same colour in every picture of one trace; no request
    colour is a state colour.

vLLM has no counterpart (it draws nothing).
"""

from __future__ import annotations

# Okabe-Ito, minus black (kept for marks and text).
ORANGE = "#E69F00"
SKY_BLUE = "#56B4E9"
BLUISH_GREEN = "#009E73"
YELLOW = "#F0E442"
BLUE = "#0072B2"
VERMILLION = "#D55E00"
REDDISH_PURPLE = "#CC79A7"
BLACK = "#000000"

FREE_GREY = "#D9D9D9"  # a free block / free slots
EMPTY = "#FFFFFF"  # nothing there (not arrived, done)

OKABE_ITO = [ORANGE, SKY_BLUE, BLUISH_GREEN, YELLOW, BLUE, VERMILLION, REDDISH_PURPLE]

# Request states in the timeline (see minipaged.viz.activity): blues = in ``running``,
# greys = not, vermillion = preempted. No request colour below is any of these.
STATE_COLORS = {
    "absent": EMPTY,  # not arrived yet, or finished
    "waiting": "#BBBBBB",  # arrived, waiting for admission (or requeued)
    "running": "#BBE1F6",  # "running, idle": holds blocks but got no tokens this step
    "prefill": BLUE,  # computing prompt tokens (a chunk)
    "decode": SKY_BLUE,  # computing one new token
    "preempted": VERMILLION,  # preempted this step (recompute: its blocks freed)
    "swapped": "#555555",  # its KV blocks are in the CPU pool
}

BATCH_BLUE = "#2B93CE"  # the timeline's "sequences in the batch" strip: between prefill and decode

# Request (owner) colours, in arrival order. The first twelve are the most distinct
# (pairwise Delta E >= 22); the rest are lighter and darker versions, picked to stay
# away from the states (see the module docstring).
REQUEST_COLORS = [
    BLUISH_GREEN,
    YELLOW,
    "#762A83",  # purple (ColorBrewer PRGn)
    ORANGE,
    "#DDCC77",  # sand (Tol muted)
    "#117733",  # green (Tol muted)
    "#BA94C1",  # lavender
    "#8C510A",  # brown (ColorBrewer BrBG)
    "#995B7D",  # mauve
    "#86A768",  # sage
    "#521433",  # dark wine
    "#D8EFC4",  # pale green
    "#104821",  # dark green
    "#543106",  # dark brown
    "#DFC096",  # tan
    "#B4AB32",  # olive
    "#47194F",  # aubergine
    "#EEBC4C",  # light orange
    "#F4EC7B",  # light yellow
    REDDISH_PURPLE,
    "#857A47",  # khaki
]

# Memory picture (minipaged.viz.occupancy).
MEMORY_COLORS = {
    "tokens": BLUE,  # slots holding a token's K/V
    "reserved": ORANGE,  # slots reserved in a held block, not holding a token yet
    "free": FREE_GREY,  # slots in free blocks
}


def _mix(hex_color: str, other: str, t: float) -> str:
    """Blend ``hex_color`` toward ``other`` by ``t`` in [0, 1]."""
    a = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
    b = [int(other[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02X}" for x, y in zip(a, b))


def lighten(hex_color: str, t: float = 0.55) -> str:
    return _mix(hex_color, "#FFFFFF", t)


def darken(hex_color: str, t: float = 0.35) -> str:
    return _mix(hex_color, "#000000", t)


def owner_color(k: int) -> str:
    """Colour of the k-th request (0-based, in arrival order); never a state colour."""
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    return REQUEST_COLORS[k % len(REQUEST_COLORS)]


def relative_luminance(hex_color: str) -> float:
    """WCAG 2 relative luminance of ``#RRGGBB``: 0 for black, 1 for white."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast_ratio(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two colours, 1 (same) to 21 (black on white); body text
    needs at least 4.5."""
    la, lb = sorted((relative_luminance(a), relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_color_on(hex_color: str) -> str:
    """Black or white, whichever has the higher WCAG contrast with ``hex_color``: white on
    the dark colours, black on the light ones. The better of the two is never below
    sqrt(21) = 4.58, so text on any fill passes WCAG's 4.5.

    NOTE: white is a literal, not a constant: ``fingerprint`` hashes the constants, and
    the figures that record it stay fresh."""
    return BLACK if contrast_ratio(BLACK, hex_color) >= contrast_ratio("#FFFFFF", hex_color) else "#FFFFFF"


def short_name(rid: str, k: int, width: int = 4) -> str:
    """A label for cells: ``rid`` itself if it is short; ``r{rid}`` for a number (so that
    ``r0:1``, request 0's logical block 1, does not read as a ratio); else ``r{k}`` (k =
    its index in arrival order)."""
    if rid.isdigit() and len(rid) < width:
        return f"r{rid}"
    return rid if len(rid) <= width else f"r{k}"


def fingerprint() -> str:
    """sha256 of every colour this module defines (its upper-case constants), so that a
    figure that cannot be redrawn cheaply can record which palette it was drawn in."""
    import hashlib
    import json

    values = {k: v for k, v in sorted(globals().items()) if k.isupper() and isinstance(v, (str, list, dict))}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
