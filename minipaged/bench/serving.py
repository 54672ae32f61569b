"""``minipaged bench`` / ``benchmarks/serving.py``: real serving on this machine, against transformers.

Mirrors vLLM ``benchmarks/benchmark_throughput.py`` (offline: every request at t = 0, fixed
output lengths with ``ignore_eos``, the ``vllm`` and ``hf`` backends side by side).

What it measures
    One seeded ShareGPT-like workload (``minipaged.sim.workloads.sample_requests``; its
    lengths scaled by ``max_model_len / 2048`` so the paper's 2048-token context maps onto
    the model's), random prompt token ids, served in one process, one after the other, on
    the same weights and the same number of KV token slots (``num_blocks * block_size``):

    (a) ``continuous+paged``: minipaged's continuous-batching ``Scheduler``, blocks on demand;
    (b) ``static+contiguous``: minipaged's ``StaticBatchScheduler``, a batch formed only when
        the last one is done, each member reserving prompt + max_tokens slots up front;
    (c) ``hf-generate-static``: transformers ``model.generate`` in left-padded static batches
        that fit the same slots (``minipaged.bench.hf_baselines``);
    (d) ``hf-continuous-batching``: transformers' ``ContinuousBatchingManager`` with a paged
        cache of the same slots and the same token budget per step; if it cannot run here the
        system is reported as ``unavailable: <reason>``.

    All greedy, each request exactly its sampled output length, EOS ignored (minipaged
    ``ignore_eos``; transformers with EOS switched off), so every system should produce the
    same tokens: ``outputs_equal`` says which pairs do (and how many requests match).
    Reported per system: output tokens/s (wall clock; also per CPU second of this process),
    TTFT and TPOT (all requests arrive at t = 0, so TTFT includes queueing), latency,
    forward steps; for minipaged also the per-step time split (schedule / prepare / forward
    / sample / update) and the overhead (time outside forward and sampler). Ratios (a)/(b),
    (a)/(c), (a)/(d) side by side.

    ``--profile``: one decode step at ``max_num_seqs`` (64) running sequences, timed by the
    engine's stopwatch laps over several steps (no profiler) and split further with cProfile:
    scheduling, block management, input preparation, trace recording, forward, sampler.
    Then one of those steps' forward is split (``forward_breakdown``, CPU time): the weight
    matmuls alone (the floor), the attention layers, everything else, and forward / floor,
    for the attention backend that ran and for ``"torch"`` on the same step;
    ``plot_forward_breakdown`` draws them ("where a decode step's time goes";
    ``--save-profile`` writes them, ``benchmarks/results/cpu_profile.json``). With (a) and (b)
    both run, ``matmul_floors`` also gives each whole run's weight-matmul time: how far a/b
    can go when both compute the same tokens.

    ``--attention-backend`` (minipaged's, for (a) and (b)) defaults to ``"auto"``: the C kernel
    on a CPU where it builds (``minipaged.kernels.cpu``), Triton on a GPU.

Models
    ``course`` (the shipped course model, default), ``random-llama-20m`` (a seeded random
    20M-parameter Llama written to a temporary directory), ``tiny-llama`` (for tests), or a
    local checkpoint directory. ``--model`` may be given several times: one run per model.

Inputs
    ``run_benchmark(...)`` keyword arguments (see ``add_arguments``); ``--json`` prints one
    JSON object (``{"runs": [...]}`` for several models) instead of the table.
Outputs
    a dict ``{"workload", "model", "attention_backend", "kv_cache", "systems": {name: metrics},
    "ratios", "outputs_equal", "outputs_matching", "matmul_floor"?, "profile"?}``.

Failure mode
    bad arguments raise ``ValueError`` naming them. Wall-clock numbers vary from run to run
    and machine to machine (this machine is shared); step counts and outputs do not.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from minipaged.bench.result import ServeResult
from minipaged.cli import dumps_json

# name -> (letter, what it is)
SYSTEMS = {
    "continuous+paged": ("a", "minipaged continuous batching, paged KV"),
    "static+contiguous": ("b", "minipaged static batches, contiguous reservation"),
    "hf-generate-static": ("c", "transformers generate, padded static batches"),
    "hf-continuous-batching": ("d", "transformers continuous batching, paged cache"),
}
MINIPAGED = {"continuous+paged": "continuous", "static+contiguous": "static"}
NAMED_MODELS = ("course", "random-llama-20m", "tiny-llama")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from minipaged.cli import non_negative_int, positive_int

    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help=f"one of {', '.join(NAMED_MODELS)} or a checkpoint dir; repeat for "
        "several runs (default: course)",
    )
    parser.add_argument("--workload", default="sharegpt", choices=["sharegpt", "alpaca"])
    parser.add_argument("--num-requests", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help="KV pool size shared by all systems (default: a quarter of the workload's tokens)",
    )
    parser.add_argument("--max-num-seqs", type=positive_int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton", "cpu"],
        help="minipaged's attention for (a) and (b); auto = the fastest that runs here "
        "(cpu: the C kernel; cuda: triton), see minipaged.kernels.selector.get_attn_backend",
    )
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="torch CPU threads for all systems (default 1: steady numbers on a shared "
        "machine; 0 = torch's default)",
    )
    parser.add_argument(
        "--preemption-mode",
        default="recompute",
        choices=["recompute", "swap"],
        help="preemption of the continuous system",
    )
    parser.add_argument("--systems", default="a,b,c,d", help="which systems to run, e.g. a,b (default all)")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="runs per system, alternating order; the fastest of each is reported",
    )
    parser.add_argument(
        "--quick", action="store_true", help="8 requests, lengths scaled to a 128-token context (for tests)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile one step at --max-num-seqs running sequences"
    )
    parser.add_argument(
        "--save-profile",
        metavar="JSON",
        default=None,
        help="with --profile: write the forward breakdowns (each attention backend) to this file, "
        "and their bar chart next to it as .png",
    )
    parser.add_argument(
        "--profile-figure",
        metavar="PNG",
        default=None,
        help="with --save-profile: where the bar chart goes (default: the JSON's name with .png)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def scaled_workload(workload: str, num_requests: int, seed: int, max_model_len: int):
    """[(prompt_len, output_len)], the workload's lengths scaled to ``max_model_len``."""
    from minipaged.sim.workloads import sample_requests

    scale = min(1.0, max_model_len / 2048)
    out = []
    for p, o in sample_requests(workload, num_requests, seed, max_model_len=2048):
        p = max(1, min(round(p * scale), max_model_len - 1))
        o = max(1, min(round(o * scale), max_model_len - p))
        out.append((p, o))
    return out


