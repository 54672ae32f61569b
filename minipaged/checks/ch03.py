"""Checkers for chapter 03 exercises: attention through a block table.

Exercises (notebooks/exercises/ch03_paged_attention.ipynb)
    ex3.1 ``gather_kv(k_cache, v_cache, block_table, seq_len)``: one sequence's K and V,
          read token by token through its block table.
    ex3.2 ``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)``:
          decode attention by hand in torch (GQA included).
    ex3.3 ``paged_decode_kernel``: the inner loop of a Triton decode kernel (online
          softmax over the blocks of one sequence), run under ``TRITON_INTERPRET=1`` on CPU.
    ex3.4 ``combine_partitions(tmp_out, max_logits, exp_sums)``: the split-KV reduce
          ("PagedAttention V2"): merge per-partition results into the exact output.
    ex3.5 ``predict_reads()`` -> per sequence of ``READ_SEQUENCES`` (a per-student
          workload), per split-KV partition, the ``(physical block, tokens read)`` in order
          (a prediction), judged against the indexing of ``split_kv_partials``.
    ex3.6 ``attention_intensity(num_heads, num_kv_heads, head_dim, seq_len, dtype_bytes)``:
          FLOPs per byte of K/V read by one decode token's attention (the formula of the
          course cost model); the local check then prints the figure for MHA, GQA and MQA
          shapes (a measurement of why decode attention is memory-bound).
    ex3.7 ``concept_answers()``: the end-of-chapter questions (answers in the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``). A case is plain data: the shapes,
the sequence lengths and a torch seed; ``observe`` (the student's kernel) builds the
tensors from it (``case_tensors``: seeded, so both sides build the same ones), calls the
student's function or launches the student's kernel, and returns the output tensors
(through ``minipaged.grading.codec``). The trusted side computes the expected tensors
with ``minipaged.kernels.reference.paged_attention_ref`` (ex3.2-ex3.4) or plain indexing
(ex3.1) and compares within ``rel_tol=1e-4, abs_tol=1e-5`` (exactly for gathers). Shapes
are kept small (a few thousand values per case): the results cross as JSON text.
Shapes: q [num_seqs, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads,
head_dim]; block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32.
Float32 throughout; an output of another dtype or shape is wrong.

ex3.4's split-KV partials are computed on the trusted side (``split_kv_partials``) and sent
in the case: with one partition they are decode attention itself, so the kernel has none.

Failure mode: the student's code raising becomes data (``{"raised": ...}``), reported with
the smallest failing case; a missing Triton (ex3.3) is reported as such.
"""

from __future__ import annotations

import math
import os

import torch

from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.kernels.reference import paged_attention_ref

SPECS: dict = {}
ATOL, RTOL = 1e-5, 1e-4


def case_tensors(c: dict, device: str = "cpu") -> dict:
    """The tensors a case describes: random q and caches from ``c["seed"]``; each sequence
    gets random, non-contiguous physical blocks (a few blocks nobody uses)."""
    g = torch.Generator().manual_seed(int(c["seed"]))
    block_size, seq_lens = int(c["block_size"]), [int(n) for n in c["seq_lens"]]
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(num_seqs, max(blocks_per_seq), dtype=torch.int32)
    k = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = torch.tensor(perm[k : k + nb], dtype=torch.int32)
        k += nb
    head_dim, kvh = int(c["head_dim"]), int(c["num_kv_heads"])
    t = dict(
        q=torch.randn(num_seqs, int(c["num_heads"]), head_dim, generator=g),  # [B, H, D]
        k_cache=torch.randn(num_blocks, block_size, kvh, head_dim, generator=g),
        v_cache=torch.randn(num_blocks, block_size, kvh, head_dim, generator=g),
        block_tables=tables,  # [B, max_blocks]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [B]
    )
    t = {name: v.to(device) for name, v in t.items()}
    t["scale"] = 1.0 / math.sqrt(head_dim)
    return t


