"""Generator of notebooks/exercises/ch04_continuous_batching.ipynb (chapter 04 exercises)."""

from _common import ExerciseNotebook, _md

from minipaged.checks.ch04 import (
    PREDICT_KNOBS,
    PREDICT_REQUESTS,
    SERVE_KNOBS,
    SERVE_WORKLOAD,
    predict_request_row,
)

nb = ExerciseNotebook(
    chapter="ch04",
    filename="ch04_continuous_batching.ipynb",
    title="Chapter 04 exercises: continuous batching",
    minutes=70,
    intro="""
    Companion to `notebooks/04_continuous_batching.ipynb`. You will write the two halves of
    one engine step around the model: the admission loop that lets waiting requests join
    the running batch, and the update after the model ran that appends tokens, finishes
    requests and frees their blocks. Your functions act on a real
    `minipaged.core.Scheduler` (its own `schedule` / `update_from_output` switched off);
    the check runs the package's scheduler on an identical twin and compares the two.

    What your code may touch: `scheduler.waiting` (a `deque` of `Request`, arrival order),
    `scheduler.running` (a `list`), `scheduler.requests` (the unfinished ones, id -> request)
    and `scheduler.finished_req_ids` (a `set`: ids finished since the last step),
    `scheduler.kv_cache_manager` (`allocate_slots(request, n)` -> new blocks or `None`,
    `free(request)`), `scheduler.max_num_seqs`, `scheduler.max_model_len`. A `Request` has
    `request_id`, `status`, `num_tokens` (prompt + output so far), `num_computed_tokens`
    (tokens whose K/V are in the cache), `output_token_ids`, `sampling_params`
    (`max_tokens`, `ignore_eos`, `stop_token_ids`) and `eos_token_id`.
    """,
)

# NOTE: the setup cell holds the runs as literals: a submission may not import minipaged.checks
nb.setup(f"""
from minipaged.core import Request, RequestStatus, Scheduler

# ex4.4: (request id, prompt tokens, max_tokens, arrival step), and the scheduler's knobs
PREDICT_REQUESTS = {PREDICT_REQUESTS!r}
PREDICT_KNOBS = {PREDICT_KNOBS!r}
# ex4.5: the workload your engine loop serves (same format), and the knobs besides max_num_seqs
SERVE_WORKLOAD = {SERVE_WORKLOAD!r}
SERVE_KNOBS = {SERVE_KNOBS!r}
""")

nb.exercise(
    "ex4.1",
    "the admission loop",
    """
    Write `schedule_waiting(scheduler, token_budget)`, the second half of `schedule()`:
    the running requests already got their tokens this step and `token_budget` tokens are
    left for newcomers.

    - **Inputs**: `scheduler` (its `waiting` deque in arrival order, `running`,
      `max_num_seqs`, `kv_cache_manager`); `token_budget >= 0`.
    - **Output**: the `(request, n)` pairs admitted this step, in admission order; `n` is
      how many of the request's tokens it computes now (with chunked prefill a long prompt
      may take only part of what is left and continue next step).
    - **Invariants** (the check compares them with the package's scheduler on many seeded
      states): admission is FCFS, never skipping ahead; at most `max_num_seqs` requests
      run; the admitted `n`s sum to at most `token_budget`, each `n >= 1`; every admitted
      request has KV slots for its `n` tokens, is `RUNNING` and in `running` (appended, in
      order), and nobody else's state changed.
    - **Failure mode**: when the pool cannot hold the head's tokens (`allocate_slots`
      returns `None`), nothing half-happens: the head and everyone behind it keep waiting.

    Worked example: budget 10, `max_num_seqs` 4, one request running; waiting A (prompt 6)
    then B (prompt 12), the pool has room for both. Admitted: `[(A, 6), (B, 4)]`; B
    continues next step with 8 tokens left; budget used up.
    """,
    """
    def schedule_waiting(scheduler, token_budget: int) -> list:
        \"\"\"Admit waiting requests FCFS while seats, tokens and KV blocks last.\"\"\"
        ### BEGIN SOLUTION
        admitted = []
        while token_budget > 0 and len(scheduler.running) < scheduler.max_num_seqs and scheduler.waiting:
            request = scheduler.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if scheduler.kv_cache_manager.allocate_slots(request, n) is None:
                break  # FCFS: the head waits, and everyone behind it
            scheduler.waiting.popleft()
            request.status = RequestStatus.RUNNING
            scheduler.running.append(request)
            admitted.append((request, n))
            token_budget -= n
        return admitted
        ### END SOLUTION
    """,
    ["schedule_waiting"],
)

