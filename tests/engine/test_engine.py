"""LLMEngine (minipaged/engine/llm_engine.py) with its worker (minipaged/worker/).

Two independent references:
- a *counting model* whose next token is a function of the whole context as it reads it
  back from the paged cache: any slot-mapping, block-table, swap or recompute bug changes
  the tokens (and a wrong cache entry trips an assertion inside the model);
- Hugging Face transformers' greedy ``generate`` on randomly initialised Llama (GQA),
  Mistral, Qwen2 and GPT-2 checkpoints and on the course model, token for token.
"""

from __future__ import annotations

import random

import pytest
import torch
from _counting_model import CountingModel, counting_reference  # noqa: E402

from minipaged import SamplingParams
from minipaged.config import EngineConfig
from minipaged.core import PaperSchedulerOutput, RequestStatus
from minipaged.engine.llm_engine import LLMEngine
from minipaged.trace import EngineTrace

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


# ----------------------------------------------------------------------------- counting model
def run_engine(engine, prompts, params, arrivals=None):
    """Add prompts (at their arrival steps), step to the end with invariants checked."""
    arrivals = arrivals or [0] * len(prompts)
    outs, step = {}, 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params[i] if isinstance(params, list) else params)
        for o in engine.step():
            o.check_invariants()
            outs[o.request_id] = o
        engine.check_invariants()
        step += 1
        assert step < 5000, "engine did not finish"
    return [outs[str(i)] for i in range(len(prompts))]


def _prompts(seed, n, max_len=30, V=97):
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


COUNTING_CONFIGS = {
    "roomy": dict(),
    "recompute": dict(num_blocks=12, block_size=4),
    "swap": dict(num_blocks=12, block_size=4, preemption_mode="swap"),
    "static": dict(scheduling="static", num_blocks=40, block_size=4, max_num_seqs=4),
    "chunked-tiny-budget": dict(max_num_batched_tokens=8, num_blocks=14, block_size=4),
    "no-chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=32, num_blocks=14, block_size=4),
    "block-size-1": dict(block_size=1, num_blocks=50, max_num_seqs=3),
}


@pytest.mark.parametrize("name", list(COUNTING_CONFIGS))
def test_counting_model_equals_reference(name):
    kw = COUNTING_CONFIGS[name]
    prompts = _prompts(0, 9, max_len=25)
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 16, **kw), model=CountingModel())
    arrivals = [0, 0, 0, 1, 2, 3, 5, 8, 13]
    outs = run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=16), arrivals)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        if c.finish_reason == "refused":
            assert "refused" in c.stop_reason and c.token_ids == []
            continue
        assert c.finish_reason == "length"
        assert c.token_ids == counting_reference(p, 16)
    assert any(o.outputs[0].finish_reason != "refused" for o in outs)
    steps = engine.trace.steps
    if name == "recompute":
        assert any(s.preempted_ids for s in steps), "the small pool should force recompute"
    if name == "swap":
        assert any(s.swapped_out_ids for s in steps) and any(s.swapped_in_ids for s in steps)
    engine.trace.check_invariants()
    info = engine.trace.requests
    assert sorted(info) == [str(i) for i in range(9)]
    for i in range(9):
        assert info[str(i)]["arrival_step"] == arrivals[i]
        assert info[str(i)]["finish_step"] >= arrivals[i]


def test_a_failed_step_that_swapped_out_aborts_the_swapped_ones_too():
    """``EngineCore.fail_step``: the requests the failed step swapped out (their copy may be
    half made) are aborted with the step's own; the others finish, both pools end empty."""
    engine = LLMEngine(
        EngineConfig(kv_cache_memory=1 << 16, **COUNTING_CONFIGS["swap"]), model=CountingModel()
    )
    for i, p in enumerate(_prompts(0, 6, max_len=25)):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=16))
    core, execute = engine.core, engine.executor.execute_model

    def fail_on_swap_out(out):
        if isinstance(out, PaperSchedulerOutput) and out.blocks_to_swap_out:
            raise RuntimeError("the copy failed")
        return execute(out)

    engine.executor.execute_model = fail_on_swap_out
    with pytest.raises(RuntimeError, match="copy failed"):
        while engine.has_unfinished_requests():
            engine.step()
    swapped = list(core._in_flight.swapped_out)
    assert swapped
    engine.output_processor.process_outputs(core.fail_step(RuntimeError("the copy failed")).outputs)
    assert all(r.status == RequestStatus.FINISHED_ABORTED and "copy failed" in r.stop_reason for r in swapped)
    engine.executor.execute_model = execute
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    kv = engine.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks and kv.get_num_free_cpu_blocks() == kv.num_cpu_blocks


