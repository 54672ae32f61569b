"""Tests for the continuous-batching schedulers (minipaged/core/sched/: vLLM v1's Scheduler and the paper's PaperScheduler).

Independent references: schedules worked out by hand for tiny cases; a fake paged model
that reads every context back through the block tables and must reproduce the outputs of
a plain loop without any scheduler (``_fake_paged_model.reference_outputs``); the
refusal rule and the preemption victim recomputed from first principles.
"""

from __future__ import annotations

import math

import pytest
from _fake_paged_model import FakePagedModel, reference_outputs
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.core import (
    PaperScheduler,
    PaperSchedulerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from minipaged.sampling_params import SamplingParams
from minipaged.trace import EngineTrace, record_step, run_scheduler


def req(rid, prompt_len, max_tokens, **kw):
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=kw.pop("ignore_eos", False),
        stop_token_ids=kw.pop("stop_token_ids", None),
    )
    return Request(rid, [(i * 7 + 3) % 50 for i in range(prompt_len)], params, **kw)


def const_token(tok=7):
    return lambda r: tok


def drive(sched, arrivals, next_token=const_token(), max_steps=1000):  # noqa: B008 (a stateless token function)
    """Run to completion; per step: scheduled {id: n}, preempted, swapped out/in, finished."""
    log = []
    step = 0
    last = max(arrivals, default=0)
    while step <= last or sched.has_unfinished_requests():
        assert step < max_steps
        for r in arrivals.get(step, ()):
            sched.add_request(r)
        out = sched.schedule()
        sched.check_invariants()
        sampled = {
            r.request_id: next_token(r) for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens
        }
        fin = sched.update_from_output(out, sampled)
        sched.check_invariants()
        tables = {r.request_id: sched.kv_cache_manager.get_block_ids(r.request_id) for r in sched.running}
        paper = isinstance(out, PaperSchedulerOutput)
        log.append(
            dict(
                scheduled=out.num_scheduled_tokens,
                preempted=[r.request_id for r in out.preempted],
                swapped_out=[r.request_id for r in out.swapped_out] if paper else [],
                swapped_in=[r.request_id for r in out.swapped_in] if paper else [],
                finished=[r.request_id for r in fin],
                tables=tables,
                out=out,
            )
        )
        step += 1
    return log


# -- hand-checked schedules -------------------------------------------------------------
def test_chunked_prefill_by_hand():
    # budget 6: A's 5-token prompt runs whole, B's 4-token prompt is split 1 + 3 and
    # rides along with A's decodes.
    s = PaperScheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    a, b = req("A", 5, 3), req("B", 4, 2)
    log = drive(s, {0: [a, b]})
    assert [e["scheduled"] for e in log] == [{"A": 5, "B": 1}, {"A": 1, "B": 3}, {"A": 1, "B": 1}]
    assert [e["out"].prefill_ids for e in log] == [["A", "B"], ["B"], []]
    assert [e["out"].decode_ids for e in log] == [[], ["A"], ["A", "B"]]
    assert log[0]["tables"] == {"A": [0, 1], "B": [2]}
    assert log[1]["tables"] == {"A": [0, 1], "B": [2]}
    assert log[2]["finished"] == ["A", "B"]
    assert a.output_token_ids == [7, 7, 7] and b.output_token_ids == [7, 7]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert s.kv_cache_manager.get_num_free_blocks() == 8


