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
          ``BlockSpaceManager``; the first difference shows ``viz.block_tables_text``.
    ex6.6 ``blocks_with_sharing(prompt_len, output_lens, block_size)``: blocks in use after
          parallel sampling with fork and copy-on-write, checked against the manager; then
          the measured saving over unshared sequences is printed (deterministic).
    ex6.7 ``concept_answers()``: the end-of-chapter questions with a number or a choice.

Reference: the package's ``BlockSpaceManager`` (``fork``; ``allocate_slots`` of one token,
whose copy-on-write records the ``(src, dst)`` pair that ``take_pending_copies`` hands
over; ``get_computed_blocks``; the chained ``_block_hashes``). ``ref_fork`` /
``ref_append_slot`` / ``ref_block_hashes`` / ``ref_find_cached_blocks`` below are the same
rules written out over ``BlockPool`` alone (tests/test_checks.py checks that they agree
with the package). The student's code and the reference run side by side on seeded
random operation sequences; ``BlockSpaceManager.check_invariants`` (``ref_cnt`` equals the
number of block tables holding a block; free queue = blocks with ``ref_cnt == 0``) runs
after every step.
"""

from __future__ import annotations

import random
from typing import Optional

from minipaged.checks._harness import (
    Mismatch,
    exercise,
    expect_equal,
    expect_equal_to_reference,
    expect_invariants,
    expect_raises,
    expect_true,
    require_callable,
    run_cases,
)
from minipaged.checks._spec import concept_spec, register
from minipaged.core import BlockPool, BlockSpaceManager, BlockTable, KVCacheBlock, Request, hash_block_tokens

CHECKS: dict = {}


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


# -- state comparison ----------------------------------------------------------------------


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
    return {
        "tables": {rid: (t.num_tokens, t.block_ids()) for rid, t in sorted(m.block_tables.items())},
        "ref_cnt": [b.ref_cnt for b in m.block_pool.blocks],
        "free": [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()],
    }


_MWHAT = {
    "tables": "{request: (num_tokens, block table)}",
    "ref_cnt": "ref_cnt of blocks 0, 1, 2, ...",
    "free": "the free queue, front to back",
}


def _compare(step: str, ref: BlockSpaceManager, stu: BlockSpaceManager) -> None:
    a, b = _mstate(ref), _mstate(stu)
    for key in a:
        expect_equal(f"after {step}: {_MWHAT[key]}", a[key], b[key])
    expect_invariants(f"after {step}", stu)


def _sharing_cases(exercise_id: str, n: int, focus: str) -> list:
    """(num_blocks, block_size, ops); ops: ("alloc", rid, n) | ("fork", parent, child) |
    ("append", rid) | ("free", rid) | ("fork?", parent, child) (a fork that must raise)."""
    rng = random.Random(exercise_id)
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
    return f"BlockSpaceManager(num_blocks={num_blocks}, block_size={block_size}), then: " + "; ".join(
        words[o[0]](o) for o in ops
    )


def _replay(case, fork_fn, append_fn, ref_fork_fn=None, ref_append_fn=None):
    """Run the ops on a reference manager and a student manager; compare after each.

    The reference is the package (``BlockSpaceManager.fork``, ``pkg_append_slot``) unless
    other functions are given; the student's side uses ``fork_fn`` / ``append_fn``.
    """
    ref_fork_fn = ref_fork_fn or BlockSpaceManager.fork
    ref_append_fn = ref_append_fn or pkg_append_slot
    num_blocks, block_size, ops = case
    ref, stu = BlockSpaceManager(num_blocks, block_size), _StudentManager(num_blocks, block_size)
    for i, op in enumerate(ops):
        step = f"step {i + 1} ({op[0].rstrip('?')} {', '.join(map(str, op[1:]))})"
        kind = op[0]
        if kind == "alloc":
            ref.allocate_slots(op[1], op[2])
            BlockSpaceManager.allocate_slots(stu, op[1], op[2])
        elif kind == "free":
            ref.free(op[1])
            BlockSpaceManager.free(stu, op[1])
        elif kind == "fork?":
            expect_raises(
                f"{step}: fork from an unknown parent or onto an existing child",
                ValueError,
                lambda: fork_fn(stu, op[1], op[2]),
            )
        elif kind == "fork":
            ref_fork_fn(ref, op[1], op[2])
            got = fork_fn(stu, op[1], op[2])
            expect_equal(f"{step}: return value of fork", None, got)
            child, parent = stu.block_tables.get(op[2]), stu.block_tables.get(op[1])
            if (
                child is not None
                and parent is not None
                and (child is parent or child.blocks is parent.blocks)
            ):
                raise Mismatch(
                    f"{step}: the child's block table is the parent's list object itself; "
                    "give the child its own list (the tables must be able to diverge)"
                )
        else:  # append
            expected = ref_append_fn(ref, op[1])
            got = append_fn(stu, op[1])
            expect_equal(
                f"{step}: copies to do, [(src block, dst block)] (None = no free block)", expected, got
            )
        _compare(step, ref, stu)


@exercise(CHECKS, "ex6.1", "fork: the child shares every block of the parent")
def check_fork(fork) -> None:
    require_callable("ex6.1", fork, "fork(kv_cache_manager, parent_id, child_id)")
    run_cases(
        "ex6.1",
        _sharing_cases("ex6.1", 250, focus="fork"),
        lambda c: _replay(c, fork, pkg_append_slot),
        size=lambda c: (len(c[2]), c[0]),
        describe=_describe_ops,
    )


@exercise(CHECKS, "ex6.2", "append_slot with copy-on-write")
def check_append_slot(append_slot) -> None:
    require_callable("ex6.2", append_slot, "append_slot(kv_cache_manager, request_id)")
    run_cases(
        "ex6.2",
        _sharing_cases("ex6.2", 250, focus="append"),
        lambda c: _replay(c, BlockSpaceManager.fork, append_slot),
        size=lambda c: (len(c[2]), c[0]),
        describe=_describe_ops,
    )


# -- ex6.3 -------------------------------------------------------------------------------


@exercise(CHECKS, "ex6.3", "the chained hash of every full block")
def check_block_hashes(block_hashes) -> None:
    require_callable("ex6.3", block_hashes, "block_hashes(token_ids, block_size)")
    rng = random.Random("ex6.3")
    cases = [([], 4), ([5], 1), ([1, 2, 3], 4), ([1, 2, 3, 4], 2)]
    for _ in range(150):
        bs = rng.choice([1, 2, 3, 4, 16])
        cases.append(([rng.randrange(100) for _ in range(rng.randint(0, 40))], bs))

    def run_one(c):
        tokens, bs = c
        expected = pkg_block_hashes(tokens, bs)
        got = block_hashes(list(tokens), bs)
        expect_true("block_hashes must return a list", isinstance(got, list), f"got {type(got).__name__}")
        expect_equal("number of hashes (one per *full* block)", len(expected), len(got))
        for j, (e, g) in enumerate(zip(expected, got)):
            if e != g:
                raise Mismatch(
                    f"hash of block {j} (tokens {tokens[j * bs : (j + 1) * bs]}) differs:\n"
                    f"    expected {e.hex()[:16]}...\n    got      "
                    f"{g.hex()[:16] + '...' if isinstance(g, bytes) else repr(g)}"
                )

    run_cases(
        "ex6.3",
        cases,
        run_one,
        size=lambda c: (len(c[0]), c[1]),
        describe=lambda c: f"block_hashes(token_ids={c[0]}, block_size={c[1]})",
    )


# -- ex6.4 -------------------------------------------------------------------------------


def _prefix_cases(n: int) -> list[dict]:
    rng = random.Random("ex6.4")
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
        for block, h in zip(blocks, ref_block_hashes(tokens, bs)):
            pool.cache_block(block, h)
        if not keep:
            pool.free_blocks(reversed(blocks))
    return manager


def _pool_state(pool: BlockPool):
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        sorted(b.block_id for b in pool.cached_block_hash_to_block.values()),
    )


@exercise(CHECKS, "ex6.4", "the prefix-cache lookup")
def check_find_cached_blocks(find_cached_blocks) -> None:
    require_callable("ex6.4", find_cached_blocks, "find_cached_blocks(block_pool, token_ids, block_size)")

    def run_one(c):
        ref, stu_pool = _build_pool(c), _build_pool(c).block_pool
        bs = c["block_size"]
        for q in c["queries"]:
            expected = [b.block_id for b in ref.get_computed_blocks(Request("q", list(q)))[0]]
            before = _pool_state(stu_pool)
            got = find_cached_blocks(stu_pool, list(q), bs)
            expect_true(
                "find_cached_blocks must return a list of KVCacheBlock",
                isinstance(got, list) and all(isinstance(b, KVCacheBlock) for b in got),
                f"got {got!r}",
            )
            expect_equal(f"cached block ids for token_ids={q}", expected, [b.block_id for b in got])
            expect_true(
                "the blocks returned must be the pool's own block objects",
                all(b is stu_pool.blocks[b.block_id] for b in got),
            )
            expect_equal(
                "the pool after the lookup (a lookup must not change ref counts, the free queue "
                "or the cache)",
                before,
                _pool_state(stu_pool),
            )

    def describe(c):
        hist = "; ".join(f"{t}{' (still held)' if keep else ''}" for t, keep in c["history"])
        return (
            f"BlockPool(num_blocks={c['num_blocks']}, enable_caching=True), block_size={c['block_size']}; "
            f"earlier prompts (their full blocks cached, then freed): {hist}; lookups: {c['queries']}"
        )

    run_cases(
        "ex6.4",
        _prefix_cases(200),
        run_one,
        size=lambda c: (c["num_blocks"], sum(map(len, c["queries"]))),
        describe=describe,
    )


# -- ex6.5: predict tables and ref counts -----------------------------------------------------

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


def _share_event_text(e) -> str:
    op, a, b = e
    return {
        "alloc": f"{a} allocates {b} more tokens",
        "fork": f"{a} forks {b}",
        "free": f"{a} finishes (free)",
    }[op]


def reference_sharing():
    """(tables, ref counts of held blocks) after each event of SHARE_EVENTS, and the pictures."""
    from minipaged import viz

    kv = BlockSpaceManager(**SHARE_KNOBS)
    states, pictures = [], []
    for op, a, b in SHARE_EVENTS:
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
        pictures.append(viz.block_tables_text(kv))
    return states, pictures


@exercise(CHECKS, "ex6.5", "predict block tables and ref counts through forks and copy-on-write")
def check_predict_sharing(predict_sharing) -> None:
    require_callable("ex6.5", predict_sharing, "predict_sharing")
    from minipaged.checks._harness import Mismatch

    states, pictures = reference_sharing()

    def run_one(i):
        got = predict_sharing()
        if not isinstance(got, list) or len(got) != len(SHARE_EVENTS):
            raise Mismatch(f"predict_sharing() must return a list of {len(SHARE_EVENTS)} dicts, got {got!r}")
        state = got[i]
        norm = state
        if isinstance(state, dict):
            norm = {
                "tables": {str(k): list(v) for k, v in dict(state.get("tables") or {}).items() if v},
                "ref_cnt": {k: v for k, v in dict(state.get("ref_cnt") or {}).items() if v},
            }
        if norm != states[i]:
            raise Mismatch(
                f"after event {i} ({_share_event_text(SHARE_EVENTS[i])}):\n    expected {states[i]!r}\n"
                f"    got      {norm!r}\n  the manager's picture after this event:\n"
                + "\n".join("    " + ln for ln in pictures[i].splitlines())
            )

    run_cases(
        "ex6.5",
        range(len(SHARE_EVENTS)),
        run_one,
        describe=lambda i: "events 0..{}: {}".format(
            i, "; ".join(map(_share_event_text, SHARE_EVENTS[: i + 1]))
        ),
    )


# -- ex6.6: what sharing saves, measured -----------------------------------------------------

SAMPLING_PROMPT, SAMPLING_OUTPUTS = 200, [50, 120, 80, 30]
SAMPLING_BLOCK_SIZES = (4, 16, 64)


def ref_blocks_with_sharing(prompt_len: int, output_lens, block_size: int) -> int:
    """Run it: the prompt once, forks, then every sequence decodes one token per step."""
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
    if not output_lens or any(not isinstance(o, int) or o < 1 for o in output_lens):
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


@exercise(CHECKS, "ex6.6", "what sharing the prompt saves in parallel sampling (measure)")
def check_blocks_with_sharing(blocks_with_sharing) -> None:
    require_callable("ex6.6", blocks_with_sharing, "blocks_with_sharing(prompt_len, output_lens, block_size)")
    from minipaged.checks._harness import _print, _redirect_stdout, _StringIO

    rng = random.Random("ex6.6")
    cases = [(6, [1, 3], 4), (1, [1], 1), (8, [2, 2], 4)]
    for _ in range(120):
        cases.append(
            (
                rng.randint(1, 40),
                [rng.randint(1, 20) for _ in range(rng.randint(1, 5))],
                rng.choice([1, 2, 4, 8, 16]),
            )
        )
    cases += [(0, [1], 4), (5, [], 4), (5, [2, 0], 4)]

    def run_one(c):
        p, outs, bs = c
        expect_equal_to_reference(
            "blocks in use at the end",
            lambda: ref_blocks_with_sharing(p, outs, bs),
            lambda: blocks_with_sharing(p, list(outs), bs),
        )

    verdict = _StringIO()
    with _redirect_stdout(verdict):
        run_cases(
            "ex6.6",
            cases,
            run_one,
            size=lambda c: (c[0] < 1 or not c[1] or min(c[1]) < 1, c[0] + sum(c[1]), c[2]),
            describe=lambda c: (
                f"blocks_with_sharing(prompt_len={c[0]}, output_lens={c[1]}, block_size={c[2]})"
            ),
        )
    parts = []
    for bs in SAMPLING_BLOCK_SIZES:
        shared = blocks_with_sharing(SAMPLING_PROMPT, list(SAMPLING_OUTPUTS), bs)
        alone = sum(-(-(SAMPLING_PROMPT + o) // bs) for o in SAMPLING_OUTPUTS)
        parts.append(f"block_size {bs}: {shared} vs {alone} blocks ({1 - shared / alone:.0%} saved)")
    _print(f"prompt {SAMPLING_PROMPT}, outputs {SAMPLING_OUTPUTS}: " + ", ".join(parts))
    _print(verdict.getvalue(), end="")


# -- ex6.7: concept questions ----------------------------------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
QUESTIONS = {
    "q1": ("block copies (copy-on-write) in the run of ex6.5", None),
    "q2": ("ref_cnt of block 0 after A, B and C all hold it", None),
    "q3": ("does fork copy any K/V: 'yes' or 'no'", ("yes", "no")),
    "q4": (
        "the prefix cache hashes a block together with everything before it; a block of the same tokens at another position gets the 'same' or a 'different' hash",
        ("same", "different"),
    ),
}
SPECS: dict = {}
register(SPECS, concept_spec("ex6.7", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "CHECKS",
    "pkg_append_slot",
    "pkg_block_hashes",
    "ref_append_slot",
    "ref_block_hashes",
    "ref_find_cached_blocks",
    "ref_fork",
]
