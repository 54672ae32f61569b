"""BlockSpaceManager: the paper's block manager (vLLM v0's ``BlockSpaceManagerV1``), over
the same ``BlockPool`` and block tables as vLLM v1's ``KVCacheManager``, which it extends
with what v1 removed. vLLM v1 instead: no fork (``n > 1`` shares the prompt through the
prefix cache), no copy-on-write, no swap (recompute only).

Sharing (the paper's section 4.4)
    ``fork(parent, child)``: the child's table holds the *same* blocks (every ``ref_cnt``
    + 1); nothing is copied. Copy-on-write: when ``allocate_slots`` would write into a
    shared, partly filled last block, it takes a fresh block, records ``(src, dst)`` for
    the worker to copy before the forward (``take_pending_copies`` ->
    ``PaperSchedulerOutput.blocks_to_copy``) and drops one reference from the shared block.
    Full shared blocks are never copied: a new token starts a new block.
Swapping (the paper's section 4.5)
    With ``num_cpu_blocks > 0`` a second ``BlockPool`` stands for the CPU swap space.
    ``swap_out_group(requests)`` moves whole tables there (all or nothing; blocks shared
    inside the group stay shared) and returns the ``(device, cpu)`` pairs to copy;
    ``swap_in_group`` moves them back, ``(cpu, device)``. A swapped request holds CPU
    blocks only; ``free_swapped`` drops them (abort). The worker copies the data.
Counting (admission of the paper's scheduler)
    ``get_num_blocks_needed_group`` (exact, with copy-on-write copies),
    ``get_num_blocks_to_prefill`` / ``get_num_blocks_still_needed`` (the watermark rule),
    ``can_swap_in_group``.
Free order
    every freed block goes to the back of its pool's free queue (``free_uncached_first=
    False``, the default here); vLLM v1 instead reuses blocks without a hash first.
Invariants (``check_invariants``)
    those of ``KVCacheManager`` in both pools; no request holds device and CPU blocks at
    once; pending copies have distinct destinations, each held by a table.
Failure mode
    as ``KVCacheManager``; a swap the other pool cannot hold returns None, changing nothing.
"""

from __future__ import annotations

from minipaged.core.kv.block import KVCacheBlock, cdiv
from minipaged.core.kv.block_pool import BlockPool
from minipaged.core.kv.block_table import BlockTable
from minipaged.core.kv.kv_cache_manager import KVCacheManager, _request_id, check_tables


class BlockSpaceManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        num_cpu_blocks: int = 0,
        free_uncached_first: bool = False,
    ) -> None:
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        super().__init__(num_blocks, block_size, enable_caching, free_uncached_first)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_block_pool = (
            BlockPool(num_cpu_blocks, free_uncached_first=free_uncached_first) if num_cpu_blocks > 0 else None
        )
        # request_id -> its block table while swapped out (its blocks are CPU blocks)
        self.cpu_block_tables: dict[str, BlockTable] = {}
        # Copy-on-write: (src block id, dst block id) pairs not yet handed to the worker.
        self.pending_copies: list[tuple[int, int]] = []

    # -- counting -----------------------------------------------------------------
    def _needs_copy_on_write(self, rid: str) -> bool:
        """Whether the next token of ``rid`` lands in a shared, partly filled block."""
        t = self.block_tables.get(rid)
        return (
            t is not None
            and bool(t.blocks)
            and t.num_tokens % self.block_size != 0
            and t.blocks[-1].ref_cnt > 1
        )

    def get_num_blocks_needed(self, request, num_new_tokens: int) -> int:
        """How many *new* blocks ``allocate_slots(request, num_new_tokens)`` would take
        (a copy-on-write copy counts as one)."""
        rid = _request_id(request)
        t = self.block_tables.get(rid)
        total = (0 if t is None else t.num_tokens) + num_new_tokens
        grow = max(0, cdiv(total, self.block_size) - (0 if t is None else len(t.blocks)))
        return grow + int(self._needs_copy_on_write(rid))

    def get_num_blocks_needed_group(self, requests, num_new_tokens) -> int:
        """New blocks for ``allocate_slots(r, n)`` on each ``(r, n)`` in order.

        Exact with shared blocks: once all but one holder of a shared partly filled block
        have copied it, the last one writes in place.
        """
        tables, lens = [], []
        for r in requests:
            t = self.block_tables.get(_request_id(r))
            tables.append([] if t is None else t.blocks)
            lens.append(0 if t is None else t.num_tokens)
        # NOTE: only a table's last block can need a copy, so only last blocks are counted
        # (per step, not per block held)
        refs = {t[-1].block_id: t[-1].ref_cnt for t in tables if t}
        return _num_blocks_needed(tables, lens, list(num_new_tokens), refs, self.block_size)

    def get_num_blocks_to_prefill(self, request, forks=()) -> int:
        """Blocks (an upper bound) for ``request`` to compute all its tokens from scratch,
        plus, for each request of ``forks`` (to be forked from it at its prompt's end),
        the blocks of its own output, re-prefilled from the prompt's last full block on."""
        bs = self.block_size
        if not forks:
            return cdiv(request.num_tokens, bs)
        shared = request.num_prompt_tokens // bs
        return cdiv(request.num_tokens, bs) + sum(
            cdiv(f.num_tokens, bs) - shared for f in forks if f.num_tokens > f.num_prompt_tokens
        )

    def get_num_blocks_still_needed(self, request, forks=()) -> int:
        """Blocks a running ``request`` still needs to compute the tokens it already has
        (the rest of its prefill or re-prefill, ``forks`` as above)."""
        t = self.block_tables.get(request.request_id)
        held = 0 if t is None else len(t.blocks)
        if not forks:  # NOTE: the common case, inlined: the watermark rule asks it per running request
            return max(0, cdiv(request.num_tokens, self.block_size) - held)
        return max(0, self.get_num_blocks_to_prefill(request, forks) - held)

    # -- allocation with copy-on-write ---------------------------------------------
    def allocate_slots(
        self, request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; the new blocks, or None if full.

        ``new_computed_blocks`` (prefix-cache hits from ``get_computed_blocks``, only for a
        request that holds no blocks yet) start the table and are shared, not allocated;
        ``num_new_tokens`` then counts the tokens *after* them. If the request's last
        block is shared and partly filled, its first new token would overwrite the other
        holders' K/V: the block is copied first (copy-on-write), and the copy is among the
        returned blocks.
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be a positive int, got {num_new_tokens!r}")
        rid = _request_id(request)
        if rid in self.cpu_block_tables:
            raise ValueError(f"request {rid!r} is swapped out: swap_in before allocate_slots")
        computed = list(new_computed_blocks or ())
        if computed and rid in self.block_tables:
            raise ValueError(f"new_computed_blocks: request {rid!r} already holds blocks")
        t = self.block_tables.get(rid)
        start = (0 if t is None else t.num_tokens) + len(computed) * self.block_size
        total = start + num_new_tokens
        num_total_blocks = cdiv(total, self.block_size)
        if num_total_blocks > self.num_blocks:
            raise ValueError(
                f"request {rid!r} needs {num_total_blocks} blocks for {total} "
                f"tokens but the pool has only {self.num_blocks}"
            )
        table = [] if t is None else t.blocks
        cow = self._needs_copy_on_write(rid)
        num_grow = num_total_blocks - len(table) - len(computed)
        # NOTE: a cache hit sitting in the free queue leaves it when shared, so it costs a
        # free block just like a new one.
        num_revived = sum(1 for b in computed if b.ref_cnt == 0) if computed else 0
        if num_grow + int(cow) + num_revived > self.block_pool.get_num_free_blocks():
            return None  # NOTE: nothing changed; the caller preempts or waits
        if computed:
            self.block_pool.touch(computed)
            table = list(computed)
        # NOTE: most decode steps stay inside the last block: no new block, no pool call
        new_blocks = self.block_pool.get_new_blocks(num_grow + int(cow)) if num_grow or cow else []
        if cow:
            shared, copy = table[-1], new_blocks[0]
            table[-1] = copy
            # NOTE: the shared block keeps ref_cnt >= 1 (the other holders), so this never
            # returns it to the free queue.
            self.block_pool.free_blocks([shared])
            # NOTE: if the shared block is itself the destination of a copy not yet done
            # (forked again after a copy-on-write in the same step), copy from *its*
            # source: the engine does all copies at once, reading every source first.
            src = next((s for s, d in self.pending_copies if d == shared.block_id), shared.block_id)
            self.pending_copies.append((src, copy.block_id))
            table.extend(new_blocks[1:])
        else:
            table.extend(new_blocks)
        if t is None:
            t = self.block_tables[rid] = BlockTable(table, total, self.block_size, len(computed))
        t.blocks, t.num_tokens = table, total
        return new_blocks

    def free(self, request) -> None:
        """As ``KVCacheManager.free``; a pending copy into a block nobody holds is dropped."""
        super().free(request)
        if self.pending_copies:
            # NOTE: a copy into a block nobody holds any more is moot (and the block may be
            # handed to someone else before the engine would do it).
            self.pending_copies = [
                (s, d) for s, d in self.pending_copies if self.block_pool.blocks[d].ref_cnt > 0
            ]

    # -- sharing ------------------------------------------------------------------
    def fork(self, parent, child) -> None:
        """The child shares every block of the parent (each ``ref_cnt`` + 1); no copy.

        ``child`` (a request or an id) must hold no blocks. The tables diverge later:
        the first write into the shared, partly filled last block copies it.
        """
        pid, cid = _request_id(parent), _request_id(child)
        if pid not in self.block_tables:
            raise ValueError(f"fork: unknown parent {pid!r} (it holds no device blocks)")
        if cid in self.block_tables or cid in self.cpu_block_tables:
            raise ValueError(f"fork: child {cid!r} already holds blocks")
        parent_table = self.block_tables[pid]
        blocks = list(parent_table.blocks)  # NOTE: a new list: the tables diverge later
        self.block_pool.touch(blocks)
        self.block_tables[cid] = BlockTable(blocks, parent_table.num_tokens, self.block_size)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` copy-on-write pairs recorded since the last call (cleared)."""
        out, self.pending_copies = self.pending_copies, []
        return out

    # -- swapping -----------------------------------------------------------------
    def get_num_free_cpu_blocks(self) -> int:
        return 0 if self.cpu_block_pool is None else self.cpu_block_pool.get_num_free_blocks()

    def can_swap_out(self, request) -> bool:
        rid = _request_id(request)
        t = self.block_tables.get(rid)
        return (0 if t is None else len(t.blocks)) <= self.get_num_free_cpu_blocks()

    def swap_out(self, request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU blocks: ``[(device id, cpu id)]``, or None.

        None (nothing changed) when the CPU pool has too few free blocks: the caller then
        falls back to recompute. The device blocks are freed (tail first).
        NOTE: a block shared with another table gets a private CPU copy; sharing is not
        restored on swap-in (correct, only less compact). ``swap_out_group`` keeps the
        sharing inside a group.
        """
        return self.swap_out_group([request])

    def swap_out_group(self, requests) -> list[tuple[int, int]] | None:
        """Swap out several requests at once; a block they share gets one CPU block."""
        rids = [_request_id(r) for r in requests]
        for rid in rids:
            if rid not in self.block_tables:
                raise ValueError(f"unknown request {rid!r}: it holds no device blocks")
            if rid in self.cpu_block_tables:
                raise RuntimeError(f"request {rid!r} is already swapped out")
        if len(set(rids)) != len(rids):
            raise ValueError(f"requests appear twice: {rids}")
        tables = [self.block_tables[rid] for rid in rids]
        distinct = list({b.block_id: b for t in tables for b in t.blocks}.values())
        if self.cpu_block_pool is None or len(distinct) > self.get_num_free_cpu_blocks():
            return None
        cpu_blocks = self.cpu_block_pool.get_new_blocks(len(distinct))
        to_cpu = {b.block_id: c for b, c in zip(distinct, cpu_blocks)}
        cpu_tables = [[to_cpu[b.block_id] for b in t.blocks] for t in tables]
        # get_new_blocks gave each CPU block one reference; add one per further holder.
        _add_extra_refs(self.cpu_block_pool, cpu_tables)
        for rid, t, cpu in zip(rids, tables, cpu_tables):  # NOTE: the table moves to the CPU pool
            self.free(rid)
            t.blocks, t.num_cached_blocks = cpu, 0
            self.cpu_block_tables[rid] = t
        return [(b.block_id, to_cpu[b.block_id].block_id) for b in distinct]

    def can_swap_in(self, request, num_new_tokens: int = 0) -> bool:
        """Whether ``swap_in`` and then ``allocate_slots(request, num_new_tokens)`` fit."""
        return self.can_swap_in_group([request], [num_new_tokens])

    def can_swap_in_group(self, requests, num_new_tokens) -> bool:
        """Whether ``swap_in_group`` and then each ``allocate_slots(r, n)`` fit.

        Counts exactly what will happen: one device block per distinct CPU block, the
        blocks each request grows by, and the copy-on-write copies (in order: the last
        writer of a shared partly filled block writes in place).
        """
        empty = BlockTable([], 0, self.block_size)
        got = [self.cpu_block_tables.get(_request_id(r), empty) for r in requests]
        tables = [t.blocks for t in got]
        refs: dict[int, int] = {}  # NOTE: after swap-in, shared only inside the group
        for t in tables:
            for c in t:
                refs[c.block_id] = refs.get(c.block_id, 0) + 1
        lens = [t.num_tokens for t in got]
        need = len(refs) + _num_blocks_needed(tables, lens, list(num_new_tokens), dict(refs), self.block_size)
        return need <= self.get_num_free_blocks()

    def swap_in(self, request) -> list[tuple[int, int]] | None:
        """Move a swapped request's blocks back to the device: ``[(cpu id, device id)]``.

        None (nothing changed) when the device pool has too few free blocks.
        """
        return self.swap_in_group([request])

    def swap_in_group(self, requests) -> list[tuple[int, int]] | None:
        """Swap several requests back in at once; a shared CPU block gets one device block."""
        rids = [_request_id(r) for r in requests]
        for rid in rids:
            if rid not in self.cpu_block_tables:
                raise ValueError(f"request {rid!r} is not swapped out")
            if rid in self.block_tables:
                raise RuntimeError(f"request {rid!r} holds device blocks and CPU blocks")
        if len(set(rids)) != len(rids):
            raise ValueError(f"requests appear twice: {rids}")
        tables = [self.cpu_block_tables[rid] for rid in rids]
        distinct = list({c.block_id: c for t in tables for c in t.blocks}.values())
        if len(distinct) > self.get_num_free_blocks():
            return None
        blocks = self.block_pool.get_new_blocks(len(distinct))
        to_dev = {c.block_id: b for c, b in zip(distinct, blocks)}
        dev_tables = [[to_dev[c.block_id] for c in t.blocks] for t in tables]
        _add_extra_refs(self.block_pool, dev_tables)
        for rid, t, dev in zip(rids, tables, dev_tables):  # NOTE: the table moves back
            self.free_swapped(rid)
            t.blocks = dev
            self.block_tables[rid] = t
        return [(c.block_id, to_dev[c.block_id].block_id) for c in distinct]

    def free_swapped(self, request) -> None:
        """Drop a swapped-out request's CPU blocks (it was aborted, or swapped in)."""
        rid = _request_id(request)
        if rid not in self.cpu_block_tables:
            raise ValueError(f"request {rid!r} is not swapped out")
        blocks = self.cpu_block_tables.pop(rid).blocks
        assert self.cpu_block_pool is not None
        self.cpu_block_pool.free_blocks(reversed(blocks))

    def get_cpu_block_ids(self, request_id: str) -> list[int]:
        """The CPU block table of a swapped-out request."""
        if request_id not in self.cpu_block_tables:
            raise ValueError(f"request {request_id!r} is not swapped out")
        return self.cpu_block_tables[request_id].block_ids()

    def check_invariants(self) -> None:
        self.block_pool.check_invariants()
        both = set(self.cpu_block_tables) & set(self.block_tables)
        assert not both, f"requests {sorted(both)} hold device and CPU blocks at once"
        check_tables(self.block_pool, self.block_tables, self.block_size)
        if self.cpu_block_pool is None:
            assert not self.cpu_block_tables, "CPU block tables without a CPU pool"
        else:
            self.cpu_block_pool.check_invariants()
            check_tables(self.cpu_block_pool, self.cpu_block_tables, self.block_size, "CPU ")
        dsts = [d for _, d in self.pending_copies]
        assert len(set(dsts)) == len(dsts), f"a block is the destination of two copies: {dsts}"
        for s, d in self.pending_copies:
            assert s != d and self.block_pool.blocks[d].ref_cnt >= 1, (
                f"copy {s}->{d}: the destination must be held by a table"
            )


def _num_blocks_needed(tables, lens, ks, refs: dict[int, int], block_size: int) -> int:
    """Blocks that growing table i from lens[i] by ks[i] tokens takes, in order, counting
    copy-on-write copies; ``refs`` (block id -> holders) is updated as copies are made."""
    need = 0
    for t, n, k in zip(tables, lens, ks):
        if k > 0 and t and n % block_size != 0 and refs[t[-1].block_id] > 1:
            refs[t[-1].block_id] -= 1
            need += 1
        if k > 0:
            need += max(0, cdiv(n + k, block_size) - len(t))
    return need


def _add_extra_refs(pool: BlockPool, tables: list[list[KVCacheBlock]]) -> None:
    """Each block appearing k times in ``tables`` already has one reference: add k - 1."""
    seen: set[int] = set()
    extra = []
    for table in tables:
        for b in table:
            if b.block_id in seen:
                extra.append(b)
            seen.add(b.block_id)
    pool.touch(extra)
