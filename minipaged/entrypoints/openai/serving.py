"""The request path shared by the routes: parse, validate, submit, stream the answer.

Mirrors vLLM ``vllm/entrypoints/openai/serving_engine.py`` (+ the delta logic of
``serving_completion.py`` / ``serving_chat.py``).

Inputs
    a raw HTTP request (``read_json`` -> dict, ``validate`` -> a ``protocol`` model), then
    each prompt's token ids and ``SamplingParams`` (``make_params``) -> one
    ``RequestStream`` per prompt, all on one queue, joining the same engine step
    (``submit_all``). Outputs: the final ``RequestOutput`` of each (``final_outputs``), or
    their text deltas (``TextDeltas``) for Server-Sent Events (``sse_events``,
    ``SSEResponse``), choice ``j`` of prompt ``p`` numbered ``p * n + j`` as in vLLM.
Invariants
    text sent so far is always a prefix of the final text (``TextDeltas`` holds back what may
    still change); when the client is gone or one prompt fails, every prompt's request is
    aborted (``final_outputs``, ``SSEResponse.on_close``), so no block stays held.
Off the event loop, or on it in slices
    tokenizing a prompt (and rendering a chat template) and detokenizing an echoed token-id
    prompt run in one worker thread (``run_off_loop``); a non-streamed answer is built and
    serialized on the loop in slices of a few milliseconds (``json_response``,
    ``sliced_*_logprobs``, ``json_pieces``; as vLLM's output handler works in chunks,
    ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``), so one request's big prompt or many logprobs
    never freeze the other streams; a short prompt (at most ``INLINE_PROMPT_CHARS`` characters, or token
    ids) is tokenized on the loop itself: tens of microseconds, less than the two thread
    hops it saves on the way to the first token; per streamed step the loop only slices what is new (``TextDeltas``) and
    writes it, token texts coming decoded with the logprobs.
Limits (checked before any work that grows with them)
    the body (``max_body_bytes``, and ``body_timeout`` seconds to arrive in full: a lying
    ``Content-Length`` or an endless chunked body is answered 408 and the connection
    closed), a prompt's characters before tokenizing (``max_prompt_chars``, default 32 per
    token of the context), ``n <= max_n``, ``logprobs <= max_logprobs`` (vLLM's
    ``--max-logprobs``, 20), and the ``SamplingParams`` bounds.
Failure mode
    ``ApiError(status, message, param)``: the routes answer it in the OpenAI error shape.
    ``TypeError``, ``RecursionError`` and ``ValueError`` from parsing, validating or
    tokenizing are a 400 naming the field, never a 500; an unusable engine is a 503.
"""

import asyncio
import contextvars
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Optional

from starlette.responses import Response

from minipaged.engine.async_llm import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_MAX_UNREAD_TOKENS,
    DEFAULT_UNREAD_TIMEOUT,
    AsyncLLM,
    EngineDead,
    EngineError,
    OutputQueue,
    QueueFull,
    StreamOverflow,
)
from minipaged.entrypoints.openai.profile import PROFILE
from minipaged.entrypoints.openai.protocol import error_body

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a request body larger than this gets 413
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a whole request body to arrive
# NOTE: a prompt longer than this many characters per context token cannot fit: refused
# before the tokenizer sees it (tokenizers' longest tokens are far shorter)
PROMPT_CHARS_PER_TOKEN = 32
# NOTE: prompts (characters, or token ids) up to this size are tokenized on the event loop:
# a fast tokenizer takes ~0.1 ms for them, less than a round trip through the worker thread
INLINE_PROMPT_CHARS = 2048
DEFAULT_SHUTDOWN_GRACE = 5.0  # seconds requests in flight may finish after SIGTERM
# NOTE: the most list items or object members one json.dumps call encodes (json_pieces):
# json.dumps holds the GIL for the whole call, so a big answer in one call stalls the loop
JSON_PIECE_ITEMS = 512
LOOP_SLICE_SECONDS = 0.005  # the longest stretch a big answer is built on the loop at once
LOGPROB_SLICE_TOKENS = 32  # tokens of logprobs turned into JSON objects per slice


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


