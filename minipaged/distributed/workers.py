"""N worker processes, one per tensor-parallel rank, driven from one driver process.

Mirrors vLLM ``vllm/v1/executor/multiproc_executor.py`` (``WorkerProc``, its busy loop and
``collective_rpc``) and nano-vllm's ``ModelRunner.call`` / ``loop``: the driver sends every
rank the same message, each rank runs it on its shard, each answers.

Inputs
    ``WorkerGroup(world_size, factory, kwargs, device)``: ``factory`` is ``"module:callable"``,
    called in each worker as ``factory(rank=r, tp=TensorParallelGroup, device=..., **kwargs)``
    after the worker joined the process group; ``call(method, *args)`` runs
    ``worker.method(*args)`` on every rank.
Output
    ``call`` returns the list of the ranks' return values, rank 0 first; ``stats`` adds up
    the bytes sent per rank and the seconds spent sending and waiting.

How the step crosses the process boundary (and why a pipe)
    one ``multiprocessing`` pipe per worker; a message is ``pickle.dumps((method, args))``,
    written once per rank (``send_bytes``), and the answer ``pickle.dumps((status, value))``.
    A pipe, not a ``torch.distributed`` broadcast: the driver holds no weights and is not a
    rank, the bytes per step are small (a few hundred to a few thousand), and a pipe plus each
    process's ``sentinel`` lets the driver wait on "an answer or a death" in one
    ``multiprocessing.connection.wait`` call, so a dead rank is seen at once, with no shared
    memory segment to leak. (vLLM's ``MessageQueue`` is a shared-memory ring buffer, faster for
    many ranks on one host; nano-vllm writes the pickle to one ``SharedMemory`` block.)
    NOTE: plain ``pickle``, not the pipe's own ``send``: torch registers reducers with
    multiprocessing's pickler that would move tensors through shared memory.

The collectives' segment (CPU ranks only, ``minipaged/distributed/shm_comm.py``)
    the driver creates one ``/dev/shm`` file for the group's shared-memory all-reduce and one
    wake-up pipe per rank, hands them to the workers, and unlinks the file as soon as every
    rank answered ``start`` (each has mapped it by then): for the rest of the run the segment
    has no name, and its memory goes when the last process that maps it exits, however it
    exits. When a rank dies or fails, the driver sets the segment's abort flag and writes to
    every wake-up pipe, so a rank waiting in a collective raises instead of waiting for a peer
    that will not come. While the driver writes a step to the pipes it sets the segment's
    "sending" flag: a rank woken on the driver's core yields until it is clear, so the driver
    is not kept from the next rank's pipe (the peers would wait for that rank in the step's
    first collective). ``comm="torch"`` (or ``MINIPAGED_TP_COMM=torch``) makes no segment:
    every collective through gloo, as before.

How the workers start (``worker_start_method``, vLLM's rule: ``VLLM_WORKER_MULTIPROC_METHOD``)
    ``fork`` on Linux when this process holds no CUDA context: nothing is re-imported, so an
    unguarded script and ``python - <<EOF`` work; ``spawn`` where a CUDA context exists (a
    forked child cannot use it) and off Linux. ``MINIPAGED_WORKER_MULTIPROC_METHOD`` chooses
    (``fork`` is refused where a CUDA context exists). Spawn re-imports ``__main__`` in every
    worker: from stdin it cannot (``RuntimeError`` before any process starts), and a script
    that builds the ``LLM`` at top level would build it again in the worker (the worker says
    so and dies: ``WorkerDiedError``); both messages name the ``if __name__ == "__main__":``
    guard.

Invariants
    every rank gets every message, in the same order; ``call`` returns only when every rank
    has answered; a worker never outlives the driver (it exits when the pipe closes or its
    parent process changes) and ignores ``SIGINT`` (the driver shuts it down).

Failure mode
    a worker that dies: ``WorkerDiedError`` naming its rank and exit code, raised within the
    wait (its sentinel wakes the driver), and every other worker is then stopped; a worker
    whose method raises: ``WorkerError`` naming the rank, the method and the exception. Either
    way the group is shut down (``shutdown``: ask, join, terminate, kill), as it is on
    ``KeyboardInterrupt`` inside ``call``, at garbage collection and at interpreter exit.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import wait
from typing import Any, Optional

from minipaged.distributed import shm_comm

_SHUTDOWN = "__shutdown__"
START_METHODS = ("fork", "spawn", "forkserver")
WORKER_NAME = "minipaged-tp-worker-"
GUARD = (
    'put the code that creates the LLM under `if __name__ == "__main__":` in a script file '
    "(or create no CUDA tensor before it, so that the workers can start with fork)"
)


class WorkerError(RuntimeError):
    """A tensor-parallel worker raised; ``rank`` says which."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class WorkerDiedError(WorkerError):
    """A tensor-parallel worker process ended while the driver waited for it."""


