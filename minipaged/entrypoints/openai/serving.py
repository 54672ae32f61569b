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
Failure mode
    ``ApiError(status, message, param)``: the routes answer it in the OpenAI error shape.
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Optional

from starlette.responses import Response

from minipaged.entrypoints.openai.async_engine import (
    AsyncEngine,
    EngineError,
    QueueFull,
)
from minipaged.entrypoints.openai.protocol import error_body

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a request body larger than this gets 413


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


class SSEResponse(Response):
    """Streams ``events`` (strings) as text/event-stream.

    It listens for ``http.disconnect`` itself (whatever the ASGI spec version), stops the
    stream at once when the client goes, and always calls ``on_close()`` last.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        self.events, self.on_close = events, on_close
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
    ):
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
        self.async_engine = AsyncEngine(
            engine,
            max_waiting_requests=max_waiting_requests,
            check_invariants=check_invariants,
            metrics=self.metrics,
            trace_window=trace_window,
        )
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
            raise ApiError(
                400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
            )
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
        except ValueError as e:
            raise ApiError(400, str(e))
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

    def tokenize(self, prompt, param: str) -> tuple[Optional[str], list[int]]:
        try:
            return self.engine.tokenize(prompt, name=param)
        except ValueError as e:
            raise ApiError(400, str(e), param=param)

    def submit(self, params, ids: list[int]):
        """One request -> its ``RequestStream``."""
        return self.submit_all([(params, ids)])[0]

    def submit_all(self, items: list, request_id: Optional[str] = None) -> list:
        """Several ``(params, ids)`` -> their ``RequestStream``s, sharing one queue, all
        queued for the same engine step, or none (503 when the waiting queue cannot take
        them all). One prompt is the engine request ``request_id``; several are
        ``{request_id}-{p}`` (as vLLM numbers them)."""
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        limit = self.async_engine.max_waiting_requests
        if len(items) > limit:
            raise ApiError(
                400,
                f"prompt holds {len(items)} prompts; this server takes at most {limit} in one request",
                "prompt",
            )
        rids = [rid] if len(items) == 1 else [f"{rid}-{p}" for p in range(len(items))]
        try:
            return self.async_engine.add_requests(
                [(r, ids, params) for r, (params, ids) in zip(rids, items)], queue=asyncio.Queue()
            )
        except QueueFull as e:
            raise ApiError(503, str(e), headers={"Retry-After": str(e.retry_after)})

    def abort_all(self, streams) -> None:
        for stream in streams:
            self.async_engine.abort(stream.request_id)  # no-op once finished

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
        echo_only: bool = False,
    ) -> AsyncIterator[str]:
        """The Server-Sent Events of one streamed answer: ``head`` + ``choices`` per step
        with new text, ``choice(index, text, token_ids, logprobs, offset, finish_reason,
        stop_reason)`` building each; then the usage (if asked, summed over all prompts)
        and ``[DONE]``. Choice ``j`` of prompt ``p`` is ``index = p * n + j``. With
        ``echo`` (each prompt's text), a choice's first chunk starts with its prompt; with
        ``echo_only`` (max_tokens=0) it is all the choice sends, no token counted. An error
        after the headers went out is one event in the OpenAI error shape."""
        n = params.n
        deltas = [TextDeltas(n, getattr(params, "stop", None)) for _ in streams]
        ntok = [0] * len(streams)
        echoed: set[int] = set()
        try:
            if first:
                yield sse({**head, "choices": first})
            async for p, out in self.outputs(streams):
                choices = []
                for c in out.outputs:
                    i = p * n + c.index
                    done = c.finish_reason is not None
                    reason = finish_reason_of(c) if done else None
                    stop_reason = c.stop_reason if done else None
                    offset = len(deltas[p].text[c.index])
                    text, new_ids, new_lps = deltas[p].delta(c, done)
                    if echo_only:
                        text, new_ids, new_lps = "", [], []
                        reason, stop_reason = ("length", None) if done else (None, None)
                    if echo is not None and i not in echoed:
                        echoed.add(i)
                        text = echo[p] + text
                    if text or done or new_lps:
                        choices.append(choice(i, text, new_ids, new_lps, offset, reason, stop_reason))
                if not echo_only:
                    ntok[p] = sum(len(c.token_ids) for c in out.outputs)
                if choices:
                    yield sse({**head, "choices": choices})
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
        text = full[len(sent) :] if full.startswith(sent) and len(full) > len(sent) else ""
        self.text[i] += text
        new_ids = c.token_ids[self.num_tokens[i] :]
        lps = getattr(c, "logprobs", None)
        new_lps = list(lps[self.num_tokens[i] :]) if lps else []
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
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], lps: list, top_n: int) -> Optional[dict]:
    if not lps:
        return None
    content = []
    for tid, d in zip(token_ids, lps):
        piece = tokenizer.decode([tid])
        ranked = sorted(d.items(), key=lambda kv: -_logprob_value(kv[1]))[:top_n]
        content.append(
            {
                "token": piece,
                "logprob": _logprob_value(d[tid]) if tid in d else None,
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {
                        "token": tokenizer.decode([t]),
                        "logprob": _logprob_value(v),
                        "bytes": list(tokenizer.decode([t]).encode()),
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