def test_recompute_preemption_by_hand():
    # 4 blocks of 2 slots. A and B (prompt 3) fill the pool after their first decode;
    # at step 2 A needs a 3rd block: B (the later arrival) is preempted, its blocks
    # [2, 3] freed tail first (3, then 2), and A takes block 3. B comes back at step 4
    # and re-prefills its prompt plus its 2 output tokens (5 tokens) in one go.
    s = PaperScheduler(num_blocks=4, block_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    a, b = req("A", 3, 4), req("B", 3, 4)
    log = drive(s, {0: [a, b]})
    assert [e["scheduled"] for e in log] == [
        {"A": 3, "B": 3},
        {"A": 1, "B": 1},
        {"A": 1},
        {"A": 1},
        {"B": 5},
        {"B": 1},
    ]
    assert [e["preempted"] for e in log] == [[], [], ["B"], [], [], []]
    assert log[1]["tables"] == {"A": [0, 1], "B": [2, 3]}
    assert log[2]["tables"] == {"A": [0, 1, 3]}
    assert log[3]["finished"] == ["A"]
    # A freed [0, 1, 3] tail first, behind the still-free 2: the queue is 2, 3, 1, 0
    assert log[4]["tables"] == {"B": [2, 3, 1]}
    assert log[4]["out"].admitted == [b] and log[4]["out"].prefill_ids == ["B"]
    assert b.num_preemptions == 1 and b.output_token_ids == [7] * 4
    assert s.kv_cache_manager.get_num_free_blocks() == 4


def test_swap_preemption_by_hand():
    # The same workload with swapping: B's two blocks go to CPU blocks 0 and 1 and come
    # back into device blocks 2 and 3; B then only decodes (no 5-token re-prefill).
    s = PaperScheduler(
        num_blocks=4,
        block_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        preemption_mode="swap",
        num_cpu_blocks=4,
    )
    a, b = req("A", 3, 4), req("B", 3, 4)
    log = drive(s, {0: [a, b]})
    assert [e["scheduled"] for e in log] == [
        {"A": 3, "B": 3},
        {"A": 1, "B": 1},
        {"A": 1},
        {"A": 1},
        {"B": 1},
        {"B": 1},
    ]
    assert [e["swapped_out"] for e in log] == [[], [], ["B"], [], [], []]
    assert [e["swapped_in"] for e in log] == [[], [], [], [], ["B"], []]
    assert log[2]["out"].blocks_to_swap_out == [(2, 0), (3, 1)]
    assert log[2]["out"].preempted == []
    assert log[4]["out"].blocks_to_swap_in == [(0, 2), (1, 3)]
    assert log[4]["tables"] == {"B": [2, 3, 1]}
    assert log[4]["out"].decode_ids == ["B"]
    assert s.kv_cache_manager.get_num_free_cpu_blocks() == 4


def test_swap_falls_back_to_recompute_when_cpu_pool_is_full():
    s = PaperScheduler(
        num_blocks=4,
        block_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        preemption_mode="swap",
        num_cpu_blocks=1,
    )
    a, b = req("A", 3, 4), req("B", 3, 4)
    log = drive(s, {0: [a, b]})
    assert log[2]["preempted"] == ["B"] and log[2]["swapped_out"] == []
    assert log[4]["scheduled"] == {"B": 5}


def test_head_of_line_blocking_is_fcfs():
    # C would fit, but B arrived first and does not: C waits behind B.
    s = PaperScheduler(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=12)
    a, b, c = req("A", 12, 2), req("B", 8, 2), req("C", 2, 2)
    log = drive(s, {0: [a, b, c]})
    assert log[0]["scheduled"] == {"A": 12}  # the whole budget
    assert log[1]["scheduled"] == {"A": 1}  # B needs 2 blocks, 1 free; C must not jump
    admitted = [r.request_id for e in log for r in e["out"].admitted]
    assert admitted == ["A", "B", "C"]


def test_victim_is_latest_arrival_not_latest_admitted():
    # Four requests share a tiny pool; every preemption must take the latest arrival
    # among the running ones, even after re-admissions reordered nothing.
    s = PaperScheduler(num_blocks=6, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [req(f"r{i}", 3, 6) for i in range(4)]
    seq = {r.request_id: i for i, r in enumerate(reqs)}
    step = 0
    for r in reqs:
        s.add_request(r)
    n_preempt = 0
    while s.has_unfinished_requests():
        before = sorted((r.request_id for r in s.running), key=seq.get)
        out = s.schedule()
        victims = [r.request_id for r in out.preempted]
        n_preempt += len(victims)
        assert victims == before[::-1][: len(victims)]
        s.update_from_output(
            out, {r.request_id: 7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
        )
        s.check_invariants()
        step += 1
    assert n_preempt > 0
    assert all(r.num_output_tokens == 6 for r in reqs)


def test_max_num_seqs_and_token_budget_bound_the_batch():
    s = PaperScheduler(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=5)
    reqs = [req(f"r{i}", 4, 3) for i in range(4)]
    log = drive(s, {0: reqs})
    for e in log:
        assert len(e["scheduled"]) <= 2 and sum(e["scheduled"].values()) <= 5
    assert log[0]["scheduled"] == {"r0": 4, "r1": 1}


def test_chunking_off_prompt_waits_for_budget_whole():
    s = PaperScheduler(
        num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False
    )
    a, b = req("A", 6, 3), req("B", 4, 2)
    log = drive(s, {0: [a, b]})
    # B's 4 tokens do not fit the 2 left at step 0 and must not be split
    assert log[0]["scheduled"] == {"A": 6}
    assert log[1]["scheduled"] == {"A": 1, "B": 4}


def test_chunking_off_recomputed_request_longer_than_budget_is_chunked():
    # B is preempted at step 5 with prompt 4 + 5 outputs = 9 tokens > budget 8. With
    # chunking off it still resumes, in chunks of 8 + 1, or it could never run again.
    s = PaperScheduler(
        num_blocks=8, block_size=2, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False
    )
    a, b = req("A", 4, 10), req("B", 4, 10)
    log = drive(s, {0: [a, b]})
    assert [e["preempted"] for e in log].index(["B"]) == 5
    b_steps = [e["scheduled"]["B"] for e in log if "B" in e["scheduled"]]
    # prefill 4, decodes to 5 outputs, preempted, re-prefill 8 + 1, decodes to 10 outputs
    assert b_steps == [4, 1, 1, 1, 1, 8, 1, 1, 1, 1, 1]
    resumed = [e["out"] for e in log if e["scheduled"].get("B") == 8][0]
    after = log[[e["out"] for e in log].index(resumed) + 1]["out"]
    assert "B" in resumed.prefill_ids and "B" in after.decode_ids  # the last re-prefill
    # token is also the newest token: it computes exactly like a decode
    assert b.num_output_tokens == 10 and a.num_output_tokens == 10


# -- stop conditions ------------------------------------------------------------------
def test_stop_conditions():
    s = PaperScheduler(num_blocks=32, block_size=4, max_model_len=7)
    eos = req("eos", 2, 10, eos_token_id=7)
    ign = req("ign", 2, 3, eos_token_id=7, ignore_eos=True)
    stop = req("stop", 2, 10, stop_token_ids=[7])
    ctx = req("ctx", 4, 10)  # prompt 4 + 3 outputs reaches max_model_len 7
    drive(s, {0: [eos, ign, stop, ctx]})
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [7]
    assert "eos" in eos.stop_reason
    assert ign.status == RequestStatus.FINISHED_LENGTH and ign.output_token_ids == [7, 7, 7]
    assert "max_tokens" in ign.stop_reason
    assert stop.status == RequestStatus.FINISHED_STOPPED and "stop token 7" in stop.stop_reason
    assert ctx.status == RequestStatus.FINISHED_LENGTH and ctx.num_tokens == 7
    assert "max_model_len" in ctx.stop_reason


# -- refusal and bad input ------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
        (dict(preemption_mode="evict"), "preemption_mode"),
        (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(preemption_mode="swap"), "num_cpu_blocks"),
    ],
)
def test_bad_constructor_arguments(kwargs, name):
    args = dict(num_blocks=8, block_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        PaperScheduler(**args)


def test_add_request_validation_leaves_state_unchanged():
    s = PaperScheduler(num_blocks=8, block_size=4, max_model_len=16)
    a = req("A", 4, 4)
    s.add_request(a)
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("A", 3, 2))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(req("long", 17, 1))
    running = req("X", 2, 2)
    running.status = RequestStatus.RUNNING
    with pytest.raises(ValueError, match="not fresh"):
        s.add_request(running)
    with pytest.raises(ValueError, match="Request"):
        s.add_request("A")
    assert list(s.waiting) == [a] and set(s.requests) == {"A"}
    s.check_invariants()
    # prompt + max_tokens beyond max_model_len is fine: it stops at max_model_len
    s.add_request(req("cap", 10, 100))
    s.check_invariants()


def test_request_too_big_is_refused_and_others_unaffected():
    def run(with_big):
        s = PaperScheduler(num_blocks=4, block_size=4, max_num_batched_tokens=16)
        reqs = [req("A", 5, 4), req("B", 3, 6)]
        arr = {0: reqs[:1], 1: reqs[1:]}
        big = req("big", 10, 8)  # 17 KV tokens -> 5 blocks > 4
        if with_big:
            arr[0] = [big] + arr[0]
        log = drive(s, arr, next_token=lambda r: r.num_tokens % 11)
        return reqs, big, log, s

    ref, _, ref_log, _ = run(False)
    reqs, big, log, s = run(True)
    assert big.status == RequestStatus.FINISHED_IGNORED
    assert "5 KV blocks" in big.stop_reason and "4 blocks" in big.stop_reason
    assert log[0]["out"].refused == [big] and log[0]["finished"][0] is not None
    assert "big" in log[0]["finished"] and "big" not in log[0]["scheduled"]
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref]
    assert [e["scheduled"] for e in log] == [e["scheduled"] for e in ref_log]
    assert "big" not in s.requests  # refused, hence finished: forgotten


