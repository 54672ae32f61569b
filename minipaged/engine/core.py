"""EngineCore: the scheduler and the executor, one ``step()`` at a time, plain data in and out.

Mirrors vLLM v1 ``vllm/v1/engine/core.py``: ``EngineCore(scheduler, executor)`` with
``add_request``, ``abort_requests`` and ``step() -> EngineCoreOutputs``; ``EngineCoreProc``
(``run_busy_loop``, its input and output threads) is the same core in a process of its
own. Nothing here tokenizes, detokenizes or builds a ``RequestOutput``: the frontends
(``llm_engine.py``, ``async_llm.py``) do, in their ``Processor`` and ``OutputProcessor``.

One step::

    out    = scheduler.schedule()                   who runs, how many tokens each, new blocks
    result = executor.execute_model(out)            the worker(s) see out.for_worker() only
    done   = scheduler.update_from_output(out, result)   append, stop, free (a ModelRunnerOutput)
    trace.record(record_step(...))                  what the pictures are drawn from
    -> EngineCoreOutputs: per request its new token ids (and logprob entries), finish reason

Inputs
    ``add_request(EngineCoreRequest)`` (one sequence; ``add_request_group`` for the n
    sequences of one ``SamplingParams(n > 1)``: vLLM v1's independent children, or the
    paper's forked sequence group); ``abort_requests(ids)`` (a client went away);
    ``stop_requests([(id, reason)])`` (the frontend found a stop string: vLLM aborts the
    request; here it is finished as stopped, with the step that made its last token, so the
    trace says why). All three apply between steps.
Outputs
    ``step()`` -> ``EngineCoreOutputs``: an ``EngineCoreOutput`` for every request that got
    tokens or finished during the step (refusals included), the step's ``StepRecord`` and
    the scheduler's numbers. ``trace``: the ``EngineTrace`` since the last ``reset_trace``.
Invariants
    every request added is reported finished exactly once (by a step, or by
    ``fail_step``), unless it was aborted by the frontend; ``check_invariants`` checks the
    scheduler, the executor and the trace.
Failure mode
    ``step()`` raises whatever the executor raised; ``fail_step(exc)`` then finishes that
    step's requests as ``"abort"`` with the error in ``stop_reason`` and clears the
    scheduler's step, so the next ``step()`` runs. ``EngineCoreProc`` does that for the
    server, and after ``max_step_failures`` failures in a row declares the core *dead*
    (every request aborted, the reason on every later message). A bad request (a
    duplicate id, say) raises ``ValueError`` in ``add_request`` with nothing queued.

The process (``EngineCoreProc``; what crosses is pickled plain data, sizes in chapter 09)
    in  (frontend -> core): ``("add", [(request_id, [EngineCoreRequest, ...]), ...])`` (per
        caller request, its sequences), ``("abort", [id, ...])``, ``("stop", [(id, reason), ...])``, ``("ping", n)``,
        ``("shutdown",)``.
    out (core -> frontend): ``("ready", ModelInfo)`` once (or ``("error", message)``), then
        ``("outputs", EngineCoreOutputs)`` per step (and when the core goes idle),
        ``("rejected", request_id, message)`` for an add the core refused, ``("pong", n)``.
    Transport: the standard library's ``multiprocessing`` pipes (``send_bytes`` of a
    pickle), not pyzmq as vLLM: one frontend talks to the one core it spawned, so a pipe is
    all the addressing needed, the child's end reads EOF when its parent dies (no orphan),
    and nothing new is installed. Pickle is safe: both ends are this package.
"""

from __future__ import annotations

import dataclasses
import pickle
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

from minipaged.core.sched import (
    PaperScheduler,
    PaperSchedulerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    StaticBatchScheduler,
    get_max_num_kv_tokens,
)
from minipaged.sampling_params import SamplingParams
from minipaged.trace import EngineTrace, StepRecord, record_step

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "refused",
}


