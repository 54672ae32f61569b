"""Checkers for chapter 06 exercises: sharing blocks.

Exercises (notebooks/exercises/ch06_sharing.ipynb)
    ex6.1 ``fork(kv_cache_manager, parent_id, child_id)``: the child shares every block of
          the parent (each block's ``ref_cnt`` + 1), like pages after ``fork()``.
    ex6.2 ``append_slot(kv_cache_manager, request_id)``: room for one more token, with
          copy-on-write when the last block is shared and partly filled.
    ex6.3 ``block_hashes(token_ids, block_size)``: the chained hash of every full block.
    ex6.4 ``find_cached_blocks(block_pool, token_ids, block_size)``: the prefix-cache
          lookup: the cached blocks of the longest cached prefix (at most
          ``len(token_ids) - 1`` tokens, so the last token is always computed).
    ex6.5 ``predict_sharing()`` -> per event of ``SHARE_EVENTS`` the block tables and the
          ``ref_cnt`` of every held block (a prediction), compared with a live
          ``BlockSpaceManager``.
    ex6.6 ``blocks_with_sharing(prompt_len, output_lens, block_size)``: blocks in use after
          parallel sampling with fork and copy-on-write, checked against the manager; the
          local check then prints the measured saving over unshared sequences.
    ex6.7 ``concept_answers()``: the end-of-chapter questions with a number or a choice.

Each exercise is a spec (``minipaged.checks._spec``). Inputs are plain data: operation
sequences on a manager (``("alloc", id, n)``, ``("fork", parent, child)``, ``("append",
id)``, ``("free", id)``, and forks that must raise), prompts with a cache history, token
lists. ``observe`` builds the manager / pool a case describes in the student's kernel (its
own ``fork`` and ``allocate_slots`` switched off), runs the operations, calling the
student's function for the exercise's one (the other operations are written out in
``observe`` over the pool: the student build strips the package's ``fork`` and
``allocate_slots``, and ex6.1 does not depend on the student's ex6.2, nor ex6.2 on ex6.1;
ex6.4's pool is cached with the chained hashes written out, whatever the student's ex6.3),
and returns after each operation what the call returned (or raised), every block table,
every ``ref_cnt``, the free queue and whether ``check_invariants`` holds. The trusted side runs the same ``observe`` with the package's
``BlockSpaceManager`` (``fork``; ``allocate_slots`` of one token, whose copy-on-write
records the ``(src, dst)`` pair ``take_pending_copies`` hands over; the chained
``_block_hashes``) and compares. ``ref_fork`` / ``ref_append_slot`` / ``ref_block_hashes``
/ ``ref_find_cached_blocks`` are the same rules written out over ``BlockPool`` alone
(tests/grading/test_checks.py checks they agree with the package). ex6.5 is judged against a live
manager on the trusted side (one event list per student); its failure messages name the
first wrong event, never the answer. Failure mode: the student's code raising becomes
data; a result that is not plain data of the stated shape is wrong.
"""

from __future__ import annotations

from typing import Optional

from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.core import BlockPool, BlockSpaceManager, BlockTable, KVCacheBlock, Request, hash_block_tokens

SPECS: dict = {}


# -- references ----------------------------------------------------------------------------


def ref_fork(m: BlockSpaceManager, parent_id: str, child_id: str) -> None:
    if parent_id not in m.block_tables:
        raise ValueError(f"unknown parent {parent_id!r}")
    if child_id in m.block_tables:
        raise ValueError(f"{child_id!r} already has blocks")
    parent = m.block_tables[parent_id]
    blocks = list(parent.blocks)  # NOTE: a new list: the tables diverge later
    m.block_pool.touch(blocks)
    m.block_tables[child_id] = BlockTable(blocks, parent.num_tokens, m.block_size)