def workload_prompts(workload: str, num_requests: int, seed: int, max_model_len: int, vocab: int):
    """(``scaled_workload(...)``, prompts): each prompt seeded random token ids of its length."""
    lengths = scaled_workload(workload, num_requests, seed, max_model_len)
    rng = random.Random(seed)
    return lengths, [[rng.randrange(vocab) for _ in range(p)] for p, _ in lengths]


def _parse_systems(systems) -> list[str]:
    letters = {v[0]: k for k, v in SYSTEMS.items()}
    items = systems.split(",") if isinstance(systems, str) else list(systems)
    names = []
    for s in items:
        s = s.strip()
        name = letters.get(s, s)
        if name not in SYSTEMS:
            raise ValueError(f"systems: unknown system {s!r}; use letters a-d or {sorted(SYSTEMS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("systems must name at least one system")
    return [n for n in SYSTEMS if n in names]


# -- minipaged ------------------------------------------------------------------------
def _serve(engine, prompts, params_list) -> tuple[ServeResult, dict]:
    """Serve all requests on ``engine``; (``ServeResult``, request_id -> RequestOutput)."""
    outs = {}
    for i, (p, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), p, params, stream=True)
    pending = {str(i) for i in range(len(prompts))}  # no token yet
    first, last = {}, {}
    clock = time.perf_counter
    t0, c0 = clock(), time.process_time()
    while engine.has_unfinished_requests():
        done = engine.step()
        now = clock() - t0
        for o in done:
            # NOTE: a token exists once the step that sampled it is over: TTFT at step granularity.
            if o.request_id in pending and (o.finished or o.outputs[0].token_ids):
                first[o.request_id] = now
                pending.discard(o.request_id)
            if o.finished:
                outs[o.request_id] = o
                last[o.request_id] = now
    wall, cpu = clock() - t0, time.process_time() - c0
    ids = [str(i) for i in range(len(prompts))]
    return ServeResult(
        token_ids=[list(outs[r].outputs[0].token_ids) for r in ids],
        wall_s=wall,
        cpu_s=cpu,
        first_token_s=[first[r] for r in ids],
        last_token_s=[last[r] for r in ids],
        steps=len(engine.trace),
    ), outs


def _minipaged_metrics(engine, outs) -> dict:
    trace = engine.trace
    running = [len(s.scheduled) for s in trace.steps]
    times = dict(engine.step_times)
    total_t = sum(times.values()) or 1.0
    model_t = times.get("forward", 0) + times.get("sample", 0)
    return {
        # (tokens, sequences) of every step: what its weight matmuls cost (``matmul_floor_s``)
        "_step_shapes": [(sum(s.scheduled.values()), len(s.scheduled)) for s in trace.steps],
        "computed_tokens": sum(sum(s.scheduled.values()) for s in trace.steps),
        "mean_running_seqs": round(sum(running) / len(running), 2),
        "max_running_seqs": max(running),
        "preemptions": sum(len(s.preempted_ids) + len(s.swapped_out_ids) for s in trace.steps),
        "refused": sum(1 for o in outs.values() if o.outputs[0].finish_reason == "refused"),
        "step_time_split": {k: round(v / total_t, 3) for k, v in times.items()},
        "overhead_fraction": round(1 - model_t / total_t, 3),
        "step_ms": round(1e3 * total_t / len(trace), 3),
        "overhead_ms_per_step": round(1e3 * (total_t - model_t) / len(trace), 3),
    }


