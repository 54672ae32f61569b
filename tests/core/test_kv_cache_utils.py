"""KVCacheBlock, FreeKVCacheBlockQueue, hash_block_tokens, cdiv.

The free queue is checked against a plain Python list doing the same operations
(the reference), with check_invariants() after every operation.
"""

import hashlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.core.kv.block import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    cdiv,
    hash_block_tokens,
)


def make_queue(n):
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(queue):
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_initial_order_and_len():
    blocks, q = make_queue(5)
    q.check_invariants()
    assert ids(q) == [0, 1, 2, 3, 4]
    assert len(q) == 5 and q.num_free_blocks == 5
    assert all(b in q for b in blocks)


def test_popleft_remove_append():
    blocks, q = make_queue(4)
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    assert ids(q) == [1, 3]
    assert blocks[0] not in q and blocks[2] not in q
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(q) == [1, 3, 2, 0]
    q.check_invariants()


def test_empty_queue():
    _, q = make_queue(0)
    q.check_invariants()
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
    q.check_invariants()


def test_popleft_on_exhausted_queue_changes_nothing():
    blocks, q = make_queue(2)
    q.popleft(), q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    q.check_invariants()
    assert len(q) == 0
    q.append(blocks[1])
    assert ids(q) == [1]


def test_bookkeeping_errors_leave_queue_unchanged():
    blocks, q = make_queue(3)
    b = q.popleft()
    before = ids(q)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(b)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.append(blocks[1])
    assert ids(q) == before
    q.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=12),
    ops=st.lists(
        st.tuples(st.sampled_from(["popleft", "remove", "append"]), st.integers(0, 11)), max_size=60
    ),
)
def test_queue_matches_list_reference(n, ops):
    blocks, q = make_queue(n)
    ref = list(range(n))  # the reference: a list of free block ids, front first
    for op, k in ops:
        if op == "popleft":
            if ref:
                assert q.popleft().block_id == ref.pop(0)
            else:
                with pytest.raises(ValueError):
                    q.popleft()
        elif op == "remove" and ref:
            bid = ref[k % len(ref)]
            ref.remove(bid)
            q.remove(blocks[bid])
        elif op == "append" and n:
            bid = k % n
            if bid not in ref:
                ref.append(bid)
                q.append(blocks[bid])
        q.check_invariants()
        assert ids(q) == ref
        assert len(q) == len(ref)
        assert all((b in q) == (b.block_id in ref) for b in blocks)


# -- hashing ------------------------------------------------------------------------
def reference_hash(parent, tokens):
    h = hashlib.sha256()
    h.update(hashlib.sha256(b"minipaged:none").digest() if parent is None else parent)
    for t in tokens:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.digest()


def test_hash_matches_independent_sha256():
    assert NONE_HASH == hashlib.sha256(b"minipaged:none").digest()
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == reference_hash(None, [1, 2, 3, 4])
    h2 = hash_block_tokens(h1, [5, 6, 7, 8])
    assert h2 == reference_hash(h1, [5, 6, 7, 8])
    assert isinstance(h1, bytes) and len(h1) == 32


def test_hash_is_a_prefix_key():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(None, [9, 2, 3, 4])
    # same block tokens after different parents -> different keys
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(b, [5, 6])
    # None parent and NONE_HASH parent are the same thing
    assert hash_block_tokens(NONE_HASH, [1, 2]) == hash_block_tokens(None, [1, 2])
    # order and values matter; the token boundary matters (fixed-width encoding)
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    # stable across calls (not Python's salted hash())
    assert hash_block_tokens(None, (1, 2, 3)) == hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(None, [1, 2, 3]).hex()[:16] == reference_hash(None, [1, 2, 3]).hex()[:16]


@given(a=st.integers(0, 10_000), b=st.integers(1, 512))
@settings(max_examples=200, deadline=None)
def test_cdiv(a, b):
    assert cdiv(a, b) == math.ceil(a / b)


def test_block_repr_shows_hash_prefix():
    blk = KVCacheBlock(block_id=3, ref_cnt=2)
    assert repr(blk) == "KVCacheBlock(id=3, ref_cnt=2)"
    blk.block_hash = bytes.fromhex("ab" * 32)
    assert repr(blk) == "KVCacheBlock(id=3, ref_cnt=2, hash=abababab)"