def ref_append_slot(m: BlockSpaceManager, request_id: str) -> Optional[list[tuple[int, int]]]:
    if request_id not in m.block_tables:
        raise ValueError(f"unknown request {request_id!r}")
    t = m.block_tables[request_id]
    table, n, bs = t.blocks, t.num_tokens, m.block_size
    if n % bs == 0:  # the last block is full: the new token starts a new block
        if m.block_pool.get_num_free_blocks() == 0:
            return None
        table.extend(m.block_pool.get_new_blocks(1))
        t.num_tokens = n + 1
        return []
    last = table[-1]
    if last.ref_cnt == 1:  # ours alone: write in place
        t.num_tokens = n + 1
        return []
    # shared and partly filled: copy on write
    if m.block_pool.get_num_free_blocks() == 0:
        return None
    new = m.block_pool.get_new_blocks(1)[0]
    m.block_pool.free_blocks([last])  # drops our reference only; the others keep it
    table[-1] = new
    t.num_tokens = n + 1
    return [(last.block_id, new.block_id)]


def ref_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes, parent = [], None
    for j in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[j * block_size : (j + 1) * block_size])
        hashes.append(parent)
    return hashes


def ref_find_cached_blocks(pool: BlockPool, token_ids: list[int], block_size: int) -> list[KVCacheBlock]:
    hits = []
    max_blocks = (len(token_ids) - 1) // block_size  # NOTE: the last token is always computed
    for h in ref_block_hashes(token_ids, block_size)[:max_blocks]:
        block = pool.get_cached_block(h)
        if block is None:
            break
        hits.append(block)
    return hits


def pkg_append_slot(m: BlockSpaceManager, request_id: str) -> Optional[list[tuple[int, int]]]:
    """The package's way: ``allocate_slots`` of one token, then the copies it recorded.

    NOTE: called through the class, so it also works on the student's manager, whose own
    ``allocate_slots`` is switched off.
    """
    if BlockSpaceManager.allocate_slots(m, request_id, 1) is None:
        return None
    return BlockSpaceManager.take_pending_copies(m)