# -- streaming responses -----------------------------------------------------------------
def sse(data) -> str:
    """One Server-Sent Event: ``data: <json>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# set by an SSEResponse that ends unfinished on purpose (a dropped unread stream), in the
# request's context, which uvicorn's request cycle shares: its "ASGI callable returned without
# completing response." error, logged next, would be a false alarm (the drop is counted in /metrics)
_DROPPING_STREAM = contextvars.ContextVar("minipaged_dropping_stream", default=False)


class _DroppedStreamFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_DROPPING_STREAM.get() and record.getMessage().startswith("ASGI callable returned"))


def quiet_dropped_streams() -> None:
    """Keep uvicorn from logging a deliberately dropped stream as an error (idempotent; call it
    after uvicorn configured its loggers, which resets them)."""
    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DroppedStreamFilter) for f in log.filters):
        log.addFilter(_DroppedStreamFilter())


class SSEResponse(Response):
    """Streams ``events`` (strings) as text/event-stream.

    It listens for ``http.disconnect`` itself (whatever the ASGI spec version), stops the
    stream at once when the client goes, and always calls ``on_close()`` last. When
    ``dropped`` is set (the engine let go of output the client left unread), the response
    ends unfinished: the server closes the connection, without uvicorn's error line for it
    (``quiet_dropped_streams``: the drop is by design, and counted in ``/metrics``).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[], None],
        dropped: Optional[asyncio.Event] = None,
    ) -> None:
        self.events, self.on_close, self.dropped = events, on_close, dropped
        self.background = None
        self.status_code = 200
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = {asyncio.create_task(stream()), asyncio.create_task(watch())}
        drop = None if self.dropped is None else asyncio.create_task(self.dropped.wait())
        if drop is not None:  # NOTE: the client reads nothing: its connection is closed
            tasks.add(drop)
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if drop in done:
                _DROPPING_STREAM.set(True)  # ends unfinished: uvicorn closes the connection
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                if not t.cancelled() and isinstance(t.exception(), OSError):
                    pass  # the client went away while we wrote
                elif not t.cancelled() and t.exception() is not None:
                    raise t.exception()
        finally:
            for t in tasks:
                t.cancel()
            try:
                await self.events.aclose()
            finally:
                self.on_close()


