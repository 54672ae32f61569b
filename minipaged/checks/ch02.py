"""Checkers for chapter 02 exercises: the free queue, block tables, slot mapping.

Exercises (notebooks/exercises/ch02_block_tables.ipynb)
    ex2.1 ``remove(queue, block)``: unlink a block from the middle of the free queue, O(1).
    ex2.2 ``popleft(queue)``: take the least recently freed block.
    ex2.3 ``allocate_slots(manager, request_id, num_new_tokens)``: grow a block table on
          demand, all or nothing.
    ex2.4 ``slot_mapping(block_table, block_size, start, end)``: the flat cache slot of
          each token.

Reference: the package's ``FreeKVCacheBlockQueue``, ``KVCacheManager.allocate_slots`` and
``KVCacheManager.get_slot_mapping``, run side by side with the student's code on seeded
random operation sequences. The student's queue / manager is a subclass whose own
``popleft`` / ``remove`` / ``allocate_slots`` are switched off, so the check measures the
student's code, not the package's. Pure Python, no torch.
"""

from __future__ import annotations

import random

from minipaged.checks._harness import (
    Mismatch,
    check_concept_questions,
    exercise,
    expect_equal,
    expect_equal_to_reference,
    expect_invariants,
    expect_raises,
    expect_true,
    require_callable,
    run_cases,
)
from minipaged.core import BlockPool, BlockTable, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager

CHECKS: dict = {}


class _StudentQueue(FreeKVCacheBlockQueue):
    """The queue handed to the student's code: its own popleft / remove are switched off."""

    def popleft(self):  # noqa: D401
        raise RuntimeError("queue.popleft() is switched off in this check: unlink the block yourself")

    def remove(self, block):
        raise RuntimeError("queue.remove() is switched off in this check: unlink the block yourself")


def _walk(queue: FreeKVCacheBlockQueue, limit: int) -> tuple[list[int], list[int]]:
    """Block ids front-to-back and back-to-front, following the links (cycle-safe)."""
    fwd, b = [], queue._head.next_free_block
    while b is not queue._tail:
        if b is None or len(fwd) > limit:
            raise Mismatch(
                "the forward links (next_free_block) are broken: "
                f"walked {[*fwd[:limit]]} then hit {'None' if b is None else 'a cycle'}"
            )
        fwd.append(b.block_id)
        b = b.next_free_block
    bwd, b = [], queue._tail.prev_free_block
    while b is not queue._head:
        if b is None or len(bwd) > limit:
            raise Mismatch(
                "the backward links (prev_free_block) are broken: "
                f"walked {[*bwd[:limit]]} then hit {'None' if b is None else 'a cycle'}"
            )
        bwd.append(b.block_id)
        b = b.prev_free_block
    return fwd, bwd[::-1]


def _compare_queues(
    step: str, ref: FreeKVCacheBlockQueue, stu: FreeKVCacheBlockQueue, stu_blocks: list[KVCacheBlock]
) -> None:
    ref_ids = [b.block_id for b in ref.get_all_free_blocks()]
    fwd, bwd = _walk(stu, len(stu_blocks) + 1)
    expect_equal(f"after {step}: free queue, front to back", ref_ids, fwd)
    expect_equal(f"after {step}: free queue, back to front (prev links), reversed", ref_ids, bwd)
    expect_equal(f"after {step}: queue.num_free_blocks", ref.num_free_blocks, stu.num_free_blocks)
    free = set(fwd)
    for b in stu_blocks:
        if b.block_id not in free:
            expect_true(
                f"after {step}: block {b.block_id} left the queue but still has links",
                b.prev_free_block is None and b.next_free_block is None,
                "set its prev_free_block and next_free_block to None",
            )


