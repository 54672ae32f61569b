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
    its block table; ``get_slot_mapping(request_id, start, end)`` the slots of tokens
    ``start..end-1``; ``usage()`` the occupancy figures of the paper's Fig. 2.

Invariants (``check_invariants``)
    - a block's ``ref_cnt`` equals the number of block tables holding it;
    - the free queue holds exactly the blocks with ``ref_cnt == 0``;
    - ``len(block_table) == ceil(num_tokens / block_size)`` for every request;
    - hence, without sharing, fewer than ``block_size`` slots per request are wasted.

Swap bookkeeping (preemption by swapping, the paper's section 4.5)
    With ``num_cpu_blocks > 0`` the manager also owns a second ``BlockPool`` standing for
    the CPU swap space. ``swap_out(request)`` moves a request's whole block table to CPU
    blocks and returns the ``(device block, cpu block)`` pairs to copy; ``swap_in(request)``
    moves it back and returns ``(cpu block, device block)`` pairs. Both are all or
    nothing: when the other pool has too few free blocks they return ``None`` and change
    nothing. A swapped request holds CPU blocks only (``get_cpu_block_ids``);
    ``free_swapped(request)`` drops them (abort). The manager only does the bookkeeping:
    the engine copies the data (``kernels.cache_ops.swap_blocks``) before the model runs.

Failure mode
    pool exhausted -> ``allocate_slots`` returns ``None`` and changes nothing (nothing is
    half-allocated); the scheduler then decides whom to preempt. A request that needs
    more blocks than the whole pool, a non-positive token count, an unknown request or a
    double free raise ``ValueError`` and change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from minipaged.core.block_pool import BlockPool
from minipaged.core.kv_cache_utils import KVCacheBlock, cdiv

PAD_SLOT_ID = -1  # slot id for padding tokens: reshape_and_cache skips it


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
        self, num_blocks: int, block_size: int, enable_caching: bool = False, num_cpu_blocks: int = 0
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        # request_id -> its block table (logical block j is req_to_blocks[rid][j])
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> number of tokens its slots have been allocated for
        self.num_tokens: dict[str, int] = {}
        # Swap space: a second pool of CPU blocks, and the tables of swapped-out requests.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_block_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.req_to_cpu_blocks: dict[str, list[KVCacheBlock]] = {}
        self.cpu_num_tokens: dict[str, int] = {}

    # -- allocation ---------------------------------------------------------------
    def get_num_blocks_needed(self, request, num_new_tokens: int) -> int:
        """How many *new* blocks ``allocate_slots(request, num_new_tokens)`` would take."""
        rid = _request_id(request)
        total = self.num_tokens.get(rid, 0) + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(self.req_to_blocks.get(rid, ())))

    def can_allocate(self, request, num_new_tokens: int) -> bool:
        return self.get_num_blocks_needed(request, num_new_tokens) <= self.get_num_free_blocks()

    def allocate_slots(self, request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; the new blocks, or None if full."""
        if not isinstance(num_new_tokens, int) or num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be a positive int, got {num_new_tokens!r}")
        rid = _request_id(request)
        if rid in self.req_to_cpu_blocks:
            raise ValueError(f"request {rid!r} is swapped out: swap_in before allocate_slots")
        total = self.num_tokens.get(rid, 0) + num_new_tokens
        if cdiv(total, self.block_size) > self.num_blocks:
            raise ValueError(
                f"request {rid!r} needs {cdiv(total, self.block_size)} blocks for {total} "
                f"tokens but the pool has only {self.num_blocks}"
            )
        num_needed = self.get_num_blocks_needed(rid, num_new_tokens)
        if num_needed > self.block_pool.get_num_free_blocks():
            return None  # NOTE: nothing changed; the caller preempts or waits
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        self.req_to_blocks.setdefault(rid, []).extend(new_blocks)
        self.num_tokens[rid] = total
        return new_blocks

    def free(self, request) -> None:
        """Return all of a request's blocks to the pool (tail first, for LRU eviction)."""
        rid = _request_id(request)
        if rid not in self.req_to_blocks:
            raise ValueError(f"unknown request {rid!r}: it holds no blocks")
        blocks = self.req_to_blocks.pop(rid)
        del self.num_tokens[rid]
        self.block_pool.free_blocks(reversed(blocks))

    # -- swapping -----------------------------------------------------------------
    def get_num_free_cpu_blocks(self) -> int:
        return 0 if self.cpu_block_pool is None else self.cpu_block_pool.get_num_free_blocks()

    def can_swap_out(self, request) -> bool:
        rid = _request_id(request)
        return len(self.req_to_blocks.get(rid, ())) <= self.get_num_free_cpu_blocks()

    def swap_out(self, request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU blocks: ``[(device id, cpu id)]``, or None.

        None (nothing changed) when the CPU pool has too few free blocks: the caller then
        falls back to recompute. The device blocks are freed (tail first).
        NOTE: a block shared with another table gets a private CPU copy; sharing is not
        restored on swap-in (correct, only less compact).
        """
        rid = _request_id(request)
        if rid not in self.req_to_blocks:
            raise ValueError(f"unknown request {rid!r}: it holds no device blocks")
        if rid in self.req_to_cpu_blocks:
            raise RuntimeError(f"request {rid!r} is already swapped out")
        blocks = self.req_to_blocks[rid]
        if self.cpu_block_pool is None or len(blocks) > self.get_num_free_cpu_blocks():
            return None
        cpu_blocks = self.cpu_block_pool.get_new_blocks(len(blocks))
        mapping = [(b.block_id, c.block_id) for b, c in zip(blocks, cpu_blocks)]
        self.req_to_cpu_blocks[rid] = cpu_blocks
        self.cpu_num_tokens[rid] = self.num_tokens[rid]
        self.free(rid)
        return mapping

    def can_swap_in(self, request, num_new_tokens: int = 0) -> bool:
        """Whether ``swap_in`` and then ``allocate_slots(request, num_new_tokens)`` fit."""
        rid = _request_id(request)
        n = len(self.req_to_cpu_blocks.get(rid, ()))
        total = self.cpu_num_tokens.get(rid, 0) + num_new_tokens
        return max(n, cdiv(total, self.block_size)) <= self.get_num_free_blocks()

    def swap_in(self, request) -> list[tuple[int, int]] | None:
        """Move a swapped request's blocks back to the device: ``[(cpu id, device id)]``.

        None (nothing changed) when the device pool has too few free blocks.
        """
        rid = _request_id(request)
        if rid not in self.req_to_cpu_blocks:
            raise ValueError(f"request {rid!r} is not swapped out")
        if rid in self.req_to_blocks:
            raise RuntimeError(f"request {rid!r} holds device blocks and CPU blocks")
        cpu_blocks = self.req_to_cpu_blocks[rid]
        if len(cpu_blocks) > self.get_num_free_blocks():
            return None
        blocks = self.block_pool.get_new_blocks(len(cpu_blocks))
        mapping = [(c.block_id, b.block_id) for c, b in zip(cpu_blocks, blocks)]
        self.req_to_blocks[rid] = blocks
        self.num_tokens[rid] = self.cpu_num_tokens[rid]
        self.free_swapped(rid)
        return mapping

    def free_swapped(self, request) -> None:
        """Drop a swapped-out request's CPU blocks (it was aborted, or swapped in)."""
        rid = _request_id(request)
        if rid not in self.req_to_cpu_blocks:
            raise ValueError(f"request {rid!r} is not swapped out")
        blocks = self.req_to_cpu_blocks.pop(rid)
        del self.cpu_num_tokens[rid]
        assert self.cpu_block_pool is not None
        self.cpu_block_pool.free_blocks(reversed(blocks))

    def get_cpu_block_ids(self, request_id: str) -> list[int]:
        """The CPU block table of a swapped-out request."""
        if request_id not in self.req_to_cpu_blocks:
            raise ValueError(f"request {request_id!r} is not swapped out")
        return [b.block_id for b in self.req_to_cpu_blocks[request_id]]

    # -- addressing ---------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of ``request_id`` (physical block id per logical block)."""
        if request_id not in self.req_to_blocks:
            raise ValueError(f"unknown request {request_id!r}")
        return [b.block_id for b in self.req_to_blocks[request_id]]

    def get_slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of the request's tokens ``start .. end-1`` in the flat cache."""
        if request_id not in self.req_to_blocks:
            raise ValueError(f"unknown request {request_id!r}")
        n = self.num_tokens[request_id]
        if not 0 <= start <= end <= n:
            raise ValueError(f"token span [{start}, {end}) outside the {n} allocated tokens")
        table, bs = self.req_to_blocks[request_id], self.block_size
        return [table[i // bs].block_id * bs + i % bs for i in range(start, end)]

    # -- reporting ----------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def usage(self) -> KVCacheUsage:
        """Slots holding tokens, reserved, free. Shared blocks count once."""
        bs = self.block_size
        per_block: dict[int, int] = {}  # block id -> tokens it holds
        for rid, blocks in self.req_to_blocks.items():
            n = self.num_tokens[rid]
            for j, b in enumerate(blocks):
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
        holders: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            n = self.num_tokens[rid]
            assert len(blocks) == cdiv(n, self.block_size), (
                f"request {rid!r}: {len(blocks)} blocks for {n} tokens "
                f"(block_size {self.block_size})"
            )
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert set(self.num_tokens) == set(self.req_to_blocks), "num_tokens / tables disagree"
        for b in self.block_pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by "
                f"{holders.get(b.block_id, 0)} block tables"
            )
        # swap space
        assert set(self.cpu_num_tokens) == set(self.req_to_cpu_blocks), "cpu tables disagree"
        both = set(self.req_to_cpu_blocks) & set(self.req_to_blocks)
        assert not both, f"requests {sorted(both)} hold device and CPU blocks at once"
        if self.cpu_block_pool is None:
            assert not self.req_to_cpu_blocks, "CPU block tables without a CPU pool"
            return
        self.cpu_block_pool.check_invariants()
        cpu_holders: dict[int, int] = {}
        for rid, blocks in self.req_to_cpu_blocks.items():
            n = self.cpu_num_tokens[rid]
            assert len(blocks) == cdiv(n, self.block_size), (
                f"swapped request {rid!r}: {len(blocks)} CPU blocks for {n} tokens"
            )
            for b in blocks:
                cpu_holders[b.block_id] = cpu_holders.get(b.block_id, 0) + 1
        for b in self.cpu_block_pool.blocks:
            assert b.ref_cnt == cpu_holders.get(b.block_id, 0), (
                f"CPU block {b.block_id}: ref_cnt {b.ref_cnt} but held by "
                f"{cpu_holders.get(b.block_id, 0)} CPU block tables"
            )
