"""Swap preemption as a picture: the device pool, the CPU pool, and the blocks moving.

A swap-out copies a victim's blocks from the device (GPU) pool to the CPU pool; a swap-in
copies them back, to device blocks that may differ from the ones it left. The copies of one
step are the ``PaperSchedulerOutput``'s ``blocks_to_swap_out`` / ``blocks_to_swap_in`` lists of
``(src, dst)`` block ids; the engine does them before the model runs.

    out = scheduler.schedule()
    fig = swap_blocks(trace, i, out.blocks_to_swap_out, out.blocks_to_swap_in, num_cpu_blocks=4)
    print(swap_blocks_text(trace, i, out.blocks_to_swap_out, out.blocks_to_swap_in, 4))

inputs: an ``EngineTrace`` (device block tables before and after step ``i``), that step's
two copy lists, the CPU pool's size. outputs: a Figure (device row on top, CPU row beneath,
an arrow in the owner's colour per copied block, down for swap-out, up for swap-in) and
its text rendering. invariants: each copied block is drawn in its owner's colour at both
ends; a device block that left this step has the dashed "freed this step" edge.
failure mode: a block id outside its pool -> ``ValueError`` naming the argument.
vLLM v0: ``vllm/core/block_manager.py`` (``swap_out``, ``swap_in``); vLLM v1 has no swap.
"""

from __future__ import annotations

from minipaged.trace import EngineTrace
from minipaged.viz import palette
from minipaged.viz.snapshot import _check_step, request_order


def _owners(trace: EngineTrace, i: int, moves, side: int) -> dict[int, str]:
    """Device block -> request id, for the device end of each move (``side`` 0 = src)."""
    tables = trace.steps[i - 1].block_tables if side == 0 and i > 0 else trace.steps[i].block_tables
    owner = {b: rid for rid, t in tables.items() for b in t}
    return {m[side]: owner.get(m[side], "?") for m in moves}


def _check(trace, i, out_moves, in_moves, num_cpu_blocks):
    i = _check_step(trace, i)
    if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 1:
        raise ValueError(f"num_cpu_blocks must be a positive int, got {num_cpu_blocks!r}")
    for name, moves, (src_n, dst_n) in (
        ("blocks_to_swap_out", out_moves, (trace.num_blocks, num_cpu_blocks)),
        ("blocks_to_swap_in", in_moves, (num_cpu_blocks, trace.num_blocks)),
    ):
        for src, dst in moves:
            if not (0 <= src < src_n and 0 <= dst < dst_n):
                raise ValueError(f"{name}: ({src}, {dst}) is outside the pools ({src_n}, {dst_n} blocks)")
    return i, list(out_moves), list(in_moves)


def swap_blocks_text(
    trace: EngineTrace, i: int, blocks_to_swap_out, blocks_to_swap_in, num_cpu_blocks: int
) -> str:
    """The copies of step ``i``, one line each, with their owners."""
    i, outs, ins = _check(trace, i, blocks_to_swap_out, blocks_to_swap_in, num_cpu_blocks)
    lines = [f"step {i}: device pool {trace.num_blocks} blocks, CPU pool {num_cpu_blocks} blocks"]
    own_out, own_in = _owners(trace, i, outs, 0), _owners(trace, i, ins, 1)
    lines += [f"  swap out {own_out[d]}: device {d} -> cpu {c}" for d, c in outs]
    lines += [f"  swap in  {own_in[d]}: cpu {c} -> device {d}" for c, d in ins]
    if not outs and not ins:
        lines.append("  no copies")
    return "\n".join(lines)


