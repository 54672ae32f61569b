"""BlockPool: allocation, reference counting, the free queue, prefix-cache eviction.

A reference model (ref counts in a list, the free queue as a Python list) runs the same
random operations; check_invariants() runs after every operation.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.core.kv.block import hash_block_tokens
from minipaged.core.kv.block_pool import BlockPool


def snapshot(pool):
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        [b.block_hash for b in pool.blocks],
    )


def free_ids(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_fresh_pool():
    pool = BlockPool(6)
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 6
    assert pool.get_usage() == 0.0
    assert free_ids(pool) == list(range(6))
    assert repr(pool) == "BlockPool(num_blocks=6, free=6)"


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", None])
def test_bad_num_blocks(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_get_and_free_order():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    assert [x.block_id for x in a] == [0, 1] and [x.block_id for x in b] == [2, 3]
    assert all(x.ref_cnt == 1 for x in a + b)
    assert pool.get_usage() == pytest.approx(0.8)
    pool.free_blocks(reversed(a))  # tail first, as KVCacheManager.free does
    assert free_ids(pool) == [1, 0, 4]  # no hash: to the front, first given first (vLLM 0.32)
    assert [x.block_id for x in pool.get_new_blocks(3)] == [1, 0, 4]
    assert pool.get_new_blocks(0) == []
    pool.check_invariants()
    old = BlockPool(5, free_uncached_first=False)  # every freed block to the back
    a = old.get_new_blocks(2)
    old.get_new_blocks(2)
    old.free_blocks(reversed(a))
    assert free_ids(old) == [4, 1, 0]


def test_touch_shares_and_revives_free_blocks():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.touch(a)  # a fork: two tables hold the same blocks
    assert [x.ref_cnt for x in a] == [2, 2]
    pool.free_blocks(a)
    assert [x.ref_cnt for x in a] == [1, 1] and pool.get_num_free_blocks() == 1
    pool.free_blocks(a)
    assert pool.get_num_free_blocks() == 3
    pool.touch([a[1]])  # a free block is pulled out of the middle of the queue
    assert a[1].ref_cnt == 1 and free_ids(pool) == [0, 2]
    pool.check_invariants()


# -- bad input: ValueError, state unchanged ---------------------------------------
def test_get_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(5)  # more blocks than exist at all
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        pool.get_new_blocks(-1)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_double_free_raises_and_frees_nothing():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.free_blocks([a[0]])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a[1], a[0]])  # one good, one bad: nothing is freed
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a[1], a[1]])  # the same reference twice
    assert snapshot(pool) == before
    pool.check_invariants()


# -- prefix caching ---------------------------------------------------------------
def test_cached_block_survives_free_and_is_evicted_on_reuse():
    pool = BlockPool(3, enable_caching=True)
    a = pool.get_new_blocks(2)
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    pool.cache_block(a[0], h0)
    pool.cache_block(a[1], h1)
    pool.free_blocks(reversed(a))
    pool.check_invariants()
    assert pool.get_cached_block(h0) is a[0] and a[0].ref_cnt == 0  # free but still cached
    # a hit pulls it back
    pool.touch([pool.get_cached_block(h0)])
    assert a[0].ref_cnt == 1 and a[0].block_hash == h0
    pool.free_blocks([a[0]])
    # free order is now [2, 1, 0]; taking 2 blocks evicts block 1's cache entry (LRU)
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [2, 1]
    assert pool.get_cached_block(h1) is None and a[1].block_hash is None
    assert pool.get_cached_block(h0) is a[0]
    pool.check_invariants()


def test_cache_block_keeps_duplicates_and_noop_without_caching():
    # as vLLM: two blocks filled with the same prefix are both cached; a hit gets the first
    # cached copy still there, and the prefix stays hittable until its last copy is evicted
    pool = BlockPool(3, enable_caching=True)
    a = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7])
    pool.cache_block(a[0], h)
    pool.cache_block(a[1], h)  # same prefix already cached in a[0]: cached as well
    assert pool.get_cached_block(h) is a[0] and a[1].block_hash == h
    assert pool.cached_block_hash_to_block == {h: a[0]}
    pool.check_invariants()
    pool.free_blocks([a[0], a[1]])  # free queue [2, 0, 1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 0]  # evicts the copy in 0
    assert pool.get_cached_block(h) is a[1] and a[0].block_hash is None
    pool.check_invariants()
    pool.get_new_blocks(1)  # evicts the last copy
    assert pool.get_cached_block(h) is None and pool.cached_blocks == {}
    pool.check_invariants()
    plain = BlockPool(2)
    b = plain.get_new_blocks(1)
    plain.cache_block(b[0], h)
    assert plain.get_cached_block(h) is None and b[0].block_hash is None


def test_free_uncached_first():
    # vLLM 0.32 (the default): freed blocks without a hash go to the FRONT (in the order
    # given), cached ones to the back; free_uncached_first=False puts every one at the back
    for uncached_first, want in [(False, [3, 4, 2, 1, 0]), (True, [2, 3, 4, 1, 0])]:
        pool = BlockPool(5, enable_caching=True, free_uncached_first=uncached_first)
        a = pool.get_new_blocks(3)
        pool.cache_block(a[0], hash_block_tokens(None, [1, 2]))
        pool.cache_block(a[1], hash_block_tokens(a[0].block_hash, [3, 4]))
        pool.free_blocks(reversed(a))  # tail first: 2 (no hash), 1, 0
        assert free_ids(pool) == want, uncached_first
        pool.check_invariants()
    # without caching no block has a hash: all go to the front, first given first
    pool = BlockPool(4, free_uncached_first=True)
    a = pool.get_new_blocks(2)
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [1, 0, 2, 3]
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    pool.check_invariants()


# -- random operation sequences against a reference model -----------------------------
@settings(max_examples=120, deadline=None)
@given(
    num_blocks=st.integers(1, 10),
    caching=st.booleans(),
    uncached_first=st.booleans(),
    ops=st.lists(
        st.tuples(st.sampled_from(["get", "free", "fork", "touch_free", "cache", "bad"]), st.integers(0, 12)),
        max_size=50,
    ),
)
def test_random_ops_match_reference(num_blocks, caching, uncached_first, ops):
    pool = BlockPool(num_blocks, enable_caching=caching, free_uncached_first=uncached_first)
    ref_cnt = [0] * num_blocks
    ref_free = list(range(num_blocks))
    ref_hashed: set[int] = set()  # blocks carrying a hash (cached)
    holders: list[list[int]] = []  # each holder owns one reference to each of its blocks
    counter = 0
    for op, k in ops:
        if op == "get":
            if k <= len(ref_free):
                got = pool.get_new_blocks(k)
                want, ref_free = ref_free[:k], ref_free[k:]
                assert [b.block_id for b in got] == want
                for i in want:
                    ref_cnt[i] = 1
                    ref_hashed.discard(i)  # handed out: evicted from the cache
                holders.append(want)
            else:
                before = snapshot(pool)
                with pytest.raises(ValueError):
                    pool.get_new_blocks(k)
                assert snapshot(pool) == before
        elif op == "free" and holders:
            held = holders.pop(k % len(holders))
            pool.free_blocks([pool.blocks[i] for i in reversed(held)])
            front = []
            for i in reversed(held):
                ref_cnt[i] -= 1
                if ref_cnt[i] == 0:
                    (front if uncached_first and i not in ref_hashed else ref_free).append(i)
            ref_free = front + ref_free
        elif op == "fork" and holders:
            held = list(holders[k % len(holders)])
            pool.touch([pool.blocks[i] for i in held])
            for i in held:
                ref_cnt[i] += 1
            holders.append(held)
        elif op == "touch_free" and ref_free:
            i = ref_free.pop(k % len(ref_free))
            pool.touch([pool.blocks[i]])
            ref_cnt[i] = 1
            holders.append([i])
        elif op == "cache" and holders:
            held = holders[k % len(holders)]
            counter += 1
            i = held[0] if held else 0
            pool.cache_block(pool.blocks[i], hash_block_tokens(None, [counter % 3]))  # duplicates too
            if caching:
                ref_hashed.add(i)
        elif op == "bad":
            zero = [i for i in range(num_blocks) if ref_cnt[i] == 0]
            if zero:
                before = snapshot(pool)
                with pytest.raises(ValueError, match="double free"):
                    pool.free_blocks([pool.blocks[zero[k % len(zero)]]])
                assert snapshot(pool) == before
        pool.check_invariants()
        assert [b.ref_cnt for b in pool.blocks] == ref_cnt
        assert free_ids(pool) == ref_free
        assert {b.block_id for b in pool.blocks if b.block_hash is not None} == ref_hashed
        assert pool.get_num_free_blocks() == len(ref_free)
        assert pool.get_usage() == pytest.approx(1 - len(ref_free) / num_blocks)
        if not caching:
            assert pool.cached_block_hash_to_block == {}
