"""Where a server's time goes: seconds per part, summed since the server started.

``GET /profile`` answers ``ServerProfile.snapshot()``; ``benchmarks/serve_load.py
--profile`` takes one before and one after a load run and prints each part's share of
the run's wall time. No vLLM file mirrors it (vLLM points you at ``py-spy``); it exists
to show *why* the engine core gets a process of its own.

The parts (each measured where it happens, with ``time.perf_counter``)
    ``event_loop``: the event-loop thread busy (wall time minus the time it waited in the
        selector for sockets or timers: the loop's ``select`` is wrapped);
    ``event_loop_cpu``: the event-loop thread's CPU time (``pthread_getcpuclockid``):
        its work alone, without the time it waited for the lock or for a CPU; measured
        under uvloop too, whose selector cannot be wrapped;
    ``parse``: request bodies through ``json.loads`` and pydantic (on the loop);
    ``sse``: building and JSON-encoding the streamed chunks (on the loop);
    ``tokenize``: prompts through the tokenizer (the tokenizer thread);
    ``detokenize``: each step's outputs: incremental text, stop strings, logprob dicts
        (``AsyncLLM``'s ``OutputProcessor``, in the frontend's reader thread);
    ``engine_step``: ``EngineCore.step()``, as the core reports it (its busy loop in a
        thread of this process with ``--no-engine-process``; else the core process, which
        runs *beside* the frontend rather than inside it);
    ``gil_wait``: a probe thread sleeps 5 ms again and again and sums how late it wakes:
        the time a thread that is ready to run waits for the interpreter lock, *and* for a
        CPU when the machine has fewer free cores than runnable threads (the probe cannot
        tell the two apart). The probe starts at the first ``snapshot()`` (the first
        ``GET /profile``), so a server nobody profiles does not wake 200 times a second
        to take the lock: ``gil_wait`` counts from then on. Every part is wall time, so a thread that is descheduled
        while in it counts too: on an oversubscribed machine all parts swell.
    Shares can sum to more than 1: threads (and the core process) run at the same time.

Failure mode: none; ``install`` on a loop without a selector (e.g. uvloop) measures no
``event_loop`` part (reported as None; ``event_loop_cpu`` still is).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

PARTS = ("event_loop", "event_loop_cpu", "parse", "sse", "tokenize", "detokenize", "engine_step", "gil_wait")
PROBE_INTERVAL = 0.005


class ServerProfile:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.start = time.perf_counter()
        self._idle = 0.0  # the loop's seconds in select()
        self._loop_start = None
        self._selector = None
        self._loop_thread = None
        self._loop_cpu0 = None
        self._probe = None

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    @contextmanager
    def timed(self, part: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - t0

    def install(self, loop) -> None:
        """Measure ``loop``'s idle time (its selector)."""
        # NOTE: a process may run several servers one after the other (tests): the loop
        # parts follow the newest loop only
        self._loop_thread = threading.get_ident()
        self._loop_cpu0 = self._thread_cpu()
        self._loop_start, self._idle = None, 0.0
        selector = getattr(loop, "_selector", None)
        if selector is not None and not hasattr(selector.select, "_minipaged"):
            real = selector.select

            def select(timeout=None):
                t0 = time.perf_counter()
                try:
                    return real(timeout)
                finally:
                    if self._selector is selector:
                        self._idle += time.perf_counter() - t0

            select._minipaged = True
            selector.select = select
            self._selector = selector
            self._loop_start = time.perf_counter()

    def _thread_cpu(self):
        """CPU seconds of the event-loop thread (None where the OS cannot say)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._loop_thread))
        except (AttributeError, OSError, TypeError):
            return None

    def start_probe(self) -> None:
        """Start the GIL probe thread (once)."""
        if self._probe is None:
            self._probe = threading.Thread(target=self._gil_probe, name="minipaged-gil-probe", daemon=True)
            self._probe.start()

    def _gil_probe(self) -> None:
        while True:
            t0 = time.perf_counter()
            time.sleep(PROBE_INTERVAL)
            late = time.perf_counter() - t0 - PROBE_INTERVAL
            if late > 0:
                self.seconds["gil_wait"] += late

    def snapshot(self, core_step_seconds=None) -> dict:
        """Seconds per part since the start (``wall``), as plain JSON; starts the probe."""
        self.start_probe()
        now = time.perf_counter()
        parts = dict(self.seconds)
        if self._loop_start is not None:
            parts["event_loop"] = (now - self._loop_start) - self._idle
        else:
            parts["event_loop"] = None
        cpu = None if self._loop_cpu0 is None else self._thread_cpu()
        parts["event_loop_cpu"] = None if cpu is None else cpu - self._loop_cpu0
        if core_step_seconds is not None:
            parts["engine_step"] = core_step_seconds
        return {"wall": now - self.start, "seconds": parts}


PROFILE = ServerProfile()  # one per process: the server's parts are module functions too
