"""Simulator: the real schedulers under a cost model; metrics hand-checked; CLI."""

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.core.sched.orca import OrcaScheduler
from minipaged.sim.arrivals import TraceRequest, make_requests, poisson_arrivals
from minipaged.sim.cost_model import CostModel
from minipaged.sim.simulator import (
    POLICIES,
    RateSweep,
    RequestRecord,
    SimMetrics,
    compute_metrics,
    simulate,
    sustainable_rate,
)


class _Model:
    name = "fake"
    max_model_len = 64
    kv_bytes_per_token = 1


class _GPU:
    name = "fake"


class UnitCost:
    """Every step takes 1 s; ``num_kv_tokens`` slots of KV; swaps are free."""

    model = _Model()
    gpu = _GPU()

    def __init__(self, num_kv_tokens=256):
        self._n = num_kv_tokens

    def num_kv_tokens(self):
        return self._n

    def num_gpu_blocks(self, block_size):
        return self._n // block_size

    def step_time(self, batch):
        return 1.0

    def swap_time(self, num_tokens):
        return 0.0


TWO = [TraceRequest("A", 0.0, 3, 2), TraceRequest("B", 0.5, 2, 3)]


@pytest.mark.parametrize("policy", ["paged", "orca-oracle", "orca-pow2", "orca-max"])
def test_two_requests_by_hand_continuous(policy):
    # step 0 (t 0->1): A prefill (3 tokens), A's 1st token at t=1. B arrived at 0.5.
    # step 1 (t 1->2): A decode + B prefill: A's 2nd (last) token, B's 1st, at t=2.
    # step 2, 3: B decodes; B's 3rd (last) token at t=4.
    res = simulate(TWO, policy, UnitCost(), block_size=4, check=True)
    a, b = res.records
    assert (a.first_token_time, a.finish_time) == (1.0, 2.0)
    assert (b.first_token_time, b.finish_time) == (2.0, 4.0)
    m = res.metrics
    assert m.normalized_latency == pytest.approx((2.0 / 2 + 3.5 / 3) / 2)
    assert m.mean_ttft == pytest.approx((1.0 + 1.5) / 2)
    assert m.mean_tpot == pytest.approx(((2 - 1) / 1 + (4 - 2) / 2) / 2)
    assert m.duration == 4.0
    assert m.request_throughput == pytest.approx(2 / 4)
    assert m.token_throughput == pytest.approx(5 / 4)
    assert m.num_steps == 4
    assert m.mean_batch_size == pytest.approx((1 + 2 + 1 + 1) / 4)
    assert m.num_refused == 0 and m.num_preemptions == 0


def test_two_requests_by_hand_static():
    # B arrives while A's batch runs: it waits for A to finish, then forms its own batch.
    res = simulate(TWO, "static", UnitCost(), block_size=4, check=True)
    a, b = res.records
    assert (a.first_token_time, a.finish_time) == (1.0, 2.0)
    assert (b.first_token_time, b.finish_time) == (3.0, 5.0)
    assert res.metrics.normalized_latency == pytest.approx((2.0 / 2 + 4.5 / 3) / 2)
    assert res.metrics.mean_ttft == pytest.approx((1.0 + 2.5) / 2)


def test_idle_clock_jumps_to_next_arrival():
    reqs = [TraceRequest("A", 0.0, 3, 1), TraceRequest("B", 10.0, 3, 1)]
    res = simulate(reqs, "paged", UnitCost(), block_size=4)
    assert [r.finish_time for r in res.records] == [1.0, 11.0]
    assert res.metrics.normalized_latency == pytest.approx(1.0)