def test_prompt_over_budget_with_chunking_off_is_refused():
    s = PaperScheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    r = req("r", 9, 2)
    s.add_request(r)
    out = s.schedule()
    assert out.refused == [r] and not out.scheduled
    assert "max_num_batched_tokens=8" in r.stop_reason
    assert s.update_from_output(out, {}) == [r]
    assert not s.has_unfinished_requests()
    s.check_invariants()


def test_abort_in_every_state_frees_blocks():
    s = PaperScheduler(
        num_blocks=4, block_size=2, max_num_batched_tokens=16, preemption_mode="swap", num_cpu_blocks=4
    )
    a, b, c = req("A", 3, 4), req("B", 3, 4), req("C", 2, 2)
    for r in (a, b, c):
        s.add_request(r)
    for _ in range(3):  # step 2 swaps B out; C is still waiting
        out = s.schedule()
        s.update_from_output(
            out, {r.request_id: 7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
        )
    assert [r.request_id for r in s.swapped] == ["B"] and list(s.waiting) == [c]
    s.abort_request("B")  # swapped
    s.abort_request("C")  # waiting
    s.check_invariants()
    out = s.schedule()
    s.abort_request("A")  # running, scheduled this step
    s.check_invariants()
    assert s.update_from_output(out, {"A": 7}) == []
    for r in (a, b, c):
        assert r.status == RequestStatus.FINISHED_ABORTED and r.stop_reason == "aborted"
    assert s.kv_cache_manager.get_num_free_blocks() == 4
    assert s.kv_cache_manager.get_num_free_cpu_blocks() == 4
    assert not s.has_unfinished_requests()
    s.abort_request("A")  # finished (and forgotten): nothing to do
    s.abort_request("nope")  # unknown ids are ignored, as in vLLM v1
    assert not s.requests
    s.check_invariants()


def test_update_from_output_misuse():
    s = PaperScheduler(num_blocks=8, block_size=4)
    s.add_request(req("A", 3, 2))
    out = s.schedule()
    with pytest.raises(RuntimeError, match="twice"):
        s.schedule()
    with pytest.raises(ValueError, match="A"):
        s.update_from_output(out, {})  # A's prefill completes: it needs a token
    with pytest.raises(ValueError, match="last schedule"):
        s.update_from_output(SchedulerOutput(), {})
    s.update_from_output(out, {"A": 1})
    s.check_invariants()


@pytest.mark.parametrize("cls", [Scheduler, PaperScheduler])
def test_update_from_output_takes_the_workers_output_or_a_dict(cls):
    """A ``ModelRunnerOutput`` (``req_ids`` + one token list per request, ``[]`` for a
    prefill chunk; duck-typed: core/ imports no worker) and a dict of ints or lists give
    the same step (``utils.sampled_tokens``, the one place the shapes meet)."""
    from types import SimpleNamespace

    from minipaged.core.sched.utils import sampled_tokens

    runs = []
    for sampled in (
        {"A": 9},
        {"A": [9]},
        SimpleNamespace(req_ids=["A", "B"], req_id_to_index={"A": 0, "B": 1}, sampled_token_ids=[[9], []]),
    ):
        s = cls(num_blocks=8, block_size=4, max_num_batched_tokens=5)
        s.add_request(req("A", 3, 4))
        s.add_request(req("B", 6, 4))
        out = s.schedule()  # A's whole prompt, B's first 2 tokens
        s.update_from_output(out, sampled)
        s.check_invariants()
        runs.append([(r.request_id, r.num_computed_tokens, r.output_token_ids) for r in s.running])
    assert runs[0] == runs[1] == runs[2] == [("A", 3, [9]), ("B", 2, [])]
    assert sampled_tokens({"A": 1, "B": (2, 3)}) == {"A": [1], "B": [2, 3]}
    with pytest.raises(ValueError, match="ModelRunnerOutput or a dict"):
        sampled_tokens([[1]])


def test_finished_request_id_can_be_reused():
    s = PaperScheduler(num_blocks=8, block_size=4)
    drive(s, {0: [req("A", 3, 1)]})
    again = req("A", 2, 1)
    drive(s, {0: [again]})
    assert again.status == RequestStatus.FINISHED_LENGTH and not s.requests


def test_record_step_and_run_scheduler_trace():
    s = PaperScheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16)
    a, b = req("A", 3, 4), req("B", 3, 4)
    trace = run_scheduler(s, {0: [a], 1: [b]}, const_token())
    trace.check_invariants()
    assert trace.steps[0].scheduled == {"A": 3} and trace.steps[0].arrived_ids == ["A"]
    assert trace.steps[1].arrived_ids == ["B"]
    assert sum(len(step.preempted_ids) for step in trace.steps) >= 1
    for step in trace.steps:
        assert set(step.block_tables) == set(step.num_tokens)
        for rid, table in step.block_tables.items():
            assert len(table) == math.ceil(step.num_tokens[rid] / 2)
    assert trace.requests["B"]["finish_step"] == len(trace) - 1
    again = EngineTrace.from_json(trace.to_json())
    assert again.to_dict() == trace.to_dict()
    rec = record_step(s, s._last_output, 99)
    assert rec.step == 99 and rec.num_free_blocks == 4


