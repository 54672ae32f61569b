"""The continuous-batching scheduler of vLLM v1 (``vllm/v1/core/sched/scheduler.py``).

Concept
    The batch is rebuilt at every step, in one loop read top to bottom: first the RUNNING
    requests in order (a decode needs 1 token, an unfinished prefill its next chunk), then
    the WAITING ones in arrival order, while the batch has room: at most ``max_num_seqs``
    requests, at most ``max_num_batched_tokens`` tokens (one budget shared by prefill
    chunks and decodes) and free KV blocks. A request is scheduled ``num_tokens -
    num_computed_tokens`` tokens capped by the budget, so a long prompt is split into
    chunks mixed with other requests' decodes (with ``enable_chunked_prefill`` off a
    fresh prompt runs whole or waits). On admission the prefix cache is looked up; the
    blocks a step fills are cached when they are allocated, before the forward.
Admission (vLLM's options, vLLM 0.32's defaults)
    ``scheduler_reserve_full_isl=True``: a waiting request is admitted only if the blocks
    for *all* its tokens are free (the whole prompt, or prompt + output after a
    recompute), not just its first chunk; ``False`` admits on the first chunk and relies
    on preemption (over-admission thrash, chapter 05). ``watermark``: a fraction of the
    pool kept free when admitting while others run (default 0.0).
Memory pressure
    When ``allocate_slots`` returns None for a running request, the last request of
    ``running`` is preempted by recompute (blocks freed, ``num_computed_tokens = 0``, back
    to the front of ``waiting``) and the allocation retried; nothing is admitted in that
    step. Under FCFS the last of ``running`` is also the latest arrival (the paper's victim).
Inputs / outputs
    ``add_request(request)``; ``schedule() -> SchedulerOutput`` (its plain half is all the
    worker sees); ``update_from_output(output, sampled_token_ids) -> finished requests``;
    ``finish_requests(ids, status)`` (aborts; the output processor's stop strings).
    Finished requests are forgotten at once, as in vLLM v1: their ids reach the worker in
    the next output's ``finished_req_ids``, and nothing of them stays here.
Refusal
    ``ValueError`` from ``add_request`` for a malformed request; ``FINISHED_IGNORED`` for
    one this engine can never serve (``utils.refusal_reason``), reported next step.
Invariants (``check_invariants``)
    running <= ``max_num_seqs``; scheduled tokens <= ``max_num_batched_tokens``; every
    unfinished request in exactly one queue with a matching status; exactly the running
    requests hold blocks, at least for their ``num_computed_tokens`` tokens between steps
    (more after rejected drafts or with lookahead, never past their last possible token);
    queues in arrival order, every running request ahead of every waiting one.
Failure modes
    Over-admission -> preemption thrash; a long prompt at the head blocks those behind it
    (FCFS). No livelock: the first running request is its own victim only if it alone
    exceeds the pool, which refusal excludes; a step that does nothing while requests
    wait raises RuntimeError.
Speculative decoding (as vLLM v1's; proposers and verification in ``minipaged/spec_decode/``)
    A decoding request with drafts (``request.spec_token_ids``, set by
    ``update_draft_token_ids``) is scheduled ``num_tokens_with_spec - num_computed_tokens``
    tokens like any other: its last token and the drafts that fit the budget and its last
    possible token (``scheduled_spec_decode_tokens``), plus ``num_lookahead_tokens`` KV slots
    past them for a draft model's writes (``allocate_slots``). After verification
    ``num_computed_tokens`` goes back by the rejected drafts; the blocks stay, and the next
    step rewrites their slots. A preempted request loses its drafts. (Lookahead slots are
    also reserved at admission, so the first drafts after a prefill have slots; vLLM's
    admission reserves none for a fresh request.)
The paper's scheduler (vLLM v0: sequence groups, swap, copy-on-write) is ``paper.py``.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from minipaged.core.kv.block import cdiv, check_positive_int
from minipaged.core.kv.kv_cache_manager import KVCacheManager
from minipaged.core.sched import utils
from minipaged.core.sched.output import CachedRequestData, SchedulerOutput
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
        free_uncached_first: bool = True,
        scheduler_reserve_full_isl: bool = True,
        watermark: float = 0.0,
        num_lookahead_tokens: int = 0,
    ) -> None:
        check_positive_int("num_lookahead_tokens", num_lookahead_tokens, minimum=0)
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            check_positive_int(name, locals()[name])
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.max_model_len = max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.scheduler_reserve_full_isl = bool(scheduler_reserve_full_isl)
        self.watermark = float(watermark)
        self.watermark_blocks = int(self.watermark * num_blocks)  # NOTE: as vLLM's manager
        self.num_lookahead_tokens = num_lookahead_tokens  # KV slots past a step's (draft model)
        self.kv_cache_manager = KVCacheManager(  # (enable_caching, free_uncached_first)
            num_blocks, block_size, self.enable_prefix_caching, free_uncached_first
        )
        self.waiting: deque[Request] = deque()  # arrival order; preempted ones in front
        self.running: list[Request] = []  # arrival order (FCFS)
        self.requests: dict[str, Request] = {}  # the unfinished ones, by id
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the worker
        self._num_added = 0  # gives each request its arrival_order
        self._new_arrivals: list[Request] = []
        self._to_refuse: list[Request] = []  # refused at add_request, reported next step
        self._last_output: Optional[SchedulerOutput] = None
        self._in_flight: Optional[SchedulerOutput] = None  # scheduled, not yet updated
        self.num_steps = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of which found cached (their prefill was skipped)

    # -- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice without update_from_output()")
        kv = self.kv_cache_manager
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        out.arrived, self._new_arrivals = self._new_arrivals, []
        out.refused, self._to_refuse = self._to_refuse, []
        budget = self.max_num_batched_tokens

        # 1. RUNNING first, in order: decodes (with their drafts) and continuing prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # NOTE: as vLLM, drafts count like known tokens, capped by the request's last
            # possible token (its max_tokens, the context)
            room = get_max_num_kv_tokens(request, self.max_model_len) - request.num_computed_tokens
            n = min(request.num_tokens_with_spec - request.num_computed_tokens, budget, room)
            ahead = min(self.num_lookahead_tokens, room - n)
            while (new_blocks := kv.allocate_slots(request, n, num_lookahead_tokens=ahead)) is None:
                # The pool is full: preempt the last of running (never one scheduled this
                # step: we go front to back) and retry.
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the asking request preempted itself; those after it are gone too
            if (num_spec := request.num_computed_tokens + n - request.num_tokens) > 0:  # the drafts that fit
                out.scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []  # new ones come after this step (update_draft_token_ids)
            self._schedule(request, n, new_blocks, out)
            new_ids = [b.block_id for b in new_blocks]
            out.scheduled_cached_reqs.append(
                CachedRequestData(request.request_id, new_ids, request.num_computed_tokens)
            )
            budget -= n
            i += 1

        # 2. WAITING, in arrival order (FCFS never skips ahead), unless this step preempted.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed, num_computed = kv.get_computed_blocks(request)
            n = self._num_new_tokens(request, num_computed, budget)
            if n == 0:
                break
            room = get_max_num_kv_tokens(request, self.max_model_len) - num_computed - n
            new_blocks = kv.allocate_slots(
                request,
                n,
                computed,
                full_sequence_must_fit=self.scheduler_reserve_full_isl,
                watermark_blocks=self.watermark_blocks if self.running else 0,
                num_lookahead_tokens=min(self.num_lookahead_tokens, room),
            )
            if new_blocks is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_computed
                out.num_cached_tokens[request.request_id] = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.admitted.append(request)
            self._schedule(request, n, new_blocks, out)
            # NOTE: fresh or resumed after recompute, the worker (re)builds it whole
            out.scheduled_new_reqs.append(
                utils.new_request_data(request, kv.get_block_ids(request.request_id))
            )
            budget -= n

        if not (out.scheduled or out.preempted or out.refused) and (self.waiting or self.running):
            raise RuntimeError(  # NOTE: cannot happen (see "No livelock"); fail loudly
                f"livelock: nothing scheduled with {len(self.running)} running and {len(self.waiting)} waiting"
            )
        self._in_flight = self._last_output = utils.finish_step(
            out, self.max_num_batched_tokens, self.max_num_seqs
        )
        self.num_steps += 1
        return out

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        left = request.num_tokens - num_computed
        return utils.num_new_tokens(left, budget, self.enable_chunked_prefill, self.max_num_batched_tokens)

    def _schedule(self, request: Request, n: int, new_blocks, out: SchedulerOutput) -> None:
        out.scheduled.append((request, n))
        out.new_block_ids.extend(b.block_id for b in new_blocks)
        # NOTE: as vLLM v1, the blocks this step fills are cached now, before the forward:
        # a request admitted later in this step may hit them (the forward writes every K/V
        # of a layer before any attention reads it).
        # Drafts are not cached: a block is cached once its tokens are known (vLLM's rule).
        self.kv_cache_manager.cache_blocks(request, min(request.num_computed_tokens + n, request.num_tokens))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute: free the blocks; it waits again, at the front (vLLM's _preempt_request)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        out.preempted_req_ids.add(request.request_id)

    # -- after the model ran ----------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled_token_ids) -> list[Request]:
        """Advance the scheduled requests, append each sampled token and stop the requests
        it ends (``check_stop``); return every request finished this step, refused ones
        first. ``sampled_token_ids``: the worker's ``ModelRunnerOutput``, or a dict request
        id -> token or list (``utils.sampled_tokens``). A request whose known tokens are all
        computed now needs a sampled token; one verified with drafts gets a list (accepted
        drafts + 1) and its ``num_computed_tokens`` goes back by the rejected drafts, as vLLM's."""
        if output is not self._in_flight:
            raise ValueError("update_from_output() needs the output of the last schedule()")
        sampled = utils.sampled_tokens(sampled_token_ids)  # request id -> list[int]
        utils.check_sampled(output, sampled)  # a token for each, 1 to m + 1 for m drafts
        finished: list[Request] = list(output.refused)
        for request, n in output.scheduled:
            if request.is_finished:  # aborted between schedule() and here
                continue
            request.num_computed_tokens += n
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: no token
            tokens = sampled[request.request_id]
            if drafts := output.scheduled_spec_decode_tokens.get(request.request_id):
                # NOTE: as vLLM, the rejected drafts' slots stay: the next step rewrites them
                request.num_computed_tokens -= len(drafts) + 1 - len(tokens)
            for t in tokens:
                request.append_output_token_id(t)
                if utils.check_stop(request, self.max_model_len):
                    self._free_request(request)
                    finished.append(request)
                    break  # NOTE: the tokens after a stop are dropped
        output.finished = finished
        self._in_flight = None
        return finished

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """vLLM's: the drafts proposed after a step, for the next one. Only a running
        request that decodes (all its tokens but the newest computed) takes them; one
        preempted or finished meanwhile takes none."""
        for rid, drafts in draft_token_ids.items():
            r = self.requests.get(rid)
            if r and r.status == RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens - 1:
                r.spec_token_ids = list(drafts)

    def _free_request(self, request: Request) -> None:
        """Forget a finished request: blocks back to the pool, its id to the worker."""
        if request.status != RequestStatus.FINISHED_IGNORED:
            if request in self.running:
                self.running.remove(request)
                self.kv_cache_manager.free(request)
            else:
                self.waiting.remove(request)
            del self.requests[request.request_id]
            self.finished_req_ids.add(request.request_id)

    def finish_requests(
        self, request_ids, status: RequestStatus, reason: Optional[str] = None
    ) -> list[Request]:
        """Finish the named unfinished requests with ``status`` (vLLM's ``finish_requests``:
        aborts, and the stop strings the output processor found); unknown or finished ids
        are ignored, as in vLLM. Returns the requests finished."""
        if not status.is_finished():
            raise ValueError(f"status must be a finished status, got {status.name}")
        done = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            request.status = status
            request.stop_reason = reason if reason is not None else status.value
            self._free_request(request)
            done.append(request)
        return done

    def abort_request(self, request_id: str) -> None:
        """Finish ``request_id`` with FINISHED_ABORTED and free its blocks (vLLM: abort)."""
        self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED, "aborted")

    def fail_step(
        self, output: Optional[SchedulerOutput], reason: str = "the engine step failed"
    ) -> list[Request]:
        """The step of ``output`` raised (before or inside ``update_from_output``): finish
        its unfinished requests as FINISHED_ABORTED with ``stop_reason`` = ``reason``, free
        their blocks and clear the in-flight step, so that ``schedule()`` runs again (vLLM
        fails every request of a step whose engine core raised). Returns them."""
        ids = [] if output is None else [r.request_id for r, _ in output.scheduled]
        self._in_flight = None
        return self.finish_requests(ids, RequestStatus.FINISHED_ABORTED, reason)

    # -- requests -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (FCFS). ValueError for an invalid request, state unchanged."""
        utils.validate_new_request(request, self.requests, self.max_model_len)
        request.arrival_order, self._num_added = self._num_added, self._num_added + 1
        self._new_arrivals.append(request)
        reason = utils.refusal_reason(request, self)
        if reason is not None:
            utils.refuse(request, reason)
            self._to_refuse.append(request)
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_request_group(self, requests: list[Request]) -> None:
        """The n samples of one ``SamplingParams(n > 1)`` request: vLLM v1 fans them out
        into independent child requests; with prefix caching on they share the prompt's
        full blocks through the cache. (The paper forks a sequence group: ``paper.py``.)"""
        for r in utils.validate_group(requests, self.requests, self.max_model_len):
            self.add_request(r)

    def get_request(self, request_id: str) -> Request:
        if request_id not in self.requests:
            raise ValueError(f"unknown request {request_id!r} (finished requests are forgotten)")
        return self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._to_refuse)

    def get_num_unfinished_requests(self) -> int:
        """Requests the engine must still step for (refusals count until reported)."""
        return len(self.requests) + len(self._to_refuse)

    # -- invariants -----------------------------------------------------------------
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
            # NOTE: a table holds the slots of the computed and scheduled tokens, and may
            # hold more (lookahead, rejected drafts' slots), never past the request's last
            held, bs = len(kv.block_tables[r.request_id].blocks), self.block_size
            need = r.num_computed_tokens + in_flight.get(r.request_id, 0)
            most = max(need, get_max_num_kv_tokens(r, self.max_model_len))
            assert cdiv(need, bs) <= held <= cdiv(most, bs), (
                f"running {r.request_id}: {held} blocks, {need} tokens"
            )
            assert in_flight or r.num_computed_tokens < r.num_tokens, f"running {r.request_id} is idle"
        if self.running and self.waiting:
            assert self.running[-1].arrival_order < min(r.arrival_order for r in self.waiting), (
                "FCFS: a running request arrived after a waiting one"
            )
