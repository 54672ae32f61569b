"""The OpenAI-compatible HTTP server: ``minipaged serve``.

Mirrors vLLM ``vllm/entrypoints/openai/api_server.py`` (+ ``serving_completion.py``,
``serving_chat.py``) over today's vLLM (v1) ``AsyncLLM``: FastAPI routes in front of one
engine's frontend (``minipaged/engine/async_llm.py``).

Routes
    ``GET /v1/models``; ``POST /v1/completions`` and ``/v1/chat/completions``, streaming
    (Server-Sent Events, ``data: {...}`` then ``data: [DONE]``) or not. A completions
    ``prompt`` is a string, a list of strings, a list of token ids or a list of lists of
    token ids; each prompt is its own engine request (``n`` choices each), all joining the
    same step; choice ``j`` of prompt ``p`` is ``index = p * n + j`` and usage sums over all
    (as vLLM). ``echo=true``: each choice's text starts with its prompt (a token-id prompt
    detokenized, special tokens kept, as vLLM's ``tokenizer.decode``); with
    ``max_tokens=0`` (allowed with echo only, as vLLM) the prompt alone, finish_reason
    ``length`` and no completion token, answered without the engine (vLLM runs one step of
    ``max_tokens=1`` and returns the same text, counting that token);
    ``echo`` with ``logprobs`` is a 400 (vLLM adds the prompt's logprobs; this engine has
    none). ``GET /metrics`` (Prometheus text, ``metrics.py``); ``GET /trace`` (the live
    ``EngineTrace``: SSE of step events, or ``?format=json`` for the recent steps);
    ``GET /`` (the live page); ``GET /health`` (200 once the engine core answers a ping
    within ``health_timeout`` s, else 503); ``POST /tokenize`` and ``/detokenize`` (vLLM's
    fields: ``prompt`` or ``messages`` -> ``count``, ``max_model_len``, ``tokens``,
    ``token_strs``; ``tokens`` -> ``prompt``); ``GET /profile`` (seconds per part of the
    server's work, ``profile.py``: what ``benchmarks/serve_load.py --profile`` prints).
Invariants
    a client that disconnects (mid-stream or while waiting) has its requests (every
    prompt's) aborted and their KV blocks freed before the next engine step; one engine
    core, reached only through ``AsyncLLM`` (its messages applied between steps).
Transport
    uvicorn (``uvicorn_config``) with its httptools parser when installed (C, as vLLM's
    server runs), else its h11 one (pure Python), and uvloop when installed (uvicorn's
    ``loop="auto"``); either way a deadline on each request's headers (``header_timeout``:
    a connection that sends them slower is closed, which uvicorn alone never does), on
    its body (``body_timeout``: 408, connection closed), ``timeout_keep_alive`` on idle
    connections and a cap on the header size. uvloop and httptools are the optional
    ``minipaged[serve]`` extra (vLLM depends on both); nothing needs them.
Privacy
    ``/trace`` (and the live page drawn from it) shows every client's request ids, prompt
    and output lengths and stop reasons to anyone who can reach the server: fine for a
    class on loopback, not for strangers; ``enable_trace=False`` (``--disable-trace``)
    turns both off (404).
Failure mode
    every error is the OpenAI JSON shape (``protocol.error_body``), never a traceback, on
    every path (FastAPI's own query-parameter errors included: ``/trace?history=abc`` is a
    400 naming ``history``): 400 bad JSON / types / unknown fields / values (the message names the field; a bad
    prompt among several, ``prompt[2]``, rejects the whole request: checked before any
    runs, or, for one the KV pool can never hold, with the others aborted), 404
    unknown model or route, 408 a body that does not arrive in time, 413 a body over
    ``max_body_bytes``, 503 + ``Retry-After`` when ``max_waiting_requests`` are already
    waiting, 500 "internal error" for an engine bug (that step's requests only: the engine
    recovers), 503 on every route and on ``/health`` once the engine is unusable.
Shutdown
    SIGTERM or Ctrl-C (``DrainingServer``): no new connection or request; requests in
    flight may finish for ``shutdown_grace`` seconds, then every stream still open gets an
    OpenAI error event and ``[DONE]``, every non-streamed request a JSON 503; only then are
    the connections closed. A second Ctrl-C ends the wait at once.
"""

