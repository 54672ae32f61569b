"""Generator of notebooks/exercises/ch08_vllm_today.ipynb (chapter 08 exercises)."""

from _common import ExerciseNotebook

from minipaged.checks.ch08 import ADMIT_KNOBS, ADMIT_REQUESTS, BATCH_KNOBS, BATCH_WORKLOAD, admit_request_row

# the table of ex8.2 (a student copy made with --seed gets its own requests, written in)
ADMIT_TABLE = "\n".join(f"    {admit_request_row(r)}" for r in ADMIT_REQUESTS)

nb = ExerciseNotebook(
    chapter="ch08",
    filename="ch08_vllm_today.ipynb",
    title="Chapter 08 exercises: vLLM v1's admission and its persistent batch",
    minutes=55,
    intro="""
    Companion to `notebooks/08_vllm_today.ipynb`. You will write vLLM v1's admission gate
    (`scheduler_reserve_full_isl` and the watermark), predict what that one setting changes
    in a small run, and write the bookkeeping of the worker's *persistent batch* (vLLM v1's
    `InputBatch`: rows that stay put between steps, holes, `condense`), then measure what it
    saves against rebuilding the batch every step.
    """,
)

# NOTE: the setup cell holds the data as literals: a submission may not import minipaged.checks
nb.setup(f"""
from minipaged.core import cdiv

# ex8.2: (request id, prompt tokens, max_tokens, arrival step), and the v1 scheduler's knobs
ADMIT_REQUESTS = {ADMIT_REQUESTS!r}
ADMIT_KNOBS = {ADMIT_KNOBS!r}
# ex8.3: the workload the persistent batch is measured on (same format), and the knobs
BATCH_WORKLOAD = {BATCH_WORKLOAD!r}
BATCH_KNOBS = {BATCH_KNOBS!r}
""")

nb.exercise(
    "ex8.1",
    "v1's admission gate",
    """
    A waiting request holds no blocks. It has `num_tokens` tokens in all (its prompt, or
    prompt + output so far after a recompute) and would compute its first chunk of
    `first_chunk` tokens this step. vLLM v1's `allocate_slots(..., full_sequence_must_fit,
    watermark_blocks)` admits it when

    - with `reserve_full_isl` (`scheduler_reserve_full_isl=True`, the default): the blocks of
      *all* its `num_tokens` tokens, plus `watermark_blocks`, are free; and
    - in any case: the blocks of its first chunk, plus `watermark_blocks`, are free.

    Write `can_admit(num_free_blocks, block_size, num_tokens, first_chunk, reserve_full_isl,
    watermark_blocks) -> bool`. Raise `ValueError` unless `1 <= first_chunk <= num_tokens`.

    Hand check: 40 tokens, blocks of 4, a first chunk of 32, 9 free blocks: with the full
    reservation it needs 10 (no); without, 8 (yes).
    """,
    """
    def can_admit(num_free_blocks: int, block_size: int, num_tokens: int, first_chunk: int,
                  reserve_full_isl: bool, watermark_blocks: int) -> bool:
        \"\"\"Whether v1 admits a waiting request this step.\"\"\"
        ### BEGIN SOLUTION
        if not 1 <= first_chunk <= num_tokens:
            raise ValueError(f"first_chunk must be in [1, {num_tokens}], got {first_chunk}")
        if reserve_full_isl and cdiv(num_tokens, block_size) + watermark_blocks > num_free_blocks:
            return False
        return cdiv(first_chunk, block_size) + watermark_blocks <= num_free_blocks
        ### END SOLUTION
    """,
    ["can_admit"],
)

nb.exercise(
    "ex8.2",
    "predict admission with and without the full reservation (on paper first)",
    """
    A v1 `Scheduler(num_blocks=5, block_size=2, max_num_seqs=3, max_num_batched_tokens=4)`
    (chunked prefill on, no watermark) serves the requests of `ADMIT_REQUESTS` (no request
    stops early; your copy's requests may differ from a classmate's):

    | request | prompt tokens | max_tokens | arrives before step |
    |---|---|---|---|
{ADMIT_TABLE}

    Work the run out twice: with `scheduler_reserve_full_isl=True` and with `False`
    (ex8.1's gate). The rest is chapters 04 and 05: running requests first, then waiting
    ones in arrival order, one budget of 4 tokens shared by prefill chunks and decodes; a
    running request short of blocks preempts the last of `running` by recompute, and nobody
    is admitted in that step.

    Write `predict_admission()`: `{"True": {...}, "False": {...}}`, each
    `{"first_step": {request id: the first step it is scheduled}, "preemptions": how many in
    the run, "steps": how many steps the run takes}`. The check says which entry is wrong and
    what you gave, not the answer.
    """.replace("{ADMIT_TABLE}\n", ADMIT_TABLE + "\n"),
    """
    def predict_admission() -> dict:
        \"\"\"For each setting: first step of each request, preemptions, steps.\"\"\"
        ### BEGIN SOLUTION
        return {
            "True": {"first_step": {"A": 0, "B": 4, "C": 5}, "preemptions": 1, "steps": 8},
            "False": {"first_step": {"A": 0, "B": 1, "C": 5}, "preemptions": 2, "steps": 8},
        }
        ### END SOLUTION
    """,
    ["predict_admission"],
)

