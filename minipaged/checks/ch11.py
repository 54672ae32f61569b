"""Checkers for chapter 11 exercises: tensor parallelism, one block table for N workers.

Exercises (notebooks/exercises/ch11_distributed.ipynb)
    ex11.1 ``mlp_shard(x, w_gate, w_up, w_down, rank, size)``: one rank's partial output of
           a Llama MLP split Megatron-style (gate and up column-parallel, down row-parallel);
           the all-reduce (a sum over ranks) of the partials is the unsharded MLP.
    ex11.2 ``qkv_shard_rows(num_heads, num_kv_heads, head_dim, rank, size)``: which rows of
           the fused q/k/v weight a rank holds (its query heads and its KV heads).
    ex11.3 ``predict_tp()`` -> per tensor-parallel size of ``TP_SIZES``: KV heads and KV
           bytes per block per worker, collectives per forward, or ``None`` where
           the size is refused (a prediction, worked on paper; one model per student).
    ex11.4 ``allreduce_bytes(num_tokens, hidden_size, num_layers, size, dtype_bytes)``: the
           bytes each rank sends in one forward's all-reduces over a ring (measure: the check
           prints it for the paper's multi-GPU settings).
    ex11.5 ``concept_answers()``: questions with a number or a choice (the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``): plain-data cases; ``observe`` calls the
student's function (for ex11.1 once per rank, on tensors built from the case's seed) and
returns what it returned; the trusted side computes the same with the unsharded layer's
slices and compares within a float tolerance (the order of a sum differs between codes).

Failure mode: the student's code raising becomes data (the message shows it); a return that
is not of the stated shape is wrong.
"""

from __future__ import annotations

from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by

SPECS: dict = {}


# -- ex11.1: one rank's share of the MLP -------------------------------------------------------


def _mlp_cases(rng):
    cases = [{"tokens": 1, "hidden": 2, "intermediate": 2, "size": 1, "seed": 1}]
    for _ in range(40):
        size = rng.choice([1, 2, 2, 4])
        cases.append(
            {
                "tokens": rng.randint(1, 4),
                "hidden": rng.choice([2, 4, 8]),
                "intermediate": size * rng.randint(1, 4),
                "size": size,
                "seed": rng.randrange(2**31),
            }
        )
    return cases + [
        {"tokens": 2, "hidden": 4, "intermediate": 6, "size": 4, "seed": 3}
    ]  # 4 does not divide 6


def _mlp_tensors(case):
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    t, h, i = case["tokens"], case["hidden"], case["intermediate"]
    x = torch.randn(t, h, generator=g)  # [T, hidden]
    w_gate = torch.randn(i, h, generator=g) / h**0.5  # [I, hidden]
    w_up = torch.randn(i, h, generator=g) / h**0.5  # [I, hidden]
    w_down = torch.randn(h, i, generator=g) / i**0.5  # [hidden, I]
    return x, w_gate, w_up, w_down


def observe_mlp_shard(case, fn) -> dict:
    """Every rank's partial output, called on copies of the full weights."""
    x, w_gate, w_up, w_down = _mlp_tensors(case)
    return {
        f"rank {r}": attempt(
            lambda r=r: fn(x.clone(), w_gate.clone(), w_up.clone(), w_down.clone(), r, case["size"])
        )
        for r in range(case["size"])
    }


def ref_mlp_shard(x, w_gate, w_up, w_down, rank: int, size: int):
    """Rows ``rank * I/size ..`` of gate and up, the same columns of down: a partial sum."""
    import torch.nn.functional as F

    inter = w_gate.shape[0]
    if inter % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the intermediate size {inter}")
    lo, hi = rank * inter // size, (rank + 1) * inter // size
    h = F.silu(x @ w_gate[lo:hi].T) * (x @ w_up[lo:hi].T)  # [T, I/size]
    return h @ w_down[:, lo:hi].T  # [T, hidden]


register(
    SPECS,
    Spec(
        "ex11.1",
        "one rank's share of a tensor-parallel MLP",
        "mlp_shard(x, w_gate, w_up, w_down, rank, size)",
        cases=_mlp_cases,
        observe=observe_mlp_shard,
        reference=lambda: (ref_mlp_shard,),
        describe=lambda c: (
            f"x [{c['tokens']}, {c['hidden']}], w_gate and w_up [{c['intermediate']}, {c['hidden']}], "
            f"w_down [{c['hidden']}, {c['intermediate']}] (random, seed {c['seed']}); "
            f"mlp_shard(..., rank, size={c['size']}) for every rank"
        ),
        size=lambda c: (c["size"], c["intermediate"], c["tokens"]),
        rel_tol=1e-4,
        abs_tol=1e-5,
    ),
)


# -- ex11.2: the rows of q, k and v a rank holds ---------------------------------------------