def _queue_cases(exercise_id: str, op_name: str, n_cases: int):
    """Seeded (num_blocks, initial order, ops) for the queue exercises, simulated on the reference."""
    rng = random.Random(exercise_id)
    cases = []
    for _ in range(n_cases):
        n = rng.randint(1, 8)
        order = list(range(n))
        rng.shuffle(order)
        free = list(order)
        ops = []
        for _ in range(rng.randint(1, 12)):
            if op_name == "remove":
                b = rng.randrange(n)
                if b in free:
                    ops.append(("remove", b))
                    free.remove(b)
                elif rng.random() < 0.7:
                    ops.append(("append", b))
                    free.append(b)
                else:
                    ops.append(("remove", b))  # not in the queue: RuntimeError expected
            else:
                taken = [b for b in range(n) if b not in free]
                if taken and rng.random() < 0.4:
                    b = rng.choice(taken)
                    ops.append(("append", b))
                    free.append(b)
                else:
                    ops.append(("popleft", None))  # on an empty queue: ValueError expected
                    if free:
                        free.pop(0)
        cases.append((n, order, ops))
    return cases


def _describe_queue_case(case) -> str:
    n, order, ops = case
    steps = "; ".join(f"{op}()" if b is None else f"{op}(block {b})" for op, b in ops)
    return f"a free queue holding blocks {order} (front first), then: {steps}"


def _twin_queues(n: int, order: list[int]):
    """The same free queue twice: the package's, and one the student's function works on."""
    ref_blocks = [KVCacheBlock(i) for i in range(n)]
    stu_blocks = [KVCacheBlock(i) for i in range(n)]
    ref = FreeKVCacheBlockQueue([ref_blocks[i] for i in order])
    stu = _StudentQueue([stu_blocks[i] for i in order])
    return ref_blocks, ref, stu_blocks, stu


@exercise(CHECKS, "ex2.1", "remove a block from the middle of the free queue")
def check_remove(remove) -> None:
    require_callable("ex2.1", remove, "remove(queue, block)")

    def run_one(case):
        n, order, ops = case
        ref_blocks, ref, stu_blocks, stu = _twin_queues(n, order)
        for k, (op, b) in enumerate(ops):
            step = f"step {k + 1} ({op} block {b})"
            if op == "append":
                ref.append(ref_blocks[b])
                FreeKVCacheBlockQueue.append(stu, stu_blocks[b])
            elif ref_blocks[b] in ref:
                ref.remove(ref_blocks[b])
                result = remove(stu, stu_blocks[b])
                expect_equal(f"{step}: return value of remove", None, result)
            else:
                expect_raises(
                    f"{step}: block {b} is not in the queue", RuntimeError, lambda: remove(stu, stu_blocks[b])
                )
            _compare_queues(step, ref, stu, stu_blocks)

    run_cases(
        "ex2.1",
        _queue_cases("ex2.1", "remove", 300),
        run_one,
        size=lambda c: (len(c[2]), c[0]),
        describe=_describe_queue_case,
    )


@exercise(CHECKS, "ex2.2", "popleft: hand out the least recently freed block")
def check_popleft(popleft) -> None:
    require_callable("ex2.2", popleft, "popleft(queue)")

    def run_one(case):
        n, order, ops = case
        ref_blocks, ref, stu_blocks, stu = _twin_queues(n, order)
        for k, (op, b) in enumerate(ops):
            step = f"step {k + 1} ({op}{'' if b is None else f' block {b}'})"
            if op == "append":
                ref.append(ref_blocks[b])
                FreeKVCacheBlockQueue.append(stu, stu_blocks[b])
            elif ref.num_free_blocks == 0:
                expect_raises(f"{step}: the queue is empty", ValueError, lambda: popleft(stu))
            else:
                expected = ref.popleft()
                got = popleft(stu)
                expect_true(
                    f"{step}: popleft must return a KVCacheBlock",
                    isinstance(got, KVCacheBlock),
                    f"got {got!r}",
                )
                expect_equal(f"{step}: id of the block popleft returned", expected.block_id, got.block_id)
                expect_true(
                    f"{step}: popleft returned a block that is not one of the queue's blocks",
                    got is stu_blocks[got.block_id],
                )
            _compare_queues(step, ref, stu, stu_blocks)

    run_cases(
        "ex2.2",
        _queue_cases("ex2.2", "popleft", 300),
        run_one,
        size=lambda c: (len(c[2]), c[0]),
        describe=_describe_queue_case,
    )


