"""Layer: preemption by swapping (the paper's section 4.5, vLLM v0).

vLLM v1 removed it: it preempts by recompute only (``Scheduler._evict``), because
re-prefilling is cheap next to PCIe copies on modern GPUs.

Concept
    With ``preemption_mode="swap"`` a victim's block table is moved to a second pool of
    ``num_cpu_blocks`` CPU blocks (``KVCacheManager.swap_out_group``: all or nothing; if
    the CPU pool is full the victim is recomputed instead). Swapped requests come back
    (``swap_in_group``) in arrival order, merged with ``waiting``, before anything that
    arrived after them, when the blocks for the swap-in *and* their next tokens are free
    (``can_swap_in_group``, exact, no watermark).
Inputs / outputs
    ``SchedulerOutput.blocks_to_swap_out`` (device, cpu) / ``blocks_to_swap_in`` (cpu,
    device): copies the engine does before the model runs; ``swapped_out`` / ``swapped_in``.
Invariants
    exactly the swapped requests hold CPU blocks, for ``num_computed_tokens`` tokens;
    ``swapped`` is in arrival order; a step has swap-outs or swap-ins, never both.
Failure mode
    ``preemption_mode="swap"`` with ``num_cpu_blocks == 0`` raises ValueError.
"""

from __future__ import annotations

from collections import deque

from minipaged.config import PREEMPTION_MODES
from minipaged.core.kv.kv_cache_manager import KVCacheManager
from minipaged.core.sched.output import SchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus
from minipaged.core.sched.scheduler import Scheduler


class SwapPreemption(Scheduler):
    def __init__(self, *args, preemption_mode: str = "recompute", num_cpu_blocks: int = 0, **kwargs) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs num_cpu_blocks > 0")
        self.preemption_mode = preemption_mode
        self.num_cpu_blocks = num_cpu_blocks
        super().__init__(*args, **kwargs)
        self.swapped: deque[Request] = deque()  # arrival order

    def _new_kv_cache_manager(self) -> KVCacheManager:
        return KVCacheManager(
            self.num_blocks,
            self.block_size,
            enable_caching=self.enable_prefix_caching,
            num_cpu_blocks=self.num_cpu_blocks,
            free_uncached_first=self.free_uncached_first,
        )

    def _evict(self, victims: list[Request], out: SchedulerOutput) -> None:
        if self.preemption_mode == "swap":
            mapping = self.kv_cache_manager.swap_out_group(victims)
            if mapping is not None:
                for v in victims:
                    v.status = RequestStatus.SWAPPED
                    self._insert_by_arrival(self.swapped, v)
                out.blocks_to_swap_out.extend(mapping)
                out.swapped_out.extend(victims)
                return
            # NOTE: the CPU pool is full: fall back to recompute
        super()._evict(victims, out)

    def _admit_next(self, budget: int, out: SchedulerOutput):
        """The earlier arrival of the heads of ``swapped`` and ``waiting`` comes next.
        NOTE: every swapped request arrived before every never-admitted one, so nothing
        new is admitted while anything is swapped out."""
        if not self.swapped or (
            self.waiting
            and self.arrival_seq[self.waiting[0].request_id] < self.arrival_seq[self.swapped[0].request_id]
        ):
            return super()._admit_next(budget, out)
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
        return unit, plan, self._allocate(plan)

    def _dequeue(self, request: Request) -> None:
        if request in self.swapped:
            self.swapped.remove(request)
            self.kv_cache_manager.free_swapped(request)
        else:
            super()._dequeue(request)

    def _num_queued(self) -> int:
        return super()._num_queued() + len(self.swapped)

    def _queues(self) -> dict:
        return {**super()._queues(), "swapped": (self.swapped, (RequestStatus.SWAPPED,), True)}

    def check_invariants(self) -> None:
        super().check_invariants()
        kv = self.kv_cache_manager
        swapped_ids = {r.request_id for r in self.swapped}
        assert set(kv.cpu_block_tables) == swapped_ids, (
            f"CPU blocks held by {sorted(kv.cpu_block_tables)}, swapped {sorted(swapped_ids)}"
        )
        for r in self.swapped:
            assert kv.cpu_block_tables[r.request_id].num_tokens == r.num_computed_tokens, (
                f"swapped {r.request_id}: CPU blocks for {kv.cpu_block_tables[r.request_id].num_tokens} "
                f"tokens, computed {r.num_computed_tokens}"
            )
            assert r.num_computed_tokens < r.num_tokens, f"swapped {r.request_id} has nothing to do"
