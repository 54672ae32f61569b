"""Generator of notebooks/exercises/ch07_serving_at_scale.ipynb (chapter 07 exercises)."""

from _common import ExerciseNotebook, _code, _md

from minipaged.checks.ch07 import CHANGES, PREDICT_REQUESTS

nb = ExerciseNotebook(
    chapter="ch07",
    filename="ch07_serving_at_scale.ipynb",
    title="Chapter 07 exercises: serving at scale, on the simulator",
    minutes=50,
    intro="""
    Companion to `notebooks/07_serving_at_scale.ipynb`. The simulator runs the course's real
    scheduler with a GPU cost model in place of the model. You will predict a small run step
    by step, read a *sustainable rate* off a latency curve and measure one, and predict how
    a paper's speedup moves when the setting changes, with the simulator as the judge.
    """,
)

# NOTE: the setup cell holds the data as literals: a submission may not import
# minipaged.checks, and the checker keeps its own copy.
_CHANGES = "\n".join(f"    {k!r}: {v!r}," for k, v in CHANGES.items())

nb.setup(f"""
from minipaged.sim import A100_40GB, OPT_13B, CostModel, make_requests, simulate, sample_requests, sweep_rates

PREDICT_REQUESTS = {PREDICT_REQUESTS!r}
CHANGES = {{
{_CHANGES}
}}

cm = CostModel(OPT_13B, A100_40GB)
print(cm)
for i, (p, o, t) in enumerate(PREDICT_REQUESTS):
    print(f"r{{i}}: prompt {{p}} tokens, output {{o}} tokens, arrives at {{t * 1e3:.0f}} ms")
print("changes for ex7.3:")
for change, what in CHANGES.items():
    print(f"  {{change!r}}: {{what}}")
""")

nb.exercise(
    "ex7.1",
    "predict who runs, step by step (on paper first)",
    """
    Three requests (`PREDICT_REQUESTS`, printed by the setup cell; your copy's requests may
    differ from a classmate's) are served by the vLLM-like policy on the
    simulated OPT-13B / A100-40GB with `max_num_batched_tokens = 8` and chunked prefill on;
    memory is plentiful. The scheduler's rule (chapters 04 and 05): running requests first,
    one token each when decoding or the rest of their prompt (as much as the budget
    allows); then waiting requests in arrival order, each getting as much of its prompt as
    the budget has left. A request's first output token comes from the step that finishes
    its prompt; it is done when it has all its output tokens. A request is seen by the
    scheduler once it has arrived by the start of a step, and each step here takes a bit
    under 24 ms (chapter 07, section 2).

    Write `predict_steps()`: a list with one dict per step, until every request is done,
    mapping each request scheduled in that step (`"r0"`, `"r1"`, `"r2"`) to the number of
    tokens it computes. Example of one step: `{"r0": 6, "r1": 2}`. Work it out on paper; do
    not call the simulator. The check compares step by step with the simulator; at the
    first difference it names the step and what you predicted (the grader judges the same
    way, on your copy's requests).
    """,
    """
    def predict_steps() -> list[dict[str, int]]:
        \"\"\"The tokens each request computes, step by step.\"\"\"
        ### BEGIN SOLUTION
        return [
            {"r0": 6, "r1": 2},          # r0's whole prompt, the first 2 of r1's
            {"r0": 1, "r1": 3},          # r0 decodes; r1 finishes its prompt (its first token)
            {"r0": 1, "r1": 1, "r2": 4}, # r2 arrived at 30 ms, after step 1 began (~24 ms)
            {"r2": 1},                   # r0 and r1 are done; r2 decodes its second token
        ]
        ### END SOLUTION
    """,
    ["predict_steps"],
)

nb.exercise(
    "ex7.2",
    "the sustainable rate of a latency curve",
    """
    The paper's comparison reads each system's latency-vs-rate curve (Fig. 12) at a
    latency level and asks: up to which request rate does the system stay under it? The
    course reads it at a level relative to the system's own light-load latency.

    Write `sustainable_rate(rates, latencies, factor)`:

    - in: `rates`, strictly increasing request rates (req/s) of a sweep; `latencies`, the
      normalized latency (s/token) measured at each; `factor > 1`. The light-load latency
      is the first point's, and the level is `factor` times it.
    - out: the rate where the curve first goes **above** the level, interpolated linearly
      between the last point at or under it and the first point over it; if no point is
      over it, the highest rate of the sweep (a lower bound: sweep further).
    - failure: `ValueError` if the lists are empty or of different lengths, the rates not
      strictly increasing, or `factor <= 1`.

    Hand check: rates `[1, 2, 3]`, latencies `[0.10, 0.15, 0.30]`, factor 2: the level is
    0.20, crossed a third of the way from 2 to 3: **2.333...** req/s.
    """,
    """
    def sustainable_rate(rates: list[float], latencies: list[float], factor: float) -> float:
        \"\"\"Request rate where the latency curve first passes factor x its light-load value.\"\"\"
        ### BEGIN SOLUTION
        if not factor > 1:
            raise ValueError(f"factor must be > 1, got {factor!r}")
        if not rates or len(rates) != len(latencies):
            raise ValueError("rates and latencies must be non-empty and of equal length")
        if any(b <= a for a, b in zip(rates, rates[1:])):
            raise ValueError("rates must be strictly increasing")
        level = factor * latencies[0]
        for k in range(1, len(rates)):
            if latencies[k] > level:
                r0, r1, l0, l1 = rates[k - 1], rates[k], latencies[k - 1], latencies[k]
                return r0 + (r1 - r0) * (level - l0) / (l1 - l0)
        return float(rates[-1])
        ### END SOLUTION
    """,
    ["sustainable_rate"],
)