def _attention_cases(rng, n, block_sizes=(1, 2, 4, 8), head_dims=(4, 8, 16), max_len=40, max_seqs=4):
    cases = []
    for _ in range(n):
        num_kv_heads = rng.choice([1, 2])
        num_seqs = rng.randint(1, max_seqs)
        cases.append(
            dict(
                seed=rng.randrange(2**31),
                num_heads=num_kv_heads * rng.choice([1, 2, 4]),
                num_kv_heads=num_kv_heads,
                head_dim=rng.choice(head_dims),
                block_size=rng.choice(block_sizes),
                seq_lens=[rng.randint(1, max_len) for _ in range(num_seqs)],
            )
        )
    return cases


def _size(c: dict):
    return (
        len(c["seq_lens"]) * c["num_heads"] * max(c["seq_lens"]),
        c["head_dim"],
        c.get("partition_size", 0),
    )


def _describe(c: dict) -> str:
    extra = f", partition_size={c['partition_size']}" if "partition_size" in c else ""
    return (
        f"num_seqs={len(c['seq_lens'])}, num_heads={c['num_heads']}, num_kv_heads={c['num_kv_heads']}, "
        f"head_dim={c['head_dim']}, block_size={c['block_size']}, seq_lens={c['seq_lens']}{extra} "
        f"(tensors from torch seed {c['seed']}: minipaged.checks.ch03.case_tensors(case)); "
        "[flat i] below is the row-major index of an output element"
    )


def _ref_out(c: dict) -> torch.Tensor:
    """The exact attention output of a case (trusted side)."""
    t = case_tensors(c)
    return paged_attention_ref(
        t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"], scale=t["scale"]
    )


def _attention_spec(exercise_id, title, signature, cases, observe, **kw) -> Spec:
    return Spec(
        exercise_id,
        title,
        signature,
        cases=cases,
        observe=observe,
        describe=_describe,
        size=_size,
        rel_tol=RTOL,
        abs_tol=ATOL,
        **kw,
    )


# -- ex3.1 -------------------------------------------------------------------------------


def observe_gather(c, gather_kv):
    t = case_tensors(c)
    return gather_kv(t["k_cache"], t["v_cache"], t["block_tables"][0].clone(), int(c["seq_lens"][0]))


