"""The public API: ``LLM(...).generate`` (minipaged/engine/llm.py, outputs.py, config.py).

Runs on a tiny random Llama checkpoint with a word-level tokenizer ("w4".."w127"), so
string prompts work without the course model. Greedy references come from the engine's
own run on a roomy pool, checked against transformers in tests/engine/test_engine.py.
"""

from __future__ import annotations

import pytest
from _tiny_llama import MAX_POS, VOCAB, make_tiny_llama

from minipaged import LLM, BeamSearchParams, SamplingParams
from minipaged.config import EngineConfig


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("api_llama"))


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, block_size=4, num_blocks=128)


def greedy(n=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [20] * 12, [33, 34, 35]]


def test_public_names():
    import minipaged

    assert minipaged.LLM is LLM
    assert minipaged.RequestOutput.__name__ == "RequestOutput"
    assert minipaged.CompletionOutput.__name__ == "CompletionOutput"
    assert minipaged.EngineConfig is EngineConfig
    assert BeamSearchParams(beam_width=2).beam_width == 2


def test_prompt_forms_and_output_structure(llm):
    by_ids = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.request_id for o in by_ids] == [str(i) for i in range(len(PROMPTS))]
    for p, o in zip(PROMPTS, by_ids):
        o.check_invariants()
        assert o.prompt is None and o.prompt_token_ids == p and o.finished
        (c,) = o.outputs
        assert c.index == 0 and c.finish_reason in ("length", "stop")
        assert len(c.token_ids) == 8 or c.finish_reason == "stop"
        assert c.text == " ".join(f"w{t}" for t in c.token_ids if t > 3)
    texts = [" ".join(f"w{t}" for t in p) for p in PROMPTS]
    by_text = llm.generate(texts, greedy(), use_tqdm=False)
    assert [o.prompt for o in by_text] == texts
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    one_str = llm.generate(texts[0], greedy(), use_tqdm=False)
    one_ids = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)
    assert len(one_str) == len(one_ids) == 1
    assert (
        one_str[0].outputs[0].token_ids == one_ids[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids
    )
    assert llm.generate([], greedy(), use_tqdm=False) == []


def test_one_sampling_params_per_prompt(llm):
    params = [greedy(n=k + 1, ignore_eos=True) for k in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS, params[:2], use_tqdm=False)


def test_trace_is_per_call(llm):
    llm.generate(PROMPTS[:2], greedy(4, ignore_eos=True), use_tqdm=False)
    first = llm.trace
    llm.generate(PROMPTS, greedy(3, ignore_eos=True), use_tqdm=False)
    t = llm.trace
    assert t is not first and t.steps[0].step == 0
    assert sorted(t.requests) == [str(i) for i in range(len(PROMPTS))]
    for i, p in enumerate(PROMPTS):
        info = t.requests[str(i)]
        assert info["prompt_len"] == len(p) and info["output_len"] == 3
        assert info["arrival_step"] == 0 and info["finish_step"] < len(t)
    t.check_invariants()


@pytest.mark.parametrize(
    "prompts, match",
    [
        ("", "empty"),
        ([""], "empty"),
        ([[]], "empty"),
        ([[1] * (MAX_POS + 1)], "longer than the model's context"),
        ([[VOCAB + 5]], "vocabulary"),
        ([3.5], "prompts"),
    ],
)
def test_bad_prompts_raise_and_run_nothing(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate([PROMPTS[1]], greedy(2), use_tqdm=False)[0].finished  # still usable


def test_a_bad_prompt_among_good_ones_runs_nothing(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate([PROMPTS[0], [], PROMPTS[1]], greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
    ],
)
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_blocks=-3), "num_blocks"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(preemption_mode="drop"), "preemption_mode"),
        (dict(scheduling="fifo"), "scheduling"),
        (dict(attention_backend="cuda"), "attention_backend"),
        (dict(dtype="int8"), "dtype"),
        (dict(seed=1.5), "seed"),
        (dict(enable_chunked_prefill="yes"), "enable_chunked_prefill"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
    ],
)
def test_bad_engine_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=name):
        LLM(**kwargs)  # validated before any model is loaded


