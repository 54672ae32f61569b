"""The OpenAI-compatible HTTP server: ``minipaged serve``.

Mirrors vLLM ``vllm/entrypoints/openai/api_server.py`` (+ ``serving_completion.py``,
``serving_chat.py``) over today's vLLM (v1) ``AsyncLLM``: FastAPI routes in front of one
engine loop (``async_engine.py``).

Routes
    ``GET /v1/models``; ``POST /v1/completions`` and ``/v1/chat/completions``, streaming
    (Server-Sent Events, ``data: {...}`` then ``data: [DONE]``) or not; ``GET /metrics``
    (Prometheus text, ``metrics.py``); ``GET /trace`` (the live ``EngineTrace``: SSE of
    step events, or ``?format=json`` for the recent steps); ``GET /`` (the live page);
    ``GET /health``.
Invariants
    a client that disconnects (mid-stream or while waiting) has its request aborted and
    its KV blocks freed before the next engine step; one engine, touched only by the loop.
Failure mode
    every error is the OpenAI JSON shape (``protocol.error_body``), never a traceback:
    400 bad JSON / types / unknown fields / values (the message names the field), 404
    unknown model or route, 413 a body over ``max_body_bytes``, 503 + ``Retry-After`` when
    ``max_waiting_requests`` are already waiting, 500 "internal error" for an engine bug.
"""


# NOTE: no `from __future__ import annotations` here: FastAPI reads the route functions'
# annotations (`request: Request`) at definition time.
import argparse
import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Optional

from minipaged.entrypoints.openai.async_engine import AsyncEngine, EngineError, QueueFull

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