def test_refused_request_leaves_the_others_unchanged():
    prompts = _prompts(1, 5, max_len=12)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    cfg = dict(num_blocks=10, block_size=4, kv_cache_memory=1 << 16)
    base = run_engine(LLMEngine(EngineConfig(**cfg), model=CountingModel()), prompts, params)
    big = [5] * 38  # 38 + 10 - 1 tokens need 12 blocks > 10
    mixed = prompts[:2] + [big] + prompts[2:]
    outs = run_engine(LLMEngine(EngineConfig(**cfg), model=CountingModel()), mixed, params)
    refused = outs[2].outputs[0]
    assert refused.finish_reason == "refused" and "pool" in refused.stop_reason
    assert outs[2].finished and refused.token_ids == []
    others = [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2]
    assert others == [o.outputs[0].token_ids for o in base]


def test_abort_frees_blocks_and_returns_nothing():
    engine = LLMEngine(
        EngineConfig(kv_cache_memory=1 << 16, num_blocks=20, block_size=4), model=CountingModel()
    )
    engine.add_request("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
    engine.add_request("y", [4, 5], SamplingParams(temperature=0.0, max_tokens=5))
    engine.step()
    engine.abort_request("x")
    with pytest.raises(ValueError, match="unknown"):
        engine.abort_request("x")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["y"]
    assert outs[0].outputs[0].token_ids == counting_reference([4, 5], 5)
    assert engine.kv_cache_manager.get_num_free_blocks() == 20
    assert engine.trace.requests["x"]["finish_reason"] == "abort"


def test_trace_round_trips_through_json():
    engine = LLMEngine(
        EngineConfig(kv_cache_memory=1 << 16, num_blocks=10, block_size=4), model=CountingModel()
    )
    run_engine(engine, _prompts(2, 4, max_len=10), SamplingParams(temperature=0.0, max_tokens=6))
    t = engine.trace
    back = EngineTrace.from_json(t.to_json())
    assert back.to_dict() == t.to_dict()
    assert len(t) == t.steps[-1].step + 1
    assert all(set(s.scheduled) == set(s.prefill_ids) | set(s.decode_ids) for s in t.steps)


def test_duplicate_request_id_is_an_error():
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 16), model=CountingModel())
    engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", [3], GREEDY)


def test_parallel_sampling_n_gives_independent_seeded_sequences():
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 16), model=CountingModel())
    outs = run_engine(engine, [[1, 2, 3]], SamplingParams(n=3, temperature=0.0, max_tokens=5))
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(c.token_ids == counting_reference([1, 2, 3], 5) for c in outs[0].outputs)


# ----------------------------------------------------------------------------- transformers
VOCAB = 128
# word-level vocabulary: special tokens 0-3, then "w4" .. "w127" (no word contains another)
WORDS = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
HF_MAX_TOKENS = 10


def _save_tiny_tokenizer(path):
    """A word-level tokenizer "w4".."w127" so that load_model finds one (prompts are ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(WORDS, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(path)


def _tiny_config(kind):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":  # GQA: 4 query heads share 2 kv heads; untied embeddings
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=None, rope_theta=1e6)
    if kind == "qwen2":  # qkv bias, tied embeddings
        return Qwen2Config(**common, tie_word_embeddings=True)
    return GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=96, bos_token_id=1, eos_token_id=2
    )


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """kind -> (checkpoint dir, the transformers model it holds)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, kind in enumerate(("llama", "mistral", "qwen2", "gpt2")):
        torch.manual_seed(100 + i)
        hf = AutoModelForCausalLM.from_config(_tiny_config(kind)).eval()
        with torch.no_grad():  # larger weights: peakier logits, no near-ties in argmax
            for p in hf.parameters():
                if p.dim() > 1:
                    p.mul_(4.0)
        path = tmp_path_factory.mktemp(f"tiny_{kind}")
        hf.save_pretrained(path)
        _save_tiny_tokenizer(path)
        out[kind] = (str(path), hf)
    return out


