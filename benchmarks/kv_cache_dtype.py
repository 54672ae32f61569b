"""What a quantized KV cache costs and buys on the course model: accuracy per kv_cache_dtype, and
the same KV budget in fp32 / bf16 / fp8 / int8.

    python benchmarks/kv_cache_dtype.py [--prompts 16] [--max-tokens 32] [--stories 40]
                                        [--budget-kib 512] [--requests 32] [--backend torch] [--threads 1]

Prints, per kv_cache_dtype (the model in fp32): greedy agreement with transformers over a prompt
set (prompts: the first 8 tokens of held-out stories of the course corpus; the share of
identical tokens, position by position, and where each prompt's first divergence falls) and the
perplexity of held-out stories (``minipaged.bench.kv_quant``). Then one engine per KV format with
the same KV budget serving the course workload: blocks, sequences per step, preemptions, steps,
tokens per step (deterministic) and tokens / s (wall clock, this machine). FP8 is the storage
format of the cache; every matmul still runs in the model dtype.
"""

from __future__ import annotations

import argparse

import torch

from minipaged import LLM
from minipaged.bench.kv_quant import greedy_agreement, held_out_stories, hf_greedy, perplexity, same_budget
from minipaged.model import COURSE_MODEL_DIR, load_model

KV_DTYPES = ("auto", "fp8", "int8")
BUDGET_SETTINGS = [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("float32", "int8")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--stories", type=int, default=40, help="held-out stories for the perplexity")
    ap.add_argument("--budget-kib", type=int, default=512, help="KV budget of the same-budget run")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--backend", default="torch", help="attention backend of the accuracy runs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_model(attention_backend=args.backend)
    stories = held_out_stories(args.stories + args.prompts)
    texts = [tok(s)["input_ids"][:512] for s in stories[: args.stories]]
    prompts = [tok(s)["input_ids"][:8] for s in stories[args.stories :]]
    reference = hf_greedy(COURSE_MODEL_DIR, prompts, args.max_tokens)
    print(
        f"accuracy (course model, fp32 weights, attention_backend={args.backend!r}): {len(prompts)} prompts x "
        f"{args.max_tokens} greedy tokens vs transformers; perplexity of {len(texts)} held-out stories "
        f"({sum(map(len, texts))} tokens)"
    )
    print(
        f"{'kv_cache_dtype':>14} {'identical':>9} {'diverged':>8} {'first divergence':>24} {'perplexity':>10}"
    )
    for kd in KV_DTYPES:
        llm = LLM(kv_cache_dtype=kd, attention_backend=args.backend)
        agree = greedy_agreement(llm, prompts, reference)
        firsts = [f for f in agree["first_divergence"] if f is not None]
        where = ", ".join(map(str, sorted(firsts))) if firsts else "-"
        ppl = perplexity(model, texts, kd)
        print(
            f"{kd:>14} {agree['identical']:>9.1%} {len(firsts):>4}/{len(prompts):<3} {where:>24} {ppl:>10.4f}"
        )

    print(f"\nsame KV budget ({args.budget_kib} KiB), course workload (sharegpt lengths scaled to 256, "
          f"{args.requests} requests, ignore_eos):")  # fmt: skip
    rows = same_budget(args.budget_kib * 1024, BUDGET_SETTINGS, num_requests=args.requests)
    print(f"{'dtype':>9} {'kv':>5} {'B/token':>7} {'blocks':>6} {'peak seqs':>9} {'mean seqs':>9} "
          f"{'preempt':>7} {'steps':>5} {'tok/step':>8} {'tok/s':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['dtype']:>9} {r['kv_cache_dtype']:>5} {r['bytes_per_token']:>7} {r['num_blocks']:>6} "
              f"{r['peak_running']:>9} {r['mean_running']:>9.1f} {r['preemptions']:>7} {r['steps']:>5} "
              f"{r['tokens_per_step']:>8.1f} {r['tokens_per_s']:>7.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
