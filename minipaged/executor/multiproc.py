"""MultiprocExecutor: N tensor-parallel workers in N processes, one scheduler in the driver.

Mirrors vLLM v1 ``vllm/v1/executor/multiproc_executor.py``: the engine (driver) keeps the
scheduler and the KV-cache manager; each step it hands the executor the ``SchedulerOutput``,
and the executor sends its plain half (``for_worker()``: new requests with their block ids,
new blocks, preempted and finished ids, block copies) to every worker. Each worker's
``ModelRunner`` keeps its own block tables from it, builds the same ``ModelInput`` (same
slots, same block ids), runs its shard of the model (``minipaged/model/parallel.py``), and
samples: the LM head's all-gather gives every rank the same logits, so every rank samples the
same tokens (vLLM v1's workers do the same) and appends them to its own copy of the requests.
Rank 0 returns the ``ModelRunnerOutput``.

Inputs
    ``MultiprocExecutor(model, dtype, attention_backend, device, tensor_parallel_size,
    num_blocks, block_size, seed, kv_cache_dtype, paper, num_cpu_blocks)``: what each worker
    needs to load its shard and allocate its cache (``[num_blocks, block_size, KVH / N, D]``
    per layer; the paper's scheduler: ``PaperModelRunner``, with its CPU pool); then one
    ``execute_model(scheduler_output)`` per step.
Outputs
    ``execute_model`` -> rank 0's ``ModelRunnerOutput`` (sampled tokens, logprobs);
    ``compute_logits`` -> rank 0's ``(logits, req_ids)`` (beam search); ``step_stats()``: the
    bytes sent per step and the seconds spent sending and waiting.

How the output crosses (``minipaged/distributed/workers.py``)
    ``pickle`` of the plain half, written to one pipe per worker. The bytes per step are a
    few hundred for a decode step of a few requests (ids and counts), more when new requests
    bring their prompts; ``stats`` counts them. The workers' all-reduces go between the
    workers (shared memory on a CPU, NCCL on CUDA), never through the driver.

Invariants
    every worker receives every step, in order, so every worker's block tables are the same;
    ``check_invariants`` runs each worker's model-runner checks.

Failure mode
    a worker that dies: ``WorkerDiedError`` (a ``RuntimeError``) naming its rank, raised in
    ``execute_model`` within the wait, the other workers stopped, nothing left behind; a
    worker that raises: ``WorkerError`` naming its rank. The engine cannot continue after
    either (the process group is gone): every later call raises ``RuntimeError``.
    ``shutdown`` stops the workers (called by ``LLM`` at exit, on ``KeyboardInterrupt``, and
    by the garbage collector).
"""

from __future__ import annotations

from typing import Optional

from minipaged.distributed.workers import WorkerGroup

WORKER_FACTORY = "minipaged.executor.multiproc:TensorParallelWorker"


