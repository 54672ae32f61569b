"""Tests for minipaged.viz.widgets: the stepper builds and steps without a front end.

The reference for what the picture must be at step i is ``viz.step(trace, i)`` rendered
to PNG independently; the widget must show exactly those bytes, and its label must read
``step i / last``.
"""

from __future__ import annotations

import base64
import sys

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minipaged import viz  # noqa: E402
from minipaged.trace import EngineTrace  # noqa: E402
from minipaged.viz import _draw  # noqa: E402
from minipaged.viz import figures as F  # noqa: E402

pytest.importorskip("ipywidgets", reason="ipywidgets is not installed")


@pytest.fixture(scope="module")
def trace():
    return F.scheduler_demo_trace()


def expected_png(trace, i) -> bytes:
    return _draw.png_bytes(viz.step(trace, i, managed=False))


def test_stepper_builds_and_shows_step_0(trace):
    s = viz.stepper(trace)
    last = len(trace) - 1
    assert s.label.value == f"step 0 / {last}"
    assert (s.slider.min, s.slider.max, s.slider.value) == (0, last, 0)
    assert (s.play.min, s.play.max) == (0, last)
    assert s.image.value == expected_png(trace, 0)
    s.check_invariants()


def test_moving_the_slider_changes_label_and_picture(trace):
    s = viz.stepper(trace)
    before = s.image.value
    i = F.interesting_step(trace)
    s.slider.value = i
    assert s.label.value == f"step {i} / {len(trace) - 1}"
    assert s.image.value != before
    assert s.image.value == expected_png(trace, i)
    assert s.play.value == i  # the play head follows the slider
    assert s.value == i
    s.check_invariants()


def test_prev_next_buttons_clamp_at_the_ends(trace):
    s = viz.stepper(trace)
    s.prev_button.click()
    assert s.value == 0
    s.next_button.click()
    s.next_button.click()
    assert s.value == 2 and s.label.value.startswith("step 2 /")
    s.go(10_000)
    assert s.value == len(trace) - 1
    s.next_button.click()
    assert s.value == len(trace) - 1
    s.check_invariants()


def test_play_drives_the_picture_through_the_slider(trace):
    """In the browser, Play is jslinked to the slider; here the link is simulated by
    setting the slider the way the front end would."""
    s = viz.stepper(trace, start=3)
    seen = []
    for i in range(3, 6):
        s.slider.value = i
        seen.append((s.label.value, s.image.value))
    assert [lab for lab, _ in seen] == [f"step {i} / {len(trace) - 1}" for i in range(3, 6)]
    assert len({img for _, img in seen}) == 3


def test_static_fallback_in_the_mimebundle(trace):
    """Viewers without a widget manager show the current picture and a line of text."""
    s = viz.stepper(trace, start=4)
    bundle = s._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == f"stepper over {len(trace)} steps, showing step 4 / {len(trace) - 1}"
    assert base64.b64decode(bundle["image/png"]) == expected_png(trace, 4)


def test_fallback_without_ipywidgets(trace, monkeypatch, capsys):
    from matplotlib.figure import Figure

    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import raises ImportError
    fig = viz.stepper(trace, start=2)
    assert isinstance(fig, Figure)
    assert "ipywidgets is not installed: showing step 2 as a static figure" in capsys.readouterr().out
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_render_cache_is_bounded(trace):
    s = viz.stepper(trace, cache=2)
    for i in range(4):
        s.slider.value = i
    assert sorted(s._pngs) == [2, 3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"start": -1}, "start"),
        ({"start": 10_000}, "start"),
    ],
)
def test_bad_arguments(trace, kwargs, match):
    with pytest.raises(ValueError, match=match):
        viz.stepper(trace, **kwargs)


def test_bad_traces():
    with pytest.raises(ValueError, match="no steps"):
        viz.stepper(EngineTrace(4, 4, 2, 8))
    with pytest.raises(ValueError, match="EngineTrace"):
        viz.stepper([1, 2, 3])
