"""KVCacheManager: one block table per request, on top of a BlockPool (vLLM v1's).

Mirrors vLLM ``vllm/v1/core/kv_cache_manager.py`` (and nano-vllm's ``block_manager.py``).
The paper's fork, copy-on-write and swap live beside it, in ``block_manager_v0.py``.

Concept (PagedAttention's addressing half)
    A request's tokens live in *logical* blocks 0, 1, 2, ... of ``block_size`` tokens.
    Its *block table* maps logical block ``j`` to a physical block id anywhere in the
    cache, so the slot of token ``i`` is::

        slot(i) = block_table[i // block_size] * block_size + i % block_size

    Blocks are allocated on demand as the sequence grows, so at most ``block_size - 1``
    slots per request are ever reserved without holding a token.
Inputs / outputs
    ``allocate_slots(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)``
    makes room for ``num_new_tokens`` more tokens past the request's computed ones (and
    ``num_lookahead_tokens`` slots beyond them, speculative decoding's) and returns the new
    blocks (possibly ``[]``), or ``None`` when the pool cannot supply them (vLLM's admission
    gates ``full_sequence_must_fit`` and ``watermark_blocks`` included). As vLLM's, a table
    keeps its blocks until ``free``: after a rejection the request's ``num_computed_tokens``
    goes back, its slots stay and the next step rewrites them. ``free(request)``
    returns its blocks. ``get_block_ids(request_id)`` is its table; ``usage()`` the
    occupancy of the paper's Fig. 2. Every block count is ``get_num_blocks_to_allocate``
    or ``max_num_blocks``: the one place blocks are counted.
Automatic prefix caching (``enable_caching=True``; vLLM's APC)
    A full block is known by ``hash_block_tokens(parent_hash, its tokens)``, chained from
    the first block, so equal hashes mean equal *prefixes*. ``get_computed_blocks`` finds
    the longest cached prefix (at most ``num_tokens - 1`` tokens: the last one is always
    computed, its logits give the next token); ``cache_blocks`` registers the blocks a
    step fills. A freed cached block stays hittable in the free queue until the pool hands
    it out (LRU eviction). ``free_uncached_first`` (default True): vLLM 0.32's free order,
    freed blocks without a hash reused first (``BlockPool``).
Invariants (``check_invariants``)
    a block's ``ref_cnt`` equals the number of tables holding it; the free queue holds
    exactly the blocks with ``ref_cnt == 0``; ``len(table) == ceil(num_tokens / block_size)``,
    ``num_tokens`` being the slots a table has claimed (computed tokens, those scheduled,
    lookahead).
Failure mode
    pool exhausted -> ``allocate_slots`` returns ``None`` and changes nothing; the
    scheduler decides whom to preempt. More blocks than the whole pool, a non-positive
    token count, an unknown request or a double free raise ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipaged.core.kv.block import BlockHash, KVCacheBlock, cdiv, check_positive_int, hash_block_tokens
from minipaged.core.kv.block_pool import BlockPool
from minipaged.core.kv.block_table import BlockTable


def max_num_blocks(num_tokens: int, block_size: int, num_seqs: int = 1, num_shared_tokens: int = 0) -> int:
    """The most blocks ``num_seqs`` sequences of up to ``num_tokens`` tokens each hold at
    once when they share the full blocks of their first ``num_shared_tokens`` tokens (a
    sequence group's or a beam family's prompt). Refusal rules compare it with the pool."""
    shared = num_shared_tokens // block_size
    return shared + num_seqs * (cdiv(num_tokens, block_size) - shared)


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
        free_uncached_first: bool = True,
    ) -> None:
        check_positive_int("block_size", block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_blocks, enable_caching=enable_caching, free_uncached_first=free_uncached_first
        )
        # request_id -> its block table (blocks, tokens, slot formula)
        self.block_tables: dict[str, BlockTable] = {}

    # -- counting (the one place) -------------------------------------------------
    def get_num_blocks_to_allocate(self, request, num_tokens: int, new_computed_blocks=()) -> int:
        """Free blocks that holding ``num_tokens`` tokens of ``request`` would take, with
        ``new_computed_blocks`` (prefix-cache hits) shared first. NOTE: a hit sitting in
        the free queue leaves it when shared, so it costs a free block like a new one."""
        t = self.block_tables.get(_request_id(request))
        held = 0 if t is None else len(t.blocks)
        grow = max(0, cdiv(num_tokens, self.block_size) - held - len(new_computed_blocks))
        return grow + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # -- allocation ---------------------------------------------------------------
    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        full_sequence_must_fit: bool = False,
        watermark_blocks: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; the new blocks, or None if they do not fit (nothing changed).

        ``new_computed_blocks`` (hits from ``get_computed_blocks``, only for a request that
        holds no blocks yet) start the table, shared; ``num_new_tokens`` counts the tokens
        after them, ``num_lookahead_tokens`` the slots past those (a draft model's writes).
        vLLM 0.32's admission gates, for a request leaving ``waiting``:
        ``full_sequence_must_fit`` (``scheduler_reserve_full_isl``) first asks for the
        blocks of *all* its tokens, and both checks keep ``watermark_blocks`` free.
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be a positive int, got {num_new_tokens!r}")
        if not isinstance(num_lookahead_tokens, int) or num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be an int >= 0, got {num_lookahead_tokens!r}")
        rid = _request_id(request)
        computed = list(new_computed_blocks or ())
        if computed and rid in self.block_tables:
            raise ValueError(f"new_computed_blocks: request {rid!r} already holds blocks")
        t = self.block_tables.get(rid)
        # NOTE: as vLLM, a Request counts from its computed tokens (its table may hold slots
        # past them: lookahead, rejected drafts); a bare id counts from its table's slots
        done = 0 if t is None else t.num_tokens if isinstance(request, str) else request.num_computed_tokens
        total = done + len(computed) * self.block_size + num_new_tokens + num_lookahead_tokens
        if cdiv(total, self.block_size) > self.num_blocks:
            raise ValueError(
                f"request {rid!r} needs {cdiv(total, self.block_size)} blocks for {total} "
                f"tokens but the pool has only {self.num_blocks}"
            )
        free = self.get_num_free_blocks()
        if full_sequence_must_fit and (
            self.get_num_blocks_to_allocate(rid, request.num_tokens, computed) + watermark_blocks > free
        ):
            return None
        if self.get_num_blocks_to_allocate(rid, total, computed) + watermark_blocks > free:
            return None  # NOTE: nothing changed; the caller preempts or waits
        if t is None:
            t = self.block_tables[rid] = BlockTable([], 0, self.block_size, len(computed))
        self.block_pool.touch(computed)
        t.blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(max(0, cdiv(total, self.block_size) - len(t.blocks)))
        t.blocks.extend(new_blocks)
        t.num_tokens = max(t.num_tokens, total)  # NOTE: blocks are kept until free()
        return new_blocks

    def free(self, request) -> None:
        """Return a request's blocks to the pool (tail first, for LRU eviction); a shared
        block only loses one reference."""
        rid = _request_id(request)
        if rid not in self.block_tables:
            raise ValueError(f"unknown request {rid!r}: it holds no blocks")
        self.block_pool.free_blocks(reversed(self.block_tables.pop(rid).blocks))

    # -- prefix caching -----------------------------------------------------------
    def _block_hashes(self, request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first ``num_blocks`` full blocks, kept on
        the request (``Request.block_hashes``) and extended lazily: tokens only grow."""
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
        """The cached blocks of the request's longest cached prefix and its token count:
        at most ``num_tokens - 1`` (and ``max_num_tokens``) tokens; ``([], 0)`` when
        caching is off. Not yet shared: pass them to ``allocate_slots``."""
        if not self.enable_caching:
            return [], 0
        limit = (
            request.num_tokens - 1 if max_num_tokens is None else min(request.num_tokens - 1, max_num_tokens)
        )
        hits: list[KVCacheBlock] = []
        for h in self._block_hashes(request, max(0, limit) // self.block_size):
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break  # NOTE: a chained hash: nothing after a miss can hit
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request, num_computed_tokens: int | None = None) -> None:
        """Register the request's full blocks up to ``num_computed_tokens`` in the cache.
        The scheduler calls it as it allocates a step's slots (vLLM v1): that step's
        forward writes them before anyone reads them."""
        if not self.enable_caching:
            return
        rid = _request_id(request)
        t = self.block_tables.get(rid)
        if t is None:
            raise ValueError(f"unknown request {rid!r}")
        n = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if n > t.num_tokens:
            raise ValueError(f"num_computed_tokens {n} > the {t.num_tokens} allocated tokens")
        full, done = n // self.block_size, t.num_cached_blocks
        for j, h in enumerate(self._block_hashes(request, full)[done:], start=done):
            self.block_pool.cache_block(t.blocks[j], h)
        t.num_cached_blocks = max(done, full)

    # -- addressing and reporting -------------------------------------------------
    def get_block_table(self, request) -> BlockTable:
        """The block table of ``request`` (a ``Request`` or its id)."""
        rid = _request_id(request)
        if rid not in self.block_tables:
            raise ValueError(f"unknown request {rid!r}")
        return self.block_tables[rid]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of ``request_id`` (physical block id per logical block)."""
        return self.get_block_table(request_id).block_ids()

    def get_slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of the request's tokens ``start .. end-1`` (``BlockTable.slot_mapping``)."""
        return self.get_block_table(request_id).slot_mapping(start, end)

    def get_ref_cnt(self, block_id: int) -> int:
        return self.block_pool.blocks[block_id].ref_cnt

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
            for j, b in enumerate(t.blocks):
                per_block[b.block_id] = max(per_block.get(b.block_id, 0), min(bs, t.num_tokens - j * bs))
        free = self.get_num_free_blocks()
        return KVCacheUsage(
            num_slots=self.num_blocks * bs,
            num_token_slots=sum(per_block.values()),
            num_reserved_slots=(self.num_blocks - free) * bs,
            num_free_slots=free * bs,
        )

    def check_invariants(self) -> None:
        self.block_pool.check_invariants()
        check_tables(self.block_pool, self.block_tables, self.block_size)


def check_tables(pool: BlockPool, tables: dict[str, BlockTable], block_size: int, where: str = "") -> None:
    """Each table has ``ceil(num_tokens / block_size)`` blocks; each block's ``ref_cnt`` is
    the number of tables holding it."""
    holders: dict[int, int] = {}
    for rid, t in tables.items():
        assert t.block_size == block_size, f"{where}table of {rid!r}: block_size {t.block_size}"
        assert len(t.blocks) == cdiv(t.num_tokens, block_size), (
            f"{where}table of {rid!r}: {len(t.blocks)} blocks for {t.num_tokens} tokens (block_size {block_size})"
        )
        assert t.num_cached_blocks <= len(t.blocks), (
            f"{rid!r}: {t.num_cached_blocks} cached blocks > its table"
        )
        for b in t.blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt == holders.get(b.block_id, 0), (
            f"{where}block {b.block_id}: ref_cnt {b.ref_cnt} but held by {holders.get(b.block_id, 0)} block tables"
        )
