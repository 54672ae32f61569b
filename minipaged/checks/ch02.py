"""Checkers for chapter 02 exercises: the free queue, block tables, slot mapping.

Exercises (notebooks/exercises/ch02_block_tables.ipynb)
    ex2.1 ``remove(queue, block)``: unlink a block from the middle of the free queue, O(1).
    ex2.2 ``popleft(queue)``: take the least recently freed block.
    ex2.3 ``allocate_slots(manager, request_id, num_new_tokens)``: grow a block table on
          demand, all or nothing.
    ex2.4 ``slot_mapping(block_table, block_size, start, end)``: the flat cache slot of
          each token.
    ex2.5 predict the free queue (a per-student workload); ex2.6 measure how many requests
    fit; ex2.7 concept questions (answers in the instructor's key only).

Each exercise is a spec (``minipaged.checks._spec``): seeded operation sequences as plain
data; ``observe`` builds the queue / manager a case describes, runs the student's function
on it and returns what can be seen afterwards (the links walked both ways, the counter,
the block tables, what each call returned or raised); the trusted side runs the same
``observe`` with the package's own method and compares. The queue / manager handed to the
student's code has its own ``popleft`` / ``remove`` / ``allocate_slots`` switched off.
Pure Python, no torch.
"""

from __future__ import annotations

from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.core import BlockPool, BlockTable, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager


class _StudentQueue(FreeKVCacheBlockQueue):
    """The queue handed to the student's code: its own popleft / remove are switched off."""

    def popleft(self):  # noqa: D401
        raise RuntimeError("queue.popleft() is switched off in this check: unlink the block yourself")

    def remove(self, block):
        raise RuntimeError("queue.remove() is switched off in this check: unlink the block yourself")


SPECS: dict = {}


def _walk(queue: FreeKVCacheBlockQueue, limit: int):
    """Block ids front-to-back and back-to-front (reversed), following the links (cycle-safe);
    a broken chain is reported as data: ``"broken after [ids]"``."""
    fwd, b = [], queue._head.next_free_block
    while b is not queue._tail:
        if type(b) is not KVCacheBlock or len(fwd) > limit:
            fwd = f"broken after {fwd[:limit]}"
            break
        fwd.append(b.block_id)
        b = b.next_free_block
    bwd, b = [], queue._tail.prev_free_block
    while b is not queue._head:
        if type(b) is not KVCacheBlock or len(bwd) > limit:
            bwd = f"broken after {bwd[:limit]}"
            break
        bwd.append(b.block_id)
        b = b.prev_free_block
    return fwd, bwd[::-1] if isinstance(bwd, list) else bwd


def _queue_state(queue: FreeKVCacheBlockQueue, blocks: list[KVCacheBlock]) -> dict:
    fwd, bwd = _walk(queue, len(blocks) + 1)
    free = set(fwd) if isinstance(fwd, list) else set()
    stale = [
        b.block_id
        for b in blocks
        if b.block_id not in free and (b.prev_free_block is not None or b.next_free_block is not None)
    ]
    n = queue.num_free_blocks
    return {
        "free queue, front to back": fwd,
        "free queue, back to front (prev links), reversed": bwd,
        "queue.num_free_blocks": n if type(n) is int else repr(n),
        "blocks out of the queue that still have links": stale,
    }


def _block_id(block, blocks: list[KVCacheBlock]):
    """A returned block as data: its id when it is one of the queue's own blocks."""
    if type(block) is KVCacheBlock and type(block.block_id) is int and 0 <= block.block_id < len(blocks):
        if block is blocks[block.block_id]:
            return block.block_id
    return {"not one of the queue's blocks": type(block).__name__}


def _queue_cases(rng, op_name: str, n_cases: int):
    """(num_blocks, initial order, ops) for the queue exercises."""
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


def _student_queue(n: int, order: list[int]):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, _StudentQueue([blocks[i] for i in order])


