"""Generator of notebooks/exercises/ch00_overview.ipynb (chapter 00 exercises)."""

from _common import ExerciseNotebook, _md

from minipaged.checks.ch00 import EVENTS, STATEMENTS, event_text

# NOTE: the setup cell holds the data as literals (texts only, no answers): a submission may
# not import minipaged.checks, and the checker keeps its own copy.
_STATEMENT_TEXTS = "\n".join(f"    {sid!r}: {text!r}," for sid, text in STATEMENTS.items())
# NOTE: the rows of the events table come from the same text a student's copy gets for its
# own events (``minipaged exercises --student OUT --seed S`` rewrites this table and EVENTS)
_EVENT_ROWS = "\n".join(f"    | {k} | {event_text(e)} |" for k, e in enumerate(EVENTS))

nb = ExerciseNotebook(
    chapter="ch00",
    filename="ch00_overview.ipynb",
    title="Chapter 00 exercises: three ideas, and what one step costs",
    minutes=40,
    intro="""
    Companion to `notebooks/00_overview.ipynb`. You will sort statements into the three
    ideas of the course, predict block tables before the engine computes them, and build
    the back-of-the-envelope cost model that explains why serving many requests at once is
    nearly free: the time of one decode step from bytes and FLOPs, and the batch size
    where decode stops being memory-bound.
    """,
)

nb.setup(f"""
from minipaged.sim.cost_model import A100_40GB, GPUS, MODELS, OPT_13B, GPUConfig, ModelConfig

STATEMENTS = {{
{_STATEMENT_TEXTS}
}}
EVENTS = {EVENTS!r}

for sid, text in STATEMENTS.items():
    print(f"{{sid:>4}}  {{text}}")
""")

nb.exercise(
    "ex0.1",
    "the three ideas, sorted",
    """
    The course keeps three ideas apart: the KV cache is **data** (what is stored), paging is
    **addressing** (where it is stored and how it is found), continuous batching is
    **scheduling** (who runs at each step). The setup cell printed twelve statements.

    Write `sort_statements()`: it returns a dict from every statement id (`"s1"` ..
    `"s12"`) to `"data"`, `"addressing"` or `"scheduling"`. Each statement is about exactly
    one of them. These answers are graded once, by the instructor's key: the check here only makes
    sure every statement has one of the three answers, and a graded failure says how
    many statements are misplaced, never which.
    """,
    """
    def sort_statements() -> dict[str, str]:
        \"\"\"Statement id -> "data", "addressing" or "scheduling".\"\"\"
        ### BEGIN SOLUTION
        return {
            "s1": "data", "s2": "addressing", "s3": "scheduling", "s4": "data",
            "s5": "addressing", "s6": "scheduling", "s7": "scheduling", "s8": "data",
            "s9": "addressing", "s10": "scheduling", "s11": "addressing", "s12": "data",
        }
        ### END SOLUTION
    """,
    ["sort_statements"],
)

nb.exercise(
    "ex0.2",
    "predict the block tables (on paper first)",
    f"""
    A `KVCacheManager` with **8 blocks of 4 slots**, empty at first, sees these events in
    order (`EVENTS` in the setup; your copy's events may differ from a classmate's):

    | event | what happens |
    |---|---|
{_EVENT_ROWS}

    What you need from chapter 00: a request holds `ceil(tokens / block_size)` blocks; the
    free queue hands out blocks from its front, never-used ones in id order; a finished
    request's blocks go to the *front* of the free queue, **last block first** (they hold no
    prefix-cache hash, so vLLM reuses them first: chapter 02).

    Write `predict_tables()`: a list of six dicts, one per event, each mapping every request
    that holds blocks *after* that event to its block ids in logical order. Work it out on
    paper; do not call the manager. Example: had event 0 been "A allocates 10 more tokens"
    (in the fresh pool), the answer after it would be `{{"A": [0, 1, 2]}}`. The check compares
    each event with the engine; at the first difference it names the event and what you
    predicted (the grader judges the same way, on your copy's events).
    """,
    """
    def predict_tables() -> list[dict[str, list[int]]]:
        \"\"\"The block tables after each event of EVENTS.\"\"\"
        ### BEGIN SOLUTION
        return [
            {"A": [0, 1, 2]},
            {"A": [0, 1, 2], "B": [3, 4]},
            {"A": [0, 1, 2], "B": [3, 4, 5]},
            {"B": [3, 4, 5]},
            {"B": [3, 4, 5], "C": [2, 1]},
            {"B": [3, 4, 5], "C": [2, 1], "D": [0, 6]},
        ]
        ### END SOLUTION
    """,
    ["predict_tables"],
)