# NOTE: no `from __future__ import annotations` here: FastAPI reads the route functions'
# annotations (`request: Request`) at definition time.
import argparse
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Optional

from minipaged.engine.async_llm import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_MAX_UNREAD_TOKENS,
    DEFAULT_UNREAD_TIMEOUT,
)
from minipaged.entrypoints.openai.serving import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SHUTDOWN_GRACE,
    quiet_dropped_streams,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a request's headers to arrive
MAX_HEADER_BYTES = 64 * 1024  # uvicorn's h11_max_incomplete_event_size (its default is 16 KiB)


def build_app(engine, **serving_kwargs):
    """The FastAPI app over ``engine`` (an ``LLMEngine``); see ``OpenAIServing`` for options."""
    # NOTE: imported here, not at the top, so that `minipaged --help` stays light
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from minipaged.engine.async_llm import EngineDead, EngineError, EngineNotResponding
    from minipaged.entrypoints.openai.live import LIVE_PAGE
    from minipaged.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
        PromptError,
        TokenizeChatRequest,
        TokenizeCompletionRequest,
        error_body,
        split_prompts,
    )
    from minipaged.entrypoints.openai.serving import (
        ApiError,
        OpenAIServing,
        SSEResponse,
        chat_logprobs,
        completion_logprobs,
        finish_reason_of,
        sliced_chat_logprobs,
        sliced_completion_logprobs,
        sse,
        usage_of,
    )

    serving = OpenAIServing(engine, **serving_kwargs)
    tokenizer = serving.engine_client.tokenizer

    @asynccontextmanager
    async def lifespan(app):
        await serving.engine_client.start()
        try:
            yield
        finally:
            await serving.engine_client.shutdown()
            serving.close()

    app = FastAPI(title="minipaged", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving

    def error(status: int, message: str, param=None, headers=None) -> JSONResponse:
        return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _query_error(request, exc):  # FastAPI's own (query parameters): vLLM's 400
        err = (exc.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x not in ("query", "body", "path")]
        param = ".".join(loc) or None
        return error(400, f"{param}: {err.get('msg', 'invalid value')}", param)

    @app.exception_handler(EngineError)
    async def _engine_error(request, exc):  # logged once by the engine core already
        return error(500, "internal server error")

    @app.exception_handler(Exception)
    async def _internal(request, exc):  # NOTE: the traceback goes to the log, not the client
        return error(500, "internal server error")

    @app.get("/health")
    async def health():
        # NOTE: 503 (so that a supervisor restarts the server) when the engine is unusable
        # or its core does not answer a ping in time (stopped, or stuck)
        try:
            await serving.engine_client.check_health(serving.health_timeout)
        except (EngineDead, EngineNotResponding) as e:
            return error(503, str(e))
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await serving.read_json(request)
        cls = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        req = serving.validate(cls, body)
        serving.check_model(req.model)
        return await serving.tokenize_request(req)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = serving.validate(DetokenizeRequest, await serving.read_json(request))
        serving.check_model(req.model)
        return await serving.detokenize_request(req)

    def check_trace_enabled() -> None:
        if not serving.enable_trace:
            raise ApiError(404, "the trace is off on this server (--disable-trace)")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": serving.model_name,
                    "object": "model",
                    "created": serving.created,
                    "owned_by": "minipaged",
                    "root": serving.model_name,
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/profile")
    async def profile():  # seconds per part of the server's work (profile.py)
        from minipaged.entrypoints.openai.profile import PROFILE

        return PROFILE.snapshot(serving.engine_client.client.stats.get("step_seconds", 0.0))

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def live_page():
        check_trace_enabled()
        return HTMLResponse(LIVE_PAGE)

    @app.get("/trace")
    async def trace(request: Request, format: str = "sse", history: int = 64):
        check_trace_enabled()
        async_llm = serving.engine_client
        if format not in ("sse", "json"):
            raise ApiError(400, f"format must be 'sse' or 'json', got {format!r}", "format")
        if history < 0:
            raise ApiError(400, f"history must be >= 0, got {history}", "history")
        recent = list(async_llm.recent_steps)[-history:] if history else []
        if format == "json":
            return {"config": async_llm.trace_header(), "steps": recent}
        q = async_llm.subscribe()

        async def events():
            yield sse(async_llm.trace_header())
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

        return SSEResponse(events(), lambda: async_llm.unsubscribe(q))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = serving.validate(CompletionRequest, await serving.read_json(request))
        serving.check_model(req.model)
        try:
            prompts = split_prompts(req.prompt)
        except PromptError as e:
            raise ApiError(400, str(e), e.param)
        if req.echo and req.logprobs is not None:
            # NOTE: vLLM answers echo + logprobs with the prompt's logprobs too
            # (prompt_logprobs); this engine does not compute those.
            raise ApiError(400, "echo and logprobs together are not supported (no prompt logprobs)", "echo")
        # NOTE: as vLLM: max_tokens=0 is allowed with echo only (the prompt and nothing
        # more), checked as a request of max_tokens=1 (what vLLM's engine runs); the answer
        # needs no forward, so here the engine never sees it (no step, no KV block).
        echo_only = req.echo and req.max_tokens == 0
        if echo_only:
            req = req.model_copy(update={"max_tokens": 1})
        texts, items = [], []
        for name, prompt in prompts:
            serving.check_prompt_size(prompt, name)  # all of them, before any tokenizing
        for name, prompt in prompts:
            _, ids = await serving.tokenize(prompt, name)
            params = serving.make_params(req, len(ids), DEFAULT_COMPLETION_MAX_TOKENS, name)
            # echo: the prompt as sent; a token-id prompt detokenized (vLLM: decode(ids))
            if req.echo and not isinstance(prompt, str):
                prompt = await serving.run_off_loop(tokenizer.decode, ids)
            texts.append(prompt)
            items.append((params, ids))
        prompt_lens = [len(ids) for _, ids in items]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if echo_only:
            return echo_only_answer(serving, req, rid, texts, prompt_lens, params.n)
        # one prompt: the engine request is rid itself
        streams = serving.submit_all(items, rid, stream=req.stream)
        n = params.n
        echo = texts if req.echo else None
        created, model = int(time.time()), serving.model_name
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if not req.stream:
            outs = await serving.final_outputs(request, streams)
            if outs is None:
                return Response(status_code=499)

            async def build() -> dict:  # in slices: logprobs may be many
                choices, ntok = [], 0
                for p, out in enumerate(outs):
                    for c in out.outputs:
                        reason, stop_reason = finish_reason_of(c), c.stop_reason
                        text = c.text
                        lps = await sliced_completion_logprobs(
                            tokenizer, c.token_ids, getattr(c, "logprobs", None)
                        )
                        ntok += len(c.token_ids)
                        choices.append(
                            {
                                "index": p * n + c.index,
                                "text": (texts[p] if req.echo else "") + text,
                                "finish_reason": reason,
                                "stop_reason": stop_reason,
                                "logprobs": lps,
                            }
                        )
                return {**head, "choices": choices, "usage": usage_of(sum(prompt_lens), ntok)}

            return await serving.json_response(build)

        def choice(index, text, token_ids, lps, offset, reason, stop_reason):
            return {
                "index": index,
                "text": text,
                "finish_reason": reason,
                "stop_reason": stop_reason,
                "logprobs": completion_logprobs(tokenizer, token_ids, lps, offset),
            }

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = serving.sse_events(streams, head, params, prompt_lens, include_usage, choice, echo=echo)
        return SSEResponse(events, lambda: serving.abort_all(streams), streams[0].queue.dropped)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = serving.validate(ChatCompletionRequest, await serving.read_json(request))
        serving.check_model(req.model)
        try:
            top_n = req._logprobs() or 0
        except ValueError as e:
            raise ApiError(400, str(e), "top_logprobs")
        _, ids = await serving.render_and_tokenize(req.messages, tokenizer)
        params = serving.make_params(req, len(ids), engine.max_model_len - len(ids))
        stream = serving.submit(params, ids, stream=req.stream)
        created, model = int(time.time()), serving.model_name
        head = {"id": stream.request_id.replace("cmpl-", "chatcmpl-"), "created": created, "model": model}
        if not req.stream:
            out = await serving.final_output(request, stream)
            if out is None:
                return Response(status_code=499)

            async def build() -> dict:  # in slices: logprobs may be many
                choices = []
                for c in out.outputs:
                    reason = finish_reason_of(c)
                    lps = await sliced_chat_logprobs(
                        tokenizer, c.token_ids, getattr(c, "logprobs", None), top_n
                    )
                    choices.append(
                        {
                            "index": c.index,
                            "message": {"role": "assistant", "content": c.text},
                            "finish_reason": reason,
                            "stop_reason": c.stop_reason,
                            "logprobs": lps,
                        }
                    )
                ntok = sum(len(c.token_ids) for c in out.outputs)
                return {
                    **head,
                    "object": "chat.completion",
                    "choices": choices,
                    "usage": usage_of(len(ids), ntok),
                }

            return await serving.json_response(build)

        def choice(index, text, token_ids, lps, offset, reason, stop_reason):
            return {
                "index": index,
                "delta": {"content": text} if text else {},
                "logprobs": chat_logprobs(tokenizer, token_ids, lps, top_n),
                "finish_reason": reason,
                "stop_reason": stop_reason,
            }

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        first = [
            {
                "index": j,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for j in range(params.n)
        ]
        events = serving.sse_events(
            [stream],
            {**head, "object": "chat.completion.chunk"},
            params,
            [len(ids)],
            include_usage,
            choice,
            first,
        )
        return SSEResponse(
            events, lambda: serving.engine_client.abort(stream.request_id), stream.queue.dropped
        )

    return app


def echo_only_answer(serving, req, rid: str, texts: list, prompt_lens: list, n: int):
    """``echo`` with ``max_tokens=0``: each prompt's text, ``n`` times, finish_reason
    ``length``, no completion token; streamed as one event per prompt, then the usage (if
    asked) and ``[DONE]``. Built without the engine: it needs no forward."""
    from fastapi.responses import JSONResponse

    from minipaged.entrypoints.openai.serving import ApiError, SSEResponse, sse, usage_of

    ae = serving.engine_client
    if ae.dead is not None or ae.draining:  # NOTE: as for a request the engine would see
        raise ApiError(
            503, f"the engine is unusable ({ae.dead})" if ae.dead else "the server is shutting down"
        )
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": serving.model_name}
    usage = usage_of(sum(prompt_lens), 0)
    per_prompt = [
        [
            {
                "index": p * n + j,
                "text": text,
                "finish_reason": "length",
                "stop_reason": None,
                "logprobs": None,
            }
            for j in range(n)
        ]
        for p, text in enumerate(texts)
    ]
    if not req.stream:
        return JSONResponse({**head, "choices": [c for cs in per_prompt for c in cs], "usage": usage})
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events():
        for choices in per_prompt:
            yield sse({**head, "choices": choices})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage})
        yield sse("[DONE]")

    return SSEResponse(events(), lambda: None)