def pkg_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    if len(token_ids) < block_size:
        return []
    manager = BlockSpaceManager(1, block_size)
    return list(manager._block_hashes(Request("q", list(token_ids)), len(token_ids) // block_size))


# -- ex6.1 / ex6.2: operation sequences on a manager ---------------------------------------


class _StudentManager(BlockSpaceManager):
    """Switches off the package's own sharing methods (if it has them) for the student's code."""

    def fork(self, *args, **kwargs):
        raise RuntimeError("kv_cache_manager.fork() is switched off in this check: write it yourself")

    def allocate_slots(self, *args, **kwargs):
        raise RuntimeError(
            "kv_cache_manager.allocate_slots() is switched off in this check "
            "(it does copy-on-write itself): write it with the block pool"
        )


def _mstate(m: BlockSpaceManager) -> dict:
    try:
        m.check_invariants()
        inv = "hold"
    except AssertionError as e:
        inv = {"broken": True, "_message": str(e)[:300]}
    return {
        "{request: [num_tokens, block table]}": {
            rid: [t.num_tokens, t.block_ids()] for rid, t in sorted(m.block_tables.items())
        },
        "ref_cnt of blocks 0, 1, 2, ...": [b.ref_cnt for b in m.block_pool.blocks],
        "the free queue, front to back": [
            b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()
        ],
        "invariants (ref_cnt = tables holding a block; free queue = ref_cnt 0)": inv,
    }


def _sharing_cases(rng, n: int, focus: str) -> list:
    """(num_blocks, block_size, ops); ops: ("alloc", rid, n) | ("fork", parent, child) |
    ("append", rid) | ("free", rid) | ("fork?", parent, child) (a fork that must raise)."""
    cases = []
    for _ in range(n):
        num_blocks = rng.randint(2, 10)
        block_size = rng.choice([1, 2, 3, 4])
        m = BlockSpaceManager(num_blocks, block_size)  # simulated to keep ops valid
        ops, k = [], 0
        for _ in range(rng.randint(1, 10)):
            holders = sorted(m.block_tables)
            r = rng.random()
            if not holders or r < 0.2:
                rid = f"r{k}"
                want = rng.randint(1, 2 * block_size + 1)
                if (
                    m.get_num_blocks_needed(rid, want) <= m.get_num_free_blocks()
                    and want <= num_blocks * block_size
                ):
                    m.allocate_slots(rid, want)
                    ops.append(("alloc", rid, want))
                    k += 1
            elif r < 0.5:
                parent, child = rng.choice(holders), f"r{k}"
                k += 1
                m.fork(parent, child)
                ops.append(("fork", parent, child))
            elif r < 0.58 and focus == "fork":
                bad = rng.choice(
                    [("fork?", f"x{k}", f"r{k + 1}"), ("fork?", rng.choice(holders), rng.choice(holders))]
                )
                ops.append(bad)
            elif r < 0.9:
                rid = rng.choice(holders)
                if -(-(m.block_tables[rid].num_tokens + 1) // block_size) <= num_blocks:
                    pkg_append_slot(m, rid)
                    ops.append(("append", rid))
            else:
                rid = rng.choice(holders)
                m.free(rid)
                ops.append(("free", rid))
        cases.append((num_blocks, block_size, ops))
    return cases


def _describe_ops(case) -> str:
    num_blocks, block_size, ops = case
    words = {
        "alloc": lambda o: f"allocate_slots({o[1]!r}, {o[2]})",
        "fork": lambda o: f"fork({o[1]!r} -> {o[2]!r})",
        "fork?": lambda o: f"fork({o[1]!r} -> {o[2]!r}) [must raise ValueError]",
        "append": lambda o: f"append_slot({o[1]!r})",
        "free": lambda o: f"free({o[1]!r})",
    }
    return (
        f"BlockSpaceManager(num_blocks={num_blocks}, block_size={block_size}), then: "
        + "; ".join(words[o[0]](o) for o in ops)
        + "\n  (step [i] of the result is the state after operation i)"
    )


def _run_ops(case, student_fn, exercise: str) -> list:
    """Run the ops on a manager whose own fork / allocate_slots are off; the state after each.

    ``exercise``: ``"fork"`` (ex6.1: ``student_fn`` does the forks) or ``"append"`` (ex6.2:
    it does the appends); the reference side passes the package's (``BlockSpaceManager.fork``,
    ``pkg_append_slot``).

    NOTE: the other operations are written out here, not called: in the student build the
    package's ``fork`` and ``allocate_slots`` are stripped (they answer ex6.1 and ex6.2), and
    ex6.1 must not depend on the student's ex6.2, nor ex6.2 on their ex6.1.
    """
    num_blocks, block_size, ops = case
    m = _StudentManager(num_blocks, block_size)
    pool = m.block_pool
    steps = []
    for op in ops:
        kind, call = op[0], None
        if kind == "alloc":  # a new request: its blocks straight from the pool
            m.block_tables[op[1]] = BlockTable(
                pool.get_new_blocks(-(-op[2] // block_size)), op[2], block_size
            )
        elif kind == "free":
            BlockSpaceManager.free(m, op[1])
        elif kind in ("fork", "fork?"):
            if exercise == "fork":
                call = attempt(lambda: student_fn(m, op[1], op[2]))
                child, parent = m.block_tables.get(op[2]), m.block_tables.get(op[1])
                if kind == "fork" and child is not None and parent is not None:
                    call["the child's block list is a list of its own"] = not (
                        child is parent or child.blocks is parent.blocks
                    )
            else:  # the child shares the parent's blocks ("fork?" is only in ex6.1's cases)
                parent = m.block_tables[op[1]]
                pool.touch(parent.blocks)
                m.block_tables[op[2]] = BlockTable(list(parent.blocks), parent.num_tokens, block_size)
        elif exercise == "append":
            call = attempt(lambda: student_fn(m, op[1]))
            call = {"copies to do, [(src block, dst block)] (None = no free block)": call}
        else:  # one more token: a new block when the last is full, a copy when it is shared
            t = m.block_tables[op[1]]
            full, shared = t.num_tokens % block_size == 0, t.blocks[-1].ref_cnt > 1
            if (full or shared) and pool.get_num_free_blocks() == 0:
                pass  # no room: nothing changes (the package's allocate_slots returns None)
            elif full:
                t.blocks.extend(pool.get_new_blocks(1))
                t.num_tokens += 1
            else:
                if shared:
                    old, t.blocks[-1] = t.blocks[-1], pool.get_new_blocks(1)[0]
                    pool.free_blocks([old])
                t.num_tokens += 1
        steps.append({"call": call, **_mstate(m)})
    return steps


def _sharing_spec(exercise_id, title, signature, focus, observe, reference):
    return Spec(
        exercise_id,
        title,
        signature,
        cases=lambda rng: _sharing_cases(rng, 250, focus=focus),
        observe=observe,
        reference=reference,
        describe=_describe_ops,
        size=lambda c: (len(c[2]), c[0]),
    )


register(
    SPECS,
    _sharing_spec(
        "ex6.1",
        "fork: the child shares every block of the parent",
        "fork(kv_cache_manager, parent_id, child_id)",
        "fork",
        observe=lambda case, fork: _run_ops(case, fork, "fork"),
        # NOTE: keywords: the student build withholds a ``reference=`` (a positional one stays)
        reference=lambda: (lambda m, p, c: BlockSpaceManager.fork(m, p, c),),
    ),
)
register(
    SPECS,
    _sharing_spec(
        "ex6.2",
        "append_slot with copy-on-write",
        "append_slot(kv_cache_manager, request_id)",
        "append",
        observe=lambda case, append_slot: _run_ops(case, append_slot, "append"),
        reference=lambda: (pkg_append_slot,),
    ),
)


# -- ex6.3 -------------------------------------------------------------------------------


def _hash_cases(rng):
    cases = [([], 4), ([5], 1), ([1, 2, 3], 4), ([1, 2, 3, 4], 2)]
    for _ in range(150):
        bs = rng.choice([1, 2, 3, 4, 16])
        cases.append(([rng.randrange(100) for _ in range(rng.randint(0, 40))], bs))
    return cases


def observe_block_hashes(case, fn):
    tokens, bs = case
    box = []
    call = attempt(lambda: box.append(fn(list(tokens), bs)))
    if "returned" not in call:
        return call
    got = box[0]
    if type(got) is not list:
        return {"returned": {"not a list": type(got).__name__}}
    return {
        "returned hashes (hex)": [
            h.hex() if type(h) is bytes else {"not bytes": type(h).__name__} for h in got
        ]
    }


register(
    SPECS,
    Spec(
        "ex6.3",
        "the chained hash of every full block",
        "block_hashes(token_ids, block_size)",
        cases=_hash_cases,
        observe=observe_block_hashes,
        reference=lambda: (pkg_block_hashes,),
        describe=lambda c: f"block_hashes(token_ids={c[0]}, block_size={c[1]})",
        size=lambda c: (len(c[0]), c[1]),
    ),
)


# -- ex6.4 -------------------------------------------------------------------------------


def _prefix_cases(rng, n: int = 200) -> list[dict]:
    cases = []
    for _ in range(n):
        bs = rng.choice([1, 2, 4])
        stems = [[rng.randrange(50) for _ in range(rng.randint(1, 4) * bs)] for _ in range(rng.randint(1, 3))]

        def prompt():
            stem = rng.choice(stems)
            cut = rng.randint(0, len(stem))
            return stem[:cut] + [rng.randrange(50) for _ in range(rng.randint(0, 2 * bs + 1))] or [1]

        history = []  # earlier requests: (prompt, keep holding its blocks?)
        for _ in range(rng.randint(1, 5)):
            history.append((prompt(), rng.random() < 0.3))
        queries = [prompt() for _ in range(rng.randint(1, 4))]
        queries.append(list(rng.choice(history)[0]))  # the exact same prompt again
        cases.append(dict(num_blocks=rng.randint(3, 14), block_size=bs, history=history, queries=queries))
    return cases


def _build_pool(c: dict) -> BlockSpaceManager:
    """A caching manager after the history ran: each earlier request took blocks from the
    pool, cached its full ones, and released them unless it still holds them (evicting
    LRU when the pool ran short). The student's code gets its ``block_pool``."""
    manager = BlockSpaceManager(c["num_blocks"], c["block_size"], enable_caching=True)
    pool = manager.block_pool
    bs = c["block_size"]
    for tokens, keep in c["history"]:
        need = -(-len(tokens) // bs)
        if need > pool.get_num_free_blocks():
            continue
        blocks = pool.get_new_blocks(need)
        # NOTE: the chained hashes written out (``ref_block_hashes`` answers ex6.3: here the
        # pool is the same whatever the student's ex6.3 does)
        h = None
        for j, block in enumerate(blocks[: len(tokens) // bs]):
            h = hash_block_tokens(h, tokens[j * bs : (j + 1) * bs])
            pool.cache_block(block, h)
        if not keep:
            pool.free_blocks(reversed(blocks))
    return manager


def _pool_state(pool: BlockPool) -> dict:
    return {
        "ref_cnt of blocks 0, 1, 2, ...": [b.ref_cnt for b in pool.blocks],
        "the free queue, front to back": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "cached block ids": sorted(b.block_id for b in pool.cached_block_hash_to_block.values()),
    }


def observe_find_cached_blocks(c, fn) -> list:
    pool = _build_pool(c).block_pool
    out = []
    for q in c["queries"]:
        box = []
        call = attempt(lambda: box.append(fn(pool, list(q), c["block_size"])))
        if "returned" in call:
            got = box[0]
            if type(got) is list and all(type(b) is KVCacheBlock for b in got):
                ids = [b.block_id for b in got]
                own = all(
                    type(i) is int and 0 <= i < len(pool.blocks) and pool.blocks[i] is b
                    for i, b in zip(ids, got)
                )
                call = {"returned block ids": ids if own else {"not the pool's own block objects": ids}}
            else:
                call = {"returned": {"not a list of KVCacheBlock": type(got).__name__}}
        out.append({"call": call, "the pool after the lookup (a lookup changes nothing)": _pool_state(pool)})
    return out


def _describe_prefix(c) -> str:
    hist = "; ".join(f"{t}{' (still held)' if keep else ''}" for t, keep in c["history"])
    return (
        f"BlockPool(num_blocks={c['num_blocks']}, enable_caching=True), block_size={c['block_size']}; "
        f"earlier prompts (their full blocks cached, then freed): {hist}; lookups: {c['queries']}"
        "\n  ([i] is lookup i)"
    )


register(
    SPECS,
    Spec(
        "ex6.4",
        "the prefix-cache lookup",
        "find_cached_blocks(block_pool, token_ids, block_size)",
        cases=_prefix_cases,
        observe=observe_find_cached_blocks,
        reference=lambda: (ref_find_cached_blocks,),
        describe=_describe_prefix,
        size=lambda c: (c["num_blocks"], sum(map(len, c["queries"]))),
    ),
)


# -- ex6.5: predict tables and ref counts (one event list per student) ------------------------

SHARE_KNOBS = {"num_blocks": 8, "block_size": 4}
# ("alloc", id, tokens) | ("fork", parent, child) | ("free", id, None)
SHARE_EVENTS = [
    ("alloc", "A", 6),
    ("fork", "A", "B"),
    ("fork", "A", "C"),
    ("alloc", "B", 1),
    ("alloc", "C", 3),
    ("free", "A", None),
]


def share_event_text(e) -> str:
    op, a, b = e
    return {
        "alloc": f"{a} allocates {b} token{'' if b == 1 else 's'}",
        "fork": f"{a} forks {b}",
        "free": f"{a} finishes (its blocks are freed)",
    }[op]


def reference_sharing(events=SHARE_EVENTS) -> list[dict]:
    """The tables and the ref counts of held blocks after each event (a live manager)."""
    kv = BlockSpaceManager(**SHARE_KNOBS)
    states = []
    for op, a, b in events:
        if op == "alloc":
            if kv.allocate_slots(a, b) is None:
                raise RuntimeError("checker bug: the pool is too small")
        elif op == "fork":
            kv.fork(a, b)
        else:
            kv.free(a)
        tables = {rid: t.block_ids() for rid, t in sorted(kv.block_tables.items())}
        refs = {blk.block_id: blk.ref_cnt for blk in kv.block_pool.blocks if blk.ref_cnt > 0}
        states.append({"tables": tables, "ref_cnt": refs})
    return states


def share_events_variant(rng) -> list:
    """Six events on a fresh ``SHARE_KNOBS`` manager, drawn by ``rng``: all fit, at least
    two forks and one copy-on-write."""
    while True:
        kv = BlockSpaceManager(**SHARE_KNOBS)
        events, copies, unused = [], 0, ["A", "B", "C", "D"]
        first = unused.pop(0)
        n = rng.randint(1, 10)
        kv.allocate_slots(first, n)
        events.append(("alloc", first, n))
        for k in range(5):
            holders = sorted(kv.block_tables)
            r = rng.random()
            if holders and unused and r < 0.4:
                parent, child = rng.choice(holders), unused.pop(0)
                kv.fork(parent, child)
                events.append(("fork", parent, child))
            elif holders and (r < 0.85 or k < 3):
                rid, n = rng.choice(holders), rng.randint(1, 4)
                if kv.allocate_slots(rid, n) is None:
                    break
                copies += len(kv.take_pending_copies())
                events.append(("alloc", rid, n))
            elif holders:
                rid = rng.choice(holders)
                kv.free(rid)
                events.append(("free", rid, None))
            else:
                break
        if len(events) == 6 and copies >= 1 and sum(e[0] == "fork" for e in events) >= 2:
            return events


def _share_cases(rng):
    # NOTE: rng is None for the shipped notebook (the events of its setup cell); a student
    # copy made with --seed gets the events its seed draws, written into its setup cell
    return [SHARE_EVENTS if rng is None else share_events_variant(rng)]


def _normalize_share(state):
    """A predicted state as the reference writes it: requests holding blocks, blocks held."""
    if type(state) is not dict:
        return state
    tables, refs = state.get("tables") or {}, state.get("ref_cnt") or {}
    return {
        "tables": {str(k): list(v) for k, v in tables.items() if v} if type(tables) is dict else tables,
        "ref_cnt": {k: v for k, v in refs.items() if v} if type(refs) is dict else refs,
    }


def observe_predict_sharing(case, fn):
    got = fn()
    return [_normalize_share(s) for s in got] if type(got) is list else got


register(
    SPECS,
    Spec(
        "ex6.5",
        "predict block tables and ref counts through forks and copy-on-write",
        "predict_sharing()",
        cases=_share_cases,
        observe=observe_predict_sharing,
        expected=lambda case, key: reference_sharing([tuple(e) for e in case]),
        describe=lambda c: (
            f"predict_sharing() for SHARE_EVENTS on BlockSpaceManager({SHARE_KNOBS}): "
            + "; ".join(f"{k}: {share_event_text(tuple(e))}" for k, e in enumerate(c))
            + "; [i] is the state after event i"
        ),
        kind="prediction",
    ),
)
VARIANTS = {"ex6.5": ("SHARE_EVENTS", share_event_text)}


# -- ex6.6: what sharing saves, measured -----------------------------------------------------

SAMPLING_PROMPT, SAMPLING_OUTPUTS = 200, [50, 120, 80, 30]
SAMPLING_BLOCK_SIZES = (4, 16, 64)


def ref_blocks_with_sharing(prompt_len: int, output_lens, block_size: int) -> int:
    """Run it: the prompt once, forks, then every sequence decodes one token per step."""
    if type(prompt_len) is not int or prompt_len < 1:
        raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
    if not output_lens or any(type(o) is not int or o < 1 for o in output_lens):
        raise ValueError(f"output_lens must be a non-empty list of ints >= 1, got {output_lens!r}")
    total = sum(-(-(prompt_len + o) // block_size) for o in output_lens) + 1
    kv = BlockSpaceManager(num_blocks=total, block_size=block_size)
    kv.allocate_slots("s0", prompt_len)
    for i in range(1, len(output_lens)):
        kv.fork("s0", f"s{i}")
    for t in range(max(output_lens)):
        for i, o in enumerate(output_lens):
            if t < o and kv.allocate_slots(f"s{i}", 1) is None:
                raise RuntimeError("checker bug: the pool is too small")
    return kv.num_blocks - kv.get_num_free_blocks()


def _sampling_cases(rng):
    cases = [(6, [1, 3], 4), (1, [1], 1), (8, [2, 2], 4)]
    for _ in range(120):
        cases.append(
            (
                rng.randint(1, 40),
                [rng.randint(1, 20) for _ in range(rng.randint(1, 5))],
                rng.choice([1, 2, 4, 8, 16]),
            )
        )
    return cases + [(0, [1], 4), (5, [], 4), (5, [2, 0], 4)]


def _sampling_report(blocks_with_sharing) -> str:
    parts = []
    for bs in SAMPLING_BLOCK_SIZES:
        shared = blocks_with_sharing(SAMPLING_PROMPT, list(SAMPLING_OUTPUTS), bs)
        alone = sum(-(-(SAMPLING_PROMPT + o) // bs) for o in SAMPLING_OUTPUTS)
        parts.append(f"block_size {bs}: {shared} vs {alone} blocks ({1 - shared / alone:.0%} saved)")
    return f"prompt {SAMPLING_PROMPT}, outputs {SAMPLING_OUTPUTS}: " + ", ".join(parts) + "\n"


register(
    SPECS,
    Spec(
        "ex6.6",
        "what sharing the prompt saves in parallel sampling (measure)",
        "blocks_with_sharing(prompt_len, output_lens, block_size)",
        cases=_sampling_cases,
        observe=lambda c, fn: attempt(lambda: fn(c[0], list(c[1]), c[2])),
        reference=lambda: (ref_blocks_with_sharing,),
        describe=lambda c: f"blocks_with_sharing(prompt_len={c[0]}, output_lens={c[1]}, block_size={c[2]})",
        size=lambda c: (c[0] < 1 or not c[1] or min(c[1]) < 1, c[0] + sum(c[1]), c[2]),
        report=_sampling_report,
    ),
)


# -- ex6.7: concept questions ----------------------------------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
# NOTE: q1/q2 name the shipped events of ex6.5 (a student's copy may have other ones)
QUESTIONS = {
    "q1": (
        "block copies (copy-on-write) when A allocates 6, forks B and C, B adds 1, C adds 3, A frees",
        None,
    ),
    "q2": ("ref_cnt of block 0 after A allocated 6 tokens and forked B and C", None),
    "q3": ("does fork copy any K/V: 'yes' or 'no'", ("yes", "no")),
    "q4": (
        "the prefix cache hashes a block together with everything before it; a block of the same tokens at another position gets the 'same' or a 'different' hash",
        ("same", "different"),
    ),
}
register(SPECS, concept_spec("ex6.7", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "QUESTIONS",
    "SAMPLING_BLOCK_SIZES",
    "SAMPLING_OUTPUTS",
    "SAMPLING_PROMPT",
    "SHARE_EVENTS",
    "SHARE_KNOBS",
    "SPECS",
    "VARIANTS",
    "pkg_append_slot",
    "pkg_block_hashes",
    "ref_append_slot",
    "ref_block_hashes",
    "ref_find_cached_blocks",
    "ref_fork",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex6.1": ("minipaged.core.kv.block_manager_v0:BlockSpaceManager.fork",),
    # allocate_slots of one token does the copy-on-write (take_pending_copies hands it over)
    "ex6.2": ("minipaged.core.kv.block_manager_v0:BlockSpaceManager.allocate_slots",),
    "ex6.3": ("minipaged.core.kv.kv_cache_manager:KVCacheManager._block_hashes",),
    "ex6.4": ("minipaged.core.kv.kv_cache_manager:KVCacheManager.get_computed_blocks",),
    "ex6.5": (
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.fork",
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.allocate_slots",
    ),
    "ex6.6": (
        "minipaged.sim.sharing:measure_parallel_sampling",
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.fork",
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.allocate_slots",
        # the blocks of sequences that share a prompt's full blocks (one output length), of a
        # request and its forks, of tables sharing a block growing with copy-on-write
        "minipaged.core.kv.kv_cache_manager:max_num_blocks",
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.get_num_blocks_to_prefill",
        "minipaged.core.kv.block_manager_v0:_num_blocks_needed",
    ),
}
set_answered_by(SPECS, ANSWERED_BY)
