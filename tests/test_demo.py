"""``minipaged demo`` (minipaged/demo.py): runs end to end on the course model."""

from minipaged.cli import main
from minipaged.demo import DEMO_ARRIVALS, DEMO_PROMPTS, busiest_step, demo_requests


def test_demo_requests_are_seeded():
    a, b = demo_requests(0), demo_requests(0)
    assert [(r[0], r[1], r[2].max_tokens, r[3]) for r in a] == [
        (r[0], r[1], r[2].max_tokens, r[3]) for r in b
    ]
    assert len(a) == len(DEMO_PROMPTS) == len(DEMO_ARRIVALS) == 8


def test_demo_runs_preempts_and_writes_pictures(tmp_path, capsys):
    out_dir = tmp_path / "pics"
    assert main(["demo", "--out-dir", str(out_dir), "--steps", "4"]) == 0
    text = capsys.readouterr().out
    assert "step   0" in text and "step   4" not in text.split("The whole run")[0]
    assert "more steps not printed" in text
    assert "Generated texts:" in text
    for rid, prompt, _, _ in demo_requests(0):
        assert f"[{rid}] {prompt!r} -> " in text
    # requests join late, and the pool is small enough that someone is preempted
    n_pre = int(text.split(" preemption(s)")[0].rsplit(", ", 1)[1])
    assert n_pre >= 1
    assert (out_dir / "timeline.png").stat().st_size > 10_000
    assert (out_dir / "block_tables.png").stat().st_size > 10_000


def test_busiest_step_prefers_a_preemption():
    from minipaged.trace import EngineTrace, StepRecord

    t = EngineTrace(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=8)
    t.record(StepRecord(step=0, block_tables={"a": [0], "b": [1]}))
    t.record(StepRecord(step=1, block_tables={"a": [0, 2]}, preempted_ids=["b"]))
    assert busiest_step(t) == 1
    t.steps[1].preempted_ids = []
    assert busiest_step(t) == 0
