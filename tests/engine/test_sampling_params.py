"""vLLM's sampling parameters (minipaged/sampling_params.py, sample/sampler.py,
engine/detokenizer.py, engine/output_processor.py).

References:
- transformers' logits processors (``RepetitionPenaltyLogitsProcessor``,
  ``MinPLogitsWarper``, ``TemperatureLogitsWarper``, ``MinNewTokensLengthLogitsProcessor``)
  and ``generate(repetition_penalty=..., min_new_tokens=...)`` on the course model;
- vLLM's documented formulas where transformers has none (presence / frequency
  penalties: ``logit -= frequency * count + presence * (count > 0)`` over output tokens);
- for stop strings, the full ``tokenizer.decode`` of an unstopped run: the first
  occurrence of the stop string, and the first token whose text reaches its end.
Every engine check runs under each scheduling variant (continuous, static, small chunks,
recompute and swap preemption, prefix caching) with n > 1 among the requests.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.config import EngineConfig
from minipaged.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from minipaged.engine.llm_engine import LLMEngine
from minipaged.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
)


class _Req:
    """What the sampler reads of a request."""

    def __init__(self, prompt, output, params, eos=None):
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = list(output)
        self.sampling_params = params
        self.eos_token_id = eos


# ------------------------------------------------------------ sampler vs transformers
@pytest.mark.parametrize("rp", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(rp):
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    V = 50
    logits = torch.randn(3, V, generator=g) * 3
    reqs = [
        _Req([1, 2, 3], [4, 4, 9], SamplingParams(repetition_penalty=rp)),
        _Req([7], [], SamplingParams(repetition_penalty=rp)),
        _Req([5, 5, 6, 40], [49, 0], SamplingParams(repetition_penalty=rp)),
    ]
    ours = apply_penalties(logits.clone(), [0, 1, 2], reqs)
    proc = RepetitionPenaltyLogitsProcessor(penalty=rp)
    for i, r in enumerate(reqs):
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
        ref = proc(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref)


def test_frequency_and_presence_penalties_follow_vllm_formula():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    V = 30
    logits = torch.randn(2, V, generator=g)
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(frequency_penalty=-1.5, presence_penalty=2.0, repetition_penalty=1.2),
    ]
    reqs = [_Req([3, 3, 8], [8, 8, 8, 2, 29], params[0]), _Req([1], [1, 5, 5], params[1])]
    ours = apply_penalties(logits.clone(), [0, 1], reqs)
    for i, (r, p) in enumerate(zip(reqs, params)):
        ref = logits[i].clone()
        if p.repetition_penalty != 1.0:
            ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
            ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, ref[None])[0]
        for t, c in Counter(r.output_token_ids).items():  # prompt tokens are not counted
            ref[t] -= p.frequency_penalty * c + p.presence_penalty
        torch.testing.assert_close(ours[i], ref)


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5), (1.0, 1.0)])
def test_min_p_matches_transformers(min_p, temperature):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 64, generator=g) * 2
    ours = apply_min_p(logits / temperature, torch.full((4,), min_p))
    ref = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_min_p_never_samples_a_dropped_token():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 40, generator=g)
    p = SamplingParams(temperature=1.0, min_p=0.5)
    probs = logits.softmax(-1)[0]
    allowed = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    drawn = {int(Sampler()(logits, [p], [s])[0]) for s in range(200)}
    assert drawn <= allowed and len(drawn) > 1


@pytest.mark.parametrize("num_out", [0, 2, 3, 5])
def test_min_tokens_matches_transformers(num_out):
    from transformers import MinNewTokensLengthLogitsProcessor

    V, eos, stops = 20, 1, [7, 11]
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(num_out))
    prompt = [4, 5, 6]
    out = list(range(12, 12 + num_out))
    r = _Req(prompt, out, SamplingParams(min_tokens=3, stop_token_ids=stops), eos=eos)
    ours = apply_min_tokens(logits.clone(), [0], [r])
    proc = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [eos] + stops)
    ref = proc(torch.tensor([prompt + out]), logits.clone())
    assert torch.equal(ours, ref)
    # ignore_eos: EOS stays allowed, stop tokens are still masked
    r = _Req(prompt, out, SamplingParams(min_tokens=3, stop_token_ids=stops, ignore_eos=True), eos=eos)
    ours = apply_min_tokens(logits.clone(), [0], [r])
    assert ours[0, eos] == logits[0, eos]


def test_sampler_logprobs_are_raw_log_softmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 25, generator=g)
    reqs = [
        _Req([1], [], SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.9)),
        _Req([1], [], SamplingParams(temperature=1.0, logprobs=0)),
        _Req([1], [], SamplingParams(temperature=0.5)),
    ]
    tokens, lps = Sampler().sample(logits, reqs, [0, 5, 6])
    assert lps[2] is None
    ref = logits.double().log_softmax(-1)
    for i in (0, 1):
        e = lps[i]
        k = reqs[i].sampling_params.logprobs
        order = ref[i].argsort(descending=True)
        assert e.token_ids == order[:k].tolist()
        assert e.logprobs == pytest.approx(ref[i][order[:k]].tolist(), abs=1e-6)
        assert e.sampled_token_id == tokens[i]
        assert e.sampled_logprob == pytest.approx(float(ref[i][tokens[i]]), abs=1e-6)
        assert e.sampled_rank == order.tolist().index(tokens[i]) + 1


# ------------------------------------------------------------ stop strings, unit level
def test_find_stop_string_first_occurrence_and_cut():
    assert find_stop_string("abc xyz", 3, ["xyz", "c x"], False) == ("c x", 2)
    assert find_stop_string("abc xyz", 3, ["xyz"], True) == ("xyz", 7)
    assert find_stop_string("abc xyz", 1, ["abc"], False) is None  # ended in older text
    assert find_stop_string("abc", 0, ["abc"], False) is None


@pytest.fixture(scope="module")
def course():
    from minipaged.model.loader import load_model

    torch.set_num_threads(1)
    return load_model(None)


def test_incremental_text_equals_full_decode(course):
    """Token by token, the text is the full decode: on random sequences of whole-character
    tokens (special ones included) and on text with multi-byte characters split across
    byte tokens."""
    _, tok = course
    g = torch.Generator().manual_seed(5)
    whole = [i for i in range(len(tok)) if "\ufffd" not in tok.decode([i])]
    seqs = [[whole[j] for j in torch.randint(0, len(whole), (34,), generator=g)] for _ in range(15)]
    seqs.append(tok("Once upon a time, a café served crème brûlée to Zoë ☕ and 猫.")["input_ids"])
    for trial, ids in enumerate(seqs):
        prompt, out = ids[:4], ids[4:]
        for skip in (True, False):
            d = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
            for t in out:
                d.update(t)
            assert d.output_text == tok.decode(out, skip_special_tokens=skip), (trial, skip)


def test_streaming_never_shows_half_a_stop_string(course):
    _, tok = course
    ids = tok("Once upon a time, there was a kind little boy")["input_ids"]
    params = SamplingParams(stop=["kind little"])
    d = IncrementalDetokenizer(tok, ids[:3], params)
    seen = ""
    for t in ids[3:]:
        hit = d.update(t)
        seen += d.get_next_output_text(finished=hit is not None, delta=True)
        assert "kind" not in seen or hit is not None
        if hit:
            break
    assert hit == "kind little" and seen == d.output_text == " a time, there was a "


# ------------------------------------------------------------ engine, every variant
VARIANTS = {
    "continuous": dict(block_size=4, num_blocks=128),
    "static": dict(block_size=4, num_blocks=128, scheduling="static"),
    "chunked": dict(block_size=4, num_blocks=128, max_num_batched_tokens=6),
    "recompute": dict(block_size=4, num_blocks=13, preemption_mode="recompute"),
    "swap": dict(block_size=4, num_blocks=13, preemption_mode="swap"),
    "prefix-caching": dict(block_size=4, num_blocks=128, enable_prefix_caching=True),
}
MAX = 12


def _llm(course, **kw) -> LLM:
    """An ``LLM`` on the already loaded course model (loading it again per variant is slow)."""
    model, tok = course
    llm = object.__new__(LLM)
    llm.config = EngineConfig(**kw)
    llm.llm_engine = LLMEngine(llm.config, model=model, tokenizer=tok)
    return llm


def _cases():
    """(prompt, params without stop strings); stop strings are added from the base run."""
    return [
        ("Once upon a time", SamplingParams(temperature=0.9, seed=1, max_tokens=MAX)),
        ("The cat sat", SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=MAX)),
        (
            "Tom had a red ball",
            SamplingParams(
                temperature=0.0,
                max_tokens=MAX,
                repetition_penalty=1.3,
                presence_penalty=0.5,
                frequency_penalty=0.3,
            ),
        ),
        ("The sun", SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8)),
        (
            "One day, a little girl",
            SamplingParams(temperature=0.0, max_tokens=MAX, logprobs=3, include_stop_str_in_output=True),
        ),
        (
            "The sun",
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, skip_special_tokens=False),
        ),
        (
            "Tom had a red ball",
            SamplingParams(
                temperature=0.7, seed=3, max_tokens=MAX, min_p=0.2, logprobs=1, stop_token_ids=[16]
            ),
        ),
    ]


def _boundary_stop(tok, ids: list[int]) -> str:
    """A stop string that straddles the boundary between two tokens in the middle of ``ids``."""
    for k in range(len(ids) // 2, len(ids) - 1):
        left, right = tok.decode(ids[: k + 1]), tok.decode(ids[: k + 2])
        if len(right) > len(left) + 1 and len(left) >= 2 and "\ufffd" not in right:
            return right[len(left) - 2 : len(left) + 2]
    raise AssertionError("no two adjacent tokens with text")


def _expected_stop(tok, ids, stop, include, skip=True):
    """(token_ids, text) of an unstopped run cut at the first occurrence of ``stop``."""
    full = tok.decode(ids, skip_special_tokens=skip)
    idx = full.find(stop)
    if idx == -1:
        return ids, full, None
    end = idx + len(stop)
    j = next(j for j in range(len(ids)) if len(tok.decode(ids[: j + 1], skip_special_tokens=skip)) >= end)
    return ids[: j + 1], full[: end if include else idx], stop


@pytest.fixture(scope="module")
def references(course):
    """Base (unstopped) outputs from the roomy engine; HF references for the greedy cases."""
    from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

    from minipaged.model.loader import COURSE_MODEL_DIR

    model, tok = course
    llm = _llm(course, **VARIANTS["continuous"])
    cases = _cases()
    base = llm.generate([p for p, _ in cases], [sp for _, sp in cases], use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(COURSE_MODEL_DIR).eval()
    eos = model.eos_token_ids[0]

    def hf_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].double()  # [T, V]

    # case 2: penalties, by hand around transformers' repetition processor
    p2 = cases[2][1]
    ids = tok(cases[2][0])["input_ids"]
    out: list[int] = []
    for _ in range(p2.max_tokens):
        row = hf_logits(ids + out)[-1]
        row = RepetitionPenaltyLogitsProcessor(p2.repetition_penalty)(torch.tensor([ids + out]), row[None])[0]
        for t, c in Counter(out).items():
            row[t] -= p2.frequency_penalty * c + p2.presence_penalty
        out.append(int(row.argmax()))
        if out[-1] == eos:
            break
    pen = out
    # case 3: min_tokens, transformers' generate(min_new_tokens=...)
    ids3 = tok(cases[3][0])["input_ids"]
    g = hf.generate(
        torch.tensor([ids3]),
        do_sample=False,
        max_new_tokens=10,
        min_new_tokens=8,
        attention_mask=torch.ones(1, len(ids3), dtype=torch.long),
        pad_token_id=2,
    )
    mint = g[0, len(ids3) :].tolist()
    if eos in mint:
        mint = mint[: mint.index(eos) + 1]
    return dict(base=base, pen=pen, min_tokens=mint, hf_logits=hf_logits)


def _with_stops(tok, cases, base):
    """The cases with stop strings taken from the base run (straddling token boundaries)."""
    out = []
    stops = {}
    for i, (prompt, sp) in enumerate(cases):
        if i in (0, 1, 4):
            s = _boundary_stop(tok, base[i].outputs[0].token_ids)
            stops[i] = s
            sp = SamplingParams(**{**sp.__dict__, "stop": [s]})
        out.append((prompt, sp))
    return out, stops


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sampling_params_under_every_scheduling_variant(course, references, variant):
    model, tok = course
    base = references["base"]
    cases, stops = _with_stops(tok, _cases(), base)
    llm = _llm(course, **VARIANTS[variant])
    outs = llm.generate([p for p, _ in cases], [sp for _, sp in cases], use_tqdm=False)
    engine = llm.llm_engine
    engine.check_invariants()
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.num_blocks
    if variant in ("recompute", "swap"):
        assert sum(r.get("num_preemptions", 0) for r in llm.trace.requests.values()) > 0

    # stop strings (cases 0, 1 with n=2, 4 with include_stop_str_in_output)
    for i in (0, 1, 4):
        sp = cases[i][1]
        for j, c in enumerate(outs[i].outputs):
            ids, text, hit = _expected_stop(
                tok, base[i].outputs[j].token_ids, stops[i], sp.include_stop_str_in_output
            )
            assert c.token_ids == ids, (i, j)
            assert c.text == text, (i, j)
            if hit:
                assert c.finish_reason == "stop" and c.stop_reason == stops[i]
            else:
                assert c.token_ids == base[i].outputs[j].token_ids
    assert outs[0].outputs[0].finish_reason == "stop"  # the stop string came from sample 0
    # penalties: the hand reference around transformers' processor
    assert outs[2].outputs[0].token_ids == references["pen"]
    # min_tokens: transformers' generate(min_new_tokens=8)
    assert outs[3].outputs[0].token_ids == references["min_tokens"]
    # logprobs (case 4): the raw log-softmax of transformers' logits, top 3 + the sampled token
    c4 = outs[4].outputs[0]
    p4 = tok(cases[4][0])["input_ids"]
    lg = references["hf_logits"](p4 + c4.token_ids).log_softmax(-1)  # [T, V]
    assert len(c4.logprobs) == len(c4.token_ids)
    for t, (tid, d) in enumerate(zip(c4.token_ids, c4.logprobs)):
        row = lg[len(p4) - 1 + t]
        top = row.topk(3)
        assert list(d)[:1] == [tid] and set(top.indices.tolist()) <= set(d) and len(d) <= 4
        for k, lp in d.items():
            assert lp.logprob == pytest.approx(float(row[k]), abs=1e-4)
            assert lp.decoded_token == tok.decode([k])
        assert d[tid].rank == 1  # greedy
    assert c4.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for t, d in zip(c4.token_ids, c4.logprobs))
    )
    # skip_special_tokens=False: the EOS the model emits (ignore_eos) is in the text
    c5 = outs[5].outputs[0]
    assert c5.text == tok.decode(c5.token_ids, skip_special_tokens=False)
    assert 1 in c5.token_ids and "<|eos|>" in c5.text
    # min_p (case 6): each sampled token's raw probability >= min_p x the top one's, at T
    c6 = outs[6].outputs[0]
    sp6 = cases[6][1]
    for tid, d in zip(c6.token_ids, c6.logprobs):
        best = max(lp.logprob for lp in d.values())
        assert (d[tid].logprob - best) / sp6.temperature >= math.log(sp6.min_p) - 1e-5
    # stop_token_ids: the stop token is kept in token_ids, cut from the text
    if c6.finish_reason == "stop":
        assert c6.token_ids[-1] == 16 and c6.stop_reason == 16
        assert c6.text == tok.decode(c6.token_ids[:-1])
    assert c6.token_ids == base[6].outputs[0].token_ids


def test_stop_string_frees_the_blocks_in_that_step(course):
    """A stop string ending mid-block: the request is finished and its blocks freed in the
    step that sampled the token completing it."""
    _, tok = course
    llm = _llm(course, block_size=16, num_blocks=8)
    engine = llm.llm_engine
    base = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=MAX), use_tqdm=False)
    ids = base[0].outputs[0].token_ids
    stop = _boundary_stop(tok, ids)
    want, text, _ = _expected_stop(tok, ids, stop, False)
    prompt_len = len(base[0].prompt_token_ids)
    assert (prompt_len + len(want)) % 16 != 0  # mid-block
    engine.reset_trace()
    engine.add_request("r", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=MAX, stop=stop))
    steps = 0
    while True:
        done = engine.step()
        steps += 1
        if done:
            break
        assert engine.kv_cache_manager.get_num_free_blocks() < engine.num_blocks
    c = done[0].outputs[0]
    assert c.token_ids == want and c.text == text and c.stop_reason == stop
    assert steps == len(want)  # one prefill step that samples, then one decode per token
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.num_blocks
    assert llm.trace.requests["r"]["finish_step"] == steps - 1
    last = llm.trace.steps[-1]  # the picture of that step: no table, every block free
    assert last.finished_ids == ["r"] and "r" not in last.block_tables
    assert last.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests()


def test_top_k_minus_one_means_off_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams().top_k
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


# -- issue 30: bounds at float32's edges and caps on what the per-token checks scan ----------
@pytest.mark.parametrize("t", [1e-39, 5e-324, 9.99e-6, 0.0])
def test_a_temperature_below_vllms_epsilon_is_greedy(t):
    p = SamplingParams(temperature=t, top_p=0.5, top_k=3, min_p=0.2)
    assert p.temperature == 0.0 and p.greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)  # as vLLM resets them
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_the_offline_engine_is_greedy_below_the_epsilon(course):
    llm = _llm(course)
    want = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    got = llm.generate(["Once upon a time"], SamplingParams(temperature=1e-39, max_tokens=8), use_tqdm=False)
    assert got[0].outputs[0].text == want[0].outputs[0].text


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(repetition_penalty=1e-300), "repetition_penalty"),
        (dict(temperature=1e39), "temperature"),
        (dict(temperature=10**400), "temperature"),
        (dict(seed=2**63), "seed"),
        (dict(stop=[f"s{i}" for i in range(65)]), "stop"),
        (dict(stop=["x" * 4097]), "stop"),
        (dict(stop_token_ids=list(range(1025))), "stop_token_ids"),
    ],
)
def test_bounds_name_the_argument(kw, field):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**kw)
    assert len(str(e.value)) < 300  # the message never echoes a whole body


def test_the_caps_themselves_are_accepted():
    from minipaged.sampling_params import FLOAT32_TINY, MAX_STOP_CHARS, MAX_STOP_STRINGS

    SamplingParams(stop=["x" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS)
    SamplingParams(repetition_penalty=FLOAT32_TINY, seed=2**63 - 1)


def test_top_k_over_the_vocabulary_is_refused_by_the_engine(course):
    with pytest.raises(ValueError, match="top_k"):
        _llm(course).generate(["Hi"], SamplingParams(temperature=1.0, top_k=10**6), use_tqdm=False)
