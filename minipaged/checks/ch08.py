"""Checkers for chapter 08 exercises: vLLM today (v1) beside the paper's v0.

Exercises (notebooks/exercises/ch08_vllm_today.ipynb)
    ex8.1 ``can_admit(num_free_blocks, block_size, num_tokens, first_chunk,
          reserve_full_isl, watermark_blocks)``: v1's admission gate for a waiting request
          (``allocate_slots(..., full_sequence_must_fit=scheduler_reserve_full_isl,
          watermark_blocks)``), checked against the package's ``KVCacheManager``.
    ex8.2 ``predict_admission()`` -> for ``scheduler_reserve_full_isl`` True and False: the
          step each request is first scheduled, the preemptions and the steps of a small run
          (a prediction, worked on paper; one workload per student).
    ex8.3 ``update_batch(rows, leaving, joining)``: the persistent batch's bookkeeping
          (vLLM v1's ``InputBatch``: leaving requests free their rows, joining ones take the
          lowest free rows, ``condense`` moves the last rows into the holes); measure: the
          check prints the rows a persistent batch writes against a batch rebuilt each step.
    ex8.4 ``concept_answers()``: questions with a number or a choice (the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``): plain-data cases; ``observe`` calls the
student's function and returns what it returned or raised; the trusted side computes the
same with the package (ex8.1: a ``KVCacheManager`` with exactly that many free blocks; ex8.2:
the v1 ``Scheduler``) or with ``ref_update_batch``, vLLM's rule written out. A prediction's
messages name the first wrong entry, never the answer. Pure Python, no torch.
"""

from __future__ import annotations

from minipaged.checks._scheduler_cases import arrivals_of
from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.core import KVCacheManager, Request, Scheduler
from minipaged.sampling_params import SamplingParams

SPECS: dict = {}


# -- ex8.1: v1's admission gate ----------------------------------------------------------------


