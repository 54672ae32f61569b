"""Block tables: each request's logical blocks mapped onto the grid of physical blocks.

The addressing half of PagedAttention in one picture (the paper's Fig. 6/7): on the left
each request's *logical* blocks 0, 1, 2, ... (filled in proportion to the tokens they
hold), each labelled with the *physical* block it maps to; on the right the physical
pool as a grid, each block coloured by its owner and labelled ``owner:logical``; shared
blocks carry their ref count (``x2``), free blocks are grey, blocks allocated at this
step (and still held) have a thick black edge, blocks freed at this step (a finished or
preempted request's, a dead beam's) are grey with a dashed edge: never the same mark.

Inputs
    ``source``: an ``EngineTrace`` with ``step`` (default: its last step), or a live
    ``minipaged.core.KVCacheManager`` (optionally ``new_block_ids=`` to highlight).
Outputs
    ``block_tables(...)`` -> a matplotlib ``Figure``; ``block_tables_text(...)`` -> the
    same state as a deterministic string (terminals, nbval).
Invariants
    what is drawn is exactly ``minipaged.viz.snapshot.snapshot(source, step)``: one cell
    per table entry, one grid cell per physical block.
Failure mode
    a step outside the trace or an unknown source raises ``ValueError``.

vLLM has no such picture; it draws ``KVCacheManager.block_tables`` and the free queue of
``vllm/v1/core/block_pool.py``.
"""

from __future__ import annotations

import math
from typing import Optional

from minipaged.viz import palette
from minipaged.viz.snapshot import BlockSnapshot, snapshot

FREED_EDGE = "#444444"  # dashed edge of a block freed at this step
NEW_FRAME = dict(edgecolor=palette.BLACK, linewidth=2.2, zorder=2.6)  # a block allocated this step
FREED_FRAME = dict(edgecolor=FREED_EDGE, linewidth=1.4, linestyle=(0, (2.5, 1.5)), zorder=2.6)


