"""One step as the tensors the model reads: the packed ragged batch of a ``ModelInput``.

The model runner (``minipaged.worker.ModelRunner.prepare_inputs``) concatenates every
scheduled token of every request into one flat batch of ``T`` rows, with no padding
between requests: request ``b`` owns rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` (one
for a decode, its chunk for a prefill). Per row: its token (``input_ids``), its position in
its request, and the cache slot its K/V are written to (``slot_mapping``); per request: its
block table row (padded with 0 past its blocks, never read) and ``seq_lens`` (its context
after this step). This module draws that and prints it.

    fig = packed_batch(inp, req_ids, block_size); plt.show(); plt.close(fig)
    print(packed_batch_text(inp, req_ids, block_size))

inputs: a ``ModelInput`` (CPU tensors), the request id of each sequence in batch order
(``list(scheduler_output.num_scheduled_tokens)``), the block size; optionally ``order``,
the request ids in arrival order, which fixes each request's colour (``owner_color``) as
in the other pictures (default: batch order).
outputs: a matplotlib Figure (``managed`` as everywhere in ``viz``) / a string.
invariants: the rows drawn are exactly ``T = cu_seqlens_q[-1]``; each row's slot is
``table[position // block_size] * block_size + position % block_size``, which the text
rendering prints for the first row of every request and ``packed_batch_rows`` checks.
failure mode: ``req_ids`` not one per sequence, or a ``ModelInput`` whose tensors disagree
in length -> ``ValueError`` naming the argument.
vLLM: the same tensors are its attention metadata (``vllm/v1/attention/backends/``); it
draws nothing.
"""

from __future__ import annotations

from minipaged.viz._draw import new_figure, plural
from minipaged.viz.palette import BLACK, FREE_GREY, owner_color, short_name, text_color_on