class _StudentManager(KVCacheManager):
    """The manager handed to the student's code: its own allocation methods are switched off."""

    def allocate_slots(self, request, num_new_tokens):
        raise RuntimeError("manager.allocate_slots() is switched off in this check: write it yourself")

    def get_num_blocks_needed(self, request, num_new_tokens):
        raise RuntimeError("manager.get_num_blocks_needed() is switched off in this check")

    def can_allocate(self, request, num_new_tokens):
        raise RuntimeError("manager.can_allocate() is switched off in this check")


def _manager_state(m: KVCacheManager) -> dict:
    return {rid: (t.num_tokens, t.block_ids()) for rid, t in sorted(m.block_tables.items())}


@exercise(CHECKS, "ex2.3", "allocate_slots: grow a block table on demand, all or nothing")
def check_allocate_slots(allocate_slots) -> None:
    require_callable("ex2.3", allocate_slots, "allocate_slots(manager, request_id, num_new_tokens)")
    rng = random.Random("ex2.3")
    cases = []
    for _ in range(250):
        num_blocks = rng.randint(1, 10)
        block_size = rng.choice([1, 2, 3, 4, 8])
        ops, holding = [], set()
        for _ in range(rng.randint(1, 10)):
            rid = f"r{rng.randrange(4)}"
            r = rng.random()
            if rid in holding and r < 0.2:
                ops.append(("free", rid, None))
                holding.discard(rid)
            elif r < 0.27:
                ops.append(("alloc", rid, rng.choice([0, -1])))  # ValueError
            elif r < 0.33:
                ops.append(("alloc", rid, (num_blocks + 1) * block_size))  # never fits: ValueError
            else:
                ops.append(("alloc", rid, rng.randint(1, 2 * block_size + 1)))
                holding.add(rid)  # maybe (the reference decides)
        cases.append((num_blocks, block_size, ops))

    def run_one(case):
        num_blocks, block_size, ops = case
        ref = KVCacheManager(num_blocks, block_size)
        stu = _StudentManager(num_blocks, block_size)
        for k, (op, rid, n) in enumerate(ops):
            step = f"step {k + 1} ({op} {rid}{'' if n is None else f', {n} tokens'})"
            if op == "free":
                if rid in ref.block_tables:
                    ref.free(rid)
                    KVCacheManager.free(stu, rid)
                continue
            try:
                expected = ref.allocate_slots(rid, n)
            except ValueError:
                expect_raises(f"{step}: a caller error", ValueError, lambda: allocate_slots(stu, rid, n))
            else:
                got = allocate_slots(stu, rid, n)
                if expected is None:
                    expect_equal(f"{step}: the pool cannot supply the blocks, so the return value", None, got)
                else:
                    expect_true(
                        f"{step}: allocate_slots must return the list of new KVCacheBlocks",
                        isinstance(got, list) and all(isinstance(b, KVCacheBlock) for b in got),
                        f"got {got!r}",
                    )
                    expect_equal(
                        f"{step}: ids of the new blocks",
                        [b.block_id for b in expected],
                        [b.block_id for b in got],
                    )
            expect_equal(
                f"after {step}: {{request: (num_tokens, block table)}}",
                _manager_state(ref),
                _manager_state(stu),
            )
            expect_invariants(f"after {step}", stu)

    def describe(case):
        num_blocks, block_size, ops = case
        steps = "; ".join(
            f"free({rid!r})" if op == "free" else f"allocate_slots(m, {rid!r}, {n})" for op, rid, n in ops
        )
        return f"m = KVCacheManager(num_blocks={num_blocks}, block_size={block_size}); then: {steps}"

    run_cases("ex2.3", cases, run_one, size=lambda c: (len(c[2]), c[0]), describe=describe)


