"""The active sequences at each step: continuous batching as a timeline.

A row per request, a column per engine step. Each cell says what the request did in that
step: waiting, prefill (with the chunk size), decode, running but not scheduled,
preempted, swapped out. Arrival is marked at the left of the first cell and the finish
at the right of the last. Beneath: how many sequences ran in each step (against
``max_num_seqs``) and how many tokens of the budget they used (against
``max_num_batched_tokens``), split into prefill and decode tokens.

Inputs: an ``EngineTrace``. Outputs: ``timeline(trace)`` -> Figure;
``timeline_text(trace)`` -> a deterministic string, one character per step;
``timeline_cells(trace)`` -> the same as plain data (what both are drawn from).
Invariants: one state per (request, step); a request's prefill cells carry exactly the
tokens ``StepRecord.scheduled`` gave it. Failure mode: an empty trace raises ValueError.

Mirrors no vLLM file; the states are those of ``vllm/v1/request.py`` (RequestStatus) and
the per-step batch is ``vllm/v1/core/sched/output.py``'s ``num_scheduled_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from minipaged.trace import EngineTrace
from minipaged.viz import palette
from minipaged.viz.snapshot import request_order

STATES = ["absent", "waiting", "running", "prefill", "decode", "preempted", "swapped"]
STATE_CHARS = {
    "absent": " ",
    "waiting": ".",
    "running": "-",
    "prefill": "P",
    "decode": "d",
    "preempted": "X",
    "swapped": "s",
}
STATE_LABELS = {
    "waiting": "waiting",
    "running": "running, idle (0 tokens)",
    "prefill": "prefill (n tokens)",
    "decode": "decode (1 token)",
    "preempted": "preempted",
    "swapped": "swapped out",
}


@dataclass
class TimelineCells:
    order: list[str]  # request ids, arrival order (rows)
    states: list[list[str]]  # [request][step] -> one of STATES
    tokens: list[list[int]]  # [request][step] -> tokens scheduled (0 if none)
    arrival: dict[str, int]  # request id -> step it arrived at
    finish: dict[str, int]  # request id -> step it finished in
    running: list[int]  # per step: sequences scheduled
    prefill_tokens: list[int]  # per step
    decode_tokens: list[int]  # per step
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def num_steps(self) -> int:
        return len(self.running)


LABEL_CHARS = 12  # row labels longer than this are shown as r{arrival index}


def _step_states(s) -> dict[str, str]:
    """request id -> its state in step ``s``, for every request the step mentions."""
    out: dict[str, str] = {}
    for rid in s.block_tables:
        out[rid] = "running"  # holds blocks; overwritten below if it did more
    for rid in s.waiting_ids:
        out[rid] = "waiting"
    for rid in (*s.swapped_ids, *s.swapped_out_ids):
        out[rid] = "swapped"
    prefill, decode = set(s.prefill_ids), set(s.decode_ids)
    for rid, n in s.scheduled.items():
        if rid in prefill:
            out[rid] = "prefill"
        elif rid in decode:
            out[rid] = "decode"
        else:
            out[rid] = "prefill" if n > 1 else "decode"
    for rid in s.preempted_ids:
        out[rid] = "preempted"
    return out


def _state(s, rid: str) -> str:
    return _step_states(s).get(rid, "absent")


def timeline_cells(trace: EngineTrace) -> TimelineCells:
    """Per request and step, its state and tokens; per step, the batch and the budget."""
    if not trace.steps:
        raise ValueError("trace has no steps to draw")
    order = request_order(trace)
    per_step = [_step_states(s) for s in trace.steps]
    states = [[st.get(r, "absent") for st in per_step] for r in order]
    tokens = [[s.scheduled.get(r, 0) for s in trace.steps] for r in order]
    arrived_at: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    for s in trace.steps:
        for rid in s.arrived_ids:
            arrived_at.setdefault(rid, s.step)
        for rid in s.finished_ids:
            finished_at.setdefault(rid, s.step)
    arrival: dict[str, int] = {}
    finish: dict[str, int] = {}
    for k, rid in enumerate(order):
        info = trace.requests.get(rid, {})
        a = info.get("arrival_step")
        if a is None:
            a = arrived_at.get(rid)
        if a is None:
            a = next((i for i, st in enumerate(states[k]) if st != "absent"), None)
        if a is not None:
            arrival[rid] = int(a)
        f = finished_at.get(rid, info.get("finish_step"))
        if f is not None:
            finish[rid] = int(f)
    prefill_tokens, decode_tokens = [], []
    for j, s in enumerate(trace.steps):
        p = sum(tokens[k][j] for k in range(len(order)) if states[k][j] == "prefill")
        prefill_tokens.append(p)
        decode_tokens.append(sum(s.scheduled.values()) - p)
    return TimelineCells(
        order=order,
        states=states,
        tokens=tokens,
        arrival=arrival,
        finish=finish,
        running=[len(s.scheduled) for s in trace.steps],
        prefill_tokens=prefill_tokens,
        decode_tokens=decode_tokens,
        max_num_seqs=trace.max_num_seqs,
        max_num_batched_tokens=trace.max_num_batched_tokens,
    )


# -- text -------------------------------------------------------------------------

SPARK = " ▁▂▃▄▅▆▇█"


def _spark(v: int, top: int) -> str:
    if v <= 0 or top <= 0:
        return " "
    return SPARK[max(1, min(8, round(8 * v / top)))]


def _limit_line(ax, run_max: float, limit: int, name: str) -> None:
    """Scale a strip to the run's own maximum; draw the configured limit where it fits."""
    top = max(run_max, 1) * 1.25
    ax.set_ylim(0, top)
    if limit <= top:
        ax.axhline(limit, color=palette.BLACK, linestyle="--", linewidth=1.0)
        ax.text(
            1.0,
            limit,
            f"{name} {limit}",
            transform=ax.get_yaxis_transform(),
            ha="right",
            va="bottom",
            fontsize=7,
        )
    else:  # NOTE: a run far below its limit would otherwise draw bars one pixel high
        ax.text(
            1.0,
            1.0,
            f"{name} {limit} (above this scale)",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=7,
        )


