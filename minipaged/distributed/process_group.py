"""Joining one torch.distributed process group: gloo on a CPU, NCCL on CUDA.

Mirrors vLLM ``vllm/distributed/parallel_state.py`` (``init_distributed_environment``,
``get_tp_group``) and ``vllm/utils.get_open_port``, cut down to one tensor-parallel group
that is the whole world.

Inputs
    ``init_tensor_parallel(rank, world_size, port, device)`` in each of ``world_size``
    processes, with the same ``port`` (``get_open_port()``, chosen by the driver).
Output
    a ``TensorParallelGroup`` for the model's layers; rank r of a CUDA group uses ``cuda:r``.

Invariants
    one group per process (``torch.distributed`` is process-global); on a CPU each rank runs
    one intra-op thread (``torch.set_num_threads(1)``), so N ranks use N cores and no more.

Failure mode
    a rank that never arrives makes the others fail after ``timeout_s`` (torch.distributed's
    store timeout) with a ``RuntimeError``/``DistNetworkError``; the executor's watchdog on
    the processes usually notices a dead rank well before.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Optional

import torch

from minipaged.distributed.shm_comm import DEFAULT_SLOT_BYTES, ShmCommunicator
from minipaged.model.parallel import TensorParallelGroup


def get_open_port() -> int:
    """A free TCP port on localhost (the OS picks it) for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str | torch.device) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise (the CPU collectives)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def device_for_rank(device: str | torch.device, rank: int) -> torch.device:
    """Rank r's device: ``cuda:r`` on CUDA (one GPU per rank), the CPU otherwise."""
    device = torch.device(device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_tensor_parallel(
    rank: int,
    world_size: int,
    port: int,
    device: str | torch.device = "cpu",
    timeout_s: float = 60.0,
    timed: bool = True,
    shm_path: Optional[str] = None,
    shm_slot_bytes: int = DEFAULT_SLOT_BYTES,
    shm_wake=None,
) -> TensorParallelGroup:
    """Join the group of ``world_size`` ranks at ``127.0.0.1:port`` as ``rank``; on a CPU with
    ``shm_path`` (a segment from ``shm_comm.create_segment``) also map it: the group's
    all-reduces and all-gathers that fit go through it, the rest through gloo (``shm_wake``:
    this rank's wake-up read fd and every rank's write fd, ``shm_comm.make_wake_pipes``)."""
    import torch.distributed as dist

    dev = device_for_rank(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)  # one core per rank: N ranks on N cores
    dist.init_process_group(
        backend_for(dev),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    shm = None
    if shm_path is not None and dev.type == "cpu":
        shm = ShmCommunicator(shm_path, rank, world_size, shm_slot_bytes, timeout_s, shm_wake)
    return TensorParallelGroup.from_torch_distributed(timed=timed, shm=shm)


def time_all_reduce(
    tp: TensorParallelGroup, shape, iters: int = 50, device="cpu", via: str = "group"
) -> float:
    """Seconds one all-reduce of a ``shape`` fp32 tensor takes when every rank is ready (a
    barrier first, then ``iters`` back to back): its own cost, without waiting for a slower
    rank. ``via="group"``: the way the model's layers all-reduce (the shared-memory segment
    where the group has one and the tensor fits, else torch.distributed); ``"torch"``:
    ``torch.distributed.all_reduce`` (gloo / NCCL) always. Call it on every rank at once.
    NOTE: the counters of ``tp`` (``comm_seconds``...) are left as they were."""
    import time

    import torch.distributed as dist

    if via not in ("group", "torch"):
        raise ValueError(f"via must be 'group' or 'torch', got {via!r}")
    x = torch.ones(shape, device=device)
    if tp.size == 1:
        return 0.0
    saved = tp.comm_seconds, tp.num_collectives, tp.num_shm
    dist.barrier(group=tp.group)
    t0 = time.perf_counter()
    for _ in range(iters):
        if via == "group":
            tp.all_reduce(x.fill_(1.0))
        else:
            dist.all_reduce(x.fill_(1.0), group=tp.group)
    if x.is_cuda:
        torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / iters
    tp.comm_seconds, tp.num_collectives, tp.num_shm = saved
    return secs


def destroy_tensor_parallel() -> None:
    """Leave the group (a no-op if this process never joined one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class CommWorker:
    """A rank with no model, only the group's collectives: the benchmark's ``--level comm``
    drives it through a ``WorkerGroup`` to time one all-reduce, gloo against shared memory."""

    def __init__(self, rank: int, tp: TensorParallelGroup, device) -> None:
        self.rank, self.tp, self.device = rank, tp, torch.device(device)

    def time_all_reduce(self, shape, iters: int = 50, via: str = "group") -> float:
        return time_all_reduce(self.tp, shape, iters, self.device, via)

    def comm_stats(self, reset: bool = False) -> dict:
        return self.tp.comm_stats(reset)
