"""Matplotlib plumbing shared by the pictures: figure creation, font fitting, PNG output.

matplotlib is imported inside these functions, never at module import, so
``import minipaged.viz`` stays cheap and the text renderings work without it.

``new_figure(figsize, managed)``: a pyplot figure (``managed=True``: shows inline in a
notebook, close it with ``plt.close(fig)``) or a free-standing ``Figure`` that pyplot never
sees (``managed=False``: for widgets and files; nothing to close, nothing shown twice).
``png_bytes(fig)`` / ``save_png(fig, path)``: PNG with no software/date metadata, so the
same figure gives the same bytes on every run.

Failure mode: none of its own; matplotlib errors propagate. vLLM has no counterpart.
"""

from __future__ import annotations

import io

DPI = 100
# NOTE: fixed fonts and hinting so the same figure renders to the same pixels; metadata
# "Software" is dropped because it carries the matplotlib version.
RC = {
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "svg.hashsalt": "minipaged",
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
    "path.simplify": True,
}
PNG_METADATA = {"Software": None}


def plural(n: int, word: str) -> str:
    """``"1 token"``, ``"2 tokens"``: a count and its noun, for figure titles."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def new_figure(figsize, managed: bool = True):
    import matplotlib

    with matplotlib.rc_context(RC):
        if managed:
            import matplotlib.pyplot as plt

            fig = plt.figure(figsize=figsize, dpi=DPI)
        else:
            from matplotlib.figure import Figure

            fig = Figure(figsize=figsize, dpi=DPI)
    return fig


def rc_context():
    import matplotlib

    return matplotlib.rc_context(RC)


def cell_points(ax, nx: int, ny: int) -> tuple[float, float]:
    """Width and height, in points, of one cell of an ``nx`` x ``ny`` grid filling ``ax``."""
    bbox = ax.get_window_extent()  # display pixels, also inside a SubFigure
    scale = 72.0 / ax.get_figure(root=True).dpi
    return bbox.width * scale / max(nx, 1), bbox.height * scale / max(ny, 1)


def fig_inches(fig) -> tuple[float, float]:
    """Size in inches of a Figure or a SubFigure."""
    dpi = fig.get_figure(root=True).dpi
    return fig.bbox.width / dpi, fig.bbox.height / dpi


def margins(fig, left=0.9, right=0.2, top=0.7, bottom=0.6) -> dict:
    """gridspec left/right/top/bottom for margins given in inches."""
    w, h = fig_inches(fig)
    return dict(
        left=min(0.4, left / w),
        right=max(0.6, 1 - right / w),
        top=max(0.55, 1 - top / h),
        bottom=min(0.4, bottom / h),
    )


def fit_fontsize(cell_w: float, cell_h: float, nchars: int, lines: int = 1, cap=8.0) -> float:
    """Largest font size (pt) at which ``nchars`` x ``lines`` of text fit in a cell."""
    by_w = 0.9 * cell_w / (0.62 * max(nchars, 1))  # DejaVu Sans: ~0.6 em per glyph
    by_h = 0.8 * cell_h / (1.25 * lines)
    return min(cap, by_w, by_h)


MIN_FONT = 5.0  # below this, labels are dropped rather than drawn unreadably small


def png_bytes(fig, dpi="figure") -> bytes:
    buf = io.BytesIO()
    with rc_context():
        fig.savefig(buf, format="png", dpi=dpi, metadata=PNG_METADATA)
    return buf.getvalue()


def save_png(fig, path, dpi="figure") -> None:
    with open(path, "wb") as f:
        f.write(png_bytes(fig, dpi=dpi))
