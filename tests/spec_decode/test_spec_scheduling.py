"""The v1 scheduler's speculative-decoding lines by hand: which drafts a step schedules,
how many lookahead slots it reserves, and what a verification does to the request (vLLM
v1's rule: ``num_computed_tokens`` back by the rejected drafts, the blocks kept)."""

import pytest

from minipaged.core.sched.request import Request, get_max_num_kv_tokens
from minipaged.core.sched.scheduler import Scheduler
from minipaged.sampling_params import SamplingParams

BS = 4


def _decoding(prompt_len=5, out_len=3, max_tokens=8, budget=64, **kw):
    """A scheduler whose one request has ``out_len`` output tokens and decodes next."""
    sched = Scheduler(num_blocks=32, block_size=BS, max_num_batched_tokens=budget, **kw)
    r = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    sched.add_request(r)
    while r.num_output_tokens < out_len:
        out = sched.schedule()
        sched.update_from_output(
            out, {"r": 40} if r.num_computed_tokens + out.num_scheduled_tokens["r"] >= r.num_tokens else {}
        )
        sched.check_invariants()
    assert r.num_computed_tokens == r.num_tokens - 1
    return sched, r


def _scheduled_drafts(sched, r, drafts):
    sched.update_draft_token_ids({"r": drafts})
    out = sched.schedule()
    sched.check_invariants()
    return out, out.scheduled_spec_decode_tokens.get("r", [])


def test_drafts_stop_at_max_tokens_the_context_and_the_budget():
    sched, r = _decoding(out_len=3, max_tokens=8)  # 5 more tokens may come: 4 drafts + 1
    out, d = _scheduled_drafts(sched, r, [1, 2, 3, 4, 5, 6])
    assert d == [1, 2, 3, 4] and out.num_scheduled_tokens["r"] == 5
    sched, r = _decoding(out_len=7, max_tokens=8)  # one token left: drafting is useless
    assert _scheduled_drafts(sched, r, [1, 2])[1] == []
    sched, r = _decoding(out_len=3, max_tokens=40, max_model_len=10)  # 8 tokens; 9 fed at most
    assert _scheduled_drafts(sched, r, [1, 2, 3, 4])[1] == [1]
    sched, r = _decoding(out_len=3, max_tokens=40, budget=3)
    assert _scheduled_drafts(sched, r, [1, 2, 3, 4])[1] == [1, 2]  # 1 + 2 tokens fit
    sched, r = _decoding(out_len=3, max_tokens=40, budget=1)
    out, d = _scheduled_drafts(sched, r, [1, 2, 3, 4])
    assert d == [] and out.num_scheduled_tokens["r"] == 1  # a plain decode still runs
    assert r.spec_token_ids == []  # consumed: new drafts come after the step


def test_lookahead_is_capped_by_the_refusal_bound():
    # max kv tokens 5 + 8 - 1 = 12; computed 7
    for drafts, lookahead, slots in [([1, 2], 4, 12), ([], 4, 12), ([], 0, 8), ([1, 2, 3, 4], 4, 12)]:
        sched, r = _decoding(out_len=3, max_tokens=8, num_lookahead_tokens=lookahead)
        assert get_max_num_kv_tokens(r) == 12
        out, _ = _scheduled_drafts(sched, r, drafts)
        n = out.num_scheduled_tokens["r"]
        # 7 computed + n scheduled + min(lookahead, 12 - 7 - n) slots, in whole blocks
        assert len(sched.kv_cache_manager.get_block_ids("r")) == -(-slots // BS), (drafts, lookahead)
        assert sched.kv_cache_manager.get_block_table("r").num_tokens == (slots if lookahead else 7 + n)


def test_rejected_drafts_roll_back_num_computed_tokens_and_keep_their_blocks():
    sched, r = _decoding(prompt_len=6, out_len=1, max_tokens=20)  # 7 tokens, 6 computed
    out, d = _scheduled_drafts(sched, r, [1, 2, 3])
    assert d == [1, 2, 3] and out.num_scheduled_tokens["r"] == 4
    blocks = sched.kv_cache_manager.get_block_ids("r")  # slots 0..9: 3 blocks
    assert len(blocks) == 3 and out.new_block_ids == blocks[2:]
    sched.update_from_output(out, {"r": [1, 50]})  # one draft accepted, then the target's own
    sched.check_invariants()
    assert r.output_token_ids == [40, 1, 50] and r.num_computed_tokens == 8  # 6 + 4 - 2 rejected
    assert sched.kv_cache_manager.get_block_ids("r") == blocks  # the rejected slots 8, 9 stay
    out = sched.schedule()  # the next decode rewrites slot 8, in a block it holds already
    assert out.num_scheduled_tokens["r"] == 1 and out.new_block_ids == []
    sched.update_from_output(out, {"r": 51})
    assert r.num_computed_tokens == 9
    # impossible counts: none sampled, or more than the drafts + 1
    for bad in ([], [1, 2, 3, 4, 5]):
        _, d = _scheduled_drafts(sched, r, [1, 2, 3])
        out = sched._in_flight
        with pytest.raises(ValueError, match="sampled for 3 drafts"):
            sched.update_from_output(out, {"r": bad})
        sched.update_from_output(out, {"r": [7]})
