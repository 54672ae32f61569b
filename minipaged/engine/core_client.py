"""EngineCoreClient: how a frontend reaches its ``EngineCore``.

Mirrors vLLM v1 ``vllm/v1/engine/core_client.py``: ``InprocClient`` (the core in the
caller's thread: ``LLMEngine``'s) and ``MPClient`` (the core in a process of its own, as
``minipaged serve`` runs it); ``ThreadedClient`` is the core's busy loop in a thread of
this process (``minipaged serve --no-engine-process``), behind the same interface as
``MPClient``. The core, and what crosses, is ``engine/core.py``.

Inputs
    ``InprocClient(core)``: ``add_request_group``, ``abort_requests``, ``stop_requests``
    call the core at once; ``get_output()`` is one ``EngineCore.step()``.
    ``MPClient(config)`` spawns ``run_engine_core`` (``spawn``: a fresh interpreter, no
    inherited threads) and waits for its ``ready`` message (``ModelInfo``: the frontend
    loads the tokenizer only, never the weights). ``ThreadedClient(core)`` starts the busy
    loop in a thread. On both: ``add_requests``, ``abort_requests``, ``stop_requests`` and
    ``ping`` put one message on a queue and return at once: a *sender thread* writes it
    (to the pipe), so a core that stopped reading never blocks the caller (the server's
    event loop); ``start(callback)`` calls ``callback(msg)`` in a reader thread for every
    message the core sends, and ``callback(("dead", exitcode))`` once if the core process
    dies while the client is not shutting down.
Failure mode
    the core refusing to start (a bad model, a bad config): ``ValueError`` with its message;
    ``shutdown()`` always leaves no process behind (ask, terminate, then kill).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Optional

from minipaged.engine.core import (
    EngineCore,
    EngineCoreProc,
    EngineCoreRequest,
    decode,
    encode,
    run_engine_core,
)


class EngineCoreDead(Exception):
    """The engine-core process is gone."""


def load_tokenizer(model):
    """The checkpoint's tokenizer, as ``load_model`` finds it (None for a local folder
    without tokenizer files), without loading the weights."""
    from transformers import AutoTokenizer

    from minipaged.model.loader import _TOKENIZER_FILES, resolve_model_path

    src = resolve_model_path(model)
    if os.path.isdir(src) and not any(os.path.isfile(os.path.join(src, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(src)


class EngineCoreClient:
    """What every client offers (vLLM's ``EngineCoreClient``)."""

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def stop_requests(self, stops: list[tuple[str, str]]) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """The core in the caller's thread (vLLM's ``InprocClient``)."""

    def __init__(self, core: EngineCore) -> None:
        self.engine_core = core

    def add_request_group(self, requests: list[EngineCoreRequest]) -> None:
        self.engine_core.add_request_group(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def stop_requests(self, stops: list[tuple[str, str]]) -> None:
        self.engine_core.stop_requests(stops)

    def get_output(self):
        return self.engine_core.step()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class _BackgroundClient(EngineCoreClient):
    """The message side shared by ``ThreadedClient`` and ``MPClient``: sends are queued
    for a sender thread, messages from the core go to a callback in a reader thread."""

    def _init_threads(self) -> None:
        self._outbox: queue.Queue = queue.Queue()  # messages for the core, in order
        self._closing = False
        self._reader: Optional[threading.Thread] = None
        self._sender = threading.Thread(target=self._send_loop, name="minipaged-core-send", daemon=True)
        self._sender.start()
        # the core's numbers after its last message: free blocks, unfinished requests, ...
        self.stats = {"num_free_blocks": self.num_blocks, "num_unfinished": 0, "step_seconds": 0.0}

    def _init_info(self, info) -> None:
        self.model_info = info
        self.config = info.config
        self.num_blocks = info.num_blocks
        self.max_model_len = info.max_model_len
        self.eos_token_ids = info.eos_token_ids

    # -- sending (never blocks the caller) -------------------------------------------------
    def _put(self, msg) -> None:
        if self._closing:
            raise EngineCoreDead("the engine core is shutting down")
        self._outbox.put(msg)

    def add_requests(self, groups: list[tuple[str, list[EngineCoreRequest]]]) -> None:
        self._put(("add", groups))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._put(("abort", list(request_ids)))

    def stop_requests(self, stops: list[tuple[str, str]]) -> None:
        if stops:
            self._put(("stop", list(stops)))

    def ping(self, token: int) -> None:
        """The core answers ``("pong", token)`` (from its input thread, even mid-step)."""
        self._put(("ping", token))

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._write(msg)
            except (OSError, ValueError, EOFError):  # the core is gone: the reader reports it
                return

    def get_num_unfinished_requests(self) -> int:
        return self.stats["num_unfinished"]

    def has_unfinished_requests(self) -> bool:
        return self.stats["num_unfinished"] > 0

    def get_num_free_blocks(self) -> int:
        return self.stats["num_free_blocks"]


class ThreadedClient(_BackgroundClient):
    """The busy loop (``EngineCoreProc``) in a thread of this process, over ``core``."""

    def __init__(
        self, core: EngineCore, *, check_invariants: bool = False, max_step_failures: int = 3
    ) -> None:
        self.engine_core = core
        self.proc = EngineCoreProc(
            core, check_invariants=check_invariants, max_step_failures=max_step_failures
        )
        self._inq: queue.Queue = queue.Queue()
        self._outq: queue.Queue = queue.Queue()
        self._init_info(core.model_info)
        self._init_threads()
        self._core_thread = threading.Thread(
            target=self.proc.run_busy_loop,
            args=(self._inq, self._outq),
            name="minipaged-engine-core",
            daemon=True,
        )
        self._core_thread.start()
        self._outq.get()  # ("ready", ...)

    def _write(self, msg) -> None:
        if msg[0] == "ping":  # NOTE: as the core process's input thread: answered at once
            self._outq.put(("pong", msg[1]))
        else:
            self._inq.put(msg)

    def start(self, callback: Callable) -> None:
        def run() -> None:
            while True:
                msg = self._outq.get()
                if msg is None:
                    return
                callback(msg)

        self._reader = threading.Thread(target=run, name="minipaged-core-outputs", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        self._outbox.put(None)
        self._sender.join(timeout)
        self._inq.put(("shutdown",))
        self._core_thread.join(timeout)
        self._outq.put(None)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)


class MPClient(_BackgroundClient):
    """The core in a process of its own (vLLM's ``MPClient``), over two pipes."""

    def __init__(
        self,
        config,
        *,
        check_invariants: bool = False,
        max_step_failures: int = 3,
        threads: int = 0,
        startup_timeout: float = 600.0,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        in_r, self._in_w = ctx.Pipe(duplex=False)  # frontend -> core
        self._out_r, out_w = ctx.Pipe(duplex=False)  # core -> frontend
        options = {
            "check_invariants": check_invariants,
            "max_step_failures": max_step_failures,
            "threads": threads,
        }
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config, in_r, out_w, options),
            name="minipaged-engine-core",
            # NOTE: not a daemon, so that the core may spawn tensor-parallel workers of its
            # own; it exits when its input pipe closes, and shutdown() runs at exit
            daemon=False,
        )
        self.proc.start()
        # NOTE: the parent closes the child's ends, so that EOF means "the other side died"
        in_r.close()
        out_w.close()
        self._closing = False
        atexit.register(self.shutdown)
        try:
            msg = self._wait_ready(startup_timeout)
        except BaseException:
            self._sender = None
            self.shutdown()
            raise
        self._init_info(msg[1])
        self._init_threads()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self._out_r.poll(0.2):
            if not self.proc.is_alive():
                raise ValueError(
                    f"the engine core process exited while starting (exit code {self.proc.exitcode})"
                )
            if time.monotonic() > deadline:
                raise ValueError(f"the engine core did not start within {timeout:g} s")
        try:
            msg = decode(self._out_r.recv_bytes())
        except EOFError:
            raise ValueError(
                f"the engine core process exited while starting (exit code {self.proc.exitcode})"
            )
        if msg[0] == "error":
            raise ValueError(msg[1])
        return msg

    def _write(self, msg) -> None:
        self._in_w.send_bytes(encode(msg))

    def start(self, callback: Callable) -> None:
        def run() -> None:
            while True:
                try:
                    msg = decode(self._out_r.recv_bytes())
                except (EOFError, OSError):
                    break
                callback(msg)
            if not self._closing:
                self.proc.join(5)
                callback(("dead", self.proc.exitcode))

        self._reader = threading.Thread(target=run, name="minipaged-core-outputs", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (ask, then terminate, then kill); no process is left behind."""
        if self._closing and not self.proc.is_alive():
            return
        self._closing = True
        sender = getattr(self, "_sender", None)
        if sender is not None:
            self._outbox.put(("shutdown",))
            self._outbox.put(None)
            sender.join(2)  # NOTE: a core that reads nothing (stopped) cannot take it: go on
        self.proc.join(timeout if sender is not None and not sender.is_alive() else 0.5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        try:
            self._in_w.close()
        except OSError:
            pass
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(5)
        self._out_r.close()