def _frame(ax, x: float, y: float, inset: float, style: dict) -> None:
    """An unfilled frame ``inset`` inside the unit cell at (x, y)."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x + inset, y + inset), 1 - 2 * inset, 1 - 2 * inset, fill=False, **style))


# -- text -------------------------------------------------------------------------


def _header(snap: BlockSnapshot) -> str:
    where = (
        "now (live KVCacheManager)" if snap.step is None else f"after step {snap.step} / {snap.num_steps - 1}"
    )
    new = " ".join(str(b) for b in snap.new_block_ids) or "-"
    freed = " | freed: " + " ".join(map(str, snap.freed_block_ids)) if snap.freed_block_ids else ""
    return (
        f"block tables {where} | block_size {snap.block_size} | {snap.num_blocks} blocks: "
        f"{snap.num_used_blocks} used, {len(snap.free_block_ids)} free | new: {new}{freed}"
    )


def _cell_label(snap: BlockSnapshot, b: int, owners, names) -> str:
    if b not in owners:
        return "~" if b in snap.cached_free_ids else "-" if b in snap.freed_block_ids else "."
    rid, j = owners[b][0]
    label = f"{names[rid]}:{j}"
    if snap.ref_cnt.get(b, 1) > 1:
        label += f"(x{snap.ref_cnt[b]})"
    if b in snap.new_block_ids:
        label += "*"
    return label


def _names(snap: BlockSnapshot) -> dict[str, str]:
    return {r: snap.names.get(r) or palette.short_name(r, snap.owner_index(r)) for r in snap.block_tables}


def _row_name(snap: BlockSnapshot, rid: str, names: dict[str, str]) -> str:
    if rid in snap.row_names:
        return snap.row_names[rid]
    if names[rid] == rid:
        return rid
    # NOTE: a long id (a server's uuid) would crowd the panel: its short name alone
    return f"{rid} ({names[rid]})" if len(rid) <= 12 else names[rid]


def block_tables_text(source, step: Optional[int] = None, *, columns: int = 8, **kwargs) -> str:
    """The block tables and the physical pool as text (see the module docstring)."""
    if not isinstance(columns, int) or columns <= 0:
        raise ValueError(f"columns must be a positive int, got {columns!r}")
    snap = snapshot(source, step, **kwargs)
    bs = snap.block_size
    new = set(snap.new_block_ids)
    names = _names(snap)
    lines = [_header(snap)]
    if snap.block_tables:
        w = max(7, *(len(r) for r in snap.block_tables))
        lines.append(f"{'request':<{w}}  tokens/slots  block table (logical j -> physical id)")
        for rid, table in snap.block_tables.items():
            n = snap.num_tokens.get(rid, len(table) * bs)
            cells = []
            for b in table:
                c = str(b)
                if snap.ref_cnt.get(b, 1) > 1:
                    c += f"(x{snap.ref_cnt[b]})"
                if b in new:
                    c += "*"
                cells.append(c)
            name = rid if names[rid] == rid else f"{rid} ({names[rid]})"
            slots = f"{n}/{len(table) * bs}"
            lines.append(f"{name:<{w}}  {slots:>12}  [{', '.join(cells)}]")
    else:
        lines.append("no request holds blocks")
    freed = ", - = freed this step" if snap.freed_block_ids else ""
    lines.append(f"physical blocks (owner:logical block, xN = ref count, * = new, . = free{freed}):")
    owners = snap.owners()
    labels = [_cell_label(snap, b, owners, names) for b in range(snap.num_blocks)]
    lw = max(len(s) for s in labels)
    iw = len(str(snap.num_blocks - 1))
    for start in range(0, snap.num_blocks, columns):
        row = [f"{b:>{iw}} {labels[b]:<{lw}}" for b in range(start, min(start + columns, snap.num_blocks))]
        lines.append("  ".join(row).rstrip())
    if snap.step is None:  # a live manager: the free queue order is known
        q = " ".join(str(b) for b in snap.free_block_ids[:24])
        more = " ..." if len(snap.free_block_ids) > 24 else ""
        lines.append(f"free queue (next to hand out first): {q or '-'}{more}")
        if snap.cached_free_ids:
            lines.append("~ = free but still caching a prefix (evicted when handed out)")
    return "\n".join(lines)


# -- figure -----------------------------------------------------------------------


def _grid_shape(num_blocks: int, aspect: float = 2.0) -> tuple[int, int]:
    """Columns and rows of the physical grid for a panel ``aspect`` times wider than tall.

    Cells come out roughly 1.6 times wider than tall, room for an ``owner:j`` label.
    """
    ncols = max(1, min(num_blocks, round(math.sqrt(num_blocks * aspect / 1.6))))
    if ncols > 6:
        ncols = min(4 * round(ncols / 4), num_blocks)  # multiples of 4 are easier to count
    return ncols, math.ceil(num_blocks / ncols)


def _separators(ax, nx: int, ny: int, cw: float, ch: float) -> None:
    """White lines between cells, as thick as the cells allow."""
    lw = 1.0 if min(cw, ch) >= 8 else 0.5 if min(cw, ch) >= 3 else 0.0
    if lw:
        ax.vlines(range(1, nx), 0, ny, colors="white", linewidth=lw, zorder=2.4)
        ax.hlines(range(1, ny), 0, nx, colors="white", linewidth=lw, zorder=2.4)


def figure_size(snap: BlockSnapshot) -> tuple[float, float]:
    ncols, nrows = _grid_shape(snap.num_blocks)
    rows = max(len(snap.block_tables), min(nrows, 12), 3)
    return 12.0, min(9.0, 1.8 + 0.36 * rows)


def draw_block_tables(
    fig,
    snap: BlockSnapshot,
    arrows: bool = False,
    legend: bool = True,
    title: Optional[str] = None,
    copies=(),
) -> None:
    """Draw ``snap`` into ``fig`` (a Figure or SubFigure): logical left, physical right.

    ``legend=False`` leaves the legend out (a stack of pictures shows it once);
    ``title`` replaces the "Block tables after step i" title; ``copies`` (``(src, dst)``
    block ids, copy-on-write's ``blocks_to_copy``) draws a "copy" arrow between the two
    physical blocks."""
    import numpy as np
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch, Rectangle

    from minipaged.viz import _draw

    names = _names(snap)
    owners = snap.owners()
    new = set(snap.new_block_ids)
    freed = set(snap.freed_block_ids)
    bs = snap.block_size
    rids = list(snap.block_tables)
    max_len = max((len(t) for t in snap.block_tables.values()), default=1)
    lcols = max(max_len, 4)

    # NOTE: a narrow figure (the step picture's right half) puts its legend on two rows
    legend_rows = 2 if _draw.fig_inches(fig)[0] < 11 else 1
    gs = fig.add_gridspec(
        1,
        2,
        width_ratios=[1.0, 1.25],
        wspace=0.12,
        **_draw.margins(
            fig, left=0.9, right=0.15, top=0.75, bottom=0.6 + 0.2 * legend_rows if legend else 0.5
        ),
    )
    ax_l = fig.add_subplot(gs[0, 0])
    ax_p = fig.add_subplot(gs[0, 1])
    pw, ph = _draw.cell_points(ax_p, 1, 1)
    ncols, nrows = _grid_shape(snap.num_blocks, aspect=pw / ph)

    # -- logical: a row per request, a cell per logical block -------------------------
    nrow_l = max(len(rids), 1)
    cw, ch = _draw.cell_points(ax_l, lcols, nrow_l)
    id_chars = len(str(snap.num_blocks - 1))
    shared_chars = max((len(f"(x{c})") for c in snap.ref_cnt.values() if c > 1), default=0)
    fs_l = _draw.fit_fontsize(cw, ch, id_chars + shared_chars)
    # NOTE: cell fills are one image (fast at thousands of blocks); only partly filled
    # last blocks and new blocks get patches of their own.
    img = np.ones((nrow_l, lcols, 4))
    for y, rid in enumerate(rids):
        color = palette.owner_color(snap.owner_index(rid))
        pale = palette.lighten(color, 0.7)
        n = snap.num_tokens.get(rid, len(snap.block_tables[rid]) * bs)
        for j, b in enumerate(snap.block_tables[rid]):
            held = max(0, min(bs, n - j * bs))
            img[y, j] = to_rgba(color if held == bs else pale)
            if 0 < held < bs:  # the slots reserved but not holding a token yet: pale tail
                ax_l.add_patch(Rectangle((j, y), held / bs, 1, facecolor=color, linewidth=0))
            if b in new:
                _frame(ax_l, j, y, 0.03, NEW_FRAME)
            if fs_l >= _draw.MIN_FONT:
                label = str(b) + (f"(x{snap.ref_cnt[b]})" if snap.ref_cnt.get(b, 1) > 1 else "")
                ax_l.text(
                    j + 0.5,
                    y + 0.5,
                    label,
                    ha="center",
                    va="center",
                    fontsize=fs_l,
                    color=palette.text_color_on(color if held * 2 >= bs else pale),
                )
    ax_l.imshow(img, extent=(0, lcols, nrow_l, 0), interpolation="nearest", aspect="auto", zorder=0)
    _separators(ax_l, lcols, nrow_l, cw, ch)
    ax_l.set_xlim(0, lcols)
    ax_l.set_ylim(nrow_l, 0)
    ax_l.set_yticks([y + 0.5 for y in range(len(rids))])
    ax_l.set_yticklabels([_row_name(snap, r, names) for r in rids])
    step_x = 1 if lcols <= 16 else max(1, lcols // 8)
    ax_l.set_xticks([j + 0.5 for j in range(0, lcols, step_x)])
    ax_l.set_xticklabels([str(j) for j in range(0, lcols, step_x)])
    ax_l.tick_params(length=0)
    for s in ax_l.spines.values():
        s.set_visible(False)
    ax_l.set_xlabel("logical block j (label: physical block id)")
    ax_l.set_title("block table per request", loc="left")
    if not rids:
        ax_l.text(lcols / 2, 0.5, "no request holds blocks", ha="center", va="center")

    # -- physical: the pool as a grid ---------------------------------------------------
    cw, ch = _draw.cell_points(ax_p, ncols, nrows)
    lab_chars = max([len(f"{names[r]}:{len(t) - 1}") for r, t in snap.block_tables.items()] + [3])
    fs_owner = _draw.fit_fontsize(cw, ch * 0.62, lab_chars)
    fs_id = min(fs_owner * 0.85, _draw.fit_fontsize(cw, ch * 0.38, id_chars))
    show_labels = fs_owner >= _draw.MIN_FONT
    tokens = snap.tokens_in_block()
    img = np.ones((nrows, ncols, 4))
    for b in range(snap.num_blocks):
        x, y = b % ncols, b // ncols
        if b in owners:
            rid, j = owners[b][0]
            color = palette.owner_color(snap.owner_index(rid))
            held = tokens.get(b, bs)
            img[y, x] = to_rgba(color if held == bs else palette.lighten(color, 0.7))
            if 0 < held < bs:
                ax_p.add_patch(Rectangle((x, y), held / bs, 1, facecolor=color, linewidth=0))
        else:
            img[y, x] = to_rgba(palette.FREE_GREY)
            if b in snap.cached_free_ids:
                ax_p.add_patch(
                    Rectangle((x, y), 1, 1, fill=False, hatch="....", edgecolor="#888888", linewidth=0)
                )
        if b in new:
            _frame(ax_p, x, y, 0.04, NEW_FRAME)
        elif b in freed and b not in owners:  # NOTE: a freed block is never framed as new
            _frame(ax_p, x, y, 0.06, FREED_FRAME)
        if show_labels:
            if b in owners:  # readable on the part of the cell under the label
                under = color if 2 * tokens.get(b, bs) >= bs else palette.lighten(color, 0.7)
                fg = palette.text_color_on(under)
            ax_p.text(
                x + 0.06,
                y + 0.06,
                str(b),
                ha="left",
                va="top",
                fontsize=fs_id,
                color=palette.text_color_on(color) if b in owners else "#777777",
            )
            if b in owners:
                label = f"{names[rid]}:{j}"
                if snap.ref_cnt.get(b, 1) > 1:
                    label = f"x{snap.ref_cnt[b]} {label}" if fs_owner >= 6 else f"x{snap.ref_cnt[b]}"
                ax_p.text(
                    x + 0.5,
                    y + 0.62,
                    label,
                    ha="center",
                    va="center",
                    fontsize=fs_owner,
                    color=fg,
                    fontweight="bold" if snap.ref_cnt.get(b, 1) > 1 else "normal",
                )
        elif snap.ref_cnt.get(b, 1) > 1 and ch >= 5:  # ref counts stay visible on a big grid
            ax_p.text(
                x + 0.5,
                y + 0.5,
                str(snap.ref_cnt[b]),
                ha="center",
                va="center",
                fontsize=max(4.0, min(7.0, ch * 0.6)),
                fontweight="bold",
                color=palette.text_color_on(color),
            )
    ax_p.imshow(img, extent=(0, ncols, nrows, 0), interpolation="nearest", aspect="auto", zorder=0)
    _separators(ax_p, ncols, nrows, cw, ch)
    ax_p.set_xlim(0, ncols)
    ax_p.set_ylim(nrows, 0)
    ax_p.set_aspect("auto")
    ax_p.set_xticks([])
    if show_labels:
        ax_p.set_yticks([])
    else:  # ids are not written in the cells: label each row with its first block id
        ax_p.set_yticks([y + 0.5 for y in range(nrows)])
        ax_p.set_yticklabels([str(y * ncols) for y in range(nrows)])
    ax_p.tick_params(length=0, labelsize=7)
    for s in ax_p.spines.values():
        s.set_visible(False)
    ax_p.set_title(
        f"physical blocks: {snap.num_used_blocks} used, {len(snap.free_block_ids)} free",
        loc="left",
    )

    # -- copy-on-write copies: src -> dst in the pool ----------------------------------
    for src, dst in copies:
        if not (0 <= src < snap.num_blocks and 0 <= dst < snap.num_blocks):
            raise ValueError(f"copies: ({src}, {dst}) is outside the pool of {snap.num_blocks} blocks")
        from matplotlib.patches import FancyArrowPatch

        a, b = (src % ncols + 0.5, src // ncols + 0.5), (dst % ncols + 0.5, dst // ncols + 0.5)
        ax_p.add_patch(
            FancyArrowPatch(
                a,
                b,
                arrowstyle="-|>",
                mutation_scale=14,
                color=palette.BLACK,
                linewidth=2.0,
                connectionstyle="arc3,rad=0.35",
                zorder=4,
            )
        )
        ax_p.text(
            (a[0] + b[0]) / 2,
            min(a[1], b[1]) - 0.2,
            f"copy {src} -> {dst}",
            ha="center",
            va="center",
            fontsize=9,
            fontweight="bold",
            zorder=4,
            bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85),
        )

    # -- logical -> physical arrows, only while they stay readable ---------------------
    if arrows:
        from matplotlib.patches import ConnectionPatch

        # NOTE: added to the physical axes (drawn second) so that its cell labels stay
        # on top; each arrow leaves its logical cell below the label and lands between a
        # physical cell's id and its owner label.
        for y, rid in enumerate(rids):
            for j, b in enumerate(snap.block_tables[rid]):
                con = ConnectionPatch(
                    xyA=(j + 0.5, y + 0.82),
                    coordsA=ax_l.transData,
                    xyB=(b % ncols + 0.5, b // ncols + 0.3),
                    coordsB=ax_p.transData,
                    color="#333333",
                    alpha=0.55,
                    linewidth=0.9,
                    arrowstyle="-|>",
                    mutation_scale=9,
                    shrinkA=0,
                    shrinkB=0,
                    zorder=2.5,
                )
                con.set_annotation_clip(False)
                ax_p.add_artist(con)
        for t in ax_p.texts + ax_l.texts:
            t.set_zorder(3)

    handles = [
        Patch(facecolor=palette.owner_color(0), label="slots holding tokens (colour = request)"),
        Patch(facecolor=palette.lighten(palette.owner_color(0), 0.7), label="reserved, no token yet"),
        Patch(facecolor=palette.FREE_GREY, label="free block"),
        Patch(facecolor="white", edgecolor=palette.BLACK, linewidth=2.0, label="allocated this step"),
        Patch(facecolor="white", edgecolor="white", label="xN: shared by N tables"),
    ]
    if snap.step is not None or snap.freed_block_ids:  # a live manager has no "step"
        freed_patch = Patch(
            facecolor=palette.FREE_GREY,
            edgecolor=FREED_EDGE,
            linewidth=1.2,
            linestyle=(0, (2.5, 1.5)),
            label="freed this step",
        )
        handles.insert(4, freed_patch)
    if snap.cached_free_ids:
        handles.insert(3, Patch(facecolor=palette.FREE_GREY, hatch="....", label="free, prefix still cached"))
    if legend:
        fig.legend(
            handles=handles,
            loc="lower left",
            ncol=math.ceil(len(handles) / legend_rows),
            frameon=False,
            bbox_to_anchor=(0.01, 0.0),
            handlelength=1.4,
            columnspacing=1.2,
        )
    where = "now" if snap.step is None else f"after step {snap.step}"
    fig.suptitle(
        title or f"Block tables {where} ({snap.num_blocks} blocks of {bs} slots)",
        x=0.01,
        ha="left",
        fontsize=11,
        y=0.99,
        va="top",
    )


MAPPING_MAX_BLOCKS = 16  # arrows=True: up to this many physical (and logical) blocks, one row each


def _mapping_fits(snap: BlockSnapshot) -> bool:
    n_logical = sum(len(t) for t in snap.block_tables.values())
    return (
        snap.num_blocks <= MAPPING_MAX_BLOCKS
        and 0 < n_logical + len(snap.block_tables) - 1 <= MAPPING_MAX_BLOCKS
    )


def draw_block_mapping(fig, snap: BlockSnapshot) -> None:
    """The block-table indirection for a small pool: every request's logical blocks in one
    row on top (grouped by request), the physical blocks ``0 .. num_blocks - 1`` in one row
    beneath, an arrow in the request's colour from each table entry to its block.

    NOTE: two rows keep every arrow between them (none crosses a cell), and coloured arrows
    stay attributable where they cross; shared blocks receive several arrows."""
    from matplotlib import patheffects
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    from minipaged.viz import _draw

    names = _names(snap)
    owners = snap.owners()
    new, freed = set(snap.new_block_ids), set(snap.freed_block_ids)
    bs = snap.block_size
    tokens = snap.tokens_in_block()
    rids = list(snap.block_tables)
    width = max(snap.num_blocks, sum(len(t) for t in snap.block_tables.values()) + len(rids) - 1)
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.13, right=0.99, top=0.86, bottom=0.2)
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-0.15, 3.35)
    ax.axis("off")
    cw, ch = _draw.cell_points(ax, width + 0.2, 3.5 / 0.8)
    fs = _draw.fit_fontsize(cw, ch, 6, cap=10.0)

    def cell(x, y, color, held, edge=None, **kw):
        pale = palette.lighten(color, 0.7)
        ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=color if held == bs else pale, linewidth=0))
        if 0 < held < bs:
            ax.add_patch(Rectangle((x, y), held / bs, 0.8, facecolor=color, linewidth=0))
        ax.add_patch(Rectangle((x, y), 1, 0.8, fill=False, edgecolor="white", linewidth=1.5))
        if edge is not None:
            ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.72, fill=False, edgecolor=edge, **kw))
        if 0 < held < bs:  # NOTE: the label straddles both shades: black with a white halo
            return palette.BLACK
        return palette.text_color_on(color if held == bs else pale)

    def halo(t, held):
        if 0 < held < bs:
            t.set_path_effects([patheffects.withStroke(linewidth=2.5, foreground="white")])

    # physical row
    for b in range(snap.num_blocks):
        if b in owners:
            rid, j = owners[b][0]
            color = palette.owner_color(snap.owner_index(rid))
            fg = cell(b, 0, color, tokens.get(b, bs), palette.BLACK if b in new else None, linewidth=2.2)
            label = f"{names[rid]}:{j}"
            if snap.ref_cnt.get(b, 1) > 1:
                label = f"x{snap.ref_cnt[b]} {label}"
            held = tokens.get(b, bs)
            halo(ax.text(b + 0.5, 0.27, label, ha="center", va="center", fontsize=fs * 0.8, color=fg), held)
            t = ax.text(
                b + 0.5, 0.6, str(b), ha="center", va="center", fontsize=fs, color=fg, fontweight="bold"
            )
            halo(t, held)
        else:
            dashed = dict(linewidth=1.4, linestyle=(0, (2.5, 1.5))) if b in freed else {}
            cell(b, 0, palette.FREE_GREY, bs, FREED_EDGE if b in freed else None, **dashed)
            if b in snap.cached_free_ids:
                ax.add_patch(
                    Rectangle((b, 0), 1, 0.8, fill=False, hatch="....", edgecolor="#888888", linewidth=0)
                )
            ax.text(b + 0.5, 0.45, str(b), ha="center", va="center", fontsize=fs, color="#666666")
    # logical row, one group per request, and the arrows
    x = (width - (sum(len(t) for t in snap.block_tables.values()) + len(rids) - 1)) / 2
    for rid in rids:
        color = palette.owner_color(snap.owner_index(rid))
        n = snap.num_tokens.get(rid, len(snap.block_tables[rid]) * bs)
        table = snap.block_tables[rid]
        ax.text(
            x,
            3.05,
            f"{_row_name(snap, rid, names)}: {_draw.plural(n, 'token')}",
            ha="left",
            va="center",
            fontsize=fs * 0.9,
        )
        for j, b in enumerate(table):
            held = max(0, min(bs, n - j * bs))
            fg = cell(x + j, 2.1, color, held)
            halo(
                ax.text(x + j + 0.5, 2.5, f"j={j}", ha="center", va="center", fontsize=fs * 0.9, color=fg),
                held,
            )
            ax.add_patch(
                FancyArrowPatch(
                    (x + j + 0.5, 2.08),
                    (b + 0.5, 0.82),
                    arrowstyle="-|>",
                    mutation_scale=12,
                    color=palette.darken(color, 0.3),
                    linewidth=1.6,
                    shrinkA=0,
                    shrinkB=0,
                )
            )
        x += len(table) + 1
    ax.text(-0.15, 2.5, "block table\n(logical block j)", ha="right", va="center", fontsize=fs * 0.85)
    ax.text(-0.15, 0.4, "physical blocks\n(the KV cache)", ha="right", va="center", fontsize=fs * 0.85)
    handles = [
        Patch(facecolor=palette.owner_color(0), label="slots holding tokens (colour = request)"),
        Patch(facecolor=palette.lighten(palette.owner_color(0), 0.7), label="reserved, no token yet"),
        Patch(facecolor=palette.FREE_GREY, label="free block"),
    ]
    if new:
        handles.append(
            Patch(facecolor="white", edgecolor=palette.BLACK, linewidth=2.0, label="allocated this step")
        )
    if freed:
        handles.append(
            Patch(
                facecolor=palette.FREE_GREY,
                edgecolor=FREED_EDGE,
                linestyle=(0, (2.5, 1.5)),
                label="freed this step",
            )
        )
    fig.legend(
        handles=handles, loc="lower left", ncol=len(handles), frameon=False, bbox_to_anchor=(0.01, 0.0)
    )
    where = "now" if snap.step is None else f"after step {snap.step}"
    fig.suptitle(
        f"Block tables {where}: logical block j -> physical block ({snap.num_blocks} blocks of {bs} slots, "
        f"{snap.num_used_blocks} used)",
        x=0.01,
        ha="left",
        fontsize=11,
        y=0.98,
        va="top",
    )


def block_tables(
    source, step: Optional[int] = None, *, arrows: bool = False, copies=(), managed: bool = True, **kwargs
):
    """Figure: block tables at ``step`` of a trace, or of a live ``KVCacheManager``.

    ``arrows=True`` draws an arrow from each logical block to its physical block: for a
    pool of at most ``MAPPING_MAX_BLOCKS`` blocks as two rows (logical above, physical
    below, ``draw_block_mapping``), else over the usual two panels (the cell labels carry
    the same mapping). ``copies`` (``(src, dst)`` pairs, as ``blocks_to_copy``) draws each
    copy-on-write copy as an arrow in the pool. ``managed=False`` returns a Figure pyplot does not
    track (for files and widgets). In a notebook: ``fig = block_tables(...); plt.show();
    plt.close(fig)``.
    """
    from minipaged.viz import _draw

    snap = snapshot(source, step, **kwargs)
    with _draw.rc_context():
        if arrows and _mapping_fits(snap) and not copies:
            fig = _draw.new_figure((9.0, 3.6), managed=managed)
            draw_block_mapping(fig, snap)
        else:
            fig = _draw.new_figure(figure_size(snap), managed=managed)
            draw_block_tables(fig, snap, arrows=arrows, copies=copies)
    return fig