# -- the app -------------------------------------------------------------------------------
class OpenAIServing:
    """Shared by the routes: the engine, its loop, limits, and the response builders."""

    def __init__(
        self,
        engine,
        *,
        served_model_name: Optional[str] = None,
        max_waiting_requests: int = 256,
        max_n: int = 16,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        check_invariants: bool = False,
        trace_window: int = 512,
        max_logprobs: int = 20,
        max_prompt_chars: Optional[int] = None,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        max_unread_steps: int = 256,
        max_step_failures: int = 3,
        enable_trace: bool = True,
        unread_timeout: float = DEFAULT_UNREAD_TIMEOUT,
        max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS,
        stream_interval: int = 1,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
    ):
        from concurrent.futures import ThreadPoolExecutor

        from minipaged.entrypoints.openai.metrics import ServerMetrics
        from minipaged.sampling_params import MAX_LOGPROBS

        if not isinstance(max_n, int) or max_n < 1:
            raise ValueError(f"max_n must be an int >= 1, got {max_n!r}")
        if not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an int >= 1024, got {max_body_bytes!r}")
        if not isinstance(max_logprobs, int) or not 0 <= max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be an int in [0, {MAX_LOGPROBS}], got {max_logprobs!r}")
        if max_prompt_chars is None:
            max_prompt_chars = PROMPT_CHARS_PER_TOKEN * engine.max_model_len
        if not isinstance(max_prompt_chars, int) or max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be an int >= 1, got {max_prompt_chars!r}")
        if not isinstance(body_timeout, (int, float)) or not body_timeout > 0:
            raise ValueError(f"body_timeout must be a number of seconds > 0, got {body_timeout!r}")
        if not isinstance(health_timeout, (int, float)) or not health_timeout > 0:
            raise ValueError(f"health_timeout must be a number of seconds > 0, got {health_timeout!r}")
        self.health_timeout = float(health_timeout)
        self.max_logprobs = max_logprobs
        self.max_prompt_chars = max_prompt_chars
        self.body_timeout = float(body_timeout)
        self.enable_trace = bool(enable_trace)
        # tokenizing, detokenizing and building non-streamed answers: off the event loop
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="minipaged-tokenizer")
        self.engine = engine
        self.model_name = served_model_name or engine.config.model or "minipaged-course-model"
        self.max_n = min(max_n, engine.config.max_num_seqs)
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(self.model_name)
        # NOTE: an engine core in its own process (an MPClient: minipaged serve's default), or
        # an LLMEngine whose core steps in a thread of this process
        self.engine_client = AsyncLLM(
            engine,
            profile=PROFILE,
            max_waiting_requests=max_waiting_requests,
            check_invariants=check_invariants,
            metrics=self.metrics,
            trace_window=trace_window,
            max_unread_steps=max_unread_steps,
            max_step_failures=max_step_failures,
            unread_timeout=unread_timeout,
            max_unread_tokens=max_unread_tokens,
            stream_interval=stream_interval,
        )
        self.created = int(time.time())

    async def run_off_loop(self, fn, *args):
        """``fn(*args)`` in the worker thread (tokenizer, detokenizer, JSON of big answers)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def json_response(self, build) -> Response:
        """The JSON of ``await build()``, serialized on the event loop in slices of about
        ``LOOP_SLICE_SECONDS`` (``json_pieces``), the other streams served in between.

        NOTE: not in a worker thread: ``json.dumps`` holds the GIL for the whole call (a
        second for 16 x 480 tokens of 20 logprobs), and a thread doing Python work takes
        the GIL for a switch interval each time the loop gives it up (every socket write);
        on the loop in slices no stream waits more than one slice. ``build`` awaits
        ``sliced_*_logprobs`` likewise."""
        obj = await build()
        parts, t0 = [], time.perf_counter()
        for piece in json_pieces(obj):
            parts.append(piece)
            if time.perf_counter() - t0 > LOOP_SLICE_SECONDS:
                await yield_to_others()
                t0 = time.perf_counter()
        return Response("".join(parts).encode(), media_type="application/json")

    def close(self) -> None:
        self._worker.shutdown(wait=False)

    # -- request parsing ---------------------------------------------------------------
    async def read_json(self, request) -> dict:
        """The body as a JSON object; 413 over the limit, 408 if it does not arrive in
        ``body_timeout`` seconds, 400 for anything not JSON (too deep included)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > 64 * limit:
            raise ApiError(413, f"request body of {declared} bytes is over the limit of {limit} bytes")
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            # NOTE: an over-long body is drained (not kept) before the 413, so the client
            # reads the answer instead of a reset; a body over 64x the limit is cut off.
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                elif size > 64 * limit:
                    break

        try:
            await asyncio.wait_for(read(), self.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {self.body_timeout:g} s",
                headers={"Connection": "close"},
            )
        if size > limit or (declared is not None and declared.isdigit() and int(declared) > limit):
            raise ApiError(413, f"request body of {size} bytes is over the limit of {limit} bytes")
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})")
        t0 = time.perf_counter()
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise ApiError(
                400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
            )
        except RecursionError:
            field = _deep_field(text)
            where = f"{field} is" if field else "request body is"
            raise ApiError(400, f"{where} nested too deeply to parse", field)
        except ValueError as e:  # e.g. an integer over Python's 4300-digit limit
            raise ApiError(400, f"request body is not valid JSON here: {e}")
        finally:
            PROFILE.add("parse", time.perf_counter() - t0)
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
        return body

    def validate(self, cls, body: dict):
        from pydantic import ValidationError

        try:
            with PROFILE.timed("parse"):
                return cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                raise ApiError(400, f"unknown field {loc!r}", param=loc)
            raise ApiError(400, f"{loc}: {err['msg']}", param=loc or None)
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply")
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e))

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
            )

    def make_params(self, req, prompt_len: int, default_max_tokens: int, name: str = "prompt"):
        """``SamplingParams`` of ``req`` for a prompt of ``prompt_len`` tokens (``name`` says
        which prompt in errors); 400 if the prompt and ``max_tokens`` overflow the context."""
        from minipaged.sampling_params import SamplingParams

        if req.n > self.max_n:
            raise ApiError(400, f"n must be <= {self.max_n} on this server, got {req.n}", "n")
        try:
            kw = req.to_sampling_kwargs(default_max_tokens)
            params = SamplingParams(**kw)
        except (ValueError, TypeError, OverflowError) as e:
            raise ApiError(400, str(e), _field_of(str(e)))
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            field = "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs"
            raise ApiError(
                400,
                f"{field}={params.logprobs} is over this server's max_logprobs={self.max_logprobs}",
                field,
            )
        vocab = self.engine_client.model_info.vocab_size
        if params.top_k > vocab:
            raise ApiError(
                400,
                f"top_k must be at most the vocabulary ({vocab}), or 0 / -1 for off; got {params.top_k}",
                "top_k",
            )
        limit = self.engine.max_model_len
        if prompt_len + params.max_tokens > limit:
            which = "" if name == "prompt" else f" for {name}"
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens; the request asks{which} for "
                f"{prompt_len + params.max_tokens} ({prompt_len} in the prompt, max_tokens="
                f"{params.max_tokens}); reduce the prompt or max_tokens",
                param="max_tokens",
            )
        return params

    def check_prompt_size(self, prompt, param: str) -> None:
        """400 for a prompt that cannot fit, by its size alone (before tokenizing)."""
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise ApiError(
                400,
                f"{param} has {len(prompt)} characters; this server takes at most {self.max_prompt_chars} "
                f"(the context is {self.engine.max_model_len} tokens)",
                param=param,
            )
        if isinstance(prompt, list) and len(prompt) > self.engine.max_model_len:
            raise ApiError(
                400,
                f"{param} has {len(prompt)} tokens, longer than the model's context "
                f"(max_model_len={self.engine.max_model_len})",
                param=param,
            )

    def _tokenize_sync(self, prompt, param: str):
        try:
            with PROFILE.timed("tokenize"):
                return self.engine_client.tokenize(prompt, name=param)
        except (ValueError, TypeError, RecursionError, UnicodeError) as e:
            # NOTE: a lone surrogate ("\ud800") makes the tokenizer raise TypeError
            msg = str(e) if isinstance(e, ValueError) else f"{param} cannot be tokenized: {type(e).__name__}"
            if isinstance(e, TypeError) and isinstance(prompt, str) and _has_surrogate(prompt):
                msg = f"{param} holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text"
            return ApiError(400, msg, param=param)

    async def tokenize(self, prompt, param: str) -> tuple[Optional[str], list[int]]:
        """(text, token ids) of one prompt, tokenized in the worker thread; 400 naming
        ``param`` for a prompt that is too big, empty, or not text."""
        self.check_prompt_size(prompt, param)
        if len(prompt) <= INLINE_PROMPT_CHARS:
            out = self._tokenize_sync(prompt, param)
        else:
            out = await self.run_off_loop(self._tokenize_sync, prompt, param)
        if isinstance(out, ApiError):
            raise out
        return out

    async def render_and_tokenize(self, messages, tokenizer) -> tuple[str, list[int]]:
        """The chat prompt of ``messages`` and its token ids, off the event loop."""
        from minipaged.entrypoints.openai.protocol import render_chat

        total = sum(len(m.text()) for m in messages)
        if total > self.max_prompt_chars:
            raise ApiError(
                400,
                f"messages hold {total} characters; this server takes at most {self.max_prompt_chars}",
                param="messages",
            )

        def work():
            try:
                prompt = render_chat(messages, tokenizer)
            except (ValueError, TypeError, RecursionError) as e:
                return ApiError(400, f"messages cannot be rendered: {type(e).__name__}: {e}", "messages")
            return prompt, self._tokenize_sync(prompt, "messages")

        out = work() if total <= INLINE_PROMPT_CHARS else await self.run_off_loop(work)
        if isinstance(out, ApiError):
            raise out
        prompt, tok = out
        if isinstance(tok, ApiError):
            raise tok
        return prompt, tok[1]

    def submit(self, params, ids: list[int], stream: bool = True):
        """One request -> its ``RequestStream``."""
        return self.submit_all([(params, ids)], stream=stream)[0]

    def submit_all(self, items: list, request_id: Optional[str] = None, stream: bool = True) -> list:
        """Several ``(params, ids)`` -> their ``RequestStream``s, sharing one queue, all
        queued for the same engine step, or none (503 when the waiting queue cannot take
        them all). One prompt is the engine request ``request_id``; several are
        ``{request_id}-{p}`` (as vLLM numbers them)."""
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        limit = self.engine_client.max_waiting_requests
        if len(items) > limit:
            raise ApiError(
                400,
                f"prompt holds {len(items)} prompts; this server takes at most {limit} in one request",
                "prompt",
            )
        rids = [rid] if len(items) == 1 else [f"{rid}-{p}" for p in range(len(items))]
        try:
            return self.engine_client.add_requests(
                [(r, ids, params) for r, (params, ids) in zip(rids, items)],
                queue=OutputQueue(self.engine_client.stream_interval),
                stream=stream,
            )
        except QueueFull as e:
            raise ApiError(503, str(e), headers={"Retry-After": str(e.retry_after)})
        except EngineDead as e:
            raise ApiError(503, str(e))

    def abort_all(self, streams) -> None:
        for stream in streams:
            self.engine_client.abort(stream.request_id)  # no-op once finished

    async def drain(self, grace: float, forced: Callable[[], bool] = lambda: False) -> int:
        """Shutting down: new requests get a 503 at once; those in flight may finish for
        ``grace`` seconds, then each still running is failed (``fail_requests``: an error
        event and ``[DONE]``, or a JSON 503). Returns how many were failed."""
        ae = self.engine_client
        ae.draining = True
        deadline = time.monotonic() + grace
        while ae.streams and time.monotonic() < deadline and not forced():
            await asyncio.sleep(0.02)
        return ae.fail_requests("the server is shutting down") if ae.streams else 0

    # -- /tokenize and /detokenize (vLLM's serving_tokenization.py) --------------------------
    async def tokenize_request(self, req) -> dict:
        """``/tokenize``: the ids of a ``prompt``, or of ``messages`` rendered as a chat
        prompt, with ``count``, ``max_model_len`` and (if asked) ``token_strs``."""
        from minipaged.entrypoints.openai.protocol import TokenizeChatRequest, render_chat

        tokenizer = self.engine_client.tokenizer
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        chat = isinstance(req, TokenizeChatRequest)
        size = sum(len(m.text()) for m in req.messages) if chat else len(req.prompt)
        param = "messages" if chat else "prompt"
        if size > self.max_prompt_chars:
            raise ApiError(
                400,
                f"{param} holds {size} characters; this server takes at most {self.max_prompt_chars}",
                param,
            )

        def work():
            try:
                if chat:
                    text = render_chat(
                        req.messages, tokenizer, req.add_generation_prompt, req.continue_final_message
                    )
                else:
                    text = req.prompt
                ids = list(tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"])
                strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            except (ValueError, TypeError, RecursionError, UnicodeError) as e:
                return ApiError(400, f"{param} cannot be tokenized: {type(e).__name__}: {e}", param)
            return ids, strs

        out = work() if size <= INLINE_PROMPT_CHARS else await self.run_off_loop(work)
        if isinstance(out, ApiError):
            raise out
        ids, strs = out
        # NOTE: as vLLM's TokenizeResponse; no context-length check (vLLM skips it for /tokenize)
        return {
            "count": len(ids),
            "max_model_len": self.engine_client.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    async def detokenize_request(self, req) -> dict:
        """``/detokenize``: ``{"prompt": text}`` of ``tokens`` (special tokens kept, as vLLM)."""
        tokenizer = self.engine_client.tokenizer
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        vocab = self.engine_client.model_info.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise ApiError(400, f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab})", "tokens")
        if len(req.tokens) <= INLINE_PROMPT_CHARS:
            return {"prompt": tokenizer.decode(req.tokens)}
        return {"prompt": await self.run_off_loop(tokenizer.decode, req.tokens)}

    # -- running requests ----------------------------------------------------------------
    async def final_output(self, request, stream):
        """Wait for the finished output of one request (None if the client went away)."""
        outs = await self.final_outputs(request, [stream])
        return None if outs is None else outs[0]

    async def final_outputs(self, request, streams) -> Optional[list]:
        """The finished output of each stream, in order; ``None`` (all aborted) if the
        client disconnects first. Every stream is aborted on the way out (a no-op for the
        finished ones), so an error in one leaves nothing of the others in the engine."""

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.create_task(disconnected())
        try:
            done: dict = {}
            items = self.outputs(streams)
            while True:
                get = asyncio.create_task(anext(items, None))
                finished, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if get not in finished:
                    get.cancel()
                    await asyncio.gather(get, return_exceptions=True)
                    return None  # the client is gone
                item = get.result()
                if item is None:
                    return [done[p] for p in range(len(streams))]
                p, out = item
                if out.finished:
                    done[p] = out
        finally:
            watch.cancel()
            self.abort_all(streams)

    async def outputs(self, streams) -> AsyncIterator:
        """``(p, output)`` for each output of each of ``streams`` (one shared queue), in the
        order the engine made them, until every one has sent its finished output."""
        index = {s.request_id: p for p, s in enumerate(streams)}
        queue = streams[0].queue
        left = set(index)
        while left:
            item = await queue.get()
            if isinstance(item, ValueError):  # refused by the engine: the caller's input
                raise ApiError(400, str(item))
            if isinstance(item, EngineDead):  # the engine core process died mid-request
                raise ApiError(503, str(item))
            if isinstance(item, StreamOverflow):
                raise ApiError(408, str(item))
            if isinstance(item, BaseException):
                raise item
            p = index[item.request_id]
            if item.finished and len(streams) > 1:
                for c in item.outputs:  # one prompt refused: the whole request fails now
                    if c.finish_reason == "refused":
                        raise ApiError(
                            400,
                            f"prompt[{p}] can never fit in this server's KV cache: {c.stop_reason}",
                            f"prompt[{p}]",
                        )
            yield p, item
            if item.finished:
                left.discard(item.request_id)

    async def sse_events(
        self,
        streams,
        head: dict,
        params,
        prompt_lens: list[int],
        include_usage: bool,
        choice: Callable,
        first: Optional[list] = None,
        echo: Optional[list[str]] = None,
    ) -> AsyncIterator[str]:
        """The Server-Sent Events of one streamed answer: ``head`` + ``choices`` per step
        with new text, ``choice(index, text, token_ids, logprobs, offset, finish_reason,
        stop_reason)`` building each; then the usage (if asked, summed over all prompts)
        and ``[DONE]``. Choice ``j`` of prompt ``p`` is ``index = p * n + j``. With
        ``echo`` (each prompt's text), a choice's first chunk starts with its prompt. A step
        that gave a choice tokens is an event even when their text is held back (as vLLM's:
        every sampled token leaves as its step ends). An error after the headers went out
        is one event in the OpenAI error shape, then ``[DONE]``."""
        n = params.n
        deltas = [TextDeltas(n, getattr(params, "stop", None)) for _ in streams]
        ntok = [0] * len(streams)
        echoed: set[int] = set()
        try:
            if first:
                yield sse({**head, "choices": first})
            async for p, out in self.outputs(streams):
                t0 = time.perf_counter()
                choices = []
                for c in out.outputs:
                    i = p * n + c.index
                    done = c.finish_reason is not None
                    reason = finish_reason_of(c) if done else None
                    stop_reason = c.stop_reason if done else None
                    offset = deltas[p].sent[c.index]
                    text, new_ids, new_lps = deltas[p].delta(c, done)
                    if echo is not None and i not in echoed:
                        echoed.add(i)
                        text = echo[p] + text
                    if text or done or new_ids:
                        choices.append(choice(i, text, new_ids, new_lps, offset, reason, stop_reason))
                ntok[p] = sum(len(c.token_ids) for c in out.outputs)
                if choices:
                    chunk = sse({**head, "choices": choices})
                    PROFILE.add("sse", time.perf_counter() - t0)
                    yield chunk
                else:
                    PROFILE.add("sse", time.perf_counter() - t0)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_of(sum(prompt_lens), sum(ntok))})
        except ApiError as e:
            yield sse(error_body(e.message, e.status, e.param))
        except EngineError as e:
            yield sse(error_body(str(e), 500))
        yield sse("[DONE]")