def _common_metrics(res: ServeResult, output_lens: list[int]) -> dict:
    n_out = sum(len(t) for t in res.token_ids)
    ttft = sorted(res.first_token_s)
    tpot = [(b - a) / (o - 1) for a, b, o in zip(res.first_token_s, res.last_token_s, output_lens) if o > 1]
    return {
        "output_tokens": n_out,
        "wall_s": round(res.wall_s, 3),
        "tokens_per_s": round(n_out / res.wall_s, 1),
        "cpu_s": round(res.cpu_s, 3),
        "tokens_per_cpu_s": round(n_out / res.cpu_s, 1) if res.cpu_s > 0 else None,
        "steps": res.steps,
        "tokens_per_step": round(n_out / res.steps, 2) if res.steps else None,
        "ttft_s_mean": round(sum(ttft) / len(ttft), 3),
        "ttft_s_p50": round(ttft[len(ttft) // 2], 3),
        "tpot_ms_mean": round(1e3 * sum(tpot) / len(tpot), 2) if tpot else None,
        "latency_s_mean": round(sum(res.last_token_s) / len(res.last_token_s), 3),
    }


# -- models ---------------------------------------------------------------------------
def _resolve_model(model: Optional[str], tmp: str, seed: int) -> tuple[str, Optional[str]]:
    """(label, checkpoint dir or None for the course model)."""
    from minipaged.bench.hf_baselines import RANDOM_LLAMAS, make_random_llama

    if model in (None, "course"):
        return "course", None
    if model in RANDOM_LLAMAS:
        return model, make_random_llama(model, f"{tmp}/{model}", seed)
    return model, model


# -- the benchmark --------------------------------------------------------------------
def run_benchmark(
    model: Optional[str] = None,
    workload: str = "sharegpt",
    num_requests: int = 64,
    seed: int = 0,
    block_size: int = 16,
    num_blocks: Optional[int] = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    device: str = "cpu",
    dtype: str = "float32",
    attention_backend: str = "auto",
    threads: int = 1,
    preemption_mode: str = "recompute",
    systems="a,b,c,d",
    repeats: int = 1,
    warmup: bool = True,
    workload_max_len: Optional[int] = None,
    profile: bool = False,
    profile_steps: int = 20,
) -> dict:
    """Serve one workload with each system on ``model``; return the metrics and the ratios."""
    import torch

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = torch's default), got {threads!r}")
    if attention_backend == "auto":
        from minipaged.kernels.selector import get_attn_backend

        attention_backend = get_attn_backend("auto", device)
    if dtype != "float32":
        raise ValueError(
            f"dtype must be 'float32' (greedy outputs are compared across systems), got {dtype!r}"
        )
    names = _parse_systems(systems)
    prev_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="minipaged-bench-") as tmp:
            label, path = _resolve_model(model, tmp, seed)
            return _measure(
                label,
                path,
                names,
                workload=workload,
                num_requests=num_requests,
                seed=seed,
                block_size=block_size,
                num_blocks=num_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                device=device,
                attention_backend=attention_backend,
                preemption_mode=preemption_mode,
                repeats=repeats,
                warmup=warmup,
                workload_max_len=workload_max_len,
                profile=profile,
                profile_steps=profile_steps,
            )
    finally:
        torch.set_num_threads(prev_threads)  # NOTE: leave the caller's process as it was


def _measure(
    label,
    path,
    names,
    *,
    workload,
    num_requests,
    seed,
    block_size,
    num_blocks,
    max_num_seqs,
    max_num_batched_tokens,
    device,
    attention_backend,
    preemption_mode,
    repeats,
    warmup,
    workload_max_len,
    profile,
    profile_steps,
) -> dict:
    """The runs themselves (see ``run_benchmark``)."""
    import torch

    from minipaged import SamplingParams
    from minipaged.bench import hf_baselines
    from minipaged.config import EngineConfig
    from minipaged.core.kv.block import cdiv
    from minipaged.engine.core import load_model_checked
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.model.loader import resolve_model_path

    base = EngineConfig(
        model=path, block_size=block_size, device=device, attention_backend=attention_backend, seed=seed
    )
    model_obj, tokenizer = load_model_checked(base)
    max_len = int(model_obj.max_model_len)
    wl_len = min(max_len, workload_max_len or max_len)
    lengths, prompts = workload_prompts(workload, num_requests, seed, wl_len, int(model_obj.vocab_size))
    output_lens = [o for _, o in lengths]
    [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in output_lens]
    demand = [cdiv(p + o - 1, block_size) for p, o in lengths]  # blocks at full length
    if num_blocks is None:
        num_blocks = max(max(demand), sum(demand) // 4)
    slots = num_blocks * block_size
    hf_model = None
    if any(n.startswith("hf-") for n in names):
        if device != "cpu":
            raise ValueError(f"device: the transformers baselines run on cpu here, got {device!r}")
        hf_model = hf_baselines.load_hf_model(resolve_model_path(path))

    def engine_for(scheduling: str) -> LLMEngine:
        kw = {"preemption_mode": preemption_mode} if scheduling == "continuous" else {}
        cfg = EngineConfig(
            model=path,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            device=device,
            attention_backend=attention_backend,
            seed=seed,
            scheduling=scheduling,
            **kw,
        )
        return LLMEngine(cfg, model=model_obj, tokenizer=tokenizer)

    def run_one(name: str, p, o) -> tuple[ServeResult, dict]:
        if name in MINIPAGED:
            engine = engine_for(MINIPAGED[name])
            res, outs = _serve(
                engine, p, [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in o]
            )
            return res, _minipaged_metrics(engine, outs)
        if name == "hf-generate-static":
            res = hf_baselines.hf_generate_static(hf_model, p, o, slots, max_num_seqs)
        else:
            res = hf_baselines.hf_continuous_batching(
                hf_model,
                p,
                o,
                block_size=block_size,
                num_blocks=num_blocks,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                seed=seed,
            )
        return res, dict(res.info)

    results: dict[str, dict] = {}
    tokens: dict[str, list] = {}
    walls: dict[str, list] = {n: [] for n in names}
    errors: dict[str, str] = {}
    if warmup:  # first-call costs (allocator, kernels, imports) out of the measurement
        wp = [p[:8] for p in prompts[:2]]
        for name in names:
            try:
                run_one(name, wp, [2] * len(wp))
            except Exception as e:  # noqa: BLE001 - reported as "unavailable" below
                if name in MINIPAGED:
                    raise
                errors[name] = f"{type(e).__name__}: {e}"
    for rep in range(repeats):
        # NOTE: alternate the order so that drifting machine load hits all systems alike;
        # each system keeps its fastest run (the least disturbed one).
        for name in names if rep % 2 == 0 else names[::-1]:
            if name in errors:
                continue
            try:
                res, extra = run_one(name, prompts, output_lens)
            except Exception as e:  # noqa: BLE001 - e.g. transformers' CB cannot run here
                if name in MINIPAGED:
                    raise
                errors[name] = f"{type(e).__name__}: {e}"
                continue
            walls[name].append(round(res.wall_s, 3))
            if name in results and res.wall_s >= results[name]["wall_s"]:
                continue
            tokens[name] = res.token_ids
            results[name] = {**_common_metrics(res, output_lens), **extra}
    shapes = {name: results[name].pop("_step_shapes") for name in MINIPAGED if name in results}
    systems = {}
    for name in names:
        letter = SYSTEMS[name][0]
        if name in results:
            systems[name] = {"label": letter, **results[name], "wall_s_all_runs": walls[name]}
        else:
            systems[name] = {"label": letter, "unavailable": errors.get(name, "not run")}

    ran = [n for n in names if n in results]
    equal, matching, divergence = {}, {}, {}
    for i, x in enumerate(ran):
        for y in ran[i + 1 :]:
            key = f"{SYSTEMS[x][0]}={SYSTEMS[y][0]}"
            same = [tx == ty for tx, ty in zip(tokens[x], tokens[y])]
            equal[key] = all(same)
            matching[key] = f"{sum(same)}/{len(same)}"
            firsts = [_first_diff(tx, ty) for tx, ty, s in zip(tokens[x], tokens[y], same) if not s]
            if firsts:
                divergence[key] = {
                    "requests": len(firsts),
                    "first_divergent_token_min": min(firsts),
                    "first_divergent_token_mean": round(sum(firsts) / len(firsts), 1),
                }
    ratios, cpu_ratios, step_ratios = {}, {}, {}
    if "continuous+paged" in results:
        a = results["continuous+paged"]
        for name in ran[1:] if ran[0] == "continuous+paged" else []:
            key = f"a/{SYSTEMS[name][0]}"
            m = results[name]
            ratios[key] = round(a["tokens_per_s"] / m["tokens_per_s"], 2)
            if m["tokens_per_cpu_s"] and a["tokens_per_cpu_s"]:
                cpu_ratios[key] = round(a["tokens_per_cpu_s"] / m["tokens_per_cpu_s"], 2)
            if m["steps"]:
                step_ratios[key] = round(m["steps"] / a["steps"], 2)
    median_ratios = _median_ratios(systems)
    num_params = sum(p.numel() for p in model_obj.parameters())
    report = {
        "workload": {
            "name": workload,
            "num_requests": num_requests,
            "seed": seed,
            "max_model_len": wl_len,
            "mean_prompt_len": round(sum(p for p, _ in lengths) / num_requests, 1),
            "mean_output_len": round(sum(o for _, o in lengths) / num_requests, 1),
            "max_prompt_plus_output": max(p + o for p, o in lengths),
        },
        "model": label,
        "model_params_m": round(num_params / 1e6, 2),
        "device": device,
        "attention_backend": attention_backend,
        "torch_threads": torch.get_num_threads(),
        "kv_cache": {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "token_slots": slots,
            "bytes": num_blocks * model_obj.kv_cache_bytes_per_block(block_size),
        },
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "preemption_mode": preemption_mode,
        "repeats": repeats,
        "systems": systems,
        "outputs_equal": equal,
        "outputs_matching": matching,
        "outputs_divergence": divergence,
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "step_ratios": step_ratios,
        "median_ratios": median_ratios,
    }
    if profile and len(shapes) == 2:
        floors = {SYSTEMS[n][0]: v for n, v in matmul_floors(model_obj, shapes).items()}
        report["matmul_floor"] = {
            "seconds": {k: round(v, 6) for k, v in floors.items()},
            "a/b": round(floors["b"] / floors["a"], 2),
        }
        split = step_cost_split(
            floors,
            {SYSTEMS[n][0]: systems[n]["wall_s"] for n in shapes},
            {SYSTEMS[n][0]: len(v) for n, v in shapes.items()},
            {SYSTEMS[n][0]: sum(b for _, b in v) for n, v in shapes.items()},
        )
        if split is not None:
            report["matmul_floor"]["split"] = split
    if profile:
        report["profile"] = profile_step(
            model_obj,
            tokenizer,
            prompts,
            path=path,
            block_size=block_size,
            num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            device=device,
            attention_backend=attention_backend,
            steps=profile_steps,
        )
    return report


def _median_ratios(systems: dict) -> dict:
    """a/x tokens/s ratios from each system's *median* wall time over its runs (every run of a
    system produces the same tokens, so tokens/s ratios are inverse wall-time ratios)."""

    def median_tps(m):
        walls = sorted(m["wall_s_all_runs"])
        return m["output_tokens"] / walls[len(walls) // 2]

    a = systems.get("continuous+paged", {})
    if "wall_s_all_runs" not in a:
        return {}
    return {
        f"a/{m['label']}": round(median_tps(a) / median_tps(m), 2)
        for name, m in systems.items()
        if name != "continuous+paged" and m.get("wall_s_all_runs")
    }


def _first_diff(x: list[int], y: list[int]) -> int:
    for i, (a, b) in enumerate(zip(x, y)):
        if a != b:
            return i
    return min(len(x), len(y))


# -- profile of one step --------------------------------------------------------------
_BLOCK_FILES = (
    "core/kv/kv_cache_manager.py",
    "core/kv/block_manager_v0.py",
    "core/kv/block_pool.py",
    "core/kv/block.py",
    "core/kv/block_table.py",
)


def profile_step(
    model_obj,
    tokenizer,
    prompts,
    *,
    path=None,
    block_size=16,
    num_seqs=64,
    max_num_batched_tokens=512,
    device="cpu",
    attention_backend="torch",
    steps=20,
    warm_steps=32,
) -> dict:
    """Time decode steps with ``num_seqs`` sequences running; split them by phase.

    ``num_seqs`` requests (the workload's prompts, cycled) share a pool big enough for all
    at full length; once every one is past its prefill and ``warm_steps`` more steps have
    run (contexts in mid-generation), ``steps`` steps are timed by the engine's stopwatch laps (no profiler), then ``steps``
    more run under cProfile, whose call graph splits the step into the engine's direct
    calls (schedule, prepare, forward, ...) and the time spent in block management
    (``KVCacheManager`` / ``BlockPool``, from wherever it is called).
    """
    import cProfile
    import pstats

    from minipaged import SamplingParams
    from minipaged.config import EngineConfig
    from minipaged.core.kv.block import cdiv
    from minipaged.engine.llm_engine import LLMEngine

    max_len = int(model_obj.max_model_len)
    reqs = [prompts[i % len(prompts)][: max_len // 2] for i in range(num_seqs)]
    new = min(warm_steps + 2 * steps + 4, max_len - max(len(p) for p in reqs))
    pool = sum(cdiv(len(p) + new, block_size) for p in reqs)
    engine = LLMEngine(
        EngineConfig(
            model=path,
            block_size=block_size,
            num_blocks=pool,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            device=device,
            attention_backend=attention_backend,
        ),
        model=model_obj,
        tokenizer=tokenizer,
    )
    for i, p in enumerate(reqs):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    while (
        not engine.trace.steps
        or engine.trace.steps[-1].prefill_ids
        or len(engine.scheduler.running) < num_seqs
    ):
        engine.step()
        if len(engine.trace) > 10 * num_seqs:
            raise RuntimeError("profile: the sequences never all reached decode")
    for _ in range(warm_steps):
        engine.step()
    step_input = _capture_step_input(engine)  # one more step: its forward is split below
    for k in engine.step_times:
        engine.step_times[k] = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - t0) / steps
    laps = {k: v / steps for k, v in engine.step_times.items()}
    running = len(engine.scheduler.running)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    st = pstats.Stats(prof).stats  # func -> (cc, nc, tt, ct, callers)
    step_key = next(f for f in st if f[0].endswith("engine/core.py") and f[2] == "step")  # EngineCore.step
    total = st[step_key][3]
    children = {}
    for f, (_, _, _, _, callers) in st.items():
        if step_key in callers:
            name = f[2] if not f[0].startswith("~") else f[2].strip("<>")
            children[name] = children.get(name, 0.0) + callers[step_key][3]
    block = 0.0
    for f, (_, _, _, _, callers) in st.items():
        if f[0].replace("\\", "/").endswith(_BLOCK_FILES):
            block += sum(
                v[3] for c, v in callers.items() if not c[0].replace("\\", "/").endswith(_BLOCK_FILES)
            )

    ms = {k: round(1e3 * v, 3) for k, v in laps.items()}
    overhead = laps["schedule"] + laps["prepare"]
    breakdown = forward_breakdown(model_obj, *step_input)
    breakdowns = {attention_backend: breakdown}
    if attention_backend != "torch":  # the same step through the readable torch reference
        breakdowns["torch"] = _with_backend(
            model_obj, "torch", lambda: forward_breakdown(model_obj, *step_input)
        )
    return {
        "attention_backend": attention_backend,
        "forward_breakdown": breakdown,
        "forward_breakdowns": breakdowns,
        "running_seqs": running,
        "steps_timed": steps,
        "step_ms": round(1e3 * step_s, 3),
        "laps_ms": ms,
        "laps_fraction": {k: round(v / step_s, 3) for k, v in laps.items()},
        # scheduling + block management (inside schedule) + input preparation
        "sched_block_prepare_fraction": round(overhead / step_s, 3),
        # all of it outside the model: + update_from_output, trace record, outputs
        "non_model_fraction": round((overhead + laps["update"]) / step_s, 3),
        "cprofile_fraction": {
            k: round(v / total, 3)
            for k, v in sorted(children.items(), key=lambda kv: -kv[1])
            if v / total >= 0.001
        },
        "cprofile_block_management_fraction": round(block / total, 3),
    }


def matmul_floors(model, runs: dict, repeats: int = 5) -> dict:
    """Seconds the weight matmuls alone take over each run: ``runs`` maps a name to its steps'
    [(tokens, sequences)]; every layer's matrices run on ``tokens`` rows, the LM head on
    ``sequences`` rows. One cost curve, measured on a grid of row counts and interpolated
    linearly, serves every run, so the runs' floors compare on one machine state: what each
    run would cost if nothing but its matmuls took time (its "floor", as for one step)."""
    import torch
    import torch.nn.functional as F

    mats = _weight_matrices(model)
    body = [m for m in mats if not m[0].endswith("lm_head")]
    head = [m for m in mats if m[0].endswith("lm_head")]
    gen = torch.Generator().manual_seed(0)

    def ms(group, rows: int) -> float:
        # NOTE: the fastest of ``repeats`` timings: a floor, so the least disturbed run is the right one
        xs = [torch.randn(rows, w.shape[1], generator=gen, dtype=w.dtype) for _, w, _ in group]
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first one warms up
                t0 = time.process_time()
                for _ in range(3):
                    for x, (_, w, b) in zip(xs, group):
                        F.linear(x, w, b)
                best = min(best, (time.process_time() - t0) / 3)
        return 1e3 * best

    def curve(group, wanted: set) -> dict:
        if not group or not wanted:
            return {}
        grid = sorted({1, *(2**k for k in range(1, 12) if 2**k < max(wanted)), max(wanted)})
        known = {r: ms(group, r) for r in grid}
        out = {}
        for r in wanted:  # linear between the two grid points around r
            lo = max(g for g in grid if g <= r)
            hi = min(g for g in grid if g >= r)
            out[r] = known[lo] if hi == lo else known[lo] + (known[hi] - known[lo]) * (r - lo) / (hi - lo)
        return out

    shapes = [shape for steps in runs.values() for shape in steps]
    tokens = curve(body, {t for t, _ in shapes if t > 0})
    seqs = curve(head, {b for _, b in shapes if b > 0})
    return {
        name: sum(tokens.get(t, 0.0) + seqs.get(b, 0.0) for t, b in steps) / 1e3
        for name, steps in runs.items()
    }


def step_cost_split(floors: dict, walls: dict, steps: dict, seq_steps: dict) -> Optional[dict]:
    """What (a) and (b) pay beyond their matmuls, split into a cost per step and a cost per
    sequence-step, and what that means for a/b.

    Each run's time beyond its matmul floor is ``steps * per_step + seq_steps * per_seq``
    (``seq_steps``: the sequences summed over the run's steps); the two runs give two equations
    for the two unknowns. Returns ``per_step_ms``, ``per_seq_step_ms``, ``a/b_if_free_per_seq``
    (a/b with per_seq = 0: the most that cutting per-sequence work can give) and
    ``per_step_ms_for_2x`` (the per-step cost a/b >= 2 would need, with per_seq = 0; None when
    no per-step cost reaches 2x), or None when the runs do not give a positive split.
    """
    (sa, sb), (qa, qb) = (steps["a"], steps["b"]), (seq_steps["a"], seq_steps["b"])
    ra, rb = walls["a"] - floors["a"], walls["b"] - floors["b"]
    det = sa * qb - sb * qa
    if det == 0:
        return None
    per_step, per_seq = (ra * qb - rb * qa) / det, (sa * rb - sb * ra) / det
    if per_step <= 0 or per_seq <= 0:
        return None
    need = (2 * floors["a"] - floors["b"]) / (sb - 2 * sa) if sb > 2 * sa else None
    return {
        "per_step_ms": round(1e3 * per_step, 3),
        "per_seq_step_ms": round(1e3 * per_seq, 4),
        "seq_steps": {"a": qa, "b": qb},
        "a/b_if_free_per_seq": round((floors["b"] + sb * per_step) / (floors["a"] + sa * per_step), 2),
        "per_step_ms_for_2x": None if need is None else round(1e3 * need, 3),
    }


# -- where a decode step's forward goes: matmul floor, attention, the rest -------------
def _with_backend(model, backend: str, fn):
    """``fn()`` with ``model`` switched to ``backend`` (its attention layers, and the small layers
    that the "cpu" backend runs in C: ``PagedCausalLM.use_backend``), then switched back."""
    before = model.use_backend(backend)
    try:
        return fn()
    finally:
        model.use_backend(before)


def _capture_step_input(engine):
    """(ModelInput, kv_caches) of the engine's next step, captured while it runs."""
    model = engine.model
    seen = {}

    def capture(inp, kv_caches):
        seen["inp"], seen["kv"] = inp, kv_caches
        return type(model).forward(model, inp, kv_caches)

    model.forward = capture  # NOTE: an instance attribute shadows the method for one step
    try:
        engine.step()
    finally:
        del model.forward
    return seen["inp"], seen["kv"]


def _weight_matrices(model, unfused: bool = False) -> list:
    """(name, weight, bias) of every ``nn.Linear`` in ``model``; with ``unfused`` a fused projection
    (``qkv_proj``, ``gate_up_proj``) counts as the checkpoint's separate matrices."""
    from torch import nn

    from minipaged.model.llama import STACKED_PARAMS

    mats = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        parent_name, _, field_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        shards = [shard for fused, _, shard in STACKED_PARAMS if fused == field_name]
        if unfused and shards and hasattr(parent, "shard_rows"):
            for shard in shards:
                rows = parent.shard_rows(shard)
                mats.append((name, mod.weight[rows], None if mod.bias is None else mod.bias[rows]))
        else:
            mats.append((name, mod.weight, mod.bias))
    return mats


def _cpu_ms(fns: dict, calls: int, repeats: int) -> dict:
    """name -> the fastest over ``repeats`` of the mean CPU time (ms) of ``calls`` calls of ``fns[name]``.

    The functions take turns in each repeat, so a change in machine load hits all alike, and
    each keeps its least disturbed repeat (on a shared machine the others measure the neighbours).
    NOTE: process CPU time, not wall time: on a shared machine a wall clock also counts the
    time this process waits for a core; CPU time counts only the work (with 1 torch thread).
    """
    for fn in fns.values():
        fn()  # warm
    runs: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            runs[name].append(1e3 * (time.process_time() - t0) / calls)
    return {name: min(r) for name, r in runs.items()}


def forward_breakdown(model, inp, kv_caches, calls: int = 5, repeats: int = 15) -> dict:
    """Split one step's forward into: the weight matmuls (the floor), attention, the rest.

    - ``floor_ms``: the same rows through every weight matrix of the model as plain
      ``F.linear`` calls, nothing else (T rows per layer matrix, B rows for the LM head);
      ``floor_unfused_ms``: the same with q/k/v and gate/up as the checkpoint's separate
      matrices (what fusing them saves).
    - ``forward_ms``: ``model.forward`` on the step's input (its attention plan included).
    - ``attention_ms``: time inside the ``PagedAttention`` layers (cache write, attention
      plan, attention): their share of a separate pass timed with hooks, times ``forward_ms``.
    - ``other_ms`` = forward - floor - attention: norms, rotary, residuals, reshapes,
      gathers, Python; ``*_share`` are fractions of the forward, ``ratio_to_floor`` = forward / floor.
    All CPU times of this process (``_cpu_ms``), the fastest of ``repeats``.
    """
    import torch
    import torch.nn.functional as F

    from minipaged.model.attention import PagedAttention

    rows = int(inp.input_ids.shape[0])
    gen = torch.Generator().manual_seed(0)

    def matmuls(mats):
        # NOTE: the LM head sees one row per sequence (the logits rows), the others every token
        xs = [
            torch.randn(
                inp.num_seqs if name.endswith("lm_head") else rows, w.shape[1], generator=gen, dtype=w.dtype
            )
            for name, w, _ in mats
        ]

        def run():
            for x, (_, w, b) in zip(xs, mats):
                F.linear(x, w, b)

        return run

    def forward():
        inp.attn_backend = None  # NOTE: plan the attention as a real step does
        model.forward(inp, kv_caches)

    spent = {"attention": 0.0}

    def pre(mod, args):
        spent["t0"] = time.process_time()

    def post(mod, args, out):
        spent["attention"] += time.process_time() - spent["t0"]

    with torch.inference_mode():
        ms = _cpu_ms(
            {
                "floor": matmuls(_weight_matrices(model)),
                "forward": forward,
                "floor_unfused": matmuls(_weight_matrices(model, unfused=True)),
            },
            calls,
            repeats,
        )
        floor, fwd, floor_unfused = ms["floor"], ms["forward"], ms["floor_unfused"]
        hooks = [
            h
            for m in model.modules()
            if isinstance(m, PagedAttention)
            for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))
        ]
        try:
            t0 = time.process_time()
            for _ in range(calls * repeats):
                forward()
            hooked = time.process_time() - t0
        finally:
            for h in hooks:
                h.remove()
    # NOTE: the attention's share of the hooked pass, applied to the forward timed without hooks
    # (one pass gives both numbers the same machine load).
    attention = fwd * spent["attention"] / hooked
    other = max(0.0, fwd - floor - attention)
    return {
        "tokens": rows,
        "num_seqs": inp.num_seqs,
        "mean_context": round(float(inp.seq_lens.float().mean()), 1),
        "max_context": int(inp.max_seq_len),
        "forward_ms": round(fwd, 4),
        "floor_ms": round(floor, 4),
        "floor_unfused_ms": round(floor_unfused, 4),
        "attention_ms": round(attention, 4),
        "other_ms": round(other, 4),
        "floor_share": round(floor / fwd, 3),
        "attention_share": round(attention / fwd, 3),
        "other_share": round(other / fwd, 3),
        "ratio_to_floor": round(fwd / floor, 2),
    }


def format_forward_breakdown(b: dict, backend: Optional[str] = None) -> str:
    which = f", attention_backend={backend!r}" if backend else ""
    return (
        f"  forward at {b['num_seqs']} sequences (context mean {b['mean_context']}, max {b['max_context']}{which}): "
        f"{b['forward_ms']:.2f} ms CPU = weight matmuls alone (the floor) {b['floor_ms']:.2f} ms "
        f"({b['floor_share']:.0%}) + attention {b['attention_ms']:.2f} ms ({b['attention_share']:.0%}) "
        f"+ everything else {b['other_ms']:.2f} ms ({b['other_share']:.0%}); "
        f"forward / floor = {b['ratio_to_floor']:.2f}x (target <= 1.5x); "
        f"floor with q/k/v and gate/up unfused: {b['floor_unfused_ms']:.2f} ms"
    )


def plot_forward_breakdown(runs: dict, ax=None):
    """Bar chart "where a decode step's time goes" from recorded breakdowns.

    ``runs``: label -> a ``forward_breakdown`` dict (e.g. the ``"runs"`` of
    ``benchmarks/results/cpu_profile.json``). One horizontal bar per label, split into the
    floor, attention and everything else (ms), with forward / floor written at its end.
    Returns the matplotlib ``Axes``.
    """
    import textwrap

    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("runs must hold at least one breakdown")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 1.6 + 0.8 * len(runs)))
    parts = (
        ("floor_ms", "weight matmuls (the floor)", "#4c72b0"),
        ("attention_ms", "attention", "#dd8452"),
        ("other_ms", "everything else", "#8c8c8c"),
    )
    labels = list(runs)[::-1]  # first label on top
    for y, label in enumerate(labels):
        b, left = runs[label], 0.0
        for key, name, color in parts:
            ax.barh(y, b[key], left=left, color=color, label=name if y == 0 else None)
            left += b[key]
        ax.text(left, y, f"  {b['ratio_to_floor']:.2f}x floor", va="center")
    ax.set_yticks(range(len(labels)), [textwrap.fill(label, 32) for label in labels])
    ax.set_xlabel("CPU ms per decode step (forward only)")
    ax.set_xlim(0, 1.3 * max(r["forward_ms"] for r in runs.values()))
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize="small", frameon=False)
    ax.set_title("Where a decode step's time goes", pad=28)
    return ax


