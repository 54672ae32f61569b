"""Checkers for chapter 00 exercises: the three ideas, and what one decode step costs.

Exercises (notebooks/exercises/ch00_overview.ipynb)
    ex0.1 ``sort_statements()`` -> ``{statement_id: "data" | "addressing" | "scheduling"}``:
          the statements of ``STATEMENTS`` sorted into the course's three concepts (graded
          once, by the instructor's key).
    ex0.2 ``predict_tables()`` -> one ``{request_id: block ids}`` per event of ``EVENTS``
          (a prediction, worked on paper; one workload per student), compared with a live
          ``KVCacheManager`` on the trusted side.
    ex0.3 ``decode_step_time(model, gpu, batch_size, context_len, mfu, mbu, overhead_s)``:
          seconds of one decode step under the course's roofline cost model, checked
          against ``minipaged.sim.CostModel.step_time``.
    ex0.4 ``ridge_batch(model, gpu, context_len, mfu, mbu)``: the smallest decode batch that
          is compute-bound (``None`` if none is), checked against ``CostModel.breakdown``.
    ex0.5 ``concept_answers()``: the end-of-chapter questions that have a number or a
          choice for an answer (graded once, by the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``): the cases are plain data (a model and
a GPU by their names in ``MODELS`` / ``GPUS``, numbers); ``observe`` calls the student's
function in the student's kernel and returns what it returned or raised; the trusted side
runs the same ``observe`` with the package's ``CostModel`` (ex0.3, ex0.4) or replays the
events on a ``KVCacheManager`` (ex0.2) and compares. A prediction's failure names the first
wrong event and what the student predicted, never the engine's tables; the keys of ex0.1 and
ex0.5 are in the instructor's key only. Pure Python (no torch).
"""

from __future__ import annotations

import math
import random

from minipaged.checks._harness import ExerciseFailure
from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.core import KVCacheManager
from minipaged.sim.cost_model import GPUS, MODELS, CostModel

SPECS: dict = {}
CONCEPTS = ("data", "addressing", "scheduling")

# statement id -> statement. Printed by the exercise notebook's setup cell; which concept
# each is about is in the instructor's key only.
STATEMENTS = {
    "s1": "It holds, per layer, a key and a value vector for every token seen so far.",
    "s2": "Token i of a request lives in slot block_table[i // block_size] * block_size + i % block_size.",
    "s3": "Every step, the batch is rebuilt from the running and the waiting requests.",
    "s4": "OPT-13B needs 800 KiB of it per token.",
    "s5": "A request's blocks may be anywhere in the pool; they need not be contiguous.",
    "s6": "max_num_batched_tokens caps how many tokens one step computes.",
    "s7": "When no block is free, a running request is preempted and recomputed later.",
    "s8": "Its entries never change once written, because attention is causal.",
    "s9": "Two requests with the same prompt can point at the same physical block (ref_cnt 2).",
    "s10": "A waiting request is admitted only if there is a free seat, token budget and blocks.",
    "s11": "The attention kernel looks up block_tables[b, n // block_size] inside its loop.",
    "s12": "It grows by one token per running request per decode step.",
}
# NOTE: graded once, by the key: a failure says how many statements are misplaced, never which
register(
    SPECS,
    concept_spec(
        "ex0.1",
        "the three ideas: sort statements into data, addressing, scheduling",
        {sid: (text, CONCEPTS) for sid, text in STATEMENTS.items()},
        fn_name="sort_statements",
    ),
)


# -- ex0.2: predict the block tables (one workload per student) ------------------------------

NUM_BLOCKS, BLOCK_SIZE = 8, 4
# (request id, tokens to add) or (request id, None) = the request finishes and frees its blocks
EVENTS = [("A", 10), ("B", 5), ("B", 4), ("A", None), ("C", 6), ("D", 5)]


def event_text(event) -> str:
    """One row of the events table (the shipped notebook's and every student's copy)."""
    rid, n = event
    return f"{rid} finishes: its blocks are freed" if n is None else f"{rid} allocates {n} more tokens"


def reference_tables(events=EVENTS) -> list[dict]:
    """The engine's block tables ``{request id: block ids}`` after each event."""
    kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    states = []
    for rid, n in events:
        if n is None:
            kv.free(rid)
        elif kv.allocate_slots(rid, n) is None:
            raise RuntimeError(f"checker bug: {rid} does not fit")
        states.append({r: list(kv.get_block_ids(r)) for r in sorted(kv.block_tables)})
    return states