nb.exercise(
    "ex0.3",
    "one decode step, from bytes and FLOPs",
    """
    The course's cost model (`minipaged.sim.cost_model`, used by the simulator of chapter
    07) says what one engine step costs on a GPU. For a **decode** step of `batch_size`
    sequences, each with `context_len` tokens already cached and one new token:

    - **bytes moved**: every weight once (`model.weight_bytes`), the cached K/V of every
      sequence (`context_len` tokens each), and the new token's K/V written, at
      `model.kv_bytes_per_token` per token;
    - **FLOPs**: `2 × model.layer_params` per new token (the linear layers), the LM head
      (`2 × hidden_size × vocab_size`) once per sequence, and attention:
      `4 × num_layers × num_heads × head_dim` per (query, key) pair, where the new token
      sees `context_len + 1` keys;
    - **time**: compute and memory overlap perfectly (a roofline), each at a fraction of the
      datasheet peak: `max(FLOPs / (gpu.peak_flops × mfu), bytes / (gpu.mem_bandwidth × mbu))
      + overhead_s`.

    Write `decode_step_time(model, gpu, batch_size, context_len, mfu, mbu, overhead_s)` in
    seconds. Raise `ValueError` unless `batch_size >= 1` and `context_len >= 0`.

    Hand check: OPT-13B on an A100-40GB, batch 1, context 400, `mfu=0.5`, `mbu=0.8`,
    `overhead_s=0.003` takes about **23.9 ms**, nearly all of it reading 23.9 GiB of weights.
    """,
    """
    def decode_step_time(model: ModelConfig, gpu: GPUConfig, batch_size: int, context_len: int,
                         mfu: float = 0.5, mbu: float = 0.8, overhead_s: float = 0.003) -> float:
        \"\"\"Seconds of one decode step under the roofline cost model.\"\"\"
        ### BEGIN SOLUTION
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if not isinstance(context_len, int) or context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len!r}")
        nbytes = model.weight_bytes + model.kv_bytes_per_token * batch_size * (context_len + 1)
        per_seq = (2 * model.layer_params + 2 * model.hidden_size * model.vocab_size
                   + 4 * model.num_layers * model.num_heads * model.head_dim * (context_len + 1))
        compute_s = batch_size * per_seq / (gpu.peak_flops * mfu)
        memory_s = nbytes / (gpu.mem_bandwidth * mbu)
        return max(compute_s, memory_s) + overhead_s
        ### END SOLUTION
    """,
    ["decode_step_time"],
)

nb.cells.append(
    _md(
        """
<details><summary>Hints for ex0.3 (open only if stuck)</summary>

- Count per sequence first (its bytes of K/V read and written, its FLOPs), then multiply
  by `batch_size`; the weights are read once per step, whatever the batch.
- A sequence with `context_len` cached tokens reads `context_len` tokens of K/V and writes 1.
</details>
""",
        "ex0-3-hints",
    )
)

nb.exercise(
    "ex0.4",
    "where decode stops being memory-bound (design, then measure)",
    """
    With one sequence, a decode step is all weight reading. Each extra sequence adds FLOPs
    (its own pass through the linear layers) but only a little memory traffic (its K/V).
    So past some batch size, compute time overtakes memory time: the **ridge**.

    Write `ridge_batch(model, gpu, context_len, mfu, mbu)`: the smallest integer batch
    size at which a decode step (every sequence with `context_len` cached tokens) has
    compute time **>=** memory time, in the cost model of ex0.3; `None` if no batch size
    ever gets there. Raise `ValueError` if `context_len < 0`. How you find it is your
    design: a search, a formula, both.

    Hand check: OPT-13B on an A100-40GB, context 0: **126**. Then predict before you run
    it: what happens with 400 tokens of context, and why?
    """,
    """
    def ridge_batch(model: ModelConfig, gpu: GPUConfig, context_len: int,
                    mfu: float = 0.5, mbu: float = 0.8) -> int | None:
        \"\"\"Smallest compute-bound decode batch, or None.\"\"\"
        ### BEGIN SOLUTION
        import math

        if not isinstance(context_len, int) or context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len!r}")
        per_seq_flops = (2 * model.layer_params + 2 * model.hidden_size * model.vocab_size
                         + 4 * model.num_layers * model.num_heads * model.head_dim * (context_len + 1))
        per_seq_bytes = model.kv_bytes_per_token * (context_len + 1)
        f, bw = gpu.peak_flops * mfu, gpu.mem_bandwidth * mbu

        def compute_bound(b):
            return b * per_seq_flops / f >= (model.weight_bytes + b * per_seq_bytes) / bw

        denom = per_seq_flops / f - per_seq_bytes / bw  # compute minus memory time per sequence
        if denom <= 0:
            return None  # each sequence adds more memory time than compute time
        b = max(1, math.ceil(model.weight_bytes / bw / denom))
        while not compute_bound(b):
            b += 1
        while b > 1 and compute_bound(b - 1):
            b -= 1
        return b
        ### END SOLUTION
    """,
    ["ridge_batch"],
)

nb.cells.append(
    _md(
        """
<details><summary>Hints for ex0.4 (open only if stuck)</summary>

- Write compute time and memory time as `a + b × batch` each. Where do the two lines cross?
  Can they fail to cross?
- A formula in floating point can land one off the integer answer: check its neighbours.
</details>
""",
        "ex0-4-hints",
    )
)

nb.exercise(
    "ex0.5",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure
    every question has an answer of the right kind, and a graded failure says how many
    are wrong, never which.

    - `q1`: how many blocks does a 100-token request hold with `block_size = 16`?
    - `q2`: how many of those blocks' slots hold no token?
    - `q3`: which idea decides *where* a token's K/V lives: `"data"`, `"addressing"` or
      `"scheduling"`?
    - `q4`: is a decode step of OPT-13B on an A100-40GB at batch 1 `"memory"`-bound or
      `"compute"`-bound?
    - `q5`: your `decode_step_time` for OPT-13B, A100-40GB, batch 1, context 400, **in
      milliseconds** (within 1%).

    Write `concept_answers()` returning `{"q1": ..., ..., "q5": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q5.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 7, "q2": 12, "q3": "addressing", "q4": "memory",
                "q5": decode_step_time(OPT_13B, A100_40GB, 1, 400) * 1e3}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. Name one statement of ex0.1 that a student could argue belongs to two ideas, and say
   which idea it is *about*.
2. Your `ridge_batch` returns `None` for OPT-13B at 400 tokens of context. What does that
   say about the value of paging for long contexts, and what would change it (think of
   grouped-query attention)?
3. Why does the free queue return a finished request's blocks last block first?

## Recap

The KV cache is data, paging is addressing, continuous batching is scheduling. A decode
step costs about one read of the weights whatever the batch, so fitting more sequences
into the same memory is almost free throughput, until compute or the KV reads catch up.
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
