"""Generator of notebooks/exercises/ch03_paged_attention.ipynb (chapter 03 exercises)."""

from _common import ExerciseNotebook

from minipaged.checks.ch03 import READ_BLOCK_SIZE, READ_PARTITION_SIZE, READ_SEQUENCES, read_sequence_row

nb = ExerciseNotebook(
    chapter="ch03",
    filename="ch03_paged_attention.ipynb",
    title="Chapter 03 exercises: attention through a block table",
    minutes=80,
    intro="""
    Companion to `notebooks/03_paged_attention.ipynb`. You will read K and V through a
    block table, write decode attention over a paged cache by hand in torch, write the
    loop of a Triton decode kernel (it runs in Triton's interpreter on a CPU), and merge
    split-KV partitions. The checks compare with `minipaged.kernels.paged_attention_ref`.

    Shapes: `q [num_seqs, num_heads, head_dim]` (one new token per sequence);
    `k_cache`, `v_cache [num_blocks, block_size, num_kv_heads, head_dim]`;
    `block_tables [num_seqs, max_blocks]` int32 (entries past a sequence's last block are
    unused); `seq_lens [num_seqs]` int32, the number of cached tokens of each sequence,
    the new one included. Query head `h` reads KV head `h // (num_heads // num_kv_heads)`
    (grouped-query attention).
    """,
)

# NOTE: the setup cell holds the data as literals: a submission may not import minipaged.checks
nb.setup(f"""
import minipaged.kernels  # first: on a machine without CUDA this turns on TRITON_INTERPRET=1
import torch
import triton
import triton.language as tl

# ex3.5: block size, split-KV partition size; (sequence, block table, tokens) of each sequence
READ_BLOCK_SIZE, READ_PARTITION_SIZE = {READ_BLOCK_SIZE!r}, {READ_PARTITION_SIZE!r}
READ_SEQUENCES = {READ_SEQUENCES!r}
""")

nb.exercise(
    "ex3.1",
    "gather one sequence's K and V",
    """
    Write `gather_kv(k_cache, v_cache, block_table, seq_len)` for one sequence:
    `block_table` is its row of the block tables (`[max_blocks]`), and token `i` lives at
    `k_cache[block_table[i // block_size], i % block_size]` (and the same in `v_cache`).
    Return `(k, v)`, each `[seq_len, num_kv_heads, head_dim]`, token `i` in row `i`.
    Try it with tensor indexing (no Python loop over tokens).
    """,
    """
    def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
        \"\"\"K and V of one sequence as contiguous [seq_len, num_kv_heads, head_dim] tensors.\"\"\"
        ### BEGIN SOLUTION
        block_size = k_cache.shape[1]
        positions = torch.arange(seq_len)  # [L]
        block_ids = block_table.long()[positions // block_size]  # [L] physical block of each token
        offsets = positions % block_size  # [L] slot inside that block
        return k_cache[block_ids, offsets], v_cache[block_ids, offsets]  # [L, KVH, D] each
        ### END SOLUTION
    """,
    ["gather_kv"],
)

nb.exercise(
    "ex3.2",
    "decode attention through block tables, by hand",
    """
    Write `paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)`:
    for each sequence `b` and query head `h`, the new token's attention over all
    `seq_lens[b]` cached tokens,

    `out[b, h] = softmax(scale * K_b @ q[b, h]) @ V_b`, with `K_b`, `V_b` the sequence's
    keys and values of KV head `h // (num_heads // num_kv_heads)`.

    Return `[num_seqs, num_heads, head_dim]` in `q`'s dtype. A loop over sequences is
    fine (you may call your `gather_kv`); do not call minipaged's attention functions.
    """,
    """
    def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
        \"\"\"Decode attention over a paged KV cache: q [B, H, D] -> [B, H, D].\"\"\"
        ### BEGIN SOLUTION
        num_seqs, num_heads, head_dim = q.shape
        group = num_heads // k_cache.shape[2]
        out = torch.empty_like(q)  # [B, H, D]
        for b in range(num_seqs):
            k, v = gather_kv(k_cache, v_cache, block_tables[b], int(seq_lens[b]))  # [L, KVH, D]
            k = k.repeat_interleave(group, dim=1)  # [L, H, D]: each KV head serves `group` query heads
            v = v.repeat_interleave(group, dim=1)  # [L, H, D]
            scores = torch.einsum("hd,lhd->hl", q[b].float(), k.float()) * scale  # [H, L]
            probs = torch.softmax(scores, dim=-1)  # [H, L]
            out[b] = torch.einsum("hl,lhd->hd", probs, v.float()).to(q.dtype)  # [H, D]
        return out
        ### END SOLUTION
    """,
    ["paged_decode_attention"],
)

