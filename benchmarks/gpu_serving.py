"""Serving on a GPU: a random ~1B Llama in bf16, minipaged against transformers, one KV budget.

    python benchmarks/gpu_serving.py --json OUT.json [--budget-s 220]   # on a CUDA GPU
    python benchmarks/gpu_serving.py --json OUT.json --dry-run          # tiny model, CPU, interpreter

Step (c) of ``benchmarks/gpu_check.sh``; the GPU twin of ``benchmarks/serving.py``, built on
the same harness (``minipaged.bench.serving``: workload, serving loop metrics; and
``minipaged.bench.hf_baselines``), which runs only fp32 on a CPU.

What it runs
    A Llama-shaped model built from a config with random weights (no download): TinyLlama's
    shape, 22 layers, hidden 2048, 32 heads / 4 KV heads of 64, vocab 32000, 1.1B parameters,
    bf16. 256 ShareGPT-like requests (lengths scaled to a 512-token context, so that the slow
    static baselines finish in the GPU window), all at t = 0, greedy, EOS ignored; one KV
    budget for every system (``num_blocks`` x 16 slots, a quarter of the workload's tokens):

    (a) minipaged continuous batching + paged KV, Triton attention kernels
    (b) minipaged static batches + contiguous reservation, Triton attention kernels
    (d) transformers' continuous batching (where the installed transformers has it)
    (c) transformers ``generate`` in left-padded static batches

    in that order, each after a two-request warm-up (compiles, cuBLAS handles). Each system
    gets a share of ``--budget-s``; a system still running when its share is spent stops and
    reports its throughput so far, marked ``partial`` (static batches are independent, so
    the batches done are a fair sample; (d) cannot stop early and reports a timeout instead).

Output (JSON, rewritten after each system)
    ``{"model", "workload", "kv_cache", "systems": {name: metrics}, "ratios": {"a/b": ...},
    "agreement": {"a=b": {"requests_equal", "token_prefix_share", "compared"}}, ...}``.
    Metrics as in ``minipaged.bench.serving`` (tokens/s, TTFT, TPOT, steps; for minipaged the
    step split and ``overhead_ms_per_step``, the time outside forward and sampler).
    Agreement instead of equality: bf16 greedy decoding of a random model meets near-ties,
    and batch shapes change the rounding, so outputs may part; the share is what is reported.

Dry run
    the same code on the CPU: a 2-layer random Llama in bf16, 4 requests (context 64), a KV
    budget that holds them all, no warm-up, the Triton interpreter.

Failure mode
    a system that raises is reported ``{"unavailable": reason}``; the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
import time

import torch

if not torch.cuda.is_available():  # before triton is imported through the package
    os.environ.setdefault("TRITON_INTERPRET", "1")

# TinyLlama-1.1B's shape (GQA 32/4, head_dim 64); 22 x 44M + 2 x 65.5M embeddings = 1.10B
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=2048,
)
LLAMA_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)
ORDER = ("continuous+paged", "static+contiguous", "hf-continuous-batching", "hf-generate-static")
LETTER = {
    "continuous+paged": "a",
    "static+contiguous": "b",
    "hf-generate-static": "c",
    "hf-continuous-batching": "d",
}
SHARE = {
    "continuous+paged": 0.2,
    "static+contiguous": 0.25,
    "hf-continuous-batching": 0.2,
    "hf-generate-static": 0.35,
}  # of the budget left after the model is built


def import_harness():
    """The serving harness and the transformers baselines, wherever they live now.

    NOTE: the one place this script imports them; ``minipaged.bench.serving`` may move.
    Returns (bench module, hf_baselines module); either may be None, with the reason."""
    bench = hf = None
    errors = []
    for name in ("minipaged.bench.serving", "minipaged.engine.bench"):
        try:
            bench = importlib.import_module(name)
            if all(
                hasattr(bench, f)
                for f in ("workload_prompts", "_minipaged_metrics", "_common_metrics", "ServeResult")
            ):
                break
            bench = None
        except ImportError as e:
            errors.append(f"{name}: {e}")
    for name in ("minipaged.bench.hf_baselines", "minipaged.engine.hf_baselines"):
        try:
            hf = importlib.import_module(name)
            break
        except ImportError as e:
            errors.append(f"{name}: {e}")
    return bench, hf, errors


# --------------------------------------------------------------------------- the model


def build_model(config_kw: dict, dtype: torch.dtype, device: torch.device, out_dir: str, seed: int):
    """A seeded random Llama checkpoint in ``dtype`` written to ``out_dir``; returns the
    transformers model loaded back from it (``from_pretrained``, as a user would) on ``device``.

    NOTE: loading back instead of keeping the built model: ``model.to(bf16)`` would also round
    the rotary ``inv_freq`` buffer to bf16, which ``from_pretrained`` (and minipaged) keep in fp32.
    """
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **config_kw,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the GPU: seconds, not a minute on the CPU
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(out_dir)
    del model
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(out_dir, **{key: dtype}).to(device).eval()


class OnDevice:
    """The transformers model, whose ``generate`` moves CPU inputs to the model's device.

    ``hf_generate_static`` builds its padded batch on the CPU (it was written for a CPU)."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def generate(self, input_ids, attention_mask, **kwargs):
        dev = self._model.device
        return self._model.generate(
            input_ids=input_ids.to(dev), attention_mask=attention_mask.to(dev), **kwargs
        )


