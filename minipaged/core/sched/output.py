"""SchedulerOutput: what one engine step runs, as decided by ``schedule()``.

Mirrors vLLM ``vllm/v1/core/sched/output.py`` (plus v0's ``blocks_to_swap_in`` /
``blocks_to_swap_out`` / ``blocks_to_copy``).

Inputs / outputs
    Filled by a scheduler's ``schedule()`` (``scheduler.py`` and its layers,
    ``static.py``); read by the engine (model inputs, block copies) and consumed
    by ``update_from_output``, which adds ``finished``.
Invariants
    ``scheduled`` is in batch order (running first, then swapped-in and admitted);
    ``total_num_scheduled_tokens == sum(n for _, n in scheduled)``; a step has swap-outs or
    swap-ins, never both. The schedulers check these in ``_end_step`` / ``check_invariants``.
Failure mode
    Plain data: a malformed output is the scheduler's bug, caught by its checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipaged.core.sched.request import Request


@dataclass
class SchedulerOutput:
    """What one step runs. The engine reads it; ``update_from_output`` consumes it."""

    # (request, num_new_tokens) in batch order: running requests (decodes and continuing
    # prefill chunks) first, then swapped-in and newly admitted ones.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)  # recompute, this step
    # NOTE: a step has swap-outs or swap-ins, never both (nothing is brought back in a
    # step that preempted), so the engine may do the copies in either order, before the
    # model runs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) CoW
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    refused: list[Request] = field(default_factory=list)  # FINISHED_IGNORED this step
    # Extras (for traces and pictures)
    admitted: list[Request] = field(default_factory=list)  # from waiting, this step
    arrived: list[Request] = field(default_factory=list)  # added since the previous step
    prefill_ids: list[str] = field(default_factory=list)  # scheduled, still prefilling
    decode_ids: list[str] = field(default_factory=list)  # scheduled for one decode token
    new_block_ids: list[int] = field(default_factory=list)  # device blocks given this step
    finished: list[Request] = field(default_factory=list)  # filled by update_from_output
    # Sharing: (parent, child) forks made this step (the child shares the parent's blocks),
    # and those of them whose child has no token yet: the child's first token is sampled
    # from the parent's logits row (the prompt was prefilled once, for the parent).
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    fork_samples: list[tuple[Request, Request]] = field(default_factory=list)
    # Prefix caching: request_id -> prompt tokens found in the cache at admission
    num_cached_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {req.request_id: n for req, n in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