nb.exercise(
    "ex3.3",
    "the Triton decode kernel's loop over blocks",
    """
    One Triton program handles one (sequence, query head). It has loaded the query `q`
    (`[HEAD_DIM]`, fp32) and must walk the sequence's blocks, keeping an *online
    softmax*: a running max `m_i`, a running sum `l_i` of `exp(score - m_i)`, and a running
    output `acc` (`[HEAD_DIM]`, unnormalized). Write the loop (the rest of the kernel is
    given): for each logical block `j = 0 .. cdiv(seq_len, BLOCK_SIZE) - 1`

    1. load the physical block id `block_tables_ptr[seq * stride_bts + j]`;
    2. load that block's keys and values of `kv_head` as `[BLOCK_SIZE, HEAD_DIM]` tiles:
       element (t, d) is at `block_id * stride_kb + t * stride_kt + kv_head * stride_kh + d`
       (the same offsets in `v_cache_ptr`); mask out tokens `j * BLOCK_SIZE + t >= seq_len`;
    3. scores `s = scale * sum_d k[t, d] * q[d]` (`-inf` where masked);
    4. `m_new = max(m_i, max(s))`, `alpha = exp(m_i - m_new)`, `p = exp(s - m_new)`,
       `l_i = l_i * alpha + sum(p)`, `acc = acc * alpha + sum_t p[t] * v[t, :]`, `m_i = m_new`.

    Useful: `tl.load(ptr + offsets, mask=..., other=0.0)`, `tl.sum(x, axis=0)`,
    `tl.max(x, axis=0)`, `tl.maximum`, `tl.exp`, `tl.where`, `tl.cdiv`, broadcasting with
    `x[:, None]` / `x[None, :]`. On a CPU the kernel runs in Triton's interpreter, so a
    plain `print` inside it works while you debug (the check hides what it prints).
    """,
    """
    @triton.jit
    def paged_decode_kernel(
        out_ptr,  # [num_seqs, num_heads, HEAD_DIM] output
        q_ptr,  # [num_seqs, num_heads, HEAD_DIM] queries
        k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
        v_cache_ptr,  # same shape and strides as k_cache
        block_tables_ptr,  # [num_seqs, max_blocks] int32
        seq_lens_ptr,  # [num_seqs] int32
        scale,  # softmax scale, 1 / sqrt(HEAD_DIM)
        stride_qs, stride_qh,  # q strides: sequence, head (head_dim stride is 1)
        stride_kb, stride_kt, stride_kh,  # cache strides: block, token, kv head
        stride_bts,  # block_tables stride over sequences
        stride_os, stride_oh,  # out strides: sequence, head
        QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        HEAD_DIM: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // QUERIES_PER_KV
        offs_t = tl.arange(0, BLOCK_SIZE)  # token offsets inside a block
        offs_d = tl.arange(0, HEAD_DIM)
        seq_len = tl.load(seq_lens_ptr + seq)
        q = tl.load(q_ptr + seq * stride_qs + head * stride_qh + offs_d).to(tl.float32)  # [HEAD_DIM]
        m_i = tl.full([], float("-inf"), dtype=tl.float32)  # running max of the scores
        l_i = tl.full([], 0.0, dtype=tl.float32)  # running sum of exp(score - m_i)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)  # running (unnormalized) output
        ### BEGIN SOLUTION
        for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
            block_id = tl.load(block_tables_ptr + seq * stride_bts + j).to(tl.int64)
            mask = j * BLOCK_SIZE + offs_t < seq_len  # [BLOCK_SIZE]
            offs = block_id * stride_kb + offs_t[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
            k = tl.load(k_cache_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)  # [BLOCK_SIZE, HEAD_DIM]
            v = tl.load(v_cache_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)  # [BLOCK_SIZE, HEAD_DIM]
            s = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_SIZE]
            s = tl.where(mask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max
            p = tl.exp(s - m_new)  # [BLOCK_SIZE]
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)  # [HEAD_DIM]
            m_i = m_new
        ### END SOLUTION
        tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, acc / l_i)
    """,
    ["paged_decode_kernel"],
)

nb.exercise(
    "ex3.4",
    "split-KV: combine the partitions",
    """
    With few long sequences, one program per (sequence, head) leaves most of a GPU idle.
    Split-KV ("PagedAttention V2") cuts each context into partitions, attends to each in
    parallel, and then merges. Partition `p` of (sequence `b`, head `h`) leaves:

    - `max_logits[b, h, p]`: the max score `m_p` over its tokens (natural log scale);
    - `exp_sums[b, h, p]`: `l_p = sum exp(score - m_p)` over its tokens;
    - `tmp_out[b, h, p]`: its output *already divided by* `l_p` (`[head_dim]`).

    A partition past the end of a shorter sequence is empty: `m_p = -inf`, `l_p = 0`,
    output 0. Write `combine_partitions(tmp_out, max_logits, exp_sums)` -> `[num_seqs,
    num_heads, head_dim]`, the exact attention output: rescale every partition to a
    common max `M = max_p m_p`, weight `w_p = l_p * exp(m_p - M)`, and return
    `sum_p w_p * tmp_out_p / sum_p w_p`. Empty partitions must not produce NaN.
    """,
    """
    def combine_partitions(tmp_out: torch.Tensor, max_logits: torch.Tensor, exp_sums: torch.Tensor) -> torch.Tensor:
        \"\"\"Merge split-KV partitions: [B, H, P, D], [B, H, P], [B, H, P] -> [B, H, D].\"\"\"
        ### BEGIN SOLUTION
        global_max = max_logits.max(dim=-1, keepdim=True).values  # [B, H, 1]
        weights = exp_sums * torch.exp(max_logits - global_max)  # [B, H, P]; empty partitions -> 0
        weights = torch.nan_to_num(weights, nan=0.0)
        out = (weights[..., None] * tmp_out).sum(dim=-2)  # [B, H, D]
        return out / weights.sum(dim=-1, keepdim=True)
        ### END SOLUTION
    """,
    ["combine_partitions"],
)