def observe_remove(case, remove) -> list:
    n, order, ops = case
    blocks, queue = _student_queue(n, order)
    steps = []
    for op, b in ops:
        if op == "append":
            FreeKVCacheBlockQueue.append(queue, blocks[b])
            call = None
        else:
            call = attempt(lambda: remove(queue, blocks[b]))
        steps.append({"call": call, **_queue_state(queue, blocks)})
    return steps


def observe_popleft(case, fn) -> list:
    """The returned block is recorded as its id, when it is one of the queue's own blocks."""
    n, order, ops = case
    blocks, queue = _student_queue(n, order)
    steps = []
    for op, b in ops:
        call = None
        if op == "append":
            FreeKVCacheBlockQueue.append(queue, blocks[b])
        else:
            box = []
            call = attempt(lambda: box.append(fn(queue)))
            if "returned" in call:
                call = {"returned block": _block_id(box[0], blocks)}
        steps.append({"call": call, **_queue_state(queue, blocks)})
    return steps


def _ref_popleft(queue: FreeKVCacheBlockQueue) -> KVCacheBlock:
    """The package's ``popleft``, on a queue whose own ``remove`` is switched off."""
    block = queue._head.next_free_block
    if block is queue._tail or block is None:
        raise ValueError("no free blocks left")
    FreeKVCacheBlockQueue.remove(queue, block)
    return block


def _size_queue(c):
    return (len(c[2]), c[0])


