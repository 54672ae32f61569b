"""Baseline: Orca-style continuous batching over contiguous reservation (the paper's
"Orca (Max / Pow2 / Oracle)" baselines; ``minipaged/sim`` serves them).

vLLM (v0 and v1) instead gives memory a block at a time (``scheduler.py``), so nothing is
reserved for tokens that do not exist yet.

Concept
    Iteration-level batching as in the base ``Scheduler`` (its queues, validation, stop
    checks and step bookkeeping), but memory is a ``ContiguousAllocator``: admission
    reserves the request's whole region up front (``final_len`` = prompt + output, which the
    Oracle / Pow2 policies are assumed to know), first-fit, FCFS with head-of-line blocking.
    Prompts run whole (no chunking); running requests never need more memory, so nobody
    is preempted.
Inputs / outputs
    ``add_request(request, final_len)``; ``schedule()`` / ``update_from_output()`` as the
    base; ``record(output, step)`` -> a ``StepRecord`` (regions are not blocks:
    ``block_tables`` stays empty and ``num_free_blocks`` counts free slots).
Refusal
    FINISHED_IGNORED when ``final_len`` exceeds ``max_model_len``, its reservation exceeds
    the pool, or its prompt exceeds ``max_num_batched_tokens``.
Invariants (``check_invariants``)
    exactly the running requests hold regions, each holding ``num_computed_tokens`` tokens
    between steps; reserved + free slots == the pool.
"""

from __future__ import annotations

from typing import Optional

from minipaged.core.kv.contiguous import ContiguousAllocator
from minipaged.core.sched import utils
from minipaged.core.sched.output import SchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus
from minipaged.core.sched.scheduler import Scheduler
from minipaged.trace import StepRecord


class OrcaScheduler(Scheduler):
    def __init__(
        self,
        num_slots: int,
        max_model_len: int,
        policy: str = "oracle",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        self.allocator = ContiguousAllocator(num_slots, max_model_len, policy)
        super().__init__(
            num_slots,
            1,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=False,
            max_model_len=max_model_len,
        )
        self.kv_cache_manager = self.allocator  # NOTE: regions instead of block tables
        self.final_len: dict[str, int] = {}

    def add_request(self, request: Request, final_len: int) -> None:
        """Queue ``request``; ``final_len`` (prompt + output) sizes its reservation."""
        if request.request_id in self.final_len:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if final_len < request.num_prompt_tokens:
            raise ValueError(f"final_len {final_len} of {request.request_id!r} is shorter than its prompt")
        utils.validate_new_request(request, self.requests, self.max_model_len)
        self.final_len[request.request_id] = final_len
        request.arrival_order, self._num_added = self._num_added, self._num_added + 1
        self._new_arrivals.append(request)
        reason = self._refusal_reason(request, final_len)
        if reason is not None:
            utils.refuse(request, reason)
            self._to_refuse.append(request)
        else:
            self.requests[request.request_id] = request
            self.waiting.append(request)

    def _refusal_reason(self, request: Request, final_len: int) -> Optional[str]:
        size = self.allocator.reservation_size(min(final_len, self.max_model_len))
        if (
            final_len > self.max_model_len
            or size > self.allocator.num_slots
            or request.num_prompt_tokens > self.max_num_batched_tokens
        ):
            return (
                f"refused: final length {final_len} (reservation {size}) does not "
                f"fit max_model_len {self.max_model_len} / "
                f"{self.allocator.num_slots} slots / the token budget"
            )
        return None

    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice without update_from_output()")
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        out.arrived, self._new_arrivals = self._new_arrivals, []
        out.refused, self._to_refuse = self._to_refuse, []
        budget = self.max_num_batched_tokens
        for req in self.running:  # every running request decodes one token
            out.scheduled.append((req, 1))
            budget -= 1
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_prompt_tokens
            if n > budget:
                break  # FCFS: the head waits for a step with room for its whole prompt
            if self.allocator.allocate(req, n, self.final_len[req.request_id]) is None:
                break  # no hole fits its region: head-of-line blocking
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.admitted.append(req)
            out.scheduled.append((req, n))
            budget -= n
        self._in_flight = self._last_output = utils.finish_step(
            out, self.max_num_batched_tokens, self.max_num_seqs
        )
        self.num_steps += 1
        return out

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids):
        finished = super().update_from_output(output, sampled_token_ids)
        regions = self.allocator.regions  # NOTE: read directly: this runs per request per step
        for req, _ in output.scheduled:  # a decode wrote one more K/V into its region
            if not req.is_finished:
                grown = req.num_computed_tokens - regions[req.request_id].num_tokens
                if grown > 0:
                    self.allocator.append_tokens(req, grown)
        return finished

    def check_invariants(self) -> None:
        a = self.allocator
        a.check_invariants()
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        assert set(a.regions) == {r.request_id for r in self.running}, "regions != running requests"
        used = sum(r.size for r in a.regions.values())
        assert used + a.get_num_free_slots() == a.num_slots, "reserved + free != pool"
        for r in self.running:
            reg = a.regions[r.request_id]
            assert reg.num_tokens == r.num_computed_tokens, (
                f"{r.request_id}: region holds {reg.num_tokens} tokens, computed {r.num_computed_tokens}"
            )
            assert r.num_tokens <= reg.final_len, f"{r.request_id} outgrew its region"

    def record(self, output: SchedulerOutput, step: int) -> StepRecord:
        """A ``StepRecord``: regions are not blocks, so ``block_tables`` stays empty and
        ``num_free_blocks`` counts free *slots* (the trace's block_size is 1)."""
        return StepRecord(
            step=step,
            scheduled=dict(output.num_scheduled_tokens),
            prefill_ids=list(output.prefill_ids),
            decode_ids=list(output.decode_ids),
            waiting_ids=[r.request_id for r in self.waiting],
            finished_ids=[r.request_id for r in output.finished],
            arrived_ids=[r.request_id for r in output.arrived],
            num_tokens={r.request_id: r.num_computed_tokens for r in self.running},
            num_free_blocks=self.allocator.get_num_free_slots(),
        )
