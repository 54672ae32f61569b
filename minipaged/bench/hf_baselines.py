"""The transformers baselines of the serving benchmark (``minipaged bench``), same workload, same KV budget.

Mirrors the ``hf`` backend of vLLM ``benchmarks/benchmark_throughput.py`` (``run_hf``: padded
static batches of ``model.generate``), and adds transformers' own continuous batching
(``transformers/generation/continuous_batching/``: ``ContinuousBatchingManager`` over a
``PagedAttentionCache``).

Systems
    (c) ``hf_generate_static``: the requests in arrival order are cut into batches greedily,
        a batch growing while ``len(batch) * (max prompt + max new - 1) <= kv_token_slots``
        and ``len(batch) <= max_num_seqs``: a left-padded batch keeps ``max prompt + max
        new - 1`` cached tokens per row at its end (the newest token is never cached), so a
        batch fits the same number of KV token slots as minipaged's pool. Each batch is one
        greedy ``model.generate(max_new_tokens=max new of the batch)``; row i keeps its
        first ``o_i`` tokens (the rest is the waste of static batching, computed and thrown
        away). EOS is switched off (``eos_token_id=None``) to match ``ignore_eos``.
    (d) ``hf_continuous_batching``: one ``ContinuousBatchingManager`` with
        ``page_size = block_size``, ``num_blocks`` (transformers rounds its cache up to
        whole sectors: the real slot count is reported), ``max_batch_tokens =
        max_num_batched_tokens``, ``max_requests_per_batch = max_num_seqs``, no prefix
        sharing, no CUDA graphs; every request added with its own ``max_new_tokens`` and
        ``eos_token_id=-1`` (transformers' "no EOS").

Inputs
    a transformers causal LM (eval, fp32), the prompts (token ids) and the output length
    of each request, and the KV budget.
Outputs
    ``ServeResult`` (``minipaged.bench.serving``): per request the generated token ids, the
    time of its first token and of its last token from the start of serving; wall and
    process-CPU seconds, steps (forward passes), and system-specific ``info``.

Invariants
    each request gets exactly ``o_i`` tokens; the batch of (c) never holds more KV slots
    than ``kv_token_slots``; greedy decoding everywhere, so outputs can be compared token
    for token with minipaged's (padding changes the shapes of the matmuls, so fp32 rounding
    can flip a near-tie: the benchmark reports which requests match, not only whether all do).

Failure mode
    a request longer than ``kv_token_slots`` alone raises ``ValueError``; (d) raises
    whatever transformers raises (the benchmark catches it and reports the system as
    "unavailable: <reason>").

Also here: ``make_random_llama`` writes a seeded random Llama checkpoint ("random-llama-20m",
about 20M parameters, or "tiny-llama" for tests) that both minipaged and transformers load.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from minipaged.bench.result import ServeResult

# name -> LlamaConfig keyword arguments (GQA, tied embeddings, 512-token context)
RANDOM_LLAMAS = {
    # 6 x (0.66M attention + 2.36M MLP) + 2.1M embedding = 20.2M parameters
    "random-llama-20m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=4096,
    ),
    "tiny-llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
    ),
}


def make_random_llama(name: str, out_dir: str, seed: int = 0) -> str:
    """Write a seeded random Llama checkpoint ``name`` (a key of ``RANDOM_LLAMAS``) to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in RANDOM_LLAMAS:
        raise ValueError(f"name must be one of {sorted(RANDOM_LLAMAS)}, got {name!r}")
    config = LlamaConfig(
        **RANDOM_LLAMAS[name],
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    _quiet(model.save_pretrained, out_dir)
    return out_dir


def load_hf_model(path: str):
    """The transformers model of ``path`` in fp32 eval mode, progress bars off."""
    from transformers import AutoModelForCausalLM

    return _quiet(AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32).eval()


def _quiet(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with transformers' progress bars off."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return fn(*args, **kwargs)
    finally:
        if was:
            hf_logging.enable_progress_bar()


def static_batches(lengths: list[tuple[int, int]], kv_token_slots: int, max_num_seqs: int) -> list[list[int]]:
    """Request indices cut greedily (arrival order) into padded batches that fit ``kv_token_slots``."""
    batches: list[list[int]] = []
    cur: list[int] = []
    max_p = max_o = 0
    for i, (p, o) in enumerate(lengths):
        if p + o - 1 > kv_token_slots:
            raise ValueError(
                f"request {i} needs {p + o - 1} KV slots, more than kv_token_slots={kv_token_slots}"
            )
        mp, mo = max(max_p, p), max(max_o, o)
        if cur and ((len(cur) + 1) * (mp + mo - 1) > kv_token_slots or len(cur) >= max_num_seqs):
            batches.append(cur)
            cur, mp, mo = [], p, o
        cur.append(i)
        max_p, max_o = mp, mo
    if cur:
        batches.append(cur)
    return batches


class TokenClock(StoppingCriteria):
    """Stops nothing; notes the time at which each new token of a ``generate`` batch exists."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # [B]


def hf_generate_static(
    hf_model, prompts: list[list[int]], output_lens: list[int], kv_token_slots: int, max_num_seqs: int
) -> ServeResult:
    """(c): left-padded greedy ``generate`` batches that fit ``kv_token_slots`` (see the module docstring)."""
    pad = hf_model.config.pad_token_id if hf_model.config.pad_token_id is not None else 0
    batches = static_batches(
        [(len(p), o) for p, o in zip(prompts, output_lens)], kv_token_slots, max_num_seqs
    )
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    first, last = [0.0] * n, [0.0] * n
    # NOTE: generate fills a None in the config it is passed from the model's own generation
    # config, so EOS is switched off there, for the duration of the run.
    saved_eos = hf_model.generation_config.eos_token_id
    hf_model.generation_config.eos_token_id = None
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        steps = 0
        for batch in batches:
            max_p = max(len(prompts[i]) for i in batch)
            max_o = max(output_lens[i] for i in batch)
            ids = torch.full((len(batch), max_p), pad, dtype=torch.long)  # [B, P] left-padded
            mask = torch.zeros((len(batch), max_p), dtype=torch.long)  # [B, P]
            for row, i in enumerate(batch):
                ids[row, max_p - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, max_p - len(prompts[i]) :] = 1
            gen = GenerationConfig(
                do_sample=False,
                num_beams=1,
                max_new_tokens=max_o,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=pad,
            )
            clock = TokenClock()
            with torch.inference_mode():
                out = hf_model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=gen,
                    stopping_criteria=StoppingCriteriaList([clock]),
                )  # [B, P + max_o]
            if len(clock.times) != max_o:
                raise RuntimeError(f"generate stopped after {len(clock.times)} of {max_o} new tokens")
            steps += max_o
            new = out[:, max_p:].tolist()
            for row, i in enumerate(batch):
                o = output_lens[i]
                tokens[i] = new[row][:o]
                first[i], last[i] = clock.times[0] - t0, clock.times[o - 1] - t0
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        hf_model.generation_config.eos_token_id = saved_eos
    peak = max(
        len(b) * (max(len(prompts[i]) for i in b) + max(output_lens[i] for i in b) - 1) for b in batches
    )
    return ServeResult(
        token_ids=tokens,
        wall_s=wall,
        cpu_s=cpu,
        first_token_s=first,
        last_token_s=last,
        steps=steps,
        info={
            "batches": len(batches),
            "batch_sizes": [len(b) for b in batches],
            "kv_token_slots_peak": peak,
            "generated_tokens": sum(len(b) * max(output_lens[i] for i in b) for b in batches),
        },
    )


def hf_continuous_batching(
    hf_model,
    prompts: list[list[int]],
    output_lens: list[int],
    *,
    block_size: int,
    num_blocks: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    seed: int = 0,
    timeout_s: Optional[float] = None,
) -> ServeResult:
    """(d): transformers' ``ContinuousBatchingManager`` with a paged cache of ``num_blocks`` x ``block_size``."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = hf_model.config
    gen = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=cfg.pad_token_id, max_new_tokens=max(output_lens)
    )
    cb = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_num_batched_tokens,
        max_requests_per_batch=max_num_seqs,
        allow_block_sharing=False,
        use_cuda_graph=False,
        use_async_batching=False,
        seed=seed,
    )
    manager = hf_model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    phases = {"prepare_next_batch": 0.0, "generation_step": 0.0, "update_batch": 0.0}
    try:
        manager.warmup()  # NOTE: on CPU no graphs to capture; it builds the batch processor (and the cache) now
        bp = manager.batch_processor
        cache = bp.cache
        _time_methods(
            bp,
            phases,
            {
                "prepare_next_batch": "prepare_next_batch",
                "_generation_step": "generation_step",
                "update_batch": "update_batch",
            },
        )
        counts = {"q": 0, "k": 0}
        step_fn = bp._generation_step

        def counted_step(*args, **kwargs):
            io = bp.inputs_and_outputs
            q = int(getattr(io, "num_q_tokens", 0))
            counts["q"] += q  # tokens through the model this step
            counts["k"] += (
                int(getattr(io, "max_kv_read", 0)) + q
            )  # keys every query of the step is masked against
            return step_fn(*args, **kwargs)

        bp._generation_step = counted_step
        manager.start()
        n = len(prompts)
        results = {}
        t0, c0 = time.perf_counter(), time.process_time()
        for i, (p, o) in enumerate(zip(prompts, output_lens)):
            manager.add_request(
                list(p), request_id=str(i), max_new_tokens=o, eos_token_id=-1, record_timestamps=True
            )
        deadline = None if timeout_s is None else t0 + timeout_s
        while len(results) < n:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"request {r.request_id}: {r.error}")
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("the generation thread stopped before every request finished")
            if deadline is not None and time.perf_counter() > deadline:
                raise RuntimeError(f"{len(results)}/{n} requests finished after {timeout_s} s")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        steps = int(getattr(manager, "current_batch", 0))
        slots = int(cache.num_blocks) * block_size
        max_batch_tokens = int(cache.max_batch_tokens)
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    tokens = [list(results[str(i)].generated_tokens) for i in range(n)]
    first = [results[str(i)].timestamps[0] - t0 for i in range(n)]
    last = [results[str(i)].timestamps[-1] - t0 for i in range(n)]
    total = sum(phases.values()) or 1.0
    return ServeResult(
        token_ids=tokens,
        wall_s=wall,
        cpu_s=cpu,
        first_token_s=first,
        last_token_s=last,
        steps=steps,
        info={
            "kv_token_slots": slots,
            "max_batch_tokens": max_batch_tokens,
            "computed_tokens": counts["q"],
            # NOTE: the sdpa path packs the batch into one sequence with a block-diagonal mask,
            # so each query is scored against every key of the batch
            "mean_keys_per_query": round(counts["k"] / steps, 1) if steps else None,
            "attn_implementation": str(hf_model.config._attn_implementation),
            # NOTE: prepare_next_batch = scheduling + block allocation + input tensors;
            # generation_step = forward + logits processing + sampling; update_batch = bookkeeping
            "step_time_split": {k: round(v / total, 3) for k, v in phases.items()},
            "overhead_fraction": round(1 - phases["generation_step"] / total, 3),
        },
    )


def _time_methods(obj, acc: dict, names: dict) -> None:
    """Wrap bound methods of ``obj`` (instance attributes) so their seconds add up in ``acc``."""
    for attr, key in names.items():
        fn = getattr(obj, attr)

        def timed(*args, _fn=fn, _key=key, **kwargs):
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                acc[_key] += time.perf_counter() - t

        setattr(obj, attr, timed)