# -- what crosses (plain data) -------------------------------------------------------------
@dataclass
class EngineCoreRequest:
    """One sequence as the core runs it (vLLM's ``EngineCoreRequest``): already tokenized
    and validated; ``sampling_params`` has ``n == 1`` (the frontend fans ``n`` out)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    base_seed: int  # the sampler's per-sequence seed (``sample/sampler.py``)


@dataclass
class EngineCoreOutput:
    """What one request got from one step (vLLM's ``EngineCoreOutput``)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list] = None  # one ``Logprobs`` per new token, if asked for
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "refused" | None
    stop_reason: Optional[str] = None  # the scheduler's words: a refusal, an engine error

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """One step's outputs (vLLM's ``EngineCoreOutputs``) and what the server draws."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    step: Optional[StepRecord] = None  # None: no step ran (idle, or the step failed)
    requests: dict = field(default_factory=dict)  # trace info of arrived / finished requests
    stats: dict = field(default_factory=dict)  # free blocks, unfinished requests, step seconds
    error: Optional[str] = None  # the step raised: its requests are finished "abort"
    dead: Optional[str] = None  # why the core is unusable (EngineCoreProc)


@dataclass
class ModelInfo:
    """What a frontend knows of the model and pool (the core's ``ready`` message): no weights."""

    config: object  # the EngineConfig
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    num_blocks: int


def encode(msg) -> bytes:
    """A message as the bytes that cross the pipe."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)


_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))


def step_event(rec: StepRecord) -> dict:
    """A ``StepRecord`` as the dict ``/trace``, ``/metrics`` and the live view read.

    NOTE: a shallow copy, not ``dataclasses.asdict`` (a deep one, which cost a sixth of
    the core's Python time at saturation): ``record_step`` builds fresh lists and dicts
    for every record and nothing changes them afterwards, so sharing them is safe."""
    return {name: getattr(rec, name) for name in _STEP_FIELDS}


# -- building a core from a config ------------------------------------------------------------
def load_model_checked(config):
    """``minipaged.model.load_model`` with a ``ValueError`` for a model that is not there."""
    from minipaged.model import load_model

    try:
        return load_model(
            model=config.model,
            dtype=config.dtype,
            device=config.device,
            attention_backend=config.attention_backend,
        )
    except OSError as e:  # e.g. a hub id that cannot be reached or does not exist
        raise ValueError(f"model {config.model!r} could not be loaded: {e}") from e


def load_model_for(config):
    """(model, tokenizer) for ``config``: with tensor parallelism the checkpoint's shapes
    only (``load_model_meta``: each worker loads its own shard), else the whole model."""
    if config.tensor_parallel_size > 1:
        from minipaged.model.loader import load_model_meta

        return load_model_meta(config.model, config.tensor_parallel_size, config.device)
    return load_model_checked(config)


def resolve_max_model_len(config, model) -> int:
    limit = int(model.max_model_len)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context ({limit})")
    return config.max_model_len


def make_scheduler(config, num_blocks: int, num_cpu_blocks: int, max_model_len: int, paper: bool = False):
    """vLLM v1's scheduler, or the paper's where a paper mechanism is asked for
    (``preemption_mode="swap"``, ``parallel_sampling="fork"``, beam search: ``paper``)."""
    c = config
    kwargs = dict(
        num_blocks=num_blocks,
        block_size=c.block_size,
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        enable_chunked_prefill=c.enable_chunked_prefill,
        max_model_len=max_model_len,
        enable_prefix_caching=c.enable_prefix_caching,
    )
    if c.scheduling == "static":
        return StaticBatchScheduler(**kwargs)
    if paper or c.preemption_mode == "swap" or c.parallel_sampling == "fork":
        watermark = {} if c.watermark is None else {"watermark": c.watermark}
        return PaperScheduler(
            **kwargs,
            **watermark,
            preemption_mode=c.preemption_mode,
            num_cpu_blocks=num_cpu_blocks,
            parallel_sampling=c.parallel_sampling,
        )
    spec = c.speculative_config  # KV slots for a draft model's writes past each step
    return Scheduler(
        **kwargs,
        scheduler_reserve_full_isl=c.scheduler_reserve_full_isl,
        watermark=c.watermark or 0.0,
        num_lookahead_tokens=0 if spec is None else spec.num_lookahead_tokens,
    )


# -- the core ---------------------------------------------------------------------------------
class EngineCore:
    def __init__(self, scheduler, executor, *, trace_meta: Optional[dict] = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.trace_meta = dict(trace_meta or {})
        self.trace = self._new_trace()
        self.requests: dict[str, Request] = {}  # unfinished sequences, as the scheduler holds them
        self._sent: dict[str, int] = {}  # request id -> output tokens reported so far
        self._logprobs: dict[str, list] = {}  # request id -> its Logprobs entries (if asked)
        self._last: Optional[tuple[SchedulerOutput, int]] = None  # the step just ended, if nothing came since
        self._in_flight: Optional[SchedulerOutput] = None  # scheduled, not yet updated
        self.step_times = dict.fromkeys(("schedule", "prepare", "forward", "sample", "update"), 0.0)
        self.step_seconds = 0.0  # time spent in step(), summed
        self.num_steps = 0
        self.spec_decode_stats = None  # speculative decoding: drafts proposed and accepted
        self.spec_decode_log: list[dict[str, tuple]] = []
        self.model_info: Optional[ModelInfo] = None  # set by from_config

    @classmethod
    def from_config(cls, config, model) -> EngineCore:
        """The core of ``config`` over ``model`` (a loaded model, or with tensor parallelism
        its shapes only): the pool sized from ``kv_cache_memory``, the scheduler, the
        executor (one worker here, or N tensor-parallel worker processes), the draft model."""
        from minipaged.config import kv_cache_bytes_per_block
        from minipaged.executor import UniProcExecutor

        tp = config.tensor_parallel_size
        max_model_len = resolve_max_model_len(config, model)
        # NOTE: with tensor parallelism, per worker (its KVH / N heads of every block), as
        # kv_cache_memory is per worker (vLLM's gpu_memory_utilization is per GPU)
        bytes_per_block = kv_cache_bytes_per_block(
            model.num_layers, config.block_size, model.num_kv_heads // tp, model.head_dim, config.dtype,
            config.kv_cache_dtype,
        )  # fmt: skip
        num_blocks = config.num_blocks_for(bytes_per_block)
        num_cpu_blocks = config.cpu_blocks_for(num_blocks)
        scheduler = make_scheduler(config, num_blocks, num_cpu_blocks, max_model_len)
        paper = isinstance(scheduler, PaperScheduler)  # NOTE: its runner does the block moves
        if tp > 1:
            from minipaged.executor.multiproc import MultiprocExecutor

            executor = MultiprocExecutor(
                config.model, config.dtype, config.attention_backend, config.device, tp, num_blocks,
                config.block_size, config.seed, config.kv_cache_dtype, paper, num_cpu_blocks,
            )  # fmt: skip
        else:
            executor = UniProcExecutor(
                model, num_blocks, config.block_size, config.device, config.kv_cache_dtype, paper,
                num_cpu_blocks,
            )  # fmt: skip
        meta = {
            "model": config.model or "course_model",
            "scheduling": config.scheduling,
            "preemption_mode": config.preemption_mode,
            "enable_chunked_prefill": config.enable_chunked_prefill,
            "num_cpu_blocks": num_cpu_blocks,
            "max_model_len": max_model_len,
        }
        core = cls(scheduler, executor, trace_meta=meta)
        eos = getattr(model, "eos_token_ids", None)
        if eos is None:
            eos = [] if model.eos_token_id is None else [model.eos_token_id]
        core.model_info = ModelInfo(
            config, int(model.vocab_size), max_model_len, [int(e) for e in eos], num_blocks
        )
        core.num_cpu_blocks = num_cpu_blocks
        core.bytes_per_block = bytes_per_block
        if executor.model_runner is not None:  # NOTE: the worker times its own phases (in-process)
            executor.model_runner.step_times = core.step_times
        if config.speculative_config is not None:
            core._enable_speculation(config, model)
        return core

    def _enable_speculation(self, config, model) -> None:
        """The worker proposes and verifies drafts; a draft model gets its own paged cache."""
        from minipaged.spec_decode.metrics import SpecDecodeStats

        sc = config.speculative_config
        draft = None
        if sc.method == "draft_model":
            draft, _ = load_model_checked(
                dataclasses.replace(config, model=sc.model, speculative_config=None)
            )
            sc.verify_draft_model(model.vocab_size, draft.vocab_size)
        self.executor.model_runner.enable_speculation(sc, draft)
        self.spec_decode_stats = SpecDecodeStats()

    # -- the trace ------------------------------------------------------------------------
    def _new_trace(self, meta: Optional[dict] = None) -> EngineTrace:
        s = self.scheduler
        return EngineTrace(
            num_blocks=s.num_blocks,
            block_size=s.block_size,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            meta={**self.trace_meta, **(meta or {})},
        )

    def reset_trace(self, meta: Optional[dict] = None) -> EngineTrace:
        """Start a fresh trace (step numbers restart at 0); returns the old one."""
        old, self.trace = self.trace, self._new_trace(meta)
        self._last = None  # NOTE: its step number belongs to the old trace
        return old

    @property
    def step_index(self) -> int:
        """The number of the next step in the current trace."""
        return len(self.trace.steps)

    def _note_finished(self, req: Request, step: Optional[int] = None) -> None:
        info = self.trace.requests.get(req.request_id)
        if info is not None:
            info["output_len"] = req.num_output_tokens
            info["finish_step"] = self.step_index if step is None else step
            info["finish_reason"] = FINISH_REASONS.get(req.status, req.status.value)
            info["status"] = req.status.value
            info["stop_reason"] = req.stop_reason
            info["num_preemptions"] = req.num_preemptions

    # -- requests (between steps) -----------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_request_group([request])

    def add_request_group(self, requests: list[EngineCoreRequest]) -> None:
        """The n sequences of one caller request, all or none (``ValueError``): vLLM v1's
        independent children sharing the prompt through prefix caching, or, with
        ``parallel_sampling="fork"``, the paper's sequence group (``core/sched/paper.py``)."""
        for r in requests:
            if r.request_id in self.requests:
                raise ValueError(f"request_id {r.request_id!r} is already in the engine")
        reqs = []
        for r in requests:
            req = Request(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                eos_token_id=r.eos_token_id,
                arrival_time=float(self.step_index),
            )
            req.base_seed = r.base_seed
            reqs.append(req)
        self.scheduler.add_request_group(reqs)
        self._last = None  # NOTE: the last step's record no longer shows the state after it
        for req in reqs:
            self.requests[req.request_id] = req
            self._sent[req.request_id] = 0
            if req.sampling_params.logprobs is not None:
                self._logprobs[req.request_id] = []
            self.trace.requests[req.request_id] = {
                "prompt_len": req.num_prompt_tokens,
                "output_len": 0,
                "arrival_step": self.step_index,
                "finish_step": None,
            }

    def abort_requests(self, request_ids) -> None:
        """Finish the named requests as aborted and free their blocks now (unknown or
        finished ids are ignored, as vLLM's). Nothing is reported for them; the worker
        hears of them with the next step (it may be gone: a caller cleaning up after a
        failure)."""
        for req in self.scheduler.finish_requests(
            list(request_ids), RequestStatus.FINISHED_ABORTED, "aborted"
        ):
            self._note_finished(req)
            self._forget(req.request_id)

    def stop_requests(self, stops: list[tuple[str, str]]) -> None:
        """The frontend found a stop string in each named request's text: finish it as
        stopped (``reason``), its blocks free before the next step. Right after the step
        that made the token (nothing added since) it counts as finished in that step, as a
        request whose stop string is found by the step itself."""
        last = self._last
        for rid, reason in stops:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED, reason)
            elif last is not None and any(r.request_id == rid for r in last[0].finished):
                req = next(r for r in last[0].finished if r.request_id == rid)
                req.status, req.stop_reason = (
                    RequestStatus.FINISHED_STOPPED,
                    reason,
                )  # it also ended by length or EOS
            else:
                continue
            if last is not None and req not in last[0].finished:
                last[0].finished.append(req)
            self._note_finished(req, None if last is None else last[1])
            self._forget(rid)
        if last is not None and stops:  # the step's record, as it would have been
            out, step = last
            self.trace.steps[step] = record_step(self.scheduler, out, step)
        self._flush_if_idle()

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._sent.pop(request_id, None)
        self._logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One schedule + execute + update; an empty ``EngineCoreOutputs`` when there is nothing to run."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(stats=self.stats())
        step = self.step_index
        self._last = None
        t0 = clock = time.perf_counter()
        out = self.scheduler.schedule()  # who runs this step, and how many tokens each
        self._in_flight = out
        now = time.perf_counter()
        self.step_times["schedule"] += now - clock
        result = self.executor.execute_model(out)  # the worker sees out.for_worker() only
        clock = time.perf_counter()  # NOTE: the worker timed its own phases (prepare, forward, sample)
        sampled = self._sampled_requests(out, result)
        self._add_logprobs(sampled, result.logprobs)
        log = self._spec_log(out) if self.spec_decode_stats is not None else None
        finished = self.scheduler.update_from_output(out, result)  # append, stop, free
        if log is not None:
            self._spec_observe(result, log)
        out.finished = finished  # NOTE: the refused ones first
        for req in finished:
            self._note_finished(req, step)
        rec = record_step(self.scheduler, out, step)
        self.trace.record(rec)
        self._in_flight = None
        outputs = self._collect(sampled, finished)
        self._last = (out, step)
        self._flush_if_idle()
        end = time.perf_counter()
        self.step_times["update"] += end - clock
        self.step_seconds += end - t0
        self.num_steps += 1
        return EngineCoreOutputs(outputs, rec, self._request_infos(rec), self.stats())

    def _sampled_requests(self, out, result) -> list[Request]:
        """The requests that got a token this step (fork children after their parents)."""
        index, got = result.req_id_to_index, result.sampled_token_ids
        reqs = [r for r, _ in out.scheduled if r.request_id in index and got[index[r.request_id]]]
        if isinstance(out, PaperSchedulerOutput):
            reqs += [c for _, c in out.fork_samples if c.request_id in index and got[index[c.request_id]]]
        return reqs

    def _add_logprobs(self, reqs: list[Request], entries: dict) -> None:
        """Before the tokens are appended: ``entries[request_id]`` belongs to output
        position ``req.num_output_tokens`` (a position sampled again replaces its entry)."""
        for req in reqs:
            lps = self._logprobs.get(req.request_id)
            e = entries.get(req.request_id)
            if lps is not None and e is not None:
                del lps[req.num_output_tokens :]
                lps.append(e)

    def _collect(self, sampled: list[Request], finished: list[Request]) -> list[EngineCoreOutput]:
        """The new tokens of every request that moved; the finished ones are forgotten."""
        outputs = []
        for req in dict.fromkeys(sampled + finished):
            rid = req.request_id
            sent = self._sent.get(rid)
            if sent is None:
                continue  # aborted by the frontend
            ids = req.output_token_ids
            lps = self._logprobs.get(rid)
            reason = FINISH_REASONS.get(req.status) if req.is_finished else None
            outputs.append(
                EngineCoreOutput(
                    rid,
                    ids[sent:],
                    None if lps is None else lps[sent : len(ids)],
                    reason,
                    req.stop_reason if reason is not None else None,
                )
            )
            self._sent[rid] = len(ids)
            if reason is not None:
                self._forget(rid)
        return outputs

    def _request_infos(self, rec: StepRecord) -> dict:
        reqs = self.trace.requests
        return {rid: dict(reqs[rid]) for rid in list(rec.arrived_ids) + list(rec.finished_ids) if rid in reqs}

    def _flush_if_idle(self) -> None:
        """Finished ids ride on the next step's output (vLLM v1); a core going idle hands
        them over now, so the worker keeps nothing of a finished request."""
        s = self.scheduler
        if s.finished_req_ids and not s.has_unfinished_requests():
            idle = SchedulerOutput(finished_req_ids=s.finished_req_ids)
            s.finished_req_ids = set()
            self.executor.execute_model(idle)

    # -- speculative decoding ----------------------------------------------------------------
    def _spec_log(self, out) -> dict[str, tuple]:
        """Each scheduled request's table as the step runs it, and its lookahead: the slots
        the scheduler reserved past the step's tokens for a draft model's writes (as its
        ``schedule``: ``num_lookahead_tokens``, capped by the request's last possible token)."""
        s = self.scheduler
        log = {}
        for r, n in out.scheduled:
            room = get_max_num_kv_tokens(r, s.max_model_len) - r.num_computed_tokens - n
            log[r.request_id] = (
                s.kv_cache_manager.get_block_ids(r.request_id),
                r.num_computed_tokens,
                len(out.scheduled_spec_decode_tokens.get(r.request_id, ())),
                min(s.num_lookahead_tokens, room),
            )
        return log

    def _spec_observe(self, result, log: dict[str, tuple]) -> None:
        """Acceptance statistics; the drafts proposed go to the scheduler for the next step."""
        step = {}
        for rid, (blocks, computed, num_drafts, ahead) in log.items():
            accepted = len(result.sampled_token_ids[result.req_id_to_index[rid]]) - 1 if num_drafts else 0
            self.spec_decode_stats.observe(num_drafts, accepted)
            step[rid] = (blocks, computed, num_drafts, accepted, ahead)
        self.spec_decode_log.append(step)
        self.scheduler.update_draft_token_ids(result.draft_token_ids)  # for the next step

    # -- recovery -----------------------------------------------------------------------------
    def fail_step(self, exc: BaseException) -> EngineCoreOutputs:
        """Recover from a ``step()`` that raised ``exc``: every request of that step (and
        those it swapped out: their copy may be half made) is finished as "abort" with
        ``stop_reason`` naming the error, its blocks freed, the scheduler's step cleared,
        so the next ``step()`` runs. Returns the outputs of every request now finished."""
        reason = f"engine error: {type(exc).__name__}: {exc}"
        out, self._in_flight = self._in_flight, None
        failed = self.scheduler.fail_step(out, reason)
        suspects = [r.request_id for r in out.swapped_out] if isinstance(out, PaperSchedulerOutput) else []
        if out is None and self.trace.steps:  # it raised outside the step: the last step's
            suspects += list(self.trace.steps[-1].scheduled)
        failed += self.scheduler.finish_requests(suspects, RequestStatus.FINISHED_ABORTED, reason)
        # NOTE: and those the failed step had already finished or refused: reported as they ended
        failed += [r for r in self.requests.values() if r.is_finished and r not in failed]
        for req in failed:
            self._note_finished(req)
        self._last = None
        outputs = self._collect([], failed)
        self._flush_if_idle()
        return EngineCoreOutputs(outputs, None, {}, self.stats(), error=f"{type(exc).__name__}: {exc}")

    def abort_all(self, reason: str) -> list[EngineCoreOutput]:
        """Every unfinished request finished as "abort" (``reason``): the core is unusable."""
        reqs = self.scheduler.finish_requests(list(self.requests), RequestStatus.FINISHED_ABORTED, reason)
        for req in reqs:
            self._note_finished(req)
        return self._collect([], reqs)

    # -- numbers --------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "num_free_blocks": self.scheduler.kv_cache_manager.get_num_free_blocks(),
            "num_unfinished": self.scheduler.get_num_unfinished_requests(),
            "step_seconds": self.step_seconds,
            "num_steps": self.num_steps,
        }

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        self.executor.check_invariants()
        self.trace.check_invariants()
        for rid, req in self.requests.items():
            assert not req.is_finished or rid not in self.scheduler.requests, (
                f"request {rid} finished but is still held by the core"
            )

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor parallelism); a no-op in-process."""
        self.executor.shutdown()


# -- the core in a loop of its own (a process, or a thread of the server) -----------------------
class EngineCoreProc:
    """The busy loop around an ``EngineCore`` (vLLM's ``EngineCoreProc.run_busy_loop``):
    messages in from ``inq``, messages out to ``outq`` (see the module docstring), never
    waiting on the frontend. One turn::

        apply every message that has arrived       adds, aborts, stops (never during a step)
        if no request is unfinished: report idle once, block until a message arrives
        core.step() (or, if it raised, core.fail_step)  -> ("outputs", EngineCoreOutputs)

    The one place a failed step is recovered and the core declared dead."""

    def __init__(
        self,
        core: EngineCore,
        *,
        check_invariants: bool = False,
        max_step_failures: int = 3,
        max_trace_steps: int = 2048,
    ) -> None:
        self.core = core
        self.check_invariants = check_invariants
        self.max_step_failures = max_step_failures
        self.max_trace_steps = max_trace_steps
        self.step_offset = 0  # global step number of the trace's step 0
        self.consecutive_failures = 0
        self.dead: Optional[str] = None
        self.errors: list[str] = []

    def handle(self, msg) -> list:
        """Apply one input message; returns the messages it answers with (refusals)."""
        kind, core = msg[0], self.core
        replies = []
        if kind == "add":
            for rid, group in msg[1]:
                if self.dead is not None:
                    replies.append(("rejected", rid, f"the engine is unusable: {self.dead}"))
                    continue
                try:
                    core.add_request_group(group)
                except ValueError as exc:
                    replies.append(("rejected", rid, str(exc)))
        elif kind == "abort":
            core.abort_requests(msg[1])
        elif kind == "stop":
            core.stop_requests(msg[1])
        return replies

    def step(self) -> EngineCoreOutputs:
        """One step, its record numbered globally; a failed one recovered."""
        core = self.core
        if core.step_index >= self.max_trace_steps:
            self.reset_trace()
        try:
            outs = core.step()
            if self.check_invariants:
                core.check_invariants()
        except Exception as exc:
            return self._fail(exc)
        self.consecutive_failures = 0
        if outs.step is not None:
            outs.step = dataclasses.replace(outs.step, step=outs.step.step + self.step_offset)
        return outs

    def _fail(self, exc: BaseException) -> EngineCoreOutputs:
        """A step raised: fail its requests; after ``max_step_failures`` in a row, or a
        recovery that raised too, the core is dead: every request aborted."""
        msg = f"{type(exc).__name__}: {exc}"
        self.errors.append(msg)
        self.consecutive_failures += 1
        print(
            "minipaged engine core: the engine step failed; its requests get an error\n"
            + "".join(traceback.format_exception(exc)),
            file=sys.stderr,
        )
        outs = EngineCoreOutputs(error=msg)
        try:
            outs = self.core.fail_step(exc)
            if self.check_invariants:
                self.core.check_invariants()
        except Exception as exc2:
            self.dead = f"recovery from {msg} failed: {type(exc2).__name__}: {exc2}"
        if self.dead is None and self.consecutive_failures >= self.max_step_failures:
            self.dead = f"{self.consecutive_failures} steps in a row failed, the last with {msg}"
        if self.dead is not None:
            print(f"minipaged engine core: the engine is unusable: {self.dead}", file=sys.stderr)
            try:
                outs.outputs += self.core.abort_all(f"the engine is unusable: {self.dead}")
            except Exception:  # noqa: BLE001 - what cannot be aborted is dropped
                self.core.requests.clear()
            outs.dead = self.dead
        outs.stats = self.core.stats()
        return outs

    def reset_trace(self) -> None:
        old = self.core.reset_trace()
        self.step_offset += len(old.steps)

    def run_busy_loop(self, inq: queue.Queue, outq: queue.Queue) -> None:
        """Step while there is work; returns on ``("shutdown",)``. ``outq`` gets
        ``("ready", ModelInfo)`` first."""
        outq.put(("ready", self.core.model_info))
        idle = True
        while True:
            msgs = [inq.get()] if idle else []  # idle: block until something arrives
            while True:  # NOTE: everything that has arrived, before the next step
                try:
                    msgs.append(inq.get_nowait())
                except queue.Empty:
                    break
            for m in msgs:
                if m[0] == "shutdown":
                    return
                if m[0] == "ping":
                    outq.put(("pong", m[1]))
                    continue
                for reply in self.handle(m):
                    outq.put(reply)
            if self.dead is None and self.core.has_unfinished_requests():
                outq.put(("outputs", self.step()))
                idle = False
                continue
            if not idle or msgs:  # ran out of work (or aborts applied while idle): say so
                if not idle:
                    self.reset_trace()  # bounded memory: a fresh trace per busy period
                outq.put(("outputs", EngineCoreOutputs(stats=self.core.stats(), dead=self.dead)))
            idle = True


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
    """The child process: build the core from ``config``, answer ``ready`` (or ``error``),
    then run the busy loop until the frontend says stop or goes away. An input thread
    reads the pipe (and answers pings at once: a core busy in a long step still answers),
    an output thread writes it, so the step never waits on the frontend."""
    import signal

    # NOTE: Ctrl-C reaches the whole process group; the frontend decides when the core stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from minipaged.kernels.selector import keep_triton_out

    keep_triton_out(config)  # NOTE: no Triton kernel runs in a CPU core: torch must not import it
    try:
        import os

        import torch

        threads = options.pop("threads", 0)
        # NOTE: by default one CPU is left to the frontend process (vLLM's CPU backend
        # reserves one too, VLLM_CPU_NUM_OF_RESERVED_CPU): torch's threads wait on each
        # other, so one of them descheduled by the frontend stalls every op of the step
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) - 1))
        torch.manual_seed(config.seed)
        model, _ = load_model_for(config)
        proc = EngineCoreProc(EngineCore.from_config(config, model), **options)
    except Exception as exc:  # a bad model or config: the frontend says why and exits
        msg = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        try:
            conn_out.send_bytes(encode(("error", msg)))
        except OSError:
            pass
        return
    freeze_gc_heap()
    inq: queue.Queue = queue.Queue()
    outq: queue.Queue = queue.Queue()

    def receive() -> None:
        try:
            while True:
                msg = decode(conn_in.recv_bytes())
                if msg[0] == "ping":  # NOTE: answered here, not after the step in progress
                    outq.put(("pong", msg[1]))
                else:
                    inq.put(msg)
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
    try:
        proc.run_busy_loop(inq, outq)
    finally:
        outq.put(None)
        sender.join(5)
        proc.core.shutdown()  # its tensor-parallel workers, if any
