"""core/sched/spec.py by hand: usable drafts, lookahead slots, how far a step advances."""

import pytest

from minipaged.core.sched.request import Request, get_max_num_kv_tokens
from minipaged.core.sched.spec import num_lookahead_slots, num_verified, usable_drafts
from minipaged.sampling_params import SamplingParams


def _decoding(prompt_len=5, out_len=3, max_tokens=8):
    r = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    r.output_token_ids = list(range(out_len))
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_usable_drafts_stop_at_max_tokens_and_the_context():
    r = _decoding(out_len=3, max_tokens=8)  # 5 more tokens may come: 4 drafts + 1
    assert usable_drafts(r, [1, 2, 3, 4, 5, 6], None) == [1, 2, 3, 4]
    r = _decoding(out_len=7, max_tokens=8)  # one token left: drafting is useless
    assert usable_drafts(r, [1, 2], None) == []
    r = _decoding(prompt_len=5, out_len=3, max_tokens=100)
    assert usable_drafts(r, [1, 2, 3, 4], max_model_len=10) == [1]  # 8 tokens; 9 fed at most
    r = _decoding(out_len=3, max_tokens=100)
    assert usable_drafts(r, [1, 2, 3, 4], None, budget=3) == [1, 2]  # 1 + 2 tokens fit
    assert usable_drafts(r, [1, 2, 3, 4], None, budget=1) == []  # a plain decode still runs


def test_lookahead_is_capped_by_the_refusal_bound():
    r = _decoding(out_len=3, max_tokens=8)  # max kv tokens 5 + 8 - 1 = 12; computed 7
    assert get_max_num_kv_tokens(r) == 12
    assert num_lookahead_slots(r, 7 + 3, 4, None) == 2  # 7 + 3 + 2 = 12
    assert num_lookahead_slots(r, 7 + 1, 4, None) == 4
    assert num_lookahead_slots(r, 7 + 1, 0, None) == 0  # n-gram: none
    assert num_lookahead_slots(r, 7 + 5, 4, None) == 0


def test_num_verified():
    assert num_verified(4, 3, 4) == 4  # all accepted: every scheduled token stays
    assert num_verified(4, 3, 1) == 1  # none: only the last sampled token
    assert num_verified(1, 0, 1) == 1  # an ordinary decode
    assert num_verified(9, 0, 1) == 9  # a prefill chunk that samples
    with pytest.raises(ValueError, match="num_sampled"):
        num_verified(4, 3, 5)
    with pytest.raises(ValueError, match="num_sampled"):
        num_verified(4, 3, 0)