# -- text report ----------------------------------------------------------------------
def format_report(r: dict) -> str:
    if "runs" in r:
        return "\n\n".join(format_report(x) for x in r["runs"])
    w, kv = r["workload"], r["kv_cache"]
    lines = [
        f"workload {w['name']}: {w['num_requests']} requests, mean prompt {w['mean_prompt_len']} "
        f"and output {w['mean_output_len']} tokens (scaled to a {w['max_model_len']}-token context, "
        f"longest {w['max_prompt_plus_output']}), seed {w['seed']}, all at t=0, greedy, EOS ignored",
        f"model {r['model']} ({r['model_params_m']}M params) on {r['device']} (minipaged attention: "
        f"{r.get('attention_backend', 'torch')}), {r['torch_threads']} torch "
        f"thread(s); KV {kv['num_blocks']} blocks x {kv['block_size']} = {kv['token_slots']} token slots "
        f"({kv['bytes'] / 2**20:.1f} MiB) for every system; max_num_seqs {r['max_num_seqs']}, "
        f"max_num_batched_tokens {r['max_num_batched_tokens']}; fastest of {r['repeats']} run(s)",
        "",
        f"{'':3s}{'system':<24s}{'tok/s':>8s}{'wall s':>8s}{'cpu s':>8s}{'steps':>7s}{'TTFT s':>8s}"
        f"{'TPOT ms':>9s}{'lat s':>7s}{'seqs/st':>8s}{'computed':>9s}{'preempt':>8s}{'ovh %':>7s}{'ovh ms':>7s}",
    ]

    for name, m in r["systems"].items():
        if "unavailable" in m:
            lines.append(f"({m['label']}){name:<24s} unavailable: {m['unavailable']}")
            continue
        ovh = m.get("overhead_fraction")
        lines.append(
            f"({m['label']}){name:<24s}{m['tokens_per_s']:>8.1f}{m['wall_s']:>8.2f}{m['cpu_s']:>8.2f}"
            f"{m['steps']:>7d}{m['ttft_s_mean']:>8.2f}{_s(m['tpot_ms_mean'], '.1f'):>9s}{m['latency_s_mean']:>7.2f}"
            f"{_s(m.get('mean_running_seqs'), '.1f'):>8s}{_s(m.get('computed_tokens'), 'd'):>9s}"
            f"{_s(m.get('preemptions'), 'd'):>8s}"
            f"{_s(None if ovh is None else 100 * ovh, '.1f'):>7s}{_s(m.get('overhead_ms_per_step'), '.2f'):>7s}"
        )
    lines.append("")
    c = r["systems"].get("hf-generate-static", {})
    if "batches" in c:
        lines.append(
            f"(c) {c['batches']} padded batches, sizes {min(c['batch_sizes'])}..{max(c['batch_sizes'])}, "
            f"peak {c['kv_token_slots_peak']} of {kv['token_slots']} slots; {c['generated_tokens']} tokens "
            f"generated for {c['output_tokens']} kept"
        )
    d = r["systems"].get("hf-continuous-batching", {})
    if "kv_token_slots" in d:
        lines.append(
            f"(d) paged cache {d['kv_token_slots']} token slots (transformers rounds up to whole "
            f"sectors), max_batch_tokens {d['max_batch_tokens']}, attention {d['attn_implementation']}; "
            f"step split {d['step_time_split']}; keys per query {d['mean_keys_per_query']} "
            f"(the batch packed into one masked sequence)"
        )
    lines += [
        "TTFT/latency include queueing (every request arrives at t=0); TPOT = (last - first token) / "
        "(tokens - 1); computed = tokens through the model (prompts, outputs, recomputation after "
        "preemption); ovh = share of step time outside the forward and the sampler (minipaged: "
        "schedule + prepare + update laps; (d): prepare_next_batch + update_batch)",
    ]
    if r["ratios"]:
        lines.append(
            "ratios (tokens/s): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items())
            + (
                "; by CPU time: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["cpu_ratios"].items())
                if r["cpu_ratios"]
                else ""
            )
            + (
                "; by steps: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["step_ratios"].items())
                if r["step_ratios"]
                else ""
            )
        )
    if r.get("median_ratios") and r["repeats"] > 1:
        lines.append(
            f"ratios (tokens/s, median of {r['repeats']} runs per system): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in r["median_ratios"].items())
        )
    if r["outputs_equal"]:
        lines.append(
            "outputs equal (greedy, token for token): "
            + ", ".join(
                f"{k} {'yes' if r['outputs_equal'][k] else 'no'} ({r['outputs_matching'][k]})"
                for k in r["outputs_equal"]
            )
        )
    for k, d in r.get("outputs_divergence", {}).items():
        lines.append(
            f"  {k}: {d['requests']} request(s) diverge, first divergent token at index "
            f">= {d['first_divergent_token_min']} (mean {d['first_divergent_token_mean']})"
        )
    if "matmul_floor" in r:
        f = r["matmul_floor"]
        lines.append(
            f"weight matmuls alone over each run's steps (the run's floor): a {f['seconds']['a']:.2f} s, "
            f"b {f['seconds']['b']:.2f} s; a/b would be {f['a/b']:.2f}x if nothing else took time "
            "(both compute the same tokens: what a's fewer steps save is b's per-step cost beyond them)"
        )
        if "split" in f:
            sp = f["split"]
            lines.append(
                f"beyond the matmuls: {sp['per_step_ms']:.2f} ms per step + {sp['per_seq_step_ms']:.3f} ms per "
                f"sequence-step (a {sp['seq_steps']['a']}, b {sp['seq_steps']['b']} sequence-steps); with no "
                f"per-sequence cost at all a/b would be {sp['a/b_if_free_per_seq']:.2f}x; a/b >= 2x needs "
                + (
                    f"{sp['per_step_ms_for_2x']:.2f} ms per step"
                    if sp["per_step_ms_for_2x"] is not None
                    else "more steps saved than this workload has"
                )
            )
    if "profile" in r:
        lines += ["", format_profile(r["profile"])]
    return "\n".join(lines)


