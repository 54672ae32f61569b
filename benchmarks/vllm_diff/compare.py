"""Differential test of minipaged's v1 scheduler against vLLM v1's own Scheduler.

Runs the same workloads (``workloads.py``: random seeds and hand-made ``CASES``) through
both: vLLM in its own virtual environment (``run_vllm.py``, a subprocess with that
environment's python), minipaged here (``run_minipaged.py``). Per step it compares which
requests are scheduled, from which computed-token count and for how many tokens (prefill
chunks, prefix-cache hits, decodes), which are admitted with how many cached tokens,
which are preempted (recompute) and which finish with how many output tokens.

Inputs / outputs
    ``--vllm-python`` (default: ``$MINIPAGED_VLLM_PYTHON`` or ``.venv-vllm/bin/python``),
    ``--ids`` (default ``0:100,cases``), ``--admission`` (one or more of
    ``workloads.ADMISSIONS``; default all three), ``--old-free-order`` (minipaged with
    ``free_uncached_first=False``, every freed block to the back: a negative control).
    Prints each differing workload (first differing step, both sides' records, the
    config, and its known cause if any) and per admission rule ``N workloads, M
    identical`` with how many preempted and hit the prefix cache. Exit status 0 iff every workload is identical or a known difference.
Failure mode
    RuntimeError if the vLLM runner fails (its stderr is shown).

usage: python benchmarks/vllm_diff/compare.py [--ids 0:100,cases] [--admission ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from run_minipaged import run_one  # noqa: E402
from workloads import ADMISSIONS, parse_ids  # noqa: E402

KEYS = ("scheduled", "admitted", "preempted", "finished")

# Workload id -> the causes of its known difference from vLLM 0.32 (none left). The
# three earlier ones, all prefix-caching details, are fixed in minipaged/core:
#   SAME_STEP  vLLM caches a request's full blocks when allocate_slots gives them, so a
#              request admitted later in the same step hits them (Scheduler._schedule
#              does so now);
#   DUPLICATE  vLLM also caches a block whose prefix is cached in another block, both
#              hittable until evicted (BlockPool.cache_block does so now);
#   LIFO       vLLM's BlockPool.free_blocks puts freed blocks without a hash at the FRONT
#              of the free queue, hashed ones at the back (minipaged's default now,
#              free_uncached_first=True, as chapter 02 teaches; False puts all at the back).
# workloads.CASES holds a minimal workload for each.
KNOWN_DIFFERENCES: dict[str, tuple[str, ...]] = {}


def default_vllm_python() -> str:
    default = os.path.join(REPO, ".venv-vllm", "bin", "python")
    return os.environ.get("MINIPAGED_VLLM_PYTHON") or default


def run_vllm(vllm_python: str, ids: str, admissions=ADMISSIONS) -> dict:
    """Run ``run_vllm.py`` in the vLLM environment; ``{admission: {id: run}}``."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH="", VLLM_LOGGING_LEVEL="ERROR")
        proc = subprocess.run(
            [
                vllm_python,
                os.path.join(HERE, "run_vllm.py"),
                "--ids",
                ids,
                "--out",
                out,
                "--admission",
                *admissions,
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"run_vllm.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        runs: dict = {}
        for admission in admissions:
            runs[admission] = {}
            for wid in parse_ids(ids):
                with open(os.path.join(out, f"vllm_{admission}_{wid}.json")) as f:
                    runs[admission][wid] = json.load(f)
        return runs


def run_minipaged(ids: str, admissions=ADMISSIONS, free_uncached_first: Optional[bool] = None) -> dict:
    """``{admission: {id: run}}`` for minipaged (in this process)."""
    return {a: {wid: run_one(wid, a, free_uncached_first) for wid in parse_ids(ids)} for a in admissions}


def first_difference(a: list[dict], b: list[dict]):
    """``(step, key, a_record, b_record)`` of the first differing step, or None."""
    for i in range(max(len(a), len(b))):
        ra = a[i] if i < len(a) else None
        rb = b[i] if i < len(b) else None
        if ra is None or rb is None:
            return i, "number of steps", ra, rb
        for k in KEYS:
            if ra[k] != rb[k]:
                return i, k, ra, rb
    return None


def stats(steps: list[dict]) -> tuple[int, int]:
    """(recompute preemptions, admissions with a prefix-cache hit) in one run."""
    pre = sum(len(s["preempted"]) for s in steps)
    hits = sum(1 for s in steps for n in s["admitted"].values() if n > 0)
    return pre, hits


def compare(vllm_runs: dict, mp_runs: dict) -> dict:
    """Compare two ``{id: run}`` maps workload by workload; a summary dict."""
    diffs = {}
    with_pre = with_hits = 0
    for wid, v in vllm_runs.items():
        m = mp_runs[wid]
        if v["workload"] != m["workload"]:
            raise ValueError(f"workload {wid}: the two sides ran different workloads")
        d = first_difference(v["steps"], m["steps"])
        if d is not None:
            diffs[wid] = d
        pre, hits = stats(v["steps"])
        with_pre += pre > 0
        with_hits += hits > 0
    unexpected = [wid for wid in diffs if wid not in KNOWN_DIFFERENCES]
    return {
        "n": len(vllm_runs),
        "identical": len(vllm_runs) - len(diffs),
        "diffs": diffs,
        "unexpected": unexpected,
        "with_preemption": with_pre,
        "with_prefix_hit": with_hits,
    }


def describe(wid: str, run: dict, d) -> str:
    step, key, v, m = d
    w = run["workload"]
    causes = KNOWN_DIFFERENCES.get(wid)
    return (
        f"workload {wid}: step {step} differs in {key}\n"
        f"  vLLM:      {v}\n  minipaged: {m}\n"
        f"  config: {w['config']}, {len(w['requests'])} requests\n"
        + ("".join(f"  known: {c}\n" for c in causes) if causes else "  NOT a known difference\n")
    )


def summary_line(admission: str, s: dict) -> str:
    known = len(s["diffs"]) - len(s["unexpected"])
    return (
        f"[{admission}] {s['n']} workloads, {s['identical']} identical "
        f"({s['with_preemption']} with recompute preemptions, {s['with_prefix_hit']} "
        f"with prefix-cache hits; {known} known differences"
        + (f"; UNEXPECTED: {s['unexpected']}" if s["unexpected"] else "")
        + ")"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", default="0:100,cases", help="workload ids (workloads.parse_ids)")
    ap.add_argument("--vllm-python", default=default_vllm_python())
    ap.add_argument("--admission", choices=ADMISSIONS, nargs="+", default=list(ADMISSIONS))
    ap.add_argument("--quiet", action="store_true", help="print only the summary lines")
    ap.add_argument(
        "--old-free-order",
        action="store_true",
        help="negative control: minipaged with free_uncached_first=False (every freed block to the back)",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    vllm_runs = run_vllm(args.vllm_python, args.ids, args.admission)
    t1 = time.perf_counter()
    mp_runs = run_minipaged(args.ids, args.admission, False if args.old_free_order else None)
    t2 = time.perf_counter()
    status = 0
    for a in args.admission:
        s = compare(vllm_runs[a], mp_runs[a])
        if not args.quiet:
            for wid, d in s["diffs"].items():
                print(f"[{a}] " + describe(wid, vllm_runs[a][wid], d))
        print(summary_line(a, s))
        status |= bool(s["unexpected"])
    print(f"vLLM {t1 - t0:.1f} s, minipaged {t2 - t1:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
