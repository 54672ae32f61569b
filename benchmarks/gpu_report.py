"""The first and last steps of ``benchmarks/gpu_check.sh``: what machine this is, and one report.

    python benchmarks/gpu_report.py env OUTDIR                 # OUTDIR/env.json: device, versions, packages
    python benchmarks/gpu_report.py combine OUTDIR [--copy-to benchmarks/results]

``combine`` reads what the steps left in OUTDIR (``env.json``, ``steps.tsv`` written by the
shell script, ``kernel_correctness.json``, ``kernels.json``, ``serving.json``, ``tensor_parallel.json``; a missing or
broken file is recorded, not fatal) and writes

    OUTDIR/<device-slug>.json   device, versions, every step's status and every figure
    OUTDIR/summary.txt          the headline numbers in a few lines (also printed)

and, with ``--copy-to DIR`` (repeatable), copies both (and the kernel figure) there as
``<slug>.json``, ``<slug>_summary.txt``, ``<slug>_kernels.png``. The slug is the device name
in lower case with dashes (``nvidia-h200``); a dry run is ``cpu-dry-run``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import shutil
import sys

PAPER_KERNEL_OVERHEAD = (0.20, 0.26)  # vLLM paper section 7.1: paged kernel vs FasterTransformer's


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def env_info(dry_run: bool) -> dict:
    """Device name and the versions of what the steps use (None for a missing package)."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "packages": {}}
    for pkg in ("torch", "triton", "transformers", "flash_attn", "matplotlib", "numpy", "safetensors"):
        try:
            info["packages"][pkg] = getattr(importlib.import_module(pkg), "__version__", "installed")
        except Exception:  # noqa: BLE001 - absent or broken: the steps that need it are skipped
            info["packages"][pkg] = None
    try:
        import torch

        cuda = torch.cuda.is_available() and not dry_run
        info["cuda_available"] = cuda
        info["cuda_version"] = torch.version.cuda
        if cuda:
            props = torch.cuda.get_device_properties(0)
            info["device"] = torch.cuda.get_device_name(0)
            info["device_count"] = torch.cuda.device_count()
            info["memory_gib"] = round(props.total_memory / 2**30, 1)
            info["sm_count"] = props.multi_processor_count
            info["capability"] = f"{props.major}.{props.minor}"
        else:
            info["device"] = "cpu dry run"
    except Exception as e:  # noqa: BLE001
        info["device"] = "unknown"
        info["error"] = f"{type(e).__name__}: {e}"
    info["slug"] = (
        "cpu-dry-run" if dry_run or info["device"] in ("cpu dry run", "unknown") else slug(info["device"])
    )
    info["date_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    info["mode"] = "dry-run" if dry_run else "gpu"
    return info


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"missing": True}
    except (OSError, ValueError) as e:
        return {"broken": f"{type(e).__name__}: {e}"}


def _steps(out_dir: str) -> dict:
    steps = {}
    try:
        with open(os.path.join(out_dir, "steps.tsv")) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4:
                    steps[parts[0]] = {
                        "status": parts[1],
                        "rc": parts[2],
                        "seconds": parts[3],
                        "note": parts[4] if len(parts) > 4 else "",
                    }
    except FileNotFoundError:
        pass
    return steps


def headline(report: dict) -> dict:
    """The few numbers the README and chapter 03 quote, None where a step did not give them."""
    h = {}
    kc = report.get("kernel_correctness", {})
    if "counts" in kc:
        h["kernel_cases"] = kc["counts"]
        h["rejected_block_sizes"] = kc.get("rejected_block_sizes")
    kb = report.get("kernel_bench", {})
    t = kb.get("targets") or {}
    h["paged_over_contiguous_64x4k"] = t.get("paged_over_contiguous")
    h["paged_over_contiguous_worst"] = t.get("paged_over_contiguous_worst")
    h["ratio_target_met"] = t.get("ratio_met")
    h["pct_peak_64x4k"] = t.get("pct_peak")
    h["pct_peak_target_met"] = t.get("pct_peak_met")
    sv = report.get("serving", {})
    h["serving_ratios"] = sv.get("ratios") or None
    a = (sv.get("systems") or {}).get("continuous+paged", {})
    h["serving_tokens_per_s_a"] = a.get("tokens_per_s")
    h["engine_overhead_ms_per_step"] = a.get("overhead_ms_per_step")
    h["engine_overhead_fraction"] = a.get("overhead_fraction")
    tp = report.get("tensor_parallel", {})
    if tp.get("results"):
        h["tensor_parallel_tokens_per_s"] = {k: round(v["tokens_per_s"], 1) for k, v in tp["results"].items()}
        h["tensor_parallel_outputs_equal"] = tp.get("outputs_equal")
    return h