def ref_qkv_shard_rows(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, size: int) -> dict:
    """``{"q": [start, end], "k": ..., "v": ...}``: rows of the fused [(H + 2 KVH) D, hidden] weight."""
    if num_heads % size or num_kv_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide num_heads {num_heads} and num_kv_heads {num_kv_heads}"
        )
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    hq, hkv = q // size, kv // size
    return {
        "q": [rank * hq, (rank + 1) * hq],
        "k": [q + rank * hkv, q + (rank + 1) * hkv],
        "v": [q + kv + rank * hkv, q + kv + (rank + 1) * hkv],
    }


def _qkv_cases(rng):
    cases = [(1, 1, 2, 0, 1), (2, 2, 1, 1, 2), (4, 2, 2, 1, 2)]
    for _ in range(150):
        size = rng.choice([1, 2, 4, 8])
        kv = size * rng.randint(1, 3) if rng.random() < 0.9 else rng.randint(1, 7)
        heads = kv * rng.choice([1, 2, 4])
        cases.append((heads, kv, rng.choice([1, 2, 4, 8]), rng.randrange(size), size))
    return cases + [(8, 2, 4, 0, 4), (6, 6, 2, 1, 4)]


register(
    SPECS,
    Spec(
        "ex11.2",
        "the rows of q, k and v a rank holds",
        "qkv_shard_rows(num_heads, num_kv_heads, head_dim, rank, size)",
        cases=_qkv_cases,
        observe=lambda c, fn: attempt(lambda: fn(*c)),
        reference=lambda: (ref_qkv_shard_rows,),
        describe=lambda c: (
            f"qkv_shard_rows(num_heads={c[0]}, num_kv_heads={c[1]}, head_dim={c[2]}, rank={c[3]}, size={c[4]})"
        ),
        size=lambda c: (c[4], c[0] + c[1]),
    ),
)


# -- ex11.3: predict what each worker holds (one model per student) -----------------------------

# a Llama-family model (fp16 KV); the tensor-parallel sizes to predict
TP_MODEL = {
    "num_layers": 32,
    "hidden_size": 4096,
    "num_heads": 32,
    "num_kv_heads": 8,
    "intermediate_size": 11008,
    "block_size": 16,
    "dtype_bytes": 2,
}
TP_SIZES = (1, 2, 4, 8, 16)


