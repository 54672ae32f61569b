"""The scheduler's behaviour is pinned: seeded runs replay the stored EngineTraces step for
step (``tests/_golden_traces.py`` records them; see its docstring to regenerate)."""

import json

import pytest
from _golden_traces import GOLDEN, SCHEDULER_CASES, SIM_CASES, scheduler_trace, sim_trace

_golden = json.loads(GOLDEN.read_text())


def _first_difference(want: list, got: list) -> str:
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return f"step {i} differs:\n  pinned {a}\n  now    {b}"
    return f"{len(want)} pinned steps, {len(got)} now"


@pytest.mark.parametrize("name", sorted(SCHEDULER_CASES))
def test_scheduler_run_matches_pinned_trace(name):
    got, want = scheduler_trace(name), _golden[name]
    assert got["steps"] == want["steps"], _first_difference(want["steps"], got["steps"])
    assert got["requests"] == want["requests"]


@pytest.mark.parametrize("name", sorted(SIM_CASES))
def test_simulator_run_matches_pinned_trace(name):
    got, want = sim_trace(name), _golden[name]
    assert got["steps"] == want["steps"], _first_difference(want["steps"], got["steps"])
    assert got["metrics"] == want["metrics"]
