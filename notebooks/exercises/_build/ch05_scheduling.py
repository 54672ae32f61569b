"""Generator of notebooks/exercises/ch05_scheduling.ipynb (chapter 05 exercises)."""

from _common import ExerciseNotebook, _md

from minipaged.checks.ch05 import (
    DESIGN_KNOBS,
    DESIGN_WORKLOAD,
    PREDICT_KNOBS,
    PREDICT_REQUESTS,
    predict_request_text,
)

# the table of ex5.5 (a student copy made with --seed gets its own requests, written in)
PREDICT_TABLE = "\n".join(f"    | {k} | {predict_request_text(r)} |" for k, r in enumerate(PREDICT_REQUESTS))

nb = ExerciseNotebook(
    chapter="ch05",
    filename="ch05_scheduling.ipynb",
    title="Chapter 05 exercises: token budget, chunked prefill, preemption",
    minutes=85,
    intro="""
    Companion to `notebooks/05_scheduling.ipynb`. You will write how many tokens a request
    gets under the token budget, which running request is preempted when memory runs out,
    preemption by recompute, and the running phase of `Scheduler.schedule()` that ties them
    together. The checks run the package's `minipaged.core.Scheduler` on an identical twin
    of the state your code gets and compare queues, statuses, token counts, block tables
    and the free queue.

    Scheduler fields you may use: `running` (a list, in arrival order), `waiting` (a
    `deque`, in arrival order, preempted requests included), `kv_cache_manager`
    (`allocate_slots`, `free`); each request's `arrival_order` (its rank in arrival order),
    `enable_chunked_prefill`, `max_num_batched_tokens`.
    """,
)

# NOTE: the setup cell holds the runs as literals: a submission may not import minipaged.checks
nb.setup(f"""
from minipaged.core import Request, RequestStatus, cdiv

# ex5.5: (request id, prompt tokens, max_tokens, arrival step), and the scheduler's knobs
PREDICT_REQUESTS = {PREDICT_REQUESTS!r}
PREDICT_KNOBS = {PREDICT_KNOBS!r}
# ex5.6: the workload your admission rule is measured on (same format), and the knobs
DESIGN_WORKLOAD = {DESIGN_WORKLOAD!r}
DESIGN_KNOBS = {DESIGN_KNOBS!r}
""")

nb.exercise(
    "ex5.1",
    "how many tokens a request gets this step",
    """
    A request has `n = request.num_tokens - request.num_computed_tokens` tokens left to
    compute (its whole prompt when fresh; prompt + output so far after a recompute
    preemption; 1 when decoding). Write `num_new_tokens(request, token_budget,
    enable_chunked_prefill, max_num_batched_tokens)`:

    - if `n <= token_budget`: all `n`;
    - else with chunked prefill on: `token_budget` (a chunk now, the rest in later steps);
    - else, if `n > max_num_batched_tokens` (it could never run whole: a resumed request
      whose prompt + output outgrew the budget): `token_budget` anyway, or it would starve;
    - else `0`: it must wait for a step with enough budget.
    """,
    """
    def num_new_tokens(request: Request, token_budget: int, enable_chunked_prefill: bool,
                       max_num_batched_tokens: int) -> int:
        \"\"\"Tokens to schedule for `request` under `token_budget` (0 = it must wait).\"\"\"
        ### BEGIN SOLUTION
        n = request.num_tokens - request.num_computed_tokens
        if n <= token_budget:
            return n
        if enable_chunked_prefill or n > max_num_batched_tokens:
            return token_budget
        return 0
        ### END SOLUTION
    """,
    ["num_new_tokens"],
)

