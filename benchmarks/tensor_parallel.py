"""Tensor parallelism on this machine: tp=1 against tp=2 tokens/s, and where a tp step goes.

    python benchmarks/tensor_parallel.py [--level engine|model] [--model random-llama-20m|tiny-llama|course|DIR]
        [--num-seqs 8] [--prompt-len 64] [--max-tokens 32] [--repeats 5] [--tp 2]
        [--device cpu|cuda] [--attention-backend auto|torch|cpu|triton] [--json]

``--level engine`` (the default): ``LLM(model)`` against ``LLM(model, tensor_parallel_size=N)``
on the same requests (``num_seqs`` random prompts, greedy, ``max_tokens`` each, one warm-up
call first), median of ``--repeats`` timed ``generate`` calls, the two engines' calls
alternating (tp=1, tp=N, tp=1, ...: a load that drifts on a shared machine hits both alike): tokens/s, whether the tokens
agree, and for tp=N the share of the wall time in rank 0's collectives (all-reduces and the
logits all-gather, waiting for the slower rank included), the all-reduce's own cost (every rank
ready), and the share spent sending each step's scheduler output to the workers, with its bytes
per step. The driver process (scheduler, detokenizer) runs beside the workers. Both engines
run ``--attention-backend`` ("auto": the C kernels on a CPU, Triton on CUDA). Where the rest
goes: one more tp=1 run under ``torch.profiler`` gives the share of its time in the matrix
multiplies, the only work that tensor parallelism divides among the ranks; everything else
(attention over the rank's heads aside: norms, RoPE, cache writes, the Python of every module
call) each rank repeats whole, so Amdahl's law estimates tp=N at ``1 / (share / N + 1 - share)``,
printed beside the measured ratio (an estimate, not a bound: the profiler's own overhead
lowers the share it finds, and half the weights per rank fit the caches better). The ratio is printed two ways: of the
medians, and the median of the ratios of each tp=1 run and the tp=N run right after it (the
runs alternate, so a pair sees the same machine; on a shared VM the second is steadier).

``--level model``: one seeded greedy workload (``num_seqs`` random prompts decoded together for ``max_tokens``
tokens each: one prefill step, then decode steps), run three ways, each ``--repeats`` times:

    tp=1 in-process   the model in this process, one thread (what ``LLM()`` runs today)
    tp=1 worker       the same model in one worker process (the pipe, no collectives)
    tp=N workers      N worker processes over torch.distributed (gloo on a CPU, NCCL on
                      CUDA), one thread each, the driver in this process

and prints the median tokens/s of each, the ratios, whether every configuration produced the
same tokens, and for tp=N the share of the step's wall time spent in collectives (rank 0's
all-reduces and the logits all-gather, waiting for the slower rank included) and in sending the
step's inputs (pickling and writing them to each rank's pipe), with the bytes per step; and
the cost of one all-reduce alone (every rank ready, ``time_all_reduce``) times the decode
steps' all-reduces, the part of the collectives' time that is the communication itself
rather than waiting for the slower rank.

The driver here builds each step's ``ModelInput`` itself (contiguous block tables, one prefill,
then decodes) and sends it to the workers; the engine's executor sends the scheduler's output
instead, and the workers build the inputs.
NOTE: a benchmark prints what it measured; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

from minipaged.distributed.shard_worker import build_model_input
from minipaged.model.input import ModelInput

BLOCK_SIZE = 16


def make_checkpoint(name: str, tmp: str) -> str:
    from minipaged.bench.hf_baselines import RANDOM_LLAMAS, make_random_llama
    from minipaged.model import COURSE_MODEL_DIR

    if name == "course":
        return str(COURSE_MODEL_DIR)
    if name in RANDOM_LLAMAS:
        return make_random_llama(name, tmp)
    return name


def step_input(chunks, blocks_per_seq: int) -> ModelInput:
    """The step's input; sequence b owns blocks b * blocks_per_seq .. (contiguous tables)."""
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(len(chunks))]
    return build_model_input(chunks, tables, BLOCK_SIZE)