# --------------------------------------------------------------------------- one system


def serve_minipaged(bench, engine, prompts, output_lens, deadline):
    """Serve on a minipaged engine until done or ``deadline``: (ServeResult-like dict, outputs, partial)."""
    from minipaged import SamplingParams

    for i, (p, o) in enumerate(zip(prompts, output_lens)):
        engine.add_request(
            str(i), p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True), stream=True
        )
    outs, first, last, seen = {}, {}, {}, {}
    pending = {str(i) for i in range(len(prompts))}
    t0, c0 = time.perf_counter(), time.process_time()
    partial = False
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            partial = True
            break
        done = engine.step()
        now = time.perf_counter() - t0
        for o in done:
            if o.request_id in pending and (o.finished or o.outputs[0].token_ids):
                first[o.request_id] = now
                pending.discard(o.request_id)
            seen[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                outs[o.request_id] = o
                last[o.request_id] = now
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    in_flight = sum(n for r, n in seen.items() if r not in outs)  # tokens of unfinished requests
    ids = [str(i) for i in range(len(prompts)) if str(i) in outs]
    tokens = {int(r): list(outs[r].outputs[0].token_ids) for r in ids}
    res = bench.ServeResult(
        token_ids=[tokens[int(r)] for r in ids],
        wall_s=wall,
        cpu_s=cpu,
        first_token_s=[first[r] for r in ids],
        last_token_s=[last[r] for r in ids],
        steps=len(engine.trace),
    )
    metrics = bench._common_metrics(res, [output_lens[int(r)] for r in ids]) if ids else {}
    metrics.update(bench._minipaged_metrics(engine, outs) if len(engine.trace) else {})
    generated = sum(len(t) for t in tokens.values()) + in_flight
    metrics.update(
        output_tokens=generated,
        wall_s=round(wall, 3),
        tokens_per_s=round(generated / wall, 1) if generated else None,
        requests_finished=len(ids),
    )
    return metrics, tokens, partial


def serve_hf_static(hf, model, prompts, output_lens, slots, max_num_seqs, deadline):
    """(c) batch by batch (the same batches as ``hf_generate_static``), until ``deadline``."""
    batches = hf.static_batches([(len(p), o) for p, o in zip(prompts, output_lens)], slots, max_num_seqs)
    tokens, wall, steps, done_batches, partial = {}, 0.0, 0, 0, False
    for batch in batches:
        if time.perf_counter() > deadline:
            partial = True
            break
        res = hf.hf_generate_static(
            model, [prompts[i] for i in batch], [output_lens[i] for i in batch], slots, max_num_seqs
        )
        for i, t in zip(batch, res.token_ids):
            tokens[i] = t
        wall += res.wall_s
        steps += res.steps
        done_batches += 1
    generated = sum(len(t) for t in tokens.values())
    metrics = {
        "output_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1) if wall else None,
        "steps": steps,
        "batches": len(batches),
        "batches_done": done_batches,
        "requests_finished": len(tokens),
        "batch_sizes": [len(b) for b in batches],
    }
    return metrics, tokens, partial


def serve_hf_cb(
    hf,
    model,
    prompts,
    output_lens,
    *,
    block_size,
    num_blocks,
    max_num_batched_tokens,
    max_num_seqs,
    seed,
    deadline,
):
    res = hf.hf_continuous_batching(
        model,
        prompts,
        output_lens,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        seed=seed,
        timeout_s=max(1.0, deadline - time.perf_counter()),
    )
    n_out = sum(len(t) for t in res.token_ids)
    metrics = {
        "output_tokens": n_out,
        "wall_s": round(res.wall_s, 3),
        "tokens_per_s": round(n_out / res.wall_s, 1) if n_out else None,
        "steps": res.steps,
        "requests_finished": len(res.token_ids),
        **res.info,
    }
    return metrics, dict(enumerate(res.token_ids)), False


def agreement(x: dict, y: dict) -> dict:
    """How far two systems' greedy outputs agree, over the requests both finished."""
    common = sorted(set(x) & set(y))
    if not common:
        return {"compared": 0, "requests_equal": None, "token_prefix_share": None}
    equal = sum(x[i] == y[i] for i in common)
    prefix = []
    for i in common:
        a, b = x[i], y[i]
        n = next((k for k, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b)))
        prefix.append(n / max(1, max(len(a), len(b))))
    return {
        "compared": len(common),
        "requests_equal": round(equal / len(common), 3),
        "token_prefix_share": round(sum(prefix) / len(prefix), 3),
    }


