"""minipaged.distributed: tensor-parallel workers over torch.distributed (the paper's §4.6).

- ``process_group.py``: join one group (gloo on a CPU, NCCL on CUDA), ``get_open_port``.
- ``workers.py``: ``WorkerGroup``: N spawned worker processes, one message per step to every
  rank over a pipe, answers collected with death detection (``WorkerDiedError`` names the rank).
- ``shard_worker.py``: ``ModelShardWorker``: one rank's shard of the model and of the KV cache.
- ``shm_comm.py``: the CPU ranks' all-reduce and all-gather through one shared-memory segment
  (home-made, as vLLM's CPU backend has its own); gloo stays for setup and what does not fit.

The layers themselves are in ``minipaged/model/parallel.py``. Mirrors vLLM
``vllm/distributed/`` and ``vllm/v1/executor/multiproc_executor.py``.
"""

from minipaged.distributed import shm_comm
from minipaged.distributed.workers import WorkerDiedError, WorkerError, WorkerGroup

__all__ = ["WorkerDiedError", "WorkerError", "WorkerGroup", "shm_comm"]