def format_summary(report: dict) -> str:
    env, h = report["env"], report["headline"]
    pk = env.get("packages", {})
    lines = [
        f"GPU check: {env.get('device')} ({report['mode']}), {env.get('date_utc')} UTC; torch {pk.get('torch')}, "
        f"triton {pk.get('triton')}, transformers {pk.get('transformers')}, flash_attn {pk.get('flash_attn')}",
        "steps: " + ", ".join(f"{k} {v['status']} ({v['seconds']} s)" for k, v in report["steps"].items()),
    ]
    if "kernel_cases" in h:
        lines.append(
            f"kernel correctness (compiled, vs torch reference): {h['kernel_cases']}; "
            f"block sizes rejected as expected: {h['rejected_block_sizes']}"
        )
    failed = [
        c["name"]
        for c in report.get("kernel_correctness", {}).get("cases", [])
        if c.get("status") in ("fail", "error")
    ]
    if failed:
        lines.append(f"  failing cases: {', '.join(failed[:8])}{' ...' if len(failed) > 8 else ''}")
    if h.get("paged_over_contiguous_64x4k") is not None:
        lo, hi = PAPER_KERNEL_OVERHEAD
        pct = h["pct_peak_64x4k"]
        kb = report["kernel_bench"]
        lines.append(
            f"decode kernel ({kb.get('dtype')}, heads {kb.get('num_heads')}/{kb.get('num_kv_heads')}, head_dim "
            f"{kb.get('head_dim')}), {kb['targets']['shape']}, block 16: "
            f"paged/contiguous {h['paged_over_contiguous_64x4k']:.2f}x "
            f"(target <= 1.2x: {_met(h['ratio_target_met'])}; paper {1 + lo:.2f}-{1 + hi:.2f}x), "
            f"{'unknown peak' if pct is None else f'{pct:.0f}% of peak HBM bandwidth'} "
            f"(target >= 70%: {_met(h['pct_peak_target_met'])}); worst ratio {h['paged_over_contiguous_worst']}"
            + (f" [{kb['targets']['note']}]" if kb["targets"].get("note") else "")
        )
    best = (report.get("kernel_bench", {}).get("tuning") or {}).get("best") or {}
    for kind, r in best.items():
        cfg = {k: v for k, v in r.items() if k not in ("kernel", "ms", "GBps", "batch", "context")}
        lines.append(
            f"  tuning: fastest {kind} at batch {r['batch']}: {r['ms']:.3f} ms, {r['GBps']:.0f} GB/s, {cfg}"
        )
    sv = report.get("serving", {})
    if sv.get("systems"):
        parts = []
        for _name, m in sv["systems"].items():
            if "unavailable" in m:
                parts.append(f"({m['label']}) unavailable")
            else:
                parts.append(
                    f"({m['label']}) {m.get('tokens_per_s')} tok/s{' partial' if m.get('partial') else ''}"
                )
        m, w = sv.get("model", {}), sv.get("workload", {})
        lines.append(
            f"serving, random Llama {m.get('params_m')}M params {m.get('dtype')}, {w.get('num_requests')} "
            f"ShareGPT-like requests (context {w.get('max_model_len')}): " + ", ".join(parts)
        )
        if sv.get("ratios"):
            lines.append(
                "  ratios: "
                + ", ".join(f"{k} {v:.2f}x" for k, v in sv["ratios"].items())
                + (
                    f"; engine overhead {h['engine_overhead_ms_per_step']} ms/step "
                    f"({h['engine_overhead_fraction']} of a step)"
                    if h.get("engine_overhead_ms_per_step") is not None
                    else ""
                )
            )
        if sv.get("agreement"):
            lines.append(
                "  greedy agreement (share of requests equal): "
                + ", ".join(
                    f"{k} {v['requests_equal']} of {v['compared']}" for k, v in sv["agreement"].items()
                )
            )
    elif sv.get("error"):
        lines.append(f"serving: {sv['error']}")
    if h.get("tensor_parallel_tokens_per_s"):
        tp_args = report["tensor_parallel"].get("args", {})
        lines.append(
            f"tensor parallel ({tp_args.get('model')}, {tp_args.get('device')}, model level): "
            + ", ".join(f"{k} {v} tok/s" for k, v in h["tensor_parallel_tokens_per_s"].items())
            + f"; greedy tokens equal: {h['tensor_parallel_outputs_equal']}"
        )
    return "\n".join(lines)


def _met(x) -> str:
    return "n/a" if x is None else ("met" if x else "MISSED")


def combine(out_dir: str, copy_to: str | None = None) -> dict:
    env = _load(os.path.join(out_dir, "env.json"))
    mode = env.get("mode", "unknown")
    report = {
        "device": env.get("device"),
        "slug": env.get("slug", "unknown-device"),
        "mode": mode,
        "env": env,
        "steps": _steps(out_dir),
        "kernel_correctness": _load(os.path.join(out_dir, "kernel_correctness.json")),
        "kernel_bench": _load(os.path.join(out_dir, "kernels.json")),
        "serving": _load(os.path.join(out_dir, "serving.json")),
        "tensor_parallel": _load(os.path.join(out_dir, "tensor_parallel.json")),
        "paper_kernel_overhead": list(PAPER_KERNEL_OVERHEAD),
    }
    report["headline"] = headline(report)
    summary = format_summary(report)
    report["summary"] = summary
    name = report["slug"]
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    if copy_to:
        copy_report(out_dir, name, copy_to)
    return report


def copy_report(out_dir: str, name: str, copy_to: str) -> None:
    """``<name>.json``, ``summary.txt`` and the kernel figure -> ``copy_to`` (``<name>_*``)."""
    os.makedirs(copy_to, exist_ok=True)
    shutil.copy(os.path.join(out_dir, f"{name}.json"), os.path.join(copy_to, f"{name}.json"))
    shutil.copy(os.path.join(out_dir, "summary.txt"), os.path.join(copy_to, f"{name}_summary.txt"))
    fig = os.path.join(out_dir, f"{name}_kernels.png")
    if os.path.exists(fig):
        shutil.copy(fig, os.path.join(copy_to, f"{name}_kernels.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["env", "combine"])
    p.add_argument("out_dir")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument(
        "--copy-to",
        action="append",
        default=[],
        help="also copy the report there (repeatable; the real run: OUTDIR/results, benchmarks/results)",
    )
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.command == "env":
        info = env_info(args.dry_run)
        with open(os.path.join(args.out_dir, "env.json"), "w") as f:
            json.dump(info, f, indent=1)
        print(f"{info['device']} -> {info['slug']}; packages {info['packages']}")
        return 0
    report = combine(args.out_dir, None)
    for target in args.copy_to:
        copy_report(args.out_dir, report["slug"], target)
    print(report["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
