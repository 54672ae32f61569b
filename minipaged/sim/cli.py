"""``minipaged simulate``: the paper's serving experiments (Fig. 12, 13, 18b) on a cost model.

No vLLM counterpart (vLLM's ``benchmarks/benchmark_serving.py`` runs a real server).

What it runs (defaults: OPT-13B on one A100-40GB, as in the paper's single-GPU setting)
    per workload (ShareGPT-like, Alpaca-like): a rate sweep of every policy of
    ``minipaged.sim.simulator.POLICIES`` on the same seeded requests, their sustainable
    rates (the knee: normalized latency at ``--factor`` times its light-load value, or an
    absolute ``--threshold``) and the ratios vLLM-like / each baseline; then the block-size
    sweep of the paged policy (8..256). ``--quick`` shrinks everything to seconds (tests).

Outputs
    a text report (or ``--json``: one JSON object, see ``build_report``), and the figures
    ``sim_latency_<workload>.png`` and ``sim_block_size.png`` in ``--out-dir`` (``figures``).

Failure mode
    an unknown workload / GPU / model name is rejected by argparse; bad numbers raise
    ``ValueError`` from the simulator.

NOTE: no torch or matplotlib at import time (the CLI router imports every subcommand).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from minipaged.cli import (
    dumps_json,
    float_above_one,
    positive_float,
    positive_int,
    positive_int_list,
)

WORKLOADS = ("sharegpt", "alpaca")
DEFAULT_NUM_REQUESTS = {"sharegpt": 500, "alpaca": 1000}
QUICK_NUM_REQUESTS = {"sharegpt": 40, "alpaca": 80}
QUICK_RATE_FRACTIONS = (0.25, 0.7, 1.0, 1.3, 1.6)
DEFAULT_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
QUICK_BLOCK_SIZES = (16, 64, 256)
TARGET_RATIO = 1.7  # issue 7: paged >= 1.7x Orca (Oracle) on ShareGPT (paper: 1.7-2.7x)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from minipaged.sim.cost_model import GPUS, MODELS  # pure Python, cheap

    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--workload", choices=(*WORKLOADS, "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    parser.add_argument(
        "--num-requests",
        type=positive_int,
        default=None,
        help="requests per run (default: 500 ShareGPT, 1000 Alpaca)",
    )
    parser.add_argument("--gpu", choices=sorted(GPUS), default="A100-40GB")
    parser.add_argument("--model", choices=sorted(MODELS), default="OPT-13B")
    parser.add_argument(
        "--factor",
        type=float_above_one,
        default=None,
        help="sustainable = latency reaches FACTOR x its light-load value (default 2)",
    )
    parser.add_argument(
        "--threshold",
        type=positive_float,
        default=None,
        help="instead of --factor: one absolute normalized latency (s/token)",
    )
    parser.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    parser.add_argument(
        "--block-sizes",
        type=positive_int_list,
        default=None,
        help="comma-separated block sizes for the sweep (default 8..256); 'none' to skip",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        help="processes for the runs (default: min(4, CPUs)); results do not depend on it",
    )
    parser.add_argument("--out-dir", default="figures", help="where the PNGs go")
    parser.add_argument("--no-figures", action="store_true")


def build_report(args) -> dict:
    """Run the experiments of ``args``; a JSON-ready dict (``setting``, ``workloads``,
    ``block_size``, ``headline``)."""
    from minipaged.sim.cost_model import GPUS, MODELS, CostModel
    from minipaged.sim.simulator import (
        DEFAULT_LATENCY_FACTOR,
        RATE_FRACTIONS,
        block_size_sweep,
        compare_policies,
    )

    cost = CostModel(MODELS[args.model], GPUS[args.gpu])
    workloads = WORKLOADS if args.workload == "both" else (args.workload,)
    fractions = QUICK_RATE_FRACTIONS if args.quick else RATE_FRACTIONS
    jobs = args.jobs if args.jobs is not None else min(4, os.cpu_count() or 1)
    factor = args.factor if args.factor is not None else DEFAULT_LATENCY_FACTOR
    if args.block_sizes is None:
        block_sizes = QUICK_BLOCK_SIZES if args.quick else DEFAULT_BLOCK_SIZES
    else:
        block_sizes = tuple(args.block_sizes)  # NOTE: parsed by positive_int_list (none -> ())
    report = {
        "setting": {
            "model": cost.model.name,
            "gpu": cost.gpu.name,
            "cost_model": repr(cost),
            "kv_cache_gib": cost.kv_cache_bytes() / 1024**3,
            "num_kv_tokens": cost.num_kv_tokens(),
            "kv_bytes_per_token": cost.model.kv_bytes_per_token,
            "latency_factor": factor,
            "threshold": args.threshold,
            "preemption_mode": args.preemption_mode,
            "seed": args.seed,
            "quick": bool(args.quick),
            "rate_fractions": list(fractions),
        },
        "workloads": {},
        "block_size": {},
        "headline": {},
    }
    for wl in workloads:
        n = args.num_requests or (QUICK_NUM_REQUESTS if args.quick else DEFAULT_NUM_REQUESTS)[wl]
        cmp_ = compare_policies(
            wl,
            n,
            args.seed,
            cost,
            factor=factor,
            threshold=args.threshold,
            rate_fractions=fractions,
            jobs=jobs,
            preemption_mode=args.preemption_mode,
        )
        d = cmp_.to_dict()
        report["workloads"][wl] = d
        report["headline"][wl] = {k: d["ratios"][k] for k in d["ratios"]}
        if block_sizes:
            report["block_size"][wl] = block_size_sweep(
                wl, block_sizes, n, args.seed, cost, jobs=jobs, preemption_mode=args.preemption_mode
            )
    if "sharegpt" in report["headline"]:
        r = report["headline"]["sharegpt"]["paged/orca-oracle"]
        report["target"] = {
            "paged/orca-oracle on sharegpt": r,
            "required": TARGET_RATIO,
            "met": math.isfinite(r) and r >= TARGET_RATIO,
        }
    return report


# -- figures ------------------------------------------------------------------------------
def plot_latency(workload_report: dict, ax=None):
    """Normalized latency vs request rate, one curve per policy (the paper's Fig. 12)."""
    import matplotlib.pyplot as plt

    from minipaged.viz import palette as pal

    colors = {
        "paged": pal.BLUE,
        "orca-oracle": pal.BLUISH_GREEN,
        "orca-pow2": pal.ORANGE,
        "orca-max": pal.VERMILLION,
        "static": pal.REDDISH_PURPLE,
    }
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sweeps = workload_report["sweeps"]
    top = 0.0
    for p, sw in sweeps.items():
        lat = sw["normalized_latency"]
        (line,) = ax.plot(sw["rates"], lat, marker="o", ms=3.5, label=sw["name"], color=colors.get(p))
        s = sw["sustainable_rate"]
        if s > 0:
            ax.plot([s], [sw["latency_level"]], marker="x", ms=9, mew=2, color=line.get_color())
        top = max(top, 4 * sw["latency_level"])
    from matplotlib.ticker import FormatStrFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter(""))
    ax.set_ylim(0, top)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    cfg = workload_report["config"]
    ax.set_title(
        f"{workload_report['workload']}: {cfg['model']} on {cfg['gpu']} ({cfg['num_requests']} requests)"
    )
    ax.plot([], [], "x", color="grey", ms=8, mew=2, label="sustainable rate (the knee)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return fig if fig is not None else ax.figure


def plot_block_size(block_reports: dict):
    """Per workload, capacity and normalized latency at one rate vs block size (Fig. 18b)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for wl, d in block_reports.items():
        bs = d["block_sizes"]
        ref = d["capacity"][bs.index(16)] if 16 in bs else d["capacity"][0]
        axes[0].plot(bs, [c / ref for c in d["capacity"]], marker="o", label=wl)
        axes[1].plot(bs, d["normalized_latency"], marker="o", label=f"{wl} at {d['rate']:.3g} req/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs)
        ax.set_xticklabels([str(b) for b in bs])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("capacity / capacity at block 16")
    axes[0].set_title("throughput with a full queue")
    axes[1].set_ylabel("normalized latency (s/token)")
    axes[1].set_title("latency at a fixed rate")
    fig.tight_layout()
    return fig


def write_figures(report: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for wl, d in report["workloads"].items():
        fig = plot_latency(d)
        p = out / f"sim_latency_{wl}.png"
        fig.savefig(p, dpi=120, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        paths.append(str(p))
    if report["block_size"]:
        fig = plot_block_size(report["block_size"])
        p = out / "sim_block_size.png"
        fig.savefig(p, dpi=120, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        paths.append(str(p))
    return paths


# -- text ---------------------------------------------------------------------------------
def format_report(report: dict) -> str:
    from minipaged.sim.simulator import POLICY_NAMES

    s = report["setting"]
    level = (
        f"normalized latency > {s['threshold']} s/token"
        if s["threshold"] is not None
        else f"normalized latency > {s['latency_factor']:g} x its light-load value"
    )
    lines = [
        f"{s['model']} on {s['gpu']}: KV cache {s['kv_cache_gib']:.2f} GiB = "
        f"{s['num_kv_tokens']} tokens ({s['kv_bytes_per_token'] // 1024} KiB/token); "
        f"preemption {s['preemption_mode']}",
        f"sustainable rate: where {level}; capacity: req/s with a full queue; "
        f"batch: sequences per step while requests wait, at the highest rate (Fig. 13)",
    ]
    for wl, d in report["workloads"].items():
        lines.append("")
        lines.append(f"== {wl} ({d['config']['num_requests']} requests, seed {d['config']['seed']}) ==")
        lines.append(
            f"{'policy':28s} {'capacity':>9s} {'sustain.':>9s} {'vLLM x':>7s} {'batch':>6s}  "
            f"latency (s/token) at rates (req/s)"
        )
        for p, sw in d["sweeps"].items():
            ratio = d["ratios"].get(f"paged/{p}")
            rs = "" if ratio is None else f"{ratio:6.2f}x" if math.isfinite(ratio) else "n/a"
            sus = f"{sw['sustainable_rate']:.3g}" + ("+" if sw["saturated"] else "")
            pts = " ".join(f"{r:.3g}:{lat:.3f}" for r, lat in zip(sw["rates"], sw["normalized_latency"]))
            batch = sw["metrics"][-1]["mean_loaded_batch_size"]
            lines.append(
                f"{POLICY_NAMES[p]:28s} {sw['capacity']:9.3g} {sus:>9s} {rs:>7s} {batch:6.1f}  {pts}"
            )
    for wl, b in report["block_size"].items():
        lines.append("")
        lines.append(f"== block size sweep, paged, {wl} (latency at {b['rate']:.3g} req/s) ==")
        for bs, c, lat in zip(b["block_sizes"], b["capacity"], b["normalized_latency"]):
            lines.append(f"block {bs:4d}: capacity {c:8.3g} req/s, normalized latency {lat:.4f} s/token")
    if "target" in report:
        t = report["target"]
        lines.append("")
        verdict = "met" if t["met"] else "NOT met"
        if s["quick"]:
            verdict = "--quick runs are too short to measure it"
        r = t["paged/orca-oracle on sharegpt"]
        rs = f"{r:.2f}x" if math.isfinite(r) else "n/a (no policy sustains any rate)"
        lines.append(f"paged / Orca (Oracle) on sharegpt: {rs} (target >= {t['required']}: {verdict})")
    for p in report.get("figures", []):
        lines.append(f"wrote {p}")
    return "\n".join(lines)


def run(args) -> int:
    t0 = time.perf_counter()
    report = build_report(args)
    if not args.no_figures:
        report["figures"] = write_figures(report, args.out_dir)
    if args.json:
        print(dumps_json(report, indent=1, sort_keys=True))
    else:
        print(format_report(report))
        print(f"({time.perf_counter() - t0:.0f} s elapsed)")
    return 0
