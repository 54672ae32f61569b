"""One engine step, the lecture's picture: the active sequences and the block tables.

Left, the timeline of every request with the current step highlighted (who is in the
batch, who waits, who was preempted); right, the block tables after that step (where
each running request's KV lives). Stepping ``i`` through a trace plays continuous
batching and paging together, like a debugger (``minipaged.viz.widgets.stepper``).

Inputs: an ``EngineTrace`` and a step index ``i`` (negative counts from the end).
Outputs: ``step(trace, i)`` -> Figure; ``step_text(trace, i)`` -> what was scheduled and
the block tables, as a deterministic string. Failure mode: ``i`` outside the trace
raises ``ValueError``.
"""

from __future__ import annotations

from minipaged.trace import EngineTrace
from minipaged.viz.snapshot import _check_step, request_order, snapshot_from_trace


def step_text(trace: EngineTrace, i: int, *, columns: int = 8) -> str:
    """What step ``i`` scheduled, who waits / was preempted / finished, and the blocks."""
    from minipaged.viz.activity import _state
    from minipaged.viz.blocks import block_tables_text

    i = _check_step(trace, i)
    s = trace.steps[i]
    order = request_order(trace)
    pos = {r: k for k, r in enumerate(order)}
    batch = []
    for rid in sorted(s.scheduled, key=pos.get):
        kind = _state(s, rid)
        batch.append(f"{rid} {kind} {s.scheduled[rid]}")
    used = sum(s.scheduled.values())

    def ids(xs) -> str:
        return " ".join(sorted(xs, key=lambda r: pos.get(r, len(pos)))) or "-"

    when = "" if s.time is None else f" | t = {s.time:.3f} s"
    lines = [
        f"step {i} / {len(trace.steps) - 1}{when} | batch {len(s.scheduled)}/"
        f"{trace.max_num_seqs} seqs, {used}/{trace.max_num_batched_tokens} tokens",
        f"scheduled: {', '.join(batch) or '-'}",
        f"arrived: {ids(s.arrived_ids)} | waiting: {ids(s.waiting_ids)} | "
        f"preempted: {ids(s.preempted_ids)} | finished: {ids(s.finished_ids)}",
    ]
    if s.swapped_out_ids or s.swapped_in_ids or s.swapped_ids:
        lines.append(
            f"swapped out: {ids(s.swapped_out_ids)} | swapped in: {ids(s.swapped_in_ids)} | "
            f"in CPU pool: {ids(s.swapped_ids)}"
        )
    lines.append(block_tables_text(trace, i, columns=columns))
    return "\n".join(lines)


def draw_step(fig, trace: EngineTrace, i: int, cells=None) -> None:
    """Draw step ``i`` into ``fig``: timeline with a cursor left, block tables right."""
    from minipaged.viz import _draw
    from minipaged.viz.activity import draw_timeline
    from minipaged.viz.blocks import draw_block_tables

    i = _check_step(trace, i)
    left, right = fig.subfigures(1, 2, width_ratios=[1.0, 1.1], wspace=0.0)
    draw_timeline(left, trace, cursor=i, cells=cells, legend_cols=4)
    s = trace.steps[i]
    left.suptitle(
        f"Step {i} / {len(trace.steps) - 1}: {_draw.plural(len(s.scheduled), 'sequence')}, "
        f"{_draw.plural(sum(s.scheduled.values()), 'token')} in the batch",
        x=0.01,
        ha="left",
        fontsize=11,
        fontweight="bold",
        y=0.99,
        va="top",
    )
    draw_block_tables(right, snapshot_from_trace(trace, i))


def figure_size(trace: EngineTrace) -> tuple[float, float]:
    from minipaged.viz import activity, blocks

    i = len(trace.steps) - 1
    h = max(activity.figure_size(trace)[1], blocks.figure_size(snapshot_from_trace(trace, i))[1])
    return 16.0, min(11.0, h + 0.5)


def step(trace: EngineTrace, i: int, *, managed: bool = True):
    """Figure: step ``i`` of ``trace``, both pictures side by side.

    In a notebook: ``fig = step(trace, 5); plt.show(); plt.close(fig)``.
    """
    from minipaged.viz import _draw

    with _draw.rc_context():
        fig = _draw.new_figure(figure_size(trace), managed=managed)
        draw_step(fig, trace, i)
    return fig
