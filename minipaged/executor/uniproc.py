"""UniProcExecutor: one worker in the engine's own process (vLLM v1's
``UniProcExecutor``). It hands the worker the plain half of the step's output
(``SchedulerOutput.for_worker()``), exactly what a worker in another process would get,
and returns the worker's ``ModelRunnerOutput``. The worker is vLLM v1's ``ModelRunner``, or
with ``paper=True`` (the paper's scheduler) ``PaperModelRunner``, with its CPU pool.

Invariant: the worker never receives a scheduler object. Failure mode: whatever the
worker raises propagates to the engine, which fails that step's requests.
"""

from __future__ import annotations

from minipaged.worker.model_runner import ModelRunner, ModelRunnerOutput
from minipaged.worker.paper_runner import PaperModelRunner


class UniProcExecutor:
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        kv_cache_dtype: str = "auto",
        paper: bool = False,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.model_runner = (
            PaperModelRunner(model, num_blocks, block_size, num_cpu_blocks, device, kv_cache_dtype)
            if paper
            else ModelRunner(model, num_blocks, block_size, device, kv_cache_dtype)
        )

    def use_paper_runner(self) -> None:
        """From now on the paper's runner, over the same caches (beam search)."""
        self.model_runner = PaperModelRunner.from_runner(self.model_runner)

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output.for_worker())

    def compute_logits(self, scheduler_output):
        """The forward alone (beam search picks the tokens): logits ``[B, V]`` and row ids."""
        return self.model_runner.compute_logits(scheduler_output.for_worker())

    def check_invariants(self) -> None:
        self.model_runner.check_invariants()

    def shutdown(self) -> None:
        """Nothing to stop in-process (a multi-process executor joins its workers here)."""

    @property
    def closed(self) -> bool:
        """Never: one worker in this process has nothing to lose (``MultiprocExecutor``'s can)."""
        return False
