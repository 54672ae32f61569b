"""analysis.py: offline greedy replay by hand, the tokens-per-step formula, the cost model."""

import pytest

from minipaged.sim.cost_model import H200, LLAMA_7B, CostModel
from minipaged.spec_decode import NgramProposer
from minipaged.spec_decode.analysis import cost_model_speedup, expected_tokens_per_step, replay_greedy


def test_replay_by_hand():
    prompt = [1, 2, 3, 4]
    out = [1, 2, 3, 9, 1, 2, 3]
    ngram = NgramProposer(1, 2, 3)
    steps = replay_greedy(prompt, out, lambda ctx, n: ngram.propose(ctx, n), k=3)
    # step 1: ctx ...4,1 -> [1] matches at 0 -> drafts [2, 3, 4]; real 2, 3, 9: 2 accepted
    # step 2: ctx ...,1,2,3,9 -> 9 never seen, no drafts, 1 token
    # step 3: ctx ...,9,1 -> [1] at 0 -> [2, ...] capped at 1: two outputs are left, and a
    # step yields its accepted drafts + 1
    assert steps == [(3, 2), (0, 0), (1, 1)]
    assert 1 + sum(a + 1 for _, a in steps) == len(out)


def test_replay_never_proposes_past_the_output():
    prompt = [5, 5, 5]
    out = [5, 5, 5]
    steps = replay_greedy(prompt, out, lambda ctx, n: [5] * n, k=4)
    assert steps == [(1, 1)]  # after out[0], only one more draft can be useful


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 3) == 1.0
    assert expected_tokens_per_step(1.0, 3) == 4.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="acceptance_rate"):
        expected_tokens_per_step(1.5, 2)
    with pytest.raises(ValueError, match="k"):
        expected_tokens_per_step(0.5, 0)


def test_speculation_wins_at_batch_1_and_loses_at_high_batch():
    cost = CostModel(LLAMA_7B, H200)
    assert cost_model_speedup(cost, 1, 512, k=4, acceptance_rate=0.7) > 2.0  # memory-bound
    assert cost_model_speedup(cost, 512, 512, k=4, acceptance_rate=0.3) < 1.0  # compute-bound
    # with no accepted draft it never pays
    for b in (1, 32, 256):
        assert cost_model_speedup(cost, b, 512, k=2, acceptance_rate=0.0) <= 1.0
    # the speedup falls as the batch grows
    s = [cost_model_speedup(cost, b, 512, k=4, acceptance_rate=0.6) for b in (1, 64, 256, 1024)]
    assert s == sorted(s, reverse=True)
    with pytest.raises(ValueError, match="batch_size"):
        cost_model_speedup(cost, 0, 512, k=4, acceptance_rate=0.6)
