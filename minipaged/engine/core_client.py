"""EngineCoreClient: the API-server process's handle on an engine core in its own process.

Mirrors vLLM v1 ``vllm/v1/engine/core_client.py`` (``MPClient``: it spawns the core and
talks to it) and the front-end half of ``vllm/v1/engine/output_processor.py``
(``FrontendOutputs``: text, stop strings and logprob dicts, built from the token ids the
core sends). The core is ``minipaged/engine/core.py`` (its docstring lists what crosses,
and why the transport is ``multiprocessing`` pipes rather than pyzmq).

Inputs
    ``EngineCoreClient(config)`` spawns ``run_engine_core`` (the ``spawn`` start method: a
    fresh interpreter, no inherited threads) and waits for its ``ready`` message: the
    engine's ``max_model_len``, vocabulary size, EOS ids and pool size. The frontend loads
    the tokenizer only, never the weights. ``send(msg)`` (thread-safe) puts one message on
    the pipe; ``start_output_thread(callback)`` calls ``callback(msg)`` in a reader thread
    for each message the core sends, and ``callback(("dead", exitcode))`` once if the pipe
    closes while the client is not shutting down (the core process died).
Outputs
    ``FrontendOutputs.process(seqs)`` -> the ``RequestOutput`` of every request that moved
    (partial ones for streamed requests) and the ``(seq_id, stop_reason)`` of every
    sequence whose text just completed a stop string: the caller sends those to the core
    (``("stop", ...)``), which finishes them at its next step boundary (vLLM v1: the
    output processor aborts the request; the core frees its blocks before its next step).
    Tokens the core made after that token are dropped, so the text and token ids equal
    offline ``LLM.generate``'s, which finishes the request in the step itself.
Invariants
    the frontend's mirror of each sequence (a ``Request`` holding the tokens received)
    is what ``OutputProcessor`` reads, as offline; the same ``OutputProcessor`` code finds
    stop strings and builds every finished ``CompletionOutput``.
Failure mode
    the core refusing to start (a bad model, a bad config): ``ValueError`` with its
    message; the core dying later: the ``dead`` callback, and ``send`` raises
    ``EngineCoreDead``. ``shutdown()`` always leaves no process behind (terminate, then kill).
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from minipaged.core.sched.request import Request, RequestStatus
from minipaged.engine.core import decode, encode, run_engine_core
from minipaged.engine.detokenizer import IncrementalDetokenizer
from minipaged.engine.output_processor import OutputProcessor, logprob_dict
from minipaged.engine.outputs import CompletionOutput, RequestOutput

STATUS_OF_REASON = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "refused": RequestStatus.FINISHED_IGNORED,
}


class EngineCoreDead(Exception):
    """The engine-core process is gone."""


@dataclass
class ModelInfo:
    """What the frontend knows of the model (the core's ``ready`` message): no weights."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]


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
        options = {"check_invariants": check_invariants, "max_step_failures": max_step_failures}
        options["threads"] = threads
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
        self._send_lock = threading.Lock()
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        atexit.register(self.shutdown)
        try:
            msg = self._wait_ready(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        info = msg[1]
        self.config = info["config"]
        self.num_blocks = info["num_blocks"]
        self.max_model_len = info["max_model_len"]
        self.eos_token_ids = info["eos_token_ids"]
        self.model = ModelInfo(info["vocab_size"], self.max_model_len, self.eos_token_ids)
        self.tokenizer = load_tokenizer(self.config.model)
        # the core's numbers after its last message: free blocks, unfinished requests, ...
        self.stats = {"num_free_blocks": self.num_blocks, "num_unfinished": 0, "step_seconds": 0.0}

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

    # -- what serving reads of an engine ---------------------------------------------------
    def tokenize(self, prompt, name: str = "prompt"):
        """(text, token ids), checked as ``LLMEngine.tokenize`` checks them (same code)."""
        from minipaged.engine.llm_engine import LLMEngine

        return LLMEngine.tokenize(self, prompt, name)

    def get_num_unfinished_requests(self) -> int:
        return self.stats["num_unfinished"]

    def has_unfinished_requests(self) -> bool:
        return self.stats["num_unfinished"] > 0

    def get_num_free_blocks(self) -> int:
        return self.stats["num_free_blocks"]

    # -- the pipe ---------------------------------------------------------------------
    def send(self, msg) -> None:
        data = encode(msg)
        with self._send_lock:
            try:
                self._in_w.send_bytes(data)
            except (OSError, ValueError) as e:
                raise EngineCoreDead(f"the engine core process is gone ({e})") from e

    def start_output_thread(self, callback: Callable) -> None:
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

        self._thread = threading.Thread(target=run, name="minipaged-core-outputs", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (ask, then terminate, then kill); no process is left behind."""
        if self._closing and not self.proc.is_alive():
            return
        self._closing = True
        try:
            self.send(("shutdown",))
        except EngineCoreDead:
            pass
        self._in_w.close()
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._out_r.close()


# -- the frontend's half of the output processor ------------------------------------------
@dataclass
class _Group:
    request_id: str
    prompt_token_ids: list[int]
    params: object
    seqs: list[Request]
    stream: bool
    detoks: list = field(default_factory=list)  # streamed: text so far, per sequence
    logprobs: list = field(default_factory=list)  # streamed: logprob dicts so far

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def seq_params(params, eos_token_ids: list[int]):
    """The parameters each sequence runs with, as ``LLMEngine.add_request`` makes them."""
    p = dataclasses.replace(params, n=1) if params.n > 1 else params
    extra = [e for e in eos_token_ids[1:] if e not in p.stop_token_ids]
    if extra and not p.ignore_eos:
        p = dataclasses.replace(p, stop_token_ids=p.stop_token_ids + extra)
    return p


class FrontendOutputs:
    """Per request: a mirror ``Request`` per sequence (the tokens received), the shared
    ``OutputProcessor`` (stop strings, finished completions) and, for a streamed request,
    each sequence's incremental text and logprob dicts (built once per token)."""

    def __init__(self, tokenizer, eos_token_ids: list[int], piece: Callable) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.piece = piece  # a token's text (memoized)
        self.op = OutputProcessor(tokenizer)
        self.groups: dict[str, _Group] = {}
        self.seq_group: dict[str, _Group] = {}

    def add(self, request_id: str, ids: list[int], params, stream: bool) -> None:
        sp = seq_params(params, self.eos_token_ids)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        n = params.n
        seqs = [
            Request(request_id if n == 1 else f"{request_id}.{j}", ids, sp, eos, status=RequestStatus.RUNNING)
            for j in range(n)
        ]
        g = _Group(request_id, list(ids), params, seqs, stream)
        self.op.add_request(seqs, ids, params)
        if stream:
            plain = dataclasses.replace(params, n=1, stop=None)
            for req in seqs:
                st = self.op.seqs[req.request_id]
                own = st.detokenizer is None and self.tokenizer is not None
                g.detoks.append(IncrementalDetokenizer(self.tokenizer, [], plain) if own else None)
                g.logprobs.append([] if params.logprobs is not None else None)
        self.groups[request_id] = g
        for req in seqs:
            self.seq_group[req.request_id] = g

    def forget(self, request_id: str) -> None:
        g = self.groups.pop(request_id, None)
        if g is not None:
            self.op.remove(g.seqs)
            for req in g.seqs:
                self.seq_group.pop(req.request_id, None)

    def process(self, seqs: list) -> tuple[dict, list]:
        """Apply one core message's sequences -> ({request_id: RequestOutput}, stops)."""
        moved: dict[str, _Group] = {}
        stops = []
        for sid, new_ids, new_lps, reason, stop_reason in seqs:
            g = self.seq_group.get(sid)
            if g is None:
                continue  # aborted by its client, or finished here already
            j = next(k for k, r in enumerate(g.seqs) if r.request_id == sid)
            req = g.seqs[j]
            if req.is_finished:
                continue  # a stop string ended it: what the core made since is dropped
            moved[g.request_id] = g
            for k, t in enumerate(new_ids):
                if new_lps is not None and k < len(new_lps):
                    self.op.add_logprobs([req], {sid: new_lps[k]})
                    lps = g.logprobs[j] if g.stream else None
                    if lps is not None:
                        lps.append(logprob_dict(new_lps[k], self.piece))
                req.output_token_ids.append(int(t))
                last = k == len(new_ids) - 1
                if last and reason is not None:
                    req.status, req.stop_reason = STATUS_OF_REASON[reason], stop_reason
                if g.stream and g.detoks and g.detoks[j] is not None:
                    g.detoks[j].update(int(t))
                s = self.op.check_stop_strings(req)
                if s is not None:  # NOTE: as offline, a stop string wins over length / EOS
                    if not req.is_finished:
                        stops.append((sid, f"stop string {s!r}"))
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, f"stop string {s!r}"
                    break
            if not new_ids and reason is not None:
                req.status, req.stop_reason = STATUS_OF_REASON[reason], stop_reason
        outs = {}
        for rid, g in moved.items():
            if g.finished:
                outs[rid] = self.final_output(g)
                self.forget(rid)
            elif g.stream:
                outs[rid] = self.partial_output(g)
        return outs, stops

    def final_output(self, g: _Group) -> RequestOutput:
        from minipaged.engine.llm_engine import FINISH_REASONS

        comps = [self.op.make_completion(j, r, FINISH_REASONS.get(r.status)) for j, r in enumerate(g.seqs)]
        return RequestOutput(g.request_id, None, list(g.prompt_token_ids), comps, True)

    def partial_output(self, g: _Group) -> RequestOutput:
        comps = []
        for j, req in enumerate(g.seqs):
            detok = g.detoks[j]
            if detok is None:
                st = self.op.seqs.get(req.request_id)
                detok = None if st is None else st.detokenizer
            comps.append(
                CompletionOutput(
                    index=j,
                    text="" if detok is None else detok.output_text,
                    token_ids=list(req.output_token_ids),
                    logprobs=g.logprobs[j],
                )
            )
        return RequestOutput(g.request_id, None, list(g.prompt_token_ids), comps, False)
