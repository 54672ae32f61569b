"""minipaged.viz.swap: the swap picture against the scheduler's own copy lists."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from minipaged.core import PaperScheduler, Request  # noqa: E402
from minipaged.sampling_params import SamplingParams  # noqa: E402
from minipaged.trace import run_scheduler  # noqa: E402
from minipaged.viz.swap import swap_blocks, swap_blocks_text  # noqa: E402


def _make(rid, prompt_len, max_tokens):
    return Request(rid, [(7 * j + 3) % 50 for j in range(prompt_len)], SamplingParams(max_tokens=max_tokens))


def _scheduler():
    return PaperScheduler(
        num_blocks=4, block_size=2, max_num_batched_tokens=16, preemption_mode="swap", num_cpu_blocks=4
    )


def _copies():
    """step -> (blocks_to_swap_out, blocks_to_swap_in), from stepping the scheduler itself."""
    s = _scheduler()
    for r in (_make("A", 3, 4), _make("B", 3, 4)):
        s.add_request(r)
    copies, step = {}, 0
    while s.has_unfinished_requests():
        out = s.schedule()
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            copies[step] = (list(out.blocks_to_swap_out), list(out.blocks_to_swap_in))
        s.update_from_output(
            out, {r.request_id: 7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
        )
        step += 1
    return copies


def test_text_names_every_copy_and_its_owner():
    trace = run_scheduler(_scheduler(), [_make("A", 3, 4), _make("B", 3, 4)], lambda r: 7)
    copies = _copies()
    assert copies, "the workload must swap"
    for step, (outs, ins) in copies.items():
        text = swap_blocks_text(trace, step, outs, ins, 4)
        for d, c in outs:
            assert f"swap out B: device {d} -> cpu {c}" in text
            assert d in trace.steps[step - 1].block_tables["B"]  # the block was B's before the step
        for c, d in ins:
            assert f"swap in  B: cpu {c} -> device {d}" in text
            assert d in trace.steps[step].block_tables["B"]  # and is B's again after it


def test_figure_draws_one_arrow_per_copy():
    trace = run_scheduler(_scheduler(), [_make("A", 3, 4), _make("B", 3, 4)], lambda r: 7)
    for step, (outs, ins) in _copies().items():
        fig = swap_blocks(trace, step, outs, ins, 4, managed=False)
        arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
        assert len(arrows) == len(outs) + len(ins)


@pytest.mark.parametrize(
    "outs, ins, cpu, match",
    [
        ([(9, 0)], [], 4, "blocks_to_swap_out"),
        ([], [(0, 9)], 4, "blocks_to_swap_in"),
        ([], [], 0, "num_cpu_blocks"),
    ],
)
def test_bad_input_names_the_argument(outs, ins, cpu, match):
    trace = run_scheduler(_scheduler(), [_make("A", 3, 4), _make("B", 3, 4)], lambda r: 7)
    with pytest.raises(ValueError, match=match):
        swap_blocks_text(trace, 2, outs, ins, cpu)
