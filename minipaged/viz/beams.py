"""Beam search, step by step: every beam keeps its name and colour, a fork is drawn as a child.

Beam search replaces its beams at every step: the engine frees the old ``Request`` objects
and forks new ones (``0.4``, ``0.5``, ... in ``LLM.beam_search``), so request ids say
nothing about who descends from whom. This module gives the beams stable names: a beam
that continues keeps its name (``b1``) and colour from step to step; a second child of a
parent gets a new name and is drawn as that parent's child (``b5 (from b1)``, in the row below it); a beam with no
surviving child is *pruned* and its name ends.

Inputs
    an ``EngineTrace`` recorded by ``LLM.beam_search`` (``llm.trace``), or any trace whose
    sequences fork (``fork_request``): parents are the previous step's requests.
Outputs
    ``beam_lineage(trace)`` -> one ``BeamStep`` per step (the beams' names, parents, the
    pruned names); ``beam_tables_text(trace, steps)`` -> the block tables under those names;
    ``beam_tables(trace, steps)`` -> a Figure, one row of block tables per step, in the
    colours of ``minipaged.viz.blocks`` (block fill = beam).
Invariants
    a trace records only block tables, so the parent of each beam is read from them: the
    allocation of step i is replayed on the parents' tables (step i-1) in the order the
    step scheduled them, as ``KVCacheManager.allocate_slots`` does it (a full last block
    grows by a new block; a shared, partly filled last block is copied to a new block,
    ``blocks_to_copy``, except for its last writer), using the step's ``new_block_ids`` in
    order; each child holds exactly its parent's table after that allocation
    (``fork_request``). Parents with identical tables are then told apart as the manager
    does: the earlier ones got the copies. A child no replay explains gets the parent
    with the longest common table prefix.
Failure mode
    an empty trace or a step outside it raises ``ValueError``.

vLLM has no picture; the beams are those of ``vllm/beam_search.py`` (vLLM v1 runs them
as child requests) and the paper's Fig. 9 (vLLM v0: forked sequence groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from minipaged.trace import EngineTrace
from minipaged.viz.snapshot import BlockSnapshot, _check_step, snapshot_from_trace


@dataclass
class BeamStep:
    """The beams after one step, under their stable names."""

    step: int
    name: dict[str, str]  # request id -> beam name ("b1"), for every request in the tables
    parent: dict[str, Optional[str]]  # request id -> its parent's beam name (None: a root)
    forked: dict[str, str] = field(default_factory=dict)  # request id -> parent name, new names only
    pruned: list[str] = field(default_factory=list)  # names with no surviving child this step
    color: dict[str, int] = field(default_factory=dict)  # request id -> colour index

    def label(self, rid: str) -> str:
        """``b5 (from b1)`` for a beam forked from ``b1`` at this step, else its name."""
        return f"{self.name[rid]} (from {self.forked[rid]})" if rid in self.forked else self.name[rid]


def _replay(prev: dict[str, list[int]], prev_tokens: dict[str, int], rec, bs: int) -> dict[str, tuple]:
    """Each parent's table after step ``rec``'s allocation, replayed in scheduling order."""
    tables = {r: list(t) for r, t in prev.items()}
    refs: dict[int, int] = {}
    for t in tables.values():
        for b in t:
            refs[b] = refs.get(b, 0) + 1
    fresh = list(rec.new_block_ids)
    order = [r for r in rec.scheduled if r in tables] + [r for r in tables if r not in rec.scheduled]
    for rid in order:
        t, n, k = tables[rid], prev_tokens.get(rid, len(tables[rid]) * bs), rec.scheduled.get(rid, 0)
        if k <= 0:
            continue
        if t and n % bs and refs.get(t[-1], 0) > 1 and fresh:  # copy-on-write
            refs[t[-1]] -= 1
            t[-1] = fresh.pop(0)
            refs[t[-1]] = 1
        for _ in range(max(0, -(-(n + k) // bs) - len(t))):  # grow
            if not fresh:
                break
            t.append(fresh.pop(0))
            refs[t[-1]] = 1
    return {r: tuple(t) for r, t in tables.items()}


def _parent_of(table: list[int], post: dict[str, tuple], taken: set) -> Optional[str]:
    exact = [r for r, t in post.items() if t == tuple(table)]
    if exact:
        return exact[0]

    def common(t) -> int:
        n = 0
        for a, b in zip(t, table):
            if a != b:
                break
            n += 1
        return n

    best = max(post, key=lambda r: (common(post[r]), r not in taken), default=None)
    return best if best is not None and common(post[best]) > 0 else None


def beam_lineage(trace: EngineTrace) -> list[BeamStep]:
    """Stable beam names for every step of ``trace`` (see the module docstring)."""
    if not trace.steps:
        raise ValueError("trace has no steps to draw")
    bs = trace.block_size
    prompts = [r for r in trace.requests if "." not in r]
    multi = len({r.split(".")[0] for r in (prompts or ["0"])}) > 1
    counters: dict[str, int] = {}
    colors: dict[str, int] = {}  # beam name -> colour index, fixed once given
    out: list[BeamStep] = []
    prev_tables: dict[str, list[int]] = {}
    prev_tokens: dict[str, int] = {}
    prev: Optional[BeamStep] = None

    def new_name(rid: str) -> str:
        root = rid.split(".")[0] if multi else ""
        k = counters.get(root, 0)
        counters[root] = k + 1
        name = f"{root}.b{k}" if multi else f"b{k}"
        colors[name] = len(colors)
        return name

    def is_prompt(rid: str) -> bool:
        return rid in trace.requests and "." not in rid and trace.meta.get("beam_search", False)

    for rec in trace.steps:
        post = _replay(prev_tables, prev_tokens, rec, bs)
        name: dict[str, str] = {}
        parent: dict[str, Optional[str]] = {}
        forked: dict[str, str] = {}
        continued: set = set()
        taken: set = set()
        for rid, table in rec.block_tables.items():
            if prev is not None and rid in prev.name:  # the same request as before
                name[rid] = prev.name[rid]
                parent[rid] = prev.parent.get(rid)
                continued.add(rid)
                taken.add(rid)
                continue
            if is_prompt(rid):  # still prefilling: not a beam yet
                name[rid], parent[rid] = (f"prompt {rid}" if multi else "prompt"), None
                colors.setdefault(name[rid], len(colors))
                continue
            p = _parent_of(table, post, taken) if post else None
            if p is not None and is_prompt(p):  # the beams forked from the prompt: roots
                taken.add(p)
                p = None
            if p is None or prev is None:
                name[rid], parent[rid] = new_name(rid), None
            elif p not in taken:  # the first child continues its parent
                taken.add(p)
                name[rid], parent[rid] = prev.name[p], prev.name[p]
            else:
                name[rid] = new_name(rid)
                parent[rid] = forked[rid] = prev.name[p]
        pruned = [] if prev is None else [prev.name[r] for r in prev.name if r not in taken]
        step = BeamStep(
            rec.step, name, parent, forked, pruned, {r: colors.get(n, 0) for r, n in name.items()}
        )
        out.append(step)
        prev, prev_tables = step, rec.block_tables
        prev_tokens = dict(rec.num_tokens)
    return out


def _snapshot(trace: EngineTrace, i: int, beams: BeamStep) -> BlockSnapshot:
    """The block state after step ``i``, rows in beam order, a forked beam right below its
    parent, under the beams' names and colours."""
    snap = snapshot_from_trace(trace, i)
    index = {n: beams.color[r] for r, n in beams.name.items()}

    def key(rid: str):
        head = beams.forked.get(rid, beams.name[rid])
        return (index.get(head, beams.color[rid]), rid in beams.forked, beams.color[rid])

    snap.block_tables = {r: snap.block_tables[r] for r in sorted(snap.block_tables, key=key)}
    snap.names = dict(beams.name)
    snap.row_names = {r: beams.label(r) for r in snap.block_tables}
    snap.colors = dict(beams.color)
    return snap