nb.exercise(
    "ex5.2",
    "the preemption victim",
    """
    When a running request needs a block and none is free, the scheduler must pick a
    running request to preempt. vLLM's policy is FCFS fairness: the oldest requests keep
    going, so every request that fits alone eventually finishes.

    - **Inputs**: `running`, a non-empty list of requests in batch order (*not* necessarily
      arrival order); `arrival_seq`, request id -> arrival rank (smaller = earlier).
    - **Output**: the request that must give way under that policy.
    - **Invariants**: `running` is unchanged (same requests, same order); the answer is
      one of its elements (the object itself, not its id).
    - **Failure mode**: an empty `running` is a caller's bug: raise `ValueError`.

    Worked example: batch order `[C, A, B]` with ranks `A=0, B=1, C=2` -> `C`.
    """,
    """
    def pick_victim(running: list, arrival_seq: dict) -> Request:
        \"\"\"The running request that arrived last.\"\"\"
        ### BEGIN SOLUTION
        if not running:
            raise ValueError("running must not be empty")
        return max(running, key=lambda request: arrival_seq[request.request_id])
        ### END SOLUTION
    """,
    ["pick_victim"],
)

nb.exercise(
    "ex5.3",
    "preemption by recompute",
    """
    Write `preempt_recompute(scheduler, victim)`: the victim gives up its KV cache and
    will be prefilled again (prompt *and* output so far) when it is admitted next.

    - remove it from `scheduler.running` and free its blocks
      (`scheduler.kv_cache_manager.free(victim)`);
    - `num_computed_tokens = 0`, status `RequestStatus.PREEMPTED`, `num_preemptions += 1`;
    - put it into `scheduler.waiting` *by arrival order* (`request.arrival_order`): it
      arrived before every fresh waiting request, so it lands before them, but after
      preempted requests that arrived earlier than it.
    """,
    """
    def preempt_recompute(scheduler, victim: Request) -> None:
        \"\"\"Free the victim's blocks and requeue it, to be recomputed later.\"\"\"
        ### BEGIN SOLUTION
        scheduler.running.remove(victim)
        scheduler.kv_cache_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        i = 0
        while i < len(scheduler.waiting) and scheduler.waiting[i].arrival_order < victim.arrival_order:
            i += 1
        scheduler.waiting.insert(i, victim)
        ### END SOLUTION
    """,
    ["preempt_recompute"],
)

nb.exercise(
    "ex5.4",
    "the running phase of schedule(), with preemption",
    """
    Write `schedule_running(scheduler, token_budget)`, the first half of `schedule()`:
    every running request gets its tokens for this step, and when the pool runs dry,
    requests are preempted (your ex5.2 and ex5.3) until the allocation fits.

    - **Inputs**: the scheduler between steps; `token_budget`, the tokens this step may
      compute (`max_num_batched_tokens` at the start of a step).
    - **Output**: `(scheduled, preempted)`: the `(request, n)` pairs that got tokens, in
      `running` order, and the preempted requests in the order they were preempted.
    - **Invariants**: running requests are served front to back (arrival order), each with
      `n` from your ex5.1 (a request that gets 0 is skipped, those behind it are still
      served); the scheduled tokens sum to at most `token_budget`; every scheduled request
      holds blocks for `num_computed_tokens + n` tokens; only the latest arrivals are
      preempted, and only when an allocation failed; a preempted request is never
      scheduled in this step; if the request asking for blocks is itself the victim,
      nothing after it is served (it was the last one).
    - **Failure mode**: none for the caller; with one request that alone does not fit
      the pool the scheduler refuses it at `add_request`, so that cannot happen here.

    Worked example: 5 free blocks of 2 slots are all taken; A (arrived first) and B are
    decoding and A's next token needs a new block: B is preempted (its blocks freed), A
    gets its block; result `([(A, 1)], [B])`.
    """,
    """
    def schedule_running(scheduler, token_budget: int):
        \"\"\"Grow every running request by its tokens for this step, preempting if needed.\"\"\"
        ### BEGIN SOLUTION
        scheduled, preempted = [], []
        i = 0
        while i < len(scheduler.running) and token_budget > 0:
            request = scheduler.running[i]
            n = num_new_tokens(request, token_budget, scheduler.enable_chunked_prefill,
                               scheduler.max_num_batched_tokens)
            if n == 0:
                i += 1
                continue
            new_blocks = scheduler.kv_cache_manager.allocate_slots(request, n)
            while new_blocks is None:
                ranks = {r.request_id: r.arrival_order for r in scheduler.running}
                victim = pick_victim(scheduler.running, ranks)
                preempt_recompute(scheduler, victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = scheduler.kv_cache_manager.allocate_slots(request, n)
            if new_blocks is None:
                break
            scheduled.append((request, n))
            token_budget -= n
            i += 1
        return scheduled, preempted
        ### END SOLUTION
    """,
    ["schedule_running"],
)

