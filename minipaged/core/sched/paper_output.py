"""PaperSchedulerOutput: the paper's scheduler's step (``paper.py``), a ``SchedulerOutput``
plus its block moves (vLLM v0's ``blocks_to_swap_out`` / ``blocks_to_swap_in`` /
``blocks_to_copy``) and its forks.

vLLM v1 instead: no swap (recompute only), no copy-on-write (``n > 1`` shares full prompt
blocks through the prefix cache), so its ``SchedulerOutput`` has none of these fields.

Inputs / outputs
    Filled by ``PaperScheduler.schedule()``; ``for_worker()`` keeps the base's plain half
    and the moves and fork ids, which ``PaperModelRunner`` (``worker/paper_runner.py``)
    does before the forward. Readers shared with vLLM v1's scheduler (the trace, the
    engine core, the simulator) read these fields only after ``isinstance(out,
    PaperSchedulerOutput)``: where it is not one, nothing was swapped or forked.
Invariants
    a step has swap-outs or swap-ins, never both (nothing is brought back in a step that
    preempted), so the worker may do the copies in either order, before the model runs;
    ``fork_sample_ids`` are the ids of ``fork_samples``, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipaged.core.sched.output import SchedulerOutput
from minipaged.core.sched.request import Request


@dataclass
class PaperSchedulerOutput(SchedulerOutput):
    # -- for the worker (plain data) -------------------------------------------------
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) CoW
    # (parent id, child id) forked this step whose child samples from the parent's row
    fork_sample_ids: list[tuple[str, str]] = field(default_factory=list)

    # -- for the scheduler, the trace and the simulator --------------------------------
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    # (parent, child) forks made this step, and those whose child samples from the
    # parent's logits row (the prompt was prefilled once, for the parent)
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    fork_samples: list[tuple[Request, Request]] = field(default_factory=list)

    def for_worker(self) -> PaperSchedulerOutput:
        """The base's plain half, plus the block moves and the fork ids."""
        return PaperSchedulerOutput(
            **vars(super().for_worker()),
            blocks_to_swap_out=list(self.blocks_to_swap_out),
            blocks_to_swap_in=list(self.blocks_to_swap_in),
            blocks_to_copy=list(self.blocks_to_copy),
            fork_sample_ids=list(self.fork_sample_ids),
        )