def _s(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_profile(p: dict) -> str:
    laps = ", ".join(f"{k} {v:.2f} ms ({p['laps_fraction'][k]:.1%})" for k, v in p["laps_ms"].items())
    prof = ", ".join(f"{k} {v:.1%}" for k, v in p["cprofile_fraction"].items())
    return "\n".join(
        [
            f"profile: one decode step at {p['running_seqs']} running sequences, mean of {p['steps_timed']} steps: "
            f"{p['step_ms']:.2f} ms",
            f"  stopwatch laps: {laps}",
            f"  scheduling + block management + input preparation (schedule + prepare): "
            f"{p['sched_block_prepare_fraction']:.1%} of the step (target < 20%); with update/trace/outputs: "
            f"{p['non_model_fraction']:.1%}",
            f"  cProfile (inflates Python-heavy parts) of the engine's direct calls: {prof}; "
            f"block management (KVCacheManager/BlockPool, all callers): {p['cprofile_block_management_fraction']:.1%}",
        ]
        + [format_forward_breakdown(b, backend) for backend, b in p.get("forward_breakdowns", {}).items()]
    )


def run(args) -> int:
    models = args.model or ["course"]
    kw = dict(
        workload=args.workload,
        num_requests=args.num_requests,
        seed=args.seed,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        attention_backend=args.attention_backend,
        threads=args.threads,
        preemption_mode=args.preemption_mode,
        systems=args.systems,
        repeats=args.repeats,
        profile=args.profile,
    )
    if args.quick:
        kw.update(num_requests=min(args.num_requests, 8), workload_max_len=128, profile_steps=3)
    if args.save_profile and not args.profile:
        raise SystemExit("--save-profile needs --profile")
    runs = [run_benchmark(model=m, **kw) for m in models]
    r = runs[0] if len(runs) == 1 else {"runs": runs}
    print(dumps_json(r, indent=2) if args.json else format_report(r))
    if args.save_profile:
        typed = getattr(args, "_argv", None)
        command = " ".join(
            ["minipaged", *typed] if typed else ["python benchmarks/serving.py", *sys.argv[1:]]
        )
        save_profile(runs[0], args.save_profile, command, args.profile_figure)
    return 0


def save_profile(report: dict, path, command: str, figure=None) -> None:
    """Write the profile's forward breakdowns (one per attention backend) to ``path`` (JSON) and
    their bar chart to ``figure`` (default: ``path`` with .png): what chapter 07 and the README read."""
    import platform

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    p = report["profile"]
    labels = {
        "torch": "attention_backend='torch' (the readable reference: gather, split-KV softmax)",
        "cpu": "attention_backend='cpu' (C: attention reading keys and values in place, and the small layers)",
        "triton": "attention_backend='triton'",
    }
    b0 = p["forward_breakdown"]
    out = {
        "what": (
            f"one decode step's forward at {b0['num_seqs']} running sequences (model {report['model']}, "
            f"{report['workload']['name']}-like prompts, {p['steps_timed']} steps timed after warm-up), split "
            "into the weight matmuls alone (the floor), the attention layers (cache write, plan, attention) "
            "and everything else; CPU ms of one process, the fastest of 15 interleaved repeats (minipaged.bench.serving.forward_breakdown)"
        ),
        "command": command,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s), {report['torch_threads']} torch thread(s)",
        "torch": torch.__version__,
        "runs": {labels.get(k, k): b for k, b in reversed(list(p["forward_breakdowns"].items()))},
    }
    if "matmul_floor" in report:  # the same run's serving side: why a/b stops where it does
        systems = report["systems"]
        out["serving"] = {
            "attention_backend": report["attention_backend"],
            "wall_s": {m["label"]: m["wall_s"] for m in systems.values() if "wall_s" in m},
            "steps": {m["label"]: m["steps"] for m in systems.values() if "steps" in m},
            "computed_tokens": {
                m["label"]: m["computed_tokens"] for m in systems.values() if "computed_tokens" in m
            },
            "matmul_floor_s": report["matmul_floor"]["seconds"],
        }
        if "split" in report["matmul_floor"]:
            out["serving"]["beyond_matmuls"] = report["matmul_floor"]["split"]
    path = Path(path)
    path.write_text(dumps_json(out, indent=2) + "\n")
    ax = plot_forward_breakdown(out["runs"])
    figure = Path(figure) if figure else path.with_suffix(".png")
    ax.figure.savefig(figure, dpi=110, bbox_inches="tight")
    plt.close(ax.figure)
    print(f"wrote {path} and {figure}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="serving on this machine: minipaged continuous+paged vs static+contiguous vs transformers"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
