"""benchmarks/gpu_check.sh and its Python steps: the dry run end to end, the report, the guards.

The dry run is the real script on tiny shapes (CPU, Triton interpreter): every step must run
and pass its own checks (the kernels against the torch reference, the serving systems to the
end), the report must hold every figure, and nothing may be written to benchmarks/results/.
No timings are asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _bench_module(name: str, alias: str):
    """``benchmarks/NAME.py`` imported as ``alias``, without putting benchmarks/ on sys.path:
    a module named like a package (``kernels``) would shadow the ``kernels`` package transformers imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(alias, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


gpu_report = _bench_module("gpu_report", "gpu_report")
kernel_bench = _bench_module("attention_kernels", "benchmarks_kernels")


def run_check(out_dir, *extra, total_s=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHON=sys.executable)
    if total_s is not None:
        env["GPU_CHECK_TOTAL_S"] = str(total_s)
    return subprocess.run(
        ["bash", str(SCRIPT), str(out_dir), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def results_listing():
    d = REPO / "benchmarks" / "results"
    return sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir()) if d.exists() else []


def read_steps(out_dir):
    rows = [line.split("\t") for line in (Path(out_dir) / "steps.tsv").read_text().splitlines()]
    return {r[0]: r[1] for r in rows}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    before = results_listing()
    res = run_check(out, "--dry-run")
    return out, res, before


def test_dry_run_every_step_ok(dry_run):
    out, res, _ = dry_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert read_steps(out) == {
        "env": "ok",
        "kernel_correctness": "ok",
        "kernel_bench": "ok",
        "serving": "ok",
        "tensor_parallel": "ok",
    }
    assert "kernel correctness" in res.stdout and "finished in" in res.stdout


def test_dry_run_writes_nothing_to_benchmarks_results(dry_run):
    _, _, before = dry_run
    assert results_listing() == before


def test_dry_run_report_holds_every_figure(dry_run):
    out, _, _ = dry_run
    report = json.loads((out / "cpu-dry-run.json").read_text())
    assert report["mode"] == "dry-run" and report["slug"] == "cpu-dry-run"
    assert report["env"]["packages"]["torch"] and report["env"]["packages"]["triton"]
    assert (out / "summary.txt").read_text().strip() == report["summary"]

    kc = report["kernel_correctness"]
    assert kc["ok"] and kc["counts"].get("fail", 0) == 0 and kc["counts"].get("error", 0) == 0
    assert kc["rejected_block_sizes"] == [3, 512]  # not a power of two / above 256
    ops = {c["op"] for c in kc["cases"] if c["status"] == "pass"}
    assert ops == {
        "decode_v1",
        "decode_v2",
        "prefill",
        "reshape_and_cache",
        "reshape_and_cache_triton",
        "copy_blocks",
        "swap_blocks",
    }
    assert {c["dtype"] for c in kc["cases"] if c["status"] == "pass"} == {"float32", "float16", "bfloat16"}
    assert {c["block_size"] for c in kc["cases"] if c["status"] == "pass"} >= {1, 16, 256}

    kb = report["kernel_bench"]
    assert kb["mode"] == "dry-run" and len(kb["sweep"]) == 4 and len(kb["block_size_sweep"]) == 3
    for row in kb["sweep"]:
        assert row["paged_ms"] > 0 and row["paged_over_contiguous"] > 0 and "inorder_ms" in row
    assert set(kb["targets"]) >= {"paged_over_contiguous", "ratio_met", "pct_peak", "pct_peak_met", "note"}
    assert kb["tuning"]["best"].keys() == {"v1", "v2"}
    assert (out / "cpu-dry-run_kernels.png").stat().st_size > 0

    sv = report["serving"]
    assert set(sv["systems"]) == {
        "continuous+paged",
        "static+contiguous",
        "hf-continuous-batching",
        "hf-generate-static",
    }
    n = sv["workload"]["num_requests"]
    for name, m in sv["systems"].items():
        if name == "hf-continuous-batching" and "unavailable" in m:
            continue  # depends on the installed transformers
        assert "unavailable" not in m, (name, m)
        assert not m["partial"] and m["requests_finished"] == n and m["tokens_per_s"] > 0
        assert m["output_tokens"] == sv["workload"]["output_tokens"]  # every request its exact length
    assert sv["agreement"]["a=b"]["compared"] == n
    assert set(sv["ratios"]) >= {"a/b", "a/c"}
    assert sv["systems"]["continuous+paged"]["overhead_ms_per_step"] >= 0
    h = report["headline"]
    assert h["serving_ratios"] == sv["ratios"] and h["kernel_cases"] == kc["counts"]

    tp = report["tensor_parallel"]  # tp=1 in-process, tp=1 in a worker, tp=2 over torch.distributed
    assert set(tp["results"]) == {"tp=1 in-process", "tp=1 worker", "tp=2 workers"}
    assert tp["outputs_equal"] is True and all(r["tokens_per_s"] > 0 for r in tp["results"].values())
    assert h["tensor_parallel_outputs_equal"] is True and "tensor parallel" in report["summary"]


def test_total_time_guard_skips_steps_and_still_reports(tmp_path):
    res = run_check(tmp_path, "--dry-run", total_s=20)  # less than the report's reserve: nothing runs
    assert res.returncode == 0, res.stdout + res.stderr  # skipped is not a failure
    steps = read_steps(tmp_path)
    assert set(steps.values()) == {"skipped"} and "env" in steps
    assert "steps:" in (tmp_path / "summary.txt").read_text()


def test_usage_errors():
    assert run_check("--dry-run").returncode == 2
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "usage" in res.stderr


# --------------------------------------------------------------------------- the Python pieces


def test_report_from_missing_and_broken_files(tmp_path):
    (tmp_path / "env.json").write_text(
        json.dumps(
            {"device": "NVIDIA H200", "slug": "nvidia-h200", "mode": "gpu", "packages": {"torch": "2.9"}}
        )
    )
    (tmp_path / "kernels.json").write_text("{not json")
    (tmp_path / "steps.tsv").write_text("env\tok\t0\t3\t\nserving\ttimeout\t124\t200\tkilled\n")
    report = gpu_report.combine(str(tmp_path), copy_to=str(tmp_path / "results"))
    assert report["kernel_correctness"] == {"missing": True}
    assert "broken" in report["kernel_bench"]
    assert report["steps"]["serving"]["status"] == "timeout"
    assert report["headline"]["paged_over_contiguous_64x4k"] is None
    assert (tmp_path / "results" / "nvidia-h200.json").exists()
    assert (tmp_path / "results" / "nvidia-h200_summary.txt").read_text().startswith("GPU check: NVIDIA H200")


def test_slug():
    assert gpu_report.slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_report.slug("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb"
    assert gpu_report.slug("  ") == "unknown-device"


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA GH200 480GB", 4.0e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA A100-SXM4-80GB", 2.039e12),
        ("NVIDIA A100-SXM4-40GB", 1.555e12),
        ("NVIDIA L40S", 0.864e12),
        ("NVIDIA L40", 0.864e12),
        ("NVIDIA L4", 0.3e12),
        ("Tesla T4", 0.32e12),
        ("NVIDIA H20", None),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_peak_bandwidth_table(name, peak):
    assert kernel_bench.peak_bandwidth(name) == peak


def test_targets_from_a_sweep():
    sweep = [
        {"batch": 8, "context": 4096, "paged_over_contiguous": 1.5, "paged_pct_peak": 40.0},
        {"batch": 64, "context": 4096, "paged_over_contiguous": 1.1, "paged_pct_peak": 72.0},
    ]
    t = kernel_bench.evaluate_targets(sweep, 64, 4096)
    assert t["ratio_met"] is True and t["pct_peak_met"] is True and t["paged_over_contiguous_worst"] == 1.5
    sweep[1].update(paged_over_contiguous=1.3, paged_pct_peak=None)  # unknown GPU: no peak
    t = kernel_bench.evaluate_targets(sweep, 64, 4096)
    assert t["ratio_met"] is False and t["pct_peak_met"] is None
    assert kernel_bench.evaluate_targets(sweep, 2, 48)["ratio_met"] is None


def test_decode_kernel_compiles_for_a_hopper_gpu_without_one(tmp_path):
    """Triton's own compiler (not the interpreter) builds the engine's decode kernel for sm_90."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    out = tmp_path / "aot.json"
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_aot_check.py"),
            "--arch",
            "90",
            "--only",
            "decode_v1:bf16",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["status"] == "ok" and 0 < row["shared"] <= 227 * 1024 and row["num_stages"] == 3


def test_serving_stops_each_system_when_its_time_share_is_spent(tmp_path):
    """A zero budget: every system stops at once and says so; the step still succeeds."""
    out = tmp_path / "serving.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_serving.py"),
            "--dry-run",
            "--budget-s",
            "0",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    sv = json.loads(out.read_text())
    for name in ("continuous+paged", "static+contiguous", "hf-generate-static"):
        m = sv["systems"][name]
        assert m["partial"] and m["requests_finished"] == 0 and m["tokens_per_s"] is None
    assert sv["ratios"] == {} and sv["agreement"]["a=b"]["compared"] == 0