nb.cells.append(
    _md(
        """
<details><summary>Hints for ex5.4 (open only if stuck)</summary>

- Walk `scheduler.running` by index, not with `for r in running`: preemption removes
  requests from the end of the list while you walk it.
- `allocate_slots` returns `None` and takes nothing when the blocks are short: retry after
  each preemption.
</details>
""",
        "ex5-4-hints",
    )
)

nb.exercise(
    "ex5.5",
    "predict a run under memory pressure (on paper first)",
    """
    A v1 `Scheduler(num_blocks=5, block_size=2, max_num_seqs=3, max_num_batched_tokens=8)`
    serves the requests of `PREDICT_REQUESTS` (no request stops early; your copy's
    requests may differ from a classmate's):

    | event | what happens |
    |---|---|
{PREDICT_TABLE}

    Ten slots are few: someone will be preempted. What you need from chapters 04 and 05:
    between steps a request holds blocks for its computed tokens; a step needs blocks for
    the tokens it computes; when a running request's blocks are short, the latest-arrived
    running request is preempted by recompute (and nobody is admitted in that step); a
    preempted request later re-prefills prompt and output so far.

    Write `predict_run()`: one dict per step until every request has finished,
    `{"scheduled": {request id: tokens}, "preempted": [request ids preempted in that
    step]}`. Example: had only A (prompt 4) and B (prompt 3) arrived before step 0, step 0
    would be `{"scheduled": {"A": 4, "B": 3}, "preempted": []}`. Work it out on paper
    first: the check is graded from what this cell returns, and a wrong answer is told
    which step is wrong and what you gave, not the scheduler's answer.
    """.replace("{PREDICT_TABLE}\n", PREDICT_TABLE + "\n"),
    """
    def predict_run() -> list[dict]:
        \"\"\"Per step: the scheduled tokens and the preempted requests.\"\"\"
        ### BEGIN SOLUTION
        return [
            {"scheduled": {"A": 4, "B": 3}, "preempted": []},
            {"scheduled": {"A": 1, "B": 1}, "preempted": []},
            {"scheduled": {"A": 1}, "preempted": ["B"]},
            {"scheduled": {"A": 1}, "preempted": []},
            {"scheduled": {"A": 1}, "preempted": []},
            {"scheduled": {"B": 5, "C": 2}, "preempted": []},
            {"scheduled": {"B": 1, "C": 1}, "preempted": []},
            {"scheduled": {"C": 1}, "preempted": []},
        ]
        ### END SOLUTION
    """,
    ["predict_run"],
)

