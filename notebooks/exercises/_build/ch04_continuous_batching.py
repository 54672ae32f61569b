"""Generator of notebooks/exercises/ch04_continuous_batching.ipynb (chapter 04 exercises)."""

from _common import ExerciseNotebook

nb = ExerciseNotebook(
    chapter="ch04",
    filename="ch04_continuous_batching.ipynb",
    title="Chapter 04 exercises: continuous batching",
    minutes=45,
    intro="""
    Companion to `notebooks/04_continuous_batching.ipynb`. You will write the two halves of
    one engine step around the model: the admission loop that lets waiting requests join
    the running batch, and the update after the model ran that appends tokens, finishes
    requests and frees their blocks. Your functions act on a real
    `minipaged.core.Scheduler` (its own `schedule` / `update_from_output` switched off);
    the check runs the package's scheduler on an identical twin and compares the two.

    What your code may touch: `scheduler.waiting` (a `deque` of `Request`, arrival order),
    `scheduler.running` (a `list`), `scheduler.finished` (a `dict` id -> request),
    `scheduler.kv_cache_manager` (`allocate_slots(request, n)` -> new blocks or `None`,
    `free(request)`), `scheduler.max_num_seqs`, `scheduler.max_model_len`. A `Request` has
    `request_id`, `status`, `num_tokens` (prompt + output so far), `num_computed_tokens`
    (tokens whose K/V are in the cache), `output_token_ids`, `sampling_params`
    (`max_tokens`, `ignore_eos`, `stop_token_ids`) and `eos_token_id`.
    """,
)

nb.setup("""
from minipaged.core import Request, RequestStatus
""")

nb.exercise(
    "ex4.1", "the admission loop",
    """
    After the running requests got their tokens for this step, `token_budget` tokens are
    left. Write `schedule_waiting(scheduler, token_budget)`: admit waiting requests in
    arrival order (FCFS, never skipping ahead), while `token_budget > 0`, fewer than
    `scheduler.max_num_seqs` requests are running, and requests wait. For the request at
    the head of `scheduler.waiting`:

    - it needs `n = min(request.num_tokens - request.num_computed_tokens, token_budget)`
      tokens this step (chunked prefill: a long prompt takes what is left of the budget and
      continues next step);
    - `scheduler.kv_cache_manager.allocate_slots(request, n)`; if that returns `None`,
      stop (it waits at the head, and so does everyone behind it);
    - otherwise take it off `waiting`, set its status to `RequestStatus.RUNNING`, append it
      to `running`, and spend `n` of the budget.

    Return the list of `(request, n)` pairs admitted, in order.
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

nb.exercise(
    "ex4.2", "does the newest token finish the request?",
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
    "ex4.3", "after the model ran: advance, append, finish, free",
    """
    The model just ran the step: `scheduled` is the list of `(request, n)` the scheduler
    chose, and `sampled_token_ids` maps a request id to its new token, for each request
    whose prefill this step completes. Write `update_from_output(scheduler, scheduled,
    sampled_token_ids)`: for each `(request, n)` in order,

    - `request.num_computed_tokens += n`;
    - if it is still below `request.num_tokens`, that was a prefill chunk: nothing else;
    - otherwise append `sampled_token_ids[request.request_id]` to its output
      (`request.append_output_token_id(token)`) and, if your `check_stop` says it is
      finished, remove it from `scheduler.running`, free its blocks with
      `scheduler.kv_cache_manager.free(request)` and record it in
      `scheduler.finished[request_id]`.

    Return the finished requests, in batch order.
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
                scheduler.finished[request.request_id] = request
                finished.append(request)
        return finished
        ### END SOLUTION
    """,
    ["update_from_output"],
)

nb.outro("""
## Recap

A step is: keep the running requests going, admit from the queue while seats, tokens and
blocks last, run the model, then append, finish and free. Because the batch is rebuilt
every step, a finished request's seat and blocks go to the next waiting request at once:
that is continuous batching.
""")

if __name__ == "__main__":
    nb.build()
