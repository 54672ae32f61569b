"""AsyncEngine: one ``LLMEngine`` stepping in a thread while HTTP handlers come and go.

Mirrors vLLM ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate`` / ``abort``), without
its engine-core process: one asyncio task runs the loop, the model step runs off the
event loop in a single worker thread, and handlers talk to the loop through a queue.

The loop (one turn)::

    apply queued adds and aborts        in the event-loop thread, never during a step
    if nothing to do: sleep until an add arrives
    rec, outs = await step in the engine thread     engine.step() [+ check_invariants()]
    publish rec to /trace, /metrics; hand each request its new tokens

Inputs
    ``add_request(request_id, prompt_token_ids, params)`` -> a ``RequestStream`` whose
    ``queue`` yields ``RequestOutput``s: one each time the request has new tokens, the last
    with ``finished=True``. ``add_requests(items, queue)``: several requests (the prompts of
    one ``/v1/completions`` call), all accepted or none, joining the same step, their
    outputs on one shared queue. ``abort(request_id)``: the request leaves the engine before the
    next step and its blocks are freed (``LLMEngine.abort_request``).
Invariants
    only the loop touches the engine, and never while a step runs; with
    ``check_invariants=True`` ``LLMEngine.check_invariants()`` holds after every step;
    every stream gets exactly one finished output, or an error, or is aborted.
Failure mode
    more than ``max_waiting_requests`` requests not yet running -> ``QueueFull`` (the server
    answers 503 with ``Retry-After``); an exception inside a step fails the requests in
    flight with an error (no traceback to clients), is counted in ``errors``, and the loop
    goes on with an empty engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from minipaged.sampling_params import SamplingParams
from minipaged.viz.palette import FREE_GREY, STATE_COLORS, owner_color


class QueueFull(Exception):
    """The waiting queue is full; try again after ``retry_after`` seconds."""

    def __init__(self, num_waiting: int, retry_after: int = 1) -> None:
        super().__init__(
            f"the server's waiting queue is full ({num_waiting} requests waiting); "
            f"retry after {retry_after} s"
        )
        self.retry_after = retry_after


class EngineError(Exception):
    """The engine failed while this request was in it (the server's fault, not the client's)."""


@dataclass
class RequestStream:
    """What a handler reads: the outputs of one request as they come."""

    request_id: str
    n: int
    prompt_len: int
    arrival: float  # time.monotonic() when it was accepted
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    num_output_tokens: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None


def _group_id(seq_id: str, known) -> str:
    """The caller's request id of a scheduler sequence (``"{id}.{j}"`` when n > 1)."""
    return seq_id if seq_id in known else seq_id.rsplit(".", 1)[0]


def partial_output(engine, request_id: str):
    """The ``RequestOutput`` of an unfinished request so far (None if the engine has none).

    NOTE: the only place the server reads engine state beyond its methods: the engine
    returns outputs of *finished* requests from ``step()``; a streaming server needs the
    tokens of running ones too (vLLM's ``OutputProcessor`` gets them every step).
    """
    group = engine.groups.get(request_id)
    return None if group is None else engine.make_output(group)