def reference_tp(model=None, sizes=TP_SIZES) -> list:
    """Per size: ``None`` when it does not divide the heads, the KV heads and the intermediate
    size; else the worker's KV heads, KV bytes per block (all layers, K and V) and the collectives of one forward (two all-reduces per layer and the embedding's;
    one all-gather of the logits)."""
    m = dict(TP_MODEL if model is None else model)
    L, h, heads, kvh = m["num_layers"], m["hidden_size"], m["num_heads"], m["num_kv_heads"]
    inter, bs, nb = m["intermediate_size"], m["block_size"], m["dtype_bytes"]
    d = h // heads
    out = []
    for n in sizes:
        if heads % n or kvh % n or inter % n:
            out.append(None)
            continue
        out.append(
            {
                "kv_heads": kvh // n,
                "kv_bytes_per_block": 2 * L * bs * (kvh // n) * d * nb,
                "all_reduces": 0 if n == 1 else 2 * L + 1,
                "all_gathers": 0 if n == 1 else 1,
            }
        )
    return out


def tp_model_row(item) -> str:
    key, value = item
    return f"| `{key}` | {value} |"


def tp_model_variant(rng) -> list:
    heads = rng.choice([16, 32, 40, 64])
    kvh = rng.choice([k for k in (1, 2, 4, 8, heads) if heads % k == 0])
    d = rng.choice([64, 128])
    model = {
        "num_layers": rng.choice([24, 32, 40, 48]),
        "hidden_size": heads * d,
        "num_heads": heads,
        "num_kv_heads": kvh,
        "intermediate_size": rng.choice([11008, 13824, 14336, 8192]),
        "block_size": 16,
        "dtype_bytes": 2,
    }
    return list(model.items())


def _tp_cases(rng):
    # NOTE: rng is None for the shipped notebook (the model of its setup cell); a student copy
    # made with --seed gets the model its seed draws, written into its setup cell
    return [list(TP_MODEL.items()) if rng is None else tp_model_variant(rng)]


register(
    SPECS,
    Spec(
        "ex11.3",
        "predict what each worker holds and sends",
        "predict_tp()",
        cases=_tp_cases,
        observe=lambda case, fn: fn(),
        expected=lambda case, key: reference_tp(dict(tuple(kv) for kv in case)),
        describe=lambda c: (
            f"predict_tp() for TP_MODEL = {dict(tuple(kv) for kv in c)} at the sizes TP_SIZES = {TP_SIZES}; "
            "[i] is TP_SIZES[i]"
        ),
        kind="prediction",
    ),
)
VARIANTS = {"ex11.3": ("TP_MODEL_ITEMS", tp_model_row, "| field | value |\n|---|---|")}


# -- ex11.4: the bytes an all-reduce moves (measure) ---------------------------------------------


def ref_allreduce_bytes(
    num_tokens: int, hidden_size: int, num_layers: int, size: int, dtype_bytes: int
) -> int:
    """Bytes each rank sends in one forward's ``2 * num_layers + 1`` all-reduces of a
    ``[num_tokens, hidden_size]`` tensor over a ring: ``2 (size - 1) / size`` of the tensor each."""
    for name, v in (("num_tokens", num_tokens), ("hidden_size", hidden_size), ("num_layers", num_layers),
                    ("size", size), ("dtype_bytes", dtype_bytes)):  # fmt: skip
        if type(v) is not int or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    tensor = num_tokens * hidden_size * dtype_bytes
    return (2 * num_layers + 1) * 2 * (size - 1) * tensor // size


def _ar_cases(rng):
    cases = [(1, 1, 1, 1, 1), (1, 2, 1, 2, 1), (3, 4, 2, 4, 2)]
    for _ in range(120):
        size = rng.choice([1, 2, 4, 8])
        cases.append(
            (
                rng.randint(1, 512),
                rng.choice([8, 64, 4096, 12288]),
                rng.randint(1, 96),
                size,
                rng.choice([1, 2, 4]),
            )
        )
    return cases + [(0, 8, 1, 2, 2), (4, 8, 1, 0, 2), (4, 8, -1, 2, 2)]


# the paper's multi-GPU settings (OPT-66B on 4 GPUs, OPT-175B on 8), fp16, a decode step of 64
AR_SETTINGS = (("OPT-66B, 4 GPUs", 9216, 64, 4), ("OPT-175B, 8 GPUs", 12288, 96, 8))
AR_TOKENS = (64, 2048)


def _ar_report(allreduce_bytes) -> str:
    lines = []
    for name, hidden, layers, size in AR_SETTINGS:
        got = ", ".join(
            f"{t} tokens: {allreduce_bytes(t, hidden, layers, size, 2) / 2**20:.1f} MiB" for t in AR_TOKENS
        )
        lines.append(f"{name}: {got} per rank per forward\n")
    return "".join(lines)


register(
    SPECS,
    Spec(
        "ex11.4",
        "the bytes a forward's all-reduces move (measure)",
        "allreduce_bytes(num_tokens, hidden_size, num_layers, size, dtype_bytes)",
        cases=_ar_cases,
        observe=lambda c, fn: attempt(lambda: fn(*c)),
        reference=lambda: (ref_allreduce_bytes,),
        describe=lambda c: (
            f"allreduce_bytes(num_tokens={c[0]}, hidden_size={c[1]}, num_layers={c[2]}, size={c[3]}, dtype_bytes={c[4]})"
        ),
        size=lambda c: (c[3], c[2], c[0]),
        report=_ar_report,
    ),
)


# -- ex11.5: concept questions ----------------------------------------------------------------

QUESTIONS = {
    "q1": [
        (
            "with `tensor_parallel_size = 2`, how many block tables does the engine keep for one request?",
            None,
        ),
        (
            "with `tensor_parallel_size = 4`, how many block tables does the engine keep for one request?",
            None,
        ),
    ],
    "q2": (
        'which layer of a decoder needs no communication: `"o_proj"`, `"qkv_proj"` or `"down_proj"`?',
        ("o_proj", "qkv_proj", "down_proj"),
    ),
    "q3": [
        (
            "the course model has 2 KV heads: the largest `tensor_parallel_size` this engine accepts for it",
            None,
        ),
        (
            "a model with 8 KV heads and 32 query heads: the largest power-of-two `tensor_parallel_size` this engine accepts",
            None,
        ),
    ],
    "q4": (
        'does a worker\'s KV cache have fewer blocks, or the same number of blocks with fewer heads each: `"fewer blocks"` or `"fewer heads"`?',
        ("fewer blocks", "fewer heads"),
    ),
}
register(SPECS, concept_spec("ex11.5", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "AR_SETTINGS",
    "AR_TOKENS",
    "QUESTIONS",
    "SPECS",
    "TP_MODEL",
    "TP_SIZES",
    "VARIANTS",
    "reference_tp",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex11.1": (
        "minipaged.model.parallel:shard_range",
        "minipaged.model.parallel:take_shard",
        "minipaged.model.parallel:RowParallelLinear.forward",
    ),
    "ex11.2": ("minipaged.model.parallel:QKVParallelLinear.local_rows",),
}
set_answered_by(SPECS, ANSWERED_BY)