def ref_slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Via the package: the ``BlockTable`` of these blocks, asked for its slot mapping."""
    pool = BlockPool(max(block_table, default=0) + 1)
    table = BlockTable([pool.blocks[i] for i in block_table], len(block_table) * block_size, block_size)
    return table.slot_mapping(start, end)


@exercise(CHECKS, "ex2.4", "slot mapping: where each token's K/V goes in the flat cache")
def check_slot_mapping(slot_mapping) -> None:
    require_callable("ex2.4", slot_mapping, "slot_mapping(block_table, block_size, start, end)")
    rng = random.Random("ex2.4")
    cases = [([0], 1, 0, 1), ([3], 2, 0, 2), ([2, 0], 2, 1, 3)]
    for _ in range(200):
        block_size = rng.choice([1, 2, 4, 16])
        num_blocks = rng.randint(1, 12)
        table = rng.sample(range(num_blocks * 2), num_blocks)
        cap = num_blocks * block_size
        if rng.random() < 0.12:  # outside the table: ValueError
            start, end = rng.choice([(-1, 1), (0, cap + 1), (2, 1), (cap, cap + 2)])
        else:
            start = rng.randint(0, cap)
            end = rng.randint(start, cap)
        cases.append((table, block_size, start, end))

    def run_one(case):
        table, block_size, start, end = case
        try:
            expected = ref_slot_mapping(table, block_size, start, end)
        except ValueError:
            expect_raises(
                "a token span outside the block table",
                ValueError,
                lambda: slot_mapping(list(table), block_size, start, end),
            )
            return
        got = slot_mapping(list(table), block_size, start, end)
        if not isinstance(got, list):
            got = list(got) if hasattr(got, "__iter__") else got
        expect_equal("slots", expected, got)

    def describe(case):
        table, block_size, start, end = case
        return f"slot_mapping(block_table={table}, block_size={block_size}, start={start}, end={end})"

    run_cases("ex2.4", cases, run_one, size=lambda c: (len(c[0]) * c[1], c[3] - c[2]), describe=describe)


# -- ex2.5: predict the free queue ------------------------------------------------------------

QUEUE_KNOBS = {"num_blocks": 6, "block_size": 2}
# (request id, tokens to add) or (request id, None) = the request finishes and frees its blocks
QUEUE_EVENTS = [("A", 3), ("B", 4), ("A", 2), ("B", None), ("C", 5), ("A", None)]


def _queue_event_text(event) -> str:
    rid, n = event
    return f"{rid} finishes (free)" if n is None else f"{rid} allocates {n} more tokens"


def reference_free_queues():
    """The free queue (front to back) after each event of QUEUE_EVENTS, and the pictures."""
    from minipaged import viz

    kv = KVCacheManager(**QUEUE_KNOBS)
    queues, pictures = [], []
    for rid, n in QUEUE_EVENTS:
        if n is None:
            kv.free(rid)
        elif kv.allocate_slots(rid, n) is None:
            raise RuntimeError(f"checker bug: {rid} does not fit")
        queue = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
        queues.append(queue)
        pictures.append(viz.block_tables_text(kv))
    return queues, pictures


@exercise(CHECKS, "ex2.5", "predict the free queue after each event")
def check_predict_free_queue(predict_free_queue) -> None:
    require_callable("ex2.5", predict_free_queue, "predict_free_queue")
    from minipaged.checks._harness import Mismatch

    queues, pictures = reference_free_queues()

    def run_one(i):
        got = predict_free_queue()
        if not isinstance(got, list) or len(got) != len(QUEUE_EVENTS):
            raise Mismatch(
                f"predict_free_queue() must return a list of {len(QUEUE_EVENTS)} lists, one per event, got {got!r}"
            )
        if not isinstance(got[i], (list, tuple)) or list(got[i]) != queues[i]:
            raise Mismatch(
                f"after event {i} ({_queue_event_text(QUEUE_EVENTS[i])}):\n    expected {queues[i]!r}\n"
                f"    got      {got[i]!r}\n  the manager's picture after this event:\n"
                + "\n".join("    " + ln for ln in pictures[i].splitlines())
            )

    run_cases(
        "ex2.5",
        range(len(QUEUE_EVENTS)),
        run_one,
        describe=lambda i: "events 0..{}: {}".format(
            i, "; ".join(map(_queue_event_text, QUEUE_EVENTS[: i + 1]))
        ),
    )


# -- ex2.6: how many requests fit, measured --------------------------------------------------

# final lengths (prompt + output) of a workload, long-tailed like chat traffic
FIT_LENS = [
    37, 512, 129, 18, 260, 75, 1020, 44, 301, 96, 13, 640, 210, 58, 150, 33, 870, 120, 66, 405,
    27, 188, 91, 350, 12, 700, 240, 81, 49, 164,
]  # fmt: skip
FIT_SLOTS = 4096  # slots of the pool, whatever the block size
FIT_BLOCK_SIZES = (1, 4, 16, 64, 256)


def ref_max_concurrent(seq_lens, num_blocks: int, block_size: int) -> int:
    if any(not isinstance(n, int) or n < 1 for n in seq_lens):
        raise ValueError(f"seq_lens must be positive ints, got {seq_lens!r}")
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    for k, n in enumerate(seq_lens):
        if -(-n // block_size) > num_blocks or kv.allocate_slots(f"r{k}", n) is None:
            return k  # NOTE: the manager raises for a request larger than the whole pool
    return len(seq_lens)


@exercise(CHECKS, "ex2.6", "how many requests fit in a paged pool (measure)")
def check_max_concurrent(max_concurrent) -> None:
    require_callable("ex2.6", max_concurrent, "max_concurrent(seq_lens, num_blocks, block_size)")
    from minipaged.checks._harness import _print, _redirect_stdout, _StringIO

    rng = random.Random("ex2.6")
    cases = [([5, 3, 4], 4, 2), ([1], 1, 1), ([3, 3], 2, 2), ([], 3, 4)]
    for _ in range(120):
        n = rng.randint(0, 10)
        cases.append(
            ([rng.randint(1, 40) for _ in range(n)], rng.randint(1, 24), rng.choice([1, 2, 4, 8, 16]))
        )
    cases += [([3, 0, 2], 8, 2), ([4, -1], 8, 2)]

    def run_one(c):
        lens, nb, bs = c
        expect_equal_to_reference(
            "requests that fit (a prefix of seq_lens)",
            lambda: ref_max_concurrent(lens, nb, bs),
            lambda: max_concurrent(list(lens), nb, bs),
        )

    verdict = _StringIO()
    with _redirect_stdout(verdict):
        run_cases(
            "ex2.6",
            cases,
            run_one,
            size=lambda c: (any(n < 1 for n in c[0]), len(c[0]), c[1]),
            describe=lambda c: f"max_concurrent(seq_lens={c[0]}, num_blocks={c[1]}, block_size={c[2]})",
        )
    fits = {bs: max_concurrent(list(FIT_LENS), FIT_SLOTS // bs, bs) for bs in FIT_BLOCK_SIZES}
    _print(
        f"FIT_LENS in {FIT_SLOTS} slots: "
        + ", ".join(f"block_size {bs}: {n} requests" for bs, n in fits.items())
    )
    _print(verdict.getvalue(), end="")


# -- ex2.7: concept questions ----------------------------------------------------------------

CONCEPT_KEY = {
    "q1": ("slot of token 5 with block_table [3, 1, 4] and block_size 4", 6, 0.0),
    "q2": ("blocks a request holds after allocating 3, then 2 more tokens, with block_size 2", 3, 0.0),
    "q3": (
        "which end of the free queue does a new block come from: 'front' or 'back'",
        "front",
        "choice",
    ),
    "q4": (
        "the largest block size of FIT_BLOCK_SIZES that still fits as many FIT_LENS requests as block_size 1",
        None,
        0.0,
    ),
}


def _concept_key():
    key = dict(CONCEPT_KEY)
    best = ref_max_concurrent(FIT_LENS, FIT_SLOTS, 1)
    q, _, how = key["q4"]
    ok = [bs for bs in FIT_BLOCK_SIZES if ref_max_concurrent(FIT_LENS, FIT_SLOTS // bs, bs) == best]
    key["q4"] = (q, max(ok), how)
    return key


@exercise(CHECKS, "ex2.7", "concept questions (numbers and choices)")
def check_concept_answers(concept_answers) -> None:
    check_concept_questions("ex2.7", concept_answers, _concept_key())


__all__ = [
    "CHECKS",
    "FIT_BLOCK_SIZES",
    "FIT_LENS",
    "FIT_SLOTS",
    "QUEUE_EVENTS",
    "QUEUE_KNOBS",
    "ref_slot_mapping",
]