# -- property tests -------------------------------------------------------------------
request_spec = st.tuples(
    st.integers(0, 8),  # arrival step
    st.integers(1, 20),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.sampled_from([None, 0, 3]),  # eos token id
    st.booleans(),  # ignore_eos
)

config = st.fixed_dictionaries(
    dict(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(1, 16),
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.integers(1, 24),
        enable_chunked_prefill=st.booleans(),
        preemption_mode=st.sampled_from(["recompute", "swap"]),
        num_cpu_blocks=st.integers(1, 12),
        max_model_len=st.sampled_from([None, 8, 40]),
    )
)


def expected_refusal(r, c, chunking=True):
    """The refusal rule, recomputed: max KV tokens over the pool, or prompt over budget."""
    if c["max_model_len"] is not None and r.num_prompt_tokens > c["max_model_len"]:
        return "error"
    kv = r.num_prompt_tokens + r.max_tokens - 1
    if c["max_model_len"] is not None:
        kv = max(r.num_prompt_tokens, min(kv, c["max_model_len"] - 1))
    if -(-kv // c["block_size"]) > c["num_blocks"]:
        return "refused"
    if not chunking and r.num_prompt_tokens > c["max_num_batched_tokens"]:
        return "refused"
    return None


def run_property(sched_cls, c, specs, chunking):
    sched = sched_cls(**c)
    model = FakePagedModel(c["block_size"])
    arrivals: dict[int, list[Request]] = {}
    reqs = []
    for i, (step, plen, mt, eos, ign) in enumerate(specs):
        r = req(f"r{i}", plen, mt, eos_token_id=eos, ignore_eos=ign)
        r.prompt_token_ids = [(i * 13 + j * 5) % 50 for j in range(plen)]
        arrivals.setdefault(step, []).append(r)
        reqs.append(r)
    order = []  # requests in add order (FCFS)
    admitted_order = []
    step, last = 0, max(arrivals)
    # Livelock bound: every step computes >= 1 token of the earliest running request.
    bound = last + 1 + sum(2 * (r.num_prompt_tokens + r.max_tokens) * (len(reqs) + 1) for r in reqs)
    outputs = []
    while step <= last or sched.has_unfinished_requests():
        assert step < bound, "no progress (livelock?)"
        for r in arrivals.get(step, ()):
            if expected_refusal(r, c, chunking) == "error":
                with pytest.raises(ValueError):
                    sched.add_request(r)
                continue
            sched.add_request(r)
            order.append(r)
        seq = {r.request_id: i for i, r in enumerate(order)}
        running_before = sorted((r.request_id for r in sched.running), key=seq.get)
        had_work = bool(sched.running or sched.waiting or getattr(sched, "swapped", ()))
        out = sched.schedule()
        outputs.append(out)
        sched.check_invariants()
        if had_work:
            assert out.scheduled, "a step scheduled nothing while requests were waiting"
        paper = isinstance(out, PaperSchedulerOutput)
        victims = [r.request_id for r in (*out.preempted, *(out.swapped_out if paper else ()))]
        # victims in preemption order: the latest arrival first
        victims.sort(key=seq.get, reverse=True)
        assert victims == running_before[::-1][: len(victims)]
        for r in (*out.admitted, *(out.swapped_in if paper else ())):
            admitted_order.append(r.request_id)
        sampled = model.execute(out, sched.kv_cache_manager)
        sched.update_from_output(out, sampled)
        sched.check_invariants()
        step += 1
    # every request finished, nothing leaked
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == c["num_blocks"]
    assert not kv.block_tables and not getattr(kv, "cpu_block_tables", {})
    if hasattr(kv, "cpu_block_pool"):
        assert kv.get_num_free_cpu_blocks() == kv.num_cpu_blocks
    assert not sched.requests, "a finished request is still held"
    for r in order:
        assert r.is_finished, r
        if expected_refusal(r, c, chunking) == "refused":
            assert r.status == RequestStatus.FINISHED_IGNORED and r.stop_reason
            continue
        assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        ref, kind = reference_outputs(r, c["max_model_len"])
        assert r.output_token_ids == ref, r
        assert r.status == (
            RequestStatus.FINISHED_LENGTH if kind == "length" else RequestStatus.FINISHED_STOPPED
        )
    # FCFS: first admissions happen in arrival order
    first = list(dict.fromkeys(admitted_order))
    served = [r.request_id for r in order if r.status != RequestStatus.FINISHED_IGNORED]
    assert first == served
    return sched, outputs


@settings(max_examples=300, deadline=None)
@given(c=config, specs=st.lists(request_spec, min_size=1, max_size=8))
def test_scheduler_random_workloads(c, specs):
    if c["preemption_mode"] == "recompute":
        c = dict(c, num_cpu_blocks=0)
    run_property(PaperScheduler, c, specs, c["enable_chunked_prefill"])


@settings(max_examples=150, deadline=None)
@given(
    c=config, specs=st.lists(request_spec, min_size=1, max_size=8), pressure=st.booleans(), full=st.booleans()
)
def test_v1_scheduler_alone_random_workloads(c, specs, pressure, full):
    """vLLM v1's ``Scheduler``: both admission rules (``scheduler_reserve_full_isl``),
    recompute only."""
    c = {k: v for k, v in c.items() if k not in ("preemption_mode", "num_cpu_blocks")}
    if pressure:  # a pool just big enough for the largest request: preemption is common
        bs = c["block_size"]
        c["num_blocks"] = max(c["num_blocks"] // 4, max(-(-(p + m - 1) // bs) for _, p, m, _, _ in specs))
    c["scheduler_reserve_full_isl"] = full
    sched, _ = run_property(Scheduler, c, specs, c["enable_chunked_prefill"])
    assert not hasattr(sched, "swapped") and not hasattr(sched, "seq_groups")


def test_v1_scheduler_equals_paper_scheduler_with_paper_mechanisms_off():
    """With the watermark off, recompute preemption and no groups, the paper's loop makes
    exactly the v1 loop's steps under v1's first-chunk rule (and under FCFS the paper's
    victim, the latest arrival, is v1's, the last of running)."""
    import random

    rng = random.Random(0)
    for _ in range(20):
        reqs = [(rng.randint(0, 6), rng.randint(1, 20), rng.randint(1, 12)) for _ in range(10)]
        traces = []
        for cls, extra in (
            # NOTE: the paper's scheduler frees every block to the back; v1's the same here
            (Scheduler, {"scheduler_reserve_full_isl": False, "free_uncached_first": False}),
            (PaperScheduler, {"watermark": None}),
        ):
            s = cls(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, **extra)
            arrivals = {}
            for i, (at, plen, mt) in enumerate(reqs):
                arrivals.setdefault(at, []).append(req(f"r{i}", plen, mt))
            traces.append(run_scheduler(s, arrivals, const_token()).to_dict()["steps"])
        assert traces[0] == traces[1]


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(request_spec, min_size=3, max_size=8),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 6),
    swap=st.booleans(),
    num_cpu_blocks=st.one_of(st.integers(1, 4), st.integers(16, 48)),
    chunking=st.booleans(),
)
def test_scheduler_under_heavy_pressure_preempts_and_finishes(
    specs, block_size, extra_blocks, swap, num_cpu_blocks, chunking
):
    # a pool just big enough for the largest request: preemption is the common case, and a
    # small CPU pool makes swap fall back to recompute
    need = max(-(-(plen + mt - 1) // block_size) for _, plen, mt, _, _ in specs)
    c = dict(
        block_size=block_size,
        num_blocks=need + extra_blocks,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        enable_chunked_prefill=chunking,
        preemption_mode="swap" if swap else "recompute",
        num_cpu_blocks=num_cpu_blocks if swap else 0,
        max_model_len=None,
    )
    run_property(PaperScheduler, c, specs, chunking)


# -- KVCacheManager swap bookkeeping (used by the scheduler) ---------------------------
def test_kv_cache_manager_swap_is_all_or_nothing():
    from minipaged.core import BlockSpaceManager

    kv = BlockSpaceManager(num_blocks=4, block_size=2, num_cpu_blocks=3)
    kv.allocate_slots("a", 5)  # 3 blocks
    kv.allocate_slots("b", 2)  # 1 block
    assert kv.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    assert kv.get_cpu_block_ids("a") == [0, 1, 2] and kv.get_num_free_blocks() == 3
    assert kv.swap_out("b") is None  # CPU pool full: nothing changes
    assert kv.get_block_ids("b") == [3] and kv.get_num_free_cpu_blocks() == 0
    kv.check_invariants()
    kv.allocate_slots("c", 3)  # 2 of the 3 free device blocks
    assert not kv.can_swap_in("a") and kv.swap_in("a") is None
    assert kv.get_cpu_block_ids("a") == [0, 1, 2]
    kv.free("c")
    assert kv.can_swap_in("a", 1) and not kv.can_swap_in("a", 2)  # 5 + 2 tokens = 4 blocks
    mapping = kv.swap_in("a")
    assert [c for c, _ in mapping] == [0, 1, 2] and kv.get_block_ids("a") == [d for _, d in mapping]
    assert kv.block_tables["a"].num_tokens == 5 and kv.get_num_free_cpu_blocks() == 3
    kv.check_invariants()
    with pytest.raises(ValueError, match="not swapped"):
        kv.swap_in("a")
    with pytest.raises(ValueError, match="not swapped"):
        kv.free_swapped("b")
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        BlockSpaceManager(4, 2, num_cpu_blocks=-1)
    from minipaged.core import KVCacheManager

    assert not hasattr(KVCacheManager(4, 2), "swap_out")  # vLLM v1's manager never swaps
    kv0 = BlockSpaceManager(4, 2)
    kv0.allocate_slots("x", 1)
    assert kv0.swap_out("x") is None and kv0.get_num_free_cpu_blocks() == 0


# -- groups re-prefilling more than the budget; livelock guard ---------------------------
def _group(prefix, n, prompt_len, max_tokens):
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    prompt = [(i * 7 + 3) % 50 for i in range(prompt_len)]
    return [Request(f"{prefix}{i}", list(prompt), params) for i in range(n)]


def _drive_checked(sched, arrivals, max_steps=2000):
    """Like ``run_scheduler`` (items that are lists are groups), checking at every step
    that a scheduler with unfinished requests makes progress: it schedules tokens,
    preempts, swaps out or refuses. Returns the per-step outputs."""
    outs, step, last = [], 0, max(arrivals, default=0)
    while step <= last or sched.has_unfinished_requests():
        assert step < max_steps, "not finished: livelock"
        for item in arrivals.get(step, ()):
            if isinstance(item, list):
                sched.add_request_group(item)
            else:
                sched.add_request(item)
        had_work = bool(sched.running or sched.waiting or getattr(sched, "swapped", ()))
        out = sched.schedule()
        paper = isinstance(out, PaperSchedulerOutput)
        sched.check_invariants()
        if had_work:
            assert out.scheduled or out.preempted or out.refused or (paper and out.swapped_out), (
                f"step {step}: nothing scheduled, preempted or refused"
            )
        sampled = {r.request_id: 7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
        sampled.update({c.request_id: 7 for _, c in out.fork_samples} if paper else {})
        sched.update_from_output(out, sampled)
        sched.check_invariants()
        outs.append(out)
        step += 1
    return outs


def test_group_reprefill_over_budget_with_chunking_off_is_split():
    # The simulator's repro. "old" and a group of 4 share 24 blocks of 4; at step 17 the
    # group (17 outputs each) is preempted by recompute. When it comes back, the leader
    # re-prefills the 8-token prompt, the others fork, and each must re-prefill its 17
    # outputs: 68 tokens > max_num_batched_tokens 64. Chunking is off, yet the group must
    # be split (17 + 17 + 17 + 13, then the last 4), or it would never run again.
    s = PaperScheduler(
        num_blocks=24,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        enable_chunked_prefill=False,
        max_model_len=256,
    )
    old = req("old", 8, 60, ignore_eos=True)
    group = _group("g", 4, 8, 20)
    outs = _drive_checked(s, {0: [old, group]})
    assert [r.request_id for r in outs[17].preempted] == ["g0", "g1", "g2", "g3"]
    sched = [o.num_scheduled_tokens for o in outs]
    split = [i for i, d in enumerate(sched) if d == {"g0": 17, "g1": 17, "g2": 17, "g3": 13}]
    assert len(split) == 1
    assert sched[split[0] + 1] == {"g0": 1, "g1": 1, "g2": 1, "g3": 4}
    for r in (old, *group):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [7] * r.max_tokens
    assert s.kv_cache_manager.get_num_free_blocks() == 24


def test_livelock_guard_raises_instead_of_an_empty_step(monkeypatch):
    s = PaperScheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    s.add_request(req("A", 4, 3))
    monkeypatch.setattr(s, "_admit_next", lambda *a: None)  # a broken admission
    with pytest.raises(RuntimeError, match="livelock"):
        s.schedule()


group_spec = st.tuples(st.integers(1, 4), st.integers(1, 12), st.integers(1, 12), st.integers(0, 6))


@settings(max_examples=120, deadline=None)
@given(
    groups=st.lists(group_spec, min_size=1, max_size=5),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 8),
    budget=st.integers(1, 16),
    chunking=st.booleans(),
    swap=st.booleans(),
    watermark=st.sampled_from([0.0, 0.01, 0.2]),
)
def test_no_livelock_with_groups_small_budgets_and_tight_pools(
    groups, block_size, extra_blocks, budget, chunking, swap, watermark
):
    # Every step with unfinished work schedules, preempts or refuses something, and every
    # request the engine can serve finishes with all its tokens.
    arrivals: dict[int, list] = {}
    reqs = []
    for k, (n, plen, mt, at) in enumerate(groups):
        seqs = _group(f"q{k}.", n, plen, mt)
        arrivals.setdefault(at, []).append(seqs if n > 1 else seqs[0])
        reqs.extend(seqs)
    need = max(-(-(plen + mt - 1) // block_size) * n for n, plen, mt, _ in groups)
    s = PaperScheduler(
        num_blocks=need + extra_blocks,
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunking,
        preemption_mode="swap" if swap else "recompute",
        num_cpu_blocks=8 if swap else 0,
        watermark=watermark,
    )
    _drive_checked(s, arrivals)
    for r in reqs:
        assert r.is_finished
        if r.status != RequestStatus.FINISHED_IGNORED:
            assert r.output_token_ids == [7] * r.max_tokens
    assert s.kv_cache_manager.get_num_free_blocks() == s.num_blocks


# -- admission watermark (vLLM v0 can_allocate) ------------------------------------------
@pytest.mark.parametrize("bad", [-0.1, 1.0, 2, "0.1", True])
def test_bad_watermark(bad):
    with pytest.raises(ValueError, match="watermark"):
        PaperScheduler(8, 4, watermark=bad)


def test_watermark_default_and_blocks():
    assert PaperScheduler(8, 4).watermark == 0.05 and PaperScheduler(8, 4).watermark_blocks == 0
    assert PaperScheduler(250, 4).watermark_blocks == 12  # int(0.05 * 250), as vLLM v0
    assert PaperScheduler(250, 4, watermark=0.01).watermark_blocks == 2
    assert PaperScheduler(10, 4, watermark=0.25).watermark_blocks == 2
    assert PaperScheduler(10, 4, watermark=None).watermark_blocks == 0


def test_new_request_waits_until_its_whole_prompt_fits():
    # 8 blocks of 4, budget 8, chunked prefill on. A (prompt 8, 10 outputs, at most 17
    # tokens = 5 blocks) runs; from step 1 A holds 3 blocks (5 free). B's first chunk
    # (7 tokens, 2 blocks) would fit, but its whole 24-token prompt needs 6 blocks > 5:
    # B waits instead of starting a prefill that must be preempted. A finishes at step 9
    # (its 10th output); B is admitted at step 10 and runs 8 + 8 + 8, then decodes once.
    s = PaperScheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = req("A", 8, 10, ignore_eos=True), req("B", 24, 2, ignore_eos=True)
    log = drive(s, {0: [a, b]})
    assert [e["scheduled"] for e in log] == (
        [{"A": 8}] + [{"A": 1}] * 9 + [{"B": 8}, {"B": 8}, {"B": 8}, {"B": 1}]
    )
    assert [r.request_id for r in log[10]["out"].admitted] == ["B"]
    assert a.num_preemptions == 0 and b.num_preemptions == 0


def test_watermark_none_is_vllm_v1_first_chunk_admission():
    # The same workload with vLLM v1's rule (watermark=None): B's first chunk is admitted
    # at step 1 (7 tokens, 2 of the 5 free blocks) and again 7 at step 2 (14 tokens, 4
    # blocks, 1 free). At step 3 A's decode fits its 3rd block but B's next 7 tokens need
    # 2 more blocks: B, the latest arrival, is preempted and its 14 tokens are lost.
    # The cycle repeats as A grows (preempted again at steps 6 and 9): 42 tokens wasted,
    # and B still starts for good only at step 10.
    s = PaperScheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, watermark=None)
    a, b = req("A", 8, 10, ignore_eos=True), req("B", 24, 2, ignore_eos=True)
    log = drive(s, {0: [a, b]})
    cycle = [{"A": 1, "B": 7}, {"A": 1, "B": 7}, {"A": 1}]
    assert [e["scheduled"] for e in log] == (
        [{"A": 8}] + cycle * 3 + [{"B": 8}, {"B": 8}, {"B": 8}, {"B": 1}]
    )
    assert [i for i, e in enumerate(log) if e["preempted"]] == [3, 6, 9]
    assert b.num_preemptions == 3 and b.output_token_ids == [7, 7]


def test_watermark_keeps_blocks_free_but_never_blocks_an_idle_engine():
    # watermark 0.5 of 10 blocks = 5 blocks kept free when something runs. A (8 tokens,
    # 2 blocks) is admitted alone; B (4 tokens, 1 block) would leave 10 - 2 - 1 = 7 >= 5
    # free: admitted with A. C (12 tokens, 3 blocks) would leave 10 - 3 - 3 = 4 < 5: it
    # waits for A and B to finish. D (36 tokens, 9 blocks > 10 - 5) is admitted when
    # nothing runs, or it could never run.
    s = PaperScheduler(num_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark=0.5)
    a, b = req("A", 8, 2, ignore_eos=True), req("B", 4, 2, ignore_eos=True)
    c, d = req("C", 12, 1, ignore_eos=True), req("D", 36, 2, ignore_eos=True)
    log = drive(s, {0: [a, b, c, d]})
    assert [[r.request_id for r in e["out"].admitted] for e in log] == [
        ["A", "B"],
        [],
        ["C"],
        ["D"],
        [],
    ]
    assert all(not e["preempted"] for e in log)
    assert all(r.is_finished and r.num_preemptions == 0 for r in (a, b, c, d))
