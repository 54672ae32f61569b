"""Grading a class: submissions per minute and peak memory of ``minipaged grade``.

    python benchmarks/grading.py                       # 500 submissions, --jobs 4
    python benchmarks/grading.py -n 100 --jobs 2 --json benchmarks/results/grading.json

It writes ``n`` generated submissions of mixed quality (chapters 01, 02, 04, 05 and 06;
chapter 03 is left out by default because its Triton exercise runs ~15 s in the
interpreter on a CPU, ``--chapters`` puts it back) into a temporary folder and grades them
with ``grade_many`` in the sandbox this machine gives, exactly as ``minipaged grade
--jobs N --csv`` does (the CSV is rewritten after each submission). Each exercise of a
submission is, at random with a fixed seed: the authored solution (55%), the stub (15%),
a wrong one that returns None (10%), one that raises (6%), a banned base-class / reference
call or a module patch (6%), a print flood (4%), an infinite loop (2%) or ``os._exit``
(2%). It prints submissions per minute (wall clock), the grader's peak RSS, the score
histogram, and how many rows the CSV holds at the end. (Kernels' memory is bounded by the
sandbox's address-space limit; ``getrusage`` cannot tell a kernel's peak from the grader's
size at the fork that started it, so no kernel figure is printed.)

It also prints the two costs ``minipaged grade`` pays besides the kernels: the student build
of each of the 12 chapters (``student_build.student_build``, made once per package version and chapter,
then cached: timed cold in a fresh cache folder and warm), and copy detection
(``grade.detect_copies``: every solution cell against the package, the authored solutions
and the other submissions, with the HTML report, as ``minipaged grade --csv`` runs it after
grading), and the rate with copy detection counted in.

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minipaged.checks.notebook import (
    cell_exercise,
    cell_role,
    cell_source,
    load_authored,
    make_student_copy,
)
from minipaged.grading.grade import copy_report_path, detect_copies, grade_many, write_csv
from minipaged.grading.sandbox import probe
from minipaged.grading.student_build import student_build

CHEATS = {
    "ch01": "import math\nmath.ceil = lambda x: 0\n",
    "ch02": "KVCacheManager.allocate_slots = lambda *a, **k: []\n",
    "ch04": "import random\nrandom.random = lambda: 0.0\n",
    "ch05": "import random\nrandom.random = lambda: 0.0\n",
    "ch06": "KVCacheManager.fork = lambda *a, **k: None\n",
}


def _signature(source: str) -> tuple[str, str]:
    """(the lines up to and including the ``def`` line, the body indentation)."""
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
            return "\n".join(lines[: i + 1]), line[: len(line) - len(line.lstrip())] + "    "
    return "", "    "


def variant(kind: str, authored_src: str, stub_src: str, chapter: str) -> str:
    head, ind = _signature(stub_src)
    solved = "\n".join(ln for ln in authored_src.splitlines() if "### " not in ln)
    if kind == "authored" or not head:
        return solved
    if kind == "stub":
        return stub_src
    if kind == "wrong":
        return f"{head}\n{ind}return None"
    if kind == "raises":
        return f"{head}\n{ind}raise RuntimeError('oops')"
    if kind == "cheat":
        return CHEATS.get(chapter, "import builtins\nbuiltins.print = print\n") + solved
    if kind == "flood":
        return "for _ in range(20):\n    print('x' * 1_000_000)\n" + solved
    if kind == "loop":
        return f"{head}\n{ind}while True:\n{ind}    pass"
    if kind == "exit":
        return "import os\nos._exit(1)\n" + solved
    raise ValueError(kind)


KINDS = [
    ("authored", 55),
    ("stub", 15),
    ("wrong", 10),
    ("raises", 6),
    ("cheat", 6),
    ("flood", 4),
    ("loop", 2),
    ("exit", 2),
]


def make_submissions(out: Path, n: int, chapters: list[str], seed: int = 0) -> list[str]:
    authored = load_authored()
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS)
    paths = []
    for k in range(n):
        ch = chapters[k % len(chapters)]
        a = authored[ch]
        nb = make_student_copy(a.nb)
        sols = {cell_exercise(c): cell_source(c) for c in a.nb.cells if cell_role(c) == "solution"}
        for cell in nb.cells:
            if cell_role(cell) == "solution":
                ex = cell_exercise(cell)
                cell.source = variant(rng.choices(kinds, weights)[0], sols[ex], cell_source(cell), ch)
        path = out / f"student{k:04d}_{a.name}"
        nbformat.write(nb, path)
        paths.append(str(path))
    return paths


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def build_costs(chapters: list[str]) -> dict:
    """``{chapter: {"cold_s", "cold_cpu_s", "warm_s"}}``: the student build made in a fresh cache
    folder, then found there."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="minipaged-bench-builds-") as cache:
        for ch in chapters:
            t, c = time.monotonic(), _cpu_s()
            student_build(ch, cache_dir=cache)
            cold, cold_cpu = time.monotonic() - t, _cpu_s() - c
            t = time.monotonic()
            student_build(ch, cache_dir=cache)
            out[ch] = {
                "cold_s": round(cold, 2),
                "cold_cpu_s": round(cold_cpu, 2),
                "warm_s": round(time.monotonic() - t, 3),
            }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=500, help="submissions to grade (default 500)")
    p.add_argument("--jobs", type=int, default=4, help="submissions graded at a time (default 4)")
    p.add_argument("--timeout", type=float, default=10.0, help="per-cell timeout in seconds (default 10)")
    p.add_argument(
        "--budget", type=float, default=120.0, help="per-submission budget in seconds (default 120)"
    )
    p.add_argument("--chapters", default="ch01,ch02,ch04,ch05,ch06")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.n < 1 or args.jobs < 1 or not args.timeout > 0 or not args.budget > 0:
        p.error("-n, --jobs, --timeout and --budget must be positive")
    iso = probe()
    print(iso.describe(), flush=True)
    chapters = [c.strip() for c in args.chapters.split(",") if c.strip()]
    with tempfile.TemporaryDirectory(prefix="minipaged-bench-") as d:
        d = Path(d)
        paths = make_submissions(d, args.n, chapters)
        csv_path = d / "scores.csv"
        done = {"n": 0}

        def save(results):
            write_csv(results, csv_path)
            done["n"] = len(results)
            if done["n"] % 25 == 0:
                print(f"  {done['n']}/{args.n} graded", flush=True)

        authored = load_authored()
        t0 = time.monotonic()
        results = grade_many(
            paths,
            authored,
            timeout=args.timeout,
            jobs=args.jobs,
            budget=args.budget,
            isolation=iso,
            on_result=save,
        )
        wall = time.monotonic() - t0
        # Linux: KiB -> MiB; before copy detection, which holds every pair of the run
        grading_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows = sum(1 for _ in csv_path.open()) - 1
        t, c = time.monotonic(), _cpu_s()
        matches = detect_copies(results, authored, copy_report_path(csv_path))
        copy_s, copy_cpu_s = time.monotonic() - t, _cpu_s() - c
    copy_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # every chapter's build, not only the graded ones: the first one timed also makes the
    # chapter-independent base build that the others copy
    builds = build_costs(sorted(load_authored()))
    hist: dict = {}
    for r in results:
        key = f"{r.score}/{r.max_score}"
        hist[key] = hist.get(key, 0) + 1
    flagged = sum(1 for r in results if any(f.endswith("]") for f in r.flags))
    errors = sum(1 for r in results if r.error)
    figures = {
        "submissions": args.n,
        "jobs": args.jobs,
        "chapters": chapters,
        "cpus": os.cpu_count(),
        "wall_s": round(wall, 1),
        "submissions_per_minute": round(60 * args.n / wall, 1),
        "grader_peak_rss_mib": round(grading_rss),
        "grader_peak_rss_with_copy_detection_mib": round(copy_rss),
        "csv_rows": rows,
        "flagged": flagged,
        "errors": errors,
        "scores": dict(sorted(hist.items())),
        "isolation": iso.describe(),
        "copy_detection_s": round(copy_s, 1),
        "copy_detection_cpu_s": round(copy_cpu_s, 1),
        "copy_flagged_pairs": len(matches),
        "submissions_per_minute_with_copy_detection": round(60 * args.n / (wall + copy_s), 1),
        "student_build": builds,
    }
    print(
        f"graded {args.n} submissions in {wall:.0f} s with --jobs {args.jobs} on {os.cpu_count()} CPUs: "
        f"{figures['submissions_per_minute']} submissions/minute"
    )
    print(f"peak memory of the grader: {figures['grader_peak_rss_mib']} MiB RSS while grading")
    print(f"CSV rows: {rows}; flagged by the scan: {flagged}; could not be graded: {errors}")
    for r in [r for r in results if r.error][:5]:
        print(f"  not graded: {Path(r.submission).name}: {r.error[:300]}")
    print("scores:", ", ".join(f"{k}: {v}" for k, v in figures["scores"].items()))
    print(
        f"copy detection of the {args.n} submissions: {copy_s:.1f} s ({copy_cpu_s:.1f} s CPU), "
        f"{len(matches)} flagged pairs; with it, "
        f"{figures['submissions_per_minute_with_copy_detection']} submissions/minute; "
        f"grader peak RSS with it {figures['grader_peak_rss_with_copy_detection_mib']} MiB"
    )
    for ch, b in builds.items():
        print(
            f"student build of {ch}: {b['cold_s']:.2f} s once per package version "
            f"({b['cold_cpu_s']:.2f} s CPU), {b['warm_s'] * 1000:.0f} ms from the cache"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