def test_compute_metrics_by_hand():
    recs = [
        RequestRecord("a", 0.0, 5, 4, first_token_time=1.0, finish_time=4.0),
        RequestRecord("b", 1.0, 5, 1, first_token_time=3.0, finish_time=3.0),
        RequestRecord("c", 2.0, 5, 9, refused=True),
    ]
    m = compute_metrics(recs)
    assert m.num_requests == 2 and m.num_refused == 1
    assert m.normalized_latency == pytest.approx((4 / 4 + 2 / 1) / 2)
    assert m.mean_ttft == pytest.approx((1 + 2) / 2)
    assert m.mean_tpot == pytest.approx(1.0)  # only "a" has >= 2 tokens: (4-1)/3
    assert m.p90_normalized_latency == 2.0
    assert m.request_throughput == pytest.approx(2 / 4)
    with pytest.raises(ValueError):
        compute_metrics([recs[2]])


def _random_requests(n, rate, seed, max_prompt=32, max_output=32):
    rng = random.Random(seed)
    lengths = [(rng.randint(1, max_prompt), rng.randint(1, max_output)) for _ in range(n)]
    return make_requests(lengths, poisson_arrivals(n, rate, seed))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_under_memory_pressure(policy):
    # 256 slots for requests of up to 64 tokens arriving fast: memory is the bottleneck.
    reqs = _random_requests(40, rate=2.0, seed=1)
    res = simulate(reqs, policy, UnitCost(256), block_size=4, check=True, record_trace=True)
    assert res.metrics.num_requests == 40 and res.metrics.num_refused == 0
    for r in res.records:
        assert r.finish_time >= r.first_token_time > r.arrival_time
    tr = res.trace
    tr.check_invariants()
    times = [s.time for s in tr.steps]
    assert all(b > a for a, b in zip(times, times[1:]))
    assert {rid for s in tr.steps for rid in s.finished_ids} == {r.request_id for r in reqs}
    if policy == "paged":
        assert res.metrics.num_preemptions > 0  # the scenario does exercise preemption
    if policy.startswith("orca"):
        # a contiguous pool never holds more than it has: free slots >= 0, tokens fit
        assert all(0 <= s.num_free_blocks <= 256 and sum(s.num_tokens.values()) <= 256 for s in tr.steps)


def test_swap_preemption_finishes_and_costs_time():
    reqs = _random_requests(30, rate=2.0, seed=2)
    rec = simulate(reqs, "paged", CostModel(), block_size=16)  # sanity on the real model
    assert rec.metrics.num_requests == 30
    res = simulate(
        reqs, "paged", UnitCost(256), block_size=4, preemption_mode="swap", num_cpu_blocks=64, check=True
    )
    assert res.metrics.num_requests == 30


def test_refused_request_is_counted_not_run():
    # "huge" fits the context (64) but needs 40 slots of a 32-slot pool: refused.
    reqs = [TraceRequest("ok", 0.0, 10, 5), TraceRequest("huge", 0.0, 20, 20)]
    for policy in ("paged", "orca-oracle"):
        res = simulate(reqs, policy, UnitCost(32), block_size=4, check=True)
        assert res.metrics.num_requests == 1 and res.metrics.num_refused == 1
        assert [r.refused for r in res.records] == [False, True]


class _Tiny(UnitCost):
    model = type("M", (), {"name": "tiny", "max_model_len": 32, "kv_bytes_per_token": 1})()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), slots=st.integers(40, 200), rate=st.floats(0.2, 5.0))
def test_orca_scheduler_never_exceeds_memory(seed, slots, rate):
    reqs = _random_requests(15, rate, seed, max_prompt=16, max_output=16)
    for policy in ("orca-oracle", "orca-pow2", "orca-max"):
        res = simulate(reqs, policy, _Tiny(slots), check=True)  # check_invariants every step
        assert res.metrics.num_requests + res.metrics.num_refused == 15


