"""Arrivals: Poisson process statistics, rate scaling, trace files round-trip."""

import math

import pytest

from minipaged.sim.arrivals import (
    TraceRequest,
    load_trace,
    make_requests,
    poisson_arrivals,
    save_trace,
)


def test_poisson_rate_and_gaps():
    n, rate = 20_000, 4.0
    t = poisson_arrivals(n, rate, seed=1)
    assert all(b >= a for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    mean = sum(gaps) / n
    var = sum((g - mean) ** 2 for g in gaps) / n
    # exponential gaps: mean 1/rate, std 1/rate (within sampling error, 4 sigma)
    assert abs(mean - 1 / rate) < 4 * (1 / rate) / math.sqrt(n)
    assert abs(math.sqrt(var) - 1 / rate) < 0.05 / rate


def test_same_seed_same_pattern_at_every_rate():
    a = poisson_arrivals(50, 1.0, seed=3)
    b = poisson_arrivals(50, 2.5, seed=3)
    assert all(abs(x / 2.5 - y) < 1e-12 for x, y in zip(a, b))
    assert poisson_arrivals(50, 1.0, seed=3) == a
    assert poisson_arrivals(50, 1.0, seed=4) != a
    assert poisson_arrivals(5, float("inf")) == [0.0] * 5


def test_bad_arguments():
    with pytest.raises(ValueError, match="request_rate"):
        poisson_arrivals(3, 0.0)
    with pytest.raises(ValueError, match="num_requests"):
        poisson_arrivals(-1, 1.0)
    with pytest.raises(ValueError, match="output_len"):
        TraceRequest("a", 0.0, 3, 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        make_requests([(1, 1), (1, 1)], [1.0, 0.5])


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_trace_round_trip(tmp_path, suffix):
    reqs = make_requests([(10, 5), (200, 1), (3, 70)], [0.0, 0.1234567891234, 2.5])
    path = tmp_path / f"trace{suffix}"
    save_trace(reqs, path)
    assert load_trace(path) == reqs


def test_trace_file_errors(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_time,prompt_len\n0.0,5\n")
    with pytest.raises(ValueError, match="output_len"):
        load_trace(p)
    p = tmp_path / "t.json"
    p.write_text(
        '[{"arrival_time": 1.0, "prompt_len": 4, "output_len": 2}, '
        '{"arrival_time": 0.5, "prompt_len": 3, "output_len": 1}]'
    )
    got = load_trace(p)  # unsorted files are sorted by arrival
    assert [r.prompt_len for r in got] == [3, 4]
    with pytest.raises(ValueError, match=".json or .csv"):
        load_trace(tmp_path / "t.txt")