def test_unknown_model_and_unknown_kwarg(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(model=str(tmp_path / "no_such_model"))
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(blocksize=16)


def test_max_model_len_over_the_model_is_an_error(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=tiny_llama, max_model_len=MAX_POS * 2, num_blocks=8)


def test_refused_request_leaves_the_others_unchanged(tiny_llama):
    small = LLM(model=tiny_llama, block_size=4, num_blocks=6)  # 24 slots in all
    good = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    base = small.generate(good, greedy(6), use_tqdm=False)
    too_big = [7] * 30  # 30 prompt tokens need 8 blocks > 6
    with pytest.warns(UserWarning, match="refused"):
        outs = small.generate([good[0], too_big, good[1], good[2]], greedy(6), use_tqdm=False)
    refused = outs[1].outputs[0]
    assert refused.finish_reason == "refused" and refused.token_ids == [] and refused.text == ""
    assert "pool" in refused.stop_reason and outs[1].finished
    kept = [outs[0], outs[2], outs[3]]
    assert [o.outputs[0].token_ids for o in kept] == [o.outputs[0].token_ids for o in base]
    small.llm_engine.check_invariants()
    assert small.llm_engine.kv_cache_manager.get_num_free_blocks() == 6


def test_stop_tokens_eos_and_ignore_eos(tiny_llama):
    llm = LLM(model=tiny_llama, block_size=4, num_blocks=64)
    p = PROMPTS[2]
    full = llm.generate(p, greedy(10, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop = full[3]
    cut = full[: full.index(stop) + 1]
    c = llm.generate(p, greedy(10, stop_token_ids=[stop], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == cut and c.finish_reason == "stop" and c.stop_reason == stop
    # EOS: make that token the model's EOS
    llm.llm_engine.eos_token_ids = [stop]
    c = llm.generate(p, greedy(10), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == cut and c.finish_reason == "stop" and c.stop_reason is None
    c = llm.generate(p, greedy(10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == full and c.finish_reason == "length"


def test_seeded_sampling_ignores_batch_mates_and_preemption(tiny_llama):
    roomy = LLM(model=tiny_llama, block_size=4, num_blocks=128, seed=3)
    target = PROMPTS[2]
    params = SamplingParams(temperature=1.0, top_k=40, max_tokens=12, seed=1234, ignore_eos=True)
    alone = roomy.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    mates = [PROMPTS[0], PROMPTS[3], target, PROMPTS[1]]
    mate_params = [
        SamplingParams(temperature=0.9, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5),
        params,
        SamplingParams(temperature=1.2, top_p=0.8, max_tokens=12, seed=5),
    ]
    batched = roomy.generate(mates, mate_params, use_tqdm=False)
    assert batched[2].outputs[0].token_ids == alone
    # a pool so small that requests are preempted and recomputed: same texts
    tight = LLM(model=tiny_llama, block_size=2, num_blocks=14, seed=3)
    tight_out = tight.generate(mates, mate_params, use_tqdm=False)
    assert any(s.preempted_ids for s in tight.trace.steps)
    assert [o.outputs[0].token_ids for o in tight_out] == [o.outputs[0].token_ids for o in batched]
    # unseeded requests: reproducible from the engine seed and the request's index
    again = LLM(model=tiny_llama, block_size=4, num_blocks=128, seed=3)
    p0 = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    a = again.generate(PROMPTS, p0, use_tqdm=False)
    b = roomy.generate(PROMPTS, p0, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_n_samples(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=9, ignore_eos=True)
    (o,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert [c.index for c in o.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in o.outputs]
    assert len(set(seqs)) > 1, "independent samples should differ"
    (again,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == seqs


def test_progress_bar_runs(llm, capsys):
    outs = llm.generate(PROMPTS[:2], greedy(2), use_tqdm=True)
    assert len(outs) == 2
    assert "Processed prompts" in capsys.readouterr().err
