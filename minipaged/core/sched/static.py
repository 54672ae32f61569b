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

from minipaged.core.sched.output import SchedulerOutput
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
        out = self._begin_step()
        kv = self.kv_cache_manager
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
        token_budget = self.max_num_batched_tokens
        for request in self.running:
            n = request.num_tokens - request.num_computed_tokens
            if n > token_budget:
                continue  # a whole prompt that does not fit this step waits for the next
            out.scheduled.append((request, n))
            token_budget -= n
        return self._end_step(out)

    def _check_allocation(self, in_flight: dict[str, int]) -> None:
        kv = self.kv_cache_manager
        for r in self.running:
            assert kv.block_tables[r.request_id].num_tokens == self._reservation(r), (
                f"batch member {r.request_id}: slots for {kv.block_tables[r.request_id].num_tokens} "
                f"tokens, reservation {self._reservation(r)}"
            )
            assert r.num_computed_tokens + in_flight.get(r.request_id, 0) <= self._reservation(r)


class StaticPagedScheduler(Scheduler):
    """Static batches over paged memory: the 2x2 experiment's third corner (chapter 04).

    A new batch forms only on an empty engine, as in ``StaticBatchScheduler``, but its
    members take blocks as they grow (the base's ``allocate_slots`` and recompute
    preemption) instead of reserving their maximum length. Prompts run whole.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs["enable_chunked_prefill"] = False
        super().__init__(*args, **kwargs)
        self._forming = True

    def schedule(self) -> SchedulerOutput:
        self._forming = not self.running  # a new batch forms only on an empty engine
        return super().schedule()

    def _admit_next(self, budget, out):  # hook: admit only while a batch forms
        return super()._admit_next(budget, out) if self._forming else None
