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
    ex3.5 ``predict_reads()`` -> per sequence of ``READ_BLOCK_TABLES``, per split-KV
          partition, the ``(physical block, tokens read)`` in order (a prediction), compared
          with the indexing of ``split_kv_partials``; a mismatch shows the walk as text.
    ex3.6 ``attention_intensity(num_heads, num_kv_heads, head_dim, seq_len, dtype_bytes)``:
          FLOPs per byte of K/V read by one decode token's attention (the formula of the
          course cost model, hand-checked in the spec); the check then prints the figure
          for MHA, GQA and MQA shapes (a measurement of why decode attention is memory-bound).
    ex3.7 ``concept_answers()``: the end-of-chapter questions with a number or a choice.

Reference: ``minipaged.kernels.reference.paged_attention_ref`` (the package's readable
torch loop) for ex3.2-ex3.4; plain indexing for ex3.1. Float32 throughout; tolerance
``atol=1e-5, rtol=1e-4`` for attention outputs, exact equality for gathers.
Shapes: q [num_seqs, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads,
head_dim]; block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32.
"""

from __future__ import annotations

import math
import os
import random

import torch

from minipaged.checks._harness import (
    ExerciseFailure,
    Mismatch,
    exercise,
    expect_close_to_reference,
    expect_true,
    require_callable,
    run_cases,
)
from minipaged.checks._spec import concept_spec, register
from minipaged.kernels.reference import paged_attention_ref

CHECKS: dict = {}
ATOL, RTOL = 1e-5, 1e-4


def _make_case(
    seed: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seq_lens: list[int],
    device: str = "cpu",
) -> dict:
    """Random q and caches; each sequence gets random, non-contiguous physical blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody uses
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    k = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = torch.tensor(perm[k : k + nb], dtype=torch.int32)
        k += nb
    case = dict(
        q=torch.randn(num_seqs, num_heads, head_dim, generator=g),  # [B, H, D]
        k_cache=torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g),
        v_cache=torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g),
        block_tables=tables,  # [B, max_blocks]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [B]
        scale=1.0 / math.sqrt(head_dim),
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def _random_cases(
    exercise_id: str,
    n: int,
    block_sizes=(1, 2, 4, 8),
    head_dims=(4, 8, 16),
    max_len: int = 40,
    max_seqs: int = 4,
) -> list[dict]:
    rng = random.Random(exercise_id)
    cases = []
    for _i in range(n):
        num_kv_heads = rng.choice([1, 2])
        num_heads = num_kv_heads * rng.choice([1, 2, 4])
        num_seqs = rng.randint(1, max_seqs)
        seq_lens = [rng.randint(1, max_len) for _ in range(num_seqs)]
        cases.append(
            dict(
                seed=rng.randrange(2**31),
                num_seqs=num_seqs,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=rng.choice(head_dims),
                block_size=rng.choice(block_sizes),
                seq_lens=seq_lens,
            )
        )
    return cases


def _size(c: dict):
    return (c["num_seqs"] * c["num_heads"] * max(c["seq_lens"]), c["head_dim"])


def _describe(c: dict) -> str:
    return (
        f"num_seqs={c['num_seqs']}, num_heads={c['num_heads']}, num_kv_heads={c['num_kv_heads']}, "
        f"head_dim={c['head_dim']}, block_size={c['block_size']}, seq_lens={c['seq_lens']} "
        f"(tensors from torch seed {c['seed']}; see minipaged/checks/ch03.py)"
    )


def _expect_close(what: str, expected: torch.Tensor, got) -> None:
    expect_true(
        f"{what}: expected a torch.Tensor", isinstance(got, torch.Tensor), f"got {type(got).__name__}"
    )
    expect_true(
        f"{what}: wrong shape",
        tuple(got.shape) == tuple(expected.shape),
        f"expected {tuple(expected.shape)}, got {tuple(got.shape)}",
    )
    got = got.detach().to("cpu", torch.float32)
    expected = expected.detach().to("cpu", torch.float32)
    if not torch.allclose(got, expected, atol=ATOL, rtol=RTOL, equal_nan=False):
        diff = (got - expected).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
        idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        raise Mismatch(
            f"{what}: max abs difference {float(diff.max()):.3g} (allowed {ATOL} + {RTOL} * |expected|)\n"
            f"    first worst element at index {list(idx)}: expected {float(expected[idx]):.6f}, "
            f"got {float(got[idx]):.6f}"
        )


# -- ex3.1 -------------------------------------------------------------------------------