nb.cells.append(
    _md(
        """
<details><summary>Hints for ex4.1 (open only if stuck)</summary>

- One loop over the head of `scheduler.waiting` while there is budget, a free seat and a
  request waiting; `n` is the smaller of its tokens still to compute and the budget.
- Ask `scheduler.kv_cache_manager.allocate_slots(request, n)` before you touch any queue.
</details>
""",
        "ex4-1-hints",
    )
)

nb.exercise(
    "ex4.2",
    "does the newest token finish the request?",
    """
    Write `check_stop(request, max_model_len)`, called right after a token was appended
    to `request.output_token_ids`. Check, in this order (vLLM's), and at the first that
    holds set `request.status` and a short `request.stop_reason` (any non-empty string)
    and return `True`:

    1. `num_output_tokens >= sampling_params.max_tokens` -> `FINISHED_LENGTH`;
    2. `max_model_len` is not `None` and `num_tokens >= max_model_len` -> `FINISHED_LENGTH`;
    3. the newest token is `request.eos_token_id` (when that is not `None`), unless
       `sampling_params.ignore_eos` -> `FINISHED_STOPPED`;
    4. the newest token is in `sampling_params.stop_token_ids` -> `FINISHED_STOPPED`.

    Otherwise change nothing and return `False`.
    """,
    """
    def check_stop(request: Request, max_model_len) -> bool:
        \"\"\"Finish `request` if its newest token ends it; True if it did.\"\"\"
        ### BEGIN SOLUTION
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.max_tokens:
            request.status, request.stop_reason = RequestStatus.FINISHED_LENGTH, "max_tokens"
        elif max_model_len is not None and request.num_tokens >= max_model_len:
            request.status, request.stop_reason = RequestStatus.FINISHED_LENGTH, "max_model_len"
        elif not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, "eos"
        elif token in params.stop_token_ids:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, f"stop token {token}"
        else:
            return False
        return True
        ### END SOLUTION
    """,
    ["check_stop"],
)