def test_contiguous_scheduler_direct():
    from minipaged.core.sched.request import Request
    from minipaged.sampling_params import SamplingParams

    s = OrcaScheduler(
        num_slots=10, max_model_len=10, policy="oracle", max_num_seqs=4, max_num_batched_tokens=16
    )
    r1 = Request("r1", [1] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
    r2 = Request("r2", [1] * 4, SamplingParams(max_tokens=3, ignore_eos=True))
    s.add_request(r1, 6)
    s.add_request(r2, 7)  # 6 + 7 > 10: r2 waits for r1's region
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r1", 4)]
    s.update_from_output(out, {"r1": 1})
    s.check_invariants()
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r1", 1)]
    assert s.update_from_output(out, {"r1": 1}) == [r1]
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r2", 4)]
    s.update_from_output(out, {"r2": 1})
    s.check_invariants()
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(r2, 7)


def test_sustainable_rate_interpolation():
    rates = [1.0, 2.0, 3.0, 4.0]
    lat = [0.1, 0.12, 0.3, 0.9]
    assert sustainable_rate(rates, lat, 0.2) == pytest.approx(2.0 + (0.2 - 0.12) / (0.3 - 0.12))
    assert sustainable_rate(rates, lat, 0.05) == 0.0
    assert sustainable_rate(rates, lat, 1.0) == 4.0  # never crossed: the top of the sweep
    with pytest.raises(ValueError, match="increasing"):
        sustainable_rate([2.0, 1.0], [0.1, 0.2], 0.5)
    m = [SimMetrics(1, 0, 1, x, x, 1, 1, 1, 1, 1) for x in lat]
    sw = RateSweep("paged", 3.0, rates, m)
    assert sw.level() == pytest.approx(0.2)  # 2 x the light-load latency 0.1
    assert sw.sustainable_rate() == pytest.approx(sustainable_rate(rates, lat, 0.2))
    assert sw.sustainable_rate(threshold=1.0) == 4.0 and sw.saturated(threshold=1.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        simulate(TWO, "orca-magic", UnitCost())
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([TraceRequest("long", 0.0, 40, 30)], "paged", UnitCost())


def test_cli_quick_json(tmp_path, capsys):
    from minipaged.cli import main

    rc = main(["simulate", "--quick", "--json", "--jobs", "1", "--out-dir", str(tmp_path)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["workloads"]) == {"sharegpt", "alpaca"}
    sg = report["workloads"]["sharegpt"]
    assert set(sg["sweeps"]) == set(POLICIES)
    for sw in sg["sweeps"].values():
        assert len(sw["rates"]) == len(sw["normalized_latency"]) > 1
        assert all(math.isfinite(x) and x > 0 for x in sw["normalized_latency"])
    assert "paged/orca-oracle" in report["headline"]["sharegpt"]
    assert report["block_size"]["alpaca"]["block_sizes"] == [16, 64, 256]
    for name in ("sim_latency_sharegpt.png", "sim_latency_alpaca.png", "sim_block_size.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.parametrize("policy", POLICIES)
def test_parallel_sampling_by_hand(policy):
    # n=2 samples of A (prompt 3, output 2): step 0 prefills (paged: once, then forks;
    # the others: two independent prompts) and gives both samples their 1st token at t=1;
    # step 1 decodes both: done at t=2.
    res = simulate(
        [TraceRequest("A", 0.0, 3, 2)], policy, UnitCost(), n=2, block_size=4, check=True, record_trace=True
    )
    (a,) = res.records
    assert (a.first_token_time, a.finish_time) == (1.0, 2.0)
    first = res.trace.steps[0].scheduled
    assert first == ({"A": 3} if policy == "paged" else {"A": 3, "A.1": 3})
    assert res.trace.steps[1].scheduled == {"A": 1, "A.1": 1}


@pytest.mark.parametrize("policy", ["paged", "orca-oracle", "static"])
def test_parallel_sampling_under_memory_pressure(policy):
    reqs = _random_requests(20, rate=2.0, seed=3, max_prompt=24, max_output=24)
    res = simulate(reqs, policy, UnitCost(256), n=3, block_size=4, check=True)
    assert res.metrics.num_requests == 20
    with pytest.raises(ValueError, match="n must be"):
        simulate(reqs, policy, UnitCost(256), n=0)
