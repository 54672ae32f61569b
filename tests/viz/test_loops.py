"""minipaged/viz/loops.py: a scheduler loop's phases and calls, read off its source.

Checked: the outline of a hand-written loop is exactly its phases and callees (worked out
by hand); the real loops outline into the phases their comments name; no outline, and no
stored output of chapters 04, 05 and 08 (which tour the two loops), contains a run of
lines of either ``schedule()`` body (exercises ex4.1 and ex5.4 ask for them); a function
without phase comments is refused.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import pytest
from test_no_printed_answers import REPO, contains, significant, stored_outputs, windows

from minipaged.core import PaperScheduler, Scheduler, StaticBatchScheduler
from minipaged.viz.loops import diff_outlines, diff_outlines_text, loop_outline, outline_text
from minipaged.viz.source import body


def _toy(self, xs):
    out = make_out()  # noqa: F821 (never called: only its source is read)
    # 1. FIRST phase.
    for x in xs:
        self.grow(x, len(xs))
        self.grow(x, 0)
    # 2. SECOND phase.
    while self.queue:
        self.queue.pop()
    return finish(out)  # noqa: F821


def _toy_b(self, xs):
    out = make_out()  # noqa: F821
    # 1. FIRST phase, again.
    for x in xs:
        self.shrink(x)
        self.grow(x, 1)
    # 2. SECOND phase.
    while self.queue:
        self.queue.pop()
    return finish(out)  # noqa: F821


def test_outline_of_a_hand_written_loop():
    assert loop_outline(_toy) == [
        ("setup", ["make_out"]),
        ("1. FIRST phase.", ["self.grow"]),  # once, and len (a builtin) left out
        ("2. SECOND phase.", ["self.queue.pop"]),
        ("end of step", ["finish"]),
    ]
    rows = diff_outlines(_toy, _toy_b)
    assert rows[1] == ("1. FIRST phase.", "1. FIRST phase, again.", [], ["self.grow"], ["self.shrink"])
    assert "only b    : self.shrink" in diff_outlines_text(_toy, _toy_b)


def test_no_phase_comments_is_refused():
    def flat(x):
        return x + 1

    with pytest.raises(ValueError, match="fn:.*numbered phase"):
        loop_outline(flat)


@pytest.mark.parametrize("loop", [Scheduler.schedule, PaperScheduler.schedule])
def test_real_loops_outline_without_their_lines(loop):
    phases = loop_outline(loop)
    titles = [t for t, _ in phases]
    assert titles[0] == "setup" and titles[-1] == "end of step" and len(titles) == 4
    assert titles[1].startswith("1. RUNNING") and titles[2].startswith("2. ")
    assert "self._preempt" in phases[1][1] and "self._schedule" in phases[2][1]
    assert not contains(outline_text(loop), body(loop))
    assert not contains(diff_outlines_text(Scheduler.schedule, PaperScheduler.schedule), body(loop))


def test_v1_loop_calls_the_kv_cache_manager_directly():
    phases = dict(loop_outline(Scheduler.schedule))
    running = next(c for t, c in phases.items() if t.startswith("1."))
    waiting = next(c for t, c in phases.items() if t.startswith("2."))
    assert (
        running.index("kv.allocate_slots")
        < running.index("self.running.pop")
        < running.index("self._preempt")
    )
    assert "kv.get_computed_blocks" in waiting and "kv.allocate_slots" in waiting


def phase_code(loop) -> str:
    """The lines of the loop's numbered phases (what ex4.1 / ex5.4 ask for), not its
    setup and end of step, which every scheduler of the package shares."""
    src = textwrap.dedent(inspect.getsource(loop))
    lines = src.splitlines()
    marks = [i + 1 for i, line in enumerate(lines) if line.strip()[:3] in ("# 1", "# 2")]
    stmts = ast.parse(src).body[0].body
    out = []
    for mark in marks:
        stmt = next(st for st in stmts if st.lineno > mark)
        out.extend(lines[stmt.lineno - 1 : stmt.end_lineno])
    assert len(out) > 10, loop
    return "\n".join(out)


@pytest.mark.parametrize("chapter", ["04_continuous_batching", "05_scheduling", "08_vllm_today"])
def test_chapters_touring_the_loops_do_not_print_them(chapter):
    outs = stored_outputs(os.path.join(REPO, "notebooks", f"{chapter}.ipynb"))
    assert outs, chapter
    for loop in (Scheduler.schedule, PaperScheduler.schedule):
        # runs shared with the static scheduler's loop (chapter 04 prints it: no exercise
        # asks for it) are bookkeeping every loop has, not the exercise's answer
        shared = windows(inspect.getsource(StaticBatchScheduler.schedule))
        needles = windows(phase_code(loop)) - shared
        assert len(needles) > 10
        printed = significant(inspect.getsource(loop))  # the detector sees a printed loop
        assert any(tuple(printed[j : j + len(w)]) == w for w in needles for j in range(len(printed)))
        found = [
            i
            for i, text in outs
            for lines in [significant(text)]
            if any(tuple(lines[j : j + len(w)]) == w for w in needles for j in range(len(lines) - len(w) + 1))
        ]
        assert not found, f"{chapter}: cells {found} print lines of {loop.__qualname__}"