def generate(forward, prompts, max_tokens: int, blocks_per_seq: int):
    """Greedy: one prefill step for all prompts, then ``max_tokens - 1`` decode steps.
    Returns (tokens per sequence, seconds)."""
    out = [[] for _ in prompts]
    t0 = time.perf_counter()
    logits = forward(step_input([(p, 0) for p in prompts], blocks_per_seq=blocks_per_seq))
    for step in range(max_tokens):
        toks = logits.argmax(-1).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        if step == max_tokens - 1:
            break
        chunks = [([o[-1]], len(p) + len(o) - 1) for p, o in zip(prompts, out)]
        logits = forward(step_input(chunks, blocks_per_seq=blocks_per_seq))
    return out, time.perf_counter() - t0


def _call_extra(st, comm: dict) -> dict:
    """What one timed generation cost in communication (``st``: the driver's ``CallStats``;
    ``comm``: rank 0's ``comm_stats``)."""
    steps = max(1, st.calls)
    return {
        "steps": st.calls,
        "comm_seconds": comm["comm_seconds"],
        "collectives_per_step": comm["num_collectives"] / steps,
        "shm_per_step": comm.get("num_shm", 0) / steps,
        "comm_path": "shared memory" if comm.get("shm") else "torch.distributed",
        "send_seconds": st.send_seconds,
        "bytes_per_step": st.bytes_sent / steps,
    }