def swap_blocks(
    trace: EngineTrace,
    i: int,
    blocks_to_swap_out,
    blocks_to_swap_in,
    num_cpu_blocks: int,
    *,
    managed: bool = True,
):
    """Figure: step ``i``'s device pool (after the step) over the CPU pool, copies as arrows."""
    from matplotlib import patheffects
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from minipaged.viz import _draw
    from minipaged.viz.blocks import FREED_EDGE

    # a dark outline keeps light owner colours (yellow) readable on the white background
    ARROW_OUTLINE = [patheffects.Stroke(linewidth=3.6, foreground=palette.BLACK), patheffects.Normal()]

    i, outs, ins = _check(trace, i, blocks_to_swap_out, blocks_to_swap_in, num_cpu_blocks)
    order = request_order(trace)

    def color(rid):
        return palette.owner_color(order.index(rid)) if rid in order else palette.FREE_GREY

    after = {b: rid for rid, t in trace.steps[i].block_tables.items() for b in t}
    own_out, own_in = _owners(trace, i, outs, 0), _owners(trace, i, ins, 1)
    cpu_held = {c: own_out[d] for d, c in outs}  # CPU blocks filled this step
    cpu_left = {c: own_in[d] for c, d in ins}  # CPU blocks emptied this step
    width = max(trace.num_blocks, num_cpu_blocks)
    with _draw.rc_context():
        fig_w = min(12.0, 1.5 + 0.8 * width)
        fig = _draw.new_figure((fig_w, 2.9), managed=managed)
        ax = fig.add_subplot(1, 1, 1)
        fig.subplots_adjust(left=1.3 / fig_w, right=0.99, top=0.82, bottom=0.04)
        ax.set_xlim(-0.1, width + 0.1)
        ax.set_ylim(-0.2, 3.0)
        ax.axis("off")

        def cell(x, y, rid, label, dashed=False):
            face = color(rid) if rid else palette.FREE_GREY
            ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=face, edgecolor="white", linewidth=1.5))
            if dashed:
                ax.add_patch(
                    Rectangle(
                        (x + 0.05, y + 0.05),
                        0.9,
                        0.7,
                        fill=False,
                        edgecolor=FREED_EDGE,
                        linestyle=(0, (2.5, 1.5)),
                    )
                )
            ax.text(
                x + 0.5,
                y + 0.4,
                label,
                ha="center",
                va="center",
                fontsize=8,
                color=palette.text_color_on(face),
            )

        left_device = {d for d, _ in outs}
        for b in range(trace.num_blocks):
            rid = after.get(b)
            cell(b, 2.0, rid, f"{b}\n{rid}" if rid else str(b), dashed=b in left_device and rid is None)
        for c in range(num_cpu_blocks):
            rid = cpu_held.get(c)
            cell(c, 0.0, rid, f"{c}\n{rid}" if rid else str(c), dashed=c in cpu_left)
        ax.text(-0.2, 2.4, f"device pool\n({trace.num_blocks} blocks)", ha="right", va="center", fontsize=9)
        ax.text(-0.2, 0.4, f"CPU pool\n({num_cpu_blocks} blocks)", ha="right", va="center", fontsize=9)
        for d, c in outs:
            ax.add_patch(
                FancyArrowPatch(
                    (d + 0.5, 2.0),
                    (c + 0.5, 0.8),
                    arrowstyle="-|>",
                    mutation_scale=12,
                    color=color(own_out[d]),
                    lw=2.0,
                    path_effects=ARROW_OUTLINE,
                )
            )
        for c, d in ins:
            ax.add_patch(
                FancyArrowPatch(
                    (c + 0.5, 0.8),
                    (d + 0.5, 2.0),
                    arrowstyle="-|>",
                    mutation_scale=12,
                    color=color(own_in[d]),
                    lw=2.0,
                    path_effects=ARROW_OUTLINE,
                )
            )
        what = []
        if outs:
            what.append(f"swap out {' '.join(sorted(set(own_out.values())))}: {len(outs)} blocks to the CPU")
        if ins:
            what.append(f"swap in {' '.join(sorted(set(own_in.values())))}: {len(ins)} blocks back")
        fig.suptitle(
            f"Step {i}: " + ("; ".join(what) or "no copies"),
            x=0.01,
            ha="left",
            fontsize=11,
            fontweight="bold",
        )
    return fig
