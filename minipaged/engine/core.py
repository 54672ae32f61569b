"""EngineCore: the scheduler and the executor stepping in a process of their own.

Mirrors vLLM v1 ``vllm/v1/engine/core.py`` (``EngineCore``, ``EngineCoreProc.run_busy_loop``
with its input and output threads). ``minipaged serve`` runs it in a child process; the
API-server process (HTTP, tokenizing, detokenizing, stop strings) talks to it through
``EngineCoreClient`` (``core_client.py``). Offline ``LLM.generate`` does not use it: it
steps its ``LLMEngine`` in-process, as before.

The busy loop (one turn)::

    apply every message that has arrived      adds, aborts (never during a step)
    if no request is unfinished: say so (stats), block until a message arrives
    engine.step()                              schedule + execute + update_from_output
    put the step's outputs on the output queue (the output thread sends them)

What crosses, each way (plain data, pickled; sizes in chapter 09)
    in  (frontend -> core): ``("add", [(request_id, prompt_token_ids, SamplingParams), ...])``,
        ``("abort", [request_id, ...])``, ``("stop", [(seq_id, stop_reason), ...])`` (the
        frontend found a stop string in the sequence's text), ``("shutdown",)``. ``SamplingParams.stop`` is
        removed: stop strings are the frontend's.
    out (core -> frontend): ``("ready", info)`` once; then per step ``("step", seqs, event,
        stats)``: for every sequence that got tokens or finished, ``(seq_id, new_token_ids,
        new logprob entries or None, finish_reason or None, stop_reason)``; ``event`` is the
        step's ``StepRecord`` as a dict (what ``/trace``, ``/metrics`` and the live view
        draw), ``stats`` the pool's free blocks, the unfinished requests and the step's
        seconds; ``("idle", stats)`` when the engine runs out of work; ``("rejected",
        request_id, message)`` for an add the engine refused (a ``ValueError``);
        ``("failed", error, seqs, stats, dead)`` when a step raised.

Transport: the standard library's ``multiprocessing`` pipes (``Connection.send_bytes`` of a
pickle), not pyzmq as vLLM. One frontend talks to one core that it spawned itself, so a
pipe is all the addressing needed; the child's end reads EOF when its parent dies (no
orphan); and nothing new is installed. pyzmq earns its place in vLLM with several
frontends and data-parallel cores (ROUTER/DEALER sockets), which minipaged does not have.
Pickle is safe here because both ends are this package, in processes it started.

Invariants
    the core never waits on the frontend: a slow reader fills the output queue, not the
    step (the output thread sends; the input thread receives); every message that has
    arrived before a step is applied before it, so an abort (a client's hang-up, or a stop
    string the frontend found) frees the request's blocks at the next step boundary;
    with ``check_invariants`` ``LLMEngine.check_invariants()`` holds after every step.
Failure mode
    a step that raises is recovered by ``LLMEngine.fail_step`` (that step's requests fail,
    the others go on); after ``max_step_failures`` failures in a row the core is *dead*:
    it drops every request and says so (``dead`` in the message). If the frontend's end
    of the pipe closes (it exited, or was killed) the core exits. If the core process
    dies, the frontend's reader sees EOF (``EngineCoreClient``).
"""

from __future__ import annotations

import dataclasses
import pickle
import queue
import sys
import threading
import time
import traceback
from typing import Optional

FINISH_REASON_NAMES = ("stop", "length", "abort", "refused")


def _step_fields() -> tuple:
    from minipaged.trace import StepRecord

    return tuple(f.name for f in dataclasses.fields(StepRecord))


_STEP_FIELDS = _step_fields()