# -- running it ----------------------------------------------------------------------------
def _http_parser() -> str:
    """The HTTP protocol ``minipaged serve`` runs: ``httptools`` (C, llhttp: what vLLM's
    uvicorn runs) when it is installed, else ``h11`` (pure Python, always there)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def header_timeout_protocol(seconds: float, parser: str = "h11", max_header_bytes: int = MAX_HEADER_BYTES):
    """uvicorn's h11 or httptools protocol with a deadline on each request's headers.

    uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but cancels
    that timer on the first byte of the next request, so a client that sends its headers
    a byte at a time (or never finishes them) holds the connection forever. Here a timer
    starts when the connection opens and after each response, and is cancelled when a
    request's headers are complete (uvicorn starts a new request cycle); if it fires, the
    connection is closed. With httptools, headers larger than ``max_header_bytes`` also
    close the connection (h11 enforces its ``h11_max_incomplete_event_size`` itself).
    """
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    elif parser == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    else:
        raise ValueError(f"parser must be 'h11' or 'httptools', got {parser!r}")
    cap = max_header_bytes if parser == "httptools" else None

    class HeaderTimeoutProtocol(Base):
        def connection_made(self, transport) -> None:
            self._header_timer = None
            self._header_bytes = 0
            super().connection_made(transport)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_cycle = self.cycle
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(seconds, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is None:
                return
            if self.cycle is not self._header_cycle:
                self._cancel_header_timer()  # the headers are in: a request cycle started
            elif cap is not None:
                self._header_bytes += len(data)
                if self._header_bytes > cap:  # still no end of the headers
                    self._cancel_header_timer()
                    self.transport.close()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is cycle:
                self._arm_header_timer()  # waiting for the next request's headers

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def uvicorn_config(
    app,
    host: str,
    port: int,
    log_level: str = "info",
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    http: str = "auto",
    loop: str = "auto",
):
    """The ``uvicorn.Config`` of ``minipaged serve`` (also ``BackgroundServer``'s).

    ``http``: ``"auto"`` (httptools if installed, else h11), ``"h11"`` or ``"httptools"``;
    ``loop``: uvicorn's (``"auto"``: uvloop if installed, else asyncio; or ``"asyncio"``).
    """
    import uvicorn

    if not isinstance(header_timeout, (int, float)) or not header_timeout > 0:
        raise ValueError(f"header_timeout must be a number of seconds > 0, got {header_timeout!r}")
    if http not in ("auto", "h11", "httptools"):
        raise ValueError(f"http must be 'auto', 'h11' or 'httptools', got {http!r}")
    if loop not in ("auto", "asyncio", "uvloop"):
        raise ValueError(f"loop must be 'auto', 'asyncio' or 'uvloop', got {loop!r}")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=FLUSH_TIMEOUT,
        http=header_timeout_protocol(header_timeout, _http_parser() if http == "auto" else http),
        loop=loop,
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    quiet_dropped_streams()  # NOTE: after Config(), which configures uvicorn's loggers
    return config


# seconds responses have to go out after the drain (uvicorn's timeout_graceful_shutdown)
FLUSH_TIMEOUT = 2.0


def draining_server(config, serving, grace: float = DEFAULT_SHUTDOWN_GRACE):
    """A ``uvicorn.Server`` that drains on SIGTERM / Ctrl-C (or ``should_exit``): it stops
    accepting connections, lets the requests in flight finish for ``grace`` seconds, then
    fails the rest (``OpenAIServing.drain``: every stream ends with an OpenAI error event
    and ``[DONE]``, every other request gets a JSON 503), and only then closes the
    connections (uvicorn's own shutdown, which alone would cut the streams mid-event). A
    second Ctrl-C (``force_exit``) ends the wait at once."""
    import uvicorn

    if not isinstance(grace, (int, float)) or not grace >= 0:
        raise ValueError(f"shutdown_grace must be a number of seconds >= 0, got {grace!r}")

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:
                server.close()  # no new connections while the others drain
            await serving.drain(grace, lambda: self.force_exit)
            await super().shutdown(sockets)

    return DrainingServer(config)


# seconds a server whose engine core process died keeps answering 503 before it exits
DEAD_CORE_EXIT_DELAY = 3.0


def exit_when_core_dies(serving, server, delay: float = DEAD_CORE_EXIT_DELAY) -> None:
    """A server over an engine core process shuts itself down ``delay`` seconds after the
    core dies (503 with the reason until then); a no-op for an in-process engine."""
    import asyncio

    serving.engine_client.on_core_death = lambda: asyncio.get_running_loop().call_later(
        delay, lambda: setattr(server, "should_exit", True)
    )


class BackgroundServer:
    """``minipaged serve`` in a thread of this process (tests, notebooks).

    ``BackgroundServer(engine, port=0).start()`` binds 127.0.0.1 on a free port (``engine``:
    an ``LLMEngine`` stepped in this process, or an ``EngineCoreClient`` whose core runs
    in its own process, as ``minipaged serve`` by default); ``.url``
    is its base URL, ``.serving`` the ``OpenAIServing``; ``.stop()`` ends it (also on
    ``with``), draining as SIGTERM does (``shutdown_grace``). Loopback only unless
    ``host`` says otherwise.
    """

    def __init__(
        self, engine, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **serving_kwargs
    ) -> None:
        header_timeout = serving_kwargs.pop("header_timeout", DEFAULT_HEADER_TIMEOUT)
        http = serving_kwargs.pop("http", "auto")
        grace = serving_kwargs.pop("shutdown_grace", DEFAULT_SHUTDOWN_GRACE)
        self.app = build_app(engine, **serving_kwargs)
        self.serving = self.app.state.serving  # OpenAIServing
        config = uvicorn_config(
            self.app, host=host, port=port, log_level=log_level, header_timeout=header_timeout, http=http
        )
        self.server = draining_server(config, self.serving, grace)
        exit_when_core_dies(self.serving, self.server)
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
    from minipaged.cli import non_negative_int, positive_int
    from minipaged.config import EngineConfig

    d = EngineConfig()
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for a classroom)",
    )
    g.add_argument("--port", type=non_negative_int, default=8000)
    g.add_argument("--served-model-name", default=None, help="the model id clients send")
    g.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=256,
        help="requests not yet running before new ones get 503 + Retry-After",
    )
    g.add_argument("--max-n", type=positive_int, default=16, help="largest n a request may ask for")
    g.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES)
    g.add_argument(
        "--max-logprobs", type=non_negative_int, default=20, help="largest logprobs / top_logprobs (vLLM's)"
    )
    g.add_argument(
        "--max-prompt-chars",
        type=positive_int,
        default=None,
        help="longest prompt in characters, refused before tokenizing (default: 32 per context token)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="seconds for a request body to arrive",
    )
    g.add_argument(
        "--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, help="seconds for request headers"
    )
    g.add_argument(
        "--max-unread-steps",
        type=positive_int,
        default=256,
        help="engine steps of output a stream may leave unread before it is aborted",
    )
    g.add_argument(
        "--unread-timeout",
        type=float,
        default=DEFAULT_UNREAD_TIMEOUT,
        help="seconds a finished stream's output may wait for its reader before it is dropped",
    )
    g.add_argument(
        "--max-unread-tokens",
        type=positive_int,
        default=DEFAULT_MAX_UNREAD_TOKENS,
        help="tokens (each logprob candidate counts one) finished streams may hold unread, all "
        "together; beyond it the oldest is dropped",
    )
    g.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="tokens per streamed event (vLLM's; 1: every token as soon as its step ends)",
    )
    g.add_argument(
        "--health-timeout",
        type=float,
        default=DEFAULT_HEALTH_TIMEOUT,
        help="seconds the engine core has to answer /health's ping before /health is 503",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE,
        help="seconds requests in flight may finish after SIGTERM; the rest get an error",
    )
    g.add_argument(
        "--disable-trace",
        action="store_true",
        help="turn off /trace and the live page (they show every client's request ids and lengths)",
    )
    g.add_argument(
        "--no-engine-process",
        dest="engine_process",
        action="store_false",
        help="step the engine in this process (default: an engine-core process, as vLLM v1)",
    )
    g.add_argument(
        "--check-invariants",
        action="store_true",
        help="run LLMEngine.check_invariants() after every step (slow; for tests)",
    )
    g.add_argument(
        "--threads",
        type=non_negative_int,
        default=0,
        help="torch CPU threads (0: torch's default in-process; all CPUs but one in an engine-core process)",
    )
    g.add_argument(
        "--http",
        default="auto",
        choices=["auto", "h11", "httptools"],
        help="HTTP parser (auto: httptools if installed, as vLLM's uvicorn, else h11)",
    )
    g.add_argument("--log-level", default="info")
    e = parser.add_argument_group("engine")
    e.add_argument("--model", default=None, help="a local HF folder or hub id (default: the course model)")
    e.add_argument("--block-size", type=positive_int, default=d.block_size)
    e.add_argument("--num-blocks", type=positive_int, default=None)
    e.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs)
    e.add_argument("--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens)
    e.add_argument("--max-model-len", type=positive_int, default=None)
    e.add_argument("--enable-prefix-caching", action="store_true")
    e.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    e.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"])
    e.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton", "cpu"],
        help="auto (default): the fastest that runs here, see minipaged.kernels.selector.get_attn_backend",
    )
    e.add_argument("--device", default=d.device)
    e.add_argument("--dtype", default=d.dtype)
    e.add_argument("--seed", type=non_negative_int, default=d.seed)
    e.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=d.tensor_parallel_size,
        help="worker processes, each with 1/N of the heads (torch.distributed: gloo on CPU, NCCL on CUDA)",
    )


ENGINE_ARGS = (
    "model",
    "block_size",
    "num_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "preemption_mode",
    "attention_backend",
    "device",
    "dtype",
    "seed",
    "tensor_parallel_size",
)


def run(args: argparse.Namespace) -> int:
    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import LLMEngine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        config = EngineConfig(**{k: getattr(args, k) for k in ENGINE_ARGS})
        from minipaged.kernels.selector import keep_triton_out

        keep_triton_out(config)  # before the tokenizer or the model loads
        if args.engine_process:
            from minipaged.engine.core_client import MPClient

            engine = MPClient(config, check_invariants=args.check_invariants, threads=args.threads)
        else:
            engine = LLMEngine(config)
    except ValueError as e:
        print(f"minipaged serve: {e}")
        return 2
    try:
        app = build_app(
            engine,
            served_model_name=args.served_model_name,
            max_waiting_requests=args.max_waiting_requests,
            max_n=args.max_n,
            max_body_bytes=args.max_body_bytes,
            check_invariants=args.check_invariants,
            max_logprobs=args.max_logprobs,
            max_prompt_chars=args.max_prompt_chars,
            body_timeout=args.body_timeout,
            max_unread_steps=args.max_unread_steps,
            enable_trace=not args.disable_trace,
            unread_timeout=args.unread_timeout,
            max_unread_tokens=args.max_unread_tokens,
            stream_interval=args.stream_interval,
            health_timeout=args.health_timeout,
        )
        uconfig = uvicorn_config(app, args.host, args.port, args.log_level, args.header_timeout, args.http)
        server = draining_server(uconfig, app.state.serving, args.shutdown_grace)
    except ValueError as e:
        print(f"minipaged serve: {e}")
        if args.engine_process:
            engine.shutdown()
        return 2
    serving = app.state.serving
    where = f"engine core process pid {engine.pid}" if args.engine_process else "engine in-process"
    print(
        f"minipaged serve: {serving.model_name} on http://{args.host}:{args.port} "
        f"(live view at /, metrics at /metrics; {where})",
        flush=True,
    )
    exit_when_core_dies(serving, server)
    from minipaged.engine.core import freeze_gc_heap

    freeze_gc_heap()  # NOTE: as vLLM's API server: the start-up heap is never collected again
    try:
        server.run()
    finally:
        engine.shutdown()  # the engine core process, or the tensor-parallel workers, if any
    return 1 if serving.engine_client.core_died else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="minipaged serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
