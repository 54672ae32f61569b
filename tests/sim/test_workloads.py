"""Synthetic workload length samplers."""

import pytest

from minipaged.sim.workloads import WORKLOADS, sample_requests


@pytest.mark.parametrize(
    "workload, mean_in, mean_out", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45)]
)
def test_means_match_the_paper(workload, mean_in, mean_out):
    reqs = sample_requests(workload, 4000, seed=0)
    assert sum(p for p, _ in reqs) / len(reqs) == pytest.approx(mean_in, rel=0.05)
    assert sum(o for _, o in reqs) / len(reqs) == pytest.approx(mean_out, rel=0.05)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("max_model_len", [2, 64, 2048])
def test_lengths_fit_the_context(workload, max_model_len):
    for p, o in sample_requests(workload, 500, seed=1, max_model_len=max_model_len):
        assert isinstance(p, int) and isinstance(o, int)
        assert 1 <= p < max_model_len and o >= 1 and p + o <= max_model_len


def test_seeded():
    assert sample_requests("sharegpt", 50, seed=7) == sample_requests("sharegpt", 50, seed=7)
    assert sample_requests("sharegpt", 50, seed=7) != sample_requests("sharegpt", 50, seed=8)
    # a fixed seed gives fixed numbers on every machine (random.Random, not global state)
    assert sample_requests("alpaca", 3, seed=0) == sample_requests("alpaca", 3, seed=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(workload="dolly", num_requests=3, seed=0), "workload"),
        (dict(workload="alpaca", num_requests=0, seed=0), "num_requests"),
        (dict(workload="alpaca", num_requests=3, seed=0, max_model_len=1), "max_model_len"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_requests(**kwargs)