def finish_reason_of(c) -> Optional[str]:
    if c.finish_reason == "refused":
        raise ApiError(400, f"the request can never fit in this server's KV cache: {c.stop_reason}")
    return c.finish_reason


class TextDeltas:
    """The text each choice has not sent yet, safe to send now.

    Held back while unfinished: a trailing U+FFFD (a character whose bytes are split
    across tokens) and the last ``len(longest stop string) - 1`` characters (they may
    start a stop string that the engine will cut off). ``sent[i]``: characters of choice
    ``i`` sent so far. Each call costs what is new, not the text so far (indices, no
    copies of the whole text).
    """

    def __init__(self, n: int, stop) -> None:
        stop = [stop] if isinstance(stop, str) else (stop or [])
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = [0] * n
        self.num_tokens = [0] * n

    def delta(self, c, finished: bool) -> tuple[str, list[int], list]:
        i, full = c.index, c.text
        sent, end = self.sent[i], len(full)
        if not finished:
            while end > sent and full[end - 1] == "\ufffd":
                end -= 1
            end -= self.hold
        text = full[sent:end] if end > sent else ""
        self.sent[i] += len(text)
        num = len(c.token_ids)
        new_ids = c.token_ids[self.num_tokens[i] :]
        lps = getattr(c, "logprobs", None)
        # NOTE: bounded by the tokens of this output: the engine may be extending the list
        new_lps = list(lps[self.num_tokens[i] : num]) if lps else []
        self.num_tokens[i] = num
        return text, new_ids, new_lps


