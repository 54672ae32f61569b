"""Tests of the checkers of chapters 08-11 beyond the parametrized ones of test_checks.py.

Each checker's reference is compared with an independent computation (the rules written
out as arithmetic, the package's own functions); the statistical judge of ex10.2 passes the
package's sampler and stops wrong ones with a message that says what is wrong; graded in a
kernel by the trusted checker, the authored notebooks get full marks and a submission that
calls the package's own implementation scores 0 on those exercises.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import nbformat
import pytest

from minipaged.checks import get_spec
from minipaged.checks._spec import judge, make_cases, observe_all
from minipaged.checks.notebook import cell_exercise, cell_role, load_authored, make_student_copy
from minipaged.core import Scheduler
from minipaged.core.kv.block import cdiv
from minipaged.grading.codec import dumps
from minipaged.grading.grade import grade_many
from minipaged.grading.sandbox import probe

AUTHORED = load_authored()
ISOLATION = probe()


# -- ch08 --------------------------------------------------------------------------------


def test_admission_reference_is_the_stated_arithmetic():
    from minipaged.checks.ch08 import _admit_cases, ref_can_admit

    for free, bs, n, chunk, full, wm in _admit_cases(random.Random(4))[:-2]:
        want = (not full or cdiv(n, bs) + wm <= free) and cdiv(chunk, bs) + wm <= free
        assert ref_can_admit(free, bs, n, chunk, full, wm) is want, (free, bs, n, chunk, full, wm)


def test_persistent_batch_reference_keeps_its_invariants():
    from minipaged.checks.ch08 import _batch_cases, ref_update_batch

    for rows, leaving, joining in _batch_cases(random.Random(5))[:-2]:
        out, moves = ref_update_batch(rows, leaving, joining)
        assert None not in out and sorted(out) == sorted([r for r in rows if r not in leaving] + joining)
        kept = [i for i, r in enumerate(rows) if r not in leaving and i < len(out) and out[i] == r]
        assert len(kept) >= len(rows) - len(leaving) - moves  # only the moved requests changed rows
        holes_left = max(0, len(leaving) - len(joining))
        assert moves <= holes_left


# -- ch09 --------------------------------------------------------------------------------


def test_latency_reference_is_the_hand_worked_run():
    """ex9.2's shipped workload, worked by hand: A's prefill 0-16 ms; B (at 5) joins step 1
    with A's decode, 16-32; both decode 32-44 (A ends); C (at 40) waits for 44, 44-57, 57-68."""
    from minipaged.checks.ch09 import reference_latency

    assert reference_latency() == {
        "A": {"ttft_ms": 16, "e2e_ms": 44},
        "B": {"ttft_ms": 27, "e2e_ms": 39},
        "C": {"ttft_ms": 17, "e2e_ms": 28},
    }


def test_serve_reference_agrees_with_the_engine_trace():
    """ref_serve's step count and finishes agree with run_scheduler on the same workload
    when every request arrives at time 0 (the clock then changes nothing)."""
    from minipaged.checks._scheduler_cases import arrivals_of
    from minipaged.checks.ch09 import _build, _serve_cases, ref_serve
    from minipaged.trace import run_scheduler

    for case in _serve_cases(random.Random(6))[:15]:
        case = dict(case, requests=[(rid, p, m, 0.0) for rid, p, m, _ in case["requests"]])
        sched, reqs, arrivals = _build(case)
        got = ref_serve(sched, reqs, arrivals, (1.0, 0.0))  # 1 s a step: times count steps
        k = dict(case["knobs"])
        trace = run_scheduler(
            Scheduler(k.pop("num_blocks"), k.pop("block_size"), **k),
            arrivals_of([(rid, p, m, 0) for rid, p, m, _ in case["requests"]]),
            next_token=lambda r: 1,
        )
        assert max(v["e2e"] for v in got.values()) == len(trace.steps)
        for rid, v in got.items():
            first = next(s.step for s in trace.steps if rid in s.scheduled)
            assert 0 < v["ttft"] <= v["e2e"] and v["ttft"] >= first + 1


# -- ch10 --------------------------------------------------------------------------------


def _sampler(bug: str = ""):
    """The rule written out, or with one bug."""
    import torch

    def sample(drafts, p, q, gen):
        m = len(drafts)
        for j, d in enumerate(drafts):
            q_d = 1.0 if q is None else float(q[j, d])
            u = float(torch.rand(1, generator=gen))
            accept = u < float(p[j, d]) if bug == "ignores q" else u * q_d < float(p[j, d])
            if not accept:
                if q is None:
                    residual = p[j].clone()
                    residual[d] = 0.0
                else:
                    residual = p[j] if bug == "residual p" else (p[j] - q[j]).clamp(min=0.0)
                return list(drafts[:j]) + [int(torch.multinomial(residual, 1, generator=gen))]
        row = m - 1 if bug == "bonus row" and m else m
        out = list(drafts) + [int(torch.multinomial(p[row], 1, generator=gen))]
        return out + [0] if bug == "extra token" else out

    return sample


