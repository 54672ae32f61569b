"""Generator of notebooks/exercises/ch09_live_server.ipynb (chapter 09 exercises)."""

from _common import ExerciseNotebook

from minipaged.checks.ch09 import (
    LATENCY_KNOBS,
    LATENCY_REQUESTS,
    SERVE_COST,
    SERVE_RATES,
    STEP_COST,
    latency_request_row,
)

# the table of ex9.2 (a student copy made with --seed gets its own requests, written in)
LATENCY_TABLE = "\n".join(f"    {latency_request_row(r)}" for r in LATENCY_REQUESTS)

nb = ExerciseNotebook(
    chapter="ch09",
    filename="ch09_live_server.ipynb",
    title="Chapter 09 exercises: the engine loop, and the latency a client sees",
    minutes=55,
    intro="""
    Companion to `notebooks/09_live_server.ipynb`. A server's engine loop adds the requests
    that arrived *between* steps, waits when there is nothing to do, and streams each token
    at the end of the step that made it. You will write which step a request joins, predict
    the time to first token (TTFT) and the end-to-end latency of a few requests on paper,
    then write the loop itself on a simulated clock and measure TTFT as the arrival rate
    grows. No server is started: the clock is a number, the steps are the v1 `Scheduler`'s.
    """,
)

# NOTE: the setup cell holds the data as literals: a submission may not import minipaged.checks
nb.setup(f"""
from minipaged.core import Request, Scheduler

# ex9.2: (request id, prompt tokens, max_tokens, arrival in ms), the scheduler's knobs and
# the step cost: STEP_COST[0] ms + STEP_COST[1] ms per token the step computes
LATENCY_REQUESTS = {LATENCY_REQUESTS!r}
LATENCY_KNOBS = {LATENCY_KNOBS!r}
STEP_COST = {STEP_COST!r}
""")

nb.exercise(
    "ex9.1",
    "which step a request joins",
    """
    The engine loop (the engine core's busy loop, `EngineCoreProc.run_busy_loop`, as vLLM
    v1's) applies the requests that arrived right before each step starts; a request
    arriving while a step runs waits for the next one. Write `join_step(arrival,
    step_starts)`: the index of the first step whose start time is at or after `arrival`,
    or `None` if no step starts that late. Raise `ValueError` if `step_starts` is not in
    increasing order (equal times are fine).

    Hand check: steps starting at `[0.0, 0.02, 0.05]`, a request at `0.02` joins step 1, one
    at `0.021` step 2.
    """,
    """
    def join_step(arrival: float, step_starts: list[float]):
        \"\"\"The first step a request arriving at `arrival` runs in, or None.\"\"\"
        ### BEGIN SOLUTION
        for a, b in zip(step_starts, step_starts[1:]):
            if b < a:
                raise ValueError(f"step_starts must be increasing: {step_starts}")
        for i, start in enumerate(step_starts):
            if start >= arrival:
                return i
        return None
        ### END SOLUTION
    """,
    ["join_step"],
)

nb.exercise(
    "ex9.2",
    "predict TTFT and end-to-end latency (on paper first)",
    f"""
    A v1 `Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)`
    behind the engine loop serves the requests of `LATENCY_REQUESTS` (no request stops
    early; your copy's requests may differ from a classmate's). A step that computes `n`
    tokens takes `{STEP_COST[0]} + {STEP_COST[1]} * n` ms; the clock starts at 0.

    | request | prompt tokens | max_tokens | arrives at (ms) |
    |---|---|---|---|
{{LATENCY_TABLE}}

    The rules: before each step every request that has arrived by then joins (ex9.1); an
    idle engine waits for the next arrival; the scheduler is chapter 04's (running requests
    first, one budget for prefill chunks and decodes). A request's first token arrives at
    the end of the step that completes its prompt; its last at the end of its last step.

    Write `predict_latency()`: `{{request id: {{"ttft_ms": first token time - arrival,
    "e2e_ms": last token time - arrival}}}}`. Example: a request of prompt 4 alone at time 0
    would have its first token at 14 ms. The check says which entry is wrong and what you
    gave, not the answer.
    """.replace("{LATENCY_TABLE}\n", LATENCY_TABLE + "\n"),
    """
    def predict_latency() -> dict:
        \"\"\"TTFT and end-to-end latency of each request, in ms.\"\"\"
        ### BEGIN SOLUTION
        return {
            "A": {"ttft_ms": 16, "e2e_ms": 44},
            "B": {"ttft_ms": 27, "e2e_ms": 39},
            "C": {"ttft_ms": 17, "e2e_ms": 28},
        }
        ### END SOLUTION
    """,
    ["predict_latency"],
)

