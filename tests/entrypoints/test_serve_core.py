"""The engine core and the frontend's outputs, driven by messages in this process (no
child process, no HTTP): what ``minipaged serve``'s two processes exchange, checked
against offline ``LLM.generate`` (text, token ids, finish and stop reasons, logprobs),
with every message sent through ``encode``/``decode`` as over the pipe."""

from __future__ import annotations

import pytest

from minipaged import SamplingParams
from minipaged.engine.core import EngineCore, core_params, decode, encode
from minipaged.engine.core_client import FrontendOutputs
from minipaged.engine.llm_engine import LLMEngine

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big"]


def run_split(llm, prompts, params, check=None):
    """Both halves in turn: the core steps, the frontend turns token ids into outputs and
    sends back the stops it finds. Returns the finished outputs by request id, and the
    core (to look at its engine)."""
    e = llm.llm_engine
    core = EngineCore(LLMEngine(e.config, model=e.model, tokenizer=e.tokenizer), check_invariants=True)
    tok = llm.get_tokenizer()
    front = FrontendOutputs(tok, core.engine.eos_token_ids, lambda t: tok.decode([t]))
    adds = []
    for i, p in enumerate(prompts):
        ids = list(tok(p)["input_ids"])
        front.add(f"r{i}", ids, params, stream=True)
        adds.append((f"r{i}", ids, params))
    assert core.handle(decode(encode(("add", adds)))) == []
    done = {}
    while True:
        out = core.step()
        if out is None:
            break
        kind, seqs, event, stats = decode(encode(out))
        assert kind == "step" and event["step"] == core.engine.step_index - 1 + core.step_offset
        outs, stops = front.process(seqs)
        for rid, o in outs.items():
            if o.finished:
                done[rid] = o
        if stops:
            before = core.engine.kv_cache_manager.get_num_free_blocks()
            core.handle(decode(encode(("stop", stops))))
            if check is not None:
                check(core, before, stops)
        core.engine.check_invariants()
    return done, core


def assert_same(done, ref):
    for i, r in enumerate(ref):
        got = done[f"r{i}"]
        assert [c.text for c in got.outputs] == [c.text for c in r.outputs]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in r.outputs]
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in r.outputs]
        assert [c.stop_reason for c in got.outputs] == [c.stop_reason for c in r.outputs]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0, max_tokens=24),
        dict(temperature=0.0, max_tokens=40, stop=[" the", "."]),
        dict(temperature=0.0, max_tokens=40, stop=["."], include_stop_str_in_output=True),
        dict(temperature=1.0, seed=7, max_tokens=16, n=2),
    ],
    ids=["greedy", "stop-strings", "stop-included", "seeded-n2"],
)
def test_split_equals_offline(llm, kw):
    params = SamplingParams(**kw)
    done, core = run_split(llm, PROMPTS, params)
    assert_same(done, llm.generate(PROMPTS, params, use_tqdm=False))
    assert core.engine.kv_cache_manager.get_num_free_blocks() == core.engine.num_blocks
    assert not core.engine.has_unfinished_requests() and core.seqs == {}


def test_logprobs_cross_as_entries_and_equal_offline(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    done, _ = run_split(llm, PROMPTS[:2], params)
    ref = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for i, r in enumerate(ref):
        got, want = done[f"r{i}"].outputs[0], r.outputs[0]
        assert len(got.logprobs) == len(want.logprobs) == 8
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-6
        assert abs(got.cumulative_logprob - want.cumulative_logprob) < 1e-5


def test_a_stop_frees_the_sequence_before_the_next_step(llm):
    """The frontend's stop reaches the core between steps: the sequence is finished and
    its blocks are back in the pool before the next ``schedule()``."""
    seen = []

    def check(core, before, stops):
        for sid, reason in stops:
            assert sid not in core.engine.seq_to_group
            info = core.engine.trace.requests[sid]
            assert info["finish_reason"] == "stop" and reason.startswith("stop string")
        assert core.engine.kv_cache_manager.get_num_free_blocks() > before
        seen.extend(stops)

    params = SamplingParams(temperature=0.0, max_tokens=60, stop=["."])
    done, _ = run_split(llm, PROMPTS, params, check)
    assert seen, "no stop string was found: the case tests nothing"
    assert_same(done, llm.generate(PROMPTS, params, use_tqdm=False))


def test_the_core_runs_without_stop_strings_and_refuses_bad_adds(llm):
    p = SamplingParams(stop=["x"], max_tokens=4)
    assert core_params(p).stop in (None, []) and core_params(p).max_tokens == 4
    e = llm.llm_engine
    core = EngineCore(LLMEngine(e.config, model=e.model, tokenizer=e.tokenizer))
    replies = core.handle(("add", [("bad", [10**9], SamplingParams(max_tokens=2))]))
    assert replies[0][:2] == ("rejected", "bad") and "vocabulary" in replies[0][2]
    assert core.step() is None  # nothing queued: the core would block on its input
    core.handle(("abort", ["unknown"]))  # an abort of a finished request is a no-op
