"""ModelRunner (minipaged/worker/model_runner.py): its inputs come from SchedulerOutput alone.

Two checks of the scheduler/worker boundary:
- a hand-written output (plain data, no scheduler anywhere) gives the slots, positions and
  tables worked out by hand, and the runner keeps its own copy of each request's tokens;
- every step of a real engine run (preemption, chunked prefill, prefix caching, swap and
  copy-on-write) is recorded as ``SchedulerOutput.for_worker()``, pickled, and replayed into
  a fresh runner with no scheduler (``PaperModelRunner`` where the paper's scheduler ran):
  it samples exactly the tokens the engine did.
And the runner's speculative half (vLLM's ``gpu_model_runner``): drafts verified by its
rejection sampler, its copy rolled back over the rejected ones, the next drafts proposed.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from _counting_model import CountingModel, counting_reference  # noqa: E402

from minipaged import SamplingParams
from minipaged.config import EngineConfig
from minipaged.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minipaged.core.sched.paper_output import PaperSchedulerOutput
from minipaged.core.sched.request import Request
from minipaged.engine.llm_engine import LLMEngine
from minipaged.worker import ModelRunner
from minipaged.worker.paper_runner import PaperModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _plain(x) -> bool:
    """True if ``x`` is built of plain data only (no scheduler objects)."""
    if isinstance(x, (str, int, float, bool, type(None), SamplingParams)):
        return True
    if isinstance(x, (list, tuple, set)):
        return all(_plain(v) for v in x)
    if isinstance(x, dict):
        return all(_plain(k) and _plain(v) for k, v in x.items())
    if dataclasses.is_dataclass(x):
        return all(_plain(getattr(x, f.name)) for f in dataclasses.fields(x))
    return False


def test_inputs_of_a_hand_written_output():
    """Slots, positions and tables of a mixed batch, computed by hand, from plain data."""
    # a: 5 prompt tokens in blocks [3, 6]; b: the first of its 3 prompt tokens, block [1]
    step0 = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("a", [1, 2, 3, 4, 5], [], GREEDY, [3, 6], 0),
            NewRequestData("b", [7, 8, 9], [], GREEDY, [1], 0),
        ],
        num_scheduled_tokens={"a": 5, "b": 1},
        total_num_scheduled_tokens=6,
    )
    assert _plain(step0)
    runner = ModelRunner(CountingModel(), num_blocks=8, block_size=4)
    runner.update_states(step0)
    inp = runner.prepare_inputs(step0)
    assert inp.input_ids.tolist() == [1, 2, 3, 4, 5, 7]
    assert inp.positions.tolist() == [0, 1, 2, 3, 4, 0]
    # slot(i) = table[i // 4] * 4 + i % 4: a's tokens 0-3 in block 3, token 4 in block 6
    assert inp.slot_mapping.tolist() == [12, 13, 14, 15, 24, 4]
    assert inp.seq_lens.tolist() == [5, 1] and inp.cu_seqlens_q.tolist() == [0, 5, 6]
    assert inp.logits_indices.tolist() == [4, 5]
    assert inp.block_tables.tolist() == [[3, 6], [1, 0]]  # padded with 0
    assert inp.max_query_len == 5 and inp.max_seq_len == 5

    runner = ModelRunner(CountingModel(), num_blocks=8, block_size=4)
    got = runner.execute_model(step0)
    tok_a = counting_reference([1, 2, 3, 4, 5], 1)[0]
    # one list per request, in batch order (vLLM's): b is mid-prefill, no token
    assert (got.req_ids, got.req_id_to_index, got.sampled_token_ids) == (
        ["a", "b"],
        {"a": 0, "b": 1},
        [[tok_a], []],
    )
    assert runner.requests["a"].output_token_ids == [tok_a]  # the runner keeps its own copy
    # step 1: a decodes its token (the runner knows it), b its other 2 prompt tokens; b
    # needs no new block, a none either (6 tokens fit in 2 blocks)
    step1 = SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData("a", [], 5), CachedRequestData("b", [], 1)],
        num_scheduled_tokens={"a": 1, "b": 2},
        total_num_scheduled_tokens=3,
    )
    runner.update_states(step1)
    inp = runner.prepare_inputs(step1)
    assert inp.input_ids.tolist() == [tok_a, 8, 9]
    assert inp.positions.tolist() == [5, 1, 2]
    assert inp.slot_mapping.tolist() == [25, 5, 6]
    # a finished: the next output drops it
    runner.update_states(SchedulerOutput(finished_req_ids={"a"}))
    assert set(runner.requests) == {"b"}
    runner.check_invariants()


def test_a_cached_request_the_worker_never_got_is_a_scheduler_bug():
    runner = ModelRunner(CountingModel(), num_blocks=8, block_size=4)
    bad = SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData("x", [0], 0)], num_scheduled_tokens={"x": 1}
    )
    with pytest.raises(RuntimeError, match="'x'"):
        runner.execute_model(bad)


REPLAY_CONFIGS = {
    "recompute": dict(num_blocks=9, block_size=4, max_num_seqs=4, max_num_batched_tokens=16),
    "chunked+prefix": dict(
        num_blocks=12, block_size=2, max_num_seqs=3, max_num_batched_tokens=5, enable_prefix_caching=True
    ),
    "swap": dict(num_blocks=9, block_size=4, max_num_seqs=4, preemption_mode="swap", num_cpu_blocks=20),
    "fork": dict(num_blocks=30, block_size=4, max_num_seqs=6, parallel_sampling="fork"),
}


@pytest.mark.parametrize("name", list(REPLAY_CONFIGS))
def test_replayed_outputs_drive_a_fresh_runner_alone(name):
    cfg = EngineConfig(kv_cache_memory=1 << 16, **REPLAY_CONFIGS[name])
    engine = LLMEngine(cfg, model=CountingModel())
    recorded = []  # (pickled worker output, the tokens the engine's worker sampled)
    execute = engine.executor.execute_model

    def record(out):
        result = execute(out)
        recorded.append((pickle.dumps(out.for_worker()), (result.req_ids, result.sampled_token_ids)))
        return result

    engine.executor.execute_model = record
    prefix = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(temperature=0.0, max_tokens=7, n=2 if name == "fork" else 1)
    for i in range(6):
        engine.add_request(str(i), prefix + [i] * (i + 1), params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        engine.check_invariants()
    for o in outs:
        for c in o.outputs:
            assert c.token_ids == counting_reference(o.prompt_token_ids, 7)
    steps = engine.trace.steps
    if name in ("recompute", "swap"):
        assert any(s.preempted_ids or s.swapped_out_ids for s in steps), "the pool should be too small"

    paper = name in ("swap", "fork")  # the paper's scheduler, and so the paper's runner
    assert isinstance(engine.model_runner, PaperModelRunner) == paper
    if paper:
        fresh = PaperModelRunner(CountingModel(), cfg.num_blocks, cfg.block_size, engine.num_cpu_blocks)
    else:
        fresh = ModelRunner(CountingModel(), cfg.num_blocks, cfg.block_size)
    for blob, sampled in recorded:
        out = pickle.loads(blob)
        assert _plain(out) and not out.scheduled and not out.preempted, "a scheduler object crossed"
        assert paper or not isinstance(out, PaperSchedulerOutput), "a paper output from vLLM v1's scheduler"
        got = fresh.execute_model(out)
        assert (got.req_ids, got.sampled_token_ids) == sampled
    assert not fresh.requests  # every finished id reached it (the last ones as the engine idled)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(fresh.kv_caches, engine.model_runner.kv_caches))


def test_the_engine_forgets_finished_requests():
    engine = LLMEngine(
        EngineConfig(kv_cache_memory=1 << 16, num_blocks=20, block_size=4), model=CountingModel()
    )
    for i in range(5):
        engine.add_request(str(i), [1, 2, 3 + i], SamplingParams(temperature=0.0, max_tokens=3 + i))
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.scheduler
    assert not s.requests and not s.running and not s.waiting and not s.finished_req_ids
    assert not engine.output_processor.request_states and not engine.core.requests
    assert not engine.model_runner.requests
    assert not hasattr(s, "finished") and not hasattr(s, "arrival_seq")
    assert isinstance(Request("x", [1]).arrival_order, int)  # the FCFS rank is the request's


class NextTokenModel:
    """next token = this token + 1, at every row the runner asks for (``logits_indices``)."""

    num_layers, num_kv_heads, head_dim, eos_token_id, vocab_size = 1, 1, 2, None, 50

    def allocate_kv_caches(self, num_blocks, block_size):
        return [(torch.zeros(num_blocks, block_size, 1, 2), torch.zeros(num_blocks, block_size, 1, 2))]

    def prepare_attention(self, inp, block_size):
        return inp  # no attention layer to plan for

    def forward(self, inp, kv_caches):
        nxt = (inp.input_ids[inp.logits_indices] + 1) % self.vocab_size  # [rows]
        return torch.nn.functional.one_hot(nxt, self.vocab_size).float()  # [rows, V]


def test_the_runner_verifies_drafts_and_proposes_the_next():
    """vLLM's gpu_model_runner: forward, rejection-sample the request scheduled with drafts
    (its entry is the accepted drafts + 1, its copy rolled back over the rejected one), then
    the drafter proposes for the next step."""
    from minipaged.spec_decode import SpeculativeConfig

    runner = ModelRunner(NextTokenModel(), num_blocks=4, block_size=4)
    sc = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runner.enable_speculation(SpeculativeConfig.from_dict(sc))
    assert runner.drafter.k == 3 and runner.rejection_sampler is not None
    prompt = [1, 2, 3, 4, 1, 2, 3]
    step0 = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", prompt, [], GREEDY, [0, 1, 2], 0)],
        num_scheduled_tokens={"a": 7},
        total_num_scheduled_tokens=7,
    )
    out = runner.execute_model(step0)
    # 4 after 3; the suffix [2, 3, 4] was seen at position 1: 1, 2, 3 followed it
    assert (out.sampled_token_ids, out.draft_token_ids) == ([[4]], {"a": [1, 2, 3]})
    step1 = SchedulerOutput(  # the scheduler sends drafts of its own: 5 and 6 right, 9 wrong
        scheduled_cached_reqs=[CachedRequestData("a", [], 7)],
        num_scheduled_tokens={"a": 4},
        total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={"a": [5, 6, 9]},
    )
    out = runner.execute_model(step1)
    assert out.sampled_token_ids == [[5, 6, 7]] and out.draft_token_ids == {}
    r = runner.requests["a"]
    assert (r.output_token_ids, r.num_computed_tokens) == ([4, 5, 6, 7], 10)  # 7 + 4 - 1 rejected
    runner.check_invariants()