nb.exercise(
    "ex8.3",
    "the persistent batch: rows, holes and condense (measure)",
    """
    vLLM v1's worker keeps its batch *between* steps (`vllm/v1/worker/gpu_input_batch.py`):
    each running request owns a row of the input tensors, and a step writes only what
    changed. `rows[i]` is the request id in row `i` (`None`: an empty row). Each step:

    1. every request of `leaving` (finished, preempted or not scheduled) frees its row;
    2. each request of `joining`, in order, takes the lowest free row, or a new row at the end;
    3. `condense`: while an empty row lies below a request, the request of the *last* row
       moves into the *lowest* empty row (one move each); trailing empty rows are dropped.

    - **Write** `update_batch(rows, leaving, joining)` -> `(new rows, moves)`.
    - **Failure mode**: `rows` holding a request twice, `leaving` naming a request not in
      `rows` (or twice), `joining` naming one already there (or twice) -> `ValueError`.

    Hand check: rows `["a", "b", "c", "d"]`, `"a"` and `"c"` leave, `"e"` joins: `"e"` takes
    row 0, `"d"` moves into row 2: `(["e", "b", "d"], 1)`.

    The check then prints how many rows the persistent batch writes over `BATCH_WORKLOAD`
    (12 requests through a v1 `Scheduler` of 8 rows: joining requests and moves) against a
    batch rebuilt every step. Predict first: how many times fewer?
    """,
    """
    def update_batch(rows: list, leaving: list, joining: list) -> tuple[list, int]:
        \"\"\"The persistent batch after a step: rows and the number of moves condense made.\"\"\"
        ### BEGIN SOLUTION
        here = [r for r in rows if r is not None]
        if len(set(here)) != len(here):
            raise ValueError(f"a request holds two rows: {rows}")
        if len(set(leaving)) != len(leaving) or not set(leaving) <= set(here):
            raise ValueError(f"leaving must name distinct requests of rows: {leaving}")
        if len(set(joining)) != len(joining) or set(joining) & set(here):
            raise ValueError(f"joining must name distinct new requests: {joining}")
        new = [None if r in leaving else r for r in rows]
        for r in joining:
            if None in new:
                new[new.index(None)] = r
            else:
                new.append(r)
        moves = 0
        while True:
            while new and new[-1] is None:
                new.pop()
            if None not in new:
                return new, moves
            new[new.index(None)] = new.pop()
            moves += 1
        ### END SOLUTION
    """,
    ["update_batch"],
)

nb.exercise(
    "ex8.4",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure every
    question has an answer of the right kind, and a graded failure says how many are wrong,
    never which.

    - `q1`: which preemption mode does vLLM v1 have: `"swap"` or `"recompute"`?
    - `q2`: a waiting request of 40 tokens, blocks of 4, its first chunk 32 tokens, 9 free blocks, no watermark: is it admitted with `scheduler_reserve_full_isl=True`? `"yes"` or `"no"`
    - `q3`: with `block_size = 16` and `k = 4` lookahead slots, the most extra blocks a decoding request needs
    - `q4`: under FCFS, are v1's victim (the last of `running`) and v0's (the latest arrival) the same request: `"yes"` or `"no"`?

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": "recompute", "q2": "no", "q3": 1, "q4": "yes"}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. In ex8.2 first-chunk admission starts work sooner; what does it cost, and on which
   workloads does it pay (chapter 08, section 1)?
2. ex8.3's `condense` moves the *last* request into the *lowest* hole. Why not shift every
   request after a hole down by one, which keeps the batch in arrival order?
3. The persistent batch saves host work, not GPU work. Why does that matter more on a GPU
   than on this CPU (chapter 08, section 6)?

## Recap

vLLM v1 admits a waiting request by one rule, `scheduler_reserve_full_isl`: the whole
sequence must fit (the default), or only its first chunk (sooner, and thrash under a tight
pool). Its worker keeps a persistent batch: a step frees the rows of leaving requests, fills
the lowest holes with new ones and condenses from the end, so most steps write a few rows,
not the whole batch.
""")

if __name__ == "__main__":
    nb.build()
