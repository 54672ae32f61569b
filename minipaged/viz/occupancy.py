"""KV cache slots over time: holding tokens, reserved but unused, free.

The paper's memory argument (Fig. 2) as it unfolds step by step: with paging, the slots
reserved but not yet holding a token are only the tails of each request's last block, so
the orange band stays thin while the blue band (real token states) grows and shrinks
with the batch. Preemptions and swap-outs are marked above the plot.

Inputs: an ``EngineTrace``. Outputs: ``memory(trace)`` -> Figure; ``memory_text(trace)``
-> a deterministic table; ``memory_series(trace)`` -> the numbers both are drawn from.
Invariants: per step, ``tokens + reserved + free == num_blocks * block_size`` (a block is
either held or free); a shared block's slots count once. Failure mode: an empty trace
raises ``ValueError``.

Mirrors ``KVCacheManager.usage()`` (``minipaged/core/kv/kv_cache_manager.py``), applied to
every recorded step.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipaged.trace import EngineTrace
from minipaged.viz import palette
from minipaged.viz.snapshot import block_tokens


@dataclass
class MemorySeries:
    num_slots: int
    tokens: list[int]  # per step: slots holding a token's K/V
    reserved: list[int]  # per step: slots in held blocks not holding a token (yet)
    free: list[int]  # per step: slots in free blocks
    preemptions: list[int]  # per step: requests preempted (recompute)
    swapped_out: list[int]  # per step: requests swapped out to the CPU pool

    @property
    def num_steps(self) -> int:
        return len(self.tokens)


def memory_series(trace: EngineTrace) -> MemorySeries:
    if not trace.steps:
        raise ValueError("trace has no steps to draw")
    bs = trace.block_size
    tokens, reserved, free, pre, swp = [], [], [], [], []
    for s in trace.steps:
        per_block = block_tokens(s.block_tables, s.num_tokens, bs)
        held = sum(per_block.values())
        tokens.append(held)
        reserved.append(len(per_block) * bs - held)
        free.append((trace.num_blocks - len(per_block)) * bs)
        pre.append(len(s.preempted_ids))
        swp.append(len(s.swapped_out_ids))
    return MemorySeries(trace.num_blocks * bs, tokens, reserved, free, pre, swp)


def memory_text(trace: EngineTrace, *, max_rows: int = 24, bar: int = 40) -> str:
    """A table of slots per step (at most ``max_rows`` evenly spaced steps, last included).

    The bar: ``#`` holding tokens, ``+`` reserved but unused, ``.`` free.
    """
    if not isinstance(max_rows, int) or max_rows <= 0:
        raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
    if not isinstance(bar, int) or bar <= 0:
        raise ValueError(f"bar must be a positive int, got {bar!r}")
    m = memory_series(trace)
    n = m.num_steps
    if n <= max_rows:
        rows = list(range(n))
    else:
        rows = sorted({round(k * (n - 1) / (max_rows - 1)) for k in range(max_rows)})
    lines = [
        f"KV slots per step: {trace.num_blocks} blocks x {trace.block_size} = {m.num_slots} "
        f"slots | # holding tokens  + reserved, unused  . free",
        f"{'step':>5} {'tokens':>7} {'unused':>7} {'free':>7} {'tok/rsv':>8}  bar",
    ]
    for i in rows:
        t, r, f = m.tokens[i], m.reserved[i], m.free[i]
        nt = round(bar * t / m.num_slots)
        nr = round(bar * (t + r) / m.num_slots) - nt
        frac = f"{100 * t / (t + r):.1f}%" if t + r else "-"
        mark = ("  preempted" if m.preemptions[i] else "") + ("  swapped out" if m.swapped_out[i] else "")
        lines.append(
            f"{i:>5} {t:>7} {r:>7} {f:>7} {frac:>8}  {'#' * nt}{'+' * nr}{'.' * (bar - nt - nr)}{mark}"
        )
    tot_t, tot_r = sum(m.tokens), sum(m.reserved)
    peak = max(t + r for t, r in zip(m.tokens, m.reserved))
    lines.append(
        f"over {n} steps: {100 * tot_t / max(1, tot_t + tot_r):.1f}% of reserved slots held "
        f"tokens; peak reserved {peak}/{m.num_slots} slots; "
        f"{sum(m.preemptions)} preempted, {sum(m.swapped_out)} swapped out"
    )
    return "\n".join(lines)


def draw_memory(fig, trace: EngineTrace, series: MemorySeries | None = None):
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    m = series or memory_series(trace)
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.80, bottom=0.13)
    x = np.arange(m.num_steps)
    # NOTE: step-shaped bands: the state is constant over a step
    ax.stackplot(
        np.append(np.repeat(x, 2)[1:], m.num_steps) - 0.5,  # step i spans i +- 0.5
        *[np.repeat(np.asarray(v), 2) for v in (m.tokens, m.reserved, m.free)],
        colors=[palette.MEMORY_COLORS[k] for k in ("tokens", "reserved", "free")],
        labels=["holding tokens", "reserved, not holding a token (yet)", "free"],
        linewidth=0,
    )
    ax.set_xlim(-0.5, m.num_steps - 0.5)
    ax.set_ylim(0, m.num_slots)
    ax.set_ylabel(f"KV slots (of {m.num_slots})")
    ax.set_xlabel("engine step")
    ax.xaxis.set_major_locator(MaxNLocator(min(m.num_steps, 20), integer=True))
    for kind, marks, color in (
        ("preempted (recompute)", m.preemptions, palette.STATE_COLORS["preempted"]),
        ("swapped out", m.swapped_out, palette.STATE_COLORS["swapped"]),
    ):
        at = [i for i, p in enumerate(marks) if p]
        if at:
            ax.plot(
                at,
                [m.num_slots * 1.02] * len(at),
                linestyle="none",
                marker="v",
                color=color,
                clip_on=False,
                label=kind,
            )
    sec = ax.secondary_yaxis(
        "right", functions=(lambda v: 100 * v / m.num_slots, lambda p: p * m.num_slots / 100)
    )
    sec.set_ylabel("% of the cache")
    fig.subplots_adjust(right=0.93)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.02), ncol=4, frameon=False)
    return ax


def memory(trace: EngineTrace, *, managed: bool = True):
    """Figure: KV slots per step. In a notebook: ``fig = memory(t); plt.show(); plt.close(fig)``."""
    from minipaged.viz import _draw

    m = memory_series(trace)
    with _draw.rc_context():
        fig = _draw.new_figure((12.0, 4.0), managed=managed)
        draw_memory(fig, trace, m)
        tot = sum(m.tokens) + sum(m.reserved)
        frac = 100 * sum(m.tokens) / tot if tot else 100.0
        fig.suptitle(
            f"KV cache over time: {frac:.1f}% of reserved slots hold tokens (block_size {trace.block_size})",
            x=0.08,
            ha="left",
            fontsize=11,
        )
    return fig
