"""PaperModelRunner: the runner of the paper's scheduler (``core/sched/paper.py``). It is
vLLM v1's ``ModelRunner`` plus what vLLM v0's ``cache_engine.py`` and sampler did: a CPU
pool for swapping, the block moves of each step, and forks that sample from their parent.

vLLM v1 instead: no CPU pool and no block moves (it recomputes and shares prompts through
the prefix cache), and each of the ``n`` samples of a request is a request with its own row.

Inputs
    ``execute_model(out)`` / ``compute_logits(out)``, ``out`` a ``PaperSchedulerOutput``
    (``for_worker()``), or a plain ``SchedulerOutput`` (the engine's idle flush, or vLLM v1's
    scheduler again after beam search), which moves nothing. Before the forward: swap out
    (device -> CPU), swap in (CPU -> device), copy-on-write copies (device -> device).
Outputs
    as ``ModelRunner``; each child of ``fork_sample_ids`` gets a logits row, a copy of its
    parent's (the prompt was prefilled once, for the parent), and so samples its own token.
Invariants (``check_invariants``)
    those of ``ModelRunner``; the CPU pool has one K and one V cache per layer,
    ``[num_cpu_blocks, block_size, KVH, D]`` each (none when ``num_cpu_blocks == 0``).
Failure mode
    a swap with no CPU pool is a scheduler bug: ``RuntimeError``.
"""

from __future__ import annotations

from typing import Optional

import torch

from minipaged.core.sched.paper_output import PaperSchedulerOutput
from minipaged.worker.model_runner import ModelRunner


class PaperModelRunner(ModelRunner):
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        device: str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        super().__init__(model, num_blocks, block_size, device, kv_cache_dtype)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if num_cpu_blocks > 0:
            pin = self.device.type == "cuda"
            for k, _ in self.kv_caches:
                shape = (num_cpu_blocks,) + tuple(k.shape[1:])  # [num_cpu_blocks, bs, KVH, D]
                self.cpu_kv_caches.append(
                    (
                        torch.zeros(shape, dtype=k.dtype, pin_memory=pin),
                        torch.zeros(shape, dtype=k.dtype, pin_memory=pin),
                    )
                )

    @classmethod
    def from_runner(cls, runner: ModelRunner) -> PaperModelRunner:
        """``runner`` (its model, caches and requests) as the paper's runner, with no CPU
        pool: beam search runs the paper's scheduler on an engine built for vLLM v1's."""
        if isinstance(runner, cls):
            return runner
        paper = cls.__new__(cls)
        vars(paper).update(vars(runner), num_cpu_blocks=0, cpu_kv_caches=[])
        return paper

    def compute_logits(self, scheduler_output) -> tuple[Optional[torch.Tensor], list[str]]:
        """The block moves, then ``ModelRunner.compute_logits``; then a row per fork child."""
        if not isinstance(scheduler_output, PaperSchedulerOutput):
            return super().compute_logits(scheduler_output)
        self.apply_cache_ops(scheduler_output)
        logits, req_ids = super().compute_logits(scheduler_output)
        forks = scheduler_output.fork_sample_ids
        if forks:  # NOTE: a child has computed all its tokens (its prompt): its row is sampled
            parents = torch.tensor([req_ids.index(p) for p, _ in forks], device=logits.device)
            logits = torch.cat([logits, logits[parents]])  # [B + forks, V]
            req_ids = req_ids + [child for _, child in forks]
        return logits, req_ids

    def apply_cache_ops(self, scheduler_output: PaperSchedulerOutput) -> None:
        """Swap out, swap in, copy-on-write: the block moves decided this step, before the
        forward. NOTE: swap-out first: the blocks it frees may be handed to someone in this
        very step, and their old contents must be saved before they are overwritten."""
        from minipaged.kernels import copy_blocks, swap_blocks

        swap_out, swap_in = scheduler_output.blocks_to_swap_out, scheduler_output.blocks_to_swap_in
        if (swap_out or swap_in) and not self.cpu_kv_caches:
            raise RuntimeError("the scheduler swapped blocks but there is no CPU pool")
        for pairs, to_cpu in ((swap_out, True), (swap_in, False)):
            if pairs:
                for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
                    swap_blocks(k, ck, pairs) if to_cpu else swap_blocks(ck, k, pairs)
                    swap_blocks(v, cv, pairs) if to_cpu else swap_blocks(cv, v, pairs)
        if scheduler_output.blocks_to_copy:
            copy_blocks(
                [k for k, _ in self.kv_caches],
                [v for _, v in self.kv_caches],
                scheduler_output.blocks_to_copy,
            )

    def check_invariants(self) -> None:
        """``ModelRunner``'s, and the CPU pool mirrors the device pool, layer by layer."""
        super().check_invariants()
        assert len(self.cpu_kv_caches) == (len(self.kv_caches) if self.num_cpu_blocks else 0), (
            "the CPU pool must have one cache pair per layer when num_cpu_blocks > 0"
        )
        for (k, _), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
            assert ck.shape == cv.shape == (self.num_cpu_blocks,) + tuple(k.shape[1:]), (
                f"CPU cache {tuple(ck.shape)} does not mirror device cache {tuple(k.shape)}"
            )
