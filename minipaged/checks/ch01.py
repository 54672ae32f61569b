"""Checkers for chapter 01 exercises: the KV cache and what it costs.

Exercises (notebooks/exercises/ch01_kv_cache.ipynb)
    ex1.1 ``kv_bytes_per_token(config, dtype_bytes)``: K and V bytes one token costs, from a
          Hugging Face config dict (GQA and an explicit ``head_dim`` included).
    ex1.2 ``reserved_slots(prompt_len, output_len, max_seq_len, policy)``: token slots a
          contiguous allocator reserves for one request (the paper's Orca baselines),
          checked against ``ContiguousAllocator.reservation_size``.
    ex1.3 ``paged_token_fraction(seq_lens, block_size)``: fraction of reserved slots that
          hold a token when memory is paged, checked against ``KVCacheManager.usage()``.
    ex1.4 ``predict_regions()`` -> the start slot (or None) of each allocation of
          ``CONTIG_EVENTS`` under first-fit pow2 reservation (a prediction), compared with
          ``ContiguousAllocator``; the first difference shows the pool before and after.
    ex1.5 ``max_batch(model, gpu, seq_len, gpu_memory_utilization, activation_reserve_bytes)``:
          how many ``seq_len``-token sequences the KV budget of a GPU holds when paged,
          checked against ``CostModel.num_kv_tokens``; the check then prints the measured
          figure for every model and GPU of the cost model at 1024 tokens.
    ex1.6 ``concept_answers()``: the end-of-chapter questions with a number or a choice.

Reference: ex1.1 is the formula in the spec, held here; ex1.2 and ex1.3 are graded
against the package (``minipaged.core.kv.contiguous`` and ``KVCacheManager``). Pure Python.
"""

from __future__ import annotations

import random

from minipaged.checks._harness import (
    ExerciseFailure,
    Mismatch,
    exercise,
    expect_close,
    expect_equal,
    expect_equal_to_reference,
    require_callable,
    run_cases,
)
from minipaged.checks._spec import concept_spec, register
from minipaged.core import KVCacheManager
from minipaged.core.kv.contiguous import ContiguousAllocator

CHECKS: dict = {}

# Real configurations (the fields that matter), as in their config.json files.
REAL_CONFIGS = {
    "Llama-2-7B": dict(num_hidden_layers=32, num_attention_heads=32, hidden_size=4096),
    "Llama-2-13B": dict(num_hidden_layers=40, num_attention_heads=40, hidden_size=5120),
    "Llama-3-8B": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096),
    "Qwen2.5-0.5B": dict(
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896
    ),
    "SmolLM2-135M": dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576),
    "Gemma-7B": dict(
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
        hidden_size=3072,
        head_dim=256,
    ),
    "TinyLlama-1.1B": dict(
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        hidden_size=2048,
        head_dim=None,
    ),
}


def ref_kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    num_layers = config["num_hidden_layers"]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@exercise(CHECKS, "ex1.1", "KV cache bytes per token of a Hugging Face config")
def check_kv_bytes_per_token(kv_bytes_per_token) -> None:
    require_callable("ex1.1", kv_bytes_per_token, "kv_bytes_per_token")
    rng = random.Random("ex1.1")
    cases = []
    for name, cfg in REAL_CONFIGS.items():
        for dtype_bytes in (2, 4, 1):
            cases.append((name, dict(cfg), dtype_bytes))
    for i in range(60):
        kv = rng.choice([1, 2, 4, 8])
        heads = kv * rng.choice([1, 1, 2, 4])
        head_dim = rng.choice([16, 32, 64, 80, 128])
        cfg = dict(
            num_hidden_layers=rng.randint(1, 48),
            num_attention_heads=heads,
            hidden_size=heads * head_dim,
        )
        style = rng.random()
        if style < 0.3:
            cfg["num_key_value_heads"] = kv
        elif style < 0.45:
            cfg["num_key_value_heads"] = None  # some configs write null: means "no GQA"
        elif style < 0.7:
            cfg["num_key_value_heads"] = kv
            cfg["head_dim"] = rng.choice([64, 128, 256])  # not hidden_size // heads
        cases.append((f"random #{i}", cfg, rng.choice([1, 2, 4])))

    def run_one(case):
        _, cfg, dtype_bytes = case
        expected = ref_kv_bytes_per_token(cfg, dtype_bytes)
        got = kv_bytes_per_token(dict(cfg), dtype_bytes)
        expect_equal("bytes per token", expected, got)

    def describe(case):
        name, cfg, dtype_bytes = case
        return f"{name}: kv_bytes_per_token({cfg}, dtype_bytes={dtype_bytes})"

    def size(case):
        _, cfg, dtype_bytes = case
        return 0 if not case[0].startswith("random") else ref_kv_bytes_per_token(cfg, dtype_bytes)

    run_cases("ex1.1", cases, run_one, size=size, describe=describe)


