"""``minipaged bench`` (minipaged/engine/bench.py): a small run, structure and invariants.

No timed assertions: wall-clock numbers vary; the step counts and the outputs do not.
"""

import json

import pytest

from minipaged.cli import main
from minipaged.engine.bench import run_benchmark, scaled_workload


def test_scaled_workload_fits_the_context():
    lengths = scaled_workload("sharegpt", 200, 0, 512)
    assert lengths == scaled_workload("sharegpt", 200, 0, 512)  # seeded
    assert all(p >= 1 and o >= 1 and p + o <= 512 for p, o in lengths)
    mean_out = sum(o for _, o in lengths) / len(lengths)
    assert 50 < mean_out < 110  # ShareGPT's 338 scaled by 512 / 2048, clipped


def test_small_benchmark_run():
    r = run_benchmark(num_requests=6, repeats=1, warmup=False)
    a, b = r["systems"]["continuous+paged"], r["systems"]["static+contiguous"]
    assert r["outputs_equal"]
    assert a["output_tokens"] == b["output_tokens"] == sum(o for _, o in scaled_workload("sharegpt", 6, 0, 512))
    assert a["steps"] <= b["steps"] and r["step_ratio"] == round(b["steps"] / a["steps"], 2)
    assert a["refused"] == b["refused"] == 0
    assert set(a["step_time_split"]) == {"schedule", "prepare", "forward", "sample", "update"}
    assert 0 <= a["overhead_fraction"] < 1
    with pytest.raises(ValueError, match="num_requests"):
        run_benchmark(num_requests=0)


def test_cli_json(capsys):
    assert main(["bench", "--num-requests", "3", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["num_requests"] == 3 and "ratio" in r and r["outputs_equal"]
