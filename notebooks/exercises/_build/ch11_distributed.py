"""Generator of notebooks/exercises/ch11_distributed.ipynb (chapter 11 exercises)."""

from _common import ExerciseNotebook

from minipaged.checks.ch11 import AR_TOKENS, TP_MODEL, TP_SIZES, tp_model_row

# the table of ex11.3 (a student copy made with --seed gets its own model, written in)
TP_TABLE = "\n".join(f"    {tp_model_row(item)}" for item in TP_MODEL.items())

nb = ExerciseNotebook(
    chapter="ch11",
    filename="ch11_distributed.ipynb",
    title="Chapter 11 exercises: tensor-parallel shards, one block table",
    minutes=60,
    intro="""
    Companion to `notebooks/11_distributed.ipynb`. You will write one rank's share of a
    Megatron-style MLP (its partial sum, which the all-reduce adds up), find the rows of the
    fused q/k/v weight a rank holds, predict what each worker of a tensor-parallel group
    holds and how many collectives a forward makes, and measure the bytes the all-reduces
    move. Everything runs in this one process: the ranks are a loop, the all-reduce a sum.
    """,
)

# NOTE: the setup cell holds the data as literals: a submission may not import minipaged.checks
nb.setup(f"""
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
# ex11.3: the model (as (field, value) pairs) and the tensor-parallel sizes
TP_MODEL_ITEMS = {list(TP_MODEL.items())!r}
TP_MODEL = dict(TP_MODEL_ITEMS)
TP_SIZES = {TP_SIZES!r}
""")

nb.exercise(
    "ex11.1",
    "one rank's share of a tensor-parallel MLP",
    """
    A Llama MLP computes `down(silu(gate(x)) * up(x))`: `w_gate` and `w_up` are
    `[I, hidden]`, `w_down` is `[hidden, I]` (`nn.Linear` layout: `y = x @ w.T`). Split over
    `size` ranks, rank `r` holds rows `r*I/size .. (r+1)*I/size - 1` of `w_gate` and `w_up`
    (column-parallel: its own slice of the intermediate activations, no communication) and
    the same *columns* of `w_down` (row-parallel: a partial product of the full output).

    Write `mlp_shard(x, w_gate, w_up, w_down, rank, size)`: rank `rank`'s partial output,
    `[T, hidden]`, before the all-reduce. Raise `ValueError` if `size` does not divide `I`.
    The check calls it for every rank and compares each partial; the sum of the partials
    (what the all-reduce computes) is then the unsharded MLP. Why is the product
    `silu(gate) * up` safe to take per rank, when `down` is not?
    """,
    """
    def mlp_shard(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  rank: int, size: int) -> torch.Tensor:
        \"\"\"Rank `rank`'s partial sum of the MLP's output, [T, hidden].\"\"\"
        ### BEGIN SOLUTION
        inter = w_gate.shape[0]
        if inter % size != 0:
            raise ValueError(f"size {size} does not divide the intermediate size {inter}")
        part = inter // size
        rows = slice(rank * part, (rank + 1) * part)
        act = F.silu(F.linear(x, w_gate[rows])) * F.linear(x, w_up[rows])  # [T, I/size]
        return F.linear(act, w_down[:, rows])  # [T, hidden]
        ### END SOLUTION
    """,
    ["mlp_shard"],
)

nb.exercise(
    "ex11.2",
    "the rows of q, k and v a rank holds",
    """
    The fused `qkv_proj` weight stacks the rows of q (`num_heads * head_dim` rows), then k
    and v (`num_kv_heads * head_dim` rows each). Split by heads over `size` ranks, rank `r`
    holds query heads `r*H/size ..` and KV heads `r*KVH/size ..`, whole heads only.

    Write `qkv_shard_rows(num_heads, num_kv_heads, head_dim, rank, size)`: a dict
    `{"q": [start, end], "k": [start, end], "v": [start, end]}`, the rows (end excluded) of
    the *full* fused weight that rank `rank` loads for each. Raise `ValueError` if `size`
    does not divide both `num_heads` and `num_kv_heads` (this engine does not replicate KV
    heads, as vLLM does when `size > num_kv_heads`).

    Hand check: 4 query heads, 2 KV heads of 2 dims, rank 1 of 2: q rows `[4, 8]`, k rows
    `[10, 12]`, v rows `[14, 16]`.
    """,
    """
    def qkv_shard_rows(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, size: int) -> dict:
        \"\"\"The [start, end] rows of q, k and v in the fused weight that `rank` holds.\"\"\"
        ### BEGIN SOLUTION
        if num_heads % size or num_kv_heads % size:
            raise ValueError(f"size {size} must divide {num_heads} heads and {num_kv_heads} KV heads")
        q_rows = num_heads * head_dim // size
        kv_rows = num_kv_heads * head_dim // size
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        return {
            "q": [rank * q_rows, (rank + 1) * q_rows],
            "k": [q_end + rank * kv_rows, q_end + (rank + 1) * kv_rows],
            "v": [k_end + rank * kv_rows, k_end + (rank + 1) * kv_rows],
        }
        ### END SOLUTION
    """,
    ["qkv_shard_rows"],
)

