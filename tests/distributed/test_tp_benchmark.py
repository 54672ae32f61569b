"""benchmarks/tensor_parallel.py at the engine level, on the tiny Llama: it runs, the two
engines give the same greedy tokens, and it reports where a tp step goes (the matmul share,
Amdahl's estimate, the collectives and the bytes sent). No timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_engine_level_reports_where_the_step_goes():
    res = subprocess.run(
        [sys.executable, "benchmarks/tensor_parallel.py", "--model", "tiny-llama", "--repeats", "1",
         "--max-tokens", "4", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["outputs_equal"] is True
    tp1, tp2 = out["results"]["tp=1 (in-process)"], out["results"]["tp=2 workers"]
    assert 0.0 < tp1["matmul_share"] <= 1.0
    assert 1.0 <= tp2["amdahl_estimate"] <= 2.0  # 1 / (share / 2 + 1 - share)
    assert tp2["comm_path"] == "shared memory" and tp2["collectives_per_step"] > 0
    assert tp2["bytes_per_step"] > 0 and tp2["paired_ratio"] > 0