def events_variant(rng: random.Random) -> list:
    """Six events that all fit a fresh pool of ``NUM_BLOCKS`` x ``BLOCK_SIZE``, with a free
    followed by an allocation (so reuse order matters), drawn by ``rng``."""
    while True:
        kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        events, ok, finished = [], True, set()
        for k in range(6):
            holding = sorted(kv.block_tables)
            if holding and k >= 2 and rng.random() < 0.3:
                rid = rng.choice(holding)
                kv.free(rid)
                finished.add(rid)  # NOTE: a finished request's id is not used again
                events.append((rid, None))
                continue
            rid = rng.choice([r for r in "ABCDE" if r not in finished])
            n = rng.randint(1, 12)
            try:
                got = kv.allocate_slots(rid, n)
            except ValueError:
                got = None
            if got is None:
                ok = False
                break
            events.append((rid, n))
        frees = [k for k, (_, n) in enumerate(events) if n is None]
        if ok and frees and frees[0] < 5:
            return events


def _tables_cases(rng):
    # NOTE: rng is None for the shipped notebook (the EVENTS of its setup cell); a student
    # copy made with --seed gets the events its seed draws, written into its setup cell
    return [EVENTS if rng is None else events_variant(rng)]


def observe_tables(case, predict_tables):
    """The student's prediction as data; a request listed with no blocks is dropped."""
    got = predict_tables()
    if type(got) is not list:
        return got
    return [
        {str(k): list(v) for k, v in state.items() if v} if type(state) is dict else state for state in got
    ]


register(
    SPECS,
    Spec(
        "ex0.2",
        "predict the block tables after each event",
        "predict_tables()",
        cases=_tables_cases,
        observe=observe_tables,
        expected=lambda case, key: reference_tables([tuple(e) for e in case]),
        describe=lambda c: (
            "the events of EVENTS: " + "; ".join(f"{k}: {event_text(e)}" for k, e in enumerate(c))
        ),
        kind="prediction",
    ),
)
VARIANTS = {"ex0.2": ("EVENTS", event_text)}


# -- ex0.3 / ex0.4: the cost model -----------------------------------------------------------


def ref_decode_step_time(model, gpu, batch_size, context_len, mfu=0.5, mbu=0.8, overhead_s=0.003) -> float:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not isinstance(context_len, int) or context_len < 0:
        raise ValueError(f"context_len must be an int >= 0, got {context_len!r}")
    cm = CostModel(model, gpu, flops_efficiency=mfu, bandwidth_efficiency=mbu, step_overhead_s=overhead_s)
    return cm.step_time([(1, context_len)] * batch_size)


def _cost_cases(rng: random.Random):
    cases = [("OPT-13B", "A100-40GB", 1, 400, 0.5, 0.8, 0.003)]
    for _ in range(60):
        cases.append(
            (
                rng.choice(sorted(MODELS)),
                rng.choice(sorted(GPUS)),
                rng.choice([1, 2, 8, 32, 64, 200, rng.randint(1, 300)]),
                rng.choice([0, 1, 100, 400, 2000, rng.randint(0, 4000)]),
                rng.choice([0.3, 0.5, 1.0]),
                rng.choice([0.6, 0.8, 1.0]),
                rng.choice([0.0, 0.003]),
            )
        )
    return cases + [
        ("OPT-13B", "A100-40GB", 0, 10, 0.5, 0.8, 0.003),
        ("Llama-7B", "H100", 4, -1, 0.5, 0.8, 0.003),
    ]


def observe_cost(case, decode_step_time):
    m, g, b, ctx, mfu, mbu, ovh = case
    return attempt(lambda: decode_step_time(MODELS[m], GPUS[g], b, ctx, mfu, mbu, ovh))


def _describe_cost(c) -> str:
    m, g, b, ctx, mfu, mbu, ovh = c
    return (
        f"decode_step_time(MODELS[{m!r}], GPUS[{g!r}], batch_size={b}, context_len={ctx}, "
        f"mfu={mfu}, mbu={mbu}, overhead_s={ovh})"
    )


register(
    SPECS,
    Spec(
        "ex0.3",
        "the time of one decode step, from bytes and FLOPs",
        "decode_step_time(model, gpu, batch_size, context_len, mfu, mbu, overhead_s)",
        cases=_cost_cases,
        observe=observe_cost,
        reference=lambda: (ref_decode_step_time,),
        describe=_describe_cost,
        size=lambda c: (c[2] < 1 or c[3] < 0, c[2], c[3]),
    ),
)


