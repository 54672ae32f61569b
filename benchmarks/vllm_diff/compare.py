"""Differential test of minipaged's v1 scheduler against vLLM v1's own Scheduler.

Runs the same random workloads (``workloads.py``) through both: vLLM in its own virtual
environment (``run_vllm.py``, started as a subprocess with that environment's python),
minipaged here (``run_minipaged.py``). Per step it compares which requests are
scheduled, from which computed-token count and for how many tokens (prefill chunks,
prefix-cache hits and decodes), which requests are admitted with how many cached tokens,
which are preempted (recompute) and which finish with how many output tokens.

Inputs / outputs
    ``--vllm-python`` (default: ``$MINIPAGED_VLLM_PYTHON`` or ``.venv-vllm/bin/python``),
    ``--seeds`` (``0:100``). Prints one line per differing workload (its first differing
    step, both sides' records, the workload's config) and ``N workloads, M identical``,
    with how many workloads preempted and hit the prefix cache. Exit status 0 iff all
    are identical.
Failure mode
    RuntimeError if the vLLM runner fails (its stderr is shown).

usage: python benchmarks/vllm_diff/compare.py [--seeds 0:100] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from run_minipaged import parse_seeds, run_one  # noqa: E402

KEYS = ("scheduled", "admitted", "preempted", "finished")


def default_vllm_python() -> str:
    return os.environ.get("MINIPAGED_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin", "python")


def run_vllm(vllm_python: str, seeds: str, admission: str = "first-chunk") -> dict[int, dict]:
    """Run ``run_vllm.py`` in the vLLM environment; ``{seed: run}``."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH="", VLLM_LOGGING_LEVEL="ERROR")
        proc = subprocess.run(
            [vllm_python, os.path.join(HERE, "run_vllm.py"), "--seeds", seeds, "--out", out,
             "--admission", admission],
            capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"run_vllm.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        runs = {}
        for seed in parse_seeds(seeds):
            with open(os.path.join(out, f"vllm_{seed}.json")) as f:
                runs[seed] = json.load(f)
        return runs


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


def compare(vllm_runs: dict[int, dict], mp_runs: dict[int, dict]) -> dict:
    """Compare runs seed by seed; a summary dict (see ``main`` for what is printed)."""
    diffs = {}
    with_pre = with_hits = 0
    for seed, v in vllm_runs.items():
        m = mp_runs[seed]
        assert v["workload"] == m["workload"], f"seed {seed}: the two sides ran different workloads"
        d = first_difference(v["steps"], m["steps"])
        if d is not None:
            diffs[seed] = d
        pre, hits = stats(v["steps"])
        with_pre += pre > 0
        with_hits += hits > 0
    return {"n": len(vllm_runs), "identical": len(vllm_runs) - len(diffs), "diffs": diffs,
            "with_preemption": with_pre, "with_prefix_hit": with_hits}


def describe(seed: int, run: dict, d) -> str:
    step, key, v, m = d
    cfg = run["workload"]["config"]
    return (f"seed {seed}: step {step} differs in {key}\n"
            f"  vLLM:      {v}\n  minipaged: {m}\n  config: {cfg}, "
            f"{len(run['workload']['requests'])} requests")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:100")
    ap.add_argument("--vllm-python", default=default_vllm_python())
    ap.add_argument("--admission", choices=["first-chunk", "full-sequence"], default="first-chunk",
                    help="vLLM's admission rule (minipaged runs watermark=None, first chunk)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    vllm_runs = run_vllm(args.vllm_python, args.seeds, args.admission)
    t1 = time.perf_counter()
    mp_runs = {seed: run_one(seed) for seed in parse_seeds(args.seeds)}
    t2 = time.perf_counter()
    summary = compare(vllm_runs, mp_runs)
    for seed, d in summary["diffs"].items():
        print(describe(seed, vllm_runs[seed], d))
    print(f"{summary['n']} workloads, {summary['identical']} identical "
          f"({summary['with_preemption']} with recompute preemptions, "
          f"{summary['with_prefix_hit']} with prefix-cache hits; "
          f"vLLM {t1 - t0:.1f} s, minipaged {t2 - t1:.1f} s)")
    return 0 if summary["identical"] == summary["n"] else 1


if __name__ == "__main__":
    sys.exit(main())
