"""Speculative decoding on the course model: accepted tokens per step and tokens/s, with and
without speculation, at batch 1 and 32 (issue 27).

    python benchmarks/spec_decode.py [--batch 1 32] [--k 4] [--max-tokens 48] [--threads 1]
                                     [--draft-layers 1] [--repeats 5] [--json PATH]

For each batch size B, one run of the target without speculation makes the reference greedy
outputs (and its tokens/s). Then, per method:

- acceptance, replayed offline (``minipaged.spec_decode.analysis.replay_greedy``): greedy
  speculative decoding yields exactly the reference tokens, so the drafts each step would
  propose (n-gram prompt lookup; the draft model = the course model's first
  ``--draft-layers`` layers, ``write_layer_skip_draft``) are compared with the reference:
  acceptance rate and mean accepted length (tokens per verification step);
- the cost of one step, measured here: the target on B sequences x 1 token (a decode) and
  on B x (1 + k) tokens (a verification; a step whose sequences propose fewer drafts on
  average is costed linearly between the two), and the draft's passes (one chunk + k - 1
  decodes); n-gram lookup timed too;
- tokens/s with speculation = B x tokens per step / (verification + drafting), next to the
  measured decode-only tokens/s (the projection from one step's costs);
- end to end: ``LLM(speculative_config=...)`` on the same prompts, its tokens/s (wall,
  prefill included) beside the run without, its acceptance from the engine's
  ``spec_decode_stats``, and whether its outputs equal the reference token for token.

Numbers are from one process on this machine (timings are medians of ``--repeats``). They say
when speculation loses: at batch 1 the forward is weight-bound and 1 + k tokens cost about
what 1 does; at batch 32 on a CPU the matmuls are compute-bound, 1 + k tokens cost nearly
1 + k times more, and only a high acceptance pays for the extra rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from minipaged import LLM, SamplingParams
from minipaged.model import COURSE_MODEL_DIR, load_model
from minipaged.spec_decode import (
    NgramProposer,
    build_model_input,
    replay_greedy,
    teacher_forced_proposer,
    write_layer_skip_draft,
)

NAMES = ["Max", "Lily", "Tom", "Sue", "Ben", "Mia", "Sam", "Zoe"]
OPENINGS = ["Once upon a time, {} and {}", "One day, {} met {} at the park.", "{} gave {} a red ball."]


def prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        a, b = NAMES[i % len(NAMES)], NAMES[(i // len(NAMES) + i + 1) % len(NAMES)]
        out.append(OPENINGS[i % len(OPENINGS)].format(a, b))
    return out


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_time(model, batch: int, context: int, num_new: int, repeats: int, block_size: int = 16) -> float:
    """Seconds of one forward of ``batch`` sequences, each ``num_new`` tokens after ``context``."""
    per_seq = -(-(context + num_new) // block_size)
    kv = model.allocate_kv_caches(batch * per_seq, block_size)
    g = torch.Generator().manual_seed(0)
    items = [
        (
            list(range(b * per_seq, (b + 1) * per_seq)),
            0,
            torch.randint(0, model.vocab_size, (context,), generator=g).tolist(),
        )
        for b in range(batch)
    ]
    with torch.inference_mode():
        model.forward(build_model_input(items, block_size), kv)  # fill the context once
        tail = [(blocks, context, [1] * num_new) for blocks, _, _ in items]
        inp = build_model_input(tail, block_size)
        if num_new > 1:  # a verification reads every row's logits
            inp.logits_indices = torch.arange(batch * num_new)

        def forward():
            inp.attn_backend = None  # NOTE: a real step builds its attention plan anew
            model.forward(inp, kv)

        return median_time(forward, repeats)


def acceptance(steps: list[tuple[int, int]]) -> tuple[float, float, float]:
    """Of replayed steps: (acceptance rate, mean acceptance length over the steps that had
    drafts: 1 + accepted, vLLM's metric, tokens per decode step over all of them)."""
    drafted = [(d, a) for d, a in steps if d > 0]
    nd = sum(d for d, _ in drafted)
    na = sum(a for _, a in drafted)
    rate = na / nd if nd else 0.0
    mean_len = 1.0 + na / len(drafted) if drafted else 1.0
    tokens_per_step = sum(a + 1 for _, a in steps) / len(steps) if steps else 1.0
    return rate, mean_len, tokens_per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--prompt-lookup", type=int, nargs=2, default=[1, 3], metavar=("MIN", "MAX"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the numbers to this file (chapter 10 reads it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = args.k
    target, _ = load_model(None)
    draft_dir = write_layer_skip_draft(COURSE_MODEL_DIR, tempfile.mkdtemp(prefix="draft_"), args.draft_layers)
    draft, _ = load_model(draft_dir)
    lo, hi = args.prompt_lookup
    specs = {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": lo,
            "prompt_lookup_max": hi,
        },
        "draft_model": {"method": "draft_model", "num_speculative_tokens": k, "model": draft_dir},
    }
    spec_llms = {name: LLM(seed=0, speculative_config=spec) for name, spec in specs.items()}
    ngram = NgramProposer(args.prompt_lookup[0], args.prompt_lookup[1], k)
    llm = LLM(seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {
        "k": k,
        "max_tokens": args.max_tokens,
        "draft_layers": args.draft_layers,
        "threads": args.threads,
        "prompt_lookup": list(args.prompt_lookup),
        "batches": {},
    }
    print(
        f"course model ({target.num_layers} layers), draft = its first {args.draft_layers} layer(s); "
        f"k={k}, max_tokens={args.max_tokens}, threads={args.threads}"
    )
    for B in args.batch:
        t = time.perf_counter()
        outs = llm.generate(prompts(B), params, use_tqdm=False)
        wall = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        ctx = round(statistics.mean(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) / 2 for o in outs))
        t_decode = step_time(target, B, ctx, 1, args.repeats)
        t_verify = step_time(target, B, ctx, 1 + k, args.repeats)
        t_draft = step_time(draft, B, ctx, 1 + k, args.repeats) + (k - 1) * step_time(
            draft, B, ctx, 1, args.repeats
        )
        ctxs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        t_ngram = median_time(lambda: [ngram.propose(c) for c in ctxs], args.repeats)
        plain = B / t_decode
        print(
            f"\nbatch {B}: end-to-end without speculation {n_out / wall:.1f} tokens/s "
            f"({n_out} tokens, {wall:.2f} s, prefill included)"
        )
        print(
            f"  one step at context {ctx}: decode (B x 1) {t_decode * 1e3:.2f} ms, verify (B x {1 + k}) "
            f"{t_verify * 1e3:.2f} ms = {t_verify / t_decode:.2f}x; draft passes {t_draft * 1e3:.2f} ms; "
            f"n-gram lookup {t_ngram * 1e3:.2f} ms"
        )
        print(f"  decode only: {plain:.1f} tokens/s")
        row = results["batches"][str(B)] = {
            "end_to_end_tokens_per_s": n_out / wall,
            "context": ctx,
            "decode_ms": t_decode * 1e3,
            "verify_ms": t_verify * 1e3,
            "draft_ms": t_draft * 1e3,
            "ngram_ms": t_ngram * 1e3,
            "decode_only_tokens_per_s": plain,
            "methods": {},
        }
        for name, propose_for, t_extra in (
            ("ngram", lambda o: ngram.propose, t_ngram),
            (
                "draft_model",
                lambda o: teacher_forced_proposer(draft, o.prompt_token_ids, o.outputs[0].token_ids),
                t_draft,
            ),
        ):
            steps = [
                s
                for o in outs
                for s in replay_greedy(o.prompt_token_ids, o.outputs[0].token_ids, propose_for(o), k)
            ]
            rate, mean_len, per_step = acceptance(steps)
            # NOTE: rows per sequence are 1 + its drafts: the verification's cost is taken
            # between the decode's (no drafts) and the full B x (1 + k) one, linearly
            mean_drafts = statistics.mean(d for d, _ in steps)
            t_step = t_decode + (t_verify - t_decode) * mean_drafts / k
            spec = B * per_step / (t_step + t_extra)
            print(
                f"  {name:11s}: acceptance {rate:.2f}, mean acceptance length {mean_len:.2f}, accepted tokens "
                f"per step {per_step - 1:.2f}; projected {spec:.1f} tokens/s = {spec / plain:.2f}x decode only"
            )
            row["methods"][name] = {
                "acceptance_rate": rate,
                "mean_acceptance_length": mean_len,
                "accepted_tokens_per_step": per_step - 1,
                "tokens_per_s": spec,
                "speedup": spec / plain,
            }
        for name, sllm in spec_llms.items():
            engine = sllm.llm_engine
            engine.spec_decode_stats.__init__()  # this batch's numbers only
            t = time.perf_counter()
            souts = sllm.generate(prompts(B), params, use_tqdm=False)
            swall = time.perf_counter() - t
            st = engine.spec_decode_stats
            same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, souts))
            rate = sum(len(o.outputs[0].token_ids) for o in souts) / swall
            print(
                f"  end to end, {name:11s}: {rate:.1f} tokens/s = {rate / (n_out / wall):.2f}x without; "
                f"acceptance {st.acceptance_rate:.2f}, mean acceptance length {st.mean_acceptance_length:.2f}; "
                f"outputs equal: {same}"
            )
            row["methods"][name].update(
                end_to_end_tokens_per_s=rate,
                end_to_end_speedup=rate / (n_out / wall),
                end_to_end_acceptance_rate=st.acceptance_rate,
                end_to_end_mean_acceptance_length=st.mean_acceptance_length,
                outputs_equal=same,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