def worker_start_method() -> str:
    """``fork`` on Linux without a CUDA context in this process, else ``spawn`` (vLLM's
    rule); ``MINIPAGED_WORKER_MULTIPROC_METHOD`` chooses. ValueError for an unknown method,
    or for ``fork`` where a CUDA context exists."""
    import torch

    cuda = torch.cuda.is_initialized()
    method = os.environ.get("MINIPAGED_WORKER_MULTIPROC_METHOD", "")
    if method and method not in START_METHODS:
        raise ValueError(f"MINIPAGED_WORKER_MULTIPROC_METHOD must be one of {START_METHODS}, got {method!r}")
    if method == "fork" and cuda:
        raise ValueError(
            "MINIPAGED_WORKER_MULTIPROC_METHOD=fork: this process holds a CUDA context, "
            "which a forked worker cannot use; use spawn"
        )
    return method or ("fork" if sys.platform == "linux" and not cuda else "spawn")


def check_main_reimportable() -> None:
    """Spawn runs ``__main__`` again in each worker: from a file it can, from stdin it cannot."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(getattr(main, "__spec__", None), "name", None) is None and path and not os.path.isfile(path):
        raise RuntimeError(
            f"tensor-parallel workers start with spawn here, which re-imports __main__ in every "
            f"worker, and __main__ is {path!r}, which cannot be re-imported: {GUARD}"
        )


class CallStats:
    """What the driver's calls cost: bytes sent per rank, seconds pickling and writing them,
    seconds waiting for the answers (the benchmark reads these)."""

    __slots__ = ("calls", "bytes_sent", "send_seconds", "wait_seconds", "last_message_bytes")

    def __init__(self) -> None:
        self.calls, self.bytes_sent, self.last_message_bytes = 0, 0, 0
        self.send_seconds = self.wait_seconds = 0.0

    def add(self, nbytes: int, send_s: float, wait_s: float) -> None:
        self.calls += 1
        self.bytes_sent += nbytes
        self.last_message_bytes = nbytes
        self.send_seconds += send_s
        self.wait_seconds += wait_s


class WorkerGroup:
    """``world_size`` worker processes in one torch.distributed group (fork or spawn: see the module doc)."""

    def __init__(
        self,
        world_size: int,
        factory: str,
        kwargs: Optional[dict] = None,
        device: str = "cpu",
        start_timeout_s: float = 300.0,
        comm: Optional[str] = None,
    ) -> None:
        import torch
        import torch.multiprocessing as tmp

        from minipaged.distributed.process_group import get_open_port

        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {world_size!r}")
        comm = os.environ.get("MINIPAGED_TP_COMM", "auto") if comm is None else comm
        if comm not in ("auto", "shm", "torch"):
            raise ValueError(f"comm (MINIPAGED_TP_COMM) must be 'auto', 'shm' or 'torch', got {comm!r}")
        on_cpu = torch.device(device).type == "cpu"
        if comm == "shm" and not (on_cpu and shm_comm.supported()):
            raise ValueError("comm='shm' needs a CPU device on x86-64 with /dev/shm")
        self.comm = (
            "shm" if comm != "torch" and world_size > 1 and on_cpu and shm_comm.supported() else "torch"
        )
        if multiprocessing.current_process().name.startswith(WORKER_NAME):
            # NOTE: spawn re-imports __main__ in a worker before it runs: a top-level LLM(...)
            # runs again here, in the worker, and would start workers of its own
            raise RuntimeError(
                f"{multiprocessing.current_process().name} is re-importing __main__, "
                f"which creates an LLM again (spawn): {GUARD}"
            )
        self.start_method = worker_start_method()
        if self.start_method == "spawn":
            check_main_reimportable()
        ctx = tmp.get_context(self.start_method)
        port = get_open_port()
        self.world_size = world_size
        self.procs: list = []
        self.conns: list = []
        # one segment for the group, made here so that the driver can unlink it and abort a wait
        shm_path, self._shm = shm_comm.create_segment(world_size) if self.comm == "shm" else (None, None)
        readers, self._wake = shm_comm.make_wake_pipes(ctx, world_size) if self._shm else ([], [])
        self._finalizer = weakref.finalize(
            self, _shutdown, self.procs, self.conns, self._shm, shm_path, self._wake
        )
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            wake = (readers[rank], self._wake) if readers else None
            proc = ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    world_size,
                    port,
                    str(device),
                    child,
                    factory,
                    dict(kwargs or {}),
                    os.getpid(),
                    shm_path,
                    wake,
                    # NOTE: a forked worker inherits the driver's ends of the earlier ranks'
                    # pipes; it closes them (spawn passes nothing it does not name)
                    list(self.conns) if self.start_method == "fork" else [],
                ),
                name=f"{WORKER_NAME}{rank}",
                daemon=True,  # multiprocessing terminates it at the driver's exit
            )
            proc.start()
            child.close()  # the worker holds the only other end: EOF when it dies
            self.procs.append(proc)
            self.conns.append(parent)
        for r in readers:  # the workers have theirs; the driver keeps the write ends (abort)
            r.close()
        self.stats = CallStats()
        self.closed = False
        try:
            self._collect("start", timeout_s=start_timeout_s)
        except WorkerDiedError as e:
            self.shutdown()
            if self.start_method == "spawn":  # most often: __main__ could not be re-imported
                e.args = (f"{e.args[0]} while starting (spawn re-imports __main__ in every worker: {GUARD})",)
            raise
        except BaseException:
            self.shutdown()
            raise
        # every rank has mapped the segment: its name can go, the memory stays until the last
        # map does (so no way of dying, even a SIGKILL of this process, leaves it in /dev/shm)
        shm_comm.unlink_segment(shm_path)

    # -- the driver's side of a step -------------------------------------------------
    def call(self, method: str, *args, timeout_s: Optional[float] = None) -> list[Any]:
        """``worker.method(*args)`` on every rank -> the ranks' results, rank 0 first."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers have been shut down")
        t0 = time.perf_counter()
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            shm_comm.set_sending(self._shm, self.world_size, True)
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(data)
                except (BrokenPipeError, OSError):
                    raise self._died(rank) from None
            shm_comm.set_sending(self._shm, self.world_size, False)
            t1 = time.perf_counter()
            results = self._collect(method, timeout_s)
            self.stats.add(len(data), t1 - t0, time.perf_counter() - t1)
            return results
        except BaseException:  # a dead rank, a failed rank, KeyboardInterrupt: the group is gone
            self.shutdown()
            raise

    def _collect(self, method: str, timeout_s: Optional[float] = None) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=left)
            if not ready:
                raise TimeoutError(f"tensor-parallel workers {sorted(pending)} did not answer {method!r}")
            for rank in sorted(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready or conn.poll():
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        raise self._died(rank) from None
                    if status == "error":
                        raise self._blame(
                            rank, f"tensor-parallel worker rank {rank} failed in {method!r}: {value}"
                        )
                    results[rank] = value
                    pending.discard(rank)
                elif proc.sentinel in ready:
                    raise self._died(rank)
        return results

    def _abort_collectives(self) -> None:
        """Make every rank waiting in a shared-memory collective raise (a peer is gone)."""
        shm_comm.abort(self._shm, self.world_size, [w.fileno() for w in self._wake if not w.closed])

    def _died(self, rank: int) -> WorkerDiedError:
        self._abort_collectives()
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return WorkerDiedError(rank, f"tensor-parallel worker rank {rank} died ({how}, pid {proc.pid})")

    def _blame(self, rank: int, message: str) -> WorkerError:
        """A rank's error, or the death that caused it: a collective fails on every rank when one
        rank dies, so a rank that is gone within a second is the one to name."""
        self._abort_collectives()
        others = [p.sentinel for r, p in enumerate(self.procs) if r != rank and p.is_alive()]
        if others:
            wait(others, timeout=1.0)
        for r, p in enumerate(self.procs):
            if r != rank and not p.is_alive():
                err = self._died(r)
                err.args = (f"{err.args[0]}; rank {rank} then failed: {message}",)
                return err
        return WorkerError(rank, message)

    # -- lifetime --------------------------------------------------------------------
    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self.procs]

    def shutdown(self) -> None:
        """Stop every worker (ask, then terminate, then kill) and close the pipes. Idempotent."""
        self.closed = True
        self._finalizer()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _shutdown(procs, conns, shm=None, shm_path=None, wake=(), grace_s: float = 3.0) -> None:
    # a rank still waiting in a shared-memory collective stops waiting
    shm_comm.abort(shm, len(procs), [w.fileno() for w in wake if not w.closed])
    msg = pickle.dumps((_SHUTDOWN, ()))
    for conn in conns:
        try:
            conn.send_bytes(msg)
        except (OSError, ValueError):
            pass  # already dead or closed
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()  # SIGTERM: blocked in a collective with a dead peer
            proc.join(timeout=1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1.0)
    for conn in conns:
        conn.close()
    shm_comm.unlink_segment(shm_path)  # gone already unless the workers never started
    if shm is not None:
        shm.close()
    for w in wake:
        w.close()