def timeline_text(trace: EngineTrace, *, width: int = 100, cursor: Optional[int] = None) -> str:
    """The timeline, one character per step, wrapped every ``width`` steps.

    A row starts at its request's arrival; ``|`` marks the finish (after the last cell).
    The ``seqs`` and ``tokens`` rows are bars scaled to ``max_num_seqs`` and
    ``max_num_batched_tokens``. ``cursor`` puts a ``v`` over one step.
    """
    if not isinstance(width, int) or width <= 0:
        raise ValueError(f"width must be a positive int, got {width!r}")
    c = timeline_cells(trace)
    n = c.num_steps
    if cursor is not None and not 0 <= cursor < n:
        raise ValueError(f"cursor {cursor} is outside the trace (0 .. {n - 1})")
    w = max(6, *(len(r) for r in c.order))
    legend = "  ".join(f"{STATE_CHARS[s]} {s}" for s in STATES[1:])
    lines = [
        f"timeline: {len(c.order)} requests x {n} steps | max_num_seqs {c.max_num_seqs} | "
        f"max_num_batched_tokens {c.max_num_batched_tokens}",
        f"  {legend}  | finish (a row starts at its arrival)",
    ]
    for start in range(0, n, width):
        end = min(n, start + width)
        lines.append("")
        ticks = [" "] * (end - start)
        for j in range(start, end):
            # the step number, written from its column rightwards where it fits
            if j % 10 == 0 and j - start + len(str(j)) <= len(ticks):
                for o, ch in enumerate(str(j)):
                    ticks[j - start + o] = ch
        ticks = "".join(ticks)
        lines.append(f"{'step':<{w}}  {ticks.rstrip()}")
        if cursor is not None and start <= cursor < end:
            lines.append(f"{'':<{w}}  {' ' * (cursor - start)}v")
        for k, rid in enumerate(c.order):
            row = []
            for j in range(start, end):
                ch = STATE_CHARS[c.states[k][j]]
                if c.finish.get(rid) == j - 1 and ch == " ":
                    ch = "|"
                row.append(ch)
            if c.finish.get(rid) == end - 1 and end == n:
                row.append("|")
            text = "".join(row).rstrip()
            if text:
                lines.append(f"{rid:<{w}}  {text}")
        seqs = "".join(_spark(c.running[j], c.max_num_seqs) for j in range(start, end))
        toks = "".join(
            _spark(c.prefill_tokens[j] + c.decode_tokens[j], c.max_num_batched_tokens)
            for j in range(start, end)
        )
        lines.append(f"{'seqs':<{w}}  {seqs.rstrip()}")
        lines.append(f"{'tokens':<{w}}  {toks.rstrip()}")
    used = [p + d for p, d in zip(c.prefill_tokens, c.decode_tokens)]
    lines.append("")
    lines.append(
        f"sequences per step: max {max(c.running)}/{c.max_num_seqs}, mean "
        f"{sum(c.running) / n:.2f} | tokens per step: max {max(used)}/"
        f"{c.max_num_batched_tokens}, mean {sum(used) / n:.2f} | preemptions: "
        f"{sum(row.count('preempted') for row in c.states)}"
    )
    return "\n".join(lines)


# -- figure -----------------------------------------------------------------------


def figure_size(trace: EngineTrace) -> tuple[float, float]:
    n_req = len(request_order(trace))
    return 12.0, min(11.0, 2.9 + 0.24 * min(max(n_req, 3), 34))