nb.exercise(
    "ex4.3",
    "after the model ran: advance, append, finish, free",
    """
    Write `update_from_output(scheduler, scheduled, sampled_token_ids)`, the second half
    of an engine step.

    - **Inputs**: `scheduled`, the `(request, n)` pairs this step computed, in batch order;
      `sampled_token_ids`, request id -> the token the model sampled, present exactly for
      the requests whose prefill this step completed (a decode always completes it).
    - **Output**: the requests that finished this step, in batch order.
    - **Afterwards** (the invariants the check compares with the package's scheduler):
      every scheduled request's `num_computed_tokens` counts this step's tokens; each
      request that got a token has it at the end of `output_token_ids`; a request is
      finished exactly when your `check_stop` (ex4.2) says so, and then it is no longer
      in `scheduler.running`, holds no blocks (its blocks are back in the free queue) and
      is forgotten, as vLLM v1 forgets it: gone from `scheduler.requests`, its id in
      `scheduler.finished_req_ids` (the worker drops it at the next step). A prefill chunk that does not complete the
      prompt gets no token and cannot finish.
    - **Failure mode**: a request that completed its prefill but has no entry in
      `sampled_token_ids` is a caller's bug: a `KeyError` is fine.

    Worked example: `scheduled = [(A, 1), (B, 4)]`, A decoding with 9 tokens computed of
    10, B mid-prompt with 4 of 12 computed, `sampled_token_ids = {"A": 2}` where 2 is A's
    eos: A has 10 computed, output `[..., 2]`, is finished and freed; B has 8 computed
    and no new token. Returned: `[A]`.

    Useful: `request.append_output_token_id(token)`,
    `scheduler.kv_cache_manager.free(request)`.
    """,
    """
    def update_from_output(scheduler, scheduled: list, sampled_token_ids: dict) -> list:
        \"\"\"Advance the scheduled requests; finish and free the ones that are done.\"\"\"
        ### BEGIN SOLUTION
        finished = []
        for request, n in scheduled:
            request.num_computed_tokens += n
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: no token yet
            request.append_output_token_id(sampled_token_ids[request.request_id])
            if check_stop(request, scheduler.max_model_len):
                scheduler.running.remove(request)
                scheduler.kv_cache_manager.free(request)
                del scheduler.requests[request.request_id]
                scheduler.finished_req_ids.add(request.request_id)
                finished.append(request)
        return finished
        ### END SOLUTION
    """,
    ["update_from_output"],
)

nb.cells.append(
    _md(
        """
<details><summary>Hints for ex4.3 (open only if stuck)</summary>

- Advance first, then ask: is `num_computed_tokens` now equal to `num_tokens`? Only then
  does the request own a sampled token.
- Removing from `running` while you loop over `scheduled` is safe: they are different lists.
</details>
""",
        "ex4-3-hints",
    )
)

nb.exercise(
    "ex4.4",
    "predict the next steps (on paper first)",
    """
    A v1 `Scheduler(num_blocks=16, block_size=4, max_num_seqs=3,
    max_num_batched_tokens=8)` (chunked prefill on) serves the requests of
    `PREDICT_REQUESTS`:

    | request | prompt tokens | max_tokens | arrives before step |
    |---|---|---|---|
{PREDICT_ROWS}

    No request stops early (`ignore_eos`). What you need from chapter 04: running requests
    are served first, in arrival order, then waiting ones are admitted in arrival order
    while seats, budget and blocks last; a request gets all its remaining tokens or what is
    left of the budget (a chunk); the step that completes a prompt samples its first
    output token; a request finishes in the step that samples its `max_tokens`-th token,
    and its seat is free from the next step.

    Write `predict_steps()`: a list with one dict per step until every request has
    finished, mapping each request scheduled in that step to its number of tokens. Work it
    out on paper; do not run a scheduler. Example, for other requests: a step that runs
    6 tokens of X and 2 of Y is `{"X": 6, "Y": 2}`. The check compares step by step and
    names the first wrong step (never the right answer).
    """.replace("{PREDICT_ROWS}", "\n".join("    " + predict_request_row(r) for r in PREDICT_REQUESTS)),
    """
    def predict_steps() -> list[dict[str, int]]:
        \"\"\"Request id -> tokens scheduled, for each step of the run.\"\"\"
        ### BEGIN SOLUTION
        return [
            {"A": 6, "B": 2},
            {"A": 1, "B": 3, "C": 4},
            {"A": 1, "B": 1, "C": 1},
            {"A": 1, "C": 1, "D": 5},
            {"D": 1},
        ]
        ### END SOLUTION
    """,
    ["predict_steps"],
)