# --------------------------------------------------------------------------- the run


def run(args) -> dict:
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if args.dry_run:
        # bf16 as on the GPU (the interpreter computes bf16 tiles in fp32, see _compute_dtype)
        cfg_kw, dtype_name, n_req, ctx = LLAMA_TINY, "bfloat16", min(args.num_requests, 4), 64
        max_num_seqs, max_batched, kv_fraction = 8, 128, 1.0  # all fits: few interpreted steps
    else:
        cfg_kw, dtype_name, n_req, ctx = LLAMA_1B, "bfloat16", args.num_requests, args.context
        max_num_seqs, max_batched, kv_fraction = args.max_num_seqs, args.max_num_batched_tokens, 0.25
    dtype = getattr(torch, dtype_name)
    report = {
        "step": "serving",
        "mode": "gpu" if device.type == "cuda" else "dry-run",
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "budget_s": args.budget_s,
        "systems": {},
        "ratios": {},
        "agreement": {},
    }

    def save():
        report["seconds"] = round(time.perf_counter() - start, 1)
        write_json(args.json, report)

    bench, hf, errors = import_harness()
    if bench is None:
        report["error"] = "serving harness not found: " + "; ".join(errors)
        save()
        return report

    from transformers.utils import logging as hf_logging

    from minipaged.config import EngineConfig
    from minipaged.core.kv.block import cdiv
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.model import load_model

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="minipaged-gpu-") as tmp:
        hf_model = build_model(cfg_kw, dtype, device, tmp, args.seed)
        model, _ = load_model(tmp, dtype=dtype_name, device=str(device), attention_backend="triton")
        num_params = sum(p.numel() for p in model.parameters())
        report["model"] = {
            "config": cfg_kw,
            "params_m": round(num_params / 1e6, 1),
            "dtype": dtype_name,
            "attention_backend": "triton",
            "build_s": round(time.perf_counter() - start, 1),
        }
        lengths, prompts = bench.workload_prompts("sharegpt", n_req, args.seed, ctx, cfg_kw["vocab_size"])
        output_lens = [o for _, o in lengths]
        block_size = 16
        demand = [cdiv(p + o - 1, block_size) for p, o in lengths]
        num_blocks = max(max(demand), int(sum(demand) * kv_fraction))
        report["workload"] = {
            "name": "sharegpt",
            "num_requests": n_req,
            "seed": args.seed,
            "max_model_len": ctx,
            "mean_prompt_len": round(sum(p for p, _ in lengths) / n_req, 1),
            "mean_output_len": round(sum(output_lens) / n_req, 1),
            "output_tokens": sum(output_lens),
        }
        report["kv_cache"] = {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "token_slots": num_blocks * block_size,
            "bytes": num_blocks * model.kv_cache_bytes_per_block(block_size),
        }
        report["max_num_seqs"], report["max_num_batched_tokens"] = max_num_seqs, max_batched
        save()

        def engine_for(scheduling, blocks=num_blocks):
            cfg = EngineConfig(
                model=tmp,
                block_size=block_size,
                num_blocks=blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched,
                device=str(device),
                dtype=dtype_name,
                attention_backend="triton",
                seed=args.seed,
                scheduling=scheduling,
            )
            return LLMEngine(cfg, model=model, tokenizer=None)

        hf_dev = OnDevice(hf_model)

        def run_system(name, p, o, deadline):
            if name in ("continuous+paged", "static+contiguous"):
                engine = engine_for("continuous" if name == "continuous+paged" else "static")
                return serve_minipaged(bench, engine, p, o, deadline)
            if hf is None:
                raise RuntimeError("minipaged's transformers baselines could not be imported")
            if name == "hf-generate-static":
                return serve_hf_static(hf, hf_dev, p, o, num_blocks * block_size, max_num_seqs, deadline)
            return serve_hf_cb(
                hf,
                hf_model,
                p,
                o,
                block_size=block_size,
                num_blocks=num_blocks,
                max_num_batched_tokens=max_batched,
                max_num_seqs=max_num_seqs,
                seed=args.seed,
                deadline=deadline,
            )

        tokens = {}
        left = args.budget_s - (time.perf_counter() - start)
        budget = {n: SHARE[n] * left for n in ORDER}
        carry = 0.0  # what an early finisher leaves to the systems after it
        for name in ORDER:
            t_sys = time.perf_counter()
            share = budget[name] + carry
            try:
                if not args.dry_run:  # warm-up: compiles, cuBLAS handles (the dry run has nothing to warm)
                    run_system(name, [p[:8] for p in prompts[:2]], [2, 2], time.perf_counter() + 120)
                metrics, toks, partial = run_system(name, prompts, output_lens, t_sys + share)
                tokens[name] = toks
                report["systems"][name] = {"label": LETTER[name], **metrics, "partial": partial}
            except Exception as e:  # noqa: BLE001 - reported, the next system still runs
                report["systems"][name] = {
                    "label": LETTER[name],
                    "unavailable": f"{type(e).__name__}: {e}"[:400],
                }
            carry = max(0.0, share - (time.perf_counter() - t_sys))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            summarize(report, tokens)
            save()
    return report