def ref_gather_kv(k_cache, v_cache, block_table, seq_len):
    """Token ``i`` read from ``[block_table[i // block_size], i % block_size]``, one at a time."""
    bs = k_cache.shape[1]
    ids = [int(block_table[i // bs]) for i in range(seq_len)]
    k = torch.stack([k_cache[ids[i], i % bs] for i in range(seq_len)])  # [L, KVH, D]
    v = torch.stack([v_cache[ids[i], i % bs] for i in range(seq_len)])  # [L, KVH, D]
    return k, v


register(
    SPECS,
    Spec(
        "ex3.1",
        "gather one sequence's K and V through its block table",
        "gather_kv(k_cache, v_cache, block_table, seq_len)",
        cases=lambda rng: _attention_cases(rng, 60, head_dims=(4, 8), max_seqs=1),
        observe=observe_gather,
        reference=lambda: (ref_gather_kv,),
        describe=lambda c: _describe(c) + "; the result is [k, v], each [seq_len, num_kv_heads, head_dim]",
        size=_size,
    ),
)


# -- ex3.2 -------------------------------------------------------------------------------


def observe_attention(c, paged_decode_attention):
    t = case_tensors(c)
    return paged_decode_attention(
        t["q"].clone(),
        t["k_cache"],
        t["v_cache"],
        t["block_tables"].clone(),
        t["seq_lens"].clone(),
        t["scale"],
    )


register(
    SPECS,
    _attention_spec(
        "ex3.2",
        "decode attention through block tables, by hand in torch",
        "paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)",
        cases=lambda rng: _attention_cases(rng, 50),
        observe=observe_attention,
        expected=lambda c, key: _ref_out(c),
    ),
)


# -- ex3.3 -------------------------------------------------------------------------------


def _triton_device() -> str:
    try:
        import triton  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "ex3.3 needs Triton, which is not installed here (Linux x86-64 only); "
            "skip this exercise on this machine"
        ) from None
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    raise RuntimeError(
        "ex3.3: no GPU and TRITON_INTERPRET is not 1; run the setup cell first "
        "(it imports minipaged.kernels, which turns the interpreter on)"
    )


def launch_decode_kernel(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Launch a kernel with the ex3.3 signature: one program per (sequence, query head)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)  # [B, H, D]
    kernel[(num_seqs, num_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
    )
    return out


def observe_kernel(c, paged_decode_kernel):
    device = _triton_device()
    if not hasattr(paged_decode_kernel, "__getitem__"):
        raise TypeError("paged_decode_kernel must be a Triton kernel (decorated with @triton.jit)")
    t = case_tensors(c, device)
    return launch_decode_kernel(
        paged_decode_kernel, t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"], t["scale"]
    )


register(
    SPECS,
    _attention_spec(
        "ex3.3",
        "the Triton decode kernel's loop over blocks (online softmax)",
        "paged_decode_kernel[(num_seqs, num_heads)](...)",
        # few, small cases: the interpreter runs each program in numpy, one after another
        cases=lambda rng: _attention_cases(
            rng, 8, block_sizes=(2, 4, 8), head_dims=(8, 16), max_len=24, max_seqs=3
        ),
        observe=observe_kernel,
        expected=lambda c, key: _ref_out(c),
    ),
)


# -- ex3.4 -------------------------------------------------------------------------------


def split_kv_partials(t: dict, partition_size: int):
    """Per-partition results as a split-KV kernel writes them (natural-log max, normalized outputs).

    -> tmp_out [B, H, P, D], max_logits [B, H, P], exp_sums [B, H, P]; empty partitions
    (past a shorter sequence's end) have max_logit -inf, exp_sum 0 and output 0.
    """
    q, k_cache, v_cache = t["q"], t["k_cache"], t["v_cache"]
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    seq_lens = [int(x) for x in t["seq_lens"]]
    num_parts = max(-(-n // partition_size) for n in seq_lens)
    tmp_out = torch.zeros(num_seqs, num_heads, num_parts, head_dim)
    max_logits = torch.full((num_seqs, num_heads, num_parts), float("-inf"))
    exp_sums = torch.zeros(num_seqs, num_heads, num_parts)
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        ids = t["block_tables"][b].long()[pos // block_size]
        k = k_cache[ids, pos % block_size]  # [L, KVH, D]
        v = v_cache[ids, pos % block_size]  # [L, KVH, D]
        for h in range(num_heads):
            s = (k[:, h // group] @ q[b, h]) * t["scale"]  # [L]
            for p in range(-(-n // partition_size)):
                sp = s[p * partition_size : (p + 1) * partition_size]
                m = sp.max()
                e = torch.exp(sp - m)
                max_logits[b, h, p] = m
                exp_sums[b, h, p] = e.sum()
                tmp_out[b, h, p] = (e / e.sum()) @ v[
                    p * partition_size : (p + 1) * partition_size, h // group
                ]
    return tmp_out, max_logits, exp_sums


PARTIALS = ("tmp_out", "max_logits", "exp_sums")


def _partition_cases(rng):
    """NOTE: the partials are computed here (trusted side) and sent in the case: with one
    partition per sequence ``split_kv_partials`` *is* decode attention (ex3.2), so it is not
    in the student build."""
    cases = _attention_cases(rng, 50, max_len=30)
    for c in cases:
        c["partition_size"] = rng.choice([1, 2, 4, 8])
        c["partials"] = dict(zip(PARTIALS, split_kv_partials(case_tensors(c), c["partition_size"])))
    return cases


def _partials(c: dict) -> tuple:
    """The case's partials as float32 tensors (sent as data, ``minipaged.grading.codec``)."""
    out = []
    for name in PARTIALS:
        t = c["partials"][name]
        if isinstance(t, torch.Tensor):  # a case not yet through JSON
            out.append(t.clone())
            continue
        vals = [float(v["__float__"]) if type(v) is dict else float(v) for v in t["__tensor__"]["values"]]
        out.append(torch.tensor(vals, dtype=torch.float32).reshape(t["__tensor__"]["shape"]))
    return tuple(out)


def observe_combine(c, combine_partitions):
    tmp_out, max_logits, exp_sums = _partials(c)
    return combine_partitions(tmp_out, max_logits, exp_sums)


register(
    SPECS,
    _attention_spec(
        "ex3.4",
        "split-KV: combine partition results into the exact output",
        "combine_partitions(tmp_out, max_logits, exp_sums)",
        cases=_partition_cases,
        observe=observe_combine,
        expected=lambda c, key: _ref_out(c),
    ),
)


# -- ex3.5: predict what each split-KV partition reads (one workload per student) -------------

READ_BLOCK_SIZE, READ_PARTITION_SIZE = 4, 8
# (sequence, block table, tokens): the shipped notebook's; a student copy made with --seed
# gets the sequences its seed draws (``read_sequences_variant``)
READ_SEQUENCES = [("A", [7, 2, 5, 0], 13), ("B", [3, 6], 5), ("C", [1, 4, 8], 9)]


def reference_reads(sequences=READ_SEQUENCES) -> dict:
    """Sequence -> per split-KV partition, the [physical block, tokens read from it] in order,
    the way ``split_kv_partials`` (and the kernel) index the cache."""
    out = {}
    for rid, table, n in sequences:
        parts = []
        for p in range(-(-n // READ_PARTITION_SIZE)):
            pos = torch.arange(p * READ_PARTITION_SIZE, min(n, (p + 1) * READ_PARTITION_SIZE))
            ids = torch.tensor(table)[pos // READ_BLOCK_SIZE].tolist()
            reads: list = []
            for b in ids:
                if reads and reads[-1][0] == b:
                    reads[-1] = [b, reads[-1][1] + 1]
                else:
                    reads.append([b, 1])
            parts.append(reads)
        out[rid] = parts
    return out


def read_sequences_variant(rng) -> list:
    """Three sequences A, B, C over distinct physical blocks of a 10-block pool: at least one
    longer than a partition, one ending mid-block, drawn by ``rng``."""
    while True:
        lens = [rng.randint(1, 16) for _ in range(3)]
        need = [-(-n // READ_BLOCK_SIZE) for n in lens]
        if sum(need) > 10 or max(lens) <= READ_PARTITION_SIZE or all(n % READ_BLOCK_SIZE == 0 for n in lens):
            continue
        blocks = rng.sample(range(10), sum(need))
        seqs, k = [], 0
        for rid, n, nb in zip("ABC", lens, need):
            seqs.append((rid, blocks[k : k + nb], n))
            k += nb
        return seqs


def read_sequence_row(seq) -> str:
    rid, table, n = seq
    return f"| {rid} | `{list(table)}` | {n} |"


def _reads_cases(rng):
    return [READ_SEQUENCES if rng is None else read_sequences_variant(rng)]


def observe_prediction(case, fn):
    return fn()


register(
    SPECS,
    Spec(
        "ex3.5",
        "predict what each split-KV partition reads",
        "predict_reads()",
        cases=_reads_cases,
        observe=observe_prediction,
        expected=lambda case, key: reference_reads([tuple(s) for s in case]),
        describe=lambda c: (
            f"the sequences of READ_SEQUENCES (block_size {READ_BLOCK_SIZE}, partition size "
            f"{READ_PARTITION_SIZE}): " + "; ".join(f"{r}: block table {t}, {n} tokens" for r, t, n in c)
        ),
        kind="prediction",
    ),
)
VARIANTS = {
    "ex3.5": (
        "READ_SEQUENCES",
        read_sequence_row,
        "| sequence | block table | tokens |\n|---|---|---|",
    )
}


# -- ex3.6: arithmetic intensity of decode attention ----------------------------------------

INTENSITY_SHAPES = {"MHA 32/32": (32, 32), "GQA 32/8": (32, 8), "MQA 32/1": (32, 1)}


def ref_attention_intensity(num_heads, num_kv_heads, head_dim, seq_len, dtype_bytes) -> float:
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("seq_len", seq_len), ("dtype_bytes", dtype_bytes)):  # fmt: skip
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    flops = 4 * num_heads * head_dim * seq_len  # q.k and p.v: a multiply-add each, per head and key
    nbytes = 2 * num_kv_heads * head_dim * seq_len * dtype_bytes  # K and V, read once
    return flops / nbytes


def _intensity_cases(rng):
    cases = [(32, 8, 128, 1000, 2), (1, 1, 1, 1, 1)]
    for _ in range(60):
        kv = rng.choice([1, 2, 4, 8, 16])
        cases.append(
            (
                kv * rng.choice([1, 2, 4, 8]),
                kv,
                rng.choice([64, 80, 128, 256]),
                rng.randint(1, 4096),
                rng.choice([1, 2, 4]),
            )
        )
    bad = [(32, 8, 128, 0, 2), (32, 6, 128, 10, 2), (32, 8, 128, 10, 0), (0, 1, 64, 10, 2), (8, 2, -4, 10, 2)]
    return cases + rng.sample(bad, 3)


def _intensity_report(attention_intensity) -> str:
    row = ", ".join(
        f"{name}: {attention_intensity(h, kv, 128, 4096, 2):g}" for name, (h, kv) in INTENSITY_SHAPES.items()
    )
    return f"FLOPs per byte, head_dim 128, 4096 tokens, fp16: {row} (an H100's ridge is about 295)\n"


register(
    SPECS,
    Spec(
        "ex3.6",
        "the arithmetic intensity of decode attention (measure)",
        "attention_intensity(num_heads, num_kv_heads, head_dim, seq_len, dtype_bytes)",
        cases=_intensity_cases,
        observe=lambda c, fn: attempt(lambda: fn(*c)),
        reference=lambda: (ref_attention_intensity,),
        describe=lambda c: (
            "attention_intensity(num_heads={}, num_kv_heads={}, head_dim={}, seq_len={}, dtype_bytes={})".format(
                *c
            )
        ),
        size=lambda c: (min(c) < 1, c[3]),
        report=_intensity_report,
    ),
)


# -- ex3.7: concept questions ----------------------------------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
QUESTIONS = {
    "q1": ("split-KV partitions of a 1000-token sequence with partition_size 512", None),
    "q2": ("KV heads query head 13 reads with 32 query heads and 8 KV heads (its index)", None),
    "q3": (
        "does the paged kernel compute the same numbers as attention over a contiguous cache, up to rounding: 'yes' or 'no'",
        ("yes", "no"),
    ),
    "q4": ("what the decode kernel is bound by at batch 1: 'memory' or 'compute'", ("memory", "compute")),
}
register(SPECS, concept_spec("ex3.7", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "READ_SEQUENCES",
    "SPECS",
    "VARIANTS",
    "case_tensors",
    "launch_decode_kernel",
    "split_kv_partials",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex3.1": (
        "minipaged.kernels.reference:_gather_kv",
        "minipaged.kernels.torch_backend:_gather_blocks",
    ),
    "ex3.2": (
        "minipaged.kernels.reference:paged_attention_ref",
        "minipaged.kernels.reference:paged_attention_prefill_ref",
        "minipaged.kernels.reference:contiguous_attention",
        "minipaged.kernels.torch_backend:paged_attention_torch",
        "minipaged.kernels.torch_backend:attend_prefills",
        "minipaged.kernels.torch_backend:_paged_attention_padded",
        "minipaged.kernels.torch_backend:_decode_split_kv",
        "minipaged.kernels.paged_attention:paged_attention_decode",
        "minipaged.kernels.paged_attention:paged_attention_prefill",
        "minipaged.kernels.cpu:paged_attention_decode_cpu",
        "minipaged.kernels.cpu:paged_attention_cpu",
        # grouped-query softmax attention over gathered K/V: with a gather (ex3.1), ex3.2
        "minipaged.kernels.torch_backend:_sdpa_grouped",
        # the compiled C kernels (ctypes): the library's accessor and its build (a fresh
        # sandbox has no compiled library in its cache; ``_library`` itself is lru-cached)
        "minipaged.kernels.cpu:_lib",
        "minipaged.kernels.cpu:_compile",
    ),
    "ex3.3": (
        "minipaged.kernels.paged_attention:_paged_attention_decode_kernel",
        "minipaged.kernels.paged_attention:_attend_kv_range",
        "minipaged.kernels.paged_attention:_paged_attention_prefill_kernel",
        "minipaged.kernels.paged_attention:paged_attention_decode",
        "minipaged.kernels.reference:paged_attention_ref",
    ),
    "ex3.4": (
        "minipaged.kernels.paged_attention:_paged_attention_reduce_kernel",
        "minipaged.kernels.torch_backend:_decode_split_kv",
        "minipaged.kernels.reference:paged_attention_ref",
    ),
    "ex3.6": (),
}
set_answered_by(SPECS, ANSWERED_BY)
