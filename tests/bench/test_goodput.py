"""TTFT / ITL / goodput (minipaged.bench.goodput) against hand-checked cases, the simulator's
own per-request records, and a real engine run whose token counts are known."""

import math

import numpy as np
import pytest

from minipaged.bench.goodput import SLO, drive_engine, latency_report, percentile, token_times
from minipaged.sim import (
    A100_40GB,
    OPT_13B,
    CostModel,
    make_requests,
    poisson_arrivals,
    sample_requests,
    simulate,
)


def test_percentile_is_numpys_linear_rule():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.random(n).tolist()
        for p in (0, 50, 90, 99, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert math.isnan(percentile([], 50))


def test_report_by_hand():
    # a arrives at 0, tokens at 0.3, 0.4, 0.6: TTFT 0.3, gaps 0.1 and 0.2, TPOT 0.15
    # b arrives at 0.5, one token at 0.9: TTFT 0.4, no gap; c never got a token
    arrivals = {"a": 0.0, "b": 0.5, "c": 0.7}
    times = {"a": [0.3, 0.4, 0.6], "b": [0.9]}
    rep = latency_report(arrivals, times, SLO(ttft_s=0.35, tpot_s=0.2), duration=1.0)
    assert rep.ttft[50] == pytest.approx(0.35) and rep.tpot[50] == pytest.approx(0.15)
    assert rep.itl[50] == pytest.approx(0.15)
    assert rep.num_good == 1 and rep.goodput == pytest.approx(1.0) and rep.throughput == pytest.approx(3.0)
    rep = latency_report(arrivals, times, SLO(ttft_s=0.5, tpot_s=0.1), duration=1.0)
    assert rep.num_good == 1  # a's TPOT 0.15 misses 0.1; b meets its TTFT; c has nothing
    with pytest.raises(ValueError, match="not ordered"):
        latency_report({"a": 1.0}, {"a": [0.5]}, SLO(1, 1), 1.0)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "1"])
def test_slo_rejects_bad_targets(bad):
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=bad, tpot_s=0.1)


@pytest.mark.parametrize(
    "policy,rate,kw",
    [
        ("paged", 3.0, {}),  # preemptions (recompute) happen at this rate
        ("paged", 3.0, {"enable_chunked_prefill": True, "max_num_batched_tokens": 512}),
        ("orca-oracle", 2.0, {}),
    ],
)
def test_token_times_agree_with_the_simulators_records(policy, rate, kw):
    cm = CostModel(OPT_13B, A100_40GB)
    lens = sample_requests("sharegpt", 120, 0)
    res = simulate(
        make_requests(lens, poisson_arrivals(len(lens), rate, 0)), policy, cm, record_trace=True, **kw
    )
    times = token_times(res.trace)
    for r in res.records:
        ts = times[r.request_id]
        assert len(ts) == r.output_len
        assert ts[0] == pytest.approx(r.first_token_time) and ts[-1] == pytest.approx(r.finish_time)
    if policy == "paged" and not kw:
        assert sum(r.num_preemptions for r in res.records) > 0


def test_a_real_engine_run_counts_every_token():
    from minipaged import LLM, SamplingParams

    engine = LLM(max_num_seqs=4, num_blocks=64).llm_engine
    lens = [(5, 6), (9, 3), (3, 8), (7, 1), (4, 5)]
    reqs = [
        (f"q{i}", list(range(10, 10 + p)), SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
        for i, (p, m) in enumerate(lens)
    ]
    arrived, times, duration = drive_engine(engine, reqs, [0.0, 0.0, 0.01, 0.02, 0.03])
    assert {rid: len(ts) for rid, ts in times.items()} == {f"q{i}": m for i, (_, m) in enumerate(lens)}
    rep = latency_report(arrived, times, SLO(ttft_s=60.0, tpot_s=60.0), duration)
    assert rep.num_good == len(lens) and 0 < rep.ttft[50] <= duration
