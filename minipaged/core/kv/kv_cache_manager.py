"""KVCacheManager: one block table per request, on top of a BlockPool.

Mirrors vLLM ``vllm/v1/core/kv_cache_manager.py`` (and nano-vllm's ``block_manager.py``).

Concept (PagedAttention's addressing half)
    A request's tokens live in *logical* blocks 0, 1, 2, ... of ``block_size`` tokens.
    Its *block table* maps logical block ``j`` to a physical block id anywhere in the
    cache, so the slot of token ``i`` is::

        slot(i) = block_table[i // block_size] * block_size + i % block_size

    Blocks are allocated on demand, one at a time as the sequence grows, so at most
    ``block_size - 1`` slots per request are ever reserved without holding a token.

Inputs / outputs
    ``allocate_slots(request, num_new_tokens)`` makes room for ``num_new_tokens`` more
    tokens of ``request`` (a ``Request`` or a request id) and returns the newly allocated
    blocks (possibly ``[]``), or ``None`` when the pool cannot supply them.
    ``free(request)`` returns its blocks to the pool. ``get_block_ids(request_id)`` is
    its block table's ids; ``get_block_table(request)`` the ``BlockTable`` (with the slot
    formula) the model runner reads; ``usage()`` the occupancy figures of the paper's Fig. 2.

Invariants (``check_invariants``)
    - a block's ``ref_cnt`` equals the number of block tables holding it;
    - the free queue holds exactly the blocks with ``ref_cnt == 0``;
    - ``len(block_table) == ceil(num_tokens / block_size)`` for every request;
    - hence, without sharing, fewer than ``block_size`` slots per request are wasted;
    - pending copies have distinct destinations, each held by some table.

Swap bookkeeping (preemption by swapping, the paper's section 4.5)
    With ``num_cpu_blocks > 0`` the manager also owns a second ``BlockPool`` standing for
    the CPU swap space. ``swap_out(request)`` moves a request's whole block table to CPU
    blocks and returns the ``(device block, cpu block)`` pairs to copy; ``swap_in(request)``
    moves it back and returns ``(cpu block, device block)`` pairs. Both are all or
    nothing: when the other pool has too few free blocks they return ``None`` and change
    nothing. A swapped request holds CPU blocks only (``get_cpu_block_ids``);
    ``free_swapped(request)`` drops them (abort). The manager only does the bookkeeping:
    the engine copies the data (``kernels.cache_ops.swap_blocks``) before the model runs.

Sharing (the paper's section 4.4)
    ``fork(parent, child)``: the child's block table holds the *same* blocks as the
    parent's (every ``ref_cnt`` + 1); no K/V is copied. Parallel sampling and beam search
    fork. Freeing a shared block only drops its count.
    Copy-on-write: when ``allocate_slots`` would write into a shared, partly filled last
    block, it takes a fresh block for this request, records ``(src, dst)`` so the engine
    copies the block (``kernels.cache_ops.copy_blocks``) before the model writes, and drops
    one reference from the shared block. ``take_pending_copies()`` hands the recorded
    pairs over (the scheduler puts them into ``SchedulerOutput.blocks_to_copy``). Full
    shared blocks are never copied: a new token starts a new block.
    ``swap_out_group`` / ``swap_in_group`` move several tables at once and keep the
    blocks they share shared (one CPU block per shared device block, and back).

Automatic prefix caching (``enable_caching=True``; vLLM's APC)
    A full block is known by ``hash_block_tokens(parent_hash, its tokens)``, chained from
    the first block, so equal hashes mean equal *prefixes*. ``cache_blocks(request)``
    registers a request's blocks as they fill (after the model wrote them).
    ``get_computed_blocks(request)`` -> ``(blocks, num_computed_tokens)``: the cached
    blocks of the request's longest cached prefix, at most ``num_tokens - 1`` tokens so
    that the last token is always computed (its logits are needed); pass them to
    ``allocate_slots(request, n, new_computed_blocks=blocks)``, which shares them. A
    freed cached block stays in the free queue with its hash and can be hit again until
    the pool hands it out to someone else: eviction in LRU order (free order, tail first).
    As vLLM, a filled block is cached even when another block holds the same prefix (both
    hittable). ``free_uncached_first=True``: vLLM 0.32 frees blocks without a hash to the
    front of the free queue, cached ones to the back (``BlockPool``); default off.

Failure mode
    pool exhausted -> ``allocate_slots`` returns ``None`` and changes nothing (nothing is
    half-allocated); the scheduler then decides whom to preempt. A request that needs
    more blocks than the whole pool, a non-positive token count, an unknown request or a
    double free raise ``ValueError`` and change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipaged.core.kv.block import BlockHash, KVCacheBlock, cdiv, check_positive_int, hash_block_tokens
from minipaged.core.kv.block_pool import BlockPool
from minipaged.core.kv.block_table import BlockTable


@dataclass(frozen=True, slots=True)
class KVCacheUsage:
    """Occupancy of the KV cache, in token slots."""

    num_slots: int  # all slots in the pool
    num_token_slots: int  # slots holding (or about to hold) a token's K/V
    num_reserved_slots: int  # slots in blocks that some request holds
    num_free_slots: int  # slots in free blocks

    @property
    def internal_fragmentation(self) -> int:
        """Reserved but not holding a token: the tail of each request's last block."""
        return self.num_reserved_slots - self.num_token_slots

    @property
    def token_fraction(self) -> float:
        """Fraction of *reserved* memory holding token states (the paper's Fig. 2 bar)."""
        return self.num_token_slots / self.num_reserved_slots if self.num_reserved_slots else 1.0