# -- streaming responses -----------------------------------------------------------------
def sse(data) -> str:
    """One Server-Sent Event: ``data: <json>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _sse_response_class():
    from starlette.responses import Response

    class SSEResponse(Response):
        """See ``SSEResponse``."""

        media_type = "text/event-stream"

        def __init__(self, events, on_close) -> None:
            self.events, self.on_close = events, on_close
            self.background = None
            self.status_code = 200
            self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

        __call__ = _SSEStream.__call__

    return SSEResponse


def SSEResponse(events: AsyncIterator[str], on_close: Callable[[], None]):
    """An ASGI response streaming ``events`` (see ``_SSEStream``)."""
    return _sse_response_class()(events, on_close)


class _SSEStream:
    """An ASGI response streaming ``events`` as text/event-stream.

    It listens for ``http.disconnect`` itself (whatever the ASGI spec version), stops the
    stream at once when the client goes, and always calls ``on_close()`` last.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ]})  # NOTE: the headers above, not self.raw_headers (no content-length)
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = {asyncio.create_task(stream()), asyncio.create_task(watch())}
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
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

    def __init__(self, engine, *, served_model_name: Optional[str] = None,
                 max_waiting_requests: int = 256, max_n: int = 16,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, check_invariants: bool = False,
                 trace_window: int = 512):
        from minipaged.entrypoints.openai.metrics import ServerMetrics

        if not isinstance(max_n, int) or max_n < 1:
            raise ValueError(f"max_n must be an int >= 1, got {max_n!r}")
        if not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an int >= 1024, got {max_body_bytes!r}")
        self.engine = engine
        self.model_name = served_model_name or engine.config.model or "minipaged-course-model"
        self.max_n = min(max_n, engine.config.max_num_seqs)
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(self.model_name)
        self.async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests,
                                        check_invariants=check_invariants, metrics=self.metrics,
                                        trace_window=trace_window)
        self.created = int(time.time())

    # -- request parsing ---------------------------------------------------------------
    async def read_json(self, request) -> dict:
        """The body as a JSON object; 413 over the limit, 400 for anything not JSON."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        chunks, size = [], 0
        # NOTE: an over-long body is drained (not kept) before the 413, so the client
        # reads the answer instead of a reset; a body over 64x the limit is cut off.
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > 64 * limit:
                break
        if size > limit or (declared is not None and declared.isdigit() and int(declared) > limit):
            raise ApiError(413, f"request body of {size} bytes is over the limit of {limit} bytes")
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})")
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} "
                                f"column {e.colno}")
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
        return body

    def validate(self, cls, body: dict):
        from pydantic import ValidationError

        try:
            return cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                raise ApiError(400, f"unknown field {loc!r}", param=loc)
            raise ApiError(400, f"{loc}: {err['msg']}", param=loc or None)
        except ValueError as e:
            raise ApiError(400, str(e))

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model")

    def make_params(self, req, prompt_len: int, default_max_tokens: int):
        from minipaged.sampling_params import SamplingParams

        if req.n > self.max_n:
            raise ApiError(400, f"n must be <= {self.max_n} on this server, got {req.n}", "n")
        try:
            kw = req.to_sampling_kwargs(default_max_tokens)
            params = SamplingParams(**kw)
        except ValueError as e:
            raise ApiError(400, str(e))
        limit = self.engine.max_model_len
        if prompt_len + params.max_tokens > limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{prompt_len + params.max_tokens} ({prompt_len} in the prompt, max_tokens="
                f"{params.max_tokens}); reduce the prompt or max_tokens",
                param="max_tokens",
            )
        return params

    def tokenize(self, prompt, param: str) -> tuple[Optional[str], list[int]]:
        try:
            return self.engine.tokenize(prompt, name=param)
        except ValueError as e:
            raise ApiError(400, str(e), param=param)

    def submit(self, params, ids: list[int]):
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            return self.async_engine.add_request(rid, ids, params)
        except QueueFull as e:
            raise ApiError(503, str(e), headers={"Retry-After": str(e.retry_after)})

    # -- running one request -------------------------------------------------------------
    async def final_output(self, request, stream):
        """Wait for the finished output; abort if the client disconnects first."""

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.create_task(disconnected())
        try:
            while True:
                get = asyncio.create_task(stream.queue.get())
                done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return None  # the client is gone
                item = get.result()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    return item
        finally:
            watch.cancel()
            self.async_engine.abort(stream.request_id)  # no-op once finished

    async def outputs(self, stream) -> AsyncIterator:
        """Each output of ``stream`` until the finished one."""
        while True:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


def _finish_reason(c) -> Optional[str]:
    if c.finish_reason == "refused":
        raise ApiError(400, f"the request can never fit in this server's KV cache: {c.stop_reason}")
    return c.finish_reason


class _Deltas:
    """The text each choice has not sent yet, safe to send now.

    Held back while unfinished: a trailing U+FFFD (a character whose bytes are split
    across tokens) and the last ``len(longest stop string) - 1`` characters (they may
    start a stop string that the engine will cut off).
    """

    def __init__(self, n: int, stop) -> None:
        stop = [stop] if isinstance(stop, str) else (stop or [])
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = [""] * n
        self.num_tokens = [0] * n

    def delta(self, c, finished: bool) -> tuple[str, list[int], list]:
        i, full = c.index, c.text
        if not finished:
            full = full.rstrip("\ufffd")
            if self.hold:
                full = full[: max(0, len(full) - self.hold)]
        sent = self.text[i]
        text = full[len(sent):] if full.startswith(sent) and len(full) > len(sent) else ""
        self.text[i] += text
        new_ids = c.token_ids[self.num_tokens[i]:]
        lps = getattr(c, "logprobs", None)
        new_lps = list(lps[self.num_tokens[i]:]) if lps else []
        self.num_tokens[i] = len(c.token_ids)
        return text, new_ids, new_lps


def _logprob_value(x) -> float:
    return float(getattr(x, "logprob", x))


def completion_logprobs(tokenizer, token_ids: list[int], lps: list, offset: int = 0) -> Optional[dict]:
    """The legacy completions ``logprobs`` object from the engine's per-token logprobs
    (``lps[i]``: {token_id: Logprob or float}, holding the sampled token)."""
    if not lps:
        return None
    tokens, token_lps, top, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps):
        piece = tokenizer.decode([tid])
        offsets.append(offset)
        offset += len(piece)
        tokens.append(piece)
        token_lps.append(_logprob_value(d[tid]) if tid in d else None)
        top.append({tokenizer.decode([t]): _logprob_value(v) for t, v in d.items()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], lps: list, top_n: int) -> Optional[dict]:
    if not lps:
        return None
    content = []
    for tid, d in zip(token_ids, lps):
        piece = tokenizer.decode([tid])
        ranked = sorted(d.items(), key=lambda kv: -_logprob_value(kv[1]))[:top_n]
        content.append({
            "token": piece, "logprob": _logprob_value(d[tid]) if tid in d else None,
            "bytes": list(piece.encode()),
            "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": _logprob_value(v),
                              "bytes": list(tokenizer.decode([t]).encode())} for t, v in ranked],
        })
    return {"content": content}


def _usage(prompt_len: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
            "total_tokens": prompt_len + completion_tokens}


def build_app(engine, **serving_kwargs):
    """The FastAPI app over ``engine`` (an ``LLMEngine``); see ``OpenAIServing`` for options."""
    from fastapi import FastAPI, Request  # NOTE: imported here so `minipaged --help` stays light
    from fastapi.responses import HTMLResponse, JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from minipaged.entrypoints.openai.live import LIVE_PAGE
    from minipaged.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        error_body,
        render_chat,
    )

    serving = OpenAIServing(engine, **serving_kwargs)
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app):
        await serving.async_engine.start()
        try:
            yield
        finally:
            await serving.async_engine.shutdown()

    app = FastAPI(title="minipaged", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.serving = serving

    def error(status: int, message: str, param=None, headers=None) -> JSONResponse:
        return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, exc):  # NOTE: the traceback goes to the log, not the client
        return error(500, "internal server error")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": serving.model_name, "object": "model", "created": serving.created,
            "owned_by": "minipaged", "root": serving.model_name,
            "max_model_len": engine.max_model_len,
        }]}

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def live_page():
        return HTMLResponse(LIVE_PAGE)

    @app.get("/trace")
    async def trace(request: Request, format: str = "sse", history: int = 64):
        ae = serving.async_engine
        if format not in ("sse", "json"):
            raise ApiError(400, f"format must be 'sse' or 'json', got {format!r}", "format")
        if history < 0:
            raise ApiError(400, f"history must be >= 0, got {history}", "history")
        recent = list(ae.recent_steps)[-history:] if history else []
        if format == "json":
            return {"config": ae.trace_header(), "steps": recent}
        q = ae.subscribe()

        async def events():
            yield sse(ae.trace_header())
            last = -1
            for ev in recent:
                last = ev["step"]
                yield sse(ev)
            while True:
                ev = await q.get()
                if ev is None:
                    return
                if ev["step"] > last:
                    yield sse(ev)

        return SSEResponse(events(), lambda: ae.unsubscribe(q))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = serving.validate(CompletionRequest, await serving.read_json(request))
        serving.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: a list of several prompts is not supported; send "
                                    "one request per prompt", "prompt")
            prompt = prompt[0]
        if req.echo:
            raise ApiError(400, "echo is not supported", "echo")
        _, ids = serving.tokenize(prompt, "prompt")
        params = serving.make_params(req, len(ids), DEFAULT_COMPLETION_MAX_TOKENS)
        stream = serving.submit(params, ids)
        created, model = int(time.time()), serving.model_name
        head = {"id": stream.request_id, "object": "text_completion", "created": created,
                "model": model}
        if not req.stream:
            out = await serving.final_output(request, stream)
            if out is None:
                return Response(status_code=499)
            choices = []
            for c in out.outputs:
                reason = _finish_reason(c)
                choices.append({"index": c.index, "text": c.text, "finish_reason": reason,
                                "stop_reason": c.stop_reason,
                                "logprobs": completion_logprobs(tokenizer, c.token_ids,
                                                                getattr(c, "logprobs", None))})
            ntok = sum(len(c.token_ids) for c in out.outputs)
            return {**head, "choices": choices, "usage": _usage(len(ids), ntok)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        deltas = _Deltas(params.n, getattr(params, "stop", None))

        async def events():
            ntok = 0
            try:
                async for out in serving.outputs(stream):
                    choices = []
                    for c in out.outputs:
                        done = c.finish_reason is not None
                        reason = _finish_reason(c) if done else None
                        offset = len(deltas.text[c.index])
                        text, new_ids, new_lps = deltas.delta(c, done)
                        if not text and not done and not new_lps:
                            continue
                        choices.append({"index": c.index, "text": text, "finish_reason": reason,
                                        "stop_reason": c.stop_reason if done else None,
                                        "logprobs": completion_logprobs(tokenizer, new_ids,
                                                                        new_lps, offset)})
                    ntok = sum(len(c.token_ids) for c in out.outputs)
                    if choices:
                        yield sse({**head, "choices": choices})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(len(ids), ntok)})
            except (ApiError, EngineError, ValueError) as e:
                status = e.status if isinstance(e, ApiError) else 500
                yield sse(error_body(getattr(e, "message", str(e)), status))
            yield sse("[DONE]")

        return SSEResponse(events(), lambda: serving.async_engine.abort(stream.request_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = serving.validate(ChatCompletionRequest, await serving.read_json(request))
        serving.check_model(req.model)
        prompt = render_chat(req.messages, tokenizer)
        _, ids = serving.tokenize(prompt, "messages")
        try:
            top_n = req._logprobs() or 0
        except ValueError as e:
            raise ApiError(400, str(e), "top_logprobs")
        params = serving.make_params(req, len(ids), engine.max_model_len - len(ids))
        stream = serving.submit(params, ids)
        created, model = int(time.time()), serving.model_name
        head = {"id": stream.request_id.replace("cmpl-", "chatcmpl-"), "created": created,
                "model": model}
        if not req.stream:
            out = await serving.final_output(request, stream)
            if out is None:
                return Response(status_code=499)
            choices = []
            for c in out.outputs:
                reason = _finish_reason(c)
                choices.append({
                    "index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": reason, "stop_reason": c.stop_reason,
                    "logprobs": chat_logprobs(tokenizer, c.token_ids,
                                              getattr(c, "logprobs", None), top_n),
                })
            ntok = sum(len(c.token_ids) for c in out.outputs)
            return {**head, "object": "chat.completion", "choices": choices,
                    "usage": _usage(len(ids), ntok)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        deltas = _Deltas(params.n, getattr(params, "stop", None))
        head = {**head, "object": "chat.completion.chunk"}

        async def events():
            ntok = 0
            try:
                yield sse({**head, "choices": [
                    {"index": j, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None} for j in range(params.n)]})
                async for out in serving.outputs(stream):
                    choices = []
                    for c in out.outputs:
                        done = c.finish_reason is not None
                        reason = _finish_reason(c) if done else None
                        text, new_ids, new_lps = deltas.delta(c, done)
                        if not text and not done and not new_lps:
                            continue
                        choices.append({"index": c.index,
                                        "delta": {"content": text} if text else {},
                                        "logprobs": chat_logprobs(tokenizer, new_ids, new_lps, top_n),
                                        "finish_reason": reason,
                                        "stop_reason": c.stop_reason if done else None})
                    ntok = sum(len(c.token_ids) for c in out.outputs)
                    if choices:
                        yield sse({**head, "choices": choices})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(len(ids), ntok)})
            except (ApiError, EngineError, ValueError) as e:
                status = e.status if isinstance(e, ApiError) else 500
                yield sse(error_body(getattr(e, "message", str(e)), status))
            yield sse("[DONE]")

        return SSEResponse(events(), lambda: serving.async_engine.abort(stream.request_id))

    return app


# -- running it ----------------------------------------------------------------------------
class BackgroundServer:
    """``minipaged serve`` in a thread of this process (tests, notebooks).

    ``BackgroundServer(engine, port=0).start()`` binds 127.0.0.1 on a free port; ``.url``
    is its base URL, ``.serving`` the ``OpenAIServing``; ``.stop()`` ends it (also on
    ``with``). Loopback only unless ``host`` says otherwise.
    """

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 **serving_kwargs) -> None:
        import uvicorn

        self.app = build_app(engine, **serving_kwargs)
        self.serving: OpenAIServing = self.app.state.serving
        config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.host = host
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread = threading.Thread(target=self.server.run, name="minipaged-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self.server.should_exit = True
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "BackgroundServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from minipaged.config import EngineConfig

    d = EngineConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for a classroom)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="the model id clients send")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests not yet running before new ones get 503 + Retry-After")
    g.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    g.add_argument("--check-invariants", action="store_true",
                   help="run LLMEngine.check_invariants() after every step (slow; for tests)")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    g.add_argument("--log-level", default="info")
    e = parser.add_argument_group("engine")
    e.add_argument("--model", default=None, help="a local HF folder or hub id (default: the course model)")
    e.add_argument("--block-size", type=int, default=d.block_size)
    e.add_argument("--num-blocks", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    e.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--enable-prefix-caching", action="store_true")
    e.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    e.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"])
    e.add_argument("--attention-backend", default=d.attention_backend, choices=["torch", "triton"])
    e.add_argument("--device", default=d.device)
    e.add_argument("--dtype", default=d.dtype)
    e.add_argument("--seed", type=int, default=d.seed)


ENGINE_ARGS = ("model", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
               "max_model_len", "enable_prefix_caching", "enable_chunked_prefill",
               "preemption_mode", "attention_backend", "device", "dtype", "seed")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import LLMEngine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        engine = LLMEngine(EngineConfig(**{k: getattr(args, k) for k in ENGINE_ARGS}))
        app = build_app(engine, served_model_name=args.served_model_name,
                        max_waiting_requests=args.max_waiting_requests, max_n=args.max_n,
                        max_body_bytes=args.max_body_bytes, check_invariants=args.check_invariants)
    except ValueError as e:
        print(f"minipaged serve: {e}")
        return 2
    print(f"minipaged serve: {app.state.serving.model_name} on http://{args.host}:{args.port} "
          f"(live view at /, metrics at /metrics)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="minipaged serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