def _judge(ex, objects, seed="run-a"):
    spec = get_spec(ex)
    cases = make_cases(spec, seed)
    return judge(spec, cases, dumps(observe_all(spec, cases, objects)))


def test_rejection_judge_passes_the_package_sampler(monkeypatch):
    from minipaged.checks import ch10
    from minipaged.sample.rejection_sampler import RejectionSampler

    monkeypatch.setattr(ch10, "REJECTION_TRIALS", 2000)
    assert _judge("ex10.2", (RejectionSampler._random,)) == (True, "✅ ex10.2 passed")


@pytest.mark.parametrize(
    "bug,message",
    [
        ("residual p", "which the rule never returns"),
        ("ignores q", "total variation distance"),
        ("bonus row", "bonus token"),
        ("extra token", "1 to m + 1 tokens"),
    ],
)
def test_rejection_judge_catches_a_wrong_sampler(monkeypatch, bug, message):
    from minipaged.checks import ch10

    monkeypatch.setattr(ch10, "REJECTION_TRIALS", 1500)
    ok, msg = _judge("ex10.2", (_sampler(bug),))
    assert not ok and msg.startswith("ex10.2 failed on case ") and message in msg, msg


def test_outcome_probabilities_are_a_distribution_and_the_bound_shrinks():
    from minipaged.checks.ch10 import _rejection_cases, outcome_probs, tv_bound

    for case in _rejection_cases(random.Random(0)):
        probs = outcome_probs(case["p"], case["q"], case["drafts"])
        assert abs(sum(probs.values()) - 1.0) < 1e-9 and min(probs.values()) > 0
        assert tv_bound(probs, 16000) < tv_bound(probs, 4000) / 1.9


def _spec_steps_by_hand(prompt, max_tokens, accepted, k, block_size):
    """ex10.3's rules as arithmetic: drafts and lookahead bounded by prompt + max_tokens - 1."""
    max_kv = prompt + max_tokens - 1
    lookahead = min(k, max_kv - prompt)
    steps = [
        {
            "scheduled": prompt,
            "lookahead": lookahead,
            "blocks": cdiv(prompt + lookahead, block_size),
            "computed": prompt,
        }
    ]
    computed, outputs, verified = prompt, 1, 0
    while outputs < max_tokens:
        drafts = min(k, max_kv - (prompt + outputs))
        n = 1 + drafts
        lookahead = min(k, max_kv - (computed + n))
        blocks = cdiv(computed + n + lookahead, block_size)
        a = min(accepted[verified], drafts) if drafts else 0
        verified += drafts > 0
        computed += n - (drafts - a)
        outputs += a + 1
        steps.append({"scheduled": n, "lookahead": lookahead, "blocks": blocks, "computed": computed})
    return steps


def test_spec_steps_reference_follows_the_stated_rules():
    from minipaged.checks.ch10 import SPEC_KNOBS, SPEC_REQUESTS, reference_spec_steps, spec_requests_variant

    k, bs = SPEC_KNOBS["k"], SPEC_KNOBS["block_size"]
    workloads = [SPEC_REQUESTS] + [spec_requests_variant(random.Random(s)) for s in range(12)]
    for requests in workloads:
        ((_, prompt, max_tokens, accepted),) = requests
        assert reference_spec_steps(requests) == _spec_steps_by_hand(prompt, max_tokens, accepted, k, bs), (
            requests
        )


def test_best_k_reference_uses_the_packages_tokens_per_step():
    from minipaged.checks.ch10 import _best_k_cases, ref_best_k, ref_tokens_per_step
    from minipaged.spec_decode import expected_tokens_per_step

    for a in (0.0, 0.3, 0.77, 1.0):
        for k in range(1, 9):
            assert ref_tokens_per_step(a, k) == pytest.approx(expected_tokens_per_step(a, k))
    for a, cost in _best_k_cases(random.Random(1))[:-4]:
        rates = [ref_tokens_per_step(a, k) / c for k, c in enumerate(cost)]
        assert rates[ref_best_k(a, cost)] == max(rates)


# -- ch11 --------------------------------------------------------------------------------


def test_mlp_partials_add_up_to_the_unsharded_mlp():
    import torch
    import torch.nn.functional as F

    from minipaged.checks.ch11 import _mlp_cases, _mlp_tensors, ref_mlp_shard

    for case in _mlp_cases(random.Random(2))[:-1]:
        x, w_gate, w_up, w_down = _mlp_tensors(case)
        full = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
        parts = sum(ref_mlp_shard(x, w_gate, w_up, w_down, r, case["size"]) for r in range(case["size"]))
        torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-6)