def encode(msg) -> bytes:
    """A message as the bytes that cross the pipe."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)


def step_event(rec) -> dict:
    """A ``StepRecord`` as the dict ``/trace``, ``/metrics`` and the live view read.

    NOTE: a shallow copy, not ``dataclasses.asdict`` (a deep one, which cost a sixth of
    the core's Python time at saturation): ``record_step`` builds fresh lists and dicts
    for every record and nothing changes them afterwards, so sharing them is safe."""
    return {name: getattr(rec, name) for name in _STEP_FIELDS}


def core_params(params):
    """The ``SamplingParams`` the core runs: the same without stop strings (the frontend
    finds those in the text and aborts the request, as vLLM v1's output processor does)."""
    if not params.stop:
        return params
    return dataclasses.replace(params, stop=None)


class EngineCore:
    """An ``LLMEngine`` driven by messages: ``handle(msg)`` applies one input message,
    ``step()`` runs one engine step and returns the output message (or None when idle).

    The same object runs in-process in tests and chapter 09 (to show what crosses) and in
    the child process (``run_engine_core``), where ``run_busy_loop`` drives it."""

    def __init__(
        self,
        engine,
        *,
        check_invariants: bool = False,
        max_step_failures: int = 3,
        max_trace_steps: int = 2048,
    ) -> None:
        self.engine = engine
        # NOTE: the core never detokenizes: its output processor keeps logprob entries only
        engine.output_processor.tokenizer = None
        self.check_invariants = check_invariants
        self.max_step_failures = max_step_failures
        self.max_trace_steps = max_trace_steps
        self.seqs: dict = {}  # seq_id -> [Request, tokens sent, logprob entries list or None]
        self.step_offset = 0  # global step number of the trace's step 0
        self.step_seconds = 0.0  # time spent in engine.step(), summed
        self.num_steps = 0
        self.consecutive_failures = 0
        self.dead: Optional[str] = None
        self.errors: list[str] = []

    def info(self) -> dict:
        """What the frontend needs to know of the engine (the ``ready`` message)."""
        e = self.engine
        return {
            "config": e.config,
            "max_model_len": e.max_model_len,
            "vocab_size": int(e.model.vocab_size),
            "eos_token_ids": list(e.eos_token_ids),
            "num_blocks": e.num_blocks,
        }

    def stats(self) -> dict:
        e = self.engine
        return {
            "num_free_blocks": e.kv_cache_manager.get_num_free_blocks(),
            "num_unfinished": e.get_num_unfinished_requests(),
            "step_seconds": self.step_seconds,
            "num_steps": self.num_steps,
        }

    # -- input ----------------------------------------------------------------------
    def handle(self, msg) -> list:
        """Apply one input message; returns the messages it answers with (refusals)."""
        kind = msg[0]
        replies = []
        if kind == "add":
            for rid, ids, params in msg[1]:
                if self.dead is not None:
                    replies.append(("rejected", rid, f"the engine is unusable: {self.dead}"))
                    continue
                try:
                    self.engine.add_request(rid, ids, core_params(params))
                except ValueError as exc:
                    replies.append(("rejected", rid, str(exc)))
                    continue
                lps = self.engine.output_processor.seqs
                for req in self.engine.groups[rid].seqs:
                    st = lps.get(req.request_id)
                    # NOTE: the output processor's list, mutated in place by the engine
                    self.seqs[req.request_id] = [req, 0, None if st is None else st.logprobs]
        elif kind == "stop":  # the frontend found a stop string: finished now, blocks freed
            for sid, reason in msg[1]:
                self.seqs.pop(sid, None)
                self.engine.finish_sequence(sid, reason)
        elif kind == "abort":
            for rid in msg[1]:
                group = self.engine.groups.get(rid)
                if group is None:
                    continue  # finished in the step that just ran
                for req in group.seqs:
                    self.seqs.pop(req.request_id, None)
                self.engine.abort_request(rid)  # frees its blocks now, before the next step
        return replies

    # -- the step -----------------------------------------------------------------------
    def step(self):
        """One engine step -> its output message; None if there was nothing to run."""
        engine = self.engine
        if not engine.has_unfinished_requests():
            return None
        if engine.step_index >= self.max_trace_steps:
            self.reset_trace()
        t0 = time.perf_counter()
        try:
            engine.step()
            if self.check_invariants:
                engine.check_invariants()
        except Exception as exc:
            self.step_seconds += time.perf_counter() - t0
            return self._fail(exc)
        self.step_seconds += time.perf_counter() - t0
        self.num_steps += 1
        self.consecutive_failures = 0
        rec = engine.trace.steps[-1]
        event = step_event(rec)
        event["step"] += self.step_offset
        event["requests"] = {
            rid: dict(engine.trace.requests[rid])
            for rid in list(rec.arrived_ids) + list(rec.finished_ids)
            if rid in engine.trace.requests
        }
        return ("step", self._collect(), event, self.stats())

    def _collect(self) -> list:
        """Every tracked sequence's new tokens (and logprob entries) since the last message,
        and its finish reason once it finished; finished ones are forgotten."""
        from minipaged.engine.llm_engine import FINISH_REASONS

        out = []
        live = self.engine.seq_to_group
        for sid, st in list(self.seqs.items()):
            req, sent, lps = st
            ids = req.output_token_ids
            finished = req.is_finished or sid not in live
            if len(ids) == sent and not finished:
                continue
            new_lps = None if lps is None else lps[sent : len(ids)]
            reason = None
            if finished:
                reason = FINISH_REASONS.get(req.status, "abort") if req.is_finished else "abort"
                del self.seqs[sid]
            out.append((sid, ids[sent:], new_lps, reason, req.stop_reason if finished else None))
            st[1] = len(ids)
        return out

    def _fail(self, exc: BaseException):
        """A step raised: fail its requests (``LLMEngine.fail_step``), report every sequence
        that is now finished; after ``max_step_failures`` in a row the core is dead."""
        msg = f"{type(exc).__name__}: {exc}"
        self.errors.append(msg)
        self.consecutive_failures += 1
        print(
            "minipaged engine core: the engine step failed; its requests get an error\n"
            + "".join(traceback.format_exception(exc)),
            file=sys.stderr,
        )
        try:
            self.engine.fail_step(exc)
            if self.check_invariants:
                self.engine.check_invariants()
        except Exception as exc2:
            self._die(f"recovery from {msg} failed: {type(exc2).__name__}: {exc2}")
        if self.dead is None and self.consecutive_failures >= self.max_step_failures:
            self._die(f"{self.consecutive_failures} steps in a row failed, the last with {msg}")
        return ("failed", msg, self._collect(), self.stats(), self.dead)

    def _die(self, reason: str) -> None:
        self.dead = reason
        print(f"minipaged engine core: the engine is unusable: {reason}", file=sys.stderr)
        for rid in list(self.engine.groups):
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
        self.engine.groups.clear()  # NOTE: what could not be aborted is dropped

    def reset_trace(self) -> None:
        old = self.engine.reset_trace()
        self.step_offset += len(old.steps)

    # -- the process ------------------------------------------------------------------
    def run_busy_loop(self, conn_in, conn_out) -> None:
        """Step while there is work; the input thread receives, the output thread sends,
        so the step never waits on the frontend. Returns on ``shutdown`` or EOF."""
        inq: queue.Queue = queue.Queue()
        outq: queue.Queue = queue.Queue()

        def receive() -> None:
            try:
                while True:
                    inq.put(decode(conn_in.recv_bytes()))
            except (EOFError, OSError):  # the frontend is gone
                pass
            inq.put(("shutdown",))

        def send() -> None:
            while True:
                msg = outq.get()
                if msg is None:
                    return
                try:
                    conn_out.send_bytes(encode(msg))
                except (OSError, ValueError):  # the frontend is gone
                    return

        threading.Thread(target=receive, name="minipaged-core-in", daemon=True).start()
        sender = threading.Thread(target=send, name="minipaged-core-out", daemon=True)
        sender.start()
        outq.put(("ready", self.info()))
        idle = True
        try:
            while True:
                msgs = [] if not idle else [inq.get()]  # idle: block until something arrives
                while True:  # NOTE: everything that has arrived, before the next step
                    try:
                        msgs.append(inq.get_nowait())
                    except queue.Empty:
                        break
                for m in msgs:
                    if m[0] == "shutdown":
                        return
                    for reply in self.handle(m):
                        outq.put(reply)
                out = self.step()
                if out is not None:
                    outq.put(out)
                    idle = False
                    continue
                if not idle:  # ran out of work: say so, start a fresh trace
                    self.reset_trace()
                    outq.put(("idle", self.stats()))
                elif msgs:
                    outq.put(("idle", self.stats()))  # e.g. aborts applied while idle
                idle = True
        finally:
            outq.put(None)
            sender.join(5)


def freeze_gc_heap() -> None:
    """Collect, then move every object alive now out of the garbage collector's sight
    (``gc.freeze``), as vLLM does after start-up in both of its processes
    (``vllm/utils/gc_utils.py``).

    NOTE: the heap after start-up (torch, transformers, the model, the tokenizer: ~350,000
    objects) never becomes garbage, yet every oldest-generation collection walks all of
    it: 0.1-0.2 s each, several times in a 256-request burst, each one freezing that
    process (the core's step, or every stream of the server) meanwhile."""
    import gc

    gc.collect()
    gc.freeze()


def run_engine_core(config, conn_in, conn_out, options: dict) -> None:
    """The child process: build the engine from ``config``, answer ``ready`` (or ``error``),
    then run the busy loop until the frontend says stop or goes away."""
    import signal

    # NOTE: Ctrl-C reaches the whole process group; the frontend decides when the core stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import os

        import torch

        threads = options.pop("threads", 0)
        # NOTE: by default one CPU is left to the frontend process (vLLM's CPU backend
        # reserves one too, VLLM_CPU_NUM_OF_RESERVED_CPU): torch's threads wait on each
        # other, so one of them descheduled by the frontend stalls every op of the step
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) - 1))
        from minipaged.engine.llm_engine import LLMEngine

        core = EngineCore(LLMEngine(config), **options)
    except Exception as exc:  # a bad model or config: the frontend says why and exits
        msg = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        try:
            conn_out.send_bytes(encode(("error", msg)))
        except OSError:
            pass
        return
    freeze_gc_heap()
    try:
        core.run_busy_loop(conn_in, conn_out)
    finally:
        core.engine.shutdown()  # its tensor-parallel workers, if any
