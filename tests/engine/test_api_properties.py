"""Property test of the public API (``SamplingParams``, ``LLM``, ``generate``): random
arguments, valid and not, with bounded sizes. Each call either succeeds with outputs that
respect the parameters, or raises ``ValueError`` naming one of the arguments it was given;
never another exception type, never a hang (an alarm fails a call that runs too long).

Runs on a tiny random Llama with a word-level tokenizer ("w4".."w127"); the checkpoint is
loaded once and ``LLM(...)`` receives it through the loader (every other step of the
construction runs as usual), so a hundred engines cost seconds.
"""

from __future__ import annotations

import math
import signal
from contextlib import contextmanager

import pytest
import torch
from _tiny_llama import EOS, MAX_POS, VOCAB, make_tiny_llama
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minipaged import LLM, SamplingParams
from minipaged.config import EngineConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minipaged.model.loader import load_model

    torch.set_num_threads(1)
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("prop_llama")))


@pytest.fixture
def preloaded(tiny, monkeypatch):
    """``LLM(...)`` gets the tiny model from the loader instead of reading it again."""
    import minipaged.engine.core as le

    monkeypatch.setattr(le, "load_model_checked", lambda config: tiny)
    return tiny


@contextmanager
def deadline(seconds: int):
    def fail(*_):
        raise AssertionError(f"a call ran for more than {seconds} s (a hang?)")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


BAD_NUMBERS = [float("nan"), float("inf"), -float("inf"), True, "1", None, -1, 0]


def _args(valid: dict, invalid: dict):
    """A random subset of the arguments with valid values; half the time one of them (or
    one from ``invalid`` alone) takes an invalid value."""

    @st.composite
    def draw(draw_):
        args = draw_(st.fixed_dictionaries({}, optional=valid))
        if draw_(st.booleans()):
            name = draw_(st.sampled_from(sorted(invalid)))
            args[name] = draw_(st.sampled_from(invalid[name]))
        return args

    return draw()


ENGINE_ARGS = _args(
    valid={
        "block_size": st.sampled_from([1, 2, 3, 4, 8, 16]),
        "num_blocks": st.one_of(st.none(), st.integers(1, 48)),
        "max_num_seqs": st.integers(1, 6),
        "max_num_batched_tokens": st.integers(1, 40),
        "enable_prefix_caching": st.booleans(),
        "enable_chunked_prefill": st.booleans(),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "scheduling": st.sampled_from(["continuous", "static"]),
        "attention_backend": st.just("torch"),
        "dtype": st.just("float32"),
        "seed": st.integers(0, 2**32),
        "max_model_len": st.one_of(st.none(), st.integers(1, MAX_POS)),
        "kv_cache_memory": st.integers(1 << 12, 1 << 16),
        "num_cpu_blocks": st.one_of(st.none(), st.integers(0, 16)),
    },
    invalid={
        "block_size": [0, -4, 2.0, True, "4", 512],
        "num_blocks": [0, -3, 10**12, 1.5, True],
        "max_num_seqs": BAD_NUMBERS,
        "max_num_batched_tokens": BAD_NUMBERS,
        "enable_prefix_caching": [1, "yes", None],
        "enable_chunked_prefill": [0, "no"],
        "preemption_mode": ["both", 1],
        "scheduling": ["fifo", None],
        "attention_backend": ["triton", "flash", 3],
        "dtype": ["float64", "fp32"],
        "seed": [1.5, "0", None],
        "max_model_len": [0, MAX_POS + 1, 2.5],
        "kv_cache_memory": [0, -1, 1, float("nan"), 1 << 62],
        "num_cpu_blocks": [-1, 10**12, "8"],
        "model": [5, 2.5, b"x"],
        "bogus_option": [1],
    },
)

STOP_WORDS = ["w5", "5 w", "w1", "w12 w", " w3", "w4", "0 w"]
PARAMS = _args(
    valid={
        "n": st.integers(1, 3),
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        "top_p": st.floats(0.05, 1.0),
        "top_k": st.integers(0, 20),
        "min_p": st.floats(0.0, 1.0),
        "max_tokens": st.integers(1, 8),
        "min_tokens": st.integers(0, 1),
        "seed": st.one_of(st.none(), st.integers(0, 1000)),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.1, 2.0),
        "stop": st.one_of(st.sampled_from(STOP_WORDS), st.lists(st.sampled_from(STOP_WORDS), max_size=3)),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "include_stop_str_in_output": st.booleans(),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(0, 5)),
        "skip_special_tokens": st.booleans(),
    },
    invalid={
        "n": [0, 10**6, True, 2.0],
        "temperature": BAD_NUMBERS,
        "top_p": [0.0, 1.5, float("nan")],
        "top_k": [-2, 2.0, True],
        "min_p": [-0.1, 1.1, float("inf")],
        "max_tokens": [0, -1, True, 2.5],
        "min_tokens": [-1, 100, True],
        "seed": [1.5, "x"],
        "presence_penalty": BAD_NUMBERS,
        "frequency_penalty": [2.5, float("nan")],
        "repetition_penalty": [0.0, 3.0, float("-inf")],
        "stop": [[""], [5], b"w5"],
        "stop_token_ids": ["\n", [True], [VOCAB], [-1], [1.0]],
        "include_stop_str_in_output": [1],
        "ignore_eos": ["no"],
        "logprobs": [-1, 21, True],
        "skip_special_tokens": [None],
    },
)

