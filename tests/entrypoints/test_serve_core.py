"""The engine core and the frontend's outputs, driven by messages in this process (no
child process, no HTTP): what ``minipaged serve``'s two processes exchange, checked
against offline ``LLM.generate`` (text, token ids, finish and stop reasons, logprobs),
with every message sent through ``encode``/``decode`` as over the pipe."""

from __future__ import annotations

import pytest

from minipaged import SamplingParams
from minipaged.engine.core import EngineCore, EngineCoreProc, decode, encode
from minipaged.engine.output_processor import OutputProcessor
from minipaged.engine.processor import Processor

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big"]


def make_core(llm, **kw) -> EngineCoreProc:
    e = llm.llm_engine
    return EngineCoreProc(EngineCore.from_config(e.config, e.model), **kw)


def run_split(llm, prompts, params, check=None):
    """Both halves in turn: the core steps, the frontend turns token ids into outputs and
    sends back the stops it finds. Returns the finished outputs by request id, and the
    core's loop (to look at its core)."""
    proc = make_core(llm, check_invariants=True)
    core = proc.core
    tok = llm.get_tokenizer()
    processor, front = Processor(core.model_info, tok), OutputProcessor(tok)
    adds = []
    for i, p in enumerate(prompts):
        _, ids = processor.tokenize(p)
        children = processor.process_inputs(f"r{i}", ids, params)
        front.add_request(f"r{i}", None, ids, params, children, stream=True)
        adds.append((f"r{i}", children))
    assert proc.handle(decode(encode(("add", adds)))) == []
    done = {}
    while core.has_unfinished_requests():
        outs = decode(encode(proc.step()))
        assert outs.error is None and outs.step.step == core.step_index - 1 + proc.step_offset
        processed = front.process_outputs(outs.outputs)
        for o in processed.request_outputs:
            if o.finished:
                done[o.request_id] = o
        if processed.reqs_to_stop:
            before = core.scheduler.kv_cache_manager.get_num_free_blocks()
            proc.handle(decode(encode(("stop", processed.reqs_to_stop))))
            if check is not None:
                check(core, before, processed.reqs_to_stop)
        core.check_invariants()
    assert not front.has_unfinished_requests()
    return done, proc


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
    done, proc = run_split(llm, PROMPTS, params)
    assert_same(done, llm.generate(PROMPTS, params, use_tqdm=False))
    core = proc.core
    assert core.scheduler.kv_cache_manager.get_num_free_blocks() == core.model_info.num_blocks
    assert not core.has_unfinished_requests() and core.requests == {}


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
            assert sid not in core.requests
            info = core.trace.requests[sid]
            assert info["finish_reason"] == "stop" and reason.startswith("stop string")
        assert core.scheduler.kv_cache_manager.get_num_free_blocks() > before
        seen.extend(stops)

    params = SamplingParams(temperature=0.0, max_tokens=60, stop=["."])
    done, _ = run_split(llm, PROMPTS, params, check)
    assert seen, "no stop string was found: the case tests nothing"
    assert_same(done, llm.generate(PROMPTS, params, use_tqdm=False))


def test_a_stop_after_the_trace_was_reset_still_frees_the_sequence(llm):
    """A trace drained (``reset_trace``, the server's ``/trace`` with reset) between a step
    and the frontend's stop: the stop no longer rewrites the old trace's step record (it once
    raised IndexError there and killed the engine core)."""
    proc = make_core(llm, check_invariants=True)
    core, tok = proc.core, llm.get_tokenizer()
    processor, front = Processor(core.model_info, tok), OutputProcessor(tok)
    params = SamplingParams(temperature=0.0, max_tokens=60, stop=["."])
    _, ids = processor.tokenize(PROMPTS[0])
    children = processor.process_inputs("r0", ids, params)
    front.add_request("r0", None, ids, params, children, stream=True)
    proc.handle(("add", [("r0", children)]))
    stops = []
    while core.has_unfinished_requests() and not stops:
        stops = front.process_outputs(proc.step().outputs).reqs_to_stop
    assert stops, "no stop string was found: the case tests nothing"
    core.reset_trace()
    assert proc.handle(("stop", stops)) == []
    assert not core.has_unfinished_requests() and core.requests == {}
    assert core.scheduler.kv_cache_manager.get_num_free_blocks() == core.model_info.num_blocks


def test_the_core_refuses_bad_adds_and_ignores_unknown_aborts(llm):
    proc = make_core(llm)
    tok = llm.get_tokenizer()
    processor = Processor(proc.core.model_info, tok)
    _, ids = processor.tokenize("Once upon a time")
    reqs = processor.process_inputs("a", ids, SamplingParams(max_tokens=2))
    assert proc.handle(("add", [("a", reqs)])) == []
    replies = proc.handle(decode(encode(("add", [("a", reqs)]))))  # the same id again
    assert replies[0][:2] == ("rejected", "a") and "already in the engine" in replies[0][2]
    proc.handle(("abort", ["unknown"]))  # an abort of a finished request is a no-op
    proc.handle(("abort", ["a"]))
    assert not proc.core.has_unfinished_requests() and proc.core.requests == {}
    assert proc.core.step().outputs == []  # nothing queued: the loop would block on its input
