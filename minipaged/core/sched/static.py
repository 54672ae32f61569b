"""The static-batching baseline: ``StaticBatchScheduler``.

What it is
    Request-level batching as in FasterTransformer-style serving (the baseline of the
    Orca and vLLM papers): a batch of up to ``max_num_seqs`` requests is formed only when
    the previous batch has completely finished, and each member reserves KV memory for
    its maximum length (``get_max_num_kv_tokens``) up front, as a contiguous allocator
    must. Prompts run whole (no chunking) and nothing is ever preempted or swapped. The
    n sequences of a ``SamplingParams(n > 1)`` request are served independently, without
    sharing. Queues, validation, refusal and stop checks are the base ``Scheduler``'s
    (``scheduler.py``); only ``schedule`` differs.

Inputs / outputs
    As ``Scheduler``: ``add_request``; ``schedule() -> SchedulerOutput``;
    ``update_from_output(output, sampled_token_ids)``.

Invariants (``check_invariants``)
    Those of the base, plus: every batch member holds exactly its reservation's slots and
    never computes past it; nothing is admitted while a batch runs.

Failure mode
    Waste, not errors: a batch runs as long as its longest member while finished members'
    seats stay empty, and reservations for the maximum length leave most reserved slots
    unused (internal fragmentation), so fewer requests fit. A request whose reservation
    exceeds the whole pool is refused (FINISHED_IGNORED).
"""

from __future__ import annotations

from collections import deque

from minipaged.core.sched import utils
from minipaged.core.sched.output import CachedRequestData, SchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus, get_max_num_kv_tokens
from minipaged.core.sched.scheduler import Scheduler


class StaticBatchScheduler(Scheduler):
    """The baseline: static batches with a max-length reservation per request.

    A batch of up to ``max_num_seqs`` requests is formed only when the previous batch has
    completely finished; each member reserves ``ceil(get_max_num_kv_tokens / block_size)``
    blocks up front (memory for its maximum length, as a contiguous allocator must).
    Prompts run whole (no chunking; ``enable_chunked_prefill`` is ignored) and a prompt
    waits for a step with enough token budget left. Nothing is ever preempted.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.enable_chunked_prefill = False  # NOTE: static batching never chunks

    def _reservation(self, request: Request) -> int:
        return get_max_num_kv_tokens(request, self.max_model_len)

    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice without update_from_output()")
        kv = self.kv_cache_manager
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        out.arrived, self._new_arrivals = self._new_arrivals, []
        out.refused, self._to_refuse = self._to_refuse, []
        if not self.running:  # the previous batch is done: form a new one (FCFS)
            while self.waiting and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                new_blocks = kv.allocate_slots(request, self._reservation(request))
                if new_blocks is None:
                    break
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                out.admitted.append(request)
                out.new_block_ids.extend(b.block_id for b in new_blocks)
                out.scheduled_new_reqs.append(
                    utils.new_request_data(request, kv.get_block_ids(request.request_id))
                )
        admitted = set(map(id, out.admitted))
        token_budget = self.max_num_batched_tokens
        for request in self.running:
            n = request.num_tokens - request.num_computed_tokens
            if n > token_budget:
                continue  # a whole prompt that does not fit this step waits for the next
            out.scheduled.append((request, n))
            if id(request) not in admitted:
                out.scheduled_cached_reqs.append(
                    CachedRequestData(request.request_id, [], request.num_computed_tokens)
                )
            token_budget -= n
        self._in_flight = self._last_output = utils.finish_step(
            out, self.max_num_batched_tokens, self.max_num_seqs
        )
        self.num_steps += 1
        return out

    def check_invariants(self) -> None:
        kv = self.kv_cache_manager
        waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        queues = {
            "waiting": (self.waiting, waiting, True),
            "running": (self.running, (RequestStatus.RUNNING,), True),
        }
        utils.check_scheduler(self, queues)
        in_flight = {} if self._in_flight is None else self._in_flight.num_scheduled_tokens
        for r in self.running:
            held = kv.block_tables[r.request_id].num_tokens
            assert held == self._reservation(r), (
                f"batch member {r.request_id}: slots for {held} tokens, reservation {self._reservation(r)}"
            )
            assert r.num_computed_tokens + in_flight.get(r.request_id, 0) <= self._reservation(r)


class StaticPagedScheduler(Scheduler):
    """Static batches over paged memory: the 2x2 experiment's third corner (chapter 04).

    A new batch forms only on an empty engine, as in ``StaticBatchScheduler``, but its
    members take blocks as they grow (``Scheduler``'s loop, first-chunk admission and
    recompute preemption) instead of reserving their maximum length. Prompts run whole.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs["enable_chunked_prefill"] = False
        kwargs.setdefault("scheduler_reserve_full_isl", False)
        super().__init__(*args, **kwargs)

    def schedule(self) -> SchedulerOutput:
        if not self.running:  # a new batch forms only on an empty engine
            return super().schedule()
        held, self.waiting = self.waiting, deque()  # nothing is admitted while a batch runs
        try:
            return super().schedule()
        finally:  # NOTE: members preempted this step wait in front of the others
            held.extendleft(reversed(self.waiting))
            self.waiting = held
