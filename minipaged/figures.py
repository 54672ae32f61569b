"""``minipaged figures``: regenerate every PNG in ``figures/`` from seeded runs.

Each figure is a name and a function that returns a matplotlib Figure from a seeded
run; the same code gives the same bytes (fixed fonts, no software/date metadata in the
PNG; ``--check`` renders everything twice and compares sha256).

Sources
    - viz's pictures (timeline, block tables, one step, memory) of the seeded runs in
      ``minipaged.viz.figures`` (the engine on the course model where it is present, else
      the real ``Scheduler`` with a fake model);
    - figures owned by the simulator (``minipaged.sim.memory_waste``: the paper's Fig. 2),
      drawn by its own functions in viz's palette. This command sits above both packages:
      viz imports no sim module, sim imports viz's palette (``tests/test_imports.py``).
    A figure whose module is missing is skipped with a note.

Inputs: ``--out DIR`` (default ``figures``), ``--only NAME...``, ``--list``, ``--check``,
``--stamp``. Output: the PNGs, one line each with its sha256. Failure mode: an unknown
``--only`` name is an error (exit 2); a figure whose module is missing is skipped (exit 0).

This module must not import torch or matplotlib at import time (``minipaged.cli``
imports every subcommand module to build its parser). vLLM has no counterpart.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from minipaged.viz.figures import course_model_available, demo_trace, interesting_step, scheduler_large_trace

# -- the figures ----------------------------------------------------------------------


def _memory_waste(workload: str):
    from minipaged.sim import memory_waste

    return memory_waste.plot_memory_waste(memory_waste.run_memory_experiment(workload=workload))


_RUNS: dict[str, object] = {}  # the traces of the write_figures call in progress


def _run(which: str):
    """Each seeded run once per ``write_figures`` call (the engine run takes seconds)."""
    if which not in _RUNS:
        _RUNS[which] = demo_trace() if which == "demo" else scheduler_large_trace()
    return _RUNS[which]


def _own(kind: str, which: str = "demo") -> Callable:
    def build():
        from minipaged import viz

        trace = _run(which)
        if kind == "timeline":
            return viz.timeline(trace, managed=False)
        if kind == "memory":
            return viz.memory(trace, managed=False)
        i = interesting_step(trace)
        if kind == "block_tables":
            return viz.block_tables(trace, i, managed=False)
        return viz.step(trace, i, managed=False)

    return build


# name -> (module it needs, builder, what it shows)
FIGURES: dict[str, tuple[str, Callable, str]] = {
    "timeline.png": (
        "minipaged.core.sched.scheduler",
        _own("timeline"),
        "active sequences per step (chapter 00 run)",
    ),
    "block_tables.png": (
        "minipaged.core.sched.scheduler",
        _own("block_tables"),
        "block tables at the first preemption (chapter 00 run)",
    ),
    "step.png": (
        "minipaged.core.sched.scheduler",
        _own("step"),
        "the lecture's picture: one step, timeline + block tables",
    ),
    "memory.png": ("minipaged.core.sched.scheduler", _own("memory"), "KV slots over time (chapter 00 run)"),
    "timeline_20x200.png": (
        "minipaged.core.sched.scheduler",
        _own("timeline", "large"),
        "20 requests x ~200 steps, scheduler + fake model",
    ),
    "step_20x200.png": ("minipaged.core.sched.scheduler", _own("step", "large"), "one step of the large run"),
    "memory_20x200.png": (
        "minipaged.core.sched.scheduler",
        _own("memory", "large"),
        "KV slots over time, large run",
    ),
    "memory_waste.png": (
        "minipaged.sim.memory_waste",
        lambda: _memory_waste("sharegpt"),
        "paper Fig. 2, ShareGPT-like workload",
    ),
    "memory_waste_alpaca.png": (
        "minipaged.sim.memory_waste",
        lambda: _memory_waste("alpaca"),
        "paper Fig. 2, Alpaca-like workload",
    ),
}


# Figures drawn in this palette by commands too slow to rerun in a test (``minipaged
# simulate``: minutes). ``minipaged figures --stamp`` records their sha256 and the palette's
# fingerprint in ``figures/palette_stamps.json``; tests/viz/test_figures_fresh.py checks both.
PALETTE_FIGURES = ("sim_latency_sharegpt.png", "sim_latency_alpaca.png", "sim_block_size.png")
STAMPS = "palette_stamps.json"


def stamp_palette_figures(fig_dir) -> dict:
    """Record the palette fingerprint and each ``PALETTE_FIGURES`` file's sha256."""
    import json

    from minipaged.viz import palette

    d = Path(fig_dir)
    stamps = {
        "palette": palette.fingerprint(),
        "figures": {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in PALETTE_FIGURES},
    }
    (d / STAMPS).write_text(json.dumps(stamps, indent=2, sort_keys=True) + "\n")
    return stamps


def _module_available(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def write_figures(out_dir, names: Optional[list[str]] = None, log=print) -> dict[str, str]:
    """Render ``names`` (default: all) into ``out_dir``; returns name -> sha256."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minipaged.viz import _draw

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hashes = {}
    _RUNS.clear()  # NOTE: every call reruns its seeded runs: --check compares two runs
    for name in names or list(FIGURES):
        module, build, _ = FIGURES[name]
        if not _module_available(module):
            log(f"skip {name}: {module} is not available in this version")
            continue
        fig = build()
        path = out / name
        _draw.save_png(fig, path)
        plt.close(fig)  # a no-op for figures pyplot does not track
        hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        log(f"wrote {path}  sha256 {hashes[name][:16]}")
    _RUNS.clear()
    return hashes


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="figures", help="folder for the PNGs (default figures)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these figures")
    parser.add_argument("--list", action="store_true", help="list the figures and exit")
    parser.add_argument(
        "--check", action="store_true", help="render twice into temporary folders and compare sha256"
    )
    parser.add_argument(
        "--stamp",
        action="store_true",
        help="after `minipaged simulate`: record the sim_*.png hashes and the palette in figures/palette_stamps.json",
    )


def run(args) -> int:
    if args.list:
        for name, (module, _, what) in FIGURES.items():
            print(f"{name:<26} {what}  [{module}]")
        return 0
    if args.stamp:
        stamps = stamp_palette_figures(args.out)
        print(f"stamped {', '.join(stamps['figures'])} with palette {stamps['palette'][:16]}")
        return 0
    names = args.only or None
    for n in names or ():
        if n not in FIGURES:
            print(f"unknown figure {n!r}; choose from {', '.join(FIGURES)}", file=sys.stderr)
            return 2
    if args.check:
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            ha = write_figures(a, names, log=lambda _: None)
            hb = write_figures(b, names, log=lambda _: None)
        bad = [n for n in ha if ha[n] != hb.get(n)]
        for n in ha:
            print(f"{'DIFFERENT' if n in bad else 'identical'}  {n}  {ha[n][:16]}")
        return 1 if bad else 0
    source = (
        "engine on the course model"
        if course_model_available()
        else ("scheduler + fake model (the course model is not available yet)")
    )
    print(f"demo run: {source}")
    write_figures(args.out, names)
    return 0
