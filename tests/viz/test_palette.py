"""Tests for minipaged.viz.palette: requests and states never share a colour.

The reference is colour science written out here, independently of the palette: sRGB ->
linear RGB -> CIE XYZ (D65) -> CIELAB, Delta E 1976 between two colours, and the
deuteranopia / protanopia simulations of Machado, Oliveira & Fernandes (2009, severity
1.0), the two common forms of colour-blindness. A student must never read a request's
colour as a state: every request colour must be far from every state colour, for normal
vision and through both simulations.
"""

from __future__ import annotations

import itertools
import math

import pytest

from minipaged.viz import palette

# Machado et al. 2009, severity 1.0, applied to linear RGB.
CVD = {
    "normal": ((1, 0, 0), (0, 1, 0), (0, 0, 1)),
    "protanopia": (
        (0.152286, 1.052583, -0.204868),
        (0.114503, 0.786281, 0.099216),
        (-0.003882, -0.048116, 1.051998),
    ),
    "deuteranopia": (
        (0.367322, 0.860646, -0.227968),
        (0.280085, 0.672501, 0.047413),
        (-0.011820, 0.042940, 0.968881),
    ),
}
MIN_DELTA_E = {"normal": 25.0, "protanopia": 12.0, "deuteranopia": 12.0}


def lab(hex_color: str, vision: str = "normal") -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB hex colour, as seen with ``vision``."""
    srgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in srgb]
    m = CVD[vision]
    lin = [min(1.0, max(0.0, sum(m[r][c] * lin[c] for c in range(3)))) for r in range(3)]
    x = (0.4124 * lin[0] + 0.3576 * lin[1] + 0.1805 * lin[2]) / 0.95047
    y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    z = (0.0193 * lin[0] + 0.1192 * lin[1] + 0.9505 * lin[2]) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def delta_e(a: str, b: str, vision: str = "normal") -> float:
    return math.dist(lab(a, vision), lab(b, vision))


def test_lab_reference_points():
    """Hand-checked anchors: white is L* 100, black L* 0, sRGB red (53.2, 80.1, 67.2)."""
    assert lab("#FFFFFF") == pytest.approx((100.0, 0.0, 0.0), abs=0.05)
    assert lab("#000000") == pytest.approx((0.0, 0.0, 0.0), abs=0.05)
    assert lab("#FF0000") == pytest.approx((53.24, 80.09, 67.20), abs=0.1)
    # a protanope barely tells red from a dark olive-green: the simulation must show it
    assert delta_e("#FF0000", "#008000") > 50
    assert delta_e("#FF0000", "#008000", "protanopia") < delta_e("#FF0000", "#008000") / 2


def test_request_and_state_palettes_are_disjoint():
    requests = [palette.owner_color(k) for k in range(len(palette.REQUEST_COLORS))]
    states = set(palette.STATE_COLORS.values())
    assert not {c.upper() for c in requests} & {c.upper() for c in states}


@pytest.mark.parametrize("vision", sorted(MIN_DELTA_E))
def test_no_request_colour_looks_like_a_state(vision):
    worst = min(
        (delta_e(r, s, vision), r, name)
        for r in palette.REQUEST_COLORS
        for name, s in palette.STATE_COLORS.items()
    )
    assert worst[0] >= MIN_DELTA_E[vision], (
        f"request colour {worst[1]} looks like state {worst[2]!r}: {worst}"
    )


def test_states_are_distinct_from_each_other():
    """The timeline's states, pairwise, for normal vision and both simulations."""
    for vision in MIN_DELTA_E:
        for (a, ca), (b, cb) in itertools.combinations(palette.STATE_COLORS.items(), 2):
            assert delta_e(ca, cb, vision) >= 10, (vision, a, b)


def test_first_request_colours_are_distinct():
    first = palette.REQUEST_COLORS[:12]
    assert min(delta_e(a, b) for a, b in itertools.combinations(first, 2)) >= 20
    assert len(set(palette.REQUEST_COLORS)) == len(palette.REQUEST_COLORS) >= 21


def test_owner_color_cycles_and_checks():
    n = len(palette.REQUEST_COLORS)
    assert palette.owner_color(0) == palette.BLUISH_GREEN
    assert palette.owner_color(n + 3) == palette.owner_color(3)
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="k must be"):
            palette.owner_color(bad)


def wcag_contrast(a: str, b: str) -> float:
    """WCAG 2.x contrast ratio, (L1 + 0.05) / (L2 + 0.05), L the relative luminance (the Y
    of ``lab`` above), written out here independently of the palette."""

    def lum(c: str) -> float:
        s = [int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        r, g, b = (v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4 for v in s)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    hi, lo = max(lum(a), lum(b)), min(lum(a), lum(b))
    return (hi + 0.05) / (lo + 0.05)


def test_contrast_ratio_reference_points():
    """WCAG 2's anchors: black on white 21, a colour on itself 1, #767676 on white 4.54
    (the lightest grey WCAG's examples pass at 4.5); symmetric."""
    assert palette.contrast_ratio("#000000", "#FFFFFF") == pytest.approx(21.0)
    assert palette.contrast_ratio("#762A83", "#762A83") == pytest.approx(1.0)
    assert palette.contrast_ratio("#767676", "#FFFFFF") == pytest.approx(4.54, abs=0.01)
    assert palette.contrast_ratio("#FFFFFF", "#767676") == palette.contrast_ratio("#767676", "#FFFFFF")
    for a, b in itertools.combinations(palette.REQUEST_COLORS[:8] + ["#000000", "#FFFFFF"], 2):
        assert palette.contrast_ratio(a, b) == pytest.approx(wcag_contrast(a, b))


@pytest.mark.parametrize(
    "fill, text",
    [
        ("#FFFFFF", "#000000"),
        ("#000000", "#FFFFFF"),
        (palette.YELLOW, "#000000"),  # light: black
        ("#521433", "#FFFFFF"),  # dark wine, the darkest request colours: white
        ("#104821", "#FFFFFF"),
        ("#47194F", "#FFFFFF"),
        (palette.BLUE, "#FFFFFF"),  # prefill's blue: black would be 4.2, below 4.5
    ],
)
def test_text_color_on_picks_black_or_white(fill, text):
    assert palette.text_color_on(fill) == text


@pytest.mark.parametrize(
    "fill",
    palette.REQUEST_COLORS + list(palette.STATE_COLORS.values()) + [palette.FREE_GREY, palette.BATCH_BLUE],
)
def test_text_on_every_palette_colour_passes_wcag(fill):
    """The chosen text colour reads on every fill of the palette (WCAG AA, 4.5), and is the
    better of black and white."""
    text = palette.text_color_on(fill)
    other = "#FFFFFF" if text == "#000000" else "#000000"
    assert wcag_contrast(text, fill) >= 4.5
    assert wcag_contrast(text, fill) >= wcag_contrast(other, fill)
