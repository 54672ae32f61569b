"""ContiguousAllocator (Orca Max / Pow2 / Oracle): first-fit regions, holes, fragmentation.

The reference is a list with one entry per slot (the owner or None): first fit is the
first run of None long enough, the holes are the maximal runs of None. The hypothesis
state machine runs random allocate / append / free against it, with check_invariants()
after every rule.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minipaged.core.kv.contiguous import (
    POLICIES,
    ContiguousAllocator,
    ContiguousRegion,
    ContiguousUsage,
    next_power_of_two,
)
from minipaged.core.sched.request import Request


def snapshot(alloc):
    regions = {rid: (r.start, r.size, r.num_tokens, r.final_len) for rid, r in alloc.regions.items()}
    return regions, alloc.get_holes()


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (1, 2, 3, 4, 5, 17, 1024, 1025)] == [1, 2, 4, 4, 8, 32, 1024, 2048]


def test_reservation_sizes():
    mx = ContiguousAllocator(10_000, 2048, "max")
    p2 = ContiguousAllocator(10_000, 2048, "pow2")
    orc = ContiguousAllocator(10_000, 2048, "oracle")
    assert [mx.reservation_size(n) for n in (1, 300, 2048)] == [2048, 2048, 2048]
    assert [p2.reservation_size(n) for n in (1, 300, 513, 2048)] == [1, 512, 1024, 2048]
    assert [orc.reservation_size(n) for n in (1, 300, 2048)] == [1, 300, 2048]
    # pow2 never reserves past max_model_len
    assert ContiguousAllocator(10_000, 1500, "pow2").reservation_size(1100) == 1500
    assert mx.name == "Orca (Max)" and p2.name == "Orca (Pow2)" and orc.name == "Orca (Oracle)"


def test_hand_checked_first_fit_and_external_fragmentation():
    a = ContiguousAllocator(12, 12, "oracle")
    assert a.allocate("A", 2, 4) == ContiguousRegion(0, 4, 2, 4)
    assert a.allocate("B", 1, 4) == ContiguousRegion(4, 4, 1, 4)
    assert a.allocate("C", 4, 4) == ContiguousRegion(8, 4, 4, 4)
    assert a.get_holes() == []
    a.free("A")
    a.free("C")
    assert a.get_holes() == [(0, 4), (8, 4)]
    # 8 free slots, but a 6-slot request fits in no hole: all 8 are external fragmentation
    assert not a.can_allocate(6) and a.allocate("D", 1, 6) is None
    assert a.external_fragmentation(6) == 8
    assert a.external_fragmentation(4) == 0  # it fits
    assert a.external_fragmentation(10) == 0  # too little memory even if compacted
    # first fit: the lowest hole that is large enough
    assert a.allocate("E", 1, 3).start == 0
    assert a.get_holes() == [(3, 1), (8, 4)]
    a.free("B")  # merges with the hole on its left and the one on its right
    assert a.get_holes() == [(3, 9)]
    a.check_invariants()
    assert a.get_slot_mapping("E", 0, 1) == [0]


def test_append_and_usage():
    a = ContiguousAllocator(4096, 2048, "pow2")
    a.allocate("x", 100, 300)  # reserves 512
    a.append_tokens("x", 50)
    a.append_tokens(Request("x", prompt_token_ids=[1]))
    u = a.usage()
    assert u == ContiguousUsage(
        num_slots=4096,
        num_token_slots=151,
        num_future_slots=149,
        num_reserved_slots=512,
        num_free_slots=3584,
        largest_hole=3584,
    )
    assert u.internal_fragmentation == 212
    assert u.token_fraction == pytest.approx(151 / 512)
    assert a.get_slot_mapping("x", 149, 151) == [149, 150]
    a.check_invariants()


def test_bad_input_raises_and_changes_nothing():
    a = ContiguousAllocator(100, 50, "oracle")
    a.allocate("x", 5, 10)
    before = snapshot(a)
    cases = [
        (lambda: a.allocate("y", 0, 10), "num_tokens"),
        (lambda: a.allocate("y", -2, 10), "num_tokens"),
        (lambda: a.allocate("y", 5, 0), "final_len"),
        (lambda: a.allocate("y", 5, 4), "below num_tokens"),
        (lambda: a.allocate("y", 5, 51), "exceeds max_model_len"),
        (lambda: a.allocate("x", 1, 2), "already holds"),
        (lambda: a.append_tokens("x", 0), "num_new_tokens"),
        (lambda: a.append_tokens("x", -1), "num_new_tokens"),
        (lambda: a.append_tokens("x", 6), "exceed its final_len"),
        (lambda: a.append_tokens("nobody"), "unknown request"),
        (lambda: a.free("nobody"), "unknown request"),
        (lambda: a.get_slot_mapping("x", 0, 6), "outside"),
        (lambda: a.external_fragmentation(0), "next_final_len"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert snapshot(a) == before
    a.free("x")
    freed = snapshot(a)
    with pytest.raises(ValueError, match="unknown request"):
        a.free("x")  # double free
    assert snapshot(a) == freed
    # a reservation larger than the whole pool can never fit
    big = ContiguousAllocator(100, 2048, "max")
    with pytest.raises(ValueError, match="pool has only 100"):
        big.allocate("z", 1, 1)
    assert big.regions == {} and big.get_holes() == [(0, 100)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_slots=0, max_model_len=8), "num_slots"),
        (dict(num_slots=8, max_model_len=-1), "max_model_len"),
        (dict(num_slots=8, max_model_len=8, policy="best"), "policy"),
    ],
)
def test_bad_constructor(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContiguousAllocator(**kwargs)


# -- random allocate / append / free against the slot-array reference -----------------
REQUEST_IDS = [f"r{i}" for i in range(6)]


def reference_holes(owner):
    holes, start = [], None
    for i, o in enumerate(owner + ["end"]):
        if o is None and start is None:
            start = i
        elif o is not None and start is not None:
            holes.append((start, i - start))
            start = None
    return holes


class ContiguousMachine(RuleBasedStateMachine):
    @initialize(
        num_slots=st.integers(1, 48), max_model_len=st.integers(1, 24), policy=st.sampled_from(POLICIES)
    )
    def init(self, num_slots, max_model_len, policy):
        self.alloc = ContiguousAllocator(num_slots, max_model_len, policy)
        self.owner = [None] * num_slots  # the reference
        self.tokens: dict[str, list[int]] = {}  # rid -> [num_tokens, final_len]

    def ref_size(self, final_len):
        policy, m = self.alloc.policy, self.alloc.max_model_len
        if policy == "max":
            return m
        if policy == "pow2":
            p = 1
            while p < final_len:
                p *= 2
            return min(p, m)
        return final_len

    @rule(rid=st.sampled_from(REQUEST_IDS), n=st.integers(-1, 12), extra=st.integers(-1, 12))
    def allocate(self, rid, n, extra):
        final = n + extra
        before = snapshot(self.alloc)
        if (
            n <= 0
            or final <= 0
            or extra < 0
            or final > self.alloc.max_model_len
            or rid in self.tokens
            or self.ref_size(final) > len(self.owner)
        ):
            with pytest.raises(ValueError):
                self.alloc.allocate(rid, n, final)
            assert snapshot(self.alloc) == before
            return
        size = self.ref_size(final)
        fit = [s for s, length in reference_holes(self.owner) if length >= size]
        free = self.owner.count(None)
        # external fragmentation: enough free slots in total, but no hole fits
        assert self.alloc.external_fragmentation(final) == (free if not fit and free >= size else 0)
        region = self.alloc.allocate(rid, n, final)
        if not fit:
            assert region is None
            assert snapshot(self.alloc) == before
            return
        assert region is not None and region.start == fit[0] and region.size == size
        for s in range(fit[0], fit[0] + size):
            self.owner[s] = rid
        self.tokens[rid] = [n, final]

    @rule(rid=st.sampled_from(REQUEST_IDS), k=st.integers(-1, 6))
    def append(self, rid, k):
        before = snapshot(self.alloc)
        if rid not in self.tokens or k <= 0 or self.tokens[rid][0] + k > self.tokens[rid][1]:
            with pytest.raises(ValueError):
                self.alloc.append_tokens(rid, k)
            assert snapshot(self.alloc) == before
        else:
            self.alloc.append_tokens(rid, k)
            self.tokens[rid][0] += k

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free(self, rid):
        if rid not in self.tokens:
            before = snapshot(self.alloc)
            with pytest.raises(ValueError, match="unknown request"):
                self.alloc.free(rid)
            assert snapshot(self.alloc) == before
            return
        self.alloc.free(rid)
        del self.tokens[rid]
        self.owner = [None if o == rid else o for o in self.owner]

    @invariant()
    def consistent(self):
        a = self.alloc
        a.check_invariants()
        assert a.get_holes() == reference_holes(self.owner)
        for rid, (n, final) in self.tokens.items():
            r = a.get_region(rid)
            assert self.owner[r.start : r.start + r.size] == [rid] * r.size
            assert self.owner.count(rid) == r.size
            assert (r.num_tokens, r.final_len) == (n, final)
            assert a.get_slot_mapping(rid, 0, n) == list(range(r.start, r.start + n))
        u = a.usage()
        assert u.num_token_slots == sum(n for n, _ in self.tokens.values())
        assert u.num_future_slots == sum(f - n for n, f in self.tokens.values())
        assert u.num_reserved_slots == len(self.owner) - self.owner.count(None)
        assert u.num_free_slots == self.owner.count(None)
        assert u.internal_fragmentation == sum(self.ref_size(f) - f for _, f in self.tokens.values())
        assert (
            u.num_token_slots + u.num_future_slots + u.internal_fragmentation + u.num_free_slots
        ) == u.num_slots


TestContiguousMachine = ContiguousMachine.TestCase
TestContiguousMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