PROMPT = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
    st.lists(st.sampled_from([f"w{i}" for i in range(4, 40)]), min_size=1, max_size=8).map(" ".join),
    st.sampled_from([[], "", [VOCAB], [-1], [True, 5], [1.5], None, [[3]], list(range(4, 4 + MAX_POS + 1))]),
)
PROMPTS = st.one_of(st.lists(PROMPT, min_size=1, max_size=3), PROMPT)


def _num_prompts(prompts) -> int:
    """How many prompts ``generate`` sees (a string or one list of ids is one prompt)."""
    if not isinstance(prompts, list):
        return 1
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return 1
    return len(prompts)


def _names(e: ValueError, names) -> bool:
    msg = str(e)
    return any(n in msg for n in names)


def _check_completion(c, p: SamplingParams, prompt_len: int, max_model_len: int, tok) -> None:
    ids = c.token_ids
    assert c.finish_reason in ("stop", "length", "refused"), c.finish_reason
    if c.finish_reason == "refused":
        assert ids == [] and isinstance(c.stop_reason, str)
        return
    assert 1 <= len(ids) <= p.max_tokens
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    # nothing that stops a request appears before its last token
    assert not (set(ids[:-1]) & stop_ids), (ids, stop_ids)
    if c.finish_reason == "length":
        assert len(ids) == p.max_tokens or prompt_len + len(ids) >= max_model_len
        if p.stop and p.min_tokens == 0:
            assert not any(s in c.text for s in p.stop), (c.text, p.stop)
    elif isinstance(c.stop_reason, str):  # a stop string
        assert c.stop_reason in p.stop and len(ids) > p.min_tokens
        full = tok.decode(ids, skip_special_tokens=p.skip_special_tokens)
        assert c.stop_reason in full
        if p.min_tokens == 0:  # (with min_tokens, an earlier occurrence does not count)
            cut = full.find(c.stop_reason)
            want = full[: cut + len(c.stop_reason)] if p.include_stop_str_in_output else full[:cut]
            assert c.text == want
            # the token completing it is the last one kept
            shorter = tok.decode(ids[:-1], skip_special_tokens=p.skip_special_tokens)
            assert not any(s in shorter for s in p.stop)
    else:  # EOS (stop_reason None) or a stop token id
        assert len(ids) >= max(1, p.min_tokens)
        assert ids[-1] in stop_ids and (c.stop_reason is None or c.stop_reason == ids[-1])
        if p.stop and p.min_tokens == 0:
            assert not any(s in c.text for s in p.stop), (c.text, p.stop)
    if p.logprobs is None:
        assert c.logprobs is None
    else:
        assert len(c.logprobs) == len(ids)
        for t, d in zip(ids, c.logprobs):
            assert t in d and len(d) in (p.logprobs, p.logprobs + 1) or (p.logprobs == 0 and len(d) == 1)
            assert all(math.isfinite(lp.logprob) and lp.logprob <= 1e-6 for lp in d.values())
        plain = p.temperature == 0 and not p.uses_penalties and p.min_tokens == 0
        if plain:
            assert all(d[t].rank == 1 for t, d in zip(ids, c.logprobs))


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    engine_args=ENGINE_ARGS,
    params_args=st.lists(PARAMS, min_size=1, max_size=3),
    prompts=PROMPTS,
    one_params=st.booleans(),
)
def test_random_api_calls_succeed_or_raise_value_error_naming_an_argument(
    preloaded, engine_args, params_args, prompts, one_params
):
    _, tok = preloaded
    with deadline(60):
        try:
            llm = LLM(**engine_args)
        except ValueError as e:
            assert _names(e, engine_args), (str(e), engine_args)
            event("LLM(...) raised ValueError")
            return
        engine = llm.llm_engine
        params = []
        for kw in params_args:
            try:
                params.append(SamplingParams(**kw))
            except ValueError as e:
                assert _names(e, kw), (str(e), kw)
        if not params:
            return
        n_prompts = _num_prompts(prompts)
        sp = params[0] if one_params or len(params) != n_prompts else params
        if llm.config.attention_backend == "triton":
            return  # NOTE: Triton's CPU interpreter is too slow for a property test
        try:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        except ValueError as e:
            assert _names(e, ["prompts", "sampling_params"]), str(e)
            assert not engine.has_unfinished_requests()
            event("generate raised ValueError")
            return
        engine.check_invariants()
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache_manager.get_num_free_blocks() == engine.num_blocks
        plist = [sp] * len(outs) if isinstance(sp, SamplingParams) else sp
        assert len(outs) == n_prompts
        for o, p in zip(outs, plist):
            o.check_invariants()
            assert o.finished and len(o.outputs) == p.n
            for c in o.outputs:
                _check_completion(c, p, len(o.prompt_token_ids), engine.max_model_len, tok)
                kind = type(c.stop_reason).__name__ if c.finish_reason == "stop" else ""
                event(f"completion: {c.finish_reason} {kind}")


def test_config_alone_names_the_argument():
    """EngineConfig is what LLM validates first; it needs no model."""
    for kw in ({"block_size": True}, {"kv_cache_memory": float("nan")}, {"seed": None}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            EngineConfig(**kw)
