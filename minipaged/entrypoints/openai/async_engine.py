"""AsyncEngine: one ``LLMEngine`` stepping in a thread while HTTP handlers come and go.

Mirrors vLLM ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate`` / ``abort``). Two
forms, one interface: ``AsyncEngine`` steps the engine in this process (one asyncio task
runs the loop, the model step runs off the event loop in a single worker thread, and
handlers talk to the loop through a queue: ``minipaged serve --no-engine-process``);
``AsyncMPEngine`` (at the end of this file) talks to an engine core in its own process
(``minipaged/engine/core.py``), as vLLM v1 does and ``minipaged serve`` does by default.

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
Outputs of a running request
    only streamed requests (``add_requests(..., stream=True)``) get partial outputs, built
    in the engine thread from what each step added (``_Progress``): the new tokens go
    through the request's own ``IncrementalDetokenizer``, the new logprob entries become
    dicts once (token texts memoized), past tokens are never revisited. A stream's queue
    (``OutputQueue``) merges partial outputs its reader has not taken yet (they are
    cumulative, as vLLM's ``RequestOutputCollector`` merges deltas), so an unread stream
    holds one output, not one per step; after ``max_unread_steps`` merged steps the client
    is taken as gone: the request is aborted and the stream gets ``StreamOverflow``.
Failure mode
    more than ``max_waiting_requests`` requests not yet running -> ``QueueFull`` (the server
    answers 503 with ``Retry-After``); an exception inside a step fails that step's
    requests with an error (no traceback to clients; ``LLMEngine.fail_step`` frees their
    blocks and resets the scheduler's step), is counted in ``errors``, and the loop goes
    on with the other requests. If the recovery itself fails, or ``max_step_failures``
    steps in a row fail, the engine is *unusable*: ``dead`` says why, every request gets
    an error, new ones ``EngineDead`` (503), and ``/health`` answers 503 so a supervisor
    restarts the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from minipaged.engine.core import step_event
from minipaged.engine.detokenizer import IncrementalDetokenizer
from minipaged.engine.output_processor import logprob_dict
from minipaged.engine.outputs import CompletionOutput, RequestOutput
from minipaged.entrypoints.openai.profile import PROFILE
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


class EngineDead(Exception):
    """The engine is unusable (see ``AsyncEngine.dead``); the server must be restarted."""


class StreamOverflow(Exception):
    """The client left its stream unread for too many steps; the request was aborted."""


@dataclass
class _Partial:
    request_id: str


class OutputQueue:
    """A reader's outputs (of one request, or of the prompts of one request), in order.

    ``put_nowait(item)``: a finished output, an exception, or a *partial* output (an
    unfinished ``RequestOutput``). A partial output of a request that already has one
    waiting replaces it (outputs are cumulative: the newest says all), and
    ``unread[request_id]`` counts the merges; ``await get()`` returns the next item.
    """

    def __init__(self) -> None:
        self._items: deque = deque()  # outputs, exceptions, or _Partial markers
        self._partial: dict = {}  # request_id -> its newest partial output not yet read
        self.unread: dict[str, int] = {}  # request_id -> partial outputs merged while waiting
        self._event = asyncio.Event()

    def put_nowait(self, item) -> None:
        rid = getattr(item, "request_id", None)
        if rid is not None and not getattr(item, "finished", True):
            if rid in self._partial:
                self._partial[rid] = item
                self.unread[rid] += 1
                return
            self._partial[rid], self.unread[rid] = item, 0
            item = _Partial(rid)
        self._items.append(item)
        self._event.set()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if isinstance(item, _Partial):
            self.unread.pop(item.request_id, None)
            return self._partial.pop(item.request_id)
        return item

    async def get(self):
        while not self._items:
            self._event.clear()
            await self._event.wait()
        return self.get_nowait()


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


def _group_id(seq_id: str, known) -> str:
    """The caller's request id of a scheduler sequence (``"{id}.{j}"`` when n > 1)."""
    return seq_id if seq_id in known else seq_id.rsplit(".", 1)[0]


