"""SchedulerOutput: what one engine step runs, as decided by ``schedule()``.

Mirrors vLLM ``vllm/v1/core/sched/output.py``. The paper's scheduler adds its block moves
and forks in its own ``PaperSchedulerOutput`` (``paper_output.py``).

Two halves
    *For the worker* (plain data: ids, token ids, block ids; what ``for_worker()`` keeps
    and what crosses to worker processes): ``scheduled_new_reqs`` (requests the worker
    does not know yet, or whose table it must replace, with their whole block table),
    ``scheduled_cached_reqs`` (the ones it knows: only their *new* block ids),
    ``num_scheduled_tokens`` (request id -> tokens, in batch order),
    ``finished_req_ids`` / ``preempted_req_ids`` (drop them),
    ``scheduled_spec_decode_tokens`` (speculative decoding: the drafts to verify).
    *For the scheduler and the pictures*: ``scheduled`` ``(Request, n)`` pairs and the
    other ``Request`` lists, read by ``update_from_output``, ``trace.record_step`` and
    the simulator; never by the worker.
Invariants
    ``scheduled`` is in batch order (running first, then admitted) and
    its ids equal ``num_scheduled_tokens``' keys in order;
    ``total_num_scheduled_tokens == sum(num_scheduled_tokens.values())``. The schedulers
    check these.
Failure mode
    Plain data: a malformed output is the scheduler's bug, caught by its checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from minipaged.core.sched.request import Request
from minipaged.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker must (re)build: vLLM v1's ``NewRequestData``.

    Sent the first step a request is scheduled, again after it was preempted or swapped
    (the worker dropped it), and, in the paper's scheduler, when copy-on-write replaced a
    block of its table (vLLM v0 sent every table every step)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty for a resumed or forked request
    sampling_params: SamplingParams
    block_ids: list[int]  # its whole block table
    num_computed_tokens: int
    eos_token_id: Optional[int] = None
    base_seed: int = 0  # the sampler's per-request seed (``sampler.request_base_seed``)


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker already holds: vLLM v1's ``CachedRequestData`` (one row)."""

    req_id: str
    new_block_ids: list[int]  # appended to its table
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """What one step runs. The worker reads the plain half; the scheduler the rest."""

    # -- for the worker (plain data) -------------------------------------------------
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # batch order
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # since the previous step
    preempted_req_ids: set[str] = field(default_factory=set)  # this step
    # speculative decoding: request id -> the drafts scheduled after its last token (vLLM's
    # name); the worker runs them and the rejection sampler verifies them
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    # -- for the scheduler, the trace and the simulator --------------------------------
    # (request, num_new_tokens) in batch order: running requests (decodes and continuing
    # prefill chunks) first, then the admitted ones.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # recompute, this step
    refused: list[Request] = field(default_factory=list)  # FINISHED_IGNORED this step
    admitted: list[Request] = field(default_factory=list)  # from waiting, this step
    arrived: list[Request] = field(default_factory=list)  # added since the previous step
    prefill_ids: list[str] = field(default_factory=list)  # scheduled, still prefilling
    decode_ids: list[str] = field(default_factory=list)  # scheduled for one decode token
    new_block_ids: list[int] = field(default_factory=list)  # device blocks given this step
    finished: list[Request] = field(default_factory=list)  # filled after the step
    # prefix caching: request_id -> prompt tokens found in the cache at admission
    num_cached_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def for_worker(self) -> SchedulerOutput:
        """The plain half alone: what a worker (in this process or another) receives."""
        return SchedulerOutput(
            scheduled_new_reqs=list(self.scheduled_new_reqs),
            scheduled_cached_reqs=list(self.scheduled_cached_reqs),
            num_scheduled_tokens=dict(self.num_scheduled_tokens),
            total_num_scheduled_tokens=self.total_num_scheduled_tokens,
            finished_req_ids=set(self.finished_req_ids),
            preempted_req_ids=set(self.preempted_req_ids),
            scheduled_spec_decode_tokens={k: list(v) for k, v in self.scheduled_spec_decode_tokens.items()},
        )