def _request_id(request) -> str:
    return request if isinstance(request, str) else request.request_id


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        num_cpu_blocks: int = 0,
        free_uncached_first: bool = False,
    ) -> None:
        check_positive_int("block_size", block_size)
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_blocks, enable_caching=enable_caching, free_uncached_first=free_uncached_first
        )
        # request_id -> its block table (blocks, tokens, slot formula), in the device pool
        self.block_tables: dict[str, BlockTable] = {}
        # Swap space: a second pool of CPU blocks, and the tables of swapped-out requests.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_block_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        # request_id -> its block table while swapped out (its blocks are CPU blocks)
        self.cpu_block_tables: dict[str, BlockTable] = {}
        # Copy-on-write: (src block id, dst block id) pairs not yet handed to the engine.
        self.pending_copies: list[tuple[int, int]] = []

    # -- allocation ---------------------------------------------------------------
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
        empty = BlockTable([], 0, self.block_size)
        got = [self.block_tables.get(_request_id(r), empty) for r in requests]
        tables = [t.blocks for t in got]
        refs = {b.block_id: b.ref_cnt for t in tables for b in t}
        lens = [t.num_tokens for t in got]
        return _num_blocks_needed(tables, lens, list(num_new_tokens), refs, self.block_size)

    def get_max_num_blocks(self, num_tokens: int, num_seqs: int = 1, num_shared_tokens: int = 0) -> int:
        """The most blocks ``num_seqs`` sequences of up to ``num_tokens`` tokens each can hold
        at once when they share the full blocks of their first ``num_shared_tokens`` tokens
        (a sequence group's prompt); the refusal rules compare it with ``num_blocks``."""
        shared = num_shared_tokens // self.block_size
        return shared + num_seqs * (cdiv(num_tokens, self.block_size) - shared)

    def get_num_blocks_to_prefill(self, request, forks=()) -> int:
        """Blocks (an upper bound) for ``request`` to compute all its tokens from scratch,
        plus, for each request of ``forks`` (to be forked from it at its prompt's end),
        the blocks of its own output, re-prefilled from the prompt's last full block on."""
        bs = self.block_size
        shared = request.num_prompt_tokens // bs
        return cdiv(request.num_tokens, bs) + sum(
            cdiv(f.num_tokens, bs) - shared for f in forks if f.num_tokens > f.num_prompt_tokens
        )

    def get_num_blocks_still_needed(self, request, forks=()) -> int:
        """Blocks a running ``request`` still needs to compute the tokens it already has
        (the rest of its prefill or re-prefill, ``forks`` as above)."""
        t = self.block_tables.get(request.request_id)
        held = 0 if t is None else len(t.blocks)
        return max(0, self.get_num_blocks_to_prefill(request, forks) - held)

    def can_allocate(self, request, num_new_tokens: int) -> bool:
        return self.get_num_blocks_needed(request, num_new_tokens) <= self.get_num_free_blocks()

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
        if cdiv(total, self.block_size) > self.num_blocks:
            raise ValueError(
                f"request {rid!r} needs {cdiv(total, self.block_size)} blocks for {total} "
                f"tokens but the pool has only {self.num_blocks}"
            )
        table = [] if t is None else t.blocks
        cow = self._needs_copy_on_write(rid)
        num_grow = cdiv(total, self.block_size) - len(table) - len(computed)
        # NOTE: a cache hit sitting in the free queue leaves it when shared, so it costs a
        # free block just like a new one.
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        if num_grow + int(cow) + num_revived > self.block_pool.get_num_free_blocks():
            return None  # NOTE: nothing changed; the caller preempts or waits
        if computed:
            self.block_pool.touch(computed)
            table = list(computed)
        new_blocks = self.block_pool.get_new_blocks(num_grow + int(cow))
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
        """Return all of a request's blocks to the pool (tail first, for LRU eviction).

        A shared block only loses one reference; it is free when its last holder frees it.
        """
        rid = _request_id(request)
        if rid not in self.block_tables:
            raise ValueError(f"unknown request {rid!r}: it holds no blocks")
        self.block_pool.free_blocks(reversed(self.block_tables.pop(rid).blocks))
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

    def get_ref_cnt(self, block_id: int) -> int:
        return self.block_pool.blocks[block_id].ref_cnt

    # -- prefix caching -----------------------------------------------------------
    def _block_hashes(self, request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first ``num_blocks`` full blocks.

        Kept on the request (``Request.block_hashes``) and extended lazily: a request's
        tokens only ever grow, so a block's hash never changes.
        """
        if isinstance(request, str):
            raise ValueError("prefix caching needs a Request (its token ids), not an id")
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            bs = self.block_size
            tokens = request.all_token_ids
            num_blocks = min(num_blocks, len(tokens) // bs)
            parent = hashes[-1] if hashes else None
            for j in range(len(hashes), num_blocks):
                parent = hash_block_tokens(parent, tokens[j * bs : (j + 1) * bs])
                hashes.append(parent)
        return hashes[:num_blocks]

    def get_computed_blocks(
        self, request, max_num_tokens: int | None = None
    ) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the request's longest cached prefix, and its token count.

        At most ``num_tokens - 1`` tokens (and at most ``max_num_tokens``): the last token
        is always computed, because its logits give the next token. ``([], 0)`` when
        caching is off. The blocks are not yet shared: pass them to ``allocate_slots``.
        """
        if not self.enable_caching:
            return [], 0
        limit = request.num_tokens - 1
        if max_num_tokens is not None:
            limit = min(limit, max_num_tokens)
        hits: list[KVCacheBlock] = []
        for h in self._block_hashes(request, max(0, limit) // self.block_size):
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break  # NOTE: a chained hash: nothing after a miss can hit
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request, num_computed_tokens: int | None = None) -> None:
        """Register the request's full blocks up to ``num_computed_tokens`` in the cache.

        The scheduler calls it as it allocates a step's slots (vLLM v1): the blocks are
        written by that step's forward before anyone reads them.
        A block whose prefix is already cached in another block is cached too (vLLM).
        """
        if not self.enable_caching:
            return
        rid = _request_id(request)
        t = self.block_tables.get(rid)
        if t is None:
            raise ValueError(f"unknown request {rid!r}")
        n = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if n > t.num_tokens:
            raise ValueError(f"num_computed_tokens {n} > the {t.num_tokens} allocated tokens")
        full = n // self.block_size
        done = t.num_cached_blocks
        if full <= done:
            return
        for j, h in enumerate(self._block_hashes(request, full)[done:], start=done):
            self.block_pool.cache_block(t.blocks[j], h)
        t.num_cached_blocks = full

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

    # -- addressing ---------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of ``request_id`` (physical block id per logical block)."""
        return self.get_block_table(request_id).block_ids()

    def get_slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of the request's tokens ``start .. end-1`` (``BlockTable.slot_mapping``)."""
        return self.get_block_table(request_id).slot_mapping(start, end)

    def get_block_table(self, request) -> BlockTable:
        """The block table of ``request`` (a ``Request`` or its id): blocks, token count
        and the slot formula, as the model runner reads it."""
        rid = _request_id(request)
        if rid not in self.block_tables:
            raise ValueError(f"unknown request {rid!r}")
        return self.block_tables[rid]

    # -- reporting ----------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_num_used_blocks(self) -> int:
        """Physical blocks held by some table (a shared block counts once)."""
        return self.num_blocks - self.get_num_free_blocks()

    def get_num_table_blocks(self) -> int:
        """Block-table entries over all requests: the blocks used *without* sharing."""
        return sum(len(t.blocks) for t in self.block_tables.values())

    def usage(self) -> KVCacheUsage:
        """Slots holding tokens, reserved, free. Shared blocks count once."""
        bs = self.block_size
        per_block: dict[int, int] = {}  # block id -> tokens it holds
        for t in self.block_tables.values():
            n = t.num_tokens
            for j, b in enumerate(t.blocks):
                held = min(bs, n - j * bs)
                per_block[b.block_id] = max(per_block.get(b.block_id, 0), held)
        reserved = (self.num_blocks - self.get_num_free_blocks()) * bs
        return KVCacheUsage(
            num_slots=self.num_blocks * bs,
            num_token_slots=sum(per_block.values()),
            num_reserved_slots=reserved,
            num_free_slots=self.get_num_free_blocks() * bs,
        )

    def check_invariants(self) -> None:
        self.block_pool.check_invariants()
        both = set(self.cpu_block_tables) & set(self.block_tables)
        assert not both, f"requests {sorted(both)} hold device and CPU blocks at once"
        pools = [(self.block_pool, self.block_tables, "")]
        if self.cpu_block_pool is None:
            assert not self.cpu_block_tables, "CPU block tables without a CPU pool"
        else:
            self.cpu_block_pool.check_invariants()
            pools.append((self.cpu_block_pool, self.cpu_block_tables, "CPU "))
        for pool, tables, where in pools:
            holders: dict[int, int] = {}
            for rid, t in tables.items():
                assert t.block_size == self.block_size, f"{where}table of {rid!r}: block_size {t.block_size}"
                assert len(t.blocks) == cdiv(t.num_tokens, self.block_size), (
                    f"{where}table of {rid!r}: {len(t.blocks)} blocks for {t.num_tokens} tokens "
                    f"(block_size {self.block_size})"
                )
                assert t.num_cached_blocks <= len(t.blocks), (
                    f"{rid!r}: {t.num_cached_blocks} cached blocks > its table"
                )
                for b in t.blocks:
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
            for b in pool.blocks:
                assert b.ref_cnt == holders.get(b.block_id, 0), (
                    f"{where}block {b.block_id}: ref_cnt {b.ref_cnt} but held by "
                    f"{holders.get(b.block_id, 0)} block tables"
                )
        # copy-on-write: distinct destinations, each held by a table
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
