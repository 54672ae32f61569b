"""The paper's scheduler (vLLM v0, ``vllm/core/scheduler.py`` of 2023): its own loop.

vLLM v1 (``scheduler.py``) keeps one request per sequence, preempts by recompute only and
shares prompts through the prefix cache; diff the two ``schedule()`` loops to see what the
paper had that v1 dropped.

Concept
    The unit of scheduling is a *sequence group* (the n samples of ``SamplingParams(n > 1)``,
    or one request): scheduled, preempted, swapped and resumed all or nothing. One step:
    1. RUNNING groups in arrival order get their tokens (all-or-nothing allocation); when
       the pool is full, the *latest arrival* (the last group of ``running``) is preempted,
       by swap (``preemption_mode="swap"``: its blocks copied to a CPU pool, all or
       nothing) or by recompute (freed; it re-prefills later), and the allocation retried.
    2. Unless this step preempted: the earlier arrival of the heads of SWAPPED and WAITING
       comes back next, while it fits. A swapped group returns when the blocks for its
       swap-in *and* its next tokens are free; a waiting one when its whole (re)prefill
       fits after what the running ones still need, leaving ``watermark * num_blocks``
       free (vLLM v0's ``can_allocate``; None = v1's first-chunk rule).
    Sharing (section 4.4): only a group's first unfinished sequence, the *leader*, is
    prefilled; at its prompt's end the others are forked from it (``BlockSpaceManager.fork``:
    shared blocks, copy-on-write later) and draw their first token from its logits row
    (``fork_samples``). ``fork_request`` forks a running request (beam search).
Inputs / outputs
    As ``Scheduler``, but ``schedule()`` returns a ``PaperSchedulerOutput``
    (``paper_output.py``): plus ``blocks_to_swap_out`` / ``blocks_to_swap_in`` /
    ``blocks_to_copy``, ``swapped_out`` / ``swapped_in``, ``forks`` / ``fork_samples``.
    The worker gets a request's whole table again whenever copy-on-write changed it.
Refusal
    ``n > max_num_seqs``, or a worst case (shared full prompt blocks + n private tails)
    above the pool: the whole group is FINISHED_IGNORED.
Invariants (``check_invariants``)
    those of ``Scheduler`` over waiting / running / swapped / held (a held sequence waits
    for its leader's fork and holds no blocks); exactly the swapped requests hold CPU
    blocks; the unfinished sequences of a forked group are all running or all swapped.
Failure mode
    ``preemption_mode="swap"`` with ``num_cpu_blocks == 0`` raises ValueError; a full CPU
    pool falls back to recompute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from minipaged.config import PARALLEL_SAMPLING, PREEMPTION_MODES
from minipaged.core.kv.block import check_positive_int
from minipaged.core.kv.block_manager_v0 import BlockSpaceManager
from minipaged.core.sched import utils
from minipaged.core.sched.output import CachedRequestData
from minipaged.core.sched.paper_output import PaperSchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus

DEFAULT_WATERMARK = 0.05  # chapter 05's best on the course workloads (vLLM v0: 0.01)


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


class PaperScheduler:
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
        watermark: Optional[float] = DEFAULT_WATERMARK,
        preemption_mode: str = "recompute",
        num_cpu_blocks: int = 0,
        parallel_sampling: str = "fork",
    ) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            check_positive_int(name, locals()[name])
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len)
        if watermark is not None and (
            not isinstance(watermark, (int, float)) or isinstance(watermark, bool) or not 0 <= watermark < 1
        ):
            raise ValueError(f"watermark must be None or a fraction in [0, 1), got {watermark!r}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs num_cpu_blocks > 0")
        if parallel_sampling not in PARALLEL_SAMPLING:
            raise ValueError(
                f"parallel_sampling must be one of {PARALLEL_SAMPLING}, got {parallel_sampling!r}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.max_model_len = max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.watermark = None if watermark is None else float(watermark)
        # NOTE: as vLLM v0's BlockSpaceManager: int(watermark * num_gpu_blocks)
        self.watermark_blocks = 0 if watermark is None else int(self.watermark * num_blocks)
        self.preemption_mode = preemption_mode
        self.num_cpu_blocks = num_cpu_blocks
        self.parallel_sampling = parallel_sampling  # "fork" (the paper) or "prefix" (v1 fan-out)
        self.kv_cache_manager = BlockSpaceManager(
            num_blocks,
            block_size,
            enable_caching=self.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
            free_uncached_first=free_uncached_first,
        )
        self.waiting: deque[Request] = deque()  # arrival order; preempted ones in front
        self.running: list[Request] = []  # arrival order
        self.swapped: deque[Request] = deque()  # arrival order
        self.requests: dict[str, Request] = {}  # the unfinished ones, by id
        self.seq_groups: dict[str, SequenceGroup] = {}  # sequence id -> its group (n > 1)
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the worker
        self._synced: set[str] = set()  # running requests whose table the worker holds
        self._num_added = 0
        self._new_arrivals: list[Request] = []
        self._to_refuse: list[Request] = []
        self._last_output: Optional[PaperSchedulerOutput] = None
        self._in_flight: Optional[PaperSchedulerOutput] = None
        self.num_steps = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- one step -------------------------------------------------------------------
    def schedule(self) -> PaperSchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice without update_from_output()")
        out = PaperSchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        out.arrived, self._new_arrivals = self._new_arrivals, []
        out.refused, self._to_refuse = self._to_refuse, []
        budget = self.max_num_batched_tokens
        preempted = False

        # 1. RUNNING groups first, in arrival order; the latest arrival is the victim.
        units = self._units(self.running)
        u = 0
        while u < len(units) and budget > 0:
            plan = self._plan(units[u], budget)
            if plan is None:
                u += 1
                continue
            while (new_blocks := self._allocate(plan)) is None:
                victims = units.pop()  # NOTE: never a unit scheduled this step
                del self.running[len(self.running) - len(victims) :]
                self._preempt(victims, out)
                preempted = True
                if plan[0][0] in victims:
                    break
            if new_blocks is None:
                break  # the asking group preempted itself; those after it are gone too
            self._schedule(plan, new_blocks, out)
            budget -= sum(n for _, n in plan)
            u += 1

        # 2. SWAPPED or WAITING, whichever head arrived first, unless this step preempted.
        while not preempted and budget > 0:
            if self.swapped and not (
                self.waiting and self.waiting[0].arrival_order < self.swapped[0].arrival_order
            ):
                admitted = self._swap_in_next(budget, out)
            else:
                admitted = self._admit_next(budget, out)
            if admitted is None:
                break
            plan, new_blocks = admitted
            for r, _ in plan:
                if r.status != RequestStatus.RUNNING:
                    r.status = RequestStatus.RUNNING
                    utils.insert_by_arrival(self.running, r)
            self._schedule(plan, new_blocks, out)
            budget -= sum(n for _, n in plan)

        if not (out.scheduled or preempted or out.refused) and self._num_queued():
            raise RuntimeError(
                f"livelock: nothing scheduled with {len(self.running)} running and "
                f"{self._num_queued() - len(self.running)} other unfinished requests"
            )
        out.blocks_to_copy = self.kv_cache_manager.take_pending_copies()  # copy-on-write
        self._in_flight = self._last_output = utils.finish_step(
            out, self.max_num_batched_tokens, self.max_num_seqs
        )
        self.num_steps += 1
        return out

    def _units(self, queue) -> list[list[Request]]:
        """``queue`` cut into groups (a lone request is a group of one), in order."""
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

    def _num_to_compute(self, request: Request) -> int:
        """Tokens left before it samples; a leader with held sequences stops at its
        prompt's end, where they fork."""
        if self.seq_groups and self._fork_target(request) is not None:
            return request.num_prompt_tokens - request.num_computed_tokens
        return request.num_tokens - request.num_computed_tokens

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        left = self._num_to_compute(request)
        return utils.num_new_tokens(left, budget, self.enable_chunked_prefill, self.max_num_batched_tokens)

    def _plan(self, unit: list[Request], budget: int):
        """``[(request, n)]`` giving every sequence >= 1 token, or None (it waits). A unit
        that needs more than the whole budget is split (entries with n = 0 wait)."""
        plan, left = [], budget
        for r in unit:
            n = self._num_new_tokens(r, left)
            if n <= 0:
                break
            plan.append((r, n))
            left -= n
        else:
            return plan
        if sum(self._num_to_compute(r) for r in unit) <= self.max_num_batched_tokens:
            return None  # NOTE: it fits whole in some later step
        plan, left = [], budget
        for r in unit:
            n = min(self._num_to_compute(r), left)
            plan.append((r, n))
            left -= n
        return plan if plan[0][1] > 0 else None

    def _allocate(self, plan, computed=None):
        """The new blocks of every ``(request, n)``, all or nothing (None)."""
        kv = self.kv_cache_manager
        if len(plan) == 1:  # a lone request (leaving waiting: with its cache hits)
            ((request, n),) = plan  # NOTE: allocate_slots is all or nothing by itself
            blocks = kv.allocate_slots(request, n, computed)
            return None if blocks is None else [blocks]
        if (
            kv.get_num_blocks_needed_group([r for r, _ in plan], [n for _, n in plan])
            > kv.get_num_free_blocks()
        ):
            return None
        allocated = [kv.allocate_slots(r, n) if n > 0 else [] for r, n in plan]
        assert all(a is not None for a in allocated), "the block count promised room"
        return allocated

    def _schedule(self, plan, new_blocks, out: PaperSchedulerOutput) -> None:
        kv = self.kv_cache_manager
        copies = {d for _, d in kv.pending_copies}
        for (request, n), blocks in zip(plan, new_blocks):
            if n == 0:
                continue
            rid = request.request_id
            out.scheduled.append((request, n))
            new_ids = [b.block_id for b in blocks]
            out.new_block_ids.extend(new_ids)
            if rid in self._synced and not (copies and copies.intersection(kv.get_block_ids(rid))):
                out.scheduled_cached_reqs.append(CachedRequestData(rid, new_ids, request.num_computed_tokens))
            else:  # NOTE: new to the worker, or copy-on-write rewrote its table (v0 sent all)
                out.scheduled_new_reqs.append(utils.new_request_data(request, kv.get_block_ids(rid)))
                self._synced.add(rid)
            kv.cache_blocks(request, request.num_computed_tokens + n)
            self._maybe_fork(request, n, out)

    def _maybe_fork(self, request: Request, n: int, out: PaperSchedulerOutput) -> None:
        """Fork the held sequences from ``request`` if this step computes its last prompt token."""
        group = self._fork_target(request)
        if group is None or request.num_computed_tokens + n != request.num_prompt_tokens:
            return
        for child in group.unfinished[1:]:
            self.kv_cache_manager.fork(request, child)
            # NOTE: the child's prompt K/V is written by the parent's rows of this very step;
            # nobody reads it before then, so it counts as computed from now on.
            child.num_computed_tokens = request.num_prompt_tokens
            child.status = RequestStatus.RUNNING
            utils.insert_by_arrival(self.running, child)
            out.forks.append((request, child))
            out.scheduled_new_reqs.append(
                utils.new_request_data(child, self.kv_cache_manager.get_block_ids(child.request_id))
            )
            self._synced.add(child.request_id)
            if child.num_computed_tokens == child.num_tokens:
                out.fork_samples.append((request, child))
                out.fork_sample_ids.append((request.request_id, child.request_id))
        group.forked = True

    def _preempt(self, victims: list[Request], out: PaperSchedulerOutput) -> None:
        """Swap the group out (all or nothing) or, failing that, recompute it."""
        for v in victims:
            v.num_preemptions += 1
            self._synced.discard(v.request_id)
            out.preempted_req_ids.add(v.request_id)
        if self.preemption_mode == "swap":
            mapping = self.kv_cache_manager.swap_out_group(victims)
            if mapping is not None:
                for v in victims:
                    v.status = RequestStatus.SWAPPED
                    utils.insert_by_arrival(self.swapped, v)
                out.blocks_to_swap_out.extend(mapping)
                out.swapped_out.extend(victims)
                return
            # NOTE: the CPU pool is full: fall back to recompute
        for v in victims:
            self.kv_cache_manager.free(v)
            v.num_computed_tokens = 0
            v.status = RequestStatus.PREEMPTED
        utils.insert_by_arrival(self.waiting, victims[0])  # the others are held again
        out.preempted.extend(victims)
        g = self.seq_groups.get(victims[0].request_id)
        if g is not None:
            g.forked = False  # NOTE: the leader re-prefills the prompt, the others fork again

    def _admit_next(self, budget: int, out: PaperSchedulerOutput):
        """Admit the head of ``waiting`` (with its group's seats): ``(plan, blocks)`` or None."""
        if not self.waiting:
            return None
        request = self.waiting[0]
        g = self._fork_target(request)
        if len(self.running) + (1 if g is None else len(g.unfinished)) > self.max_num_seqs:
            return None
        kv = self.kv_cache_manager
        # NOTE: the lookup stops one token short of what it computes before sampling
        computed, num_computed = kv.get_computed_blocks(request, self._num_to_compute(request) - 1)
        request.num_computed_tokens = num_computed
        n = self._num_new_tokens(request, budget)
        new_blocks = None
        if n > 0 and self._can_admit(request, computed):
            new_blocks = self._allocate([(request, n)], computed)
        if new_blocks is None:
            request.num_computed_tokens = 0
            return None
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
            out.num_cached_tokens[request.request_id] = num_computed
        self.waiting.popleft()
        out.admitted.append(request)
        return [(request, n)], new_blocks

    def _can_admit(self, request: Request, computed_blocks) -> bool:
        """The watermark rule: the whole (re)prefill fits after what running ones still need."""
        if self.watermark is None or not self.running:
            return True
        kv = self.kv_cache_manager
        need = kv.get_num_blocks_to_prefill(request, self._forks_of(request))
        need -= sum(1 for b in computed_blocks if b.ref_cnt > 0)  # NOTE: shared hits are free
        reserved = sum(kv.get_num_blocks_still_needed(r, self._forks_of(r)) for r in self.running)
        return kv.get_num_free_blocks() - reserved - need >= self.watermark_blocks

    def _swap_in_next(self, budget: int, out: PaperSchedulerOutput):
        """Swap the head group of ``swapped`` back in if it and its next tokens fit."""
        kv = self.kv_cache_manager
        unit = self._units(self.swapped)[0]
        if len(self.running) + len(unit) > self.max_num_seqs:
            return None
        plan = self._plan(unit, budget)
        if plan is None or not kv.can_swap_in_group(unit, [n for _, n in plan]):
            return None
        out.blocks_to_swap_in.extend(kv.swap_in_group(unit))
        for r in unit:
            self.swapped.remove(r)
        out.swapped_in.extend(unit)
        return plan, self._allocate(plan)

    # -- sequence groups ------------------------------------------------------------
    def _fork_target(self, request: Request) -> Optional[SequenceGroup]:
        """The group whose held sequences fork from ``request`` once its prompt is computed."""
        g = self.seq_groups.get(request.request_id)
        return g if g is not None and g.needs_fork and g.leader is request else None

    def _forks_of(self, request: Request) -> list[Request]:
        if not self.seq_groups:  # NOTE: no group at all (n = 1): asked per running request
            return []
        g = self._fork_target(request)
        return [] if g is None else g.unfinished[1:]

    def _held_seqs(self) -> list[Request]:
        groups = {id(g): g for g in self.seq_groups.values()}.values()
        return [s for g in groups if g.needs_fork for s in g.unfinished[1:]]

    def fork_request(self, parent: Request, child: Request) -> None:
        """Add ``child`` to ``running`` sharing every block of the running ``parent`` (no
        copy), in the parent's place in arrival order: beam search (the paper's Fig. 9).
        ``child`` carries its own tokens and ``num_computed_tokens``."""
        if parent not in self.running:
            raise ValueError(f"fork_request: parent {parent.request_id!r} is not running")
        if child.request_id in self.requests:
            raise ValueError(f"fork_request: id {child.request_id!r} is in use by an unfinished request")
        self.requests[child.request_id] = child
        child.arrival_order = parent.arrival_order
        self.kv_cache_manager.fork(parent, child)
        child.status = RequestStatus.RUNNING
        utils.insert_by_arrival(self.running, child)

    # -- after the model ran ----------------------------------------------------------
    def update_from_output(self, output: PaperSchedulerOutput, sampled_token_ids) -> list[Request]:
        """As ``Scheduler.update_from_output``; a child forked this step computed nothing:
        its first token was sampled from its parent's logits row."""
        if output is not self._in_flight:
            raise ValueError("update_from_output() needs the output of the last schedule()")
        sampled_token_ids = utils.sampled_tokens(sampled_token_ids)  # request id -> list[int]
        need = [  # NOTE: the dict lookup first: it rules out almost every request at once
            r.request_id
            for r, n in output.scheduled
            if r.request_id not in sampled_token_ids
            and not r.is_finished
            and r.num_computed_tokens + n == r.num_tokens
        ]
        need += [
            c.request_id
            for _, c in output.fork_samples
            if c.request_id not in sampled_token_ids and not c.is_finished
        ]
        if need:
            raise ValueError(f"sampled_token_ids lacks a token for requests {need}")
        finished: list[Request] = list(output.refused)
        for request, n in output.scheduled:
            if not request.is_finished:
                request.num_computed_tokens += n
                if request.num_computed_tokens == request.num_tokens:
                    self._append_and_check(request, sampled_token_ids[request.request_id], finished)
        for _, child in output.fork_samples:
            if not child.is_finished:
                self._append_and_check(child, sampled_token_ids[child.request_id], finished)
        output.finished = finished
        self._in_flight = None
        return finished

    def _append_and_check(self, request: Request, token_ids: list[int], finished: list[Request]) -> None:
        for t in token_ids:
            request.append_output_token_id(t)
            if utils.check_stop(request, self.max_model_len):
                self._free_request(request)
                finished.append(request)
                return  # NOTE: the tokens after a stop are dropped

    def _free_request(self, request: Request) -> None:
        rid = request.request_id
        if request in self.running:
            self.running.remove(request)
            self.kv_cache_manager.free(request)
        elif request in self.swapped:
            self.swapped.remove(request)
            self.kv_cache_manager.free_swapped(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        del self.requests[rid]
        self._synced.discard(rid)
        self.finished_req_ids.add(rid)
        g = self.seq_groups.get(rid)
        if g is not None and not g.unfinished:
            for s in g.seqs:
                self.seq_groups.pop(s.request_id, None)

    def finish_requests(
        self, request_ids, status: RequestStatus, reason: Optional[str] = None
    ) -> list[Request]:
        """As ``Scheduler.finish_requests``; finishing any sequence of a group that has
        not forked yet finishes the whole group (its held sequences have nothing of their own)."""
        done = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            g = self.seq_groups.get(rid)
            held = g.unfinished if g is not None and g.needs_fork else [request]
            for r in held:
                r.status = status
                r.stop_reason = reason if reason is not None else status.value
            for r in held:
                self._free_request(r)
            done.extend(held)
        return done

    def abort_request(self, request_id: str) -> None:
        self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED, "aborted")

    def fail_step(
        self, output: Optional[PaperSchedulerOutput], reason: str = "the engine step failed"
    ) -> list[Request]:
        """As ``Scheduler.fail_step`` (the children forked in that step too)."""
        ids = (
            []
            if output is None
            else [r.request_id for r, _ in output.scheduled] + [c.request_id for _, c in output.forks]
        )
        self._in_flight = None
        return self.finish_requests(ids, RequestStatus.FINISHED_ABORTED, reason)

    # -- requests -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.add_request_group([request])

    def add_request_group(self, requests: list[Request]) -> None:
        """Queue the n sequences of one request. ``"fork"``: the leader waits, the others
        are held until the leader's prompt is computed; ``"prefix"``: v1's fan-out."""
        requests = utils.validate_group(requests, self.requests, self.max_model_len)
        if self.parallel_sampling == "prefix" and len(requests) > 1:
            for r in requests:
                self.add_request_group([r])
            return
        for r in requests:
            r.arrival_order, self._num_added = self._num_added, self._num_added + 1
            self._new_arrivals.append(r)
        reason = utils.refusal_reason(requests[0], self, len(requests))
        if reason is not None:
            for r in requests:
                utils.refuse(r, reason)
            self._to_refuse.extend(requests)
            return
        for r in requests:
            self.requests[r.request_id] = r
        if len(requests) > 1:
            group = SequenceGroup(requests[0].request_id, requests)
            for r in requests:
                self.seq_groups[r.request_id] = group
        self.waiting.append(requests[0])

    def get_request(self, request_id: str) -> Request:
        if request_id not in self.requests:
            raise ValueError(f"unknown request {request_id!r} (finished requests are forgotten)")
        return self.requests[request_id]

    def _num_queued(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self._held_seqs())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._to_refuse)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self._to_refuse)

    # -- invariants -----------------------------------------------------------------
    def check_invariants(self) -> None:
        kv = self.kv_cache_manager
        waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        queues = {
            "waiting": (self.waiting, waiting, True),
            "running": (self.running, (RequestStatus.RUNNING,), True),
            "swapped": (self.swapped, (RequestStatus.SWAPPED,), True),
            "held": (self._held_seqs(), waiting, False),
        }
        utils.check_scheduler(self, queues)
        assert set(kv.cpu_block_tables) == {r.request_id for r in self.swapped}, (
            "CPU blocks held by others than swapped"
        )
        in_flight = {} if self._in_flight is None else self._in_flight.num_scheduled_tokens
        for r in self.running:
            held, expected = (
                kv.block_tables[r.request_id].num_tokens,
                r.num_computed_tokens + in_flight.get(r.request_id, 0),
            )
            assert held == expected, f"running {r.request_id}: slots for {held} tokens, expected {expected}"
            assert in_flight or r.num_computed_tokens < r.num_tokens, f"running {r.request_id} is idle"
        for r in self.swapped:
            assert kv.cpu_block_tables[r.request_id].num_tokens == r.num_computed_tokens, (
                f"swapped {r.request_id}: CPU blocks"
            )
            assert r.num_computed_tokens < r.num_tokens, f"swapped {r.request_id} has nothing to do"
        others = [r for q in (self.waiting, self.swapped) for r in q]
        if self.running and others:
            assert max(r.arrival_order for r in self.running) < min(r.arrival_order for r in others), (
                "FCFS: a running request arrived after a waiting one"
            )
        for g in {id(g): g for g in self.seq_groups.values()}.values():
            assert g.unfinished, f"group {g.group_id} is done but still registered"
            if g.forked:
                places = {
                    "running" if r in self.running else "swapped" if r in self.swapped else "elsewhere"
                    for r in g.unfinished
                }
                assert places in ({"running"}, {"swapped"}), (
                    f"group {g.group_id}: sequences split across {sorted(places)}"
                )
