"""What a picture shows, as plain data: the KV block state at one step, request order.

Every picture in ``minipaged.viz`` is drawn in two steps: first the state is read into
plain data here (testable, no matplotlib), then it is drawn (``blocks``, ``activity``,
``occupancy``) or written as text. The figure and its text rendering read the same data,
so they cannot disagree.

Inputs
    an ``EngineTrace`` and a step index (the state recorded *after* that step), or a live
    ``minipaged.core.KVCacheManager`` (its state now).
Outputs
    ``BlockSnapshot``: the block tables, tokens per request, ref counts, the free blocks
    (in free-queue order when read from a manager), the blocks allocated this step and
    still held, and the blocks freed this step (held after the step before, or allocated
    during this one, and free after it: a finished or preempted request's, a dead beam's).
    ``request_order(trace)``: every request id in arrival order (fixes colours and rows).
Invariants (``BlockSnapshot.check_invariants``)
    every block id is in ``range(num_blocks)``; a held block is not free; a block's
    ``ref_cnt`` equals the number of block tables holding it; a table has
    ``ceil(num_tokens / block_size)`` blocks.
Failure mode
    a step outside the trace, or a source that is neither a trace nor a manager, raises
    ``ValueError``.

Mirrors no vLLM file (vLLM has no pictures); the state read from a manager is
``KVCacheManager.block_tables`` and ``BlockPool.free_block_queue`` as in
``vllm/v1/core/kv_cache_manager.py`` and ``block_pool.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from minipaged.trace import EngineTrace


def request_order(trace: EngineTrace) -> list[str]:
    """All request ids of ``trace`` in arrival order (first seen first).

    ``trace.requests`` is in the order requests were added; ids that only appear in the
    steps are appended in the order they first show up.
    """
    arrival = {}
    for rid, info in trace.requests.items():
        arrival[rid] = info.get("arrival_step")
    seen = dict.fromkeys(trace.requests)
    for s in trace.steps:
        for rid in _ids_in_step(s):
            if rid not in seen:
                seen[rid] = None
                arrival.setdefault(rid, s.step)
    order = list(seen)
    # stable sort by arrival step where known (unknown arrivals keep their place at the end)
    big = len(trace.steps) + 1
    return sorted(order, key=lambda r: big if arrival.get(r) is None else arrival[r])


def _ids_in_step(s) -> Iterable[str]:
    yield from s.arrived_ids
    yield from s.scheduled
    yield from s.waiting_ids
    yield from s.block_tables
    yield from s.preempted_ids
    yield from s.swapped_out_ids
    yield from s.swapped_ids
    yield from s.finished_ids


def block_tokens(tables: dict[str, list[int]], num_tokens: dict[str, int], bs: int):
    """block id -> tokens it holds, over all ``tables`` (a shared block counts its fullest
    holder, as ``KVCacheManager.usage`` does); a table without a token count is full."""
    out: dict[int, int] = {}
    for rid, table in tables.items():
        n = num_tokens.get(rid, len(table) * bs)
        for j, b in enumerate(table):
            out[b] = max(out.get(b, 0), max(0, min(bs, n - j * bs)))
    return out


@dataclass
class BlockSnapshot:
    """The KV blocks at one moment: who holds which block, and what is free."""

    num_blocks: int
    block_size: int
    # request id -> physical block ids (logical block j is block_tables[rid][j])
    block_tables: dict[str, list[int]]
    num_tokens: dict[str, int]  # request id -> tokens held in its blocks
    ref_cnt: dict[int, int]  # held block id -> ref count (>= 1)
    free_block_ids: list[int]  # free blocks; in free-queue order when known
    new_block_ids: list[int] = field(default_factory=list)  # allocated this step
    freed_block_ids: list[int] = field(default_factory=list)  # free now, held during this step
    cached_free_ids: frozenset = frozenset()  # free, but still holding a cached prefix
    order: list[str] = field(default_factory=list)  # all requests, arrival order (colours)
    step: Optional[int] = None
    num_steps: Optional[int] = None
    # optional overrides (beam pictures, minipaged.viz.beams): request id -> cell name,
    # row label, colour index; requests not listed keep the defaults
    names: dict[str, str] = field(default_factory=dict)
    row_names: dict[str, str] = field(default_factory=dict)
    colors: dict[str, int] = field(default_factory=dict)

    # -- derived ------------------------------------------------------------------
    def owner_index(self, rid: str) -> int:
        """Position of ``rid`` in arrival order: its colour and label."""
        if rid in self.colors:
            return self.colors[rid]
        try:
            return self.order.index(rid)
        except ValueError:
            return len(self.order) + sorted(self.block_tables).index(rid)

    def owners(self) -> dict[int, list[tuple[str, int]]]:
        """block id -> [(request id, logical block index), ...] in request order."""
        out: dict[int, list[tuple[str, int]]] = {}
        for rid, table in self.block_tables.items():
            for j, b in enumerate(table):
                out.setdefault(b, []).append((rid, j))
        return out

    def tokens_in_block(self) -> dict[int, int]:
        """block id -> tokens it holds (a shared block counts its fullest holder)."""
        return block_tokens(self.block_tables, self.num_tokens, self.block_size)

    @property
    def num_used_blocks(self) -> int:
        return len(self.ref_cnt)

    def check_invariants(self) -> None:
        holders: dict[int, int] = {}
        for rid, table in self.block_tables.items():
            for b in table:
                assert 0 <= b < self.num_blocks, f"{rid} holds block {b} outside the pool"
                holders[b] = holders.get(b, 0) + 1
            n = self.num_tokens.get(rid)
            if n is not None:
                need = -(-n // self.block_size)
                assert len(table) == need, (
                    f"{rid}: {len(table)} blocks for {n} tokens (block_size {self.block_size})"
                )
        for b, c in holders.items():
            assert self.ref_cnt.get(b) == c, f"block {b}: ref_cnt {self.ref_cnt.get(b)} != {c}"
        assert not set(self.free_block_ids) & set(holders), "a held block is listed as free"
        assert not set(self.freed_block_ids) & set(holders), "a held block is listed as freed"
        assert len(holders) + len(self.free_block_ids) <= self.num_blocks, "blocks overcounted"


def _check_step(trace: EngineTrace, step: Optional[int]) -> int:
    n = len(trace.steps)
    if n == 0:
        raise ValueError("trace has no steps to draw")
    if step is None:
        return n - 1
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"step must be an int, got {step!r}")
    if not -n <= step < n:
        raise ValueError(f"step {step} is outside the trace (0 .. {n - 1})")
    return step % n


def snapshot_from_trace(trace: EngineTrace, step: Optional[int] = None) -> BlockSnapshot:
    """The block state recorded after ``step`` (default: the last step)."""
    i = _check_step(trace, step)
    rec = trace.steps[i]
    order = request_order(trace)
    pos = {r: k for k, r in enumerate(order)}
    tables = {r: list(rec.block_tables[r]) for r in sorted(rec.block_tables, key=pos.get)}
    holders: dict[int, int] = {}
    for table in tables.values():
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    held = set(holders)
    free = [b for b in range(trace.num_blocks) if b not in held]
    before = {b for t in trace.steps[i - 1].block_tables.values() for b in t} if i > 0 else set()
    freed = sorted((before | set(rec.new_block_ids)) - held)
    return BlockSnapshot(
        num_blocks=trace.num_blocks,
        block_size=trace.block_size,
        block_tables=tables,
        num_tokens={r: rec.num_tokens[r] for r in tables if r in rec.num_tokens},
        ref_cnt=holders,
        free_block_ids=free,
        new_block_ids=[b for b in rec.new_block_ids if b in held],
        freed_block_ids=freed,
        order=order,
        step=i,
        num_steps=len(trace.steps),
    )


def snapshot_from_manager(
    manager,
    new_block_ids: Iterable[int] = (),
    order: Optional[list[str]] = None,
    freed_block_ids: Iterable[int] = (),
) -> BlockSnapshot:
    """The live state of a ``KVCacheManager``; ``new_block_ids`` (held) and
    ``freed_block_ids`` (free) are marked."""
    pool = manager.block_pool
    tables = {r: t.block_ids() for r, t in manager.block_tables.items()}
    if order is None:
        order = list(tables)
    else:
        order = list(order) + [r for r in tables if r not in order]
    pos = {r: k for k, r in enumerate(order)}
    tables = {r: tables[r] for r in sorted(tables, key=pos.get)}
    ref_cnt = {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt > 0}
    free_blocks = pool.free_block_queue.get_all_free_blocks()
    return BlockSnapshot(
        num_blocks=manager.num_blocks,
        block_size=manager.block_size,
        block_tables=tables,
        num_tokens={r: manager.block_tables[r].num_tokens for r in tables},
        ref_cnt=ref_cnt,
        free_block_ids=[b.block_id for b in free_blocks],
        new_block_ids=list(new_block_ids),
        freed_block_ids=sorted(freed_block_ids),
        cached_free_ids=frozenset(b.block_id for b in free_blocks if b.block_hash is not None),
        order=order,
    )


def snapshot(source, step: Optional[int] = None, **kwargs) -> BlockSnapshot:
    """A ``BlockSnapshot`` from an ``EngineTrace`` (+ step) or a ``KVCacheManager``."""
    if isinstance(source, BlockSnapshot):
        return source
    if isinstance(source, EngineTrace):
        if kwargs:
            raise ValueError(f"unexpected arguments for a trace: {sorted(kwargs)}")
        return snapshot_from_trace(source, step)
    if hasattr(source, "block_tables") and hasattr(source, "block_pool"):
        if step is not None:
            raise ValueError("step applies to an EngineTrace; a KVCacheManager is drawn as is")
        return snapshot_from_manager(source, **kwargs)
    raise ValueError(f"source must be an EngineTrace or a KVCacheManager, got {type(source).__name__}")