nb.cells.append(
    _md(
        """
**Measure.** Once ex7.2 passes, the next cell sweeps the vLLM-like and the Orca (Oracle)-like
policies on 100 ShareGPT-like requests and reads both curves with your function. Change the
workload (`"alpaca"`), the factor, or `max_num_seqs` and compare designs of the
experiment: which of your choices moves the ratio most?
""",
        "ex7-2-measure-md",
    )
)

measure = _code(
    """
# Measure with your sustainable_rate (prints "finish ex7.2 first" until it is implemented).
try:
    lengths = sample_requests("sharegpt", 100, 0)
    fractions = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
    measured = {}
    for policy in ("paged", "orca-oracle"):
        sw = sweep_rates(lengths, policy, cm, rate_fractions=fractions)
        measured[policy] = sustainable_rate(sw.rates, sw.normalized_latencies, 2.0)
        bound = " (the top of the sweep: a lower bound)" if measured[policy] == sw.rates[-1] else ""
        print(f"{policy:12s} sustainable rate {measured[policy]:.2f} req/s{bound}, capacity {sw.capacity:.2f}")
    print(f"ratio {measured['paged'] / measured['orca-oracle']:.2f}x")
except NotImplementedError:
    print("finish ex7.2 first")
""",
    "ex7-2-measure",
)
measure.metadata["tags"] = ["nbval-ignore-output"]
nb.cells.append(measure)

nb.exercise(
    "ex7.3",
    "why a speedup moves (predict, then the simulator judges)",
    """
    A speedup is a ratio of two systems in one setting. Take the capacity ratio of
    vLLM-like to Orca (Oracle)-like serving (throughput with a full queue, same memory) for
    100 ShareGPT-like requests on OPT-13B / A100-40GB, `max_num_seqs = 256`. For each change
    in `CHANGES` (printed by the setup cell), predict whether the ratio goes `"up"`, `"down"` or stays
    the `"same"` (within 10%), changing only that.

    Write `predict_directions()` returning `{change: "up" | "down" | "same"}` for every
    key of `CHANGES`. Predict first: the check here records your answers (it checks only their shape);
    the grader runs the simulator for each change and grades the predictions once,
    saying how many are wrong. The measured ratios are in chapter 07: read them after
    you hand in, and explain each to yourself.
    """,
    """
    def predict_directions() -> dict[str, str]:
        \"\"\"How the vLLM-like / Orca (Oracle) capacity ratio moves under each change.\"\"\"
        ### BEGIN SOLUTION
        return {
            "max_num_seqs=8": "down",     # both run 8 sequences: memory no longer limits either
            "max_num_seqs=32": "same",    # Orca (Oracle) fits ~15; paging still fills 32
            "flipped lengths": "down",    # less room reserved for future output tokens
        }
        ### END SOLUTION
    """,
    ["predict_directions"],
)

nb.exercise(
    "ex7.4",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure
    every question has an answer of the right kind, and a graded failure says how many
    are wrong, never which.

    - `q1`: the paper's "1.7–2.7× the request rate of Orca (Oracle)" on ShareGPT is a range
      over: `"a"` request rates of one model, `"b"` three models (OPT-13B, 66B, 175B, each
      on its own GPUs), `"c"` two datasets.
    - `q2`: what the paper (§6.2) credits for vLLM's gain over Orca: `"continuous batching"`
      or `"memory management"`?
    - `q3`: Orca (Max) on OPT-13B / A100-40GB has 14,526 KV slots and reserves 2,048 per
      request: at most how many requests run at once?
    - `q4`: the vLLM-like / Orca (Oracle) capacity ratio with `max_num_seqs = 8` (within 2%).

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": "b", "q2": "memory management", "q3": 14526 // 2048, "q4": 1.0}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. The chapter reports two ratios to Orca (Oracle) for the same workload: a
   sustainable-rate ratio and a capacity ratio. Which one would you quote for a chatbot
   with a latency target, and which for an offline batch job? Why do they differ?
2. A colleague measures vLLM against a contiguous-cache server on a CPU with 4 concurrent
   requests of 50 tokens and finds no speedup. Is the paper wrong? What would you change
   in the experiment?
3. On a GPU with twice the memory, does paging matter more or less? Give one reason each
   way (chapter 07, section 7b).

## Recap

The simulator keeps the real scheduler and replaces only the model, so a speedup can be
taken apart: what limits each system's batch (memory, `max_num_seqs`, the token budget),
what the lengths make each system reserve, and at which latency level the ratio is read.
""")


def _unstore_outputs(path) -> None:
    # NOTE: a student copy keeps a setup cell's outputs but drops its execution count, and
    # nbval refuses "unrun" cells that have outputs. So cells other than solutions and
    # checks store no output: nbval runs them and compares nothing.
    import nbformat

    from minipaged.checks.notebook import cell_role

    book = nbformat.read(path, as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code" and cell_role(cell) not in ("solution", "check"):
            cell.outputs, cell.execution_count = [], None
    nbformat.write(book, path)


if __name__ == "__main__":
    _unstore_outputs(nb.build())
