"""What a quantized KV cache costs and buys, measured on the course model.

Read by ``benchmarks/kv_cache_dtype.py`` (which prints it) and chapter 01 (which shows it).

Inputs / outputs
    ``held_out_stories(n)``: ``n`` stories of the course model's own corpus generator
    (``scripts/train_course_model.py``) drawn with a seed the training never used.
    ``perplexity(model, token_lists, kv_cache_dtype)``: exp of the mean next-token NLL, each text
    one prefill through a paged cache of that dtype (the prefill reads its own keys back from the
    cache, so the cache's rounding is in every logit after the first).
    ``greedy_agreement(llm, prompts, reference)``: the share of generated tokens equal to the
    reference's, position by position, and where each prompt's first divergence falls.
    ``hf_greedy(model_dir, prompts, max_tokens)``: the reference, transformers' greedy tokens.
    ``same_budget(kv_cache_memory, settings, ...)``: one engine per (dtype, kv_cache_dtype) with the
    same KV budget, serving the course workload: blocks, peak and mean running sequences,
    preemptions, steps, generated tokens per step (deterministic) and wall-clock tokens / s.

Invariants
    Greedy decoding, ``ignore_eos`` with fixed output lengths in ``same_budget``, so the
    schedule (and every count but the wall clock) depends only on the number of blocks.

Failure mode
    ``ValueError`` from the engine for a bad dtype; ``FileNotFoundError`` if the repository's
    ``scripts/`` folder (the corpus generator) is not there, e.g. in an installed wheel.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import torch

HELD_OUT_SEED = 12345  # the course model was trained on stories drawn with seed 0
TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_course_model.py"


def held_out_stories(n: int, seed: int = HELD_OUT_SEED) -> list[str]:
    """``n`` stories from the course corpus generator, with a seed the training did not use."""
    if not TRAIN_SCRIPT.is_file():
        raise FileNotFoundError(f"the corpus generator {TRAIN_SCRIPT} is not there")
    spec = importlib.util.spec_from_file_location("train_course_model", TRAIN_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_corpus(n, seed)


def perplexity(
    model, token_lists: list[list[int]], kv_cache_dtype: str = "auto", block_size: int = 16
) -> float:
    """exp(mean NLL of every next token), each list one prefill through a fresh paged cache."""
    from minipaged.model import ModelInput

    nll, count = 0.0, 0
    dev = model.device
    for ids in token_lists:
        n = len(ids)
        nb = -(-n // block_size)
        caches = model.allocate_kv_caches(nb, block_size, kv_cache_dtype)
        i32 = dict(dtype=torch.int32, device=dev)
        inp = ModelInput(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.arange(n, device=dev),
            slot_mapping=torch.arange(n, device=dev),
            block_tables=torch.arange(nb, **i32)[None],
            seq_lens=torch.tensor([n], **i32),
            cu_seqlens_q=torch.tensor([0, n], **i32),
            logits_indices=torch.arange(n, device=dev),  # every position's logits, not only the last
            max_query_len=n,
            max_seq_len=n,
        )
        with torch.no_grad():
            logits = model(inp, caches)  # [n, vocab] fp32
        target = torch.tensor(ids[1:], device=dev)
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum"))
        count += n - 1
    return math.exp(nll / count)


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, fp32, ``max_tokens`` tokens past any EOS
    (a plain argmax loop over the full sequence, no KV cache at all): the reference."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # NOTE: no progress bar in a notebook's output
    try:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    out = []
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = hf(torch.tensor([ids]), use_cache=False).logits[0, -1]  # [vocab]
                ids.append(int(logits.argmax()))
        out.append(ids[len(p) :])
    return out


def greedy_agreement(llm, prompts: list[list[int]], reference: list[list[int]]) -> dict:
    """Greedy tokens of ``llm`` against ``reference``: {"identical": share of equal tokens, position by
    position; "first_divergence": per prompt, the index of the first differing token (None: none)}."""
    from minipaged import SamplingParams

    max_tokens = max(len(r) for r in reference)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    same = total = 0
    first = []
    for o, ref in zip(outs, reference):
        got = o.outputs[0].token_ids[: len(ref)]
        eq = [a == b for a, b in zip(got, ref)]
        same += sum(eq)
        total += len(ref)
        first.append(next((i for i, e in enumerate(eq) if not e), None))
    return {"identical": same / total, "first_divergence": first}


def same_budget(
    kv_cache_memory: int,
    settings: list[tuple[str, str]],
    num_requests: int = 32,
    max_model_len: int = 256,
    block_size: int = 16,
    seed: int = 0,
    attention_backend: str = "torch",
) -> list[dict]:
    """For each (dtype, kv_cache_dtype): serve the course workload (``bench.serving.scaled_workload``:
    sharegpt lengths scaled to ``max_model_len``) with ``kv_cache_memory`` bytes of KV cache."""
    from minipaged import LLM, SamplingParams
    from minipaged.bench.serving import workload_prompts

    rows = []
    for dtype, kv_cache_dtype in settings:
        llm = LLM(
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory=kv_cache_memory,
            block_size=block_size,
            max_num_seqs=256,
            max_num_batched_tokens=1024,
            max_model_len=max_model_len,
            attention_backend=attention_backend,
            seed=seed,
        )
        engine = llm.llm_engine
        lengths, prompts = workload_prompts(
            "sharegpt", num_requests, seed, max_model_len, engine.model.vocab_size
        )
        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in lengths]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = llm.trace.steps
        running = [len(s.scheduled) for s in steps]  # sequences in each step's batch
        generated = sum(o for _, o in lengths)
        rows.append(
            {
                "dtype": dtype,
                "kv_cache_dtype": kv_cache_dtype,
                "bytes_per_token": engine.bytes_per_block // block_size,
                "num_blocks": engine.num_blocks,
                "tokens_in_budget": engine.num_blocks * block_size,
                "peak_running": max(running),
                "mean_running": sum(running) / len(running),
                "preemptions": sum(len(s.preempted_ids) for s in steps),
                "steps": len(steps),
                "tokens_per_step": generated / len(steps),
                "tokens_per_s": generated / wall,
            }
        )
    return rows
