"""AsyncLLM: the server's frontend. Requests come and go on the event loop while the core steps.

Mirrors vLLM v1 ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate`` / ``abort``, its
``output_handler``): one ``Processor`` (fan ``n`` out), one ``OutputProcessor`` (text, stop
strings, logprobs, ``n > 1``: the same code offline uses, the only place outputs are built)
and a background client (``engine/core_client.py``): ``MPClient``, the engine core in its
own process (``minipaged serve``'s default, as vLLM v1), or ``ThreadedClient``, the same
busy loop in a thread of this process (``--no-engine-process``, over an ``LLMEngine``).

The data path::

    handler: add_requests(...)        Processor -> EngineCoreRequests -> client (a sender
                                      thread writes them: the event loop never blocks)
    reader thread: ("outputs", o)     OutputProcessor.process_outputs(o.outputs), stop
                                      strings -> client.stop_requests, then on the loop:
    loop: _on_outputs                 /trace event, metrics, each request's RequestOutput
                                      on its stream's queue (partial ones if streamed)

Inputs
    ``add_request(request_id, prompt_token_ids, params)`` -> a ``RequestStream`` whose
    ``queue`` yields ``RequestOutput``s (the last with ``finished=True``) or an exception;
    ``add_requests(items, queue)``: several requests (the prompts of one
    ``/v1/completions`` call), all accepted or none, their outputs on one shared queue;
    ``abort(request_id)``: its sequences leave the core before its next step.
    ``await check_health(timeout)``: pings the core (one ping shared by concurrent callers);
    ``EngineNotResponding`` if it does not answer within ``timeout`` seconds, ``EngineDead``
    if it is unusable. ``fail_requests(message)``: shutting down, every request in flight
    gets ``EngineDead(message)``, new ones are refused (``draining``).
Invariants
    every stream gets exactly one finished output, or an error, or is aborted; the
    output processor's state is touched under one lock (the loop adds, the reader moves).
    A stream's queue (``OutputQueue``) merges partial outputs its reader has not taken yet
    (they are cumulative, as vLLM's ``RequestOutputCollector`` merges deltas) but keeps each
    step's boundary, so an unread stream holds one output and the reader still gets one
    output per step (``stream_interval``, vLLM's ``--stream-interval``); after
    ``max_unread_steps`` merged steps the client is taken as gone: the request is aborted
    and the stream gets ``StreamOverflow``. A finished output left unread is dropped the
    same way after ``unread_timeout`` seconds, or, oldest first, while such outputs hold
    more than ``max_unread_tokens`` entries together (``num_unread_dropped`` counts both).
Failure mode
    more than ``max_waiting_requests`` requests not yet running -> ``QueueFull`` (503 with
    ``Retry-After``); a failed core step fails that step's requests with ``EngineError``
    (the core recovers, ``EngineCoreProc``); a core that is dead (too many failures) or
    whose process died: ``dead`` says why, every request gets an error, new ones
    ``EngineDead`` (503), and ``on_core_death()`` is called once when the process died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional

from minipaged.engine.core import step_event
from minipaged.engine.core_client import EngineCoreDead, MPClient, ThreadedClient, load_tokenizer
from minipaged.engine.output_processor import OutputProcessor
from minipaged.engine.outputs import RequestOutput
from minipaged.engine.processor import Processor
from minipaged.sampling_params import SamplingParams

DEFAULT_UNREAD_TIMEOUT = 30.0  # seconds a finished stream's output may wait for its reader
# NOTE: entries (tokens, plus their logprob candidates) that finished streams may hold
# unread, all together: ~100-200 bytes each in Python objects, so ~100-200 MB
DEFAULT_MAX_UNREAD_TOKENS = 1_000_000
DEFAULT_HEALTH_TIMEOUT = 5.0  # seconds the engine core has to answer /health's ping
# NOTE: oldest-generation collections 10x rarer than Python's default (10) in the frontend:
# one walks every object alive (a big logprobs answer is ~100,000 Logprob objects and dicts)
# holding the GIL, 100 ms in which no stream moves; the frontend collects in full when idle
GC_GEN2_THRESHOLD = 100


class QueueFull(Exception):
    """The waiting queue is full; try again after ``retry_after`` seconds."""

    def __init__(self, num_waiting: int, retry_after: int = 1) -> None:
        super().__init__(
            f"the server's waiting queue is full ({num_waiting} requests waiting); retry after {retry_after} s"
        )
        self.retry_after = retry_after


class EngineError(Exception):
    """The engine failed while this request was in it (the server's fault, not the client's)."""


class EngineDead(Exception):
    """The engine is unusable (see ``AsyncLLM.dead``); the server must be restarted."""


class EngineNotResponding(Exception):
    """The engine core did not answer a ping in time (stopped, or stuck)."""


class StreamOverflow(Exception):
    """The client left its stream unread for too many steps; the request was aborted."""


@dataclass
class _Partial:
    request_id: str


def _cut(out: RequestOutput, bound: tuple) -> RequestOutput:
    """``out`` as it stood at an earlier step: choice ``j`` cut to its first ``bound[j]`` =
    (tokens, characters); the logprob list stays shared (readers slice it by token count)."""
    comps = [
        dataclasses.replace(c, text=c.text[:nchars], token_ids=c.token_ids[:ntok])
        for c, (ntok, nchars) in zip(out.outputs, bound)
    ]
    return dataclasses.replace(out, outputs=comps)


def output_size(out) -> int:
    """What an output holds, in entries: each token, plus each of its logprob candidates."""
    size = 0
    for c in getattr(out, "outputs", ()):
        lps = c.logprobs
        size += len(c.token_ids) * (1 + (len(lps[0]) if lps else 0))
    return size


class OutputQueue:
    """A reader's outputs (of one request, or of the prompts of one request), one per
    engine step, in order.

    ``put_nowait(item)``: a finished output, an exception, or a *partial* output (an
    unfinished, cumulative ``RequestOutput``). A partial output of a request that already
    has one waiting replaces it and only that step's boundary is kept (per choice: tokens
    and characters so far), so an unread stream holds one output and a few integers per
    step; ``get()`` still hands out each step's output in turn, the earlier ones cut from
    the newest (``_cut``): every step's tokens are their own event however late the reader
    comes (vLLM's ``--stream-interval 1``). ``unread[request_id]``: steps waiting beyond
    the first. With ``stream_interval = N > 1`` a step is its own output only once it adds
    N tokens (the first token and the finished output always are), as vLLM's.
    ``drop(request_id, exc)``: the request's waiting outputs are let go and ``exc`` takes
    their place; ``dropped`` is set (the response closes the connection).
    """

    def __init__(self, stream_interval: int = 1) -> None:
        self.stream_interval = stream_interval
        self._items: deque = deque()  # outputs, exceptions, or _Partial markers
        self._partial: dict = {}  # request_id -> its newest partial output not yet read
        self._bounds: dict[str, deque] = {}  # request_id -> its waiting steps' boundaries
        self._marks: dict[str, int] = {}  # request_id -> tokens at its last step boundary
        self.unread: dict[str, int] = {}  # request_id -> steps waiting beyond the first
        self.on_taken = None  # called with the output when a finished output is read
        self.dropped = asyncio.Event()
        self._event = asyncio.Event()

    def put_nowait(self, item) -> None:
        rid = getattr(item, "request_id", None)
        if rid is not None and not getattr(item, "finished", True):
            bound = tuple((len(c.token_ids), len(c.text)) for c in item.outputs)
            mark = max((b[0] for b in bound), default=0)
            last = self._marks.get(rid)
            if self.stream_interval > 1 and last is not None and mark - last < self.stream_interval:
                return  # held back: the next output sent says all of it (outputs are cumulative)
            self._marks[rid] = mark
            if rid in self._partial:
                self._partial[rid] = item
                self._bounds[rid].append(bound)
                self.unread[rid] += 1
                return
            self._partial[rid], self._bounds[rid], self.unread[rid] = item, deque([bound]), 0
            item = _Partial(rid)
        elif rid is not None:
            self._marks.pop(rid, None)
        self._items.append(item)
        self._event.set()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Drop everything not read yet (the reader is gone)."""
        self._items.clear()
        for d in (self._partial, self._bounds, self._marks, self.unread):
            d.clear()

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if isinstance(item, _Partial):
            rid = item.request_id
            bounds = self._bounds[rid]
            bound = bounds.popleft()
            if bounds:  # later steps wait: this one is cut from the newest output
                self._items.appendleft(item)
                self.unread[rid] -= 1
                return _cut(self._partial[rid], bound)
            self.unread.pop(rid, None)
            del self._bounds[rid]
            return self._partial.pop(rid)
        if self.on_taken is not None and getattr(item, "finished", False):
            self.on_taken(item)
        return item

    async def get(self):
        while not self._items:
            self._event.clear()
            await self._event.wait()
        return self.get_nowait()

    def drop(self, request_id: str, exc: BaseException) -> None:
        """Let go of everything of ``request_id`` that waits; ``exc`` is read instead."""
        self._items = deque(x for x in self._items if getattr(x, "request_id", None) != request_id)
        for d in (self._partial, self._bounds, self._marks, self.unread):
            d.pop(request_id, None)
        self._items.append(exc)
        self.dropped.set()
        self._event.set()


@dataclass
class RequestStream:
    """What a handler reads: the outputs of one request as they come."""

    request_id: str
    n: int
    prompt_len: int
    arrival: float  # time.monotonic() when it was accepted
    queue: OutputQueue = field(default_factory=OutputQueue)
    stream: bool = True  # wants partial outputs (False: only the finished one)
    finished: bool = False
    num_output_tokens: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None


def _release_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    NOTE: a burst of big answers (16 x 480 tokens with 20 logprobs each) leaves hundreds of
    MB freed but still mapped in glibc's per-thread arenas; trimming when the engine goes
    idle keeps the server's RSS near its warm-up value. It runs in a thread of its own
    (ctypes releases the GIL), never on the event loop, so no stream waits for it."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim and not _trimming.locked():
        threading.Thread(target=_trim, name="minipaged-malloc-trim", daemon=True).start()


def _trim() -> None:
    with _trimming:
        gc.collect()  # NOTE: nothing is in flight: the cycles the burst left, then the pages
        _malloc_trim(0)


_malloc_trim = None
_trimming = threading.Lock()


class _NoProfile:
    def install(self, loop) -> None:
        pass

    def add(self, name: str, seconds: float) -> None:
        pass


class AsyncLLM:
    def __init__(
        self,
        engine,
        *,
        max_waiting_requests: int = 256,
        check_invariants: bool = False,
        metrics=None,
        trace_window: int = 256,
        max_unread_steps: int = 256,
        max_step_failures: int = 3,
        profile=None,
        unread_timeout: float = DEFAULT_UNREAD_TIMEOUT,
        max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS,
        stream_interval: int = 1,
    ) -> None:
        """``engine``: an ``MPClient`` (the core in its own process) or an ``LLMEngine``
        (its core's busy loop runs in a thread here: ``ThreadedClient``)."""
        for name, value in (
            ("max_waiting_requests", max_waiting_requests),
            ("max_unread_steps", max_unread_steps),
            ("max_step_failures", max_step_failures),
            ("max_unread_tokens", max_unread_tokens),
            ("stream_interval", stream_interval),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(unread_timeout, (int, float)) or not unread_timeout > 0:
            raise ValueError(f"unread_timeout must be a number of seconds > 0, got {unread_timeout!r}")
        if isinstance(engine, MPClient):
            self.client = engine
            tokenizer = load_tokenizer(engine.config.model)
        else:  # an LLMEngine: its core, stepped in a thread of this process
            self.client = ThreadedClient(
                engine.core, check_invariants=check_invariants, max_step_failures=max_step_failures
            )
            tokenizer = engine.tokenizer
        info = self.client.model_info
        self.model_info = info
        self.config = info.config
        self.max_model_len = info.max_model_len
        self.num_blocks = info.num_blocks
        self.tokenizer = tokenizer
        self.processor = Processor(info, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.max_waiting_requests = max_waiting_requests
        self.max_unread_steps = max_unread_steps
        self.unread_timeout = float(unread_timeout)
        self.max_unread_tokens = max_unread_tokens
        self.stream_interval = stream_interval
        # finished outputs of streamed requests not read yet: request id -> (queue ref, size)
        self._unread: OrderedDict = OrderedDict()
        self._unread_size = 0
        self.num_unread_dropped = 0
        self.draining = False  # shutting down: new requests are refused
        self._health: Optional[asyncio.Future] = None  # the ping in flight (shared by callers)
        self._gc_threshold: Optional[tuple] = None  # Python's, while the frontend runs with its own
        self.check_invariants = check_invariants
        self.metrics = metrics
        self.profile = profile if profile is not None else _NoProfile()
        self.dead: Optional[str] = None  # why the engine is unusable (None: it is fine)
        self.core_died = False
        self.on_core_death = None  # called once when the core process dies
        self.streams: dict[str, RequestStream] = {}  # accepted, not finished
        self._lock = threading.Lock()  # the output processor: the loop adds, the reader moves
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._running_rids: set[str] = set()  # requests with a sequence running after the last step
        self._pings: dict[int, asyncio.Future] = {}
        self._ping_ids = itertools.count()
        self.num_steps = 0  # steps taken since the server started
        self.recent_steps: deque = deque(maxlen=trace_window)  # /trace events, for late joiners
        self._subscribers: set[asyncio.Queue] = set()
        self.errors: list[str] = []  # exceptions raised inside steps (should stay empty)

    # -- what serving reads of the engine ---------------------------------------------------
    def tokenize(self, prompt, name: str = "prompt"):
        return self.processor.tokenize(prompt, name)

    def get_num_unfinished_requests(self) -> int:
        """The core's unfinished requests, as of its last message."""
        return self.client.get_num_unfinished_requests()

    def get_num_free_blocks(self) -> int:
        return self.client.get_num_free_blocks()

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._gc_threshold = t0, t1, t2 = gc.get_threshold()  # put back by shutdown()
        gc.set_threshold(t0, t1, max(t2, GC_GEN2_THRESHOLD))
        self._loop = asyncio.get_running_loop()
        self.profile.install(self._loop)
        self.client.start(self._on_message)

    async def shutdown(self) -> None:
        for stream in list(self.streams.values()):
            stream.finished = True
            stream.queue.put_nowait(EngineError("the server is shutting down"))
        self.streams.clear()
        for q in list(self._subscribers):
            q.put_nowait(None)
        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)
        await asyncio.get_running_loop().run_in_executor(None, self.client.shutdown)

    async def check_health(self, timeout: float = DEFAULT_HEALTH_TIMEOUT) -> None:
        """Ping the engine core: ``EngineNotResponding`` without an answer in ``timeout``
        seconds, ``EngineDead`` if it is unusable. Concurrent callers share one ping, so a
        stopped core is never sent more than one."""
        if self.dead is not None:
            raise EngineDead(f"the engine is unusable ({self.dead})")
        if self._health is None or self._health.done():
            self._health = asyncio.ensure_future(self._ping())
        try:
            await asyncio.wait_for(asyncio.shield(self._health), timeout)
        except asyncio.TimeoutError:
            raise EngineNotResponding(f"the engine core did not answer a ping within {timeout:g} s") from None
        except EngineCoreDead as e:
            raise EngineDead(str(e)) from None

    async def _ping(self) -> None:
        token = next(self._ping_ids)
        fut = asyncio.get_running_loop().create_future()
        self._pings[token] = fut
        try:
            self.client.ping(token)  # NOTE: queued for the sender thread: never blocks the loop
            await fut
        finally:
            self._pings.pop(token, None)

    def fail_requests(self, message: str) -> int:
        """Shutting down: every request still in the server is aborted and its reader gets
        ``EngineDead(message)`` (an error event then ``[DONE]``, or a JSON 503); new ones
        are refused (``draining``). Returns how many were failed."""
        self.draining = True
        streams = [s for s in self.streams.values() if not s.finished]
        for stream in streams:
            self.abort(stream.request_id)
            stream.queue.put_nowait(EngineDead(message))
        return len(streams)

    # -- requests (called by handlers, on the event loop) --------------------------------------
    def num_waiting(self) -> int:
        """Accepted requests that are not running yet (queued here or in the scheduler)."""
        return len(self.streams) - len(self._running_rids & self.streams.keys())

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: bool = True
    ) -> RequestStream:
        """Queue a request for the next step; ``QueueFull`` when too many are waiting."""
        return self.add_requests([(request_id, prompt_token_ids, params)], stream=stream)[0]

    def add_requests(
        self,
        items: list[tuple[str, list[int], SamplingParams]],
        queue: Optional[OutputQueue] = None,
        stream: bool = True,
    ) -> list[RequestStream]:
        """Queue several requests for the same next step, all or none: ``QueueFull`` when
        they do not all fit in the waiting queue, ``EngineDead`` when the engine is
        unusable, ``ValueError`` for bad input. With ``queue``, every stream shares it (one
        reader sees the outputs of all, in order). ``stream=False``: only finished outputs."""
        if self.dead is not None:
            raise EngineDead(f"the engine is unusable ({self.dead}); the server must be restarted")
        if self.draining:
            raise EngineDead("the server is shutting down")
        rids = [rid for rid, _, _ in items]
        for rid in rids:
            if rid in self.streams or rids.count(rid) > 1:
                raise ValueError(f"request_id {rid!r} is already in the server")
        waiting = self.num_waiting()
        if waiting + len(items) > self.max_waiting_requests:
            raise QueueFull(waiting)
        groups = [
            (rid, self.processor.process_inputs(rid, ids, self.processor.verify_params(params)))
            for rid, ids, params in items
        ]
        streams = []
        with self._lock:
            for (rid, ids, params), (_, children) in zip(items, groups):
                self.output_processor.add_request(rid, None, ids, params, children, stream=stream)
                q = queue if queue is not None else OutputQueue(self.stream_interval)
                s = RequestStream(rid, params.n, len(ids), time.monotonic(), q, stream)
                self.streams[rid] = s
                streams.append(s)
        try:
            self.client.add_requests(groups)
        except EngineCoreDead as e:
            for s in streams:
                self._drop(s.request_id)
            raise EngineDead(str(e)) from None
        return streams

    def abort(self, request_id: str) -> None:
        """Abort before the core's next step (no-op for a finished or unknown request)."""
        self._forget_unread(request_id)  # NOTE: its reader is gone: what waits for it goes too
        stream = self.streams.pop(request_id, None)
        if stream is None or stream.finished:
            self._release_if_idle()  # a finished stream's reader hung up: its output is free now
            return
        stream.finished = True
        if self.metrics is not None:
            self.metrics.on_request_aborted(request_id)
        with self._lock:
            seq_ids = self.output_processor.abort_request(request_id)
        try:
            self.client.abort_requests(seq_ids)
        except EngineCoreDead:
            pass  # the core is gone: nothing of the request is left anywhere

    def _drop(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        with self._lock:
            self.output_processor.abort_request(request_id)

    # -- /trace subscribers ------------------------------------------------------------------
    def trace_header(self) -> dict:
        from minipaged.viz.palette import FREE_GREY, STATE_COLORS, owner_color, text_color_on

        c = self.config
        return {
            "type": "config",
            "model": c.model or "course_model",
            "num_blocks": self.num_blocks,
            "block_size": c.block_size,
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "colors": {
                "owners": [owner_color(k) for k in range(21)],
                "states": STATE_COLORS,
                "free": FREE_GREY,
                # the label colour on each fill (black or white, WCAG contrast >= 4.5)
                "text": {
                    "owners": [text_color_on(owner_color(k)) for k in range(21)],
                    "states": {s: text_color_on(col) for s, col in STATE_COLORS.items()},
                },
            },
        }

    def subscribe(self, maxsize: int = 1024) -> asyncio.Queue:
        """A queue of step events (dicts); ``None`` when the server stops or the reader lags."""
        q: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    # -- the reader thread: outputs are built here, off the event loop ------------------------------
    def _on_message(self, msg) -> None:
        kind, loop = msg[0], self._loop
        try:
            if kind == "outputs":
                outs = msg[1]
                t0 = time.perf_counter()
                with self._lock:
                    failed = self._failed_parents(outs) if outs.error is not None else set()
                    processed = self.output_processor.process_outputs(outs.outputs)
                    siblings = [sid for rid in failed for sid in self.output_processor.abort_request(rid)]
                self.profile.add("detokenize", time.perf_counter() - t0)
                try:
                    self.client.stop_requests(processed.reqs_to_stop)
                    self.client.abort_requests(siblings)
                except EngineCoreDead:
                    pass
                loop.call_soon_threadsafe(self._on_outputs, outs, processed.request_outputs, failed)
            elif kind == "rejected":
                loop.call_soon_threadsafe(self._on_rejected, msg[1], msg[2])
            elif kind == "pong":
                loop.call_soon_threadsafe(self._on_pong, msg[1])
            elif kind == "dead":
                loop.call_soon_threadsafe(self._on_core_dead, msg[1])
        except RuntimeError:  # the event loop is closed: the server is stopping
            pass

    def _failed_parents(self, outs) -> set[str]:
        """The caller requests a failed step aborted a sequence of (all its samples fail)."""
        found = (
            self.output_processor._samples.get(o.request_id)
            for o in outs.outputs
            if o.finish_reason == "abort"
        )
        return {f[0].request_id for f in found if f is not None}

    # -- on the event loop -----------------------------------------------------------------------
    def _on_outputs(self, outs, request_outputs: list, failed: set[str]) -> None:
        self.client.stats = outs.stats
        if outs.step is not None:
            self._publish(outs)
        if outs.error is not None:
            self.errors.append(outs.error)
            if self.metrics is not None:
                self.metrics.on_engine_error()
            for rid in failed:
                self._fail_stream(rid, EngineError("the engine failed while serving this request"))
        self._dispatch([o for o in request_outputs if o.request_id not in failed])
        if outs.dead is not None:
            self._mark_dead(outs.dead, EngineError("the engine failed while serving this request"))
        elif outs.step is None and outs.error is None:  # the core ran out of work
            self._running_rids = set()
            if self.metrics is not None:
                self.metrics.on_idle(outs.stats["num_free_blocks"], self.num_blocks)
            self._release_if_idle()

    def _publish(self, outs) -> None:
        event = step_event(outs.step)
        event["requests"] = outs.requests
        event["type"] = "step"
        event["time"] = time.time()
        self.num_steps += 1
        self._running_rids = {self._caller_id(sid) for sid in event["block_tables"]}
        if self.metrics is not None:
            self.metrics.on_step(event, self.num_blocks, 0)
        self.recent_steps.append(event)
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a reader that cannot keep up is let go
                self._subscribers.discard(q)
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)

    def _caller_id(self, seq_id: str) -> str:
        """The caller's request id of a core sequence (``"{id}.{j}"`` when n > 1)."""
        return seq_id if seq_id in self.streams else seq_id.rsplit(".", 1)[0]

    def _dispatch(self, request_outputs: list) -> None:
        now = time.monotonic()
        for out in request_outputs:
            rid = out.request_id
            stream = self.streams.get(rid)
            if stream is None or stream.finished:
                continue  # aborted by its client meanwhile
            num = sum(len(c.token_ids) for c in out.outputs)
            new = num - stream.num_output_tokens
            if new > 0:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    if self.metrics is not None:
                        self.metrics.on_first_token(now - stream.arrival, stream.prompt_len, new)
                elif self.metrics is not None:
                    self.metrics.on_next_token(now - stream.last_token_time, new)
                stream.last_token_time = now
                stream.num_output_tokens = num
            if out.finished:
                stream.finished = True
                self.streams.pop(rid, None)
                if self.metrics is not None:
                    self.metrics.on_request_finished(out, now - stream.arrival)
                stream.queue.put_nowait(out)
                if stream.stream and isinstance(stream.queue, OutputQueue):
                    self._watch_unread(stream.queue, out)
            elif new > 0 and stream.stream:
                stream.queue.put_nowait(out)
                unread = getattr(stream.queue, "unread", {}).get(rid, 0)  # an asyncio.Queue: 0
                if unread >= self.max_unread_steps:  # the client reads nothing: let it go
                    self.abort(rid)
                    self._drop(
                        stream.queue,
                        rid,
                        f"the client left {unread} steps of output unread; the request was aborted",
                    )

    # -- finished outputs nobody reads: let go after a time, or beyond a size -----------------
    def _watch_unread(self, queue: OutputQueue, out) -> None:
        """``out`` (finished) waits in a streamed request's ``queue``: it is dropped if still
        unread ``unread_timeout`` seconds from now, or, oldest first, while such outputs
        hold more than ``max_unread_tokens`` entries together (``output_size``). Only a
        weak reference to the queue is kept: a reader that goes away frees it at once."""
        rid = out.request_id
        size = output_size(out)
        self._unread[rid] = (weakref.ref(queue), size)
        self._unread_size += size
        queue.on_taken = lambda o: self._forget_unread(o.request_id)
        loop = asyncio.get_running_loop()
        loop.call_later(self.unread_timeout, self._expire_unread, rid, queue.dropped)
        if self._unread_size > self.max_unread_tokens:
            # NOTE: a moment later, so that readers woken by this step take theirs first
            loop.call_later(0.05, self._enforce_unread_size)

    def _forget_unread(self, rid: str) -> None:
        entry = self._unread.pop(rid, None)
        if entry is not None:
            self._unread_size -= entry[1]

    def _expire_unread(self, rid: str, token) -> None:
        entry = self._unread.get(rid)
        queue = None if entry is None else entry[0]()
        if queue is None or queue.dropped is not token:
            return  # read, gone, or another request of the same id
        self._forget_unread(rid)
        self._drop(
            queue, rid, f"the finished output was left unread for {self.unread_timeout:g} s and was dropped"
        )

    def _enforce_unread_size(self) -> None:
        while self._unread_size > self.max_unread_tokens and self._unread:
            rid, (ref, size) = next(iter(self._unread.items()))
            self._forget_unread(rid)
            queue = ref()
            if queue is not None:
                self._drop(
                    queue,
                    rid,
                    f"unread outputs held more than {self.max_unread_tokens} tokens; the oldest was dropped",
                )

    def _drop(self, queue: OutputQueue, request_id: str, message: str) -> None:
        """A stream's reader is gone or stuck: what waits for it is let go, and counted."""
        self.num_unread_dropped += 1
        if self.metrics is not None:
            self.metrics.on_unread_dropped()
        queue.drop(request_id, StreamOverflow(message))
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        """Nothing in flight and nothing waiting for a reader: hand freed memory back
        (``_release_memory``). NOTE: also after a drop or a hang-up, not only when the core
        goes idle: an unread output is let go 30 s after the core went idle."""
        if not self.streams and not self._unread:
            _release_memory()

    def _fail_stream(self, rid: str, exc: Exception) -> None:
        stream = self.streams.pop(rid, None)
        with self._lock:
            self.output_processor.abort_request(rid)
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.queue.put_nowait(exc)

    def _on_rejected(self, rid: str, message: str) -> None:
        self._fail_stream(rid, ValueError(message) if self.dead is None else EngineDead(message))

    def _on_pong(self, token: int) -> None:
        fut = self._pings.get(token)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _on_core_dead(self, exitcode) -> None:
        if self.core_died:
            return
        self.core_died = True
        reason = f"the engine core process died (exit code {exitcode})"
        print(f"minipaged serve: {reason}; shutting down", file=sys.stderr, flush=True)
        if self.metrics is not None:
            self.metrics.on_engine_error()
        self._mark_dead(reason, EngineDead(f"{reason}; the server is shutting down"))
        if self.on_core_death is not None:
            self.on_core_death()

    def _mark_dead(self, reason: str, exc: Exception) -> None:
        """The one place the engine becomes unusable: every stream gets ``exc``, new
        requests ``EngineDead``."""
        if self.dead is None:
            print(f"minipaged serve: the engine is unusable: {reason}", file=sys.stderr)
        self.dead = reason
        for stream in list(self.streams.values()):
            stream.finished = True
            stream.queue.put_nowait(exc)
        self.streams.clear()
        with self._lock:
            for rid in list(self.output_processor.request_states):
                self.output_processor.abort_request(rid)
        for fut in self._pings.values():
            if not fut.done():
                fut.set_exception(EngineDead(reason))
