"""Generator of notebooks/exercises/ch01_kv_cache.ipynb (chapter 01 exercises)."""

from _common import ExerciseNotebook

from minipaged.checks.ch01 import CONTIG_EVENTS, CONTIG_KNOBS, contig_event_text

# NOTE: the rows of the events table come from the same text a student's copy gets for its
# own events (``minipaged exercises --student OUT --seed S`` rewrites this table and CONTIG_EVENTS)
_EVENT_ROWS = "\n".join(f"    | {k} | {contig_event_text(e)} |" for k, e in enumerate(CONTIG_EVENTS))

nb = ExerciseNotebook(
    chapter="ch01",
    filename="ch01_kv_cache.ipynb",
    title="Chapter 01 exercises: the KV cache and what it costs",
    minutes=50,
    intro="""
    Companion to `notebooks/01_kv_cache.ipynb`. You will compute what one token's keys and
    values cost for real models, how much a contiguous allocator reserves per request, and
    how much of the reserved memory holds tokens once memory is paged.
    """,
)

# NOTE: the setup cell holds the events as literals: a submission may not import minipaged.checks
nb.setup(f"""
from minipaged.core import KVCacheManager, cdiv
from minipaged.sim.cost_model import GPUS, MODELS, GPUConfig, ModelConfig

# ex1.4: the allocator's knobs; (request id, final length) = allocate, (request id, None) = free
CONTIG_KNOBS = {CONTIG_KNOBS!r}
CONTIG_EVENTS = {CONTIG_EVENTS!r}
""")

nb.exercise(
    "ex1.1",
    "KV cache bytes per token",
    """
    Every layer stores one key vector and one value vector per KV head for every token.
    Write `kv_bytes_per_token(config, dtype_bytes)` for a Hugging Face `config.json`
    read into a dict:

    - `num_hidden_layers` layers, `num_attention_heads` query heads;
    - `num_key_value_heads` KV heads (grouped-query attention). It may be missing or `None`:
      then every query head has its own KV head;
    - `head_dim`, which may be missing or `None`: then it is `hidden_size // num_attention_heads`;
    - `dtype_bytes` bytes per number (2 for fp16/bf16).

    Hand check: Llama-2-13B (40 layers, 40 heads, hidden 5120, fp16) costs 819,200 bytes.
    (The paper's "800 KB per token" is OPT-13B's, which has the same shape.)
    """,
    """
    def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
        \"\"\"Bytes of K and V one token occupies in the KV cache, over all layers.\"\"\"
        ### BEGIN SOLUTION
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        return 2 * config["num_hidden_layers"] * num_kv_heads * head_dim * dtype_bytes
        ### END SOLUTION
    """,
    ["kv_bytes_per_token"],
)

nb.exercise(
    "ex1.2",
    "what a contiguous allocator reserves",
    """
    Before paging, a serving system reserved one contiguous chunk per request, sized
    before the output length is known. The paper compares three such baselines (Orca).
    Write `reserved_slots(prompt_len, output_len, max_seq_len, policy)`, the number of
    token slots reserved for one request of `prompt_len + output_len` tokens:

    - `"max"`: the model's whole context, `max_seq_len`;
    - `"pow2"`: the final length `prompt_len + output_len` rounded up to a power of two
      (a request that ends at 600 tokens reserves 1024), but never more than `max_seq_len`:
      a system that knows the final length within a factor of two;
    - `"oracle"`: exactly `prompt_len + output_len`.

    Raise `ValueError` for another policy, or unless `prompt_len >= 1`, `output_len >= 1`
    and `prompt_len + output_len <= max_seq_len`.
    """,
    """
    def reserved_slots(prompt_len: int, output_len: int, max_seq_len: int, policy: str) -> int:
        \"\"\"Token slots a contiguous allocator reserves for one request.\"\"\"
        ### BEGIN SOLUTION
        if policy not in ("max", "pow2", "oracle"):
            raise ValueError(f"unknown policy {policy!r}")
        if prompt_len < 1 or output_len < 1 or prompt_len + output_len > max_seq_len:
            raise ValueError("the request does not fit the model's context")
        if policy == "max":
            return max_seq_len
        if policy == "pow2":
            pow2 = 1
            while pow2 < prompt_len + output_len:
                pow2 *= 2
            return min(max_seq_len, pow2)
        return prompt_len + output_len
        ### END SOLUTION
    """,
    ["reserved_slots"],
)