nb.exercise(
    "ex3.5",
    "predict what each split-KV partition reads (on paper first)",
    """
    A split-KV kernel (chapter 03's "PagedAttention V2") cuts each sequence into
    partitions of `READ_PARTITION_SIZE = 8` tokens, one program per partition, and walks
    each partition's tokens in order through the block table (`READ_BLOCK_SIZE = 4`):

    | sequence | block table | tokens |
    |---|---|---|
{READ_ROWS}

    (the same as `READ_SEQUENCES` in the setup cell). Write `predict_reads()`: a dict
    sequence -> list of partitions, each partition the list of `(physical block id, number
    of tokens read from it)` in the order the kernel reads them. Example, for another
    sequence: block table `[9, 1]` and 5 tokens -> `[[(9, 4), (1, 1)]]` (one partition;
    all of block 9, one token of block 1). Work it out on paper; the check says which
    entry is the first wrong one (never the right answer).
    """.replace("{READ_ROWS}", "\n".join("    " + read_sequence_row(s) for s in READ_SEQUENCES)),
    """
    def predict_reads() -> dict[str, list[list[tuple[int, int]]]]:
        \"\"\"Per sequence, per partition: (block id, tokens read) in order.\"\"\"
        ### BEGIN SOLUTION
        return {
            "A": [[(7, 4), (2, 4)], [(5, 4), (0, 1)]],
            "B": [[(3, 4), (6, 1)]],
            "C": [[(1, 4), (4, 4)], [(8, 1)]],
        }
        ### END SOLUTION
    """,
    ["predict_reads"],
)

nb.exercise(
    "ex3.6",
    "the arithmetic intensity of decode attention (measure)",
    """
    One decode token attends to `seq_len` cached tokens. Per query head and key it does a
    dot product `q·k` and adds `p × v`: `head_dim` multiply-adds each, 2 FLOPs per
    multiply-add. It reads each cached K and V vector of its KV head once (with GQA,
    several query heads share one KV head: the kernel reads it once for the group).

    - **Write** `attention_intensity(num_heads, num_kv_heads, head_dim, seq_len,
      dtype_bytes)`: the FLOPs divided by the bytes of K/V read (ignore q and the
      output).
    - **Failure mode**: any argument that is not an int >= 1, or `num_heads` not a
      multiple of `num_kv_heads` -> `ValueError`.

    Worked example: 32 query heads, 8 KV heads, head_dim 128, 1000 tokens, fp16 ->
    `4.0` FLOPs per byte. The check prints your figure for MHA, GQA and MQA shapes beside
    an H100's ridge (peak FLOPs / bandwidth): predict first which, if any, is compute-bound.
    """,
    """
    def attention_intensity(num_heads: int, num_kv_heads: int, head_dim: int, seq_len: int,
                            dtype_bytes: int) -> float:
        \"\"\"FLOPs per byte of K/V read by one decode token's attention.\"\"\"
        ### BEGIN SOLUTION
        for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("seq_len", seq_len), ("dtype_bytes", dtype_bytes)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        flops = 4 * num_heads * head_dim * seq_len
        nbytes = 2 * num_kv_heads * head_dim * seq_len * dtype_bytes
        return flops / nbytes
        ### END SOLUTION
    """,
    ["attention_intensity"],
)

nb.exercise(
    "ex3.7",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure
    every question has an answer of the right kind, and a graded failure says how many
    are wrong, never which.

    - `q1`: how many split-KV partitions does a 1000-token sequence have with
      `partition_size = 512`?
    - `q2`: with 32 query heads and 8 KV heads, which KV head (its index) does query
      head 13 read?
    - `q3`: does the paged kernel compute the same numbers as attention over a contiguous
      cache, up to rounding: `"yes"` or `"no"`?
    - `q4`: is the decode attention kernel at batch 1 bound by `"memory"` or `"compute"`?

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 2, "q2": 3, "q3": "yes", "q4": "memory"}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Recap

Paging changes only *where* a key is read from: one extra load of a block id per block.
The math after the load is ordinary attention, done with an online softmax so the score
matrix is never stored (that part is FlashAttention's idea, not PagedAttention's), and it
splits across partitions exactly, because softmax pieces can be rescaled to a common max.
""")

if __name__ == "__main__":
    nb.build()