def ref_can_admit(
    num_free_blocks, block_size, num_tokens, first_chunk, reserve_full_isl, watermark_blocks
) -> bool:
    """Via the package: a pool with exactly ``num_free_blocks`` free, asked to admit a request
    of ``num_tokens`` tokens whose first chunk is ``first_chunk`` tokens."""
    if not 1 <= first_chunk <= num_tokens:
        raise ValueError(f"first_chunk must be in [1, num_tokens={num_tokens}], got {first_chunk}")
    pool = max(num_free_blocks, -(-num_tokens // block_size)) + 1
    kv = KVCacheManager(pool, block_size)
    if pool - num_free_blocks:
        kv.allocate_slots("others", (pool - num_free_blocks) * block_size)  # the blocks others hold
    request = Request("r", list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=1))
    got = kv.allocate_slots(
        request, first_chunk, full_sequence_must_fit=reserve_full_isl, watermark_blocks=watermark_blocks
    )
    return got is not None


def _admit_cases(rng):
    cases = [(0, 2, 1, 1, True, 0), (1, 2, 2, 2, True, 0), (1, 2, 3, 2, True, 0), (1, 2, 3, 2, False, 0)]
    for _ in range(250):
        bs = rng.choice([1, 2, 4, 16])
        n = rng.randint(1, 6 * bs)
        chunk = rng.randint(1, n)
        cases.append((rng.randint(0, 8), bs, n, chunk, rng.random() < 0.5, rng.choice([0, 0, 1, 2])))
    return cases + [(4, 2, 3, 4, True, 0), (4, 2, 3, 0, False, 0)]  # a chunk outside [1, num_tokens]


register(
    SPECS,
    Spec(
        "ex8.1",
        "v1's admission gate: scheduler_reserve_full_isl and the watermark",
        "can_admit(num_free_blocks, block_size, num_tokens, first_chunk, reserve_full_isl, watermark_blocks)",
        cases=_admit_cases,
        observe=lambda c, fn: attempt(lambda: fn(*c)),
        reference=lambda: (ref_can_admit,),
        describe=lambda c: (
            f"can_admit(num_free_blocks={c[0]}, block_size={c[1]}, num_tokens={c[2]}, first_chunk={c[3]}, "
            f"reserve_full_isl={c[4]}, watermark_blocks={c[5]})"
        ),
        size=lambda c: (c[2], c[0]),
    ),
)


# -- ex8.2: predict admission under both settings (one workload per student) -------------------

# (request id, prompt tokens, max_tokens, arrival step); the knobs of the v1 scheduler
ADMIT_REQUESTS = [("A", 6, 3, 0), ("B", 6, 2, 0), ("C", 2, 2, 1)]
ADMIT_KNOBS = {"num_blocks": 5, "block_size": 2, "max_num_seqs": 3, "max_num_batched_tokens": 4}
_ADMIT_MAX_STEPS = 12


def reference_admission(requests=ADMIT_REQUESTS, knobs=ADMIT_KNOBS) -> dict:
    """For each setting: ``{"first_step": {id: step first scheduled}, "preemptions": n,
    "steps": n}`` of the v1 ``Scheduler`` (fake model: token 1)."""
    from minipaged.trace import run_scheduler

    out = {}
    for setting in (True, False):
        k = dict(knobs)
        sched = Scheduler(k.pop("num_blocks"), k.pop("block_size"), scheduler_reserve_full_isl=setting, **k)
        trace = run_scheduler(sched, arrivals_of([tuple(r) for r in requests]), next_token=lambda r: 1)
        first: dict = {}
        for s in trace.steps:
            for rid in s.scheduled:
                first.setdefault(rid, s.step)
        out[str(setting)] = {
            "first_step": dict(sorted(first.items())),
            "preemptions": sum(len(s.preempted_ids) for s in trace.steps),
            "steps": len(trace.steps),
        }
    return out


def admit_request_row(req) -> str:
    rid, prompt, max_tokens, at = req
    return f"| {rid} | {prompt} | {max_tokens} | {at} |"


def admission_variant(rng) -> list:
    """Three requests on ``ADMIT_KNOBS`` drawn by ``rng``: each fits the pool alone, the two
    settings differ in preemptions, each run takes at most ``_ADMIT_MAX_STEPS`` steps."""
    slots = ADMIT_KNOBS["num_blocks"] * ADMIT_KNOBS["block_size"]
    while True:
        reqs = []
        for rid, at in (("A", 0), ("B", 0), ("C", rng.randint(0, 2))):
            prompt = rng.randint(2, 7)
            reqs.append((rid, prompt, rng.randint(1, min(4, slots - prompt + 1)), at))
        runs = reference_admission(reqs)
        if (
            max(r["steps"] for r in runs.values()) <= _ADMIT_MAX_STEPS
            and runs["True"]["preemptions"] != runs["False"]["preemptions"]
        ):
            return reqs


def _admission_cases(rng):
    # NOTE: rng is None for the shipped notebook (the requests of its setup cell); a student
    # copy made with --seed gets the requests its seed draws, written into its setup cell
    return [ADMIT_REQUESTS if rng is None else admission_variant(rng)]


def _normalize_admission(got):
    """The student's answer with True/False keys accepted as the strings "True"/"False"."""
    if type(got) is dict and set(got) <= {True, False, "True", "False"}:
        return {str(k): v for k, v in got.items()}
    return got


register(
    SPECS,
    Spec(
        "ex8.2",
        "predict admission with and without scheduler_reserve_full_isl",
        "predict_admission()",
        cases=_admission_cases,
        observe=lambda case, fn: _normalize_admission(fn()),
        expected=lambda case, key: reference_admission(case),
        describe=lambda c: (
            f"predict_admission() for ADMIT_REQUESTS = {[tuple(r) for r in c]} (id, prompt, max_tokens, "
            f"arrival step) on Scheduler({ADMIT_KNOBS}), for scheduler_reserve_full_isl True and False"
        ),
        kind="prediction",
    ),
)
VARIANTS = {
    "ex8.2": (
        "ADMIT_REQUESTS",
        admit_request_row,
        "| request | prompt tokens | max_tokens | arrives before step |\n|---|---|---|---|",
    )
}


# -- ex8.3: the persistent batch's bookkeeping (measure) ---------------------------------------


def ref_update_batch(rows: list, leaving: list, joining: list) -> tuple[list, int]:
    """vLLM v1's ``InputBatch`` (``vllm/v1/worker/gpu_input_batch.py``): ``rows[i]`` is the
    request in row i (``None``: empty). Leaving requests free their rows; each joining
    request, in order, takes the lowest free row (or a new one at the end); ``condense`` then
    moves the request of the last row into the lowest hole while a hole lies below it.
    Returns the rows (no trailing holes, no hole below a request) and the moves made."""
    present = [r for r in rows if r is not None]
    if len(set(present)) != len(present):
        raise ValueError(f"rows holds a request twice: {rows}")
    if any(r not in present for r in leaving) or len(set(leaving)) != len(leaving):
        raise ValueError(f"leaving must be distinct requests of rows, got {leaving}")
    if any(r in present for r in joining) or len(set(joining)) != len(joining):
        raise ValueError(f"joining must be distinct requests not in rows, got {joining}")
    out = [None if r in leaving else r for r in rows]
    for r in joining:
        holes = [i for i, x in enumerate(out) if x is None]
        if holes:
            out[holes[0]] = r
        else:
            out.append(r)
    moves = 0
    while True:
        while out and out[-1] is None:
            out.pop()
        holes = [i for i, x in enumerate(out) if x is None]
        if not holes:
            return out, moves
        out[holes[0]] = out.pop()
        moves += 1


def _batch_cases(rng):
    cases = [([], [], []), (["a"], ["a"], []), (["a", "b", "c"], ["a"], []), (["a", "b"], ["a"], ["c"])]
    for _ in range(250):
        n = rng.randint(0, 8)
        names = [f"r{i}" for i in range(12)]
        rng.shuffle(names)
        rows = names[:n]
        leaving = rng.sample(rows, rng.randint(0, n))
        joining = names[n : n + rng.randint(0, 4)]
        cases.append((rows, leaving, joining))
    return cases + [(["a", "b"], ["c"], []), (["a", "b"], [], ["b"])]  # caller errors: ValueError


def observe_update_batch(case, fn):
    rows, leaving, joining = case
    box = []
    call = attempt(lambda: box.append(fn(list(rows), list(leaving), list(joining))))
    if "returned" in call:
        got = box[0]
        if type(got) is tuple and len(got) == 2:
            call = {"rows": got[0], "moves": got[1]}
        else:
            call = {"returned": {"not a (rows, moves) tuple": type(got).__name__}}
    return call


# (request id, prompt tokens, max_tokens, arrival step): 12 requests through 8 rows
BATCH_WORKLOAD = [
    ("r0", 12, 20, 0), ("r1", 8, 6, 0), ("r2", 20, 14, 0), ("r3", 9, 30, 0), ("r4", 15, 4, 1), ("r5", 10, 18, 2),
    ("r6", 18, 9, 3), ("r7", 11, 25, 5), ("r8", 14, 7, 8), ("r9", 8, 16, 10), ("r10", 16, 11, 12), ("r11", 9, 5, 15),
]  # fmt: skip
BATCH_KNOBS = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64}


