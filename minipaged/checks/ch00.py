"""Checkers for chapter 00 exercises: the three ideas, and what one decode step costs.

Exercises (notebooks/exercises/ch00_overview.ipynb)
    ex0.1 ``sort_statements()`` -> ``{statement_id: "data" | "addressing" | "scheduling"}``:
          the statements of ``STATEMENTS`` sorted into the course's three concepts.
    ex0.2 ``predict_tables()`` -> one ``{request_id: block ids}`` per event of ``EVENTS``
          (a prediction, worked on paper), compared with a live ``KVCacheManager``.
    ex0.3 ``decode_step_time(model, gpu, batch_size, context_len, mfu, mbu, overhead_s)``:
          seconds of one decode step under the course's roofline cost model, checked
          against ``minipaged.sim.CostModel.step_time``.
    ex0.4 ``ridge_batch(model, gpu, context_len, mfu, mbu)``: the smallest decode batch that
          is compute-bound (``None`` if none is), checked against ``CostModel.breakdown``.
    ex0.5 ``concept_answers()``: the end-of-chapter questions that have a number or a
          choice for an answer.

Reference: the package (``KVCacheManager``, ``CostModel``); ex0.1 and ex0.5 hold an answer
key here. A failure names the first wrong item without revealing the key for choices.
Pure Python (no torch).
"""

from __future__ import annotations

import math
import random

from minipaged.checks._harness import (
    ExerciseFailure,
    Mismatch,
    exercise,
    expect_close_to_reference,
    expect_equal_to_reference,
    require_callable,
    run_cases,
)
from minipaged.checks._spec import concept_spec, register
from minipaged.core import KVCacheManager
from minipaged.sim.cost_model import GPUS, MODELS, CostModel

CHECKS: dict = {}
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


# -- ex0.2: predict the block tables ---------------------------------------------------------

NUM_BLOCKS, BLOCK_SIZE = 8, 4
# (request id, tokens to add) or (request id, None) = the request finishes and frees its blocks
EVENTS = [("A", 10), ("B", 5), ("B", 4), ("A", None), ("C", 6), ("D", 5)]


def _event_text(event) -> str:
    rid, n = event
    return f"{rid} finishes (free)" if n is None else f"{rid} allocates {n} more tokens"


def reference_tables():
    """The engine's block tables after each event, and its text picture after each."""
    from minipaged import viz

    kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    states, pictures = [], []
    for rid, n in EVENTS:
        if n is None:
            kv.free(rid)
        elif kv.allocate_slots(rid, n) is None:
            raise RuntimeError(f"checker bug: {rid} does not fit")
        states.append({r: list(kv.get_block_ids(r)) for r in sorted(kv.block_tables)})
        pictures.append(viz.block_tables_text(kv))
    return states, pictures


@exercise(CHECKS, "ex0.2", "predict the block tables after each event")
def check_predict_tables(predict_tables) -> None:
    require_callable("ex0.2", predict_tables, "predict_tables")
    states, pictures = reference_tables()

    def run_one(i):
        got = predict_tables()
        if not isinstance(got, list) or len(got) != len(EVENTS):
            raise Mismatch(
                f"predict_tables() must return a list of {len(EVENTS)} dicts, one per event, got {got!r}"
            )
        state = got[i]
        if not isinstance(state, dict):
            raise Mismatch(f"after event {i}: expected a dict request id -> block ids, got {state!r}")
        norm = {str(k): list(v) for k, v in state.items() if v}
        if norm != states[i]:
            raise Mismatch(
                f"after event {i} ({_event_text(EVENTS[i])}):\n    expected {states[i]!r}\n"
                f"    got      {norm!r}\n  the engine's picture after this event:\n"
                + "\n".join("    " + ln for ln in pictures[i].splitlines())
            )

    run_cases(
        "ex0.2",
        range(len(EVENTS)),
        run_one,
        describe=lambda i: f"events 0..{i}: " + "; ".join(_event_text(e) for e in EVENTS[: i + 1]),
    )


# -- ex0.3 / ex0.4: the cost model -----------------------------------------------------------