def ref_ridge_batch(model, gpu, context_len, mfu=0.5, mbu=0.8):
    """Smallest batch whose decode step is compute-bound (compute time >= memory time)."""
    if not isinstance(context_len, int) or context_len < 0:
        raise ValueError(f"context_len must be an int >= 0, got {context_len!r}")
    cm = CostModel(model, gpu, flops_efficiency=mfu, bandwidth_efficiency=mbu)
    ridge = cm.decode_ridge_batch(context_len)
    if math.isinf(ridge):
        return None
    b = max(1, math.ceil(ridge))

    def compute_bound(k):
        return cm.breakdown([(1, context_len)] * k).bound == "compute"

    while not compute_bound(b):  # NOTE: guard the float edge of ceil() both ways
        b += 1
    while b > 1 and compute_bound(b - 1):
        b -= 1
    return b


def _ridge_cases(rng: random.Random):
    cases = [("OPT-13B", "A100-40GB", 0, 0.5, 0.8), ("OPT-13B", "A100-40GB", 400, 0.5, 0.8)]
    for _ in range(40):
        cases.append(
            (
                rng.choice(sorted(MODELS)),
                rng.choice(sorted(GPUS)),
                rng.choice([0, 1, 16, 64, 100, 400, rng.randint(0, 200)]),
                rng.choice([0.3, 0.5, 1.0]),
                rng.choice([0.6, 0.8, 1.0]),
            )
        )
    return cases + [("Llama-7B", "H200", -5, 0.5, 0.8)]


def observe_ridge(case, ridge_batch):
    m, g, ctx, mfu, mbu = case
    return attempt(lambda: ridge_batch(MODELS[m], GPUS[g], ctx, mfu, mbu))


register(
    SPECS,
    Spec(
        "ex0.4",
        "the batch size where decode stops being memory-bound",
        "ridge_batch(model, gpu, context_len, mfu, mbu)",
        cases=_ridge_cases,
        observe=observe_ridge,
        reference=lambda: (ref_ridge_batch,),
        describe=lambda c: (
            f"ridge_batch(MODELS[{c[0]!r}], GPUS[{c[1]!r}], context_len={c[2]}, mfu={c[3]}, mbu={c[4]})"
        ),
        size=lambda c: (c[2] < 0, c[2]),
    ),
)


# -- ex0.5: concept questions with a number or a choice ----------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
QUESTIONS = {
    "q1": ("blocks a 100-token request holds with block_size 16", None),
    "q2": ("slots of those blocks that hold no token", None),
    "q3": (
        "which idea decides where a token's K/V lives: 'data', 'addressing' or 'scheduling'",
        ("data", "addressing", "scheduling"),
    ),
    "q4": (
        "decode of OPT-13B on an A100-40GB at batch 1: 'memory'-bound or 'compute'-bound",
        ("memory", "compute"),
    ),
    "q5": ("the course cost model's decode step for OPT-13B, A100-40GB, batch 1, context 400, in ms", None),
}
register(SPECS, concept_spec("ex0.5", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "EVENTS",
    "QUESTIONS",
    "SPECS",
    "STATEMENTS",
    "VARIANTS",
    "ExerciseFailure",
    "event_text",
    "ref_decode_step_time",
    "ref_ridge_batch",
    "reference_tables",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex0.2": (
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.allocate_slots",
        "minipaged.core.kv.block_manager_v0:BlockSpaceManager.allocate_slots",
    ),
    "ex0.3": (
        "minipaged.sim.cost_model:CostModel.step_time",
        "minipaged.sim.cost_model:CostModel.breakdown",
        "minipaged.sim.cost_model:CostModel.step_costs",
    ),
    "ex0.4": (
        "minipaged.sim.cost_model:CostModel.decode_ridge_batch",
        "minipaged.sim.cost_model:CostModel.breakdown",
        "minipaged.sim.cost_model:StepCost.bound",
    ),
    "ex0.5": (
        "minipaged.sim.cost_model:CostModel.step_time",
        "minipaged.sim.cost_model:CostModel.breakdown",
        "minipaged.sim.cost_model:StepCost.bound",
    ),
}
set_answered_by(SPECS, ANSWERED_BY)
