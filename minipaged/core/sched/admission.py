"""Layer: whole-prefill watermark admission (vLLM v0's ``BlockSpaceManager.can_allocate``).

The base ``Scheduler`` admits a request as soon as its first chunk's blocks are free
(``_can_admit`` returns True; vLLM v1 with ``scheduler_reserve_full_isl=False``) and relies
on preemption when the rest outgrows the pool. vLLM 0.32's default
(``scheduler_reserve_full_isl=True``) is this layer with ``watermark=0.0``, and vLLM's
``watermark`` option is this layer's; ``benchmarks/vllm_diff`` checks all three step by step.

Concept
    A request leaves ``waiting`` (fresh, or resumed after recompute) only if the blocks
    for its *whole* (re)prefill fit in the free pool after the blocks the running requests
    still need for their own (re)prefills, leaving ``watermark_blocks =
    int(watermark * num_blocks)`` free. When nothing runs it is admitted whatever the
    watermark (it fits alone by the refusal rule), so an idle engine always progresses.
    Running requests are never held back by it. The KV-cache manager does the counting
    (``get_num_blocks_to_prefill`` / ``get_num_blocks_still_needed``).
Why
    Admitting on the first chunk over-admits: a prefill that cannot finish preempts the
    latest arrival, often itself, and the work is lost. Chapter 05 measures the trade-off
    (preemptions vs batch size for several watermarks); ``DEFAULT_WATERMARK`` = 0.05 was
    the best there. vLLM v0's 0.01 is 1% of thousands of GPU blocks; here 1 of ~100.
Inputs / outputs
    ``watermark`` (constructor keyword): a fraction in [0, 1), or None for the first-chunk rule.
Failure mode
    A bad ``watermark`` raises ValueError. Too large a watermark shrinks the batch; decodes
    that outgrow the pool still preempt (the watermark only slows admission down).
"""

from __future__ import annotations

from typing import Optional

from minipaged.core.sched.request import Request
from minipaged.core.sched.scheduler import Scheduler

DEFAULT_WATERMARK = 0.05


class WatermarkAdmission(Scheduler):
    def __init__(self, *args, watermark: Optional[float] = DEFAULT_WATERMARK, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if watermark is not None and (
            not isinstance(watermark, (int, float)) or isinstance(watermark, bool) or not 0 <= watermark < 1
        ):
            raise ValueError(f"watermark must be None or a fraction in [0, 1), got {watermark!r}")
        self.watermark = None if watermark is None else float(watermark)
        # NOTE: as vLLM v0's BlockSpaceManager: int(watermark * num_gpu_blocks)
        self.watermark_blocks = 0 if watermark is None else int(self.watermark * self.num_blocks)

    def _can_admit(self, request: Request, computed_blocks) -> bool:
        if self.watermark is None or not self.running:
            return True
        kv = self.kv_cache_manager
        need = kv.get_num_blocks_to_prefill(request, self._forks_of(request))
        need -= sum(1 for b in computed_blocks if b.ref_cnt > 0)  # NOTE: shared hits are free
        reserved = sum(kv.get_num_blocks_still_needed(r, self._forks_of(r)) for r in self.running)
        return kv.get_num_free_blocks() - reserved - need >= self.watermark_blocks

    def _forks_of(self, request: Request) -> list[Request]:  # hook
        """Requests that will fork from ``request`` and need blocks of their own (none)."""
        return []