nb.exercise(
    "ex11.3",
    "predict what each worker holds and sends (on paper first)",
    f"""
    The model of `TP_MODEL` (your copy's model may differ from a classmate's), served with
    each tensor-parallel size of `TP_SIZES = {TP_SIZES}`:

    | field | value |
    |---|---|
{{TP_TABLE}}

    Write `predict_tp()`: one entry per size of `TP_SIZES`, in order: `None` if the engine
    refuses that size (it must divide the query heads, the KV heads and the intermediate
    size), else a dict

    - `"kv_heads"`: the KV heads of one worker;
    - `"kv_bytes_per_block"`: the bytes of K and V one worker keeps for one block, all
      layers together (`head_dim = hidden_size / num_heads`);
    - `"all_reduces"`, `"all_gathers"`: the collectives of one forward (chapter 11,
      section 1: which layers are row-parallel, and what the embedding and the LM head do);
      none at size 1.

    Example: a model of 2 layers, 4 heads of 8 dims, 2 KV heads, blocks of 16, fp16, at size 2
    would be `{{"kv_heads": 1, "kv_bytes_per_block": 1024, "all_reduces": 5, "all_gathers": 1}}`.
    """.replace("{TP_TABLE}\n", TP_TABLE + "\n"),
    """
    def predict_tp() -> list:
        \"\"\"Per size of TP_SIZES: None, or what one worker holds and the collectives of a forward.\"\"\"
        ### BEGIN SOLUTION
        return [
            {"kv_heads": 8, "kv_bytes_per_block": 2097152, "all_reduces": 0, "all_gathers": 0},
            {"kv_heads": 4, "kv_bytes_per_block": 1048576, "all_reduces": 65, "all_gathers": 1},
            {"kv_heads": 2, "kv_bytes_per_block": 524288, "all_reduces": 65, "all_gathers": 1},
            {"kv_heads": 1, "kv_bytes_per_block": 262144, "all_reduces": 65, "all_gathers": 1},
            None,
        ]
        ### END SOLUTION
    """,
    ["predict_tp"],
)

nb.exercise(
    "ex11.4",
    "the bytes a forward's all-reduces move (measure)",
    f"""
    A forward makes `2 * num_layers + 1` all-reduces of a `[num_tokens, hidden_size]`
    tensor. A ring all-reduce over `size` ranks sends, from each rank, `2 (size - 1) / size`
    of the tensor's bytes (a reduce-scatter, then an all-gather).

    - **Write** `allreduce_bytes(num_tokens, hidden_size, num_layers, size, dtype_bytes)`:
      the bytes one rank sends in one forward's all-reduces (an int; floor the division).
    - **Failure mode**: any argument that is not an int >= 1 -> `ValueError`.

    The check then prints it for the paper's settings (OPT-66B on 4 GPUs, OPT-175B on 8,
    fp16) for a decode step of {AR_TOKENS[0]} sequences and a prefill of {AR_TOKENS[1]} tokens.
    Predict first: does the context length of the sequences change it?
    """,
    """
    def allreduce_bytes(num_tokens: int, hidden_size: int, num_layers: int, size: int, dtype_bytes: int) -> int:
        \"\"\"Bytes one rank sends in one forward's all-reduces over a ring.\"\"\"
        ### BEGIN SOLUTION
        for v in (num_tokens, hidden_size, num_layers, size, dtype_bytes):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"every argument must be a positive int, got {v!r}")
        per_tensor = num_tokens * hidden_size * dtype_bytes
        return (2 * num_layers + 1) * 2 * (size - 1) * per_tensor // size
        ### END SOLUTION
    """,
    ["allreduce_bytes"],
)

nb.exercise(
    "ex11.5",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure every
    question has an answer of the right kind, and a graded failure says how many are wrong,
    never which.

    - `q1`: with `tensor_parallel_size = 2`, how many block tables does the engine keep for one request?
    - `q2`: which layer of a decoder needs no communication: `"o_proj"`, `"qkv_proj"` or `"down_proj"`?
    - `q3`: the course model has 2 KV heads: the largest `tensor_parallel_size` this engine accepts for it
    - `q4`: does a worker's KV cache have fewer blocks, or the same number of blocks with fewer heads each: `"fewer blocks"` or `"fewer heads"`?

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 1, "q2": "qkv_proj", "q3": 2, "q4": "fewer heads"}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. ex11.1's partial sums are added in a different order on every machine: why are the
   outputs of a tensor-parallel engine equal to the one-process engine's only up to float
   rounding, and why do greedy tokens still agree here?
2. ex11.4 grows with the tokens of a step but not with their context. Which grows with the
   context instead, and does it cross a process boundary?
3. Pipeline parallelism (chapter 11, section 5) splits by layers instead: what would each
   worker's KV cache hold, and what would cross between workers each step?

## Recap

A column-parallel layer splits the output columns and needs no communication; a row-parallel
layer leaves partial sums that one all-reduce adds. Attention splits by heads, and so does the
KV cache: every worker holds every block, with its heads only, so one block table (one
scheduler, one KV-cache manager) serves them all.
""")

if __name__ == "__main__":
    nb.build()
