"""minipaged/viz/gpu_results.py: recorded GPU results as text, on hand-written result files."""

from __future__ import annotations

import json

from minipaged.viz.gpu_results import NO_RESULTS, load_gpu_results, price_of_paging_text, readme_rows


def bench(mode="gpu", gpu="NVIDIA H200"):
    rows = [
        dict(batch=8, context=1024, paged_over_contiguous=1.1, paged_GBps=2100.0, paged_pct_peak=43.75),
        dict(batch=64, context=4096, paged_over_contiguous=1.25, paged_GBps=3500.0, paged_pct_peak=72.9),
        dict(batch=64, context=1024, paged_over_contiguous=1.4, paged_GBps=3000.0, paged_pct_peak=None),
    ]
    targets = dict(
        shape="batch 64 x context 4096",
        paged_over_contiguous=1.25,
        paged_over_contiguous_worst=1.4,
        ratio_target=1.2,
        ratio_met=False,
        pct_peak=72.9,
        pct_peak_target=70.0,
        pct_peak_met=True,
    )
    return dict(
        mode=mode,
        gpu=gpu,
        dtype="bfloat16",
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        flash_attn=False,
        sweep=rows,
        targets=targets,
    )


def report(mode="gpu"):
    return {
        "mode": mode,
        "env": {"date_utc": "2026-12-01 10:00"},
        "kernel_bench": bench(mode),
        "serving": {
            "ratios": {"a/b": 2.5, "a/c": 3.1},
            "model": {"params_m": 1100.0, "dtype": "bfloat16"},
            "workload": {"num_requests": 256},
        },
    }


def test_no_results_prints_the_old_sentence(tmp_path):
    assert price_of_paging_text(tmp_path / "absent") == NO_RESULTS
    (tmp_path / "cpu-dry-run.json").write_text(json.dumps(report("dry-run")))  # a dry run is no result
    (tmp_path / "broken.json").write_text("{")
    assert load_gpu_results(tmp_path) == []
    assert price_of_paging_text(tmp_path) == NO_RESULTS
    assert readme_rows(tmp_path) == []


def test_measured_ratios_beside_the_paper(tmp_path):
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(report()))
    (tmp_path / "kernels_a100.json").write_text(
        json.dumps(bench(gpu="NVIDIA A100-SXM4-80GB"))
    )  # attention_kernels.py --json
    (tmp_path / "notes.json").write_text("[1, 2]")
    runs = load_gpu_results(tmp_path)
    assert [name for name, _, _ in runs] == ["kernels_a100.json", "nvidia-h200.json"]
    text = price_of_paging_text(tmp_path)
    assert text.splitlines()[0] == (
        "paper (vLLM, section 7.1): paged kernel 20%-26% slower than a contiguous one (1.20-1.26x)"
    )
    assert "NVIDIA H200 (2026-12-01): bfloat16, heads 32/8 kv, head_dim 128" in text
    lines = text.splitlines()
    assert "    8    1024             1.10x    better   2100     44%" in lines
    assert "   64    4096             1.25x    within   3500     73%" in lines
    assert "   64    1024             1.40x     worse   3000       -" in lines
    assert "targets at batch 64 x context 4096: paged/contiguous <= 1.2x missed; >= 70% of peak met" in lines
    assert text == price_of_paging_text(tmp_path)  # deterministic
    rows = readme_rows(tmp_path)
    assert len(rows) == 3 and all(r.startswith("| ") and r.endswith(" |") for r in rows)
    assert "paged/contiguous 1.25x at batch 64 x context 4096" in rows[1] and "73% of peak" in rows[1]
    assert "a/b 2.50x, a/c 3.10x" in rows[2]