class _Progress:
    """What the server has built of one streamed request's output so far (engine thread):
    per sequence, its detokenizer, how many tokens it has seen, its logprob dicts."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        detok_params = dataclasses.replace(params, n=1, stop=None)  # the stop check is the engine's
        self.detoks = [
            None if tokenizer is None else IncrementalDetokenizer(tokenizer, [], detok_params)
            for _ in range(params.n)
        ]
        self.num_tokens = [0] * params.n
        self.logprobs: list[list] = [[] for _ in range(params.n)]


def partial_output(engine, request_id: str, progress: Optional[_Progress] = None, piece=None):
    """The ``RequestOutput`` of an unfinished request so far (None if the engine has none).

    With ``progress`` (the server's path) only what the last step added is worked on: the
    new tokens are detokenized incrementally and only the new logprob entries become dicts
    (``piece(token_id)``: a token's text); past tokens are never revisited. Without it, the
    engine builds the whole output (``make_output``: every token's dicts again).

    NOTE: the only place the server reads engine state beyond its methods: the engine
    returns outputs of *finished* requests from ``step()``; a streaming server needs the
    tokens of running ones too (vLLM's ``OutputProcessor`` gets them every step).
    """
    group = engine.groups.get(request_id)
    if group is None:
        return None
    if progress is None:
        return engine.make_output(group)
    comps = []
    for j, req in enumerate(group.seqs):
        ids = list(req.output_token_ids)
        detok = progress.detoks[j]
        for t in [] if detok is None else ids[progress.num_tokens[j] :]:
            detok.update(t)
        progress.num_tokens[j] = len(ids)
        st = engine.output_processor.seqs.get(req.request_id)
        entries = None if st is None else st.logprobs
        lps = progress.logprobs[j]
        if entries is not None:
            del lps[len(entries) :]  # a position sampled again replaces its entry
            lps.extend(logprob_dict(e, piece) for e in entries[len(lps) :])
        comps.append(
            CompletionOutput(
                index=j,
                text="" if detok is None else detok.output_text,
                token_ids=ids,
                logprobs=lps if entries is not None else None,
            )
        )
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, comps, False)


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
        _malloc_trim(0)


_malloc_trim = None
_trimming = threading.Lock()


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
        max_unread_steps: int = 256,
        max_step_failures: int = 3,
    ) -> None:
        for name, value in (
            ("max_waiting_requests", max_waiting_requests),
            ("max_unread_steps", max_unread_steps),
            ("max_step_failures", max_step_failures),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_unread_steps = max_unread_steps
        self.max_step_failures = max_step_failures
        self.dead: Optional[str] = None  # why the engine is unusable (None: it is fine)
        self._consecutive_failures = 0
        self._progress: dict[str, _Progress] = {}  # streamed request -> what is built of it
        tok = engine.tokenizer
        # a token's text, memoized (at most the vocabulary): logprob dicts decode each once
        self._piece = functools.lru_cache(maxsize=1 << 18)(
            (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else (lambda t: None)
        )
        self.num_logprob_dicts = 0  # logprob dicts the server built (one per streamed token)
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
        PROFILE.install(asyncio.get_running_loop())
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
        unusable. With ``queue``, every stream shares it (one reader sees the outputs of
        all, in the order the engine made them). ``stream=False``: only finished outputs."""
        if self.dead is not None:
            raise EngineDead(f"the engine is unusable ({self.dead}); the server must be restarted")
        rids = [rid for rid, _, _ in items]
        for rid in rids:
            if rid in self.streams or rids.count(rid) > 1:
                raise ValueError(f"request_id {rid!r} is already in the server")
        waiting = self.num_waiting()
        if waiting + len(items) > self.max_waiting_requests:
            raise QueueFull(waiting)
        streams = []
        for rid, ids, params in items:
            stream = RequestStream(rid, params.n, len(ids), time.monotonic(), stream=stream)
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
        self._forget_progress(request_id)
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
                except Exception as exc:  # validated by the handler already; be safe
                    stream = self.streams.pop(rid, None)
                    if stream is not None:
                        stream.finished = True
                        bad_input = isinstance(exc, ValueError)
                        stream.queue.put_nowait(exc if bad_input else EngineError(f"{type(exc).__name__}"))
                    continue
                stream = self.streams.get(rid)
                if stream is not None and stream.stream:
                    self._progress[rid] = _Progress(self.engine.tokenizer, params)
            else:
                try:
                    self.engine.abort_request(item[1])  # frees its blocks now
                except ValueError:
                    pass  # it finished in the step that just ran
                self._forget_progress(item[1])

    def _step_sync(self, tracked: dict[str, int]):
        """In the engine thread: one step, then the outputs of the requests that moved
        (the finished ones; partial ones for streamed requests only)."""
        engine = self.engine
        t0 = time.perf_counter()
        finished = engine.step()
        PROFILE.add("engine_step", time.perf_counter() - t0)
        if self.check_invariants:
            engine.check_invariants()
        t0 = time.perf_counter()
        rec = engine.trace.steps[-1]
        outs = {o.request_id: o for o in finished}
        moved = {_group_id(sid, tracked) for sid in rec.scheduled}
        for rid in moved:
            progress = self._progress.get(rid)
            if rid in tracked and rid not in outs and progress is not None:
                before = sum(map(len, progress.logprobs))
                out = partial_output(engine, rid, progress, self._piece)
                self.num_logprob_dicts += sum(map(len, progress.logprobs)) - before
                if out is not None:
                    outs[rid] = out
        PROFILE.add("detokenize", time.perf_counter() - t0)
        event = step_event(rec)
        event["requests"] = {
            rid: dict(engine.trace.requests[rid])
            for rid in list(rec.arrived_ids) + list(rec.finished_ids)
            if rid in engine.trace.requests
        }
        return event, outs

    def _reset_trace(self) -> None:
        old = self.engine.reset_trace()
        self.step_offset += len(old.steps)
        if not self.engine.has_unfinished_requests():  # idle: give freed memory back
            del old
            _release_memory()

    def _publish(self, event: dict) -> None:
        event["type"] = "step"
        event["step"] = self.step_offset + event["step"]
        event["time"] = time.time()
        self.num_steps += 1
        self._consecutive_failures = 0
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
                self._forget_progress(rid)
                if self.metrics is not None:
                    self.metrics.on_request_finished(out, now - stream.arrival)
                stream.queue.put_nowait(out)
            elif new > 0 and stream.stream:
                stream.queue.put_nowait(out)
                unread = getattr(stream.queue, "unread", {}).get(rid, 0)  # an asyncio.Queue: 0
                if unread >= self.max_unread_steps:  # the client reads nothing: let it go
                    self.abort(rid)
                    stream.queue.put_nowait(
                        StreamOverflow(
                            f"the client left {unread} steps of output unread; the request was aborted"
                        )
                    )

    def _forget_progress(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        """A step raised ``exc``: fail that step's requests (``LLMEngine.fail_step``: their
        blocks are freed and the scheduler's step reset), hand out the outputs it finished,
        and go on; if the recovery fails, or ``max_step_failures`` steps in a row failed,
        the engine is unusable (``dead``)."""
        msg = f"{type(exc).__name__}: {exc}"
        self.errors.append(msg)
        self._consecutive_failures += 1
        print(
            "minipaged serve: the engine step failed; its requests get an error\n"
            + "".join(traceback.format_exception(exc)),
            file=sys.stderr,
        )
        if self.metrics is not None:
            self.metrics.on_engine_error()
        # NOTE: called in the event-loop thread between steps (the failed one has ended),
        # so the engine is touched by one thread at a time, as everywhere else.
        try:
            outs = self.engine.fail_step(exc)
            if self.check_invariants:
                self.engine.check_invariants()
        except Exception as exc2:
            self._mark_dead(f"recovery from {msg} failed: {type(exc2).__name__}: {exc2}")
            return
        now = time.monotonic()
        for out in outs:
            stream = self.streams.pop(out.request_id, None)
            self._forget_progress(out.request_id)
            if stream is None or stream.finished:
                continue
            stream.finished = True
            if any(c.finish_reason == "abort" for c in out.outputs):
                stream.queue.put_nowait(EngineError("the engine failed while serving this request"))
            else:  # finished (or refused) by the failed step before it raised
                if self.metrics is not None:
                    self.metrics.on_request_finished(out, now - stream.arrival)
                stream.queue.put_nowait(out)
        queued = {item[1] for item in self._pending if item[0] == "add"}
        for rid, stream in list(self.streams.items()):
            if rid not in self.engine.groups and rid not in queued:  # its output was lost
                self.streams.pop(rid)
                self._forget_progress(rid)
                stream.finished = True
                stream.queue.put_nowait(EngineError("the engine failed while serving this request"))
        if self._consecutive_failures >= self.max_step_failures:
            self._mark_dead(f"{self._consecutive_failures} steps in a row failed, the last with {msg}")

    def _mark_dead(self, reason: str) -> None:
        """The engine is unusable: every request gets an error, new ones are refused."""
        self.dead = reason
        print(f"minipaged serve: the engine is unusable: {reason}", file=sys.stderr)
        for stream in list(self.streams.values()):
            stream.finished = True
            stream.queue.put_nowait(EngineError("the engine failed while serving this request"))
        for rid in list(self.engine.groups):
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
        # NOTE: whatever could not be aborted is dropped, so that the loop sleeps instead of
        # stepping an engine that cannot step (a dead engine serves nothing more)
        self.engine.groups.clear()
        self.streams.clear()
        self._progress.clear()
        self._pending.clear()


class AsyncMPEngine(AsyncEngine):
    """``AsyncEngine``'s interface over an engine core in its own process (vLLM v1's
    ``AsyncLLM`` over ``EngineCoreClient``): the same streams, queue limits, ``/trace``
    events and metrics; the loop here only *sends* (adds, aborts), and a reader thread
    turns each step's token ids into outputs (``FrontendOutputs``: detokenizing, stop
    strings, logprob dicts) while the core is already running its next step.

    A stop string found here is sent to the core as ``("stop", ...)``: the sequence is
    finished at the core's next step boundary, its blocks freed there. If the core process
    dies, every request gets ``EngineDead`` (503), ``dead`` says why (``/health`` 503) and
    ``on_core_death()`` is called once (the server shuts itself down)."""

    def __init__(self, client, **kwargs) -> None:
        from minipaged.engine.core_client import FrontendOutputs

        super().__init__(client, **kwargs)
        self._executor.shutdown(wait=False)  # NOTE: no engine thread: the core is a process
        self.client = client
        self.outputs = FrontendOutputs(client.tokenizer, client.eos_token_ids, self._piece)
        self._lock = threading.Lock()  # the outputs' state: the loop adds, the reader moves
        self._loop_ref: Optional[asyncio.AbstractEventLoop] = None
        self.core_died = False
        self.on_core_death = None  # called once when the core process dies

    async def start(self) -> None:
        self._loop_ref = asyncio.get_running_loop()
        await super().start()
        self.client.start_output_thread(self._on_message)

    async def shutdown(self) -> None:
        await super().shutdown()
        await asyncio.get_running_loop().run_in_executor(None, self.client.shutdown)

    # -- the loop: what handlers queued goes to the core, at once --------------------------
    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            adds, aborts = [], []
            while self._pending:
                item = self._pending.popleft()
                if item[0] == "add":
                    _, rid, ids, params = item
                    stream = self.streams.get(rid)
                    with self._lock:
                        self.outputs.add(rid, ids, params, stream is not None and stream.stream)
                    adds.append((rid, ids, params))
                else:
                    aborts.append(item[1])
            try:
                if adds:
                    self.client.send(("add", adds))
                if aborts:
                    self.client.send(("abort", aborts))
            except Exception:  # the core is gone: the reader thread reports it
                pass

    def _forget_progress(self, request_id: str) -> None:
        with self._lock:
            self.outputs.forget(request_id)

    # -- the reader thread -------------------------------------------------------------------
    def _on_message(self, msg) -> None:
        """In the reader thread: build the outputs, then hand them to the event loop."""
        kind = msg[0]
        loop = self._loop_ref
        try:
            # ("step", seqs, event, stats) or ("failed", error, seqs, stats, dead)
            if kind in ("step", "failed"):
                seqs = msg[1] if kind == "step" else msg[2]
                t0 = time.perf_counter()
                with self._lock:
                    outs, stops = self.outputs.process(seqs)
                PROFILE.add("detokenize", time.perf_counter() - t0)
                if stops:
                    try:
                        self.client.send(("stop", stops))
                    except Exception:
                        pass
                if kind == "step":
                    loop.call_soon_threadsafe(self._on_step, msg[2], outs, msg[3])
                else:
                    loop.call_soon_threadsafe(self._on_failed, msg[1], outs, msg[3], msg[4])
            elif kind == "idle":
                loop.call_soon_threadsafe(self._on_idle, msg[1])
            elif kind == "rejected":
                loop.call_soon_threadsafe(self._on_rejected, msg[1], msg[2])
            elif kind == "dead":
                loop.call_soon_threadsafe(self._on_core_dead, msg[1])
        except RuntimeError:  # the event loop is closed: the server is stopping
            pass

    def _on_step(self, event: dict, outs: dict, stats: dict) -> None:
        self.client.stats = stats
        self._publish(event)
        self._dispatch(outs)

    def _on_idle(self, stats: dict) -> None:
        self.client.stats = stats
        self._running_rids = set()
        if self.metrics is not None:
            self.metrics.on_idle(stats["num_free_blocks"], self.client.num_blocks)

    def _on_rejected(self, rid: str, message: str) -> None:
        self._forget_progress(rid)
        stream = self.streams.pop(rid, None)
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.queue.put_nowait(ValueError(message) if self.dead is None else EngineDead(message))

    def _on_failed(self, error: str, outs: dict, stats: dict, dead: Optional[str]) -> None:
        """A step failed in the core: its requests get an error, the others go on."""
        self.client.stats = stats
        self.errors.append(error)
        if self.metrics is not None:
            self.metrics.on_engine_error()
        ok = {}
        for rid, out in outs.items():
            if out.finished and any(c.finish_reason == "abort" for c in out.outputs):
                stream = self.streams.pop(rid, None)
                if stream is not None and not stream.finished:
                    stream.finished = True
                    stream.queue.put_nowait(EngineError("the engine failed while serving this request"))
            else:
                ok[rid] = out
        self._dispatch(ok)
        if dead is not None:
            self._fail_everything(dead, EngineError("the engine failed while serving this request"))

    def _on_core_dead(self, exitcode) -> None:
        if self.core_died:
            return
        self.core_died = True
        reason = f"the engine core process died (exit code {exitcode})"
        print(f"minipaged serve: {reason}; shutting down", file=sys.stderr, flush=True)
        if self.metrics is not None:
            self.metrics.on_engine_error()
        self._fail_everything(reason, EngineDead(f"{reason}; the server is shutting down"))
        if self.on_core_death is not None:
            self.on_core_death()

    def _fail_everything(self, reason: str, exc: Exception) -> None:
        self.dead = reason
        for stream in list(self.streams.values()):
            stream.finished = True
            stream.queue.put_nowait(exc)
        self.streams.clear()
        self._pending.clear()
        with self._lock:
            for rid in list(self.outputs.groups):
                self.outputs.forget(rid)
