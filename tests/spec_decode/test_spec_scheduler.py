"""The v1 scheduler with drafts in flight, no model: random drafts and random acceptance,
``check_invariants()`` after every schedule and every update, through preemption.

What a verification must do to the scheduler's state, checked by hand each step: the
request advances by ``1 + accepted`` tokens, its table keeps every block it held (the
rejected drafts' and lookahead slots stay, as vLLM v1's; ``num_computed_tokens`` alone goes
back), drafts never exceed the budget or the request's remaining tokens, and a preempted
request loses its drafts.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.core.kv.block import cdiv
from minipaged.core.sched.request import Request, get_max_num_kv_tokens
from minipaged.core.sched.scheduler import Scheduler
from minipaged.sampling_params import SamplingParams


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(8, 40),
    budget=st.integers(4, 24),
    k=st.integers(1, 4),
    lookahead=st.booleans(),
)
def test_random_drafts_and_acceptance_keep_the_invariants(seed, num_blocks, budget, k, lookahead):
    rng = random.Random(seed)
    bs = 4
    sched = Scheduler(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        num_lookahead_tokens=k if lookahead else 0,
    )
    reqs = [
        Request(
            str(i),
            [rng.randrange(50) for _ in range(rng.randint(1, 12))],
            SamplingParams(max_tokens=rng.randint(1, 14)),
        )
        for i in range(6)
    ]
    for r in reqs:
        sched.add_request(r)
    dropped_with_drafts = 0
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        held = {r.request_id: list(r.spec_token_ids) for r in sched.running if r.spec_token_ids}
        out = sched.schedule()
        sched.check_invariants()
        dropped_with_drafts += bool(set(held) & out.preempted_req_ids)
        sampled, before, tables = {}, {}, {}
        for r, n in out.scheduled:
            drafts = out.scheduled_spec_decode_tokens.get(r.request_id, [])
            before[r.request_id] = (r.num_computed_tokens, r.num_tokens, len(drafts))
            assert drafts == held.get(r.request_id, [])[: len(drafts)]
            assert r.num_computed_tokens + n <= get_max_num_kv_tokens(r) or not drafts
            if drafts:
                assert n == 1 + len(drafts) and r.num_computed_tokens == r.num_tokens - 1
            tables[r.request_id] = sched.kv_cache_manager.get_block_ids(r)
            if r.num_computed_tokens + n >= r.num_tokens:
                a = rng.randint(0, len(drafts))  # the verifier accepted a drafts
                sampled[r.request_id] = drafts[:a] + [rng.randrange(50)] if drafts else rng.randrange(50)
        finished = sched.update_from_output(out, sampled)
        sched.check_invariants()
        for r, n in out.scheduled:
            c0, t0, d = before[r.request_id]
            if r in finished:
                continue
            got = sampled.get(r.request_id)
            num_new = (len(got) if isinstance(got, list) else 1) if got is not None else 0
            assert r.num_computed_tokens == (c0 + num_new if d else c0 + n)
            assert r.num_tokens == t0 + num_new
            if r.request_id in sched.kv_cache_manager.block_tables:  # kept, none given back
                blocks = sched.kv_cache_manager.get_block_ids(r)
                assert blocks == tables[r.request_id] and len(blocks) >= cdiv(r.num_computed_tokens, bs)
        # propose random drafts for the running requests (some empty)
        sched.update_draft_token_ids(
            {
                r.request_id: [rng.randrange(50) for _ in range(rng.randint(0, k))]
                for r in sched.requests.values()
            },
        )
        assert all(r.status.name == "RUNNING" for r in sched.requests.values() if r.spec_token_ids)
    assert not sched.has_unfinished_requests()
    assert all(r.is_finished for r in reqs)


def test_preempting_a_request_that_holds_drafts_drops_them():
    sched = Scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    a = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=10))
    b = Request("b", [7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=10))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()  # both prefill: 2 blocks each, the pool is full
    sched.update_from_output(out, {"a": 20, "b": 21})
    sched.update_draft_token_ids({"a": [30, 31], "b": [32]})
    sched.check_invariants()
    out = sched.schedule()  # a's 1 + 2 tokens need a third block: b, holding drafts, is preempted
    sched.check_invariants()
    assert out.preempted_req_ids == {"b"} and out.scheduled_spec_decode_tokens == {"a": [30, 31]}
    sched.update_from_output(out, {"a": [30, 40]})  # one draft accepted, then the target's own
    sched.update_draft_token_ids({"a": [50], "b": [51]})
    assert a.spec_token_ids == [50] and b.spec_token_ids == []  # b, preempted, keeps none
    sched.check_invariants()
    assert a.output_token_ids == [20, 30, 40] and a.num_computed_tokens == 8
    assert len(sched.kv_cache_manager.get_block_ids(a)) == 3  # the rejected slot's block stays
    out = sched.schedule()  # b is readmitted: it re-prefills prompt + its token, no drafts
    sched.check_invariants()
    assert "b" not in out.scheduled_spec_decode_tokens and b.num_computed_tokens == 0
