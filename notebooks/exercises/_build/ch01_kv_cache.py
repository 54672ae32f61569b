"""Generator of notebooks/exercises/ch01_kv_cache.ipynb (chapter 01 exercises)."""

from _common import ExerciseNotebook

nb = ExerciseNotebook(
    chapter="ch01",
    filename="ch01_kv_cache.ipynb",
    title="Chapter 01 exercises: the KV cache and what it costs",
    minutes=30,
    intro="""
    Companion to `notebooks/01_kv_cache.ipynb`. You will compute what one token's keys and
    values cost for real models, how much a contiguous allocator reserves per request, and
    how much of the reserved memory holds tokens once memory is paged.
    """,
)

nb.setup("""
from minipaged.core import KVCacheManager, cdiv
""")

nb.exercise(
    "ex1.1", "KV cache bytes per token",
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
    "ex1.2", "what a contiguous allocator reserves",
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
    "ex1.3", "how much paged memory holds tokens",
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

nb.outro("""
## Recap

One token of OPT-13B or Llama-2-13B costs about 800 KB of KV cache, so the cache, not the weights,
decides how many requests fit. Reserving contiguous space by the maximum length wastes most
of it; paging wastes less than one block per sequence.
""")

if __name__ == "__main__":
    nb.build()