def _bars(ax, heights, bottom, color) -> None:
    """A bar per step; beyond 120 steps one filled staircase (thousands of bar patches
    would take seconds to draw)."""
    import numpy as np

    n = len(heights)
    if n <= 120:
        ax.bar(np.arange(n), heights, width=0.9, bottom=bottom, color=color, linewidth=0)
    else:
        top = bottom + np.asarray(heights, dtype=float)
        ax.stairs(top, np.arange(n + 1) - 0.5, baseline=bottom, fill=True, color=color, linewidth=0)


def draw_timeline(
    fig,
    trace: EngineTrace,
    cursor: Optional[int] = None,
    cells: Optional[TimelineCells] = None,
    legend_cols: int = 8,
) -> list:
    """Draw the timeline into ``fig`` (a Figure or SubFigure); returns its three axes."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator

    from minipaged.viz import _draw

    c = cells or timeline_cells(trace)
    n, R = c.num_steps, len(c.order)
    # NOTE: the strips keep their height however many rows the grid has
    gs = fig.add_gridspec(
        3,
        1,
        height_ratios=[min(max(R, 3), 34) * 0.24, 0.62, 0.75],
        hspace=0.12,
        **_draw.margins(fig, left=0.9, right=0.15, top=0.75, bottom=0.5),
    )
    ax = fig.add_subplot(gs[0])
    ax_s = fig.add_subplot(gs[1], sharex=ax)
    ax_t = fig.add_subplot(gs[2], sharex=ax)

    grid = np.array([[STATES.index(st) for st in row] for row in c.states], dtype=float)
    cmap = ListedColormap([palette.STATE_COLORS[s] for s in STATES])
    ax.imshow(
        grid.reshape(R, n),
        cmap=cmap,
        vmin=-0.5,
        vmax=len(STATES) - 0.5,
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, n - 0.5, R - 0.5, -0.5),
    )
    # thin white lines between rows keep neighbouring requests apart
    for y in range(1, R):
        ax.axhline(y - 0.5, color="white", linewidth=0.8 if R <= 30 else 0.4)
    cw, ch = _draw.cell_points(ax, n, R)
    max_chunk = max((t for row in c.tokens for t in row), default=1)
    fs = _draw.fit_fontsize(cw, ch, len(str(max_chunk)))
    if fs >= _draw.MIN_FONT:
        for k in range(R):
            for j in range(n):
                if c.states[k][j] == "prefill":
                    ax.text(j, k, str(c.tokens[k][j]), ha="center", va="center", fontsize=fs, color="white")
    # arrival and finish marks
    ms = max(1.5, min(7.0, ch * 0.55))
    arr = [(c.arrival[r] - 0.5, k) for k, r in enumerate(c.order) if r in c.arrival]
    if arr:
        ax.plot(*zip(*arr), marker=">", color=palette.BLACK, markersize=ms, linestyle="none", clip_on=False)
    fin = [(c.finish[r] + 0.5, k) for k, r in enumerate(c.order) if r in c.finish]
    if fin:
        x_f, y_f = zip(*fin)
        ax.vlines(
            x_f,
            [y - 0.42 for y in y_f],
            [y + 0.42 for y in y_f],
            colors=palette.BLACK,
            linewidth=2.0 if ch >= 4 else 1.0,
        )
    # label every row while rows are tall enough, else every k-th
    every = max(1, math.ceil(11.0 / max(ch, 0.1)))
    ax.set_yticks(range(0, R, every))
    # NOTE: a long id (a server's 36-character uuid) becomes r{k}, k its arrival index,
    # as the block tables name it; short ids stay as they are
    ax.set_yticklabels([palette.short_name(r, k, width=LABEL_CHARS) for k, r in enumerate(c.order)][::every])
    # a swatch of the request's own colour (the same as in the block tables)
    for k, lab in zip(range(0, R, every), ax.get_yticklabels()):
        col = palette.owner_color(k)
        lab.set_bbox(dict(facecolor=col, edgecolor="none", pad=1.2))
        lab.set_color(palette.text_color_on(col))
    ax.tick_params(axis="y", length=0, pad=4)
    ax.tick_params(axis="x", labelbottom=False)
    ax.set_ylim(R - 0.5, -0.5)
    ax.set_xlim(-0.5 - (0.6 if n < 40 else n * 0.015), n - 0.5 + (0.6 if n < 40 else n * 0.015))
    ax.set_ylabel("request")

    # strips: sequences in the batch, tokens of the budget
    _bars(ax_s, c.running, np.zeros(n), palette.BATCH_BLUE)
    _limit_line(ax_s, max(c.running), c.max_num_seqs, "max_num_seqs")
    ax_s.set_ylabel("seqs", rotation=0, ha="right", va="center")
    ax_s.yaxis.set_major_locator(MaxNLocator(3, integer=True))
    ax_s.tick_params(axis="x", labelbottom=False)

    _bars(ax_t, c.prefill_tokens, np.zeros(n), palette.STATE_COLORS["prefill"])
    _bars(ax_t, c.decode_tokens, np.asarray(c.prefill_tokens, dtype=float), palette.STATE_COLORS["decode"])
    _limit_line(
        ax_t,
        max(p + d for p, d in zip(c.prefill_tokens, c.decode_tokens)),
        c.max_num_batched_tokens,
        "max_num_batched_tokens",
    )
    ax_t.set_ylabel("tokens", rotation=0, ha="right", va="center")
    ax_t.yaxis.set_major_locator(MaxNLocator(3, integer=True))
    ax_t.xaxis.set_major_locator(MaxNLocator(min(n, 20), integer=True))
    ax_t.set_xlabel("engine step")
    for a in (ax_s, ax_t):
        for side in ("top", "right"):
            a.spines[side].set_visible(False)

    if cursor is not None:
        for a in (ax_s, ax_t):
            a.axvspan(cursor - 0.5, cursor + 0.5, color=palette.BLACK, alpha=0.12, zorder=0, linewidth=0)
        # NOTE: the frame is exactly the step's column; on a narrow column a thick outline
        # would cover the cells it marks, so its line thins with the column (cw points wide).
        ax.add_patch(
            Rectangle(
                (cursor - 0.5, -0.5),
                1,
                R,
                fill=False,
                edgecolor=palette.BLACK,
                linewidth=2.0 if cw >= 8 else max(0.5, min(1.5, cw / 5)),
                clip_on=False,
            )
        )
        ax.plot(cursor, -0.5, marker="v", color=palette.BLACK, markersize=8, clip_on=False)

    handles = [
        Patch(
            facecolor=palette.STATE_COLORS[s],
            label=STATE_LABELS[s],
            edgecolor="#999999" if s == "running" else "none",
        )
        for s in STATES[1:]
    ]
    handles += [
        Line2D([], [], marker=">", color=palette.BLACK, linestyle="none", label="arrival"),
        Line2D(
            [],
            [],
            marker="|",
            color=palette.BLACK,
            linestyle="none",
            markersize=9,
            markeredgewidth=2,
            label="finish",
        ),
    ]
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.01),
        ncol=min(legend_cols, len(handles)),
        frameon=False,
        handlelength=1.3,
        columnspacing=1.0,
        borderaxespad=0.1,
    )
    return [ax, ax_s, ax_t]


def timeline(trace: EngineTrace, *, cursor: Optional[int] = None, managed: bool = True):
    """Figure: the active sequences at every step (see the module docstring).

    In a notebook: ``fig = timeline(trace); plt.show(); plt.close(fig)``.
    """
    from minipaged.viz import _draw

    cells = timeline_cells(trace)
    if cursor is not None and not 0 <= cursor < cells.num_steps:
        raise ValueError(f"cursor {cursor} is outside the trace (0 .. {cells.num_steps - 1})")
    with _draw.rc_context():
        fig = _draw.new_figure(figure_size(trace), managed=managed)
        draw_timeline(fig, trace, cursor=cursor, cells=cells)
        fig.suptitle(
            f"Active sequences per engine step ({_draw.plural(len(cells.order), 'request')}, "
            f"{_draw.plural(cells.num_steps, 'step')})",
            x=0.01,
            ha="left",
            fontsize=11,
            y=0.99,
            va="top",
        )
    return fig


def timelines(traces: dict, *, managed: bool = True):
    """Figure: several runs' timelines side by side, one panel per ``{title: trace}`` entry,
    on a common step axis so that their lengths compare at a glance (chapter 08's pairs).

    In a notebook: ``fig = timelines({"v0": t0, "v1": t1}); plt.show(); plt.close(fig)``.
    """
    from minipaged.viz import _draw

    if not traces or not isinstance(traces, dict):
        raise ValueError(f"traces must be a non-empty dict of title -> EngineTrace, got {traces!r}")
    n = len(traces)
    h = max(figure_size(t)[1] for t in traces.values())
    with _draw.rc_context():
        fig = _draw.new_figure((min(16.0, 7.0 * n), h), managed=managed)
        subs = fig.subfigures(1, n, wspace=0.02) if n > 1 else [fig]
        longest = max(len(t.steps) for t in traces.values())
        for sub, (title, trace) in zip(subs, traces.items()):
            axes = draw_timeline(sub, trace, legend_cols=3)
            for ax in axes:
                ax.set_xlim(-0.5, longest - 0.5)
            sub.suptitle(
                f"{title}: {_draw.plural(len(trace.steps), 'step')}",
                x=0.02,
                ha="left",
                fontsize=11,
                fontweight="bold",
                y=0.99,
                va="top",
            )
    return fig