nb.exercise(
    "ex5.6",
    "an admission rule of your design, measured",
    """
    With `scheduler_reserve_full_isl=False` vLLM v1 admits a waiting request as soon as the
    blocks of its first chunk are free; running requests then grow into the pool and, when
    it is full, preemption pays for the optimism by recomputing. (vLLM 0.32's default, `True`,
    waits until the blocks for the request's whole sequence are free: its prompt, plus the
    tokens it had already produced when it was preempted, against exactly that thrash.) The
    scheduler here starts from the first-chunk rule: design your own.

    - **The bar** (read it first): on the checker's 201 workloads taken together, at most
      half the preemptions of the default rule, with at most 10% more steps (throughput
      within 10%); totals, so a rule may lose a little on one workload and win on others.
      Always admitting (`lambda s, r: True`) is the default rule, so it does not pass; a
      rule that refuses more than it must (admitting a request only when its own whole
      `max_tokens` fits too, beside every running request's, say) never preempts but
      costs steps, and misses the 10% on most draws of workloads.
    - **The hook**: the scheduler calls `can_admit(scheduler, request)` for the head of
      `waiting` after the running requests got their blocks for this step (so their block
      tables already include this step), when a seat and budget are left and before
      allocating. Return `True` to admit it now, `False` to keep it (and everyone behind
      it: FCFS) waiting for a later step.
    - **What you may read**: `scheduler.running`, `scheduler.waiting`,
      `scheduler.block_size`, `scheduler.num_blocks`,
      `scheduler.kv_cache_manager.get_num_free_blocks()`,
      `scheduler.kv_cache_manager.get_block_ids(request_id)`; per request `num_tokens`,
      `num_prompt_tokens`, `num_computed_tokens`, `max_tokens`. Change nothing.
    - **Invariants the check enforces**, on `DESIGN_WORKLOAD` and on random workloads
      (the graded run draws other random workloads than your local check): no
      request is lost, every one gets its `max_tokens` tokens, admission stays FCFS, the
      scheduler's invariants hold after every step, and the run ends (no livelock: if
      your rule refuses while nothing runs, nothing can ever change).
    - **What it prints** (the local check): steps and preemptions of `DESIGN_WORKLOAD`
      under the default rule and under yours. There is no single right answer: a reserve
      for what the running requests will still grow, a watermark of free blocks, a cap on
      the batch... measure each against the bar.

    **Your code powers the rest**: the scheduler that asks your rule grows its running
    requests with your `schedule_running` (ex5.4, and through it your ex5.1-ex5.3); its
    admission around your hook is the package's.
    """,
    """
    def can_admit(scheduler, request) -> bool:
        \"\"\"Admit the head of waiting now?\"\"\"
        ### BEGIN SOLUTION
        # Reserve: admit only if every running request can still reach its max_tokens
        # after this one took its whole prompt; never preempts, may admit later.
        if not scheduler.running:
            return True  # else nothing could ever run: livelock
        kv, bs = scheduler.kv_cache_manager, scheduler.block_size
        reserved = sum(cdiv(r.num_prompt_tokens + r.max_tokens - 1, bs) - len(kv.get_block_ids(r.request_id))
                       for r in scheduler.running)
        return kv.get_num_free_blocks() - reserved >= cdiv(request.num_tokens, bs)
        ### END SOLUTION
    """,
    ["can_admit"],
)

nb.cells.append(
    _md(
        """
<details><summary>Hints for ex5.6 (open only if stuck)</summary>

- A request of `p` prompt tokens and `max_tokens` m holds at most `cdiv(p + m - 1,
  block_size)` blocks (the last sampled token is never fed back).
- Whatever your rule, it must say `True` when nothing is running.
</details>
""",
        "ex5-6-hints",
    )
)

nb.exercise(
    "ex5.7",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure
    every question has an answer of the right kind, and a graded failure says how many
    are wrong, never which.

    - `q1`: on ex5.5's scheduler, A (prompt 4, max_tokens 5) and B (prompt 3, max_tokens
      4) arrive before step 0 and C (prompt 2, max_tokens 3) before step 1 (the shipped
      `PREDICT_REQUESTS`; your copy's may differ): how many preemptions happen?
    - `q2`: in that run, how many tokens does the preempted request compute when it is
      admitted again?
    - `q3`: which running request does the v1 scheduler preempt, the `"last"` or the
      `"first"` arrival?
    - `q4`: can the default rule (always admit) cause a preemption that a rule reserving
      every running request's `max_tokens` avoids: `"yes"` or `"no"`?

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 1, "q2": 5, "q3": "last", "q4": "yes"}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. Your rule of ex5.6 against the default: which costs more on `DESIGN_WORKLOAD`, the
   steps you lose by admitting later or the tokens the default recomputes? Would the
   answer change with outputs much shorter than `max_tokens` (eos)?
2. Why must an admission rule say yes when nothing is running, and why does FCFS then
   guarantee that every request that fits alone finishes?
3. In ex5.5, why is nobody admitted in the step that preempts?

## Recap

The token budget bounds each step's work; chunked prefill lets a long prompt share steps
with decodes. When memory runs out, the latest arrival is preempted, so the earliest keeps
progressing: recompute throws its KV away and pays a re-prefill later, which is cheap for
short sequences and is what vLLM does by default.
""")

if __name__ == "__main__":
    nb.build()