def ref_reserved_slots(prompt_len: int, output_len: int, max_seq_len: int, policy: str) -> int:
    """Via the package: ``ContiguousAllocator.reservation_size`` (the paper's Orca baselines)."""
    if prompt_len < 1 or output_len < 1 or prompt_len + output_len > max_seq_len:
        raise ValueError("need 1 <= prompt_len, 1 <= output_len, prompt_len + output_len <= max_seq_len")
    allocator = ContiguousAllocator(num_slots=max_seq_len, max_model_len=max_seq_len, policy=policy)
    return allocator.reservation_size(prompt_len + output_len)


@exercise(CHECKS, "ex1.2", "slots reserved by a contiguous allocator (Orca max / pow2 / oracle)")
def check_reserved_slots(reserved_slots) -> None:
    require_callable("ex1.2", reserved_slots, "reserved_slots")
    rng = random.Random("ex1.2")
    cases = []
    for policy in ("max", "pow2", "oracle"):
        cases.append((10, 25, 2048, policy))  # 35 tokens: 2048 / 64 / 35 slots
    for _ in range(150):
        max_seq_len = rng.choice([16, 64, 100, 512, 2048])
        prompt = rng.randint(1, max_seq_len - 1)
        output = rng.randint(1, max_seq_len - prompt)
        cases.append((prompt, output, max_seq_len, rng.choice(["max", "pow2", "oracle"])))
    for _ in range(30):  # caller errors
        kind = rng.randint(0, 3)
        if kind == 0:
            cases.append((rng.randint(1, 8), rng.randint(1, 8), 64, rng.choice(["min", "Pow2", ""])))
        elif kind == 1:
            cases.append((rng.randint(10, 40), rng.randint(30, 60), 64, "oracle"))
        elif kind == 2:
            cases.append((0, rng.randint(1, 8), 64, rng.choice(["max", "pow2"])))
        else:
            cases.append((rng.randint(1, 8), 0, 64, "pow2"))

    def run_one(case):
        expect_equal_to_reference(
            "reserved slots", lambda: ref_reserved_slots(*case), lambda: reserved_slots(*case)
        )

    def describe(case):
        p, o, m, pol = case
        return f"reserved_slots(prompt_len={p}, output_len={o}, max_seq_len={m}, policy={pol!r})"

    run_cases("ex1.2", cases, run_one, size=lambda c: (c[2], c[0] + c[1]), describe=describe)