def test_qkv_rows_and_refusals_agree_with_the_package():
    from types import SimpleNamespace

    from minipaged.checks.ch11 import TP_MODEL, TP_SIZES, _qkv_cases, ref_qkv_shard_rows, reference_tp
    from minipaged.model.parallel import check_tensor_parallel_size, shard_range

    for heads, kvh, d, rank, size in _qkv_cases(random.Random(3)):
        if heads % size or kvh % size:
            with pytest.raises(ValueError):
                ref_qkv_shard_rows(heads, kvh, d, rank, size)
            continue
        rows = ref_qkv_shard_rows(heads, kvh, d, rank, size)
        q0, qn = shard_range(heads * d, rank, size)
        k0, kn = shard_range(kvh * d, rank, size)
        q1, k1 = q0 + qn, k0 + kn
        assert rows == {
            "q": [q0, q1],
            "k": [heads * d + k0, heads * d + k1],
            "v": [(heads + kvh) * d + k0, (heads + kvh) * d + k1],
        }
    config = SimpleNamespace(
        num_attention_heads=TP_MODEL["num_heads"],
        num_key_value_heads=TP_MODEL["num_kv_heads"],
        intermediate_size=TP_MODEL["intermediate_size"],
    )
    for n, entry in zip(TP_SIZES, reference_tp()):
        try:  # NOTE: the package also refuses more ranks than this machine's devices: not asked here
            check_tensor_parallel_size(n, config, "cuda")
            refused = False
        except ValueError as e:
            refused = "does not divide" in str(e)
        assert (entry is None) == refused, n


# -- graded in a kernel: authored solutions, and the package's own code called ---------------

# exercise -> a solution that calls the package's implementation of it
PACKAGE_CALLS = {
    "ch10": {
        "ex10.1": "from minipaged.sample import RejectionSampler\n\n"
        "def greedy_verify(drafts, target_argmax):\n"
        "    if len(target_argmax) != len(drafts) + 1:\n"
        "        raise ValueError('rows')\n"
        "    return RejectionSampler._greedy(drafts, target_argmax)\n",
        "ex10.2": "from minipaged.sample import RejectionSampler\n\n"
        "def rejection_sample(drafts, p, q, gen):\n"
        "    return RejectionSampler._random(drafts, p, q, gen)\n",
        "ex10.4": "from minipaged.spec_decode import expected_tokens_per_step\n\n"
        "def best_k(acceptance_rate, step_cost):\n"
        "    rates = [1 / step_cost[0]] + [expected_tokens_per_step(acceptance_rate, k) / c\n"
        "                                  for k, c in enumerate(step_cost) if k]\n"
        "    return rates.index(max(rates))\n",
    },
}
PACKAGE_CALLS["ch08"] = {
    "ex8.1": "from minipaged.core import KVCacheManager, Request\n\n"
    "def can_admit(num_free_blocks, block_size, num_tokens, first_chunk, reserve_full_isl, watermark_blocks):\n"
    "    if not 1 <= first_chunk <= num_tokens:\n"
    "        raise ValueError('first_chunk')\n"
    "    pool = max(num_free_blocks, cdiv(num_tokens, block_size)) + 1\n"
    "    kv = KVCacheManager(pool, block_size)\n"
    "    if pool > num_free_blocks:\n"
    "        kv.allocate_slots('others', (pool - num_free_blocks) * block_size)\n"
    "    r = Request('r', list(range(num_tokens)))\n"
    "    got = kv.allocate_slots(r, first_chunk, full_sequence_must_fit=reserve_full_isl,\n"
    "                            watermark_blocks=watermark_blocks)\n"
    "    return got is not None\n",
}
PACKAGE_CALLS["ch09"] = {
    "ex9.3": "from minipaged.sim.simulator import simulate\n\n"
    "def serve(scheduler, requests, arrivals, step_cost):\n"
    "    return simulate(requests, scheduler, step_cost)\n",
}
PACKAGE_CALLS["ch11"] = {
    "ex11.1": "from minipaged.model.parallel import shard_range\n\n"
    "def mlp_shard(x, w_gate, w_up, w_down, rank, size):\n"
    "    if w_gate.shape[0] % size:\n"
    "        raise ValueError('size')\n"
    "    lo, n = shard_range(w_gate.shape[0], rank, size)\n"
    "    hi = lo + n\n"
    "    act = F.silu(x @ w_gate[lo:hi].T) * (x @ w_up[lo:hi].T)\n"
    "    return act @ w_down[:, lo:hi].T\n",
    "ex11.2": "from minipaged.model import parallel\n\n"
    "def qkv_shard_rows(num_heads, num_kv_heads, head_dim, rank, size):\n"
    "    if num_heads % size or num_kv_heads % size:\n"
    "        raise ValueError('size')\n"
    "    q0, qn = parallel.shard_range(num_heads * head_dim, rank, size)\n"
    "    k0, kn = parallel.shard_range(num_kv_heads * head_dim, rank, size)\n"
    "    q, kv = num_heads * head_dim, num_kv_heads * head_dim\n"
    "    return {'q': [q0, q0 + qn], 'k': [q + k0, q + k0 + kn], 'v': [q + kv + k0, q + kv + k0 + kn]}\n",
}
NEW_CHAPTERS = [ch for ch in ("ch08", "ch09", "ch10", "ch11") if ch in AUTHORED]