class TensorParallelWorker:
    """One rank: its shard of the model and a ``ModelRunner`` (or, ``paper``, a
    ``PaperModelRunner``) over its heads of the cache."""

    def __init__(
        self,
        rank: int,
        tp,
        device,
        model=None,
        dtype: str = "float32",
        attention_backend: str = "torch",
        num_blocks: int = 64,
        block_size: int = 16,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        paper: bool = False,
        num_cpu_blocks: int = 0,
    ) -> None:
        import torch

        from minipaged.model.loader import load_model
        from minipaged.worker.model_runner import ModelRunner
        from minipaged.worker.paper_runner import PaperModelRunner

        torch.manual_seed(seed)
        self.rank = rank
        self.tp = tp
        self.model, _ = load_model(model, dtype, device, attention_backend, tp=tp)
        self.model_runner = (
            PaperModelRunner(self.model, num_blocks, block_size, num_cpu_blocks, str(device), kv_cache_dtype)
            if paper
            else ModelRunner(self.model, num_blocks, block_size, str(device), kv_cache_dtype)
        )

    def use_paper_runner(self) -> None:
        """From now on the paper's runner, over this rank's caches (beam search)."""
        from minipaged.worker.paper_runner import PaperModelRunner

        self.model_runner = PaperModelRunner.from_runner(self.model_runner)

    def execute_model(self, worker_output):
        out = self.model_runner.execute_model(worker_output)
        return out if self.rank == 0 else None  # the same on every rank: send it once

    def compute_logits(self, worker_output):
        logits, req_ids = self.model_runner.compute_logits(worker_output)
        if self.rank != 0:
            return None
        return (None if logits is None else logits.cpu()), req_ids

    def check_invariants(self) -> None:
        self.model_runner.check_invariants()

    def kv_blocks(self, layer: int, block_ids: list[int]):
        """This rank's K and V of physical blocks ``block_ids`` in ``layer``, each
        ``[n, block_size, KVH / N, D]`` (the chapter draws them side by side)."""
        import torch

        k, v = self.model_runner.kv_caches[layer]
        idx = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        return k[idx].cpu(), v[idx].cpu()

    def info(self) -> dict:
        """Plain numbers about this rank: its heads, cache shape, KV and weight bytes."""
        kv = self.model_runner.kv_caches
        return {
            "rank": self.rank,
            "num_heads": self.model.num_heads,
            "num_kv_heads": self.model.num_kv_heads,
            "cache_shape": list(kv[0][0].shape),
            "kv_cache_bytes": sum(t.numel() * t.element_size() for pair in kv for t in pair),
            "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
        }

    def time_all_reduce(self, shape, iters: int = 50, via: str = "group") -> float:
        """Seconds per all-reduce of ``shape`` with every rank ready (call on all ranks);
        ``via="torch"``: through torch.distributed even where the group has shared memory."""
        from minipaged.distributed.process_group import time_all_reduce

        return time_all_reduce(self.tp, shape, iters, self.model.device, via)

    def comm_stats(self, reset: bool = False) -> dict:
        return self.tp.comm_stats(reset)


class MultiprocExecutor:
    """``tensor_parallel_size`` worker processes over torch.distributed (see the module doc)."""

    def __init__(
        self,
        model=None,
        dtype: str = "float32",
        attention_backend: str = "torch",
        device: str = "cpu",
        tensor_parallel_size: int = 2,
        num_blocks: int = 64,
        block_size: int = 16,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        paper: bool = False,
        num_cpu_blocks: int = 0,
        timed: bool = True,
    ) -> None:
        kwargs = dict(
            model=model,
            dtype=dtype,
            attention_backend=attention_backend,
            num_blocks=num_blocks,
            block_size=block_size,
            seed=seed,
            kv_cache_dtype=kv_cache_dtype,
            paper=paper,
            num_cpu_blocks=num_cpu_blocks,
            timed=timed,
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.last_sent = None  # the plain half of the last step's output, as sent
        self.workers = WorkerGroup(tensor_parallel_size, WORKER_FACTORY, kwargs, device)

    def execute_model(self, scheduler_output):
        self.last_sent = scheduler_output.for_worker()  # kept for the chapter to print
        return self.workers.call("execute_model", self.last_sent)[0]

    def compute_logits(self, scheduler_output):
        self.last_sent = scheduler_output.for_worker()
        return self.workers.call("compute_logits", self.last_sent)[0]

    def use_paper_runner(self) -> None:
        """From now on every worker runs the paper's runner, over its caches (beam search)."""
        self.workers.call("use_paper_runner")

    def check_invariants(self) -> None:
        self.workers.call("check_invariants")

    def comm_stats(self, reset: bool = False) -> list[dict]:
        return self.workers.call("comm_stats", reset)

    @property
    def stats(self):
        return self.workers.stats

    def shutdown(self) -> None:
        self.workers.shutdown()

    @property
    def closed(self) -> bool:
        """True once the workers are gone (``shutdown``, or a worker failed)."""
        return self.workers.closed

    @property
    def model_runner(self) -> Optional[object]:
        """No model runner in the driver: each worker holds its own."""
        return None