nb.exercise(
    "ex9.3",
    "the engine loop on a clock (measure)",
    f"""
    Now write the loop. `scheduler` is a fresh v1 `Scheduler`, `requests` its `Request`s (not
    added yet), `arrivals[request_id]` each one's arrival time in seconds, and a step of `n`
    tokens takes `step_cost[0] + step_cost[1] * n` seconds.

    - **Write** `serve(scheduler, requests, arrivals, step_cost)` -> `{{request id: {{"ttft":
      s, "e2e": s}}}}`, the rules of ex9.2 on a clock that starts at 0: add (in arrival
      order) every request that has arrived by the clock, jump the clock to the next arrival
      when nothing is unfinished, else `out = scheduler.schedule()`, advance the clock by the
      step's cost, then `scheduler.update_from_output(out, sampled)` where `sampled` gives
      token `1` to each scheduled request whose known tokens are then all computed
      (`request.num_computed_tokens + n >= request.num_tokens`, read before the update); it
      returns the requests that finished.
    - **Invariants**: `0 < ttft <= e2e` for every request.

    The check then prints TTFT percentiles of 60 requests arriving at {", ".join(f"{r:g}" for r in SERVE_RATES)}
    requests per second (a step costing {SERVE_COST[0] * 1e3:g} ms + {SERVE_COST[1] * 1e3:g} ms per token).
    Predict first: which grows faster with the rate, the median or the p90, and why?
    """,
    """
    def serve(scheduler: Scheduler, requests: list[Request], arrivals: dict, step_cost: tuple) -> dict:
        \"\"\"TTFT and end-to-end latency (s) of each request served by the engine loop.\"\"\"
        ### BEGIN SOLUTION
        waiting = sorted(requests, key=lambda r: arrivals[r.request_id])
        clock, lat = 0.0, {}
        while waiting or scheduler.has_unfinished_requests():
            while waiting and arrivals[waiting[0].request_id] <= clock:
                scheduler.add_request(waiting.pop(0))
            if not scheduler.has_unfinished_requests():
                clock = arrivals[waiting[0].request_id]
                continue
            out = scheduler.schedule()
            clock += step_cost[0] + step_cost[1] * sum(n for _, n in out.scheduled)
            sampled = {r.request_id: 1 for r, n in out.scheduled if r.num_computed_tokens + n >= r.num_tokens}
            for rid in sampled:
                if rid not in lat:
                    lat[rid] = {"ttft": clock - arrivals[rid]}
            for r in scheduler.update_from_output(out, sampled):
                lat[r.request_id]["e2e"] = clock - arrivals[r.request_id]
        return lat
        ### END SOLUTION
    """,
    ["serve"],
)

nb.exercise(
    "ex9.4",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure every
    question has an answer of the right kind, and a graded failure says how many are wrong,
    never which.

    - `q1`: a request arrives while step k runs: which step is it first in: `"k"`, `"k+1"` or `"k+2"`?
    - `q2`: a client hangs up mid-stream: are its blocks freed before the next step (`"yes"`) or when it would have finished (`"no"`)?
    - `q3`: requests arrive at 6 per second and each spends 2 s in the server: how many are in it on average (Little's law)?
    - `q4`: which process finds stop strings in vLLM v1's two-process server: `"engine core"` or `"api server"`?

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": "k+1", "q2": "yes", "q3": 12, "q4": "api server"}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. In ex9.2, B's prompt rides along with A's decode in one step. What would B's TTFT be
   if the engine ran prefills and decodes in separate steps, as the paper's scheduler did?
2. ex9.3's p90 grows faster than its median at the highest rate: which requests make the
   tail, and which knob of the scheduler would you turn first?
3. The clock of ex9.3 charges nothing for the server's own work (HTTP, detokenizing, SSE).
   Where does chapter 09 put that work, and when does it stop being free?

## Recap

The engine loop adds requests between steps and streams each token at the end of its step:
a request's TTFT is its wait for the next step start plus the steps its prompt takes, shared
with everyone else in the batch. Continuous batching needs nothing more than that loop.
""")

if __name__ == "__main__":
    nb.build()