def _solutions(chapter):
    return {cell_exercise(c): c.source for c in AUTHORED[chapter].nb.cells if cell_role(c) == "solution"}


def _package_calls_notebook(chapter):
    """The student copy with the package's own implementation called in ``PACKAGE_CALLS``'
    exercises and the authored solutions in the others."""
    calls, honest = PACKAGE_CALLS[chapter], _solutions(chapter)
    nb = make_student_copy(copy.deepcopy(AUTHORED[chapter].nb))
    for cell in nb.cells:
        if cell_role(cell) == "solution":
            ex = cell_exercise(cell)
            cell.source = calls.get(ex, honest[ex])
    return nb


def test_authored_full_marks_and_package_calls_score_zero(tmp_path):
    paths = []
    for ch in NEW_CHAPTERS:
        for kind, nb in (("authored", AUTHORED[ch].nb), ("calls", _package_calls_notebook(ch))):
            path = tmp_path / f"{kind}_{AUTHORED[ch].name}"
            nbformat.write(nb, path)
            paths.append(str(path))
    results = grade_many(paths, AUTHORED, timeout=120, jobs=2, isolation=ISOLATION)
    for r in results:
        assert r.error is None, (r.submission, r.error)
        authored = AUTHORED[r.chapter]
        got = {ex: int(x.passed) for ex, x in r.exercises.items()}
        if Path(r.submission).name.startswith("authored_"):
            assert got == dict.fromkeys(authored.exercises, 1), r.exercises
            continue
        calls = PACKAGE_CALLS[r.chapter]
        assert got == {ex: int(ex not in calls) for ex in authored.exercises}, r.exercises
        for ex in calls:
            reason = r.exercises[ex].reason
            assert "uses the reference" in reason or "your notebook's" in reason, (ex, reason)


# -- under the student build: the authored solutions still pass, the package's code is gone --

_IN_BUILD = """
import json, sys
from minipaged.checks._spec import observe_all
from minipaged.checks import get_spec
from minipaged.grading.codec import dumps
job = json.loads(sys.stdin.read())
ns = {}
for src in job["cells"]:
    exec(src, ns)
out = {}
for ex, (names, cases) in job["exercises"].items():
    out[ex] = dumps(observe_all(get_spec(ex), cases, tuple(ns[n] for n in names)))
print("MPOUT " + json.dumps(out))
"""


@pytest.mark.parametrize("chapter", NEW_CHAPTERS)
def test_authored_solutions_pass_under_the_student_build(chapter, tmp_path, student_build_cache):
    import json
    import os
    import subprocess
    import sys

    from minipaged.checks._spec import LOCAL_SEED
    from minipaged.checks.notebook import cell_source
    from minipaged.grading.grade import check_call
    from minipaged.grading.student_build import strip_targets, student_build

    build = Path(student_build(chapter, student_build_cache))
    authored = AUTHORED[chapter]
    cells = [cell_source(c) for c in authored.nb.cells if cell_role(c) in ("setup", "solution")]
    exercises = {}
    for ex in authored.exercises:
        spec = get_spec(ex)
        exercises[ex] = (check_call(cell_source(authored.check_cells[ex]))[1], make_cases(spec, LOCAL_SEED))
    env = dict(os.environ, PYTHONPATH=str(build.parent))
    run = subprocess.run(
        [sys.executable, "-c", _IN_BUILD],
        input=json.dumps({"cells": cells, "exercises": exercises}),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(next(ln for ln in run.stdout.splitlines() if ln.startswith("MPOUT "))[6:])
    key = json.loads(
        (Path(__file__).resolve().parents[2] / "notebooks/exercises/_instructor/key.json").read_text()
    )
    for ex, text in got.items():
        ok, msg = judge(get_spec(ex), exercises[ex][1], text, key)
        assert ok, msg
    # what the chapter's exercises ask for is not in the build
    for target in strip_targets(chapter):
        mod, qual = target.split(":")
        path = build.joinpath(*mod.split(".")[1:]).with_suffix(".py")
        assert "_student_build" in path.read_text(), target
