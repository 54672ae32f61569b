"""A step-through player over an ``EngineTrace``: continuous batching like a debugger.

``stepper(trace)`` shows ``step(trace, i)`` (the active sequences with step ``i``
highlighted, beside the block tables after step ``i``) with a slider, a play button and
previous / next buttons, and a label ``step i / last``. All the logic is the pictures of
``minipaged.viz``; the widget only picks ``i``, so everything it shows is tested in
pytest, and a text rendering of one step (``step_text``) follows it in the chapters.

Inputs: an ``EngineTrace`` with at least one step. Output: a ``Stepper`` (an ipywidgets
``VBox``). The picture is an ``ipywidgets.Image`` holding the PNG of the current step
(rendered off-screen, pyplot untouched, recent steps cached), so it needs no live
matplotlib backend in the front end and the current picture can be read back in tests
(``stepper.image.value``).

Fallbacks
    - where ipywidgets is not installed, ``stepper`` returns the static figure of step
      ``start`` (and says so);
    - where the front end cannot render widgets (a static notebook viewer, nbconvert to
      HTML), the ``Stepper`` also offers its current picture as ``image/png`` and a line
      of ``text/plain``, which such viewers show instead of the widget.
Invariants (``Stepper.check_invariants``): the slider, the play head, the label and the
picture all show the same step.
Failure mode: an empty trace or ``start`` outside it raises ``ValueError``.

vLLM has no counterpart (it has no pictures); the widget plays back what
``minipaged.trace.record_step`` recorded.
"""

from __future__ import annotations

import base64
from collections import OrderedDict

from minipaged.trace import EngineTrace


def _label(i: int, n: int) -> str:
    return f"step {i} / {n - 1}"


def stepper(trace: EngineTrace, *, start: int = 0, interval_ms: int = 700, cache: int = 32):
    """A slider + play + prev/next player over ``step(trace, i)``; see the module docstring."""
    if not isinstance(trace, EngineTrace):
        raise ValueError(f"trace must be an EngineTrace, got {type(trace).__name__}")
    n = len(trace.steps)
    if n == 0:
        raise ValueError("trace has no steps to step through")
    if not isinstance(start, int) or not 0 <= start < n:
        raise ValueError(f"start must be a step in 0 .. {n - 1}, got {start!r}")
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        from minipaged.viz.stepview import step

        print(f"ipywidgets is not installed: showing step {start} as a static figure")
        return step(trace, start)
    return _make_stepper(trace, start=start, interval_ms=interval_ms, cache=cache)


def _make_stepper(trace: EngineTrace, *, start: int, interval_ms: int, cache: int):
    import ipywidgets as w

    class Stepper(w.VBox):
        """The player; ``.slider``, ``.play``, ``.prev_button``, ``.next_button``,
        ``.label`` and ``.image`` are its parts, ``.value`` the step shown."""

        def __init__(self) -> None:
            n = len(trace.steps)
            self.trace = trace
            self._pngs: OrderedDict[int, bytes] = OrderedDict()
            self._cache = max(1, cache)
            self.slider = w.IntSlider(
                value=start,
                min=0,
                max=n - 1,
                step=1,
                description="step",
                continuous_update=False,
                readout=False,
                layout=w.Layout(width="420px"),
            )
            self.play = w.Play(
                value=start, min=0, max=n - 1, step=1, interval=interval_ms, description="play"
            )
            # NOTE: the link runs in the browser, so play -> slider costs no round trip
            w.jslink((self.play, "value"), (self.slider, "value"))
            self.prev_button = w.Button(
                description="◀ prev", tooltip="previous step", layout=w.Layout(width="80px")
            )
            self.next_button = w.Button(
                description="next ▶", tooltip="next step", layout=w.Layout(width="80px")
            )
            self.label = w.Label(value=_label(start, n))
            self.label.add_class("minipaged-step-label")
            self.image = w.Image(format="png", value=self.render(start), layout=w.Layout(max_width="100%"))
            self.prev_button.on_click(lambda _: self.go(self.slider.value - 1))
            self.next_button.on_click(lambda _: self.go(self.slider.value + 1))
            self.slider.observe(self._on_value, names="value")
            controls = w.HBox([self.play, self.prev_button, self.slider, self.next_button, self.label])
            super().__init__([controls, self.image])
            self.add_class("minipaged-stepper")

        @property
        def value(self) -> int:
            return self.slider.value

        def go(self, i: int) -> None:
            """Show step ``i`` (clamped to the trace)."""
            self.slider.value = max(0, min(len(self.trace.steps) - 1, int(i)))

        def render(self, i: int) -> bytes:
            """PNG of ``step(trace, i)``; the last ``cache`` steps are kept."""
            if i in self._pngs:
                self._pngs.move_to_end(i)
                return self._pngs[i]
            from minipaged.viz import _draw
            from minipaged.viz.stepview import step

            png = _draw.png_bytes(step(self.trace, i, managed=False))
            self._pngs[i] = png
            while len(self._pngs) > self._cache:
                self._pngs.popitem(last=False)
            return png

        def _on_value(self, change) -> None:
            i = change["new"]
            self.image.value = self.render(i)
            self.label.value = _label(i, len(self.trace.steps))
            if self.play.value != i:  # keep the play head where the slider is
                self.play.value = i

        def check_invariants(self) -> None:
            n, i = len(self.trace.steps), self.slider.value
            assert 0 <= i < n, f"slider at {i}, outside 0 .. {n - 1}"
            assert self.play.value == i, f"play head at {self.play.value}, slider at {i}"
            assert self.label.value == _label(i, n), f"label {self.label.value!r} at step {i}"
            assert self.image.value == self.render(i), f"the picture is not step {i}'s"

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs) or {}
            # NOTE: a viewer without a widget manager falls back to these two
            data["text/plain"] = (
                f"stepper over {len(self.trace.steps)} steps, showing "
                f"{_label(self.value, len(self.trace.steps))}"
            )
            data["image/png"] = base64.b64encode(self.render(self.value)).decode("ascii")
            return data

    return Stepper()
