"""Speculative decoding in the engine: greedy outputs equal those without speculation under
every scheduling variant, for n-gram and draft-model proposals; ``check_invariants()`` after
every step with drafts in flight, preemption of a request that holds drafts included.

Model: the tiny random Llama of ``tests/_tiny_llama.py``; draft: its first layer
(``write_layer_skip_draft``). Reference: the same engine without ``speculative_config``.
"""

import pytest
import torch
from _tiny_llama import make_tiny_llama

from minipaged import LLM, SamplingParams
from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine
from minipaged.spec_decode import write_layer_skip_draft

BS = 4
# repetitive prompts (prompt lookup finds matches) and plain ones; staggered arrivals
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    [9, 10, 11, 9, 10],
    [20, 21, 22, 23, 24, 25, 26, 27, 28],
    [5, 6, 7, 8, 30, 31],
    [40, 41, 40, 41, 40],
]
ARRIVALS = [0, 0, 1, 3, 6]
MAX_TOKENS = 18

VARIANTS = {
    "roomy": dict(num_blocks=96),
    "recompute": dict(num_blocks=16),  # the pool forces preemption
    "thrash": dict(num_blocks=16, scheduler_reserve_full_isl=False),
    "tiny-budget": dict(num_blocks=96, max_num_batched_tokens=6),  # chunks; drafts capped
    "no-chunking": dict(num_blocks=96, enable_chunked_prefill=False, max_num_batched_tokens=12),
    "prefix-caching": dict(num_blocks=96, enable_prefix_caching=True),
    "one-seq": dict(num_blocks=96, max_num_seqs=1),
    "block-size-1": dict(num_blocks=200, block_size=1),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("spec_llama"))


@pytest.fixture(scope="module")
def draft_dir(ckpt, tmp_path_factory):
    return write_layer_skip_draft(ckpt, tmp_path_factory.mktemp("spec_draft"), 1)


def spec_config(method, draft_dir, k=3):
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    return {"method": "draft_model", "num_speculative_tokens": k, "model": draft_dir}


def run(engine, params, prompts=PROMPTS, arrivals=ARRIVALS):
    """Step to completion with check_invariants() after every step; returns the outputs and
    the number of steps in which a request holding drafts was preempted."""
    outs, step, preempted_with_drafts = {}, 0, 0
    pending = list(zip(range(len(prompts)), prompts, arrivals))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][2] <= step:
            i, p, _ = pending.pop(0)
            engine.add_request(str(i), p, params)
        held = {r.request_id for r in engine.scheduler.running if r.spec_token_ids}
        for o in engine.step():
            outs[o.request_id] = o
        engine.check_invariants()
        preempted_with_drafts += bool(held & set(engine.trace.steps[-1].preempted_ids))
        step += 1
        assert step < 2000, "engine did not finish"
    return [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))], preempted_with_drafts


@pytest.fixture(scope="module")
def reference(ckpt):
    engine = LLMEngine(EngineConfig(model=ckpt, block_size=BS, num_blocks=96))
    return run(engine, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_equals_no_speculation_under_every_variant(method, ckpt, draft_dir, reference):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    drafted = accepted = 0
    for name, kw in VARIANTS.items():
        kw = {"block_size": BS, **kw}
        engine = LLMEngine(EngineConfig(model=ckpt, speculative_config=spec_config(method, draft_dir), **kw))
        got, preempted_with_drafts = run(engine, params)
        assert got == reference, f"{method} / {name}: outputs differ from greedy without speculation"
        st = engine.spec_decode_stats
        drafted += st.num_draft_tokens
        accepted += st.num_accepted_tokens
        if name in ("recompute", "thrash"):
            assert any(s.preempted_ids for s in engine.trace.steps), (
                f"{name}: the pool should force preemption"
            )
            assert preempted_with_drafts, f"{name}: no request was preempted while it held drafts"
        if name == "prefix-caching":
            assert engine.scheduler.prefix_cache_hits > 0
    assert accepted > 0 and drafted > accepted, f"{method}: {drafted} drafted, {accepted} accepted"


def test_rejected_slots_are_given_back_and_rewritten(ckpt):
    """One request's table across steps: after each verification it holds exactly its
    verified tokens' slots; the next step writes the positions of the rejected drafts."""
    spec = spec_config("ngram", None)
    engine = LLMEngine(EngineConfig(model=ckpt, block_size=BS, num_blocks=96, speculative_config=spec))
    _, _ = run(
        engine, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), PROMPTS[:1], [0]
    )
    steps = [s["0"] for s in engine.spec_decode_log if "0" in s]
    assert any(d > a for _, _, d, a, _ in steps), "no draft was rejected"
    for (blocks, computed, drafts, accepted, _), nxt in zip(steps, steps[1:]):
        kept = computed + 1 + accepted if drafts or computed >= len(PROMPTS[0]) else None
        if kept is not None:
            assert nxt[1] == kept  # the next step starts right after the verified tokens
            assert nxt[0][: -(-kept // BS)] == blocks[: -(-kept // BS)]  # the kept blocks stay


def test_draft_model_requests_with_stop_tokens_and_logprobs(ckpt, draft_dir, reference):
    """A stop token met among accepted drafts ends the request there; requests asking for
    logprobs or stop strings decode one token a step beside speculating ones."""
    out0 = reference[0]
    stop = out0[7]
    want = out0[: out0.index(stop) + 1]
    spec = spec_config("draft_model", draft_dir)
    llm = LLM(model=ckpt, block_size=BS, num_blocks=96, speculative_config=spec)
    outs = llm.generate(
        [PROMPTS[0], PROMPTS[1]],
        [
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop]),
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == want and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].token_ids == reference[1]
    assert len(outs[1].outputs[0].logprobs) == MAX_TOKENS


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_runs_and_is_seeded(method, ckpt, draft_dir):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)
    outs = []
    for _ in range(2):
        kw = dict(model=ckpt, block_size=BS, num_blocks=16, speculative_config=spec_config(method, draft_dir))
        engine = LLMEngine(EngineConfig(**kw))
        outs.append(run(engine, params)[0])
        assert engine.spec_decode_stats.num_draft_tokens > 0
    assert outs[0] == outs[1]
    assert all(len(o) == MAX_TOKENS for o in outs[0])


def _other_vocab_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "spec, kw, field",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, {}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, {}, "method"),
        (
            {"method": "ngram", "num_speculative_tokens": 8},
            {"max_num_batched_tokens": 8},
            "num_speculative_tokens",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2}, {"preemption_mode": "swap"}, "speculative_config"),
        ({"method": "ngram", "num_speculative_tokens": 2}, {"scheduling": "static"}, "speculative_config"),
    ],
)
def test_bad_config(spec, kw, field, ckpt):
    with pytest.raises(ValueError, match=field):
        LLM(model=ckpt, speculative_config=spec, **kw)


def test_draft_vocabulary_must_match(ckpt, tmp_path):
    other = _other_vocab_llama(tmp_path / "other")
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        LLM(model=ckpt, block_size=BS, num_blocks=16, speculative_config=spec_config("draft_model", other))