register(
    SPECS,
    Spec(
        "ex2.1",
        "remove a block from the middle of the free queue",
        "remove(queue, block)",
        cases=lambda rng: _queue_cases(rng, "remove", 300),
        observe=observe_remove,
        reference=lambda: (lambda q, b: FreeKVCacheBlockQueue.remove(q, b),),
        describe=_describe_queue_case,
        size=_size_queue,
    ),
)
register(
    SPECS,
    Spec(
        "ex2.2",
        "popleft: hand out the least recently freed block",
        "popleft(queue)",
        cases=lambda rng: _queue_cases(rng, "popleft", 300),
        observe=observe_popleft,
        reference=lambda: (_ref_popleft,),
        describe=_describe_queue_case,
        size=_size_queue,
    ),
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
    return {rid: [t.num_tokens, t.block_ids()] for rid, t in sorted(m.block_tables.items())}


def _allocate_cases(rng):
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
    return cases


def observe_allocate_slots(case, allocate_slots) -> list:
    num_blocks, block_size, ops = case
    m = _StudentManager(num_blocks, block_size)
    steps = []
    for op, rid, n in ops:
        if op == "free":
            if rid in m.block_tables:
                KVCacheManager.free(m, rid)
            continue
        box = []
        call = attempt(lambda: box.append(allocate_slots(m, rid, n)))
        if "returned" in call:
            got = box[0]
            if got is None:
                call = {"returned": None}
            elif type(got) is list and all(type(b) is KVCacheBlock for b in got):
                call = {"returned new blocks": [b.block_id for b in got]}
            else:
                call = {"returned": {"not a list of KVCacheBlocks": type(got).__name__}}
        try:
            m.check_invariants()
            inv = "hold"
        except AssertionError as e:
            inv = {"broken": True, "_message": str(e)[:300]}
        steps.append(
            {"call": call, "{request: [num_tokens, block ids]}": _manager_state(m), "invariants": inv}
        )
    return steps


def _describe_allocate(case):
    num_blocks, block_size, ops = case
    steps = "; ".join(
        f"free({rid!r})" if op == "free" else f"allocate_slots(m, {rid!r}, {n})" for op, rid, n in ops
    )
    return f"m = KVCacheManager(num_blocks={num_blocks}, block_size={block_size}); then: {steps}"


register(
    SPECS,
    Spec(
        "ex2.3",
        "allocate_slots: grow a block table on demand, all or nothing",
        "allocate_slots(manager, request_id, num_new_tokens)",
        cases=_allocate_cases,
        observe=observe_allocate_slots,
        reference=lambda: (lambda m, rid, n: KVCacheManager.allocate_slots(m, rid, n),),
        describe=_describe_allocate,
        size=lambda c: (len(c[2]), c[0]),
    ),
)


def ref_slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Via the package: the ``BlockTable`` of these blocks, asked for its slot mapping."""
    pool = BlockPool(max(block_table, default=0) + 1)
    table = BlockTable([pool.blocks[i] for i in block_table], len(block_table) * block_size, block_size)
    return table.slot_mapping(start, end)


def _slot_cases(rng):
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
    return cases


def observe_slot_mapping(case, slot_mapping):
    table, block_size, start, end = case
    return attempt(lambda: slot_mapping(list(table), block_size, start, end))


register(
    SPECS,
    Spec(
        "ex2.4",
        "slot mapping: where each token's K/V goes in the flat cache",
        "slot_mapping(block_table, block_size, start, end)",
        cases=_slot_cases,
        observe=observe_slot_mapping,
        reference=lambda: (ref_slot_mapping,),
        describe=lambda c: f"slot_mapping(block_table={c[0]}, block_size={c[1]}, start={c[2]}, end={c[3]})",
        size=lambda c: (len(c[0]) * c[1], c[3] - c[2]),
    ),
)


# -- ex2.5: predict the free queue (one workload per student) --------------------------------

QUEUE_KNOBS = {"num_blocks": 6, "block_size": 2}
# (request id, tokens to add) or (request id, None) = the request finishes and frees its blocks
QUEUE_EVENTS = [("A", 3), ("B", 4), ("A", 2), ("B", None), ("C", 5), ("A", None)]


def queue_event_text(event) -> str:
    rid, n = event
    return f"{rid} finishes (free)" if n is None else f"{rid} allocates {n} more tokens"


def reference_free_queues(events=QUEUE_EVENTS, knobs=QUEUE_KNOBS) -> list[list[int]]:
    """The free queue (front to back) after each event."""
    kv = KVCacheManager(**knobs)
    queues = []
    for rid, n in events:
        if n is None:
            kv.free(rid)
        elif kv.allocate_slots(rid, n) is None:
            raise RuntimeError(f"checker bug: {rid} does not fit")
        queues.append([b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()])
    return queues


def queue_events_variant(rng) -> list:
    """Six events that all fit a fresh ``QUEUE_KNOBS`` pool, at least one free, drawn by ``rng``."""
    while True:
        kv = KVCacheManager(**QUEUE_KNOBS)
        events, ok = [], True
        for k in range(6):
            holding = sorted(kv.block_tables)
            if holding and (k >= 2 and rng.random() < 0.35):
                rid = rng.choice(holding)
                kv.free(rid)
                events.append((rid, None))
                continue
            rid = rng.choice(["A", "B", "C", "D"])
            n = rng.randint(1, 5)
            try:
                got = kv.allocate_slots(rid, n)
            except ValueError:
                got = None
            if got is None:
                ok = False
                break
            events.append((rid, n))
        if ok and any(n is None for _, n in events):
            return events


def _queue_prediction_cases(rng):
    # NOTE: rng is None for the shipped notebook (the events of its setup cell); a student
    # copy made with --seed gets the events its seed draws, written into its setup cell
    return [QUEUE_EVENTS if rng is None else queue_events_variant(rng)]


def observe_prediction(case, fn):
    return fn()


register(
    SPECS,
    Spec(
        "ex2.5",
        "predict the free queue after each event",
        "predict_free_queue()",
        cases=_queue_prediction_cases,
        observe=observe_prediction,
        expected=lambda case, key: reference_free_queues([tuple(e) for e in case]),
        describe=lambda c: "the events of QUEUE_EVENTS: " + "; ".join(queue_event_text(e) for e in c),
        kind="prediction",
    ),
)
VARIANTS = {"ex2.5": ("QUEUE_EVENTS", queue_event_text)}


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


def _fit_cases(rng):
    cases = [([5, 3, 4], 4, 2), ([1], 1, 1), ([3, 3], 2, 2), ([], 3, 4)]
    for _ in range(120):
        n = rng.randint(0, 10)
        cases.append(
            ([rng.randint(1, 40) for _ in range(n)], rng.randint(1, 24), rng.choice([1, 2, 4, 8, 16]))
        )
    return cases + [([3, 0, 2], 8, 2), ([4, -1], 8, 2)]


def _fit_report(max_concurrent) -> str:
    fits = {bs: max_concurrent(list(FIT_LENS), FIT_SLOTS // bs, bs) for bs in FIT_BLOCK_SIZES}
    return (
        f"FIT_LENS in {FIT_SLOTS} slots: "
        + ", ".join(f"block_size {bs}: {n} requests" for bs, n in fits.items())
        + "\n"
    )


register(
    SPECS,
    Spec(
        "ex2.6",
        "how many requests fit in a paged pool (measure)",
        "max_concurrent(seq_lens, num_blocks, block_size)",
        cases=_fit_cases,
        observe=lambda c, fn: attempt(lambda: fn(list(c[0]), c[1], c[2])),
        reference=lambda: (ref_max_concurrent,),
        describe=lambda c: f"max_concurrent(seq_lens={c[0]}, num_blocks={c[1]}, block_size={c[2]})",
        size=lambda c: (any(n < 1 for n in c[0]), len(c[0]), c[1]),
        report=_fit_report,
    ),
)


# -- ex2.7: concept questions (the answers are in the instructor's key) ---------------------

# NOTE: a list is one question's variants, one drawn per student (variant 0: the shipped
# notebook's); the key holds one answer per variant
QUESTIONS = {
    "q1": [
        ("slot of token 5 with block_table [3, 1, 4] and block_size 4", None),
        ("the flat slot of token 6 with `block_table = [2, 5, 0]` and `block_size = 4`?", None),
        ("the flat slot of token 9 with `block_table = [7, 2, 3]` and `block_size = 4`?", None),
    ],
    "q2": [
        ("blocks a request holds after allocating 3, then 2 more tokens, with block_size 2", None),
        (
            "how many blocks does a request hold after allocating 7 tokens and then 6 more, "
            "with `block_size = 4`?",
            None,
        ),
        (
            "how many blocks does a request hold after allocating 4 tokens and then 5 more, "
            "with `block_size = 2`?",
            None,
        ),
    ],
    "q3": ("which end of the free queue does a new block come from", ("front", "back")),
    "q4": (
        "the largest block size of FIT_BLOCK_SIZES that still fits as many FIT_LENS requests as block_size 1",
        None,
    ),
}
register(SPECS, concept_spec("ex2.7", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "FIT_BLOCK_SIZES",
    "FIT_LENS",
    "FIT_SLOTS",
    "QUEUE_EVENTS",
    "QUEUE_KNOBS",
    "SPECS",
    "VARIANTS",
    "ref_slot_mapping",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex2.1": ("minipaged.core.kv.block:FreeKVCacheBlockQueue.remove",),
    "ex2.2": ("minipaged.core.kv.block:FreeKVCacheBlockQueue.popleft",),
    "ex2.3": (
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.allocate_slots",
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.allocate_slots",
    ),
    "ex2.4": (
        "minipaged.core.kv.block_table:BlockTable.slot_mapping",
        "minipaged.core.kv.block_table:BlockTable.slot",
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.get_slot_mapping",
    ),
    "ex2.5": (
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.allocate_slots",
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.allocate_slots",
    ),
    "ex2.6": (
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.allocate_slots",
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.allocate_slots",
    ),
    "ex2.7": (
        "minipaged.core.kv.block_table:BlockTable.slot",
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.allocate_slots",
    ),
}
set_answered_by(SPECS, ANSWERED_BY)