def _logprob_value(x) -> float:
    return float(getattr(x, "logprob", x))


def _piece(tokenizer, token_id: int, lp=None) -> str:
    """A token's text: the one decoded with its logprob (the output processor) when there is one."""
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else tokenizer.decode([token_id])


def _field_of(message: str) -> Optional[str]:
    """The field a ``SamplingParams`` error message starts with (its first word)."""
    head = message.split(" ", 1)[0].split("=", 1)[0].rstrip(":")
    return head if head.isidentifier() else None


_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:]')


def _deep_field(text: str, depth_limit: int = 64) -> Optional[str]:
    """The top-level key of a JSON object text under which nesting first passes
    ``depth_limit`` (to name the field of a body too deep for ``json.loads``)."""
    depth, key, last = 0, None, None
    for m in _JSON_TOKENS.finditer(text):
        t = m.group()
        if t in ("[", "{"):
            depth += 1
            if depth > depth_limit:
                return key
        elif t in ("]", "}"):
            depth -= 1
        elif t == ":":
            if depth == 1:
                key = last
        elif depth == 1:
            last = t[1:-1]
    return None


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def completion_logprobs(tokenizer, token_ids: list[int], lps: list, offset: int = 0) -> Optional[dict]:
    """The legacy completions ``logprobs`` object from the engine's per-token logprobs
    (``lps[i]``: {token_id: Logprob or float}, holding the sampled token)."""
    if not lps:
        return None
    tokens, token_lps, top, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps):
        piece = _piece(tokenizer, tid, d.get(tid))
        offsets.append(offset)
        offset += len(piece)
        tokens.append(piece)
        token_lps.append(_logprob_value(d[tid]) if tid in d else None)
        top.append({_piece(tokenizer, t, v): _logprob_value(v) for t, v in d.items()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}


async def yield_to_others() -> None:
    """Between two slices of a big answer: let the event loop serve the others.

    NOTE: a short sleep, not ``sleep(0)``: the loop must go idle (its ``select`` frees the
    GIL) for the thread that turns the engine core's messages into outputs to run; with
    ``sleep(0)`` the loop keeps the GIL and that thread waits for a forced switch."""
    await asyncio.sleep(0.001)


async def sliced_completion_logprobs(tokenizer, token_ids: list[int], lps: list) -> Optional[dict]:
    """``completion_logprobs`` of a whole answer, ``LOGPROB_SLICE_TOKENS`` tokens at a
    time with the event loop free in between (the same object)."""
    if not lps:
        return None
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset, step = 0, LOGPROB_SLICE_TOKENS
    for a in range(0, len(token_ids), step):
        part = completion_logprobs(tokenizer, token_ids[a : a + step], lps[a : a + step], offset)
        if part is None:
            break
        for k, v in part.items():
            out[k].extend(v)
        offset = part["text_offset"][-1] + len(part["tokens"][-1])
        await yield_to_others()
    return out


async def sliced_chat_logprobs(tokenizer, token_ids: list[int], lps: list, top_n: int) -> Optional[dict]:
    """``chat_logprobs`` of a whole answer, in slices (as ``sliced_completion_logprobs``)."""
    if not lps:
        return None
    content, step = [], LOGPROB_SLICE_TOKENS
    for a in range(0, len(token_ids), step):
        part = chat_logprobs(tokenizer, token_ids[a : a + step], lps[a : a + step], top_n)
        if part is None:
            break
        content.extend(part["content"])
        await yield_to_others()
    return {"content": content}


def chat_logprobs(tokenizer, token_ids: list[int], lps: list, top_n: int) -> Optional[dict]:
    if not lps:
        return None
    content = []
    for tid, d in zip(token_ids, lps):
        piece = _piece(tokenizer, tid, d.get(tid))
        ranked = sorted(d.items(), key=lambda kv: -_logprob_value(kv[1]))[:top_n]
        content.append(
            {
                "token": piece,
                "logprob": _logprob_value(d[tid]) if tid in d else None,
                "bytes": list(piece.encode("utf-8", "replace")),
                "top_logprobs": [
                    {
                        "token": (t_piece := _piece(tokenizer, t, v)),
                        "logprob": _logprob_value(v),
                        "bytes": list(t_piece.encode("utf-8", "replace")),
                    }
                    for t, v in ranked
                ],
            }
        )
    return {"content": content}


def usage_of(prompt_len: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_len + completion_tokens,
    }


def json_pieces(obj, limit: int = JSON_PIECE_ITEMS) -> Iterator[str]:
    """``json.dumps(obj)`` as strings (yielded one at a time) that join to exactly it,
    each from one ``json.dumps`` of at most about ``limit`` list items and object members,
    so the caller can pause between two. Objects with keys other than strings are encoded
    whole."""
    if not isinstance(obj, (list, dict)) or _fits(obj, limit):
        yield json.dumps(obj)
    elif isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            yield json.dumps(obj)
            return
        yield "{"
        for i, (k, v) in enumerate(obj.items()):
            yield f"{', ' if i else ''}{json.dumps(k)}: "
            yield from json_pieces(v, limit)
        yield "}"
    else:
        yield "["
        for i, v in enumerate(obj):
            if i:
                yield ", "
            yield from json_pieces(v, limit)
        yield "]"


def _fits(obj, limit: int) -> bool:
    """Whether ``obj`` holds at most ``limit`` list items and members, all levels (early exit)."""
    todo, count = [obj], 0
    while todo:
        x = todo.pop()
        if isinstance(x, (list, dict)):
            count += len(x)
            if count > limit:
                return False
            todo.extend(x.values() if isinstance(x, dict) else x)
    return True
