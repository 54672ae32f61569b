"""``minipaged bench`` / ``benchmarks/serving.py``: real serving throughput on this machine.

Mirrors vLLM ``benchmarks/benchmark_throughput.py`` (offline: all requests at once,
fixed output lengths with ``ignore_eos``).

What it measures
    One seeded ShareGPT-like workload (``minipaged.sim.workloads.sample_requests``; its
    lengths scaled by ``max_model_len / 2048`` so the paper's 2048-token context maps onto
    the course model's) is served twice, in one process, on the same model and the same
    KV memory (the same number of blocks):

    (a) ``continuous+paged``: the continuous-batching ``Scheduler``, blocks on demand;
    (b) ``static+contiguous``: ``StaticBatchScheduler``, a batch formed only when the last
        one is done, each member reserving prompt + max_tokens slots up front.

    Both decode greedily with ``ignore_eos`` and ``max_tokens`` = the sampled output
    length, so both produce exactly the same tokens (checked: ``outputs_equal``). Reported:
    output tokens/s (wall clock), steps, mean sequences per step, the time split of a step
    (schedule / prepare / forward / sample / update), and the ratio (a)/(b).

Inputs
    ``run_benchmark(...)`` keyword arguments (see ``add_arguments``); ``--json`` prints
    one JSON object instead of the table.
Outputs
    a dict ``{"workload": ..., "systems": {name: metrics}, "ratio": float}``.

Failure mode
    bad arguments raise ``ValueError`` naming them. Wall-clock numbers vary from run to
    run and machine to machine; the step counts and ``outputs_equal`` do not.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Optional

SYSTEMS = {
    "continuous+paged": dict(scheduling="continuous"),
    "static+contiguous": dict(scheduling="static"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir or hub id (default: course model)")
    parser.add_argument("--workload", default="sharegpt", choices=["sharegpt", "alpaca"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks", type=int, default=None,
        help="KV pool size shared by both systems (default: a quarter of the workload's tokens)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads for both systems (default 1: steady numbers on a shared "
             "machine; 0 = torch's default)",
    )
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                        help="preemption of the continuous system")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per system, alternating; the fastest of each is reported")
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


def _serve(engine, prompts, params_list) -> tuple[dict, float, float, list]:
    """Serve all requests; (outputs, wall seconds, CPU seconds of this process, token ids)."""
    outs = {}
    for i, (p, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), p, params)
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return outs, wall, cpu, [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))]


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
    attention_backend: str = "torch",
    threads: int = 1,
    preemption_mode: str = "recompute",
    repeats: int = 3,
    warmup: bool = True,
) -> dict:
    """Serve one workload with each system; return the metrics and the throughput ratio."""
    import torch

    from minipaged import SamplingParams
    from minipaged.config import EngineConfig
    from minipaged.core.kv_cache_utils import cdiv
    from minipaged.engine.llm_engine import load_model_checked

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    base = EngineConfig(model=model, block_size=block_size, device=device, dtype=dtype,
                        attention_backend=attention_backend, seed=seed)
    model_obj, tokenizer = load_model_checked(base)
    max_len = int(model_obj.max_model_len)
    lengths = scaled_workload(workload, num_requests, seed, max_len)
    rng = random.Random(seed)
    vocab = int(model_obj.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(p)] for p, _ in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in lengths]
    demand = [cdiv(p + o - 1, block_size) for p, o in lengths]  # blocks at full length
    if num_blocks is None:
        num_blocks = max(max(demand), sum(demand) // 4)
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = torch's default), got {threads!r}")
    prev_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        return _measure(
            model_obj, tokenizer, lengths, prompts, params,
            model=model, workload=workload, seed=seed, block_size=block_size,
            num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, device=device, dtype=dtype,
            attention_backend=attention_backend, preemption_mode=preemption_mode,
            repeats=repeats, warmup=warmup,
        )
    finally:
        torch.set_num_threads(prev_threads)  # NOTE: leave the caller's process as it was


def _measure(model_obj, tokenizer, lengths, prompts, params, *, model, workload, seed, block_size,
             num_blocks, max_num_seqs, max_num_batched_tokens, device, dtype, attention_backend,
             preemption_mode, repeats, warmup) -> dict:
    """The runs themselves (see ``run_benchmark``)."""
    import torch

    from minipaged import SamplingParams
    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import LLMEngine

    num_requests = len(lengths)
    max_len = int(model_obj.max_model_len)
    if warmup:  # first-call costs (allocator, kernels) out of the measurement
        eng = LLMEngine(EngineConfig(model=model, block_size=block_size, num_blocks=num_blocks,
                                     device=device, dtype=dtype, attention_backend=attention_backend),
                        model=model_obj, tokenizer=tokenizer)
        _serve(eng, prompts[:4], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 4)

    systems, tokens = {}, {}
    walls, cpus = {name: [] for name in SYSTEMS}, {name: [] for name in SYSTEMS}
    names = list(SYSTEMS)
    for rep in range(repeats):
        # NOTE: alternate the order so that drifting machine load hits both systems alike;
        # each system keeps its fastest run (the least disturbed one).
        for name in names if rep % 2 == 0 else names[::-1]:
            kw = dict(SYSTEMS[name])
            if kw["scheduling"] == "continuous":
                kw["preemption_mode"] = preemption_mode
            cfg = EngineConfig(
                model=model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, device=device, dtype=dtype,
                attention_backend=attention_backend, seed=seed, **kw,
            )
            engine = LLMEngine(cfg, model=model_obj, tokenizer=tokenizer)
            outs, wall, cpu, toks = _serve(engine, prompts, params)
            walls[name].append(round(wall, 3))
            cpus[name].append(round(cpu, 3))
            if name in systems and wall >= systems[name]["wall_s"]:
                continue
            tokens[name] = toks
            trace = engine.trace
            n_out = sum(len(t) for t in toks)
            running = [len(s.scheduled) for s in trace.steps]
            times = dict(engine.step_times)
            total_t = sum(times.values()) or 1.0
            systems[name] = {
                "output_tokens": n_out,
                "wall_s": round(wall, 3),
                "tokens_per_s": round(n_out / wall, 1),
                "cpu_s": round(cpu, 3),
                "tokens_per_cpu_s": round(n_out / cpu, 1),
                "steps": len(trace),
                "computed_tokens": sum(sum(s.scheduled.values()) for s in trace.steps),
                "tokens_per_step": round(n_out / len(trace), 2),
                "mean_running_seqs": round(sum(running) / len(running), 2),
                "max_running_seqs": max(running),
                "preemptions": sum(len(s.preempted_ids) + len(s.swapped_out_ids) for s in trace.steps),
                "refused": sum(1 for o in outs.values() if o.outputs[0].finish_reason == "refused"),
                "step_time_split": {k: round(v / total_t, 3) for k, v in times.items()},
                "overhead_fraction": round(
                    1 - (times.get("forward", 0) + times.get("sample", 0)) / total_t, 3
                ),
            }
    for name, m in systems.items():
        m["wall_s_all_runs"] = walls[name]
        m["cpu_s"] = min(cpus[name])  # each measure's least disturbed run
        m["tokens_per_cpu_s"] = round(m["output_tokens"] / m["cpu_s"], 1)
    a, b = systems["continuous+paged"], systems["static+contiguous"]
    return {
        "workload": {
            "name": workload,
            "num_requests": num_requests,
            "seed": seed,
            "max_model_len": max_len,
            "mean_prompt_len": round(sum(p for p, _ in lengths) / num_requests, 1),
            "mean_output_len": round(sum(o for _, o in lengths) / num_requests, 1),
        },
        "model": model or "course_model",
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "kv_cache": {"num_blocks": num_blocks, "block_size": block_size,
                     "bytes": num_blocks * engine.bytes_per_block},
        "max_num_seqs": max_num_seqs,
        "preemption_mode": preemption_mode,
        "repeats": repeats,
        "max_num_batched_tokens": max_num_batched_tokens,
        "systems": systems,
        "outputs_equal": tokens["continuous+paged"] == tokens["static+contiguous"],
        "ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 2),
        "cpu_ratio": round(a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"], 2),
        "step_ratio": round(b["steps"] / a["steps"], 2),
    }


def format_report(r: dict) -> str:
    w = r["workload"]
    lines = [
        f"workload {w['name']}: {w['num_requests']} requests, mean prompt {w['mean_prompt_len']} "
        f"and output {w['mean_output_len']} tokens (scaled to max_model_len {w['max_model_len']}), "
        f"seed {w['seed']}",
        f"model {r['model']} on {r['device']} ({r['torch_threads']} torch threads); KV pool "
        f"{r['kv_cache']['num_blocks']} blocks x {r['kv_cache']['block_size']} tokens "
        f"({r['kv_cache']['bytes'] / 2**20:.1f} MiB) for both; fastest of {r['repeats']} run(s)",
        "",
        f"{'system':<20s}{'tokens/s':>10s}{'wall s':>8s}{'cpu s':>8s}{'steps':>7s}{'out/step':>10s}"
        f"{'seqs/step':>10s}{'computed':>10s}{'preempt':>9s}{'overhead':>10s}",
    ]
    for name, m in r["systems"].items():
        lines.append(
            f"{name:<20s}{m['tokens_per_s']:>10.1f}{m['wall_s']:>8.2f}{m['cpu_s']:>8.2f}{m['steps']:>7d}"
            f"{m['tokens_per_step']:>10.2f}{m['mean_running_seqs']:>10.2f}{m['computed_tokens']:>10d}"
            f"{m['preemptions']:>9d}{m['overhead_fraction']:>10.1%}"
        )
    lines += [
        "",
        "computed = tokens run through the model (prompts, outputs, and recomputation after "
        "preemption); overhead = share of step time outside the forward and the sampler",
        f"throughput ratio continuous+paged / static+contiguous: {r['ratio']:.2f}x "
        f"(by CPU time of this process {r['cpu_ratio']:.2f}x; steps ratio {r['step_ratio']:.2f}x); "
        f"outputs equal: {r['outputs_equal']}",
    ]
    return "\n".join(lines)


def run(args) -> int:
    r = run_benchmark(
        model=args.model, workload=args.workload, num_requests=args.num_requests, seed=args.seed,
        block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, device=args.device, dtype=args.dtype,
        attention_backend=args.attention_backend, threads=args.threads,
        preemption_mode=args.preemption_mode, repeats=args.repeats,
    )
    print(json.dumps(r, indent=2) if args.json else format_report(r))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="continuous+paged vs static+contiguous serving")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
