"""The v1 scheduler with drafts in flight, no model: random drafts and random acceptance,
``check_invariants()`` after every schedule and every update, through preemption.

What a verification must do to the scheduler's state, checked by hand each step: the
request advances by ``1 + accepted`` tokens, its table then holds exactly its computed
tokens (rejected and lookahead slots given back), drafts never exceed the budget or the
request's remaining tokens, and a preempted request loses its drafts.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.core.kv.block import cdiv
from minipaged.core.kv.kv_cache_manager import KVCacheManager
from minipaged.core.sched import spec
from minipaged.core.sched.request import Request, get_max_num_kv_tokens
from minipaged.core.sched.scheduler import Scheduler
from minipaged.sampling_params import SamplingParams


def test_trim_slots_by_hand():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", 10)  # 3 blocks
    blocks = kv.get_block_ids("a")
    assert kv.trim_slots("a", 5) == [blocks[2]]  # slots 5..9 given back, block 3 of them whole
    assert kv.get_block_ids("a") == blocks[:2] and kv.get_block_table("a").num_tokens == 5
    assert kv.get_num_free_blocks() == 6
    kv.check_invariants()
    for bad in (0, 6):
        try:
            kv.trim_slots("a", bad)
        except ValueError as e:
            assert "num_tokens" in str(e)
        else:
            raise AssertionError(f"trim_slots({bad}) should fail")


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
    )
    sched.spec_decode.num_lookahead_tokens = k if lookahead else 0  # fmt: skip
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
        held = dict(sched.spec_decode.spec_token_ids)
        out = sched.schedule()
        sched.check_invariants()
        dropped_with_drafts += bool(set(held) & out.preempted_req_ids)
        sampled, before = {}, {}
        for r, n in out.scheduled:
            drafts = out.scheduled_spec_decode_tokens.get(r.request_id, [])
            before[r.request_id] = (r.num_computed_tokens, r.num_tokens, len(drafts))
            assert drafts == held.get(r.request_id, [])[: len(drafts)]
            assert r.num_computed_tokens + n <= get_max_num_kv_tokens(r) or not drafts
            if drafts:
                assert n == 1 + len(drafts) and r.num_computed_tokens == r.num_tokens - 1
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
            table = sched.kv_cache_manager.get_block_table(r)
            assert table.num_tokens == r.num_computed_tokens and len(table.blocks) == cdiv(
                r.num_computed_tokens, bs
            )
        # propose random drafts for the running requests (some empty)
        spec.update_draft_token_ids(
            sched,
            {
                r.request_id: [rng.randrange(50) for _ in range(rng.randint(0, k))]
                for r in sched.requests.values()
            },
        )
        assert all(
            r.status.name == "RUNNING" for r in map(sched.requests.get, sched.spec_decode.spec_token_ids)
        )
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
    spec.update_draft_token_ids(sched, {"a": [30, 31], "b": [32]})
    sched.check_invariants()
    out = sched.schedule()  # a's 1 + 2 tokens need a third block: b, holding drafts, is preempted
    sched.check_invariants()
    assert out.preempted_req_ids == {"b"} and out.scheduled_spec_decode_tokens == {"a": [30, 31]}
    sched.update_from_output(out, {"a": [30, 40]})  # one draft accepted, then the target's own
    spec.update_draft_token_ids(sched, {"a": [50], "b": [51]})
    assert sched.spec_decode.spec_token_ids == {"a": [50]}  # b, preempted, keeps none
    sched.check_invariants()
    assert a.output_token_ids == [20, 30, 40] and a.num_computed_tokens == 8
    assert sched.kv_cache_manager.get_block_table(a).num_tokens == 8  # the rejected slot went back
    out = sched.schedule()  # b is readmitted: it re-prefills prompt + its token, no drafts
    sched.check_invariants()
    assert "b" not in out.scheduled_spec_decode_tokens and b.num_computed_tokens == 0
