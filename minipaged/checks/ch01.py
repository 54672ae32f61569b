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
          ``CONTIG_EVENTS`` under first-fit pow2 reservation (a prediction; one workload per
          student), compared with ``ContiguousAllocator`` on the trusted side.
    ex1.5 ``max_batch(model, gpu, seq_len, gpu_memory_utilization, activation_reserve_bytes)``:
          how many ``seq_len``-token sequences the KV budget of a GPU holds when paged,
          checked against ``CostModel.num_kv_tokens``; the local check then prints the
          measured figure for every model and GPU of the cost model at 1024 tokens.
    ex1.6 ``concept_answers()``: the end-of-chapter questions with a number or a choice
          (graded once, by the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``): plain-data cases (a config dict,
lengths, a model and a GPU by their names in ``MODELS`` / ``GPUS``); ``observe`` calls the
student's function in the student's kernel and returns what it returned or raised; the
trusted side runs the same ``observe`` with the reference (ex1.1: the formula of the spec,
held here; ex1.2, ex1.3, ex1.5: the package) and compares. ex1.4's failure names the first
wrong allocation and what the student predicted, never the allocator's answer. Pure Python.
"""

from __future__ import annotations

import random

from minipaged.checks._harness import ExerciseFailure
from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.core import KVCacheManager
from minipaged.core.kv.contiguous import ContiguousAllocator
from minipaged.sim.cost_model import GPUS, LLAMA_7B, MODELS, OPT_13B, CostModel

SPECS: dict = {}

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


def _kv_bytes_cases(rng):
    cases = []
    for name, cfg in REAL_CONFIGS.items():
        for dtype_bytes in (2, 4, 1):
            cases.append((name, dict(cfg), dtype_bytes))
    for i in range(60):
        kv = rng.choice([1, 2, 4, 8])
        heads = kv * rng.choice([1, 1, 2, 4])
        head_dim = rng.choice([16, 32, 64, 80, 128])
        cfg = dict(
            num_hidden_layers=rng.randint(1, 48), num_attention_heads=heads, hidden_size=heads * head_dim
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
    return cases


def _kv_bytes_size(case):
    name, cfg, dtype_bytes = case
    return 0 if not name.startswith("random") else ref_kv_bytes_per_token(cfg, dtype_bytes)


register(
    SPECS,
    Spec(
        "ex1.1",
        "KV cache bytes per token of a Hugging Face config",
        "kv_bytes_per_token(config, dtype_bytes)",
        cases=_kv_bytes_cases,
        observe=lambda c, fn: attempt(lambda: fn(dict(c[1]), c[2])),
        reference=lambda: (ref_kv_bytes_per_token,),
        describe=lambda c: f"{c[0]}: kv_bytes_per_token({c[1]}, dtype_bytes={c[2]})",
        size=_kv_bytes_size,
    ),
)


def ref_reserved_slots(prompt_len: int, output_len: int, max_seq_len: int, policy: str) -> int:
    """Via the package: ``ContiguousAllocator.reservation_size`` (the paper's Orca baselines)."""
    if prompt_len < 1 or output_len < 1 or prompt_len + output_len > max_seq_len:
        raise ValueError("need 1 <= prompt_len, 1 <= output_len, prompt_len + output_len <= max_seq_len")
    allocator = ContiguousAllocator(num_slots=max_seq_len, max_model_len=max_seq_len, policy=policy)
    return allocator.reservation_size(prompt_len + output_len)


def _reserved_cases(rng):
    cases = [(10, 25, 2048, policy) for policy in ("max", "pow2", "oracle")]  # 2048 / 64 / 35 slots
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
    return cases


register(
    SPECS,
    Spec(
        "ex1.2",
        "slots reserved by a contiguous allocator (Orca max / pow2 / oracle)",
        "reserved_slots(prompt_len, output_len, max_seq_len, policy)",
        cases=_reserved_cases,
        observe=lambda c, fn: attempt(lambda: fn(c[0], c[1], c[2], c[3])),
        reference=lambda: (ref_reserved_slots,),
        describe=lambda c: (
            f"reserved_slots(prompt_len={c[0]}, output_len={c[1]}, max_seq_len={c[2]}, policy={c[3]!r})"
        ),
        size=lambda c: (c[2], c[0] + c[1]),
    ),
)


def ref_paged_token_fraction(seq_lens: list[int], block_size: int) -> float:
    """Via the package: allocate every sequence in a KVCacheManager and ask its usage()."""
    num_blocks = max(1, sum(-(-n // block_size) for n in seq_lens))
    manager = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    for i, n in enumerate(seq_lens):
        if manager.allocate_slots(f"r{i}", n) is None:
            raise RuntimeError("checker bug: the pool was sized to fit every sequence")
    return manager.usage().token_fraction


def _fraction_cases(rng):
    cases = [([], 16), ([16], 16), ([17], 16), ([1], 1), ([5, 3], 4)]
    for _ in range(150):
        block_size = rng.choice([1, 2, 4, 8, 16, 32])
        cases.append(([rng.randint(1, 200) for _ in range(rng.randint(1, 8))], block_size))
    return cases


register(
    SPECS,
    Spec(
        "ex1.3",
        "fraction of reserved KV memory holding tokens, paged",
        "paged_token_fraction(seq_lens, block_size)",
        cases=_fraction_cases,
        observe=lambda c, fn: attempt(lambda: fn(list(c[0]), c[1])),
        reference=lambda: (ref_paged_token_fraction,),
        describe=lambda c: f"paged_token_fraction(seq_lens={c[0]}, block_size={c[1]})",
        size=lambda c: (len(c[0]), sum(c[0])),
        abs_tol=1e-12,
    ),
)


# -- ex1.4: predict where contiguous regions go (one workload per student) ------------------

CONTIG_KNOBS = {"num_slots": 32, "max_model_len": 16, "policy": "pow2"}
# (request id, final length) = allocate it (1 token now); (request id, None) = free it
CONTIG_EVENTS = [("A", 5), ("B", 9), ("C", 3), ("A", None), ("D", 7), ("E", 4), ("F", 6)]


def contig_event_text(event) -> str:
    """One row of the events table (the shipped notebook's and every student's copy)."""
    rid, final_len = event
    return (
        f"{rid} finishes (its region is freed)"
        if final_len is None
        else f"{rid} arrives, final length {final_len}"
    )


def reference_starts(events=CONTIG_EVENTS) -> list:
    """The start slot (or None: no hole is large enough) of each allocation of ``events``."""
    alloc = ContiguousAllocator(**CONTIG_KNOBS)
    starts = []
    for rid, final_len in events:
        if final_len is None:
            alloc.free(rid)
        else:
            region = alloc.allocate(rid, 1, final_len)
            starts.append(None if region is None else region.start)
    return starts


def contig_events_variant(rng: random.Random) -> list:
    """Seven events on a fresh ``CONTIG_KNOBS`` allocator, drawn by ``rng``: an arrival
    after the first free (so a hole is reused) and last, only placed requests freed, ids
    never reused."""
    while True:
        alloc = ContiguousAllocator(**CONTIG_KNOBS)
        events, placed = [], []
        for k in range(7):
            if placed and k >= 2 and rng.random() < 0.25:
                rid = placed.pop(rng.randrange(len(placed)))
                alloc.free(rid)
                events.append((rid, None))
                continue
            rid = "ABCDEFGH"[len([e for e in events if e[1] is not None])]
            final_len = rng.randint(2, CONTIG_KNOBS["max_model_len"])
            if alloc.allocate(rid, 1, final_len) is not None:
                placed.append(rid)
            events.append((rid, final_len))
        frees = [i for i, (_, n) in enumerate(events) if n is None]
        arrivals = [i for i, (_, n) in enumerate(events) if n is not None]
        if frees and arrivals[-1] > frees[0] and len(arrivals) >= 4 and arrivals[-1] == 6:
            return events


def _contig_cases(rng):
    # NOTE: rng is None for the shipped notebook (the CONTIG_EVENTS of its setup cell); a
    # student copy made with --seed gets the events its seed draws, written into its setup cell
    return [CONTIG_EVENTS if rng is None else contig_events_variant(rng)]


register(
    SPECS,
    Spec(
        "ex1.4",
        "predict where a contiguous allocator puts each request",
        "predict_regions()",
        cases=_contig_cases,
        observe=lambda case, fn: fn(),
        expected=lambda case, key: reference_starts([tuple(e) for e in case]),
        describe=lambda c: (
            "the events of CONTIG_EVENTS: "
            + "; ".join(f"{k}: {contig_event_text(e)}" for k, e in enumerate(c))
        ),
        kind="prediction",
    ),
)
VARIANTS = {"ex1.4": ("CONTIG_EVENTS", contig_event_text)}


# -- ex1.5: how many sequences fit a GPU, measured -------------------------------------------

# NOTE: the models that fit one GPU (the paper's 66B and 175B need 4 and 8: chapter 11)
FIT_MODELS = sorted(m for m in MODELS if MODELS[m] in (OPT_13B, LLAMA_7B))


def ref_max_batch(model, gpu, seq_len, gpu_memory_utilization=0.9, activation_reserve_bytes=2**30) -> int:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    cm = CostModel(
        model,
        gpu,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve_bytes=activation_reserve_bytes,
    )
    return cm.num_kv_tokens() // seq_len  # ValueError if the weights do not fit


def _max_batch_cases(rng):
    cases = [("OPT-13B", "A100-40GB", 1024, 0.9, 2**30)]
    for _ in range(60):
        cases.append(
            (
                rng.choice(FIT_MODELS),
                rng.choice(sorted(GPUS)),
                rng.choice([1, 100, 512, 1024, 2048, 4096, rng.randint(1, 5000)]),
                rng.choice([0.5, 0.8, 0.9, 1.0]),
                rng.choice([0, 2**30, 4 * 2**30]),
            )
        )
    return cases + [("OPT-13B", "A100-40GB", 0, 0.9, 2**30), ("OPT-13B", "A100-40GB", 1024, 0.5, 2**30)]


def _max_batch_report(max_batch) -> str:
    """The measured figure for every model and GPU at 1024 tokens (printed by the local check)."""
    rows = []
    for m in FIT_MODELS:
        row = ", ".join(f"{g} {max_batch(MODELS[m], GPUS[g], 1024, 0.9, 2**30)}" for g in sorted(GPUS))
        rows.append(f"{m}, 1024-token sequences that fit: {row}\n")
    return "".join(rows)


register(
    SPECS,
    Spec(
        "ex1.5",
        "how many sequences fit a GPU's KV budget (measure)",
        "max_batch(model, gpu, seq_len, gpu_memory_utilization, activation_reserve_bytes)",
        cases=_max_batch_cases,
        observe=lambda c, fn: attempt(lambda: fn(MODELS[c[0]], GPUS[c[1]], c[2], c[3], c[4])),
        reference=lambda: (ref_max_batch,),
        describe=lambda c: (
            f"max_batch(MODELS[{c[0]!r}], GPUS[{c[1]!r}], seq_len={c[2]}, "
            f"gpu_memory_utilization={c[3]}, activation_reserve_bytes={c[4]})"
        ),
        size=lambda c: (c[2] < 1, c[2]),
        report=_max_batch_report,
    ),
)


# -- ex1.6: concept questions ----------------------------------------------------------------

# question id -> (what is asked, the allowed choices or None for a number); the answers
# are in the instructor's key (notebooks/exercises/_instructor/key.json), not in the package
# NOTE: q1 and q3 state their workload (the shipped CONTIG_EVENTS): a student's copy of ex1.4
# has its own events, and the key has one answer
QUESTIONS = {
    "q1": (
        "the ex1.4 allocator after A (final length 5), B (9), C (3) arrive, A finishes, D (7) and E (4) "
        "arrive: slots reserved but never used",
        None,
    ),
    "q2": ("blocks of 4 slots a 9-token request holds when paged", None),
    "q3": (
        "then F (final length 6) does not fit although 0 slots are free: is that 'internal' or 'external' "
        "fragmentation, or 'neither'",
        ("internal", "external", "neither"),
    ),
    "q4": (
        "which waste does paging leave, bounded by block_size - 1 slots per request: 'internal' or 'external'",
        ("internal", "external"),
    ),
}
register(SPECS, concept_spec("ex1.6", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "CONTIG_EVENTS",
    "CONTIG_KNOBS",
    "QUESTIONS",
    "SPECS",
    "VARIANTS",
    "ExerciseFailure",
    "contig_event_text",
    "ref_max_batch",
    "ref_paged_token_fraction",
    "ref_kv_bytes_per_token",
    "ref_reserved_slots",
    "reference_starts",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex1.1": ("minipaged.sim.cost_model:ModelConfig.kv_bytes_per_token",),
    "ex1.2": (
        "minipaged.core.kv.contiguous:ContiguousAllocator.reservation_size",
        "minipaged.core.kv.contiguous:next_power_of_two",
    ),
    "ex1.3": (
        "minipaged.core.kv.kv_cache_manager:KVCacheUsage.token_fraction",
        "minipaged.core.kv.kv_cache_manager:KVCacheManager.usage",
    ),
    "ex1.4": (
        "minipaged.core.kv.contiguous:ContiguousAllocator.allocate",
        "minipaged.core.kv.contiguous:ContiguousAllocator._find_hole",
        "minipaged.sim.memory_waste:replay_contiguous",
    ),
    "ex1.5": (
        "minipaged.sim.cost_model:CostModel.num_kv_tokens",
        "minipaged.sim.cost_model:CostModel.kv_cache_bytes",
        "minipaged.sim.cost_model:CostModel.num_gpu_blocks",
    ),
    "ex1.6": (
        "minipaged.core.kv.contiguous:ContiguousAllocator.allocate",
        "minipaged.core.kv.contiguous:ContiguousAllocator.external_fragmentation",
        "minipaged.core.kv.contiguous:ContiguousUsage.internal_fragmentation",
    ),
}
set_answered_by(SPECS, ANSWERED_BY)