nb.exercise(
    "ex4.5",
    "the engine loop, and what max_num_seqs buys (measure)",
    """
    Write `serve(scheduler, arrivals)`: the loop an engine runs around the scheduler, with
    a fake model.

    - **Inputs**: a fresh `Scheduler`; `arrivals`, step -> list of fresh `Request`s to add
      (`scheduler.add_request`) just before that step's `schedule()`.
    - **The fake model**: every request whose prefill completes in a step samples token
      `1`; give those tokens to `scheduler.update_from_output(output, sampled)`, exactly
      once after each `schedule()`.
    - **Output**: request id -> the step (0-based) in which it finished.
    - **Invariants**: it returns only when every request has arrived and finished
      (`scheduler.has_unfinished_requests()` is false); no request is lost; each gets its
      `max_tokens` tokens.
    - **Failure mode**: a loop that never ends is a bug; the scheduler itself raises
      `RuntimeError` if a step could do nothing while requests wait.

    The check runs your loop on `SERVE_WORKLOAD` with `max_num_seqs` 1, 2, 4 and 8 (and
    on other small workloads), compares every finish step with the package's driver, and
    prints what your loop measured on `SERVE_WORKLOAD`: the steps the workload took and
    the mean finish step. Before you run it: how much
    should 8 seats gain over 1 here, and why not 8 times?

    **Your code powers the rest**: the scheduler your `serve` drives admits with your
    `schedule_waiting` (ex4.1) and updates with your `update_from_output` (ex4.3), which
    stops requests with your `check_stop` (ex4.2): its running phase is the package's.
    (The package's own loop, `trace.run_scheduler`, is not there when graded.)
    """,
    """
    def serve(scheduler, arrivals: dict) -> dict[str, int]:
        \"\"\"Run `scheduler` with a fake model until every request finished.\"\"\"
        ### BEGIN SOLUTION
        finish_step = {}
        last = max(arrivals, default=0)
        step = 0
        while step <= last or scheduler.has_unfinished_requests():
            for request in arrivals.get(step, []):
                scheduler.add_request(request)
            output = scheduler.schedule()
            sampled = {r.request_id: 1 for r, n in output.scheduled
                       if r.num_computed_tokens + n == r.num_tokens}
            for request in scheduler.update_from_output(output, sampled):
                finish_step[request.request_id] = step
            step += 1
        return finish_step
        ### END SOLUTION
    """,
    ["serve"],
)

nb.cells.append(
    _md(
        """
<details><summary>Hints for ex4.5 (open only if stuck)</summary>

- Read `sampled` off `output.scheduled` *before* `update_from_output` advances the
  counters: a request's prefill completes this step when
  `num_computed_tokens + n == num_tokens`.
- Keep looping while arrivals are still to come, even if nothing is unfinished right now.
</details>
""",
        "ex4-5-hints",
    )
)

nb.exercise(
    "ex4.6",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure
    every question has an answer of the right kind, and a graded failure says how many
    are wrong, never which.

    - `q1`: the scheduler of ex4.4, but with `max_num_seqs=1` instead of 3, serves A
      (prompt 6, max_tokens 4), B (5, 2) and C (4, 3), arriving before step 0, and D
      (5, 2) before step 1: how many steps does the run take? (Work it out; you may
      check it with your `serve`.)
    - `q2`: a request finishes in step *t*; can another request use its freed blocks in
      the `"same"` step *t* or only from the `"next"` step?
    - `q3`: how many tokens does a step hold that runs 3 decodes and a 5-token prefill
      chunk?
    - `q4`: the request at the head of `waiting` does not fit in the free blocks; may the
      v1 scheduler admit a smaller request behind it in this step: `"yes"` or `"no"`?

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 11, "q2": "next", "q3": 8, "q4": "no"}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. In ex4.5, why does going from 1 seat to 8 shorten the workload by less than 8 times?
   Name the two limits that bind.
2. Your `serve` feeds token 1 to every request; what changes in the measurement if the
   fake model sampled eos early for half the requests?
3. Why does a prefill chunk that does not complete the prompt produce no token?

## Recap

A step is: keep the running requests going, admit from the queue while seats, tokens and
blocks last, run the model, then append, finish and free. Because the batch is rebuilt
every step, a finished request's seat and blocks go to the next waiting request at once:
that is continuous batching.
""")

if __name__ == "__main__":
    nb.build()