def _matmul_share(llm, prompts, params) -> float:
    """The share of one tp=1 ``generate``'s wall time spent in the matrix multiplies (the
    linear layers and the LM head: ``aten::addmm`` / ``aten::mm`` self time, ``torch.profiler``),
    the work that tensor parallelism splits among the ranks."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t0
    matmul_us = sum(
        e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::addmm", "aten::mm")
    )
    return min(1.0, matmul_us / 1e6 / secs)


def _all_reduce_alone(grp, r: dict, args, hidden: int) -> None:
    """One all-reduce of a decode step's ``[num_seqs, hidden]`` with every rank ready, the
    group's way and torch.distributed's (gloo / NCCL), median of 3 x 100; and its floor: that
    cost times the decode steps' collectives, as a share of the generation's wall time."""
    shape = [args.num_seqs, hidden]
    for via, key in (("group", "all_reduce_decode_s"), ("torch", "all_reduce_torch_s")):
        runs = sorted(grp.call("time_all_reduce", shape, 100, via)[0] for _ in range(3))
        r[key] = runs[1]
    r["all_reduce_floor_share"] = (
        r["all_reduce_decode_s"] * r["collectives_per_step"] * (args.max_tokens - 1) / r["seconds"]
    )


def comm_level(args) -> int:
    """One all-reduce alone, gloo against the shared-memory segment, on 2 bare ranks (no model):
    a decode step's [num_seqs, hidden] and a prefill's [num_seqs * prompt_len, hidden]."""
    from minipaged.distributed import WorkerGroup

    hidden = 512 if args.model == "random-llama-20m" else args.hidden
    shapes = [[args.num_seqs, hidden], [min(args.num_seqs * args.prompt_len, 512), hidden]]
    rows = {}
    for comm in ("torch", "shm"):
        with WorkerGroup(
            args.tp, "minipaged.distributed.process_group:CommWorker", {}, args.device, comm=comm
        ) as g:
            for shape in shapes:
                iters = 200 if shape[0] <= 64 else 20
                runs = sorted(
                    g.call("time_all_reduce", shape, iters, "group")[0] for _ in range(args.repeats)
                )
                rows[(comm, tuple(shape))] = runs
    if args.json:
        print(json.dumps({f"{c} {list(s)}": r for (c, s), r in rows.items()}, indent=2))
        return 0
    print(
        f"comm level: one all-reduce of fp32, {args.tp} ranks with nothing else to do, median of {args.repeats}"
    )
    for shape in shapes:
        g = rows[("torch", tuple(shape))]
        m = rows[("shm", tuple(shape))]
        gm, mm = g[len(g) // 2], m[len(m) // 2]
        print(
            f"  {str(shape):12s} gloo {1e6 * gm:8.0f} us   shared memory {1e6 * mm:8.0f} us   "
            f"({gm / mm:.1f}x; runs gloo {', '.join(f'{1e6 * t:.0f}' for t in g)}, "
            f"shm {', '.join(f'{1e6 * t:.0f}' for t in m)})"
        )
    return 0


def engine_level(args, path: str) -> dict:
    """tp=1 vs tp=N through ``LLM`` (see the module docstring)."""
    from minipaged import LLM, SamplingParams
    from minipaged.model import load_model

    g = torch.Generator().manual_seed(0)
    meta, _ = load_model(path)
    prompts = [
        torch.randint(3, meta.vocab_size, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.num_seqs)
    ]
    hidden = meta.config.hidden_size
    del meta
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine_kw = dict(
        block_size=BLOCK_SIZE,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=512,
        device=args.device,
        attention_backend=args.attention_backend,
    )
    results, outputs = {}, {}
    sizes = (1, args.tp)
    labels = {size: f"tp={size}" + (" (in-process)" if size == 1 else " workers") for size in sizes}
    llms = {}
    try:
        for size in sizes:  # both engines up first, then their runs alternate (a drifting load
            llms[size] = LLM(path, tensor_parallel_size=size, **engine_kw)  # hits both alike)
            llms[size].generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        runs: dict[int, list] = {size: [] for size in sizes}
        for _ in range(args.repeats):
            for size in sizes:
                llm = llms[size]
                executor = llm.llm_engine.executor
                if size > 1:
                    executor.comm_stats(True)
                    executor.workers.stats = type(executor.stats)()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                secs = time.perf_counter() - t0
                extra = {}
                if size > 1:
                    st = executor.stats
                    executor.workers.stats = type(st)()
                    extra = _call_extra(st, executor.comm_stats()[0])
                runs[size].append((args.num_seqs * args.max_tokens / secs, secs, extra))
                outputs[labels[size]] = [o.outputs[0].token_ids for o in outs]
        for size in sizes:
            rs = sorted(runs[size], key=lambda r: r[0])
            tps, secs, extra = rs[len(rs) // 2]
            results[labels[size]] = {
                "tokens_per_s": tps,
                "seconds": secs,
                "all_runs": [r[0] for r in rs],
                **extra,
            }
            if size > 1:
                _all_reduce_alone(llms[size].llm_engine.executor.workers, results[labels[size]], args, hidden)
                pairs = sorted(b[0] / a[0] for a, b in zip(runs[1], runs[size]))  # each tp=1 run, then tp=N
                results[labels[size]]["paired_ratio"] = pairs[len(pairs) // 2]
        share = _matmul_share(llms[1], prompts, params)
        results[labels[1]]["matmul_share"] = share
        results[labels[args.tp]]["amdahl_estimate"] = 1.0 / (share / args.tp + 1.0 - share)
    finally:
        for llm in llms.values():
            llm.shutdown()
    return results, outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--level", default="engine", choices=["engine", "model", "comm"])
    ap.add_argument("--model", default="random-llama-20m")
    ap.add_argument("--num-seqs", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--comm",
        default="auto",
        choices=["auto", "torch"],
        help="tp=N collectives: auto (shared memory on a CPU, NCCL on CUDA) or torch (gloo / NCCL only)",
    )
    ap.add_argument("--hidden", type=int, default=512, help="--level comm with another --model")
    args = ap.parse_args(argv)
    import os

    os.environ["MINIPAGED_TP_COMM"] = args.comm  # read by WorkerGroup in this (the driver) process
    if args.level == "comm":
        return comm_level(args)

    from minipaged.distributed import WorkerGroup
    from minipaged.model import load_model

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="minipaged-tp-bench-")
    path = make_checkpoint(args.model, tmp)
    if args.level == "engine":
        results, outputs = engine_level(args, path)
        return report(args, results, outputs)
    from minipaged.kernels.selector import get_attn_backend

    backend = get_attn_backend(args.attention_backend, args.device, block_size=BLOCK_SIZE)
    ref, _ = load_model(path, device=args.device, attention_backend=backend)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, ref.vocab_size, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.num_seqs)
    ]
    blocks_per_seq = -(-(args.prompt_len + args.max_tokens) // BLOCK_SIZE)
    num_blocks = blocks_per_seq * args.num_seqs
    kwargs = dict(
        model=path, attention_backend=backend, num_blocks=num_blocks, block_size=BLOCK_SIZE, timed=True
    )
    tokens = args.num_seqs * args.max_tokens
    results, outputs = {}, {}

    def measure(label, forward, before=None, after=None):
        runs = []
        for _ in range(args.repeats):
            if before:
                before()
            out, secs = generate(forward, prompts, args.max_tokens, blocks_per_seq)
            runs.append((tokens / secs, secs, after() if after else {}))
        runs.sort(key=lambda r: r[0])
        tps, secs, extra = runs[len(runs) // 2]  # the median run
        results[label] = {"tokens_per_s": tps, "seconds": secs, "all_runs": [r[0] for r in runs], **extra}
        outputs[label] = out

    if args.device == "cpu":
        kv = ref.allocate_kv_caches(num_blocks, BLOCK_SIZE)

        @torch.inference_mode()
        def local(inp):
            return ref(inp, kv)

        measure("tp=1 in-process", local)

    for size, label in ((1, "tp=1 worker"), (args.tp, f"tp={args.tp} workers")):
        with WorkerGroup(
            size, "minipaged.distributed.shard_worker:ModelShardWorker", kwargs, args.device
        ) as grp:

            def forward(inp, grp=grp):
                return grp.call("execute_model", inp)[0]

            def before(grp=grp):
                grp.call("comm_stats", True)
                grp.stats = type(grp.stats)()

            def after(grp=grp):
                st = grp.stats  # the generation's calls only
                grp.stats = type(st)()
                comm = grp.call("comm_stats")[0]
                return _call_extra(st, comm)

            measure(label, forward, before, after)
            if size > 1:  # the all-reduce alone, every rank ready: a decode step's [B, hidden]
                _all_reduce_alone(grp, results[label], args, ref.config.hidden_size)

    return report(args, results, outputs)


def report(args, results: dict, outputs: dict) -> int:
    base = next(iter(results.values()))["tokens_per_s"]
    same = len({json.dumps(o) for o in outputs.values()}) == 1
    if args.json:
        print(json.dumps({"args": vars(args), "results": results, "outputs_equal": same}, indent=2))
        return 0
    print(
        f"{args.level} level, model {args.model}: {args.num_seqs} sequences x ({args.prompt_len} prompt + {args.max_tokens} new) "
        f"tokens, {args.device}, one thread per process, median of {args.repeats}"
    )
    for label, r in results.items():
        line = f"  {label:18s} {r['tokens_per_s']:8.1f} tok/s  ({r['tokens_per_s'] / base:.2f}x)"
        line += f"  (runs: {', '.join(f'{t:.1f}' for t in r['all_runs'])})"
        print(line)
        if "comm_seconds" in r and r["comm_seconds"]:
            print(
                f"      collectives (rank 0, waiting for the other rank included): "
                f"{100 * r['comm_seconds'] / r['seconds']:.1f}% of the wall time, "
                f"{r['collectives_per_step']:.1f} per step, "
                + (
                    "all via torch.distributed"
                    if r["comm_path"] == "torch.distributed"
                    else "all via shared memory"
                    if r["shm_per_step"] == r["collectives_per_step"]
                    else f"{r['shm_per_step']:.1f} of them via shared memory, the rest via torch.distributed"
                )
            )
        if "all_reduce_decode_s" in r:
            print(
                f"      one all-reduce of [{args.num_seqs}, hidden] alone: {1e6 * r['all_reduce_decode_s']:.0f} us "
                f"this way, {1e6 * r['all_reduce_torch_s']:.0f} us through torch.distributed; "
                f"{100 * r['all_reduce_floor_share']:.1f}% of the wall time over the decode steps"
            )
        if "matmul_share" in r:
            print(
                f"      matrix multiplies: {100 * r['matmul_share']:.0f}% of the wall time (torch.profiler, one "
                "more run); the rest each tp rank repeats whole (norms, RoPE, cache writes, module calls)"
            )
        if "amdahl_estimate" in r:
            print(
                f"      Amdahl's estimate if only the matrix multiplies split: {r['amdahl_estimate']:.2f}x; "
                f"measured {r['tokens_per_s'] / base:.2f}x (median of the paired runs: {r['paired_ratio']:.2f}x)"
            )
        if "send_seconds" in r:
            print(
                f"      sending the step's inputs: {100 * r['send_seconds'] / r['seconds']:.1f}% of the wall time "
                f"({r['bytes_per_step']:.0f} B per step per rank)"
            )
    print(f"  greedy tokens equal across configurations: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