def hf_greedy(hf, prompt, max_new_tokens):
    """transformers' greedy continuation of one prompt (fp32, batch of one)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=hf.config.eos_token_id,
        )
    return out[0, len(prompt) :].tolist()


HF_PROMPTS = _prompts(7, 6, max_len=20, V=VOCAB)


def _backends():
    """The attention backends every greedy-equality test runs under: torch, and the C kernel
    where a compiler builds it (Triton has its own, shorter test below: its interpreter is slow)."""
    from minipaged.kernels import cpu

    return [
        "torch",
        pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(), reason="no C compiler")),
    ]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2"])
def test_greedy_equals_transformers(tiny_checkpoints, kind, backend):
    from minipaged import LLM

    path, hf = tiny_checkpoints[kind]
    llm = LLM(model=path, block_size=4, num_blocks=64, attention_backend=backend)
    outs = llm.generate(HF_PROMPTS, SamplingParams(temperature=0.0, max_tokens=HF_MAX_TOKENS), use_tqdm=False)
    for p, o in zip(HF_PROMPTS, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf_greedy(hf, p, HF_MAX_TOKENS), f"{kind}, prompt {p}"


SCHEDULING_VARIANTS = {
    "continuous-chunked": dict(block_size=4, num_blocks=64),
    "continuous-no-chunking": dict(block_size=4, num_blocks=64, enable_chunked_prefill=False),
    "static": dict(block_size=4, num_blocks=64, scheduling="static", max_num_seqs=3),
    "tiny-budget-chunks": dict(block_size=4, num_blocks=64, max_num_batched_tokens=7),
    "recompute-small-pool": dict(block_size=2, num_blocks=26, max_num_batched_tokens=16),
    "swap-small-pool": dict(block_size=2, num_blocks=26, max_num_batched_tokens=16, preemption_mode="swap"),
}


@pytest.fixture(scope="module")
def llama_reference(tiny_checkpoints):
    path, hf = tiny_checkpoints["llama"]
    return path, [hf_greedy(hf, p, HF_MAX_TOKENS) for p in HF_PROMPTS]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("variant", list(SCHEDULING_VARIANTS))
def test_scheduling_variants_give_the_same_tokens(llama_reference, variant, backend):
    from minipaged import LLM

    path, want = llama_reference
    llm = LLM(model=path, attention_backend=backend, **SCHEDULING_VARIANTS[variant])
    outs = llm.generate(HF_PROMPTS, SamplingParams(temperature=0.0, max_tokens=HF_MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    steps = llm.trace.steps
    llm.trace.check_invariants()
    if variant == "recompute-small-pool":
        assert any(s.preempted_ids for s in steps), "the pool should be small enough to preempt"
    if variant == "swap-small-pool":
        assert any(s.swapped_out_ids for s in steps), "the pool should be small enough to swap"
    if variant == "tiny-budget-chunks":
        assert max(sum(s.scheduled.values()) for s in steps) <= 7
    if variant == "static":
        # a static batch admits nobody until the whole batch is done
        assert max(len(s.scheduled) for s in steps) <= 3


def test_triton_backend_equals_torch_backend(llama_reference):
    """The Triton kernels (interpreted on CPU) give the same greedy tokens; few tokens."""
    from minipaged import LLM
    from minipaged.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("Triton is not installed on this platform")
    path, want = llama_reference
    llm = LLM(model=path, block_size=4, num_blocks=32, attention_backend="triton")
    prompts = HF_PROMPTS[:2]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w[:3] for w in want[:2]]


@pytest.mark.parametrize("backend", _backends())
def test_course_model_greedy_equals_transformers(backend):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minipaged import LLM
    from minipaged.model import COURSE_MODEL_DIR

    hf = AutoModelForCausalLM.from_pretrained(COURSE_MODEL_DIR).eval()
    tok = AutoTokenizer.from_pretrained(COURSE_MODEL_DIR)
    prompts = ["Once upon a time", "The little dog", "One day, a girl named Lily went"]
    llm = LLM(block_size=16, attention_backend=backend)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = tok(p)["input_ids"]
        assert o.prompt_token_ids == ids
        want = hf_greedy(hf, ids, 24)
        assert o.outputs[0].token_ids == want
        assert o.outputs[0].text == tok.decode(want, skip_special_tokens=True)