@exercise(CHECKS, "ex3.1", "gather one sequence's K and V through its block table")
def check_gather_kv(gather_kv) -> None:
    require_callable("ex3.1", gather_kv, "gather_kv(k_cache, v_cache, block_table, seq_len)")
    cases = _random_cases("ex3.1", 80, max_seqs=1)

    def run_one(c):
        t = _make_case(**c)
        block_table, seq_len = t["block_tables"][0], int(t["seq_lens"][0])
        bs = c["block_size"]
        ids = [int(block_table[i // bs]) for i in range(seq_len)]
        k_ref = torch.stack([t["k_cache"][ids[i], i % bs] for i in range(seq_len)])  # [L, KVH, D]
        v_ref = torch.stack([t["v_cache"][ids[i], i % bs] for i in range(seq_len)])  # [L, KVH, D]
        got = gather_kv(t["k_cache"], t["v_cache"], block_table.clone(), seq_len)
        expect_true(
            "gather_kv must return a pair (k, v)",
            isinstance(got, (tuple, list)) and len(got) == 2,
            f"got {type(got).__name__}",
        )
        for name, ref, x in (("k", k_ref, got[0]), ("v", v_ref, got[1])):
            expect_true(
                f"{name}: expected a torch.Tensor", isinstance(x, torch.Tensor), f"got {type(x).__name__}"
            )
            expect_true(
                f"{name}: wrong shape",
                tuple(x.shape) == tuple(ref.shape),
                f"expected {tuple(ref.shape)} = [seq_len, num_kv_heads, head_dim], got {tuple(x.shape)}",
            )
            if not torch.equal(x, ref):
                bad = next(i for i in range(seq_len) if not torch.equal(x[i], ref[i]))
                raise Mismatch(
                    f"{name}: token {bad} is wrong: it lives in physical block {ids[bad]} "
                    f"(logical block {bad // bs}), offset {bad % bs}"
                )

    run_cases("ex3.1", cases, run_one, size=_size, describe=_describe)


# -- ex3.2 -------------------------------------------------------------------------------


@exercise(CHECKS, "ex3.2", "decode attention through block tables, by hand in torch")
def check_paged_decode_attention(paged_decode_attention) -> None:
    require_callable(
        "ex3.2",
        paged_decode_attention,
        "paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)",
    )
    cases = _random_cases("ex3.2", 60)

    def run_one(c):
        t = _make_case(**c)
        expected = paged_attention_ref(
            t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"], scale=t["scale"]
        )
        got = paged_decode_attention(
            t["q"].clone(),
            t["k_cache"],
            t["v_cache"],
            t["block_tables"].clone(),
            t["seq_lens"].clone(),
            t["scale"],
        )
        _expect_close("attention output [num_seqs, num_heads, head_dim]", expected, got)

    run_cases("ex3.2", cases, run_one, size=_size, describe=_describe)


# -- ex3.3 -------------------------------------------------------------------------------


def _triton_device() -> str:
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ExerciseFailure(
            "ex3.3 needs Triton, which is not installed here (Linux x86-64 only); "
            "skip this exercise on this machine"
        ) from None
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    raise ExerciseFailure(
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


@exercise(CHECKS, "ex3.3", "the Triton decode kernel's loop over blocks (online softmax)")
def check_paged_decode_kernel(paged_decode_kernel) -> None:
    device = _triton_device()
    if not hasattr(paged_decode_kernel, "__getitem__"):
        raise ExerciseFailure(
            "ex3.3: paged_decode_kernel must be a Triton kernel (decorated with @triton.jit)"
        )
    # Few, small cases: the interpreter runs each program in numpy, one after another.
    cases = _random_cases("ex3.3", 8, block_sizes=(2, 4, 8), head_dims=(8, 16), max_len=24, max_seqs=3)

    def run_one(c):
        t = _make_case(**c, device=device)
        expected = paged_attention_ref(
            t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"], scale=t["scale"]
        )
        got = launch_decode_kernel(
            paged_decode_kernel,
            t["q"],
            t["k_cache"],
            t["v_cache"],
            t["block_tables"],
            t["seq_lens"],
            t["scale"],
        )
        _expect_close("kernel output [num_seqs, num_heads, head_dim]", expected, got)

    run_cases("ex3.3", cases, run_one, size=_size, describe=_describe)


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


@exercise(CHECKS, "ex3.4", "split-KV: combine partition results into the exact output")
def check_combine_partitions(combine_partitions) -> None:
    require_callable("ex3.4", combine_partitions, "combine_partitions(tmp_out, max_logits, exp_sums)")
    cases = _random_cases("ex3.4", 50, max_len=30)
    rng = random.Random("ex3.4/partition")
    for c in cases:
        c["partition_size"] = rng.choice([1, 2, 4, 8])

    def run_one(c):
        c = dict(c)
        partition_size = c.pop("partition_size")
        t = _make_case(**c)
        expected = paged_attention_ref(
            t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"], scale=t["scale"]
        )
        tmp_out, max_logits, exp_sums = split_kv_partials(t, partition_size)
        got = combine_partitions(tmp_out.clone(), max_logits.clone(), exp_sums.clone())
        _expect_close("combined output [num_seqs, num_heads, head_dim]", expected, got)

    def describe(c):
        return _describe(c) + f", partition_size={c['partition_size']}"

    run_cases("ex3.4", cases, run_one, size=lambda c: (_size(c), -c["partition_size"]), describe=describe)


# -- ex3.5: predict what each split-KV partition reads ----------------------------------------

READ_BLOCK_SIZE, READ_PARTITION_SIZE = 4, 8
READ_BLOCK_TABLES = {"A": [7, 2, 5, 0], "B": [3, 6], "C": [1, 4, 8]}
READ_SEQ_LENS = {"A": 13, "B": 5, "C": 9}


def reference_reads() -> dict:
    """Sequence -> per split-KV partition, the (physical block, tokens read from it) in order,
    the way ``split_kv_partials`` (and the kernel) index the cache."""
    out = {}
    for rid, table in READ_BLOCK_TABLES.items():
        n = READ_SEQ_LENS[rid]
        parts = []
        for p in range(-(-n // READ_PARTITION_SIZE)):
            pos = torch.arange(p * READ_PARTITION_SIZE, min(n, (p + 1) * READ_PARTITION_SIZE))
            ids = torch.tensor(table)[pos // READ_BLOCK_SIZE].tolist()
            reads: list = []
            for b in ids:
                if reads and reads[-1][0] == b:
                    reads[-1] = (b, reads[-1][1] + 1)
                else:
                    reads.append((b, 1))
            parts.append(reads)
        out[rid] = parts
    return out


def _reads_picture(rid: str) -> str:
    table, n = READ_BLOCK_TABLES[rid], READ_SEQ_LENS[rid]
    cells = []
    for i in range(n):
        if i and i % READ_PARTITION_SIZE == 0:
            cells.append("|")
        cells.append(f"{i}@b{table[i // READ_BLOCK_SIZE]}")
    return f"{rid}: token@block, '|' = partition boundary: " + " ".join(cells)


@exercise(CHECKS, "ex3.5", "predict what each split-KV partition reads")
def check_predict_reads(predict_reads) -> None:
    require_callable("ex3.5", predict_reads, "predict_reads")
    from minipaged.checks._harness import Mismatch

    expected = reference_reads()

    def run_one(rid):
        got = predict_reads()
        if not isinstance(got, dict):
            raise Mismatch(f"predict_reads() must return a dict sequence -> partitions, got {got!r}")
        mine = got.get(rid)
        try:
            norm = [[(int(b), int(k)) for b, k in part] for part in mine]
        except (TypeError, ValueError):
            norm = mine
        if norm != expected[rid]:
            raise Mismatch(
                f"sequence {rid}:\n    expected {expected[rid]!r}\n    got      {mine!r}\n"
                f"  the cache as the kernel walks it:\n    {_reads_picture(rid)}"
            )

    run_cases("ex3.5", list(READ_BLOCK_TABLES), run_one, describe=lambda rid: f"sequence {rid}")


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


@exercise(CHECKS, "ex3.6", "the arithmetic intensity of decode attention (measure)")
def check_attention_intensity(attention_intensity) -> None:
    require_callable("ex3.6", attention_intensity, "attention_intensity")

    from minipaged.checks._harness import _print, _redirect_stdout, _StringIO

    rng = random.Random("ex3.6")
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
    cases += [(32, 8, 128, 0, 2), (32, 6, 128, 10, 2), (32, 8, 128, 10, 0)]

    def run_one(c):
        expect_close_to_reference(
            "FLOPs per byte", lambda: ref_attention_intensity(*c), lambda: attention_intensity(*c)
        )

    verdict = _StringIO()
    with _redirect_stdout(verdict):
        run_cases(
            "ex3.6",
            cases,
            run_one,
            size=lambda c: (min(c) < 1, c[3]),
            describe=lambda c: (
                "attention_intensity(num_heads={}, num_kv_heads={}, head_dim={}, seq_len={}, "
                "dtype_bytes={})".format(*c)
            ),
        )
    row = ", ".join(
        f"{name}: {attention_intensity(h, kv, 128, 4096, 2):g}" for name, (h, kv) in INTENSITY_SHAPES.items()
    )
    _print(f"FLOPs per byte, head_dim 128, 4096 tokens, fp16: {row} (an H100's ridge is about 295)")
    _print(verdict.getvalue(), end="")


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
SPECS: dict = {}
register(SPECS, concept_spec("ex3.7", "concept questions (numbers and choices)", QUESTIONS))


__all__ = ["CHECKS", "launch_decode_kernel", "split_kv_partials"]
