"""The continuous-batching scheduler: which requests run at each step, and how many tokens.

Mirrors vLLM ``vllm/v1/core/sched/scheduler.py`` (and nano-vllm's ``scheduler.py``);
swapping follows vLLM v0 ``vllm/core/scheduler.py`` and the paper's section 4.5.
Here: ``_SchedulerBase`` (queues, validation, refusal, stop checks; shared with the
static baseline in ``static_scheduler.py``), ``SequenceGroup`` and ``Scheduler``.
``SchedulerOutput`` is in ``sched_output.py``; ``get_max_num_kv_tokens``,
``record_step`` and ``run_scheduler`` are in ``sched_utils.py``.

Concept (continuous batching)
    The batch is rebuilt at every step. ``schedule()`` first keeps the RUNNING requests
    (a decoding request needs 1 token, a partially prefilled one its next chunk), then
    brings back swapped requests and admits WAITING ones in arrival order, while the
    batch has room: at most ``max_num_seqs`` requests, at most ``max_num_batched_tokens``
    tokens, and free KV blocks. Prefill and decode are one mechanism: a request is
    scheduled ``num_tokens - num_computed_tokens`` tokens (capped by the budget, so a
    long prompt is split into chunks across steps, mixed with other requests' decodes).

Admission (vLLM v0's ``BlockSpaceManager.can_allocate``, not v1's first-chunk rule)
    A request leaves ``waiting`` (fresh, or resumed after recompute) only if the blocks
    for its *whole* (re)prefill fit in the free pool after the blocks the running
    requests still need for their own (re)prefills, leaving ``watermark_blocks =
    int(watermark * num_blocks)`` blocks free (``watermark``: constructor keyword,
    ``DEFAULT_WATERMARK`` = 0.05; ``None`` restores vLLM v1's rule: a request is admitted
    when its first chunk fits). For a sequence group the count covers the prompt once and
    each sequence's own output to re-prefill. When nothing is running the request is
    admitted whatever the watermark (it fits alone by the refusal rule), so an idle
    engine always makes progress. Swapped requests come back by ``can_swap_in_group``
    (exact, no watermark); running requests are never held back by it.
    Why: admitting on the first chunk thrashes; a prefill that cannot finish, or decodes
    that outgrow the pool, preempt the latest arrival by recompute. Measured on the CPU
    serving benchmark (64 ShareGPT-like requests at t=0, 123 blocks of 16): 55 recompute
    preemptions with the v1 rule, 42 / 26 / 17 / 10 / 0 with watermark 0.01 / 0.03 /
    0.05 / 0.1 / 0.2 (same steps; 10219 -> 8187 tokens computed at 0.05, 7356 useful).
    In the simulator (``minipaged simulate --workload sharegpt``) paged / Orca-Oracle
    sustainable rate: 1.66x (v1 rule), 1.67x (0.01), 1.71x (0.03), 1.70x (0.05 and
    0.07), 1.66x (0.1): a larger watermark shrinks the batch. vLLM v0's 0.01 is 1% of
    thousands of GPU blocks; here it is 1 block of 123.

Inputs / outputs
    ``add_request(request)``; ``schedule() -> SchedulerOutput`` (requests and token counts
    in batch order, preemptions, the block copies to do before the model runs);
    ``update_from_output(output, sampled_token_ids)`` advances ``num_computed_tokens``,
    appends the token of every request whose prefill is complete, finishes requests on
    EOS / stop token / ``max_tokens`` / ``max_model_len`` and frees their blocks.
    Contract with the engine: exactly one ``update_from_output`` per ``schedule``; between
    the two, request ``r`` scheduled ``n`` tokens computes positions
    ``r.num_computed_tokens .. + n - 1`` and samples iff ``r.num_computed_tokens + n ==
    r.num_tokens``; the block copies in the output are done before the model runs.
    Arrival (FCFS) order is the order of ``add_request`` calls.

Preemption (when ``allocate_slots`` returns None for a running request)
    The victim is the latest-arrived running request (possibly the one asking).
    ``recompute``: its blocks are freed, ``num_computed_tokens`` goes back to 0 and it
    waits at the front of the queue; its prompt *and* its output so far are prefilled
    again later. ``swap``: its blocks are copied to the CPU pool (all or nothing; when the
    CPU pool is full it falls back to recompute) and copied back before anything that
    arrived after it is admitted. Nothing is admitted in a step that preempted.

Refusal (pick-one rule, applied consistently)
    ``ValueError`` from ``add_request``: the request is wrong whatever the engine's size
    (not a fresh WAITING request, an id already in use by an unfinished request, a prompt
    longer than ``max_model_len``). State is unchanged.
    ``FINISHED_IGNORED``: a valid request that *this* engine can never serve: its KV
    (``get_max_num_kv_tokens``) needs more blocks than the whole pool, or, with chunked
    prefill off, its prompt exceeds ``max_num_batched_tokens``. It is finished at once
    with a ``stop_reason`` in words, reported in the next ``SchedulerOutput.refused`` and
    returned by the next ``update_from_output``; the other requests are unaffected.
    ``prompt + max_tokens > max_model_len`` is not an error: generation stops at
    ``max_model_len`` with FINISHED_LENGTH (as in vLLM).

Sharing (chapter 06; the paper's section 4.4, vLLM v0's ``SequenceGroup``)
    ``add_request_group(seqs)`` queues the n sequences of one ``SamplingParams(n > 1)``
    request as a *sequence group*. Only the first unfinished sequence, the *leader*, is
    queued and prefilled; the others are *held*. In the step whose chunk completes the
    leader's prompt, the held sequences are forked from it (``KVCacheManager.fork``:
    they share its blocks) and join ``running``; those without output yet draw their
    first token from the leader's logits row (``SchedulerOutput.fork_samples``): the
    prompt is prefilled once. From then on each sequence appends its own tokens and the
    first write into a shared partly filled block is copied (``blocks_to_copy``). A group
    is scheduled, preempted, swapped and resumed all or nothing; a group preempted by
    recompute is held again and forks again at its prompt (each sequence then re-prefills
    its own output). A group whose sequences together have more tokens to compute than
    ``max_num_batched_tokens`` (large re-prefills) is split across steps even with
    chunked prefill off: in a step, its sequences take the budget in order and those
    left with 0 tokens wait (it could never run whole). It is refused if ``n > max_num_seqs`` or if its worst case (shared
    full prompt blocks + n private tails) exceeds the pool.

    With ``enable_prefix_caching`` a request admitted from ``waiting`` first looks up its
    longest cached prefix (``KVCacheManager.get_computed_blocks``, full blocks, at most
    ``num_tokens - 1`` tokens): those blocks are shared and ``num_computed_tokens``
    starts at the hit length, so the prefill skips them (``num_cached_tokens`` per step,
    ``prefix_cache_queries`` / ``prefix_cache_hits`` in tokens over the run). Blocks are
    cached as they fill, in ``update_from_output``.

Invariants (``check_invariants``)
    running <= ``max_num_seqs``; the last step's tokens <= ``max_num_batched_tokens``;
    every request is in exactly one of waiting / running / swapped / held / finished with
    a matching status; a held sequence holds no blocks and waits for its group's leader;
    the unfinished sequences of a forked group are all running or all swapped; exactly the running requests hold device blocks, exactly the
    swapped ones hold CPU blocks, for exactly ``num_computed_tokens`` tokens between
    steps; FCFS: running, waiting and swapped are each in arrival order and every running
    request arrived before every waiting or swapped one.

Failure modes
    Over-admission -> preemption thrash (recompute redoes work). A long prompt at the head
    of the queue blocks everything behind it (FCFS head-of-line blocking). A request too
    big for the whole cache is refused. No livelock: the earliest-arrived running request
    is the victim only if it runs alone and still cannot get a block, i.e. it alone needs
    more than the pool, which the refusal rule excludes; so it gets >= 1 token every step,
    and every request that fits alone finishes. The first running unit always gets >= 1
    token (a fresh prompt <= the whole budget, a larger re-prefill or group is split), and
    with nothing running the head of ``waiting`` / ``swapped`` fits the empty pool; a
    step that schedules, preempts and refuses nothing while requests are unfinished is
    a bug and raises RuntimeError ("livelock"). Decodes that outgrow the pool still
    preempt (the watermark only slows admission down; a larger one trades batch size for
    fewer preemptions).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.kv_cache_utils import cdiv
from minipaged.core.request import Request, RequestStatus
from minipaged.core.sched_output import SchedulerOutput
from minipaged.core.sched_utils import get_max_num_kv_tokens

PREEMPTION_MODES = ("recompute", "swap")
# NOTE: vLLM v0 uses 0.01 of thousands of GPU blocks; on the course's pools (~100 blocks)
# and in the simulator, 0.05 measured best (see the module docstring, "Admission").
DEFAULT_WATERMARK = 0.05


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class _SchedulerBase:
    """Queues, arrival order, request validation, refusal and stop checks, shared by both
    schedulers. The policy (``schedule``) is in the subclasses."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "recompute",
        num_cpu_blocks: int = 0,
        max_model_len: Optional[int] = None,
        enable_prefix_caching: bool = False,
    ) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        _check_positive_int("max_num_seqs", max_num_seqs)
        _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_model_len is not None:
            _check_positive_int("max_model_len", max_model_len)
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}"
            )
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.preemption_mode = preemption_mode
        self.num_cpu_blocks = num_cpu_blocks
        self.max_model_len = max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, block_size, enable_caching=enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
        )
        self.waiting: deque[Request] = deque()  # arrival order; preempted ones in front
        self.running: list[Request] = []  # arrival order
        self.swapped: deque[Request] = deque()  # arrival order
        self.finished: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every request not yet forgotten
        self.arrival_seq: dict[str, int] = {}  # request_id -> FCFS rank (add order)
        self._next_seq = 0
        self._new_arrivals: list[Request] = []
        self._to_refuse: list[Request] = []  # refused at add_request, reported next step
        self._last_output: Optional[SchedulerOutput] = None
        self._in_flight: Optional[SchedulerOutput] = None  # scheduled, not yet updated
        self.num_steps = 0
        # (request, stopped) -> stopped: the engine's stop-string check (OutputProcessor)
        self.stop_checker = None

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

    def add_request_group(self, requests: list[Request]) -> None:
        """Queue the sequences of one ``n > 1`` request. The baseline serves them as
        independent requests; ``Scheduler`` shares their prompt (see the module docstring)."""
        requests = self._validate_group(requests)
        for r in requests:
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

    def _register(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.finished:  # NOTE: a finished request's id may be reused
            del self.finished[rid]
        self.requests[rid] = request
        self.arrival_seq[rid] = self._next_seq
        self._next_seq += 1
        self._new_arrivals.append(request)

    def _refuse(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED_IGNORED
        request.stop_reason = reason
        self.finished[request.request_id] = request
        self._to_refuse.append(request)

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

    def _refusal_reason(self, request: Request) -> Optional[str]:
        """Why this engine can never serve ``request``, or None."""
        n = get_max_num_kv_tokens(request, self.max_model_len)
        blocks = cdiv(n, self.block_size)
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

    def abort_request(self, request_id: str) -> None:
        """Finish ``request_id`` with FINISHED_ABORTED and free its blocks.

        Aborting a finished request does nothing; an unknown id raises ValueError.
        """
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request {request_id!r}")
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
            self.kv_cache_manager.free(request)
        elif request in self.swapped:
            self.swapped.remove(request)
            self.kv_cache_manager.free_swapped(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = "aborted"
        self.finished[request_id] = request

    def get_request(self, request_id: str) -> Request:
        if request_id not in self.requests:
            raise ValueError(f"unknown request {request_id!r}")
        return self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._to_refuse)

    def get_num_unfinished_requests(self) -> int:
        """Requests the engine must still step for (refusals count until reported)."""
        return (len(self.waiting) + len(self.running) + len(self.swapped)
                + len(self._held_seqs()) + len(self._to_refuse))

    def _held_seqs(self) -> list[Request]:
        """Sequences waiting for their group's leader to be forked (none in the baseline)."""
        return []

    def _insert_by_arrival(self, queue, request: Request) -> None:
        """Put ``request`` into ``queue`` (kept in arrival order)."""
        seq = self.arrival_seq[request.request_id]
        i = 0
        while i < len(queue) and self.arrival_seq[queue[i].request_id] < seq:
            i += 1
        queue.insert(i, request)

    def _begin_step(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice without update_from_output()")
        out = SchedulerOutput()
        out.arrived, self._new_arrivals = self._new_arrivals, []
        out.refused, self._to_refuse = self._to_refuse, []
        return out

    def _end_step(self, out: SchedulerOutput) -> SchedulerOutput:
        out.blocks_to_copy = self.kv_cache_manager.take_pending_copies()
        total = sum(n for _, n in out.scheduled)
        out.total_num_scheduled_tokens = total
        if total > self.max_num_batched_tokens or len(out.scheduled) > self.max_num_seqs:
            raise RuntimeError(f"over budget: {total} tokens, {len(out.scheduled)} sequences")
        for req, n in out.scheduled:
            # NOTE: a request whose scheduled tokens bring it to num_tokens - 1 or less is
            # (re)prefilling; one that computes only its newest token is decoding.
            if n == 1 and req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1:
                out.decode_ids.append(req.request_id)
            else:
                out.prefill_ids.append(req.request_id)
        self._in_flight = out
        self._last_output = out
        self.num_steps += 1
        return out

    # -- after the model ran ----------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance the scheduled requests; return every request finished this step.

        A request samples a token only when this step completes its prefill
        (``num_computed_tokens == num_tokens`` after advancing); a missing token for such a
        request is a ValueError. The returned list starts with ``output.refused``.
        """
        if output is not self._in_flight:
            raise ValueError("update_from_output() needs the output of the last schedule()")
        need = [
            r.request_id for r, n in output.scheduled
            if not r.is_finished and r.num_computed_tokens + n == r.num_tokens
            and r.request_id not in sampled_token_ids
        ] + [
            c.request_id for _, c in output.fork_samples
            if not c.is_finished and c.request_id not in sampled_token_ids
        ]
        if need:
            raise ValueError(f"sampled_token_ids lacks a token for requests {need}")
        finished: list[Request] = list(output.refused)
        for req, n in output.scheduled:
            if req.is_finished:  # aborted between schedule() and here
                continue
            req.num_computed_tokens += n
            if self.enable_prefix_caching:
                self.kv_cache_manager.cache_blocks(req)  # NOTE: its new full blocks are written now
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: the sampled token (if any) is discarded
            self._append_and_check(req, sampled_token_ids[req.request_id], finished)
        # NOTE: a child forked this step computed nothing; its first token was sampled from
        # its parent's logits row.
        for _, child in output.fork_samples:
            if not child.is_finished:
                self._append_and_check(child, sampled_token_ids[child.request_id], finished)
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
            req.status, req.stop_reason = RequestStatus.FINISHED_LENGTH, f"max_tokens={params.max_tokens} reached"
        elif self.max_model_len is not None and req.num_tokens >= self.max_model_len:
            req.status, req.stop_reason = RequestStatus.FINISHED_LENGTH, f"max_model_len={self.max_model_len} reached"
        elif req.num_output_tokens < params.min_tokens:
            return False  # NOTE: as vLLM, EOS and stop tokens do not count before min_tokens
        elif not params.ignore_eos and req.eos_token_id is not None and tok == req.eos_token_id:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, f"eos token {tok}"
        elif tok in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, f"stop token {tok}"
        else:
            return False
        return True

    # -- invariants -----------------------------------------------------------------
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
        # membership and status
        where: dict[str, str] = {}
        for name, queue in (("waiting", self.waiting), ("running", self.running),
                            ("swapped", self.swapped), ("held", self._held_seqs()),
                            ("finished", self.finished.values())):
            for r in queue:
                assert r.request_id not in where, (
                    f"{r.request_id} is in both {where[r.request_id]} and {name}"
                )
                where[r.request_id] = name
        assert set(where) == set(self.requests), (
            f"requests in no queue: {sorted(set(self.requests) - set(where))}"
        )
        ok_status = {
            "waiting": (RequestStatus.WAITING, RequestStatus.PREEMPTED),
            "held": (RequestStatus.WAITING, RequestStatus.PREEMPTED),
            "running": (RequestStatus.RUNNING,),
            "swapped": (RequestStatus.SWAPPED,),
        }
        for rid, name in where.items():
            r = self.requests[rid]
            if name == "finished":
                assert r.is_finished, f"{rid} is in finished with status {r.status.name}"
            else:
                assert r.status in ok_status[name], f"{rid} is {name} with status {r.status.name}"
            assert 0 <= r.num_computed_tokens <= r.num_tokens, f"{rid}: computed > tokens"
        # block ownership
        running_ids = {r.request_id for r in self.running}
        assert set(kv.req_to_blocks) == running_ids, (
            f"device blocks held by {sorted(kv.req_to_blocks)}, running {sorted(running_ids)}"
        )
        swapped_ids = {r.request_id for r in self.swapped}
        assert set(kv.req_to_cpu_blocks) == swapped_ids, (
            f"CPU blocks held by {sorted(kv.req_to_cpu_blocks)}, swapped {sorted(swapped_ids)}"
        )
        for r in (*self.waiting, *self._held_seqs()):
            assert r.num_computed_tokens == 0, f"waiting {r.request_id} has computed tokens"
        in_flight = {} if self._in_flight is None else self._in_flight.num_scheduled_tokens
        self._check_allocation(in_flight)
        for r in self.swapped:
            assert kv.cpu_num_tokens[r.request_id] == r.num_computed_tokens, (
                f"swapped {r.request_id}: CPU blocks for {kv.cpu_num_tokens[r.request_id]} "
                f"tokens, computed {r.num_computed_tokens}"
            )
            assert r.num_computed_tokens < r.num_tokens, f"swapped {r.request_id} has nothing to do"
        # FCFS
        seq = self.arrival_seq
        for name, queue in (("running", self.running), ("waiting", self.waiting),
                            ("swapped", self.swapped)):
            s = [seq[r.request_id] for r in queue]
            assert s == sorted(s), f"{name} is not in arrival order: {[r.request_id for r in queue]}"
        if self.running and (self.waiting or self.swapped):
            last_running = max(seq[r.request_id] for r in self.running)
            first_other = min(seq[r.request_id] for r in (*self.waiting, *self.swapped))
            assert last_running < first_other, (
                "FCFS: a running request arrived after a waiting or swapped one"
            )

    def _check_allocation(self, in_flight: dict[str, int]) -> None:
        kv = self.kv_cache_manager
        for r in self.running:
            expected = r.num_computed_tokens + in_flight.get(r.request_id, 0)
            assert kv.num_tokens[r.request_id] == expected, (
                f"running {r.request_id}: slots for {kv.num_tokens[r.request_id]} tokens, "
                f"expected {expected}"
            )
            if not in_flight:
                assert r.num_computed_tokens < r.num_tokens, f"running {r.request_id} is idle"



@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one ``SamplingParams(n > 1)`` request (vLLM v0's SequenceGroup)."""

    group_id: str
    seqs: list[Request]  # in arrival order
    forked: bool = False  # the unfinished sequences share the leader's prompt blocks

    @property
    def unfinished(self) -> list[Request]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def leader(self) -> Request:
        """The sequence that is queued and prefilled for the whole group."""
        return self.unfinished[0]

    @property
    def needs_fork(self) -> bool:
        return not self.forked and len(self.unfinished) > 1


class Scheduler(_SchedulerBase):
    """Continuous batching with chunked prefill, preemption, sequence groups and prefix
    caching (vLLM v1 style, groups as in vLLM v0)."""

    def __init__(self, *args, watermark: Optional[float] = DEFAULT_WATERMARK, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs num_cpu_blocks > 0")
        if watermark is not None and (
                not isinstance(watermark, (int, float)) or isinstance(watermark, bool)
                or not 0 <= watermark < 1):
            raise ValueError(f"watermark must be None or a fraction in [0, 1), got {watermark!r}")
        # None: vLLM v1 admission (the first chunk must fit), no watermark
        self.watermark = None if watermark is None else float(watermark)
        # NOTE: as vLLM v0's BlockSpaceManager: int(watermark * num_gpu_blocks)
        self.watermark_blocks = 0 if watermark is None else int(self.watermark * self.num_blocks)
        self.seq_groups: dict[str, SequenceGroup] = {}  # sequence id -> its group (n > 1)
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of which found cached (their prefill was skipped)

    # -- groups ---------------------------------------------------------------------
    def add_request_group(self, requests: list[Request]) -> None:
        """Queue the n sequences of one request: the leader waits, the others are held
        until the leader's prompt is computed, then forked from it. ValueError for an
        invalid group, state unchanged."""
        requests = self._validate_group(requests)
        if len(requests) == 1:
            return self.add_request(requests[0])
        group = SequenceGroup(requests[0].request_id, requests)
        for r in requests:
            self._register(r)
        reason = self._group_refusal_reason(requests)
        if reason is not None:
            for r in requests:
                self._refuse(r, reason)
            return
        for r in requests:
            self.seq_groups[r.request_id] = group
        self.waiting.append(requests[0])

    def _group_refusal_reason(self, requests: list[Request]) -> Optional[str]:
        reason = self._refusal_reason(requests[0])
        if reason is not None:
            return reason
        n = len(requests)
        if n > self.max_num_seqs:
            return f"refused: a group of {n} sequences exceeds max_num_seqs={self.max_num_seqs}"
        bs = self.block_size
        shared = requests[0].num_prompt_tokens // bs  # full prompt blocks, never copied
        tail = cdiv(get_max_num_kv_tokens(requests[0], self.max_model_len), bs) - shared
        if shared + n * tail > self.num_blocks:
            return (
                f"refused: {n} sequences may need {shared} shared + {n} x {tail} private KV "
                f"blocks but the whole pool has {self.num_blocks}"
            )
        return None

    def _held_seqs(self) -> list[Request]:
        groups = {id(g): g for g in self.seq_groups.values()}.values()
        return [s for g in groups if g.needs_fork for s in g.unfinished[1:]]

    def _fork_target(self, request: Request) -> Optional[SequenceGroup]:
        """The group whose held sequences fork from ``request`` once its prompt is computed."""
        g = self.seq_groups.get(request.request_id)
        return g if g is not None and g.needs_fork and g.leader is request else None

    def _units(self, queue) -> list[list[Request]]:
        """``queue`` cut into scheduling units: a group's sequences together, in order."""
        units: list[list[Request]] = []
        last = None
        for r in queue:
            g = self.seq_groups.get(r.request_id)
            if g is not None and g is last:
                units[-1].append(r)
            else:
                units.append([r])
            last = g
        return units

    def _maybe_fork(self, request: Request, n: int, out: SchedulerOutput) -> None:
        """Fork the held sequences from ``request`` if this step computes its last prompt token."""
        group = self._fork_target(request)
        if group is None or request.num_computed_tokens + n != request.num_prompt_tokens:
            return
        kv = self.kv_cache_manager
        for child in group.unfinished[1:]:
            kv.fork(request, child)
            # NOTE: the child's prompt K/V is written by the parent's rows of this very step;
            # nobody reads it before then, so it counts as computed from now on.
            child.num_computed_tokens = request.num_prompt_tokens
            child.status = RequestStatus.RUNNING
            self._insert_by_arrival(self.running, child)
            out.forks.append((request, child))
            if child.num_computed_tokens == child.num_tokens:
                out.fork_samples.append((request, child))
        group.forked = True

    def abort_request(self, request_id: str) -> None:
        """As in the base class; aborting any sequence of a group that has not forked yet
        aborts the whole group (its held sequences have nothing of their own)."""
        g = self.seq_groups.get(request_id)
        if g is not None and g.needs_fork and not self.requests[request_id].is_finished:
            held = g.unfinished[1:]
            super().abort_request(g.leader.request_id)
            for r in held:
                r.status = RequestStatus.FINISHED_ABORTED
                r.stop_reason = "aborted"
                self.finished[r.request_id] = r
        else:
            super().abort_request(request_id)
        self._forget_group_if_done(request_id)

    def _forget_group_if_done(self, request_id: str) -> None:
        g = self.seq_groups.get(request_id)
        if g is not None and not g.unfinished:
            for s in g.seqs:
                self.seq_groups.pop(s.request_id, None)

    def update_from_output(self, output, sampled_token_ids):
        finished = super().update_from_output(output, sampled_token_ids)
        for r in finished:
            self._forget_group_if_done(r.request_id)
        return finished

    # -- one step -------------------------------------------------------------------
    def _num_to_compute(self, request: Request) -> int:
        """Tokens ``request`` has left to compute before it samples (a group leader with
        held sequences stops at its prompt's end, where they fork)."""
        target = request.num_tokens
        if self._fork_target(request) is not None:
            target = request.num_prompt_tokens
        return target - request.num_computed_tokens

    def _num_new_tokens(self, request: Request, token_budget: int, split: bool = False) -> int:
        """Tokens to schedule for ``request`` under ``token_budget`` (0 = must wait).

        With chunked prefill off a fresh prompt runs whole or waits; a request resumed after
        recompute whose prompt + output exceeds the whole budget is still chunked, or it
        could never run again; so is (``split``) a sequence of a group whose re-prefills
        together exceed the whole budget.
        """
        n = self._num_to_compute(request)
        if n <= token_budget:
            return n
        if self.enable_chunked_prefill or split or n > self.max_num_batched_tokens:
            return token_budget
        return 0

    def _plan(self, unit: list[Request], token_budget: int) -> Optional[list[tuple[Request, int]]]:
        """Tokens for every sequence of ``unit`` (in order), or None if the unit must wait.

        Normally every sequence gets >= 1 token or the unit waits. A unit whose sequences
        together need more than the whole ``max_num_batched_tokens`` (a group re-prefilling
        its outputs after recompute) could never run that way: it is split, each sequence
        in order taking what the budget still has, and the sequences left with 0 tokens
        wait for a later step (entries with n = 0 stay in the plan). Its first sequence
        always gets >= 1 token, so it progresses.
        """
        plan, budget = [], token_budget
        for r in unit:
            n = self._num_new_tokens(r, budget)
            if n <= 0:
                break
            plan.append((r, n))
            budget -= n
        else:
            return plan
        if sum(self._num_to_compute(r) for r in unit) <= self.max_num_batched_tokens:
            return None  # NOTE: it fits whole in some later step
        plan, budget = [], token_budget
        for r in unit:
            n = self._num_new_tokens(r, budget, split=True) if budget > 0 else 0
            plan.append((r, n))
            budget -= n
        return plan if plan[0][1] > 0 else None

    def _preempt(self, out: SchedulerOutput) -> list[Request]:
        """Preempt the latest-arrived running request, with its whole group; return them."""
        last = self.running[-1]  # NOTE: running is kept in arrival order
        g = self.seq_groups.get(last.request_id)
        victims = [r for r in self.running if self.seq_groups.get(r.request_id) is g] if g else [last]
        del self.running[len(self.running) - len(victims):]
        for v in victims:
            v.num_preemptions += 1
        if self.preemption_mode == "swap":
            mapping = self.kv_cache_manager.swap_out_group(victims)
            if mapping is not None:
                for v in victims:
                    v.status = RequestStatus.SWAPPED
                    self._insert_by_arrival(self.swapped, v)
                out.blocks_to_swap_out.extend(mapping)
                out.swapped_out.extend(victims)
                return victims
            # NOTE: the CPU pool is full: fall back to recompute
        for v in victims:
            self.kv_cache_manager.free(v)
            v.num_computed_tokens = 0
            v.status = RequestStatus.PREEMPTED
        if g is not None:
            g.forked = False  # NOTE: the leader re-prefills the prompt, the others fork again
        self._insert_by_arrival(self.waiting, victims[0])
        out.preempted.extend(victims)
        return victims

    def _allocate_unit(self, plan) -> list[list]:
        kv = self.kv_cache_manager
        allocated = [kv.allocate_slots(r, n) if n > 0 else [] for r, n in plan]
        assert all(a is not None for a in allocated), "the block count promised room"
        return allocated

    def _schedule_unit(self, plan, out: SchedulerOutput, new_blocks_per_seq) -> None:
        for (req, n), new_blocks in zip(plan, new_blocks_per_seq):
            if n == 0:
                continue  # NOTE: a split unit's sequence that waits for a later step
            out.scheduled.append((req, n))
            out.new_block_ids.extend(b.block_id for b in new_blocks)
        for req, n in plan:
            if n > 0:
                self._maybe_fork(req, n, out)

    def schedule(self) -> SchedulerOutput:
        out = self._begin_step()
        kv = self.kv_cache_manager
        token_budget = self.max_num_batched_tokens

        # 1. running requests first, in arrival order, a group all or nothing.
        units = self._units(self.running)
        u = 0
        while u < len(units) and token_budget > 0:
            plan = self._plan(units[u], token_budget)
            if plan is None:
                u += 1
                continue
            # NOTE: the whole unit's blocks are counted before any is taken, so a unit
            # that must preempt itself holds nothing half-allocated (its swap copies
            # exactly its computed tokens).
            seqs, ns = [r for r, _ in plan], [n for _, n in plan]
            lost = False
            while kv.get_num_blocks_needed_group(seqs, ns) > kv.get_num_free_blocks():
                # NOTE: the victim is never a unit already scheduled this step: it is the
                # last of ``running`` and we go through ``running`` front to back.
                victims = self._preempt(out)
                units.pop()
                if seqs[0] in victims:
                    lost = True
                    break
            if lost:
                break  # the asking unit preempted itself; those after it are gone too
            allocated = self._allocate_unit(plan)
            self._schedule_unit(plan, out, allocated)
            token_budget -= sum(n for _, n in plan)
            u += 1

        # 2. swapped and waiting requests, one merged arrival order (FCFS), unless this
        # step preempted. Every swapped request arrived before every never-admitted one,
        # so nothing new is admitted while anything is swapped out.
        if out.preempted or out.swapped_out:
            return self._end_step(out)
        while token_budget > 0:
            from_swap = bool(self.swapped) and (
                not self.waiting
                or self.arrival_seq[self.swapped[0].request_id]
                < self.arrival_seq[self.waiting[0].request_id]
            )
            if not from_swap and not self.waiting:
                break
            if from_swap:
                unit = self._units(self.swapped)[0]
                if len(self.running) + len(unit) > self.max_num_seqs:
                    break
                plan = self._plan(unit, token_budget)
                if plan is None or not kv.can_swap_in_group(unit, [n for _, n in plan]):
                    break  # head-of-line: FCFS never skips ahead
                out.blocks_to_swap_in.extend(kv.swap_in_group(unit))
                for r in unit:
                    self.swapped.remove(r)
                out.swapped_in.extend(unit)
                allocated = self._allocate_unit(plan)
            else:
                request = self.waiting[0]
                group = self._fork_target(request)
                size = 1 if group is None else len(group.unfinished)
                if len(self.running) + size > self.max_num_seqs:
                    break
                plan, allocated = self._admit(request, token_budget, out)
                if plan is None:
                    break  # head-of-line: FCFS never skips ahead
                self.waiting.popleft()
                out.admitted.append(request)
                unit = [request]
            for r in unit:
                r.status = RequestStatus.RUNNING
                self._insert_by_arrival(self.running, r)
            self._schedule_unit(plan, out, allocated)
            token_budget -= sum(n for _, n in plan)
        if not (out.scheduled or out.preempted or out.swapped_out or out.refused) and (
                self.running or self.waiting or self.swapped):
            # NOTE: cannot happen (see "No livelock" in the module docstring); fail loudly
            # rather than let the engine step forever.
            raise RuntimeError(
                f"livelock: nothing scheduled with {len(self.running)} running, "
                f"{len(self.waiting)} waiting, {len(self.swapped)} swapped requests")
        return self._end_step(out)

    def _admit(self, request: Request, token_budget: int, out: SchedulerOutput):
        """Prefix-cache lookup and blocks for a request from ``waiting``; (plan, blocks) or
        (None, None) with nothing changed."""
        kv = self.kv_cache_manager
        computed, num_computed = [], 0
        if self.enable_prefix_caching:
            limit = None
            if self._fork_target(request) is not None:
                limit = request.num_prompt_tokens - 1  # NOTE: the group forks at the prompt's end
            computed, num_computed = kv.get_computed_blocks(request, limit)
        request.num_computed_tokens = num_computed
        if self.watermark is not None and self.running and not self._can_admit(request, computed):
            request.num_computed_tokens = 0
            return None, None
        n = self._num_new_tokens(request, token_budget)
        new_blocks = kv.allocate_slots(request, n, computed) if n > 0 else None
        if new_blocks is None:
            request.num_computed_tokens = 0
            return None, None
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
            out.num_cached_tokens[request.request_id] = num_computed
        return [(request, n)], [new_blocks]

    def _num_blocks_to_prefill(self, request: Request) -> int:
        """Blocks (an upper bound) for ``request`` to compute all its tokens from scratch;
        for a group leader with held sequences, the whole group's: the prompt once, plus
        each sequence's own output, re-prefilled after recompute, from its prompt's last
        full block on."""
        bs = self.block_size
        need = cdiv(request.num_tokens, bs)
        g = self._fork_target(request)
        if g is not None:
            shared = request.num_prompt_tokens // bs
            need += sum(cdiv(m.num_tokens, bs) - shared for m in g.unfinished[1:]
                        if m.num_tokens > m.num_prompt_tokens)
        return need

    def _num_blocks_reserved(self) -> int:
        """Blocks the running requests still need to compute the tokens they already have
        (the rest of their prefill or re-prefill, and a decode step's new block)."""
        kv = self.kv_cache_manager
        reserved = 0
        for r in self.running:
            held = len(kv.req_to_blocks.get(r.request_id, ()))
            reserved += max(0, self._num_blocks_to_prefill(r) - held)
        return reserved

    def _can_admit(self, request: Request, computed_blocks) -> bool:
        """Whether ``request`` (from ``waiting``, prefix hits ``computed_blocks``) may start.

        NOTE: vLLM v1 admits a request when its first chunk fits; a prefill that then
        cannot finish preempts the latest arrival, often itself, and the work is lost
        (recompute thrash). As vLLM v0 (``BlockSpaceManager.can_allocate``), a request is
        admitted only if the blocks for its whole (re)prefill fit in the free pool while
        leaving ``watermark_blocks`` free, after the blocks the running requests still
        need for their own prefills. Hit blocks that someone else holds cost nothing;
        free cached ones are taken from the free pool like any other.
        """
        need = self._num_blocks_to_prefill(request)
        need -= sum(1 for b in computed_blocks if b.ref_cnt > 0)
        free = self.kv_cache_manager.get_num_free_blocks() - self._num_blocks_reserved()
        return free - need >= self.watermark_blocks

    def check_invariants(self) -> None:
        super().check_invariants()
        for g in {id(g): g for g in self.seq_groups.values()}.values():
            live = g.unfinished
            assert live, f"group {g.group_id} is done but still registered"
            if g.forked:
                places = {("running" if r in self.running else "swapped" if r in self.swapped
                           else "elsewhere") for r in live}
                assert places in ({"running"}, {"swapped"}), (
                    f"group {g.group_id}: sequences split across {sorted(places)}"
                )


# NOTE: re-exports, so that ``from minipaged.core.scheduler import X`` keeps working for
# the names that moved out. At the bottom: static_scheduler.py imports _SchedulerBase
# from this module, which is complete by now (minipaged/core/__init__.py imports this
# module first, so the import order is always this one).
from minipaged.core.sched_utils import record_step, run_scheduler  # noqa: E402
from minipaged.core.static_scheduler import StaticBatchScheduler  # noqa: E402