def _batch_workload_steps():
    """The requests of each step of ``BATCH_WORKLOAD`` on the v1 scheduler, as the worker sees them."""
    from minipaged.trace import run_scheduler

    k = dict(BATCH_KNOBS)
    sched = Scheduler(k.pop("num_blocks"), k.pop("block_size"), **k)
    trace = run_scheduler(sched, arrivals_of(BATCH_WORKLOAD), next_token=lambda r: 7)
    return [list(s.scheduled) for s in trace.steps]


def _batch_report(update_batch) -> str:
    rows, written, rebuilt = [], 0, 0
    steps = _batch_workload_steps()
    for ids in steps:
        present = set(r for r in rows if r is not None)
        leaving = [r for r in rows if r is not None and r not in ids]
        joining = [r for r in ids if r not in present]
        rows, moves = update_batch(rows, leaving, joining)
        written += len(joining) + moves
        rebuilt += len(ids)
    return (
        f"BATCH_WORKLOAD, {len(steps)} steps: the persistent batch writes {written} rows "
        f"(joining requests and moves); rebuilt every step, the batch writes {rebuilt}\n"
    )


register(
    SPECS,
    Spec(
        "ex8.3",
        "the persistent batch: rows, holes and condense (measure)",
        "update_batch(rows, leaving, joining)",
        cases=_batch_cases,
        observe=observe_update_batch,
        reference=lambda: (ref_update_batch,),
        describe=lambda c: f"update_batch(rows={c[0]}, leaving={c[1]}, joining={c[2]})",
        size=lambda c: (len(c[0]) + len(c[2]), len(c[1])),
        report=_batch_report,
    ),
)


# -- ex8.4: concept questions ----------------------------------------------------------------

QUESTIONS = {
    "q1": ('which preemption mode does vLLM v1 have: `"swap"` or `"recompute"`?', ("swap", "recompute")),
    "q2": [
        (
            "a waiting request of 40 tokens, blocks of 4, its first chunk 32 tokens, 9 free blocks, no watermark: "
            'is it admitted with `scheduler_reserve_full_isl=True`? `"yes"` or `"no"`',
            ("yes", "no"),
        ),
        (
            "a waiting request of 40 tokens, blocks of 4, its first chunk 32 tokens, 10 free blocks, no watermark: "
            'is it admitted with `scheduler_reserve_full_isl=True`? `"yes"` or `"no"`',
            ("yes", "no"),
        ),
    ],
    "q3": [
        (
            "with `block_size = 16` and `k = 4` lookahead slots, the most extra blocks a decoding request needs",
            None,
        ),
        (
            "with `block_size = 4` and `k = 6` lookahead slots, the most extra blocks a decoding request needs",
            None,
        ),
    ],
    "q4": (
        "under FCFS, are v1's victim (the last of `running`) and v0's (the latest arrival) the same request: "
        '`"yes"` or `"no"`?',
        ("yes", "no"),
    ),
}
register(SPECS, concept_spec("ex8.4", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "ADMIT_KNOBS",
    "ADMIT_REQUESTS",
    "BATCH_KNOBS",
    "BATCH_WORKLOAD",
    "QUESTIONS",
    "SPECS",
    "VARIANTS",
    "reference_admission",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex8.1": (
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.allocate_slots",
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.get_num_blocks_to_allocate",
    ),
    "ex8.2": ("minipaged.core.sched.scheduler:Scheduler.schedule",),
}
set_answered_by(SPECS, ANSWERED_BY)