def packed_batch_rows(inp, req_ids: list[str], block_size: int) -> list[dict]:
    """One dict per row of the flat batch: ``row, req, token, position, slot, block, offset``
    (``block`` = the physical block its slot is in, ``offset`` = its place there)."""
    cu = [int(x) for x in inp.cu_seqlens_q]
    if len(req_ids) != len(cu) - 1:
        raise ValueError(f"req_ids: {len(req_ids)} ids for {len(cu) - 1} sequences")
    n = len(inp.input_ids)
    if not (len(inp.positions) == len(inp.slot_mapping) == n == cu[-1]):
        raise ValueError(
            f"inp: input_ids {n}, positions {len(inp.positions)}, slot_mapping {len(inp.slot_mapping)} "
            f"rows, cu_seqlens_q ends at {cu[-1]}"
        )
    rows = []
    for b, rid in enumerate(req_ids):
        table = [int(x) for x in inp.block_tables[b]]
        for t in range(cu[b], cu[b + 1]):
            pos, slot = int(inp.positions[t]), int(inp.slot_mapping[t])
            if slot != table[pos // block_size] * block_size + pos % block_size:
                raise ValueError(f"inp: row {t} ({rid}, position {pos}) has slot {slot}, not its table's")
            rows.append(
                dict(
                    row=t,
                    req=rid,
                    token=int(inp.input_ids[t]),
                    position=pos,
                    slot=slot,
                    block=slot // block_size,
                    offset=slot % block_size,
                )
            )
    return rows


def _blocks_of(inp, b: int, block_size: int) -> list[int]:
    used = -(-int(inp.seq_lens[b]) // block_size)
    return [int(x) for x in inp.block_tables[b][:used]]


def packed_batch_text(inp, req_ids: list[str], block_size: int) -> str:
    """The flat batch, a column per row, then each sequence's metadata and one slot worked out."""
    rows = packed_batch_rows(inp, req_ids, block_size)
    cu = [int(x) for x in inp.cu_seqlens_q]
    w = max(6, max(len(str(r[k])) for r in rows for k in ("token", "slot")) + 1)
    names = {rid: short_name(rid, k) for k, rid in enumerate(req_ids)}
    lines = [f"packed batch: T = {len(rows)} rows from B = {len(req_ids)} sequences, no padding between them"]
    for label, key in (
        ("row", "row"),
        ("request", "req"),
        ("input_ids", "token"),
        ("positions", "position"),
        ("slot_mapping", "slot"),
    ):
        vals = [names[r[key]] if key == "req" else r[key] for r in rows]
        lines.append(f"{label:13s}" + "".join(f"{v:>{w}}" for v in vals))
    lines.append(f"{'cu_seqlens_q':13s}{cu}")
    lines.append("per sequence: rows, seq_len (context after this step), block table (blocks it uses)")
    for b, rid in enumerate(req_ids):
        q_len, seq_len = cu[b + 1] - cu[b], int(inp.seq_lens[b])
        kind = plural(q_len, "row")
        lines.append(
            f"  {names[rid]:5s} rows {cu[b]}:{cu[b + 1]} ({kind}: positions {seq_len - q_len}..{seq_len - 1}), "
            f"seq_len {seq_len}, block_tables row {_blocks_of(inp, b, block_size)}"
        )
    return "\n".join(lines)


def packed_batch(inp, req_ids: list[str], block_size: int, order=None, managed: bool = True):
    """The flat batch as a strip of ``T`` cells (a request's colour, its token, position and
    slot), the query span of each sequence bracketed, and under it the blocks each reads."""
    rows = packed_batch_rows(inp, req_ids, block_size)
    order = list(order) if order is not None else list(req_ids)
    color = {rid: owner_color(order.index(rid) if rid in order else k) for k, rid in enumerate(req_ids)}
    names = {rid: short_name(rid, order.index(rid) if rid in order else k) for k, rid in enumerate(req_ids)}
    cu = [int(x) for x in inp.cu_seqlens_q]
    T, B = len(rows), len(req_ids)
    tables = [_blocks_of(inp, b, block_size) for b in range(B)]
    width = max(T, max(len(t) for t in tables) * 1.5 + 3)
    fig = new_figure((max(5.0, 0.62 * width + 1.6), 2.6 + 0.42 * B))
    ax = fig.add_axes([0.01, 0.01, 0.98, 0.98])
    top = 0.0  # the strip's three rows sit just below y = 0
    y_tables = -4.3
    ax.set_xlim(-2.4, width + 0.2)
    ax.set_ylim(y_tables - 0.9 * B - 0.3, 1.5)
    ax.axis("off")
    ax.text(
        -2.3,
        1.35,
        f"one step, packed: {T} rows from {B} sequences, no padding",
        ha="left",
        va="top",
        fontsize=9,
    )
    for j, key in enumerate(("token", "position", "slot")):
        y = top - 0.7 * (j + 1)
        ax.text(
            -0.1, y + 0.35, ("input_ids", "positions", "slot_mapping")[j], ha="right", va="center", fontsize=7
        )
        for r in rows:
            x, c = r["row"], color[r["req"]]
            face = c if j == 0 else "#FFFFFF"
            ax.add_patch(_rect(x, y, 1, 0.7, face, c))
            ax.text(
                x + 0.5,
                y + 0.35,
                str(r[key]),
                ha="center",
                va="center",
                fontsize=7,
                color=text_color_on(face),
            )
    for b, rid in enumerate(req_ids):  # brackets over each sequence's rows
        a, e = cu[b], cu[b + 1]
        ax.plot([a + 0.08, a + 0.08, e - 0.08, e - 0.08], [0.1, 0.3, 0.3, 0.1], color=BLACK, lw=0.8)
        ax.text(
            (a + e) / 2, 0.38, f"{names[rid]}: {plural(e - a, 'row')}", ha="center", va="bottom", fontsize=7
        )
    ax.text(-0.1, -2.75, "cu_seqlens_q", ha="right", va="center", fontsize=7)
    for x in cu:
        ax.plot([x, x], [-2.1, -2.6], color="#555555", lw=0.6)
        ax.text(x, -2.75, str(x), ha="center", va="center", fontsize=7, color="#555555")
    ax.text(-2.3, y_tables + 0.75, "block_tables, seq_lens", ha="left", va="center", fontsize=7)
    for b, rid in enumerate(req_ids):  # each sequence's blocks, read by the kernel
        y = y_tables - b * 0.9
        ax.text(
            -0.1,
            y + 0.3,
            f"{names[rid]}  seq_len {int(inp.seq_lens[b])}",
            ha="right",
            va="center",
            fontsize=7,
        )
        written = {r["block"] for r in rows if r["req"] == rid}
        for k, blk in enumerate(tables[b]):
            face = color[rid] if blk in written else FREE_GREY
            ax.add_patch(_rect(k * 1.5, y, 1.3, 0.6, face, color[rid]))
            ax.text(
                k * 1.5 + 0.65,
                y + 0.3,
                str(blk),
                ha="center",
                va="center",
                fontsize=7,
                color=text_color_on(face),
            )
    ax.text(
        max(len(t) for t in tables) * 1.5 + 0.3,
        y_tables + 0.3,
        "coloured: a block this step writes K/V into\ngrey: read only (K/V cached by earlier steps)",
        ha="left",
        va="top",
        fontsize=6.5,
        color="#555555",
    )
    return fig


def _rect(x, y, w, h, face, edge):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, lw=0.8)