class AsyncEngine:
    def __init__(
        self,
        engine,
        *,
        max_waiting_requests: int = 256,
        check_invariants: bool = False,
        metrics=None,
        trace_window: int = 256,
        max_trace_steps: int = 2048,
    ) -> None:
        if not isinstance(max_waiting_requests, int) or max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be an int >= 1, got {max_waiting_requests!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.check_invariants = check_invariants
        self.metrics = metrics
        self.max_trace_steps = max_trace_steps
        self.streams: dict[str, RequestStream] = {}  # accepted, not finished
        self._pending: deque = deque()  # ("add", rid, ids, params) | ("abort", rid)
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minipaged-engine")
        self._running_rids: set[str] = set()  # requests with a sequence running after the last step
        self._num_waiting_seqs = 0  # sequences waiting in the scheduler after the last step
        self.step_offset = 0  # global step number of the engine trace's step 0
        self.num_steps = 0  # steps taken since the server started
        self.recent_steps: deque = deque(maxlen=trace_window)  # /trace events, for late joiners
        self._subscribers: set[asyncio.Queue] = set()
        self._owner_order: dict[str, int] = {}  # sequence id -> its colour index
        self.errors: list[str] = []  # exceptions raised inside steps (should stay empty)

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="minipaged-engine-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(EngineError("the server is shutting down"))
        self.streams.clear()
        for q in list(self._subscribers):
            q.put_nowait(None)
        self._executor.shutdown(wait=True)

    # -- requests (called by handlers, in the event-loop thread) ---------------------
    def num_waiting(self) -> int:
        """Accepted requests that are not running yet (queued here or in the scheduler)."""
        return len(self.streams) - len(self._running_rids & self.streams.keys())

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request for the next step; ``QueueFull`` when too many are waiting."""
        return self.add_requests([(request_id, prompt_token_ids, params)])[0]

    def add_requests(
        self, items: list[tuple[str, list[int], SamplingParams]], queue: Optional[asyncio.Queue] = None
    ) -> list[RequestStream]:
        """Queue several requests for the same next step, all or none: ``QueueFull`` when
        they do not all fit in the waiting queue. With ``queue``, every stream shares it
        (one reader sees the outputs of all, in the order the engine made them)."""
        rids = [rid for rid, _, _ in items]
        for rid in rids:
            if rid in self.streams or rids.count(rid) > 1:
                raise ValueError(f"request_id {rid!r} is already in the server")
        waiting = self.num_waiting()
        if waiting + len(items) > self.max_waiting_requests:
            raise QueueFull(waiting)
        streams = []
        for rid, ids, params in items:
            stream = RequestStream(rid, params.n, len(ids), time.monotonic())
            if queue is not None:
                stream.queue = queue
            self.streams[rid] = stream
            self._pending.append(("add", rid, list(ids), params))
            streams.append(stream)
        self._wake.set()
        return streams

    def abort(self, request_id: str) -> None:
        """Abort before the next step (no-op for a finished or unknown request)."""
        stream = self.streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        stream.finished = True
        if self.metrics is not None:
            self.metrics.on_request_aborted(request_id)
        for i, item in enumerate(self._pending):
            if item[0] == "add" and item[1] == request_id:  # never reached the engine
                del self._pending[i]
                return
        self._pending.append(("abort", request_id))
        self._wake.set()

    # -- /trace subscribers ----------------------------------------------------------
    def trace_header(self) -> dict:
        e = self.engine
        return {
            "type": "config",
            "model": e.config.model or "course_model",
            "num_blocks": e.num_blocks,
            "block_size": e.config.block_size,
            "max_num_seqs": e.config.max_num_seqs,
            "max_num_batched_tokens": e.config.max_num_batched_tokens,
            "max_model_len": e.max_model_len,
            "colors": {
                "owners": [owner_color(k) for k in range(21)],
                "states": STATE_COLORS,
                "free": FREE_GREY,
            },
        }

    def subscribe(self, maxsize: int = 1024) -> asyncio.Queue:
        """A queue of step events (dicts); ``None`` when the server stops or the reader lags."""
        q: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    # -- the loop ----------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._running_rids = set()
                if self.metrics is not None:  # no step will run: say so now
                    kv = self.engine.kv_cache_manager
                    self.metrics.on_idle(kv.get_num_free_blocks(), self.engine.num_blocks)
                if self.engine.step_index > 0:  # idle: start a fresh trace (bounded memory)
                    self._reset_trace()
                self._wake.clear()
                if not self._pending:
                    await self._wake.wait()
                continue
            if self.engine.step_index >= self.max_trace_steps:
                self._reset_trace()
            tracked = {rid: s.n for rid, s in self.streams.items()}
            try:
                rec, outs = await loop.run_in_executor(self._executor, self._step_sync, tracked)
            except Exception as exc:  # an engine bug: fail what is in flight, keep serving
                self._fail_all(exc)
                continue
            self._publish(rec)
            self._dispatch(outs)

    def _apply_pending(self) -> None:
        while self._pending:
            item = self._pending.popleft()
            if item[0] == "add":
                _, rid, ids, params = item
                try:
                    self.engine.add_request(rid, ids, params)
                except ValueError as exc:  # validated by the handler already; be safe
                    stream = self.streams.pop(rid, None)
                    if stream is not None:
                        stream.finished = True
                        stream.queue.put_nowait(exc)
            else:
                try:
                    self.engine.abort_request(item[1])  # frees its blocks now
                except ValueError:
                    pass  # it finished in the step that just ran

    def _step_sync(self, tracked: dict[str, int]):
        """In the engine thread: one step, then the outputs of the requests that moved."""
        engine = self.engine
        finished = engine.step()
        if self.check_invariants:
            engine.check_invariants()
        rec = engine.trace.steps[-1]
        outs = {o.request_id: o for o in finished}
        moved = {_group_id(sid, tracked) for sid in rec.scheduled}
        for rid in moved:
            if rid in tracked and rid not in outs:
                out = partial_output(engine, rid)
                if out is not None:
                    outs[rid] = out
        event = dataclasses.asdict(rec)
        event["requests"] = {
            rid: dict(engine.trace.requests[rid])
            for rid in list(rec.arrived_ids) + list(rec.finished_ids)
            if rid in engine.trace.requests
        }
        return event, outs

    def _reset_trace(self) -> None:
        old = self.engine.reset_trace()
        self.step_offset += len(old.steps)

    def _publish(self, event: dict) -> None:
        event["type"] = "step"
        event["step"] = self.step_offset + event["step"]
        event["time"] = time.time()
        self.num_steps += 1
        self._running_rids = {_group_id(sid, self.streams) for sid in event["block_tables"]}
        self._num_waiting_seqs = len(event["waiting_ids"])
        if self.metrics is not None:
            self.metrics.on_step(event, self.engine.num_blocks, len(self._pending_adds()))
        self.recent_steps.append(event)
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a reader that cannot keep up is let go
                self._subscribers.discard(q)
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)

    def _pending_adds(self) -> list:
        return [item for item in self._pending if item[0] == "add"]

    def _dispatch(self, outs: dict) -> None:
        now = time.monotonic()
        for rid, out in outs.items():
            stream = self.streams.get(rid)
            if stream is None or stream.finished:
                continue  # aborted by its client while the step ran
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
            elif new > 0:
                stream.queue.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        self.errors.append(msg)
        print(
            "minipaged serve: the engine step failed; requests in flight get an error\n"
            + "".join(traceback.format_exception(exc)),
            file=sys.stderr,
        )
        for rid, stream in list(self.streams.items()):
            stream.finished = True
            stream.queue.put_nowait(EngineError("the engine failed while serving this request"))
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
        self.streams.clear()
        self._pending.clear()
        if self.metrics is not None:
            self.metrics.on_engine_error()