nb.exercise(
    "ex1.3",
    "how much paged memory holds tokens",
    """
    With paging, a sequence of `n` tokens holds `ceil(n / block_size)` blocks of
    `block_size` slots, allocated as it grows: only its last block can have empty slots.
    Write `paged_token_fraction(seq_lens, block_size)`: of all the slots the sequences
    hold, the fraction that hold a token (`1.0` for no sequences). The check compares it
    with `KVCacheManager.usage().token_fraction` after allocating the same sequences.

    Hand check: `seq_lens=[5, 3]`, `block_size=4` hold 2 + 1 blocks = 12 slots for
    8 tokens, so 8 / 12.
    """,
    """
    def paged_token_fraction(seq_lens: list[int], block_size: int) -> float:
        \"\"\"Fraction of reserved slots that hold a token's K/V, when memory is paged.\"\"\"
        ### BEGIN SOLUTION
        reserved = sum(cdiv(n, block_size) * block_size for n in seq_lens)
        return sum(seq_lens) / reserved if reserved else 1.0
        ### END SOLUTION
    """,
    ["paged_token_fraction"],
)

nb.exercise(
    "ex1.4",
    "predict where contiguous regions go (on paper first)",
    f"""
    A contiguous allocator (`ContiguousAllocator(num_slots=32, max_model_len=16,
    policy="pow2")`, the paper's Orca (Pow2) baseline) reserves for each request
    `min(next_pow2(final_len), max_model_len)` slots in **one** region, placed first-fit:
    at the lowest start slot of a free hole large enough. A freed region becomes a hole,
    merged with free neighbours. A request that does not fit is not placed (it waits, and
    takes no part in the later events). Events, in order (`CONTIG_EVENTS`; your copy's
    events may differ from a classmate's):

    | event | what happens |
    |---|---|
{_EVENT_ROWS}

    Write `predict_regions()`: for each arrival, in order, the start slot of its region,
    or `None` if no hole is large enough. Example: the first request starts at `0`. The
    check compares with the allocator; at the first difference it names the allocation and
    what you predicted (the grader judges the same way, on your copy's events).
    """,
    """
    def predict_regions() -> list:
        \"\"\"Start slot (or None) of each allocation of CONTIG_EVENTS.\"\"\"
        ### BEGIN SOLUTION
        return [0, 8, 24, 0, 28, None]
        ### END SOLUTION
    """,
    ["predict_regions"],
)

nb.exercise(
    "ex1.5",
    "how many sequences fit a GPU (measure)",
    """
    vLLM gives the KV cache what is left of the GPU after the weights: `memory ×
    gpu_memory_utilization − weights − an activation reserve`. Paged, that budget holds
    `budget // kv_bytes_per_token` token slots, give or take a last block per sequence.

    - **Write** `max_batch(model, gpu, seq_len, gpu_memory_utilization=0.9,
      activation_reserve_bytes=2**30)`: how many sequences of `seq_len` cached tokens fit
      together (ignore the partly filled last blocks). `model` and `gpu` are the cost
      model's `ModelConfig` / `GPUConfig` (`model.weight_bytes`,
      `model.kv_bytes_per_token`, `gpu.memory_bytes`).
    - **Failure mode**: `seq_len < 1`, or weights plus reserve that leave no budget ->
      `ValueError`.

    Worked example: OPT-13B on an A100-40GB, 1024 tokens each: **14** sequences. The
    check then prints your function's figure for every model and GPU of `MODELS` / `GPUS`.
    Predict first: how many times more does an H200 hold than an A100-40GB, and why is it
    not 141/40?
    """,
    """
    def max_batch(model: ModelConfig, gpu: GPUConfig, seq_len: int, gpu_memory_utilization: float = 0.9,
                  activation_reserve_bytes: float = 2**30) -> int:
        \"\"\"Sequences of seq_len cached tokens that fit the KV budget together.\"\"\"
        ### BEGIN SOLUTION
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        budget = gpu.memory_bytes * gpu_memory_utilization - model.weight_bytes - activation_reserve_bytes
        if budget <= 0:
            raise ValueError("the weights and the activation reserve leave no KV budget")
        return int(budget // model.kv_bytes_per_token) // seq_len
        ### END SOLUTION
    """,
    ["max_batch"],
)

nb.exercise(
    "ex1.6",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure
    every question has an answer of the right kind, and a graded failure says how many
    are wrong, never which.

    - `q1`: the allocator of ex1.4, fresh, sees: A (final length 5), B (9) and C (3)
      arrive, A finishes, D (7) and E (4) arrive. How many reserved slots will never hold
      a token (internal fragmentation)?
    - `q2`: how many blocks of 4 slots does a 9-token request hold when paged?
    - `q3`: then F (final length 6) arrives and does not fit, and 0 slots are free: is that
      `"internal"` or `"external"` fragmentation, or `"neither"`?
    - `q4`: which waste does paging leave, at most `block_size - 1` slots per request:
      `"internal"` or `"external"`?

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 9, "q2": 3, "q3": "neither", "q4": "internal"}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Recap

One token of OPT-13B or Llama-2-13B costs about 800 KB of KV cache, so the cache, not the weights,
decides how many requests fit. Reserving contiguous space by the maximum length wastes most
of it; paging wastes less than one block per sequence.
""")

if __name__ == "__main__":
    nb.build()