# -- the worker's side -------------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    """Exit if the driver is gone (its pid is no longer our parent): never an orphan."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def _resolve(factory: str):
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)


def worker_main(
    rank, world_size, port, device, conn, factory, kwargs, parent_pid, shm_path=None, wake=None, inherited=()
) -> None:
    """One rank: join the group, build the worker, then answer messages until told to stop."""
    for c in inherited:  # fork: the driver's ends of the earlier ranks' pipes
        c.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the driver, which stops us
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from minipaged.distributed.process_group import (
        destroy_tensor_parallel,
        device_for_rank,
        init_tensor_parallel,
    )

    def reply(status: str, value: Any) -> None:
        conn.send_bytes(pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL))

    def failure(e: BaseException) -> str:
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"{type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})"

    try:
        try:
            tp = init_tensor_parallel(
                rank,
                world_size,
                port,
                device,
                timed=kwargs.pop("timed", True),
                shm_path=shm_path,
                shm_wake=None if wake is None else (wake[0].fileno(), [w.fileno() for w in wake[1]]),
            )
            worker = _resolve(factory)(rank=rank, tp=tp, device=device_for_rank(device, rank), **kwargs)
        except Exception as e:  # noqa: BLE001 - reported to the driver, which raises
            reply("error", failure(e))
            return
        reply("ok", None)
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the driver is gone
            if method == _SHUTDOWN:
                return
            if tp.shm is not None:
                # NOTE: a pipe wakes its reader on the writer's core, so this rank may just have
                # preempted the driver before it wrote the next rank's message: yield to it
                # until it has (then it blocks), rather than have the peers wait for that message
                # in the step's first collective
                tp.shm.wait_until_sent()
            try:
                value = getattr(worker, method)(*args)
            except Exception as e:  # noqa: BLE001 - reported to the driver, which raises
                reply("error", failure(e))
                continue
            reply("ok", value)
    finally:
        destroy_tensor_parallel()
        conn.close()
