"""The continuous-batching scheduler: vLLM v1's rule (``vllm/v1/core/sched/scheduler.py``).

Concept
    The batch is rebuilt at every step. ``schedule()`` first serves RUNNING requests in
    arrival order (a decode needs 1 token, an unfinished prefill its next chunk), then
    admits WAITING ones in arrival order, while the batch has room: at most
    ``max_num_seqs`` requests, at most ``max_num_batched_tokens`` tokens (one budget shared
    by prefill chunks and decodes) and free KV blocks. A request is scheduled
    ``num_tokens - num_computed_tokens`` tokens, capped by the budget, so a long prompt is
    split into chunks mixed with other requests' decodes (with ``enable_chunked_prefill``
    off a fresh prompt runs whole or waits). On admission the prefix cache is looked up;
    the blocks a step fills are cached when they are allocated, before the forward.
Inputs / outputs
    ``add_request(request)`` (FCFS); ``schedule() -> SchedulerOutput``;
    ``update_from_output(output, sampled_token_ids) -> finished requests``: advances
    ``num_computed_tokens``, appends the token of each request whose prefill completed,
    stops it (``_check_stop``) and frees its blocks. Exactly one update per schedule.
    ``free_uncached_first`` goes to the ``KVCacheManager`` (vLLM 0.32's free order).
Memory pressure
    Blocks come from the ``KVCacheManager``, which alone counts them. When
    ``allocate_slots`` returns None for a running request, the last request of ``running``
    is preempted by recompute (blocks freed, ``num_computed_tokens = 0``, back to the front
    of ``waiting``) and the allocation is retried; nothing is admitted in that step.
Refusal
    ``ValueError`` from ``add_request`` for a malformed request (not fresh, id in use,
    prompt > ``max_model_len``); ``FINISHED_IGNORED`` for one this engine can never serve
    (``get_max_num_kv_tokens`` needs more blocks than the pool, or a prompt above the
    budget with chunking off), reported in the next ``SchedulerOutput.refused``.
Invariants (``check_invariants``)
    running <= ``max_num_seqs``; scheduled tokens <= ``max_num_batched_tokens``; every
    request is in exactly one queue with a matching status; exactly the running requests
    hold blocks, for ``num_computed_tokens`` tokens between steps; queues in arrival order.
Failure modes
    Over-admission -> preemption thrash (recompute redoes work); a long prompt at the head
    blocks those behind it (FCFS). No livelock: the first running request is its own
    victim only if it alone exceeds the pool, which refusal excludes; a step that does
    nothing while requests wait raises RuntimeError.
Layers (the paper's mechanisms, vLLM v0) extend this class through the hooks marked
``# hook``: ``admission.py`` (watermark), ``swap.py`` (swap preemption), ``groups.py``
(sequence groups with copy-on-write fork); ``static.py`` / ``orca.py`` are baselines.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from minipaged.core.kv.block import check_positive_int
from minipaged.core.kv.kv_cache_manager import KVCacheManager
from minipaged.core.sched.output import SchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus, get_max_num_kv_tokens


class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        max_model_len: Optional[int] = None,
        enable_prefix_caching: bool = False,
        free_uncached_first: bool = False,
    ) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            check_positive_int(name, locals()[name])
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.max_model_len = max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.free_uncached_first = bool(free_uncached_first)  # vLLM 0.32's free order (BlockPool)
        self.kv_cache_manager = self._new_kv_cache_manager()
        self.waiting: deque[Request] = deque()  # arrival order; preempted ones in front
        self.running: list[Request] = []  # arrival order
        self.finished: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every request not yet forgotten
        self.arrival_seq: dict[str, int] = {}  # request_id -> FCFS rank (add order)
        self._next_seq = 0
        self._new_arrivals: list[Request] = []
        self._to_refuse: list[Request] = []  # refused at add_request, reported next step
        self._last_output: Optional[SchedulerOutput] = None
        self._in_flight: Optional[SchedulerOutput] = None  # scheduled, not yet updated
        self.num_steps = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of which found cached (their prefill was skipped)
        # (request, stopped) -> stopped: the engine's stop-string check (OutputProcessor)
        self.stop_checker = None

    def _new_kv_cache_manager(self) -> KVCacheManager:  # hook
        return KVCacheManager(
            self.num_blocks,
            self.block_size,
            enable_caching=self.enable_prefix_caching,
            free_uncached_first=self.free_uncached_first,
        )

    # -- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = self._begin_step()
        budget = self.max_num_batched_tokens
        preempted = False
        # 1. RUNNING first, in arrival order.
        units = self._units(self.running)
        u = 0
        while u < len(units) and budget > 0:
            plan = self._plan(units[u], budget)
            if plan is None:
                u += 1
                continue
            new_blocks = self._allocate(plan)
            while new_blocks is None:  # the pool is full: preempt the last of running, retry
                victims = self._preempt(out)
                units.pop()  # NOTE: never a unit scheduled this step: we go front to back
                preempted = True
                if plan[0][0] in victims:
                    break
                new_blocks = self._allocate(plan)
            if new_blocks is None:
                break  # the asking request preempted itself; those after it are gone too
            self._schedule(plan, new_blocks, out)
            budget -= sum(n for _, n in plan)
            u += 1
        # 2. WAITING, in arrival order (head-of-line: FCFS never skips ahead), unless this
        # step preempted.
        while not preempted and budget > 0:
            admitted = self._admit_next(budget, out)
            if admitted is None:
                break
            unit, plan, new_blocks = admitted
            for r in unit:
                r.status = RequestStatus.RUNNING
                self._insert_by_arrival(self.running, r)
            self._schedule(plan, new_blocks, out)
            budget -= sum(n for _, n in plan)
        if not (out.scheduled or preempted or out.refused) and self._num_queued():
            raise RuntimeError(  # NOTE: cannot happen (see "No livelock"); fail loudly
                f"livelock: nothing scheduled with {len(self.running)} running and "
                f"{self._num_queued() - len(self.running)} other unfinished requests"
            )
        return self._end_step(out)

    def _num_to_compute(self, request: Request) -> int:  # hook
        """Tokens ``request`` has left to compute before it samples."""
        return request.num_tokens - request.num_computed_tokens

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens to schedule for ``request`` under ``budget`` (0 = it must wait).

        With chunked prefill off a fresh prompt runs whole or waits; a re-prefill after
        recompute larger than the whole budget is still chunked, or it could never run."""
        n = self._num_to_compute(request)
        if n <= budget:
            return n
        if self.enable_chunked_prefill or n > self.max_num_batched_tokens:
            return budget
        return 0

    def _units(self, queue) -> list[list[Request]]:  # hook
        """``queue`` cut into what is scheduled all or nothing: here, single requests."""
        return [[r] for r in queue]

    def _plan(self, unit: list[Request], budget: int):  # hook
        """``[(request, num_new_tokens)]`` for ``unit``, or None if it must wait."""
        (request,) = unit
        n = self._num_new_tokens(request, budget)
        return [(request, n)] if n > 0 else None

    def _allocate(self, plan):  # hook
        """The new blocks of each ``(request, n)`` of ``plan``, or None (nothing taken)."""
        ((request, n),) = plan
        new_blocks = self.kv_cache_manager.allocate_slots(request, n)
        return None if new_blocks is None else [new_blocks]

    def _schedule(self, plan, new_blocks, out: SchedulerOutput) -> None:  # hook
        for (request, n), blocks in zip(plan, new_blocks):
            out.scheduled.append((request, n))
            out.new_block_ids.extend(b.block_id for b in blocks)
            # NOTE: as vLLM v1, the blocks this step fills are cached now, before the
            # forward: a request admitted later in this step may hit them (the forward
            # writes every K/V of a layer before any attention reads it).
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens + n)

    def _preempt(self, out: SchedulerOutput) -> list[Request]:
        """Preempt the last unit of ``running``; return its requests."""
        victims = self._units(self.running)[-1]
        del self.running[len(self.running) - len(victims) :]
        for v in victims:
            v.num_preemptions += 1
        self._evict(victims, out)
        return victims

    def _evict(self, victims: list[Request], out: SchedulerOutput) -> None:  # hook
        """Recompute: free the blocks; the unit waits again, at the front, as its first."""
        for v in victims:
            self.kv_cache_manager.free(v)
            v.num_computed_tokens = 0
            v.status = RequestStatus.PREEMPTED
        self._insert_by_arrival(self.waiting, victims[0])
        out.preempted.extend(victims)

    def _admit_next(self, budget: int, out: SchedulerOutput):  # hook
        """Admit the head of ``waiting``: ``(unit, plan, new_blocks)``, or None."""
        if not self.waiting:
            return None
        request = self.waiting[0]
        if len(self.running) + self._num_seats(request) > self.max_num_seqs:
            return None
        kv = self.kv_cache_manager
        # NOTE: the lookup stops one token short of what it computes before sampling
        computed, num_computed = kv.get_computed_blocks(
            request, request.num_computed_tokens + self._num_to_compute(request) - 1
        )
        request.num_computed_tokens = num_computed
        n = self._num_new_tokens(request, budget)
        new_blocks = None
        if n > 0 and self._can_admit(request, computed):
            new_blocks = kv.allocate_slots(request, n, computed)
        if new_blocks is None:
            request.num_computed_tokens = 0
            return None
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
            out.num_cached_tokens[request.request_id] = num_computed
        self.waiting.popleft()
        out.admitted.append(request)
        return [request], [(request, n)], [new_blocks]

    def _num_seats(self, request: Request) -> int:  # hook
        """Places in ``running`` that admitting ``request`` takes."""
        return 1

    def _can_admit(self, request: Request, computed_blocks) -> bool:  # hook
        """vLLM v1: a request is admitted when its first chunk's blocks are free."""
        return True

    # -- after the model ran ----------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]):
        """Advance the scheduled requests; return every request finished this step (the
        refused ones first). A request whose prefill completes needs a sampled token."""
        if output is not self._in_flight:
            raise ValueError("update_from_output() needs the output of the last schedule()")
        need = [
            r.request_id
            for r, n in output.scheduled
            if not r.is_finished
            and r.num_computed_tokens + n == r.num_tokens
            and r.request_id not in sampled_token_ids
        ]
        if need:
            raise ValueError(f"sampled_token_ids lacks a token for requests {need}")
        finished: list[Request] = list(output.refused)
        for req, n in output.scheduled:
            if req.is_finished:  # aborted between schedule() and here
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:  # else a prefill chunk: no token
                self._append_and_check(req, sampled_token_ids[req.request_id], finished)
        output.finished = finished
        self._in_flight = None
        return finished

    def _append_and_check(self, req: Request, token_id: int, finished: list[Request]) -> None:
        req.append_output_token_id(token_id)
        stopped = self._check_stop(req)
        if self.stop_checker is not None:  # stop strings, on the engine's detokenized text
            stopped = self.stop_checker(req, stopped)
        if stopped:
            self.running.remove(req)
            self.kv_cache_manager.free(req)
            self.finished[req.request_id] = req
            finished.append(req)

    def _check_stop(self, req: Request) -> bool:
        """Set a finished status on ``req`` if its newest token ends it (vLLM's order)."""
        tok = req.output_token_ids[-1]
        params = req.sampling_params
        if req.num_output_tokens >= params.max_tokens:
            req.status, req.stop_reason = (
                RequestStatus.FINISHED_LENGTH,
                f"max_tokens={params.max_tokens} reached",
            )
        elif self.max_model_len is not None and req.num_tokens >= self.max_model_len:
            req.status, req.stop_reason = (
                RequestStatus.FINISHED_LENGTH,
                f"max_model_len={self.max_model_len} reached",
            )
        elif req.num_output_tokens < params.min_tokens:
            return False  # NOTE: as vLLM, EOS and stop tokens do not count before min_tokens
        elif not params.ignore_eos and req.eos_token_id is not None and tok == req.eos_token_id:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, f"eos token {tok}"
        elif tok in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, f"stop token {tok}"
        else:
            return False
        return True

    # -- step bookkeeping -------------------------------------------------------------
    def _begin_step(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice without update_from_output()")
        out = SchedulerOutput()
        out.arrived, self._new_arrivals = self._new_arrivals, []
        out.refused, self._to_refuse = self._to_refuse, []
        return out

    def _end_step(self, out: SchedulerOutput) -> SchedulerOutput:
        out.total_num_scheduled_tokens = total = sum(n for _, n in out.scheduled)
        if total > self.max_num_batched_tokens or len(out.scheduled) > self.max_num_seqs:
            raise RuntimeError(f"over budget: {total} tokens, {len(out.scheduled)} sequences")
        for req, n in out.scheduled:
            # NOTE: a request that computes only its newest sampled token is decoding
            if n == 1 and req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1:
                out.decode_ids.append(req.request_id)
            else:
                out.prefill_ids.append(req.request_id)
        self._in_flight = self._last_output = out
        self.num_steps += 1
        return out

    def _insert_by_arrival(self, queue, request: Request) -> None:
        """Put ``request`` into ``queue`` (kept in arrival order; after equal ranks)."""
        seq = self.arrival_seq[request.request_id]
        i = 0
        while i < len(queue) and self.arrival_seq[queue[i].request_id] <= seq:
            i += 1
        queue.insert(i, request)

    # -- requests -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (FCFS). ValueError for an invalid request, state unchanged."""
        self._validate_new(request)
        self._register(request)
        reason = self._refusal_reason(request)
        if reason is not None:
            self._refuse(request, reason)
        else:
            self.waiting.append(request)

    def add_request_group(self, requests: list[Request]) -> None:  # hook
        """The n samples of one ``SamplingParams(n > 1)`` request. vLLM v1 fans them out
        into independent child requests; with prefix caching on they share the prompt's
        full blocks through the cache. (``groups.py``: the paper's fork instead.)"""
        for r in self._validate_group(requests):
            self.add_request(r)

    def _validate_group(self, requests) -> list[Request]:
        requests = list(requests)
        if not requests:
            raise ValueError("requests: a sequence group needs at least one sequence")
        ids = [r.request_id if isinstance(r, Request) else None for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"requests: sequence ids must be distinct, got {ids}")
        for r in requests:
            self._validate_new(r)
            if r.prompt_token_ids != requests[0].prompt_token_ids:
                raise ValueError("requests: the sequences of a group share one prompt")
        return requests

    def _validate_new(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise ValueError(f"request must be a Request, got {type(request).__name__}")
        rid = request.request_id
        old = self.requests.get(rid)
        if old is not None and not old.is_finished:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(
                f"request {rid!r} is not fresh (status {request.status.name}, "
                f"{request.num_computed_tokens} computed tokens)"
            )
        if self.max_model_len is not None and request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens is longer "
                f"than max_model_len={self.max_model_len}"
            )

    def _register(self, request: Request) -> None:
        rid = request.request_id
        self.finished.pop(rid, None)  # NOTE: a finished request's id may be reused
        self.requests[rid] = request
        self.arrival_seq[rid] = self._next_seq
        self._next_seq += 1
        self._new_arrivals.append(request)

    def _refusal_reason(self, request: Request) -> Optional[str]:
        """Why this engine can never serve ``request``, or None."""
        n = get_max_num_kv_tokens(request, self.max_model_len)
        blocks = self.kv_cache_manager.get_max_num_blocks(n)
        if blocks > self.num_blocks:
            return (
                f"refused: needs {blocks} KV blocks for {n} tokens (prompt "
                f"{request.num_prompt_tokens} + max_tokens {request.max_tokens} - 1) but the "
                f"whole pool has {self.num_blocks} blocks of {self.block_size} tokens"
            )
        if not self.enable_chunked_prefill and request.num_prompt_tokens > self.max_num_batched_tokens:
            return (
                f"refused: prompt of {request.num_prompt_tokens} tokens exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens} and chunked prefill is off"
            )
        return None

    def _refuse(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED_IGNORED
        request.stop_reason = reason
        self.finished[request.request_id] = request
        self._to_refuse.append(request)

    def abort_request(self, request_id: str) -> None:  # hook
        """Finish ``request_id`` with FINISHED_ABORTED and free its blocks.

        Aborting a finished request does nothing; an unknown id raises ValueError."""
        request = self.get_request(request_id)
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
            self.kv_cache_manager.free(request)
        else:
            self._dequeue(request)
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = "aborted"
        self.finished[request_id] = request

    def _dequeue(self, request: Request) -> None:  # hook
        """Take a request that is not running out of its queue (abort)."""
        self.waiting.remove(request)

    def get_request(self, request_id: str) -> Request:
        if request_id not in self.requests:
            raise ValueError(f"unknown request {request_id!r}")
        return self.requests[request_id]

    def _num_queued(self) -> int:  # hook
        """Unfinished requests in the queues (running included)."""
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._num_queued() or self._to_refuse)

    def get_num_unfinished_requests(self) -> int:
        """Requests the engine must still step for (refusals count until reported)."""
        return self._num_queued() + len(self._to_refuse)

    # -- invariants -----------------------------------------------------------------
    def _queues(self) -> dict:  # hook
        """name -> (requests, allowed statuses, kept in FCFS order?), all but ``finished``."""
        return {
            "waiting": (self.waiting, (RequestStatus.WAITING, RequestStatus.PREEMPTED), True),
            "running": (self.running, (RequestStatus.RUNNING,), True),
        }

    def check_invariants(self) -> None:
        kv = self.kv_cache_manager
        kv.check_invariants()
        assert len(self.running) <= self.max_num_seqs, (
            f"{len(self.running)} running > max_num_seqs {self.max_num_seqs}"
        )
        out = self._last_output
        if out is not None:
            total = sum(n for _, n in out.scheduled)
            assert total == out.total_num_scheduled_tokens, "total_num_scheduled_tokens is wrong"
            assert total <= self.max_num_batched_tokens, (
                f"{total} tokens scheduled > max_num_batched_tokens {self.max_num_batched_tokens}"
            )
            assert all(n >= 1 for _, n in out.scheduled), "a request was scheduled 0 tokens"
            ids = [r.request_id for r, _ in out.scheduled]
            assert len(set(ids)) == len(ids), f"a request scheduled twice: {ids}"
        where: dict[str, str] = {}
        queues = self._queues()
        for name, (queue, statuses, _) in queues.items():
            for r in queue:
                assert r.request_id not in where, (
                    f"{r.request_id} is in both {where[r.request_id]} and {name}"
                )
                where[r.request_id] = name
                assert r.status in statuses, f"{r.request_id} is {name} with status {r.status.name}"
        for rid, r in self.finished.items():
            assert rid not in where, f"{rid} is in both {where[rid]} and finished"
            assert r.is_finished, f"{rid} is in finished with status {r.status.name}"
            where[rid] = "finished"
        assert set(where) == set(self.requests), (
            f"requests in no queue: {sorted(set(self.requests) - set(where))}"
        )
        for r in self.requests.values():
            assert 0 <= r.num_computed_tokens <= r.num_tokens, f"{r.request_id}: computed > tokens"
        running_ids = {r.request_id for r in self.running}
        assert set(kv.block_tables) == running_ids, (
            f"device blocks held by {sorted(kv.block_tables)}, running {sorted(running_ids)}"
        )
        for name, (queue, statuses, _) in queues.items():
            if RequestStatus.WAITING in statuses:
                for r in queue:
                    assert r.num_computed_tokens == 0, f"{name} {r.request_id} has computed tokens"
        in_flight = {} if self._in_flight is None else self._in_flight.num_scheduled_tokens
        self._check_allocation(in_flight)
        seq = self.arrival_seq
        fcfs = {name: q for name, (q, _, ordered) in queues.items() if ordered}
        for name, queue in fcfs.items():
            s = [seq[r.request_id] for r in queue]
            assert s == sorted(s), f"{name} is not in arrival order: {[r.request_id for r in queue]}"
        others = [r for name, q in fcfs.items() if name != "running" for r in q]
        if self.running and others:
            assert max(seq[r.request_id] for r in self.running) < min(seq[r.request_id] for r in others), (
                "FCFS: a running request arrived after a waiting one"
            )

    def _check_allocation(self, in_flight: dict[str, int]) -> None:  # hook
        kv = self.kv_cache_manager
        for r in self.running:
            expected = r.num_computed_tokens + in_flight.get(r.request_id, 0)
            assert kv.block_tables[r.request_id].num_tokens == expected, (
                f"running {r.request_id}: slots for {kv.block_tables[r.request_id].num_tokens} tokens, "
                f"expected {expected}"
            )
            if not in_flight:
                assert r.num_computed_tokens < r.num_tokens, f"running {r.request_id} is idle"

    # -- a step that raised -----------------------------------------------------------
    def fail_step(
        self, output: Optional[SchedulerOutput], reason: str = "the engine step failed"
    ) -> list[Request]:
        """After the step of ``output`` raised (before or inside ``update_from_output``):
        finish every still-unfinished request it scheduled as FINISHED_ABORTED with
        ``stop_reason`` = ``reason``, free their blocks and clear the in-flight step, so that
        ``schedule()`` runs again. Returns the requests it finished (as vLLM fails every
        request of a step whose engine core raised)."""
        failed = []
        for req, _ in [] if output is None else output.scheduled:
            if not req.is_finished:
                self.abort_request(req.request_id)  # frees its blocks; the layers' hooks too
                req.stop_reason = reason
                failed.append(req)
        self._in_flight = None
        return failed
