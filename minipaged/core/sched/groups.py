"""Layer: sequence groups with copy-on-write fork (the paper's section 4.4, vLLM v0's
``SequenceGroup``), for ``SamplingParams(n > 1)``.

vLLM v1 instead fans ``n > 1`` out into n independent child requests that share the
prompt's full blocks through prefix caching (``Scheduler.add_request_group``; here
``parallel_sampling="prefix"``, the engine's default; ``"fork"``, this layer's default, forks).

Concept
    ``add_request_group(seqs)`` queues the n sequences as one group. Only the first
    unfinished sequence, the *leader*, is queued and prefilled; the others are *held*.
    In the step whose chunk completes the leader's prompt the held ones are forked from
    it (``KVCacheManager.fork``: they share its blocks) and join ``running``; those without
    output draw their first token from the leader's logits row
    (``SchedulerOutput.fork_samples``): the prompt is prefilled once. The first write into
    a shared partly filled block is copied (``blocks_to_copy``). A group is scheduled,
    preempted, swapped and resumed all or nothing (one *unit*); a group preempted by
    recompute is held again and forks again at its prompt.
Split units
    A group whose sequences together have more to compute than the whole
    ``max_num_batched_tokens`` (large re-prefills after recompute) is split across steps:
    its sequences take the budget in order, those left with 0 tokens wait.
Refusal
    ``n > max_num_seqs``, or a worst case (shared full prompt blocks + n private tails)
    above the pool: the whole group is FINISHED_IGNORED.
Invariants
    a held sequence holds no blocks; the unfinished sequences of a forked group are all
    running or all swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minipaged.config import PARALLEL_SAMPLING
from minipaged.core.sched.output import SchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus, get_max_num_kv_tokens
from minipaged.core.sched.scheduler import Scheduler


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


class SequenceGroups(Scheduler):
    def __init__(self, *args, parallel_sampling: str = "fork", **kwargs) -> None:
        if parallel_sampling not in PARALLEL_SAMPLING:
            raise ValueError(
                f"parallel_sampling must be one of {PARALLEL_SAMPLING}, got {parallel_sampling!r}"
            )
        super().__init__(*args, **kwargs)
        # "prefix": add_request_group is the base's (vLLM v1 fan-out); "fork": this layer
        self.parallel_sampling = parallel_sampling
        self.seq_groups: dict[str, SequenceGroup] = {}  # sequence id -> its group (n > 1)

    # -- requests -------------------------------------------------------------------
    def add_request_group(self, requests: list[Request]) -> None:
        """Queue the n sequences of one request: the leader waits, the others are held
        until the leader's prompt is computed. ValueError for an invalid group."""
        if self.parallel_sampling == "prefix":
            return super().add_request_group(requests)
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
        longest = get_max_num_kv_tokens(requests[0], self.max_model_len)
        need = self.kv_cache_manager.get_max_num_blocks(longest, n, requests[0].num_prompt_tokens)
        if need > self.num_blocks:
            return (
                f"refused: {n} sequences sharing their prompt's full blocks may need {need} "
                f"KV blocks but the whole pool has {self.num_blocks}"
            )
        return None

    def fork_request(self, parent: Request, child: Request) -> None:
        """Add ``child`` to ``running`` sharing every block of the running ``parent`` (no
        copy), in the parent's place in arrival order. Beam search forks its surviving
        beams this way (the paper's Fig. 9). ``child`` carries its own tokens and
        ``num_computed_tokens`` (the parent's tokens the shared blocks hold)."""
        if parent not in self.running:
            raise ValueError(f"fork_request: parent {parent.request_id!r} is not running")
        old = self.requests.get(child.request_id)
        if old is not None and not old.is_finished:
            raise ValueError(f"fork_request: id {child.request_id!r} is in use by an unfinished request")
        self.finished.pop(child.request_id, None)
        self.requests[child.request_id] = child
        self.arrival_seq[child.request_id] = self.arrival_seq[parent.request_id]
        self.kv_cache_manager.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self._insert_by_arrival(self.running, child)

    def abort_request(self, request_id: str) -> None:
        """Aborting any sequence of a group that has not forked yet aborts the whole group
        (its held sequences have nothing of their own)."""
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

    def _held_seqs(self) -> list[Request]:
        groups = {id(g): g for g in self.seq_groups.values()}.values()
        return [s for g in groups if g.needs_fork for s in g.unfinished[1:]]

    def _fork_target(self, request: Request) -> Optional[SequenceGroup]:
        """The group whose held sequences fork from ``request`` once its prompt is computed."""
        g = self.seq_groups.get(request.request_id)
        return g if g is not None and g.needs_fork and g.leader is request else None

    # -- hooks of the base ----------------------------------------------------------
    def _num_to_compute(self, request: Request) -> int:
        """A leader with held sequences stops at its prompt's end, where they fork."""
        if self._fork_target(request) is not None:
            return request.num_prompt_tokens - request.num_computed_tokens
        return super()._num_to_compute(request)

    def _num_seats(self, request: Request) -> int:
        g = self._fork_target(request)
        return 1 if g is None else len(g.unfinished)

    def _forks_of(self, request: Request) -> list[Request]:
        """The held sequences that fork from ``request`` (admission.py counts their blocks)."""
        g = self._fork_target(request)
        return [] if g is None else g.unfinished[1:]

    def _units(self, queue) -> list[list[Request]]:
        """A group's sequences together, in order."""
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

    def _plan(self, unit: list[Request], budget: int):
        """Every sequence gets >= 1 token or the unit waits; a unit that needs more than
        the whole budget is split (entries with n = 0 wait for a later step)."""
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

    def _allocate(self, plan):
        """All or nothing: the manager counts the whole unit's blocks first."""
        kv = self.kv_cache_manager
        if (
            kv.get_num_blocks_needed_group([r for r, _ in plan], [n for _, n in plan])
            > kv.get_num_free_blocks()
        ):
            return None
        allocated = [kv.allocate_slots(r, n) if n > 0 else [] for r, n in plan]
        assert all(a is not None for a in allocated), "the block count promised room"
        return allocated

    def _schedule(self, plan, new_blocks, out: SchedulerOutput) -> None:
        kept = [(p, b) for p, b in zip(plan, new_blocks) if p[1] > 0]
        super()._schedule([p for p, _ in kept], [b for _, b in kept], out)
        for req, n in plan:
            if n > 0:
                self._maybe_fork(req, n, out)

    def _maybe_fork(self, request: Request, n: int, out: SchedulerOutput) -> None:
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
            self._insert_by_arrival(self.running, child)
            out.forks.append((request, child))
            if child.num_computed_tokens == child.num_tokens:
                out.fork_samples.append((request, child))
        group.forked = True

    def _evict(self, victims: list[Request], out: SchedulerOutput) -> None:
        super()._evict(victims, out)
        g = self.seq_groups.get(victims[0].request_id)
        if g is not None and victims[0].status == RequestStatus.PREEMPTED:
            g.forked = False  # NOTE: the leader re-prefills the prompt, the others fork again

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]):
        """As the base; a child forked this step computed nothing: its first token was
        sampled from its parent's logits row."""
        if output is self._in_flight:
            need = [
                c.request_id
                for _, c in output.fork_samples
                if not c.is_finished and c.request_id not in sampled_token_ids
            ]
            if need:
                raise ValueError(f"sampled_token_ids lacks a token for requests {need}")
        finished = super().update_from_output(output, sampled_token_ids)
        for _, child in output.fork_samples:
            if not child.is_finished:
                self._append_and_check(child, sampled_token_ids[child.request_id], finished)
        for r in finished:
            self._forget_group_if_done(r.request_id)
        return finished

    # -- bookkeeping ----------------------------------------------------------------
    def _end_step(self, out: SchedulerOutput) -> SchedulerOutput:
        out.blocks_to_copy = self.kv_cache_manager.take_pending_copies()  # copy-on-write
        return super()._end_step(out)

    def _num_queued(self) -> int:
        return super()._num_queued() + len(self._held_seqs())

    def _queues(self) -> dict:
        held = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        return {**super()._queues(), "held": (self._held_seqs(), held, False)}

    def check_invariants(self) -> None:
        super().check_invariants()
        for g in {id(g): g for g in self.seq_groups.values()}.values():
            live = g.unfinished
            assert live, f"group {g.group_id} is done but still registered"
            if g.forked:
                swapped = getattr(self, "swapped", ())
                places = {
                    ("running" if r in self.running else "swapped" if r in swapped else "elsewhere")
                    for r in live
                }
                assert places in ({"running"}, {"swapped"}), (
                    f"group {g.group_id}: sequences split across {sorted(places)}"
                )
