"""Recorded GPU results, as text: what chapter 03 and the README quote from ``benchmarks/results/``.

The numbers come from ``benchmarks/gpu_check.sh`` (one JSON report per device,
``benchmarks/results/<device>.json``) or from ``benchmarks/attention_kernels.py --json`` run by hand;
nothing here measures anything. The paper's figure they sit beside is vLLM (v0, SOSP 2023)
section 7.1: its PagedAttention kernel was 20-26% slower than FasterTransformer's contiguous one.

Inputs
    a results directory (default: the repository's ``benchmarks/results``).
Outputs
    ``load_gpu_results(dir)``: ``[(file name, kernel benchmark dict, whole report)]`` of the
    real GPU runs (``mode == "gpu"``), sorted by file name; dry runs and unreadable files are
    left out. ``price_of_paging_text(dir)``: per device, paged / contiguous decode latency at
    block size 16 over batch x context beside the paper's 1.20-1.26x, the share of peak HBM
    bandwidth, the targets; with no result, the one sentence chapter 03 printed before any run.
    ``readme_rows(dir)``: Markdown rows for the README's measured table.
Invariants
    deterministic text (sorted files, fixed rounding) for nbval.
Failure mode
    none raised for bad files: they are skipped (``load_gpu_results``) and counted in the text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

PAPER_OVERHEAD = (0.20, 0.26)  # vLLM paper section 7.1, paged vs FasterTransformer kernel
NO_RESULTS = (
    "no recorded GPU results in benchmarks/results/ yet: run benchmarks/attention_kernels.py on a GPU"
)
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def load_gpu_results(results_dir=None) -> list[tuple[str, dict, dict]]:
    """The real GPU runs in ``results_dir``: (file name, kernel benchmark, whole report)."""
    d = Path(results_dir) if results_dir is not None else DEFAULT_DIR
    runs = []
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        bench = data.get("kernel_bench", data)  # a gpu_check report, or attention_kernels.py's own JSON
        if isinstance(bench, dict) and bench.get("mode") == "gpu" and bench.get("sweep"):
            runs.append((path.name, bench, data))
    return runs


def _date(report: dict) -> str:
    date = (report.get("env") or {}).get("date_utc")
    return f" ({date[:10]})" if date else ""


def price_of_paging_text(results_dir=None) -> str:
    """Measured paged/contiguous decode latency beside the paper's 20-26%, or ``NO_RESULTS``."""
    runs = load_gpu_results(results_dir)
    if not runs:
        return NO_RESULTS
    lo, hi = PAPER_OVERHEAD
    lines = [
        f"paper (vLLM, section 7.1): paged kernel {lo:.0%}-{hi:.0%} slower than a contiguous one "
        f"({1 + lo:.2f}-{1 + hi:.2f}x)"
    ]
    for name, b, report in runs:
        lines += [
            "",
            f"{b.get('gpu')}{_date(report)}: {b.get('dtype')}, heads {b.get('num_heads')}/{b.get('num_kv_heads')} kv, "
            f"head_dim {b.get('head_dim')}, block_size 16, contiguous = fastest of SDPA"
            f"{' and FlashAttention' if b.get('flash_attn') else ''}   [{name}]",
            f"{'batch':>5} {'context':>7} {'paged/contiguous':>17} {'vs paper':>9} {'GB/s':>6} {'% peak':>7}",
        ]
        for r in b["sweep"]:
            ratio = r["paged_over_contiguous"]
            pct = r.get("paged_pct_peak")
            lines.append(
                f"{r['batch']:>5} {r['context']:>7} {ratio:>16.2f}x {_vs_paper(ratio):>9} "
                f"{r['paged_GBps']:>6.0f} {'-' if pct is None else f'{pct:.0f}%':>7}"
            )
        t = b.get("targets")
        if t:
            lines.append(
                f"targets at {t['shape']}: paged/contiguous <= {t['ratio_target']}x "
                f"{_met(t['ratio_met'])}; >= {t['pct_peak_target']:.0f}% of peak {_met(t['pct_peak_met'])}"
            )
    return "\n".join(lines)


def _vs_paper(ratio: float) -> str:
    lo, hi = PAPER_OVERHEAD
    if ratio < 1 + lo:
        return "better"
    return "within" if ratio <= 1 + hi else "worse"


def _met(x: Optional[bool]) -> str:
    return "n/a" if x is None else ("met" if x else "missed")


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def readme_rows(results_dir=None) -> list[str]:
    """Markdown rows ``| experiment | command | result | paper |`` for each recorded GPU run."""
    rows = []
    for _name, b, report in load_gpu_results(results_dir):
        t = b.get("targets") or {}
        pct = t.get("pct_peak")
        ratio, worst = t.get("paged_over_contiguous"), t.get("paged_over_contiguous_worst")
        rows.append(
            f"| PagedAttention decode kernel vs contiguous, {b.get('gpu')}, {b.get('dtype')} | "
            f"`bash benchmarks/gpu_check.sh` | paged/contiguous {_x(ratio)} at "
            f"{t.get('shape')}, block 16 (worst {_x(worst)}); "
            f"{'-' if pct is None else f'{pct:.0f}%'} of peak HBM bandwidth | 1.20-1.26x (section 7.1) |"
        )
        sv = report.get("serving") or {}
        if sv.get("ratios"):
            ratios = ", ".join(f"{k} {v:.2f}x" for k, v in sv["ratios"].items())
            rows.append(
                f"| real serving on {b.get('gpu')}, random {sv['model']['params_m']}M Llama "
                f"{sv['model'].get('dtype', '')}, "
                f"{sv['workload']['num_requests']} requests | `bash benchmarks/gpu_check.sh` | "
                f"tokens/s {ratios} ((a) continuous+paged, (b) static+contiguous, (c) transformers "
                f"generate, (d) transformers continuous batching) | 2–4× (GPU) |"
            )
    return rows


if __name__ == "__main__":  # python -m minipaged.viz.gpu_results [DIR]
    import sys

    print(price_of_paging_text(sys.argv[1] if len(sys.argv) > 1 else None))
    for row in readme_rows(sys.argv[1] if len(sys.argv) > 1 else None):
        print(row)
