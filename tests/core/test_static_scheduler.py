"""Tests for minipaged.core.sched.static.StaticBatchScheduler (the static baseline).

References: a schedule worked out by hand; the generic property run of test_scheduler
(fake paged model vs a plain loop, invariants every step, no leaks, FCFS); and the
baseline's own rules checked step by step: a batch forms only when the previous one is
done, and each member holds its max-length reservation the whole time.
"""

from __future__ import annotations

import test_scheduler as ts
from _fake_paged_model import FakePagedModel
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.core import PaperScheduler, PaperSchedulerOutput, RequestStatus, StaticBatchScheduler
from minipaged.core.sched.request import get_max_num_kv_tokens
from minipaged.trace import run_scheduler

req = ts.req


def test_static_batches_by_hand():
    # A reserves ceil((3 + 4 - 1) / 4) = 2 blocks, B ceil((5 + 5 - 1) / 4) = 3; the batch
    # is full at max_num_seqs=2, so C waits for the whole batch, although 1 block is free
    # from step 0 and 3 more from step 3.
    s = StaticBatchScheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    a, b, c = req("A", 3, 4), req("B", 5, 5), req("C", 2, 2)
    log = ts.drive(s, {0: [a, b, c]})
    assert [e["scheduled"] for e in log] == [
        {"A": 3, "B": 5},
        {"A": 1, "B": 1},
        {"A": 1, "B": 1},
        {"A": 1, "B": 1},
        {"B": 1},
        {"C": 2},
        {"C": 1},
    ]
    assert log[0]["tables"] == {"A": [0, 1], "B": [2, 3, 4]}
    assert log[3]["finished"] == ["A"] and log[4]["finished"] == ["B"]
    # freed tail first, to the front (no hash): B's 4, 3, 2, then A's 1, 0, then 5, never used
    assert log[5]["tables"] == {"C": [4]}
    assert [[r.request_id for r in e["out"].admitted] for e in log] == [
        ["A", "B"],
        [],
        [],
        [],
        [],
        ["C"],
        [],
    ]
    assert s.kv_cache_manager.get_num_free_blocks() == 6


def test_reservation_limits_the_batch():
    # 8 blocks; each request reserves 3 (prompt 4 + max_tokens 8 - 1 = 11 tokens), so
    # only 2 fit a batch although a paged scheduler would run all 4 at once.
    s = StaticBatchScheduler(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [req(f"r{i}", 4, 8) for i in range(4)]
    log = ts.drive(s, {0: reqs})
    assert log[0]["scheduled"] == {"r0": 4, "r1": 4}
    assert len(log[0]["tables"]["r0"]) == 3
    assert s.kv_cache_manager.block_tables == {}  # all released at the end
    c = PaperScheduler(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    reqs2 = [req(f"r{i}", 4, 8) for i in range(4)]
    log2 = ts.drive(c, {0: reqs2})
    assert log2[0]["scheduled"] == {"r0": 4, "r1": 4, "r2": 4, "r3": 4}
    assert len(log2) < len(log)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in reqs2]


def test_prompt_waits_for_budget_and_is_never_chunked():
    s = StaticBatchScheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = req("A", 3, 3), req("B", 6, 2)
    log = ts.drive(s, {0: [a, b]})
    assert log[0]["scheduled"] == {"A": 3}  # B's 6 > 5 left: it waits, whole
    assert log[1]["scheduled"] == {"A": 1, "B": 6}


def test_static_refuses_what_can_never_fit():
    s = StaticBatchScheduler(
        num_blocks=4, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True
    )  # ignored: static never chunks
    big_kv, big_prompt, ok = req("kv", 4, 20), req("prompt", 9, 1), req("ok", 4, 4)
    log = ts.drive(s, {0: [big_kv, big_prompt, ok]})
    assert big_kv.status == big_prompt.status == RequestStatus.FINISHED_IGNORED
    assert "blocks" in big_kv.stop_reason and "max_num_batched_tokens" in big_prompt.stop_reason
    assert ok.status == RequestStatus.FINISHED_LENGTH
    assert log[0]["out"].refused == [big_kv, big_prompt]


def test_static_trace():
    s = StaticBatchScheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    trace = run_scheduler(s, [req("A", 3, 4), req("B", 5, 5), req("C", 2, 2)], lambda r: 7)
    trace.check_invariants()
    # num_tokens reports tokens held, not the reservation: A holds 3 after step 0
    assert trace[0].num_tokens == {"A": 3, "B": 5}
    assert trace[0].block_tables == {"A": [0, 1], "B": [2, 3, 4]}
    assert trace.meta["scheduler"] == "StaticBatchScheduler"


def _static(c: dict) -> dict:
    """A scheduler config without the swap layer's keywords (static batching never preempts)."""
    return {k: v for k, v in c.items() if k not in ("preemption_mode", "num_cpu_blocks")}


@settings(max_examples=200, deadline=None)
@given(c=ts.config, specs=st.lists(ts.request_spec, min_size=1, max_size=8))
def test_static_random_workloads(c, specs):
    ts.run_property(StaticBatchScheduler, _static(c), specs, chunking=False)


@settings(max_examples=60, deadline=None)
@given(c=ts.config, specs=st.lists(ts.request_spec, min_size=1, max_size=8))
def test_static_batch_rules(c, specs):
    c = _static(c)
    s = StaticBatchScheduler(**c)
    model = FakePagedModel(c["block_size"])
    arrivals = {}
    for i, (step, plen, mt, eos, ign) in enumerate(specs):
        arrivals.setdefault(step, []).append(req(f"r{i}", plen, mt, eos_token_id=eos, ignore_eos=ign))
    step, last = 0, max(arrivals)
    while step <= last or s.has_unfinished_requests():
        assert step < 5000
        for r in arrivals.get(step, ()):
            try:
                s.add_request(r)
            except ValueError:
                assert c["max_model_len"] is not None and r.num_prompt_tokens > c["max_model_len"]
        batch_before = list(s.running)
        out = s.schedule()
        if batch_before:
            assert not out.admitted, "admitted while the batch was still running"
        assert not out.preempted and not isinstance(out, PaperSchedulerOutput)
        for r in s.running:  # the full reservation, held from admission to finish
            expect = -(-get_max_num_kv_tokens(r, c["max_model_len"]) // c["block_size"])
            assert len(s.kv_cache_manager.get_block_ids(r.request_id)) == expect
        s.update_from_output(out, model.execute(out, s.kv_cache_manager))
        s.check_invariants()
        step += 1
    assert s.kv_cache_manager.get_num_free_blocks() == c["num_blocks"]