def _steps(trace: EngineTrace, steps) -> list[int]:
    if isinstance(steps, int) or not isinstance(steps, Sequence) or not steps:
        raise ValueError(f"steps must be a non-empty list of step indices, got {steps!r}")
    return [_check_step(trace, s) for s in steps]


def _caption(trace: EngineTrace, beams: BeamStep, snap: BlockSnapshot) -> str:
    forks = ", ".join(f"{beams.name[r]} forked from {p}" for r, p in beams.forked.items())
    parts = [forks] if forks else []
    if beams.pruned:
        parts.append("pruned: " + ", ".join(beams.pruned))
    return f"after step {beams.step}" + (f" ({'; '.join(parts)})" if parts else "")


def beam_tables_text(trace: EngineTrace, steps: Sequence[int]) -> str:
    """The beams' block tables at ``steps``, under their stable names (``*`` = allocated
    this step), with the forks and the pruned beams of each step."""
    lineage = beam_lineage(trace)
    lines = []
    for i in _steps(trace, steps):
        beams = lineage[i]
        snap = _snapshot(trace, i, beams)
        new = set(snap.new_block_ids)
        held = snap.num_used_blocks
        lines.append(
            f"{_caption(trace, beams, snap)}: {len(snap.block_tables)} beams, {held} blocks held"
            + (f", freed {' '.join(map(str, snap.freed_block_ids))}" if snap.freed_block_ids else "")
        )
        w = max([len(beams.label(r)) for r in snap.block_tables] + [4])
        for rid, table in snap.block_tables.items():
            cells = []
            for b in table:
                shared = f"(x{snap.ref_cnt[b]})" if snap.ref_cnt[b] > 1 else ""
                cells.append(f"{b}{shared}{'*' if b in new else ''}")
            lines.append(f"  {beams.label(rid):<{w}}  [{', '.join(cells)}]  ({rid})")
        lines.append("")
    return "\n".join(lines).rstrip()


def figure_size(trace: EngineTrace, steps) -> tuple[float, float]:
    from minipaged.viz import blocks

    heights = [blocks.figure_size(snapshot_from_trace(trace, i))[1] for i in steps]
    return 12.0, min(14.0, sum(min(h, 3.4) for h in heights) + 0.3)


def beam_tables(trace: EngineTrace, steps: Sequence[int], *, managed: bool = True):
    """Figure: the block tables at each of ``steps``, a row per step, every beam in its
    own stable colour and name (a fork labelled ``b5 (from b1)``, below its parent).

    In a notebook: ``fig = beam_tables(llm.trace, [1, 8, 14]); plt.show(); plt.close(fig)``.
    """
    from minipaged.viz import _draw
    from minipaged.viz.blocks import draw_block_tables

    idx = _steps(trace, steps)
    lineage = beam_lineage(trace)
    with _draw.rc_context():
        fig = _draw.new_figure(figure_size(trace, idx), managed=managed)
        subs = fig.subfigures(len(idx), 1, hspace=0.0)
        subs = [subs] if len(idx) == 1 else list(subs)
        for k, (sub, i) in enumerate(zip(subs, idx)):
            snap = _snapshot(trace, i, lineage[i])
            draw_block_tables(sub, snap, legend=k == len(idx) - 1, title=_caption(trace, lineage[i], snap))
    return fig
