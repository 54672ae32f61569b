"""Colours and marks shared by every minipaged picture.

Colour-blind safe: the Okabe-Ito palette (Okabe & Ito 2008, the palette recommended by
Wong, Nature Methods 2011). Colours are plain hex strings, so this module needs no
matplotlib and the text renderings can share the same names.

Inputs / outputs
    ``owner_color(k)`` -> the colour of the k-th request (in arrival order), stable across
    steps, so a request keeps its colour from picture to picture. Seven hues, then the
    same hues lighter and darker: 21 distinguishable owners before colours repeat (rows
    and cells are also labelled, so a repeat is never the only cue).
    ``STATE_COLORS`` -> the colour of each request state in the timeline.
    ``short_name(rid, k)`` -> a label that fits in a cell.

Invariants
    the same request gets the same colour in every picture of one trace.

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

# Request states in the timeline (see minipaged.viz.activity).
STATE_COLORS = {
    "absent": EMPTY,  # not arrived yet, or finished
    "waiting": "#BBBBBB",  # arrived, waiting for admission (or requeued)
    "running": YELLOW,  # holds blocks but got no tokens this step
    "prefill": BLUE,  # computing prompt tokens (a chunk)
    "decode": SKY_BLUE,  # computing one new token
    "preempted": VERMILLION,  # preempted this step (recompute: its blocks freed)
    "swapped": REDDISH_PURPLE,  # its KV blocks are in the CPU pool
}

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
    """Colour of the k-th request (0-based, in arrival order)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    hue = OKABE_ITO[k % len(OKABE_ITO)]
    shade = (k // len(OKABE_ITO)) % 3
    return hue if shade == 0 else lighten(hue, 0.5) if shade == 1 else darken(hue, 0.35)


def text_color_on(hex_color: str) -> str:
    """Black or white, whichever reads better on ``hex_color`` (WCAG relative luminance)."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    lum = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    # contrast with black is (lum + 0.05) / 0.05, with white 1.05 / (lum + 0.05)
    return BLACK if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "#FFFFFF"


def short_name(rid: str, k: int, width: int = 4) -> str:
    """A label for cells: ``rid`` itself if it is short; ``r{rid}`` for a number (so that
    ``r0:1``, request 0's logical block 1, does not read as a ratio); else ``r{k}`` (k =
    its index in arrival order)."""
    if rid.isdigit() and len(rid) < width:
        return f"r{rid}"
    return rid if len(rid) <= width else f"r{k}"