def ref_paged_token_fraction(seq_lens: list[int], block_size: int) -> float:
    """Via the package: allocate every sequence in a KVCacheManager and ask its usage()."""
    num_blocks = max(1, sum(-(-n // block_size) for n in seq_lens))
    manager = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    for i, n in enumerate(seq_lens):
        if manager.allocate_slots(f"r{i}", n) is None:
            raise RuntimeError("checker bug: the pool was sized to fit every sequence")
    return manager.usage().token_fraction


@exercise(CHECKS, "ex1.3", "fraction of reserved KV memory holding tokens, paged")
def check_paged_token_fraction(paged_token_fraction) -> None:
    require_callable("ex1.3", paged_token_fraction, "paged_token_fraction")
    rng = random.Random("ex1.3")
    cases = [([], 16), ([16], 16), ([17], 16), ([1], 1), ([5, 3], 4)]
    for _ in range(150):
        block_size = rng.choice([1, 2, 4, 8, 16, 32])
        cases.append(([rng.randint(1, 200) for _ in range(rng.randint(1, 8))], block_size))

    def run_one(case):
        seq_lens, block_size = case
        expected = ref_paged_token_fraction(seq_lens, block_size)
        expect_close(
            "token fraction", expected, paged_token_fraction(list(seq_lens), block_size), abs_tol=1e-12
        )

    def describe(case):
        return f"paged_token_fraction(seq_lens={case[0]}, block_size={case[1]})"

    run_cases("ex1.3", cases, run_one, size=lambda c: (len(c[0]), sum(c[0])), describe=describe)


# -- ex1.4: predict where contiguous regions go -----------------------------------------------

CONTIG_KNOBS = {"num_slots": 32, "max_model_len": 16, "policy": "pow2"}
# (request id, final length) = allocate it (1 token now); (request id, None) = free it
CONTIG_EVENTS = [("A", 5), ("B", 9), ("C", 3), ("A", None), ("D", 7), ("E", 4), ("F", 6)]


def _slots_picture(alloc) -> str:
    cells = ["."] * alloc.num_slots
    for rid in sorted(alloc.regions):
        r = alloc.get_region(rid)
        cells[r.start : r.start + r.size] = [rid[0]] * r.size
    return "slots 0..{}: {}  (letter = reserved by that request, . = free)".format(
        alloc.num_slots - 1, "".join(cells)
    )


def reference_starts():
    """The start slot (or None) of each allocation of CONTIG_EVENTS, and the pictures."""
    alloc = ContiguousAllocator(**CONTIG_KNOBS)
    starts, pictures = [], []
    for rid, final_len in CONTIG_EVENTS:
        if final_len is None:
            alloc.free(rid)
        else:
            region = alloc.allocate(rid, 1, final_len)
            starts.append(None if region is None else region.start)
        pictures.append(_slots_picture(alloc))
    return starts, pictures


@exercise(CHECKS, "ex1.4", "predict where a contiguous allocator puts each request")
def check_predict_regions(predict_regions) -> None:
    require_callable("ex1.4", predict_regions, "predict_regions")

    starts, pictures = reference_starts()
    allocs = [i for i, (_, f) in enumerate(CONTIG_EVENTS) if f is not None]

    def run_one(k):
        got = predict_regions()
        if not isinstance(got, list) or len(got) != len(starts):
            raise Mismatch(
                f"predict_regions() must return a list of {len(starts)} start slots (or None), "
                f"one per allocation, got {got!r}"
            )
        if got[k] != starts[k]:
            i = allocs[k]
            before = "all slots free" if i == 0 else pictures[i - 1]
            raise Mismatch(
                f"allocation {k} ({CONTIG_EVENTS[i][0]}, final length {CONTIG_EVENTS[i][1]}):\n"
                f"    expected {starts[k]!r}\n    got      {got[k]!r}\n"
                f"  the pool before it: {before}\n  the pool after it:  {pictures[i]}"
            )

    run_cases("ex1.4", range(len(starts)), run_one, describe=lambda k: f"allocations 0..{k}")


# -- ex1.5: how many sequences fit a GPU, measured -------------------------------------------


def ref_max_batch(model, gpu, seq_len, gpu_memory_utilization=0.9, activation_reserve_bytes=2**30) -> int:
    from minipaged.sim.cost_model import CostModel

    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    cm = CostModel(
        model,
        gpu,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve_bytes=activation_reserve_bytes,
    )
    return cm.num_kv_tokens() // seq_len  # ValueError if the weights do not fit


@exercise(CHECKS, "ex1.5", "how many sequences fit a GPU's KV budget (measure)")
def check_max_batch(max_batch) -> None:
    require_callable("ex1.5", max_batch, "max_batch(model, gpu, seq_len, ...)")
    from minipaged.checks._harness import _print, _redirect_stdout, _StringIO
    from minipaged.sim.cost_model import GPUS, LLAMA_7B, OPT_13B
    from minipaged.sim.cost_model import MODELS as ALL_MODELS

    # NOTE: the models that fit one GPU (the paper's 66B and 175B need 4 and 8: chapter 11)
    MODELS = {m: ALL_MODELS[m] for m in sorted(ALL_MODELS) if ALL_MODELS[m] in (OPT_13B, LLAMA_7B)}
    rng = random.Random("ex1.5")
    cases = [("OPT-13B", "A100-40GB", 1024, 0.9, 2**30)]
    for _ in range(60):
        cases.append(
            (
                rng.choice(sorted(MODELS)),
                rng.choice(sorted(GPUS)),
                rng.choice([1, 100, 512, 1024, 2048, 4096]),
                rng.choice([0.5, 0.8, 0.9, 1.0]),
                rng.choice([0, 2**30, 4 * 2**30]),
            )
        )
    cases += [("OPT-13B", "A100-40GB", 0, 0.9, 2**30), ("OPT-13B", "A100-40GB", 1024, 0.5, 2**30)]

    def run_one(c):
        m, g, n, u, a = c
        args = (MODELS[m], GPUS[g], n, u, a)
        expect_equal_to_reference(
            "sequences that fit",
            lambda: ref_max_batch(*args),
            lambda: max_batch(*args),
            caller_error="a caller error (or weights that do not fit)",
        )

    verdict = _StringIO()
    with _redirect_stdout(verdict):
        run_cases(
            "ex1.5",
            cases,
            run_one,
            size=lambda c: (c[2] < 1, c[2]),
            describe=lambda c: (
                f"max_batch(MODELS[{c[0]!r}], GPUS[{c[1]!r}], seq_len={c[2]}, "
                f"gpu_memory_utilization={c[3]}, activation_reserve_bytes={c[4]})"
            ),
        )
    for m in sorted(MODELS):
        row = ", ".join(f"{g} {max_batch(MODELS[m], GPUS[g], 1024, 0.9, 2**30)}" for g in sorted(GPUS))
        _print(f"{m}, 1024-token sequences that fit: {row}")
    _print(verdict.getvalue(), end="")


# -- ex1.6: concept questions ----------------------------------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
QUESTIONS = {
    "q1": ("slots of the pow2 run of ex1.4 reserved but never used, after E is placed", None),
    "q2": ("blocks of 4 slots a 9-token request holds when paged", None),
    "q3": (
        "F of ex1.4 does not fit although 0 slots are free: is that 'internal' or 'external' fragmentation, or 'neither'",
        ("internal", "external", "neither"),
    ),
    "q4": (
        "which waste does paging leave, bounded by block_size - 1 slots per request: 'internal' or 'external'",
        ("internal", "external"),
    ),
}
SPECS: dict = {}
register(SPECS, concept_spec("ex1.6", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "CHECKS",
    "QUESTIONS",
    "SPECS",
    "CONTIG_EVENTS",
    "CONTIG_KNOBS",
    "ExerciseFailure",
    "ref_kv_bytes_per_token",
    "ref_reserved_slots",
    "reference_starts",
]
