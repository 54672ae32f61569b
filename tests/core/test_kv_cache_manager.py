"""KVCacheManager: block tables, on-demand allocation, slot mapping, usage, failure modes.

The hypothesis state machine keeps its own reference (tokens per request) and after every
rule checks check_invariants(), the ceil(num_tokens / block_size) table length, the bound
of fewer than block_size wasted slots per request, disjoint slots, and the usage figures.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minipaged.core.kv.block import cdiv
from minipaged.core.kv.block_manager_v0 import BlockSpaceManager
from minipaged.core.kv.kv_cache_manager import KVCacheManager, KVCacheUsage
from minipaged.core.sched.request import Request


def snapshot(mgr):
    pool, cpu = mgr.block_pool, getattr(mgr, "cpu_block_pool", None)
    cpu_tables = getattr(mgr, "cpu_block_tables", {})
    return (
        {rid: t.block_ids() for rid, t in mgr.block_tables.items()},
        {rid: t.num_tokens for rid, t in mgr.block_tables.items()},
        [b.ref_cnt for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        {rid: t.block_ids() for rid, t in cpu_tables.items()},
        {rid: t.num_tokens for rid, t in cpu_tables.items()},
        None if cpu is None else [b.block_id for b in cpu.free_block_queue.get_all_free_blocks()],
    )


def test_hand_checked_slot_mapping():
    """3 requests, block_size 4, 12 blocks; worked out by hand before running."""
    mgr = KVCacheManager(num_blocks=12, block_size=4)
    # A: 6 prompt tokens -> 2 blocks, the free queue hands out 0, 1
    assert [b.block_id for b in mgr.allocate_slots("A", 6)] == [0, 1]
    # B: 3 tokens -> 1 block: 2
    assert [b.block_id for b in mgr.allocate_slots("B", 3)] == [2]
    # C: 9 tokens -> 3 blocks: 3, 4, 5
    assert [b.block_id for b in mgr.allocate_slots("C", 9)] == [3, 4, 5]
    # A decodes 2 tokens: 6 -> 8 tokens, still 2 blocks, nothing new
    assert mgr.allocate_slots("A", 2) == []
    # B frees block 2 (no hash: to the front of the queue); A's 9th token needs a 3rd
    # block: it gets block 2 back
    mgr.free("B")
    assert [b.block_id for b in mgr.allocate_slots("A", 1)] == [2]
    assert mgr.get_block_ids("A") == [0, 1, 2]
    # slot(i) = table[i // 4] * 4 + i % 4
    assert mgr.get_slot_mapping("A", 0, 9) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert mgr.get_slot_mapping("C", 0, 9) == [12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert mgr.get_slot_mapping("A", 7, 9) == [7, 8]
    assert mgr.get_slot_mapping("A", 3, 3) == []
    u = mgr.usage()
    assert u == KVCacheUsage(num_slots=48, num_token_slots=18, num_reserved_slots=24, num_free_slots=24)
    assert u.internal_fragmentation == 6 and u.token_fraction == 0.75
    mgr.check_invariants()


def test_accepts_request_objects():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    req = Request("r", prompt_token_ids=[1, 2, 3])
    assert len(mgr.allocate_slots(req, req.num_prompt_tokens)) == 2
    assert mgr.get_block_ids("r") == [0, 1]
    # the one block count: free blocks that holding 4 / 5 tokens would take
    assert mgr.get_num_blocks_to_allocate(req, 4) == 0 and mgr.get_num_blocks_to_allocate(req, 5) == 1
    assert mgr.get_num_blocks_to_allocate(req, 8) == 2 and mgr.get_num_blocks_to_allocate(req, 9) == 3
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 4
    mgr.check_invariants()


def test_exhausted_pool_returns_none_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    mgr.allocate_slots("a", 10)  # 3 blocks
    mgr.allocate_slots("c", 1)  # 1 block; 1 left
    before = snapshot(mgr)
    assert mgr.allocate_slots("b", 5) is None  # needs 2, 1 free
    assert mgr.allocate_slots("a", 7) is None  # 17 tokens -> 5 blocks: 2 more, 1 free
    assert snapshot(mgr) == before
    assert "b" not in mgr.block_tables
    mgr.check_invariants()


def test_bad_input_raises_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    mgr.allocate_slots("a", 5)
    before = snapshot(mgr)
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match="num_new_tokens"):
            mgr.allocate_slots("a", bad)
    with pytest.raises(ValueError, match="pool has only 4"):
        mgr.allocate_slots("big", 17)  # more blocks than exist at all
    with pytest.raises(ValueError, match="unknown request"):
        mgr.free("nobody")
    with pytest.raises(ValueError, match="unknown request"):
        mgr.get_block_ids("nobody")
    with pytest.raises(ValueError, match="unknown request"):
        mgr.get_slot_mapping("nobody", 0, 1)
    with pytest.raises(ValueError, match="outside"):
        mgr.get_slot_mapping("a", 0, 6)
    with pytest.raises(ValueError, match="outside"):
        mgr.get_slot_mapping("a", 3, 2)
    assert snapshot(mgr) == before
    mgr.free("a")
    after_free = snapshot(mgr)
    with pytest.raises(ValueError, match="unknown request"):
        mgr.free("a")  # double free
    assert snapshot(mgr) == after_free
    mgr.check_invariants()


@pytest.mark.parametrize("bad", [0, -4, 2.0])
def test_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=bad)


def test_bad_num_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=4)


def test_free_uncached_first_order_by_hand():
    # request a: 3 tokens in blocks [0, 1]; block 0 full and cached, block 1 not.
    # free() gives them tail first (1, then 0): by default (free_uncached_first, vLLM 0.32)
    # the uncached block 1 goes to the front; with free_uncached_first=False both go to the back.
    for uncached_first, want in [(False, [2, 3, 1, 0]), (True, [1, 2, 3, 0])]:
        m = KVCacheManager(4, 2, enable_caching=True, free_uncached_first=uncached_first)
        a = Request("a", [5, 6, 7])
        m.allocate_slots(a, 3)
        a.num_computed_tokens = 3
        m.cache_blocks(a)
        m.free(a)
        assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()] == want
        assert m.block_pool.blocks[0].block_hash is not None
        m.check_invariants()


def test_swap_out_and_in_by_hand():
    mgr = BlockSpaceManager(num_blocks=4, block_size=2, num_cpu_blocks=3)
    mgr.allocate_slots("a", 3)  # device blocks 0, 1
    mgr.allocate_slots("b", 4)  # device blocks 2, 3
    assert mgr.swap_out("a") == [(0, 0), (1, 1)]  # (device, cpu)
    assert mgr.get_cpu_block_ids("a") == [0, 1] and "a" not in mgr.block_tables
    before = snapshot(mgr)
    assert mgr.swap_out("b") is None  # needs 2 CPU blocks, 1 free: nothing changes
    assert snapshot(mgr) == before
    mgr.allocate_slots("c", 4)  # takes the freed device blocks 1, 0 (tail first)
    assert mgr.get_block_ids("c") == [1, 0]
    assert mgr.swap_in("a") is None  # no device block free
    mgr.free("c")
    assert mgr.swap_in("a") == [(0, 0), (1, 1)]  # (cpu, device)
    assert mgr.block_tables["a"].num_tokens == 3 and mgr.get_num_free_cpu_blocks() == 3
    mgr.check_invariants()


# -- random allocate / append / free / swap ----------------------------------------------
REQUEST_IDS = [f"r{i}" for i in range(6)]


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tokens: dict[str, int] = {}  # reference: tokens allocated per request

    @initialize(
        num_blocks=st.integers(1, 16),
        block_size=st.sampled_from([1, 2, 4, 16]),
        num_cpu_blocks=st.integers(0, 8),
    )
    def init(self, num_blocks, block_size, num_cpu_blocks):
        self.num_blocks, self.bs, self.num_cpu_blocks = num_blocks, block_size, num_cpu_blocks
        self.mgr = BlockSpaceManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks)
        self.swapped: dict[str, int] = {}  # reference: tokens of swapped-out requests

    def blocks_held(self):
        return sum(cdiv(n, self.bs) for n in self.tokens.values())

    @rule(rid=st.sampled_from(REQUEST_IDS), k=st.integers(1, 40))
    def allocate(self, rid, k):
        if rid in self.swapped:
            before = snapshot(self.mgr)
            with pytest.raises(ValueError, match="swapped out"):
                self.mgr.allocate_slots(rid, k)
            assert snapshot(self.mgr) == before
            return
        old = self.tokens.get(rid, 0)
        want_total = cdiv(old + k, self.bs)
        needed = want_total - cdiv(old, self.bs)
        free_before = self.num_blocks - self.blocks_held()
        before = snapshot(self.mgr)
        if want_total > self.num_blocks:
            with pytest.raises(ValueError, match="pool has only"):
                self.mgr.allocate_slots(rid, k)
            assert snapshot(self.mgr) == before
        elif needed > free_before:
            assert self.mgr.get_num_blocks_to_allocate(rid, old + k) > self.mgr.get_num_free_blocks()
            assert self.mgr.allocate_slots(rid, k) is None
            assert snapshot(self.mgr) == before
        else:
            assert self.mgr.get_num_blocks_to_allocate(rid, old + k) == needed
            free_ids = before[3]
            new = self.mgr.allocate_slots(rid, k)
            assert [b.block_id for b in new] == free_ids[:needed]  # front of the free queue
            self.tokens[rid] = old + k
            # the old part of the table is untouched
            assert self.mgr.get_block_ids(rid)[: cdiv(old, self.bs)] == before[0].get(rid, [])

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free(self, rid):
        if rid in self.tokens:
            held = self.mgr.get_block_ids(rid)
            self.mgr.free(rid)
            del self.tokens[rid]
            # freed tail first: they sit at the back of the free queue in reverse order
            tail = [b.block_id for b in self.mgr.block_pool.free_block_queue.get_all_free_blocks()]
            assert tail[len(tail) - len(held) :] == held[::-1]
        else:
            before = snapshot(self.mgr)
            with pytest.raises(ValueError, match="unknown request"):
                self.mgr.free(rid)
            assert snapshot(self.mgr) == before

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def swap_out(self, rid):
        before = snapshot(self.mgr)
        if rid not in self.tokens:
            with pytest.raises(ValueError):
                self.mgr.swap_out(rid)
            assert snapshot(self.mgr) == before
            return
        n = cdiv(self.tokens[rid], self.bs)
        cpu_used = sum(cdiv(t, self.bs) for t in self.swapped.values())
        if n > self.num_cpu_blocks - cpu_used:
            assert not self.mgr.can_swap_out(rid)
            assert self.mgr.swap_out(rid) is None
            assert snapshot(self.mgr) == before
            return
        assert self.mgr.can_swap_out(rid)
        table = before[0][rid]
        mapping = self.mgr.swap_out(rid)
        assert [d for d, _ in mapping] == table
        assert [c for _, c in mapping] == self.mgr.get_cpu_block_ids(rid) == before[6][:n]
        self.swapped[rid] = self.tokens.pop(rid)

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def swap_in(self, rid):
        before = snapshot(self.mgr)
        if rid not in self.swapped:
            with pytest.raises(ValueError, match="not swapped out"):
                self.mgr.swap_in(rid)
            assert snapshot(self.mgr) == before
            return
        n = cdiv(self.swapped[rid], self.bs)
        if n > self.num_blocks - self.blocks_held():
            assert not self.mgr.can_swap_in(rid)
            assert self.mgr.swap_in(rid) is None
            assert snapshot(self.mgr) == before
            return
        assert self.mgr.can_swap_in(rid)
        cpu_table = before[4][rid]
        mapping = self.mgr.swap_in(rid)
        assert [c for c, _ in mapping] == cpu_table
        assert [d for _, d in mapping] == self.mgr.get_block_ids(rid) == before[3][:n]
        self.tokens[rid] = self.swapped.pop(rid)

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free_swapped(self, rid):
        if rid in self.swapped:
            self.mgr.free_swapped(rid)
            del self.swapped[rid]
        else:
            before = snapshot(self.mgr)
            with pytest.raises(ValueError, match="not swapped out"):
                self.mgr.free_swapped(rid)
            assert snapshot(self.mgr) == before

    @rule(rid=st.sampled_from(REQUEST_IDS), k=st.integers(-3, 0))
    def bad_allocate(self, rid, k):
        before = snapshot(self.mgr)
        with pytest.raises(ValueError, match="num_new_tokens"):
            self.mgr.allocate_slots(rid, k)
        assert snapshot(self.mgr) == before

    @invariant()
    def consistent(self):
        mgr, bs = self.mgr, self.bs
        mgr.check_invariants()
        assert set(mgr.block_tables) == set(self.tokens)
        all_slots = []
        for rid, n in self.tokens.items():
            table = mgr.get_block_ids(rid)
            assert len(table) == cdiv(n, bs)
            assert len(table) * bs - n < bs  # the bound: fewer than block_size wasted slots
            slots = mgr.get_slot_mapping(rid, 0, n)
            assert slots == [table[i // bs] * bs + i % bs for i in range(n)]
            all_slots += slots
        assert len(set(all_slots)) == len(all_slots), "two tokens share a slot"
        assert all(0 <= s < self.num_blocks * bs for s in all_slots)
        held = self.blocks_held()
        assert mgr.get_num_free_blocks() == self.num_blocks - held
        u = mgr.usage()
        assert u.num_slots == self.num_blocks * bs
        assert u.num_token_slots == sum(self.tokens.values())
        assert u.num_reserved_slots == held * bs
        assert u.num_free_slots == (self.num_blocks - held) * bs
        assert 0 <= u.internal_fragmentation < bs * max(1, len(self.tokens))
        # swap space
        assert set(mgr.cpu_block_tables) == set(self.swapped)
        cpu_held = 0
        for rid, n in self.swapped.items():
            assert (
                len(mgr.get_cpu_block_ids(rid)) == cdiv(n, bs) and mgr.cpu_block_tables[rid].num_tokens == n
            )
            cpu_held += cdiv(n, bs)
        assert mgr.get_num_free_cpu_blocks() == self.num_cpu_blocks - cpu_held


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