def ref_decode_step_time(model, gpu, batch_size, context_len, mfu=0.5, mbu=0.8, overhead_s=0.003) -> float:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not isinstance(context_len, int) or context_len < 0:
        raise ValueError(f"context_len must be an int >= 0, got {context_len!r}")
    cm = CostModel(model, gpu, flops_efficiency=mfu, bandwidth_efficiency=mbu, step_overhead_s=overhead_s)
    return cm.step_time([(1, context_len)] * batch_size)


def _cost_cases(rng: random.Random, n: int):
    cases = [("OPT-13B", "A100-40GB", 1, 400, 0.5, 0.8, 0.003)]
    for _ in range(n):
        cases.append(
            (
                rng.choice(sorted(MODELS)),
                rng.choice(sorted(GPUS)),
                rng.choice([1, 2, 8, 32, 64, 200]),
                rng.choice([0, 1, 100, 400, 2000]),
                rng.choice([0.3, 0.5, 1.0]),
                rng.choice([0.6, 0.8, 1.0]),
                rng.choice([0.0, 0.003]),
            )
        )
    return cases


def _describe_cost(c) -> str:
    m, g, b, ctx, mfu, mbu, ovh = c
    return (
        f"decode_step_time(MODELS[{m!r}], GPUS[{g!r}], batch_size={b}, context_len={ctx}, "
        f"mfu={mfu}, mbu={mbu}, overhead_s={ovh})"
    )


@exercise(CHECKS, "ex0.3", "the time of one decode step, from bytes and FLOPs")
def check_decode_step_time(decode_step_time) -> None:
    require_callable("ex0.3", decode_step_time, "decode_step_time")
    rng = random.Random("ex0.3")
    cases = _cost_cases(rng, 60)
    cases += [("OPT-13B", "A100-40GB", 0, 10, 0.5, 0.8, 0.003), ("Llama-7B", "H100", 4, -1, 0.5, 0.8, 0.003)]

    def run_one(c):
        m, g, b, ctx, mfu, mbu, ovh = c
        args = (MODELS[m], GPUS[g], b, ctx, mfu, mbu, ovh)
        expect_close_to_reference(
            "step time in seconds", lambda: ref_decode_step_time(*args), lambda: decode_step_time(*args)
        )

    run_cases(
        "ex0.3", cases, run_one, size=lambda c: (c[2] < 1 or c[3] < 0, c[2], c[3]), describe=_describe_cost
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


@exercise(CHECKS, "ex0.4", "the batch size where decode stops being memory-bound")
def check_ridge_batch(ridge_batch) -> None:
    require_callable("ex0.4", ridge_batch, "ridge_batch")
    rng = random.Random("ex0.4")
    cases = [("OPT-13B", "A100-40GB", 0, 0.5, 0.8), ("OPT-13B", "A100-40GB", 400, 0.5, 0.8)]
    for _ in range(40):
        cases.append(
            (
                rng.choice(sorted(MODELS)),
                rng.choice(sorted(GPUS)),
                rng.choice([0, 1, 16, 64, 100, 400]),
                rng.choice([0.3, 0.5, 1.0]),
                rng.choice([0.6, 0.8, 1.0]),
            )
        )
    cases.append(("Llama-7B", "H200", -5, 0.5, 0.8))

    def run_one(c):
        m, g, ctx, mfu, mbu = c
        args = (MODELS[m], GPUS[g], ctx, mfu, mbu)
        expect_equal_to_reference(
            "smallest compute-bound batch (None if none)",
            lambda: ref_ridge_batch(*args),
            lambda: ridge_batch(*args),
        )

    def describe(c):
        m, g, ctx, mfu, mbu = c
        return f"ridge_batch(MODELS[{m!r}], GPUS[{g!r}], context_len={ctx}, mfu={mfu}, mbu={mbu})"

    run_cases("ex0.4", cases, run_one, size=lambda c: (c[2] < 0, c[2]), describe=describe)


# -- ex0.5: concept questions with a number or a choice ----------------------------------------

# question id -> (what is asked, the answer, how to compare: "choice" or a relative tolerance)
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
    "CHECKS",
    "QUESTIONS",
    "SPECS",
    "EVENTS",
    "STATEMENTS",
    "ExerciseFailure",
    "ref_decode_step_time",
    "ref_ridge_batch",
    "reference_tables",
]
