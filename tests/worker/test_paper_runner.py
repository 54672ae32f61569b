"""PaperModelRunner (minipaged/worker/paper_runner.py): the paper's block moves and forks,
from hand-written ``PaperSchedulerOutput``s (plain data, no scheduler anywhere). The
counting model reads every context back from the paged cache, so a move not done (or done
to the wrong block) fails its check."""

from __future__ import annotations

import pickle

import pytest
import torch
from _counting_model import CountingModel, counting_reference

from minipaged import SamplingParams
from minipaged.core.sched.output import NewRequestData, SchedulerOutput
from minipaged.core.sched.paper_output import PaperSchedulerOutput
from minipaged.core.sched.request import Request
from minipaged.worker import ModelRunner
from minipaged.worker.paper_runner import PaperModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _step(new=(), tokens=None, **moves) -> PaperSchedulerOutput:
    tokens = tokens or {}
    return PaperSchedulerOutput(
        scheduled_new_reqs=list(new),
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        **moves,
    )


def _sampled(out) -> dict[str, list[int]]:
    return dict(zip(out.req_ids, out.sampled_token_ids))


def test_swap_out_and_back_in_to_other_blocks():
    prompt = [1, 2, 3, 4, 5]
    tok0, tok1 = counting_reference(prompt, 2)
    runner = PaperModelRunner(CountingModel(), num_blocks=8, block_size=4, num_cpu_blocks=3)
    runner.check_invariants()
    got = runner.execute_model(_step([NewRequestData("a", prompt, [], GREEDY, [3, 6], 0)], {"a": 5}))
    assert _sampled(got) == {"a": [tok0]}
    # swapped out: its blocks to CPU blocks 0 and 1, then the device blocks are overwritten
    runner.execute_model(_step(preempted_req_ids={"a"}, blocks_to_swap_out=[(3, 0), (6, 1)]))
    assert not runner.requests
    for k, v in runner.kv_caches:
        k.fill_(-7.0), v.fill_(-7.0)
    # swapped in to device blocks 1 and 4: the decode reads its context from there
    back = NewRequestData("a", prompt, [tok0], GREEDY, [1, 4], 5)
    got = runner.execute_model(_step([back], {"a": 1}, blocks_to_swap_in=[(0, 1), (1, 4)]))
    assert _sampled(got) == {"a": [tok1]}
    runner.check_invariants()


def test_a_fork_samples_from_its_parent_row_and_copy_on_write_copies_the_shared_block():
    prompt = [1, 2, 3]  # one partly filled block of 4, shared after the fork
    tok0, tok1 = counting_reference(prompt, 2)
    model = CountingModel()
    runner = PaperModelRunner(model, num_blocks=8, block_size=4)
    step0 = _step(
        [NewRequestData("p", prompt, [], GREEDY, [2], 0), NewRequestData("c", prompt, [], GREEDY, [2], 3)],
        {"p": 3},
        fork_sample_ids=[("p", "c")],
    )
    assert _sampled(runner.execute_model(step0)) == {"p": [tok0], "c": [tok0]}
    assert model.calls == 1  # one prefill for both
    # both write their token at position 3 of the shared block: the child's goes to a copy
    step1 = _step(
        [NewRequestData("c", prompt, [tok0], GREEDY, [5], 3)],  # its table rewritten
        {"p": 1, "c": 1},
        blocks_to_copy=[(2, 5)],
    )
    step1.scheduled_new_reqs.insert(0, NewRequestData("p", prompt, [tok0], GREEDY, [2], 3))
    assert _sampled(runner.execute_model(step1)) == {"p": [tok1], "c": [tok1]}


def test_plain_outputs_move_nothing_and_a_swap_needs_a_cpu_pool():
    runner = PaperModelRunner(CountingModel(), num_blocks=4, block_size=2)
    runner.execute_model(SchedulerOutput(finished_req_ids={"gone"}))  # the engine's idle flush
    with pytest.raises(RuntimeError, match="no CPU pool"):
        runner.execute_model(_step(blocks_to_swap_out=[(0, 0)]))


def test_from_runner_shares_the_caches_and_the_requests():
    v1 = ModelRunner(CountingModel(), num_blocks=4, block_size=2)
    paper = PaperModelRunner.from_runner(v1)
    assert isinstance(paper, PaperModelRunner) and PaperModelRunner.from_runner(paper) is paper
    assert paper.kv_caches is v1.kv_caches and paper.requests is v1.requests
    assert paper.num_cpu_blocks == 0 and paper.cpu_kv_caches == []
    paper.check_invariants()


def test_for_worker_keeps_the_moves_and_the_fork_ids_as_plain_data():
    parent, child = Request("p", [1, 2]), Request("c", [1, 2])
    out = PaperSchedulerOutput(
        num_scheduled_tokens={"p": 2},
        total_num_scheduled_tokens=2,
        blocks_to_swap_out=[(1, 0)],
        blocks_to_copy=[(2, 3)],
        fork_sample_ids=[("p", "c")],
        scheduled=[(parent, 2)],
        swapped_out=[parent],
        forks=[(parent, child)],
        fork_samples=[(parent, child)],
    )
    plain = pickle.loads(pickle.dumps(out.for_worker()))
    assert isinstance(plain, PaperSchedulerOutput)
    assert plain.num_scheduled_tokens == {"p": 2} and plain.total_num_scheduled_tokens == 2
    assert plain.blocks_to_swap_out == [(1, 0)] and plain.blocks_to_copy == [(2, 3)]
    assert plain.fork_sample_ids == [("p", "c")]
    assert not (plain.scheduled or plain.swapped_out or plain.forks or plain.fork_samples)
    assert plain.blocks_to_swap_out is not out.blocks_to_swap_out  # a copy


def test_the_cpu_pool_mirrors_the_device_pool():
    runner = PaperModelRunner(CountingModel(), num_blocks=4, block_size=2, num_cpu_blocks=6)
    ((k, _),) = runner.kv_caches
    ((ck, cv),) = runner.cpu_kv_caches
    assert ck.shape == cv.shape == (6,) + tuple(k.shape[1:]) and ck.device == torch.device("cpu")
    runner.cpu_kv_caches.pop()
    with pytest.raises(AssertionError, match="one cache pair per layer"):
        runner.check_invariants()