def summarize(report: dict, tokens: dict) -> None:
    systems = report["systems"]
    a = systems.get("continuous+paged", {})
    report["ratios"] = {
        f"a/{m['label']}": round(a["tokens_per_s"] / m["tokens_per_s"], 2)
        for name, m in systems.items()
        if name != "continuous+paged" and a.get("tokens_per_s") and m.get("tokens_per_s")
    }
    names = [n for n in ORDER if n in tokens]
    report["agreement"] = {
        f"{LETTER[x]}={LETTER[y]}": agreement(tokens[x], tokens[y])
        for i, x in enumerate(names)
        for y in names[i + 1 :]
    }


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(f"{path}.tmp", path)


def format_report(r: dict) -> str:
    lines = []
    if "model" in r:
        w, kv = r["workload"], r["kv_cache"]
        lines.append(
            f"model: random Llama {r['model']['params_m']}M params, {r['model']['dtype']}, on {r['device']}; "
            f"{w['num_requests']} ShareGPT-like requests (context {w['max_model_len']}, mean prompt "
            f"{w['mean_prompt_len']}, output {w['mean_output_len']}); KV {kv['token_slots']} token slots"
        )
    for name, m in r["systems"].items():
        if "unavailable" in m:
            lines.append(f"  ({m['label']}) {name:<24} unavailable: {m['unavailable']}")
        else:
            ovh = m.get("overhead_ms_per_step")
            lines.append(
                f"  ({m['label']}) {name:<24} {m['tokens_per_s'] or 0:>9.1f} tok/s  steps {m.get('steps')}"
                + (f"  overhead {ovh:.2f} ms/step" if ovh is not None else "")
                + ("  PARTIAL (time share spent)" if m.get("partial") else "")
            )
    if r.get("ratios"):
        lines.append("  ratios (tokens/s): " + ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items()))
    if r.get("agreement"):
        lines.append(
            "  greedy agreement (requests equal, token prefix share): "
            + ", ".join(
                f"{k} {v['requests_equal']}/{v['token_prefix_share']} of {v['compared']}"
                for k, v in r["agreement"].items()
            )
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--dry-run", action="store_true", help="tiny random Llama on the CPU, Triton interpreter")
    p.add_argument("--budget-s", type=float, default=220.0, help="seconds for the whole step")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="ShareGPT lengths scaled to this context")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        print("no CUDA GPU: run with --dry-run")
        return 2
    random.seed(args.seed)
    report = run(args)
    print(format_report(report))
    if "error" in report:
        print(report["error"])
        return 1
    bad = [
        n for n in ("continuous+paged", "static+contiguous") if "unavailable" in report["systems"].get(n, {})
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
