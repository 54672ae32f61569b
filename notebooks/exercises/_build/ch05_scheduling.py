"""Generator of notebooks/exercises/ch05_scheduling.ipynb (chapter 05 exercises)."""

from _common import ExerciseNotebook

nb = ExerciseNotebook(
    chapter="ch05",
    filename="ch05_scheduling.ipynb",
    title="Chapter 05 exercises: token budget, chunked prefill, preemption",
    minutes=60,
    intro="""
    Companion to `notebooks/05_scheduling.ipynb`. You will write how many tokens a request
    gets under the token budget, which running request is preempted when memory runs out,
    preemption by recompute, and the running phase of `Scheduler.schedule()` that ties them
    together. The checks run the package's `minipaged.core.Scheduler` on an identical twin
    of the state your code gets and compare queues, statuses, token counts, block tables
    and the free queue.

    Scheduler fields you may use: `running` (a list, in arrival order), `waiting` (a
    `deque`, in arrival order, preempted requests included), `arrival_seq` (request id ->
    rank in arrival order), `kv_cache_manager` (`allocate_slots`, `free`),
    `enable_chunked_prefill`, `max_num_batched_tokens`.
    """,
)

nb.setup("""
from minipaged.core import Request, RequestStatus
""")

nb.exercise(
    "ex5.1", "how many tokens a request gets this step",
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
    "ex5.2", "the preemption victim",
    """
    When a running request needs a block and none is free, the scheduler preempts the
    *latest-arrived* running request (FCFS fairness: the oldest requests keep going, so
    every request that fits alone eventually finishes). Write `pick_victim(running,
    arrival_seq)`: `running` is a list of requests in batch order (not necessarily arrival
    order), `arrival_seq` maps a request id to its arrival rank. Return the request with
    the highest rank; do not change the list.
    """,
    """
    def pick_victim(running: list, arrival_seq: dict) -> Request:
        \"\"\"The running request that arrived last.\"\"\"
        ### BEGIN SOLUTION
        return max(running, key=lambda request: arrival_seq[request.request_id])
        ### END SOLUTION
    """,
    ["pick_victim"],
)

nb.exercise(
    "ex5.3", "preemption by recompute",
    """
    Write `preempt_recompute(scheduler, victim)`: the victim gives up its KV cache and
    will be prefilled again (prompt *and* output so far) when it is admitted next.

    - remove it from `scheduler.running` and free its blocks
      (`scheduler.kv_cache_manager.free(victim)`);
    - `num_computed_tokens = 0`, status `RequestStatus.PREEMPTED`, `num_preemptions += 1`;
    - put it into `scheduler.waiting` *by arrival order* (`scheduler.arrival_seq`): it
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
        rank = scheduler.arrival_seq[victim.request_id]
        i = 0
        while i < len(scheduler.waiting) and scheduler.arrival_seq[scheduler.waiting[i].request_id] < rank:
            i += 1
        scheduler.waiting.insert(i, victim)
        ### END SOLUTION
    """,
    ["preempt_recompute"],
)

nb.exercise(
    "ex5.4", "the running phase of schedule(), with preemption",
    """
    Write `schedule_running(scheduler, token_budget)`: go through `scheduler.running`
    front to back (by index: preemption shortens the list) while `token_budget > 0`:

    1. `n = num_new_tokens(request, token_budget, scheduler.enable_chunked_prefill,
       scheduler.max_num_batched_tokens)` (your ex5.1); if `n == 0`, skip to the next;
    2. try `scheduler.kv_cache_manager.allocate_slots(request, n)`; while it returns
       `None`, preempt `pick_victim(scheduler.running, scheduler.arrival_seq)` with your
       `preempt_recompute`, and try again, unless the victim was this very request: then
       stop the whole loop (everyone after it was preempted already);
    3. record `(request, n)` and spend `n` of the budget.

    Return `(scheduled, preempted)`: the `(request, n)` pairs in order, and the preempted
    requests in the order they were preempted.
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
                victim = pick_victim(scheduler.running, scheduler.arrival_seq)
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

nb.outro("""
## Recap

The token budget bounds each step's work; chunked prefill lets a long prompt share steps
with decodes. When memory runs out, the latest arrival is preempted, so the earliest keeps
progressing: recompute throws its KV away and pays a re-prefill later, which is cheap for
short sequences and is what vLLM does by default.
""")

if __name__ == "__main__":
    nb.build()
