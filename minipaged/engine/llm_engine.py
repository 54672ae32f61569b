"""LLMEngine: requests in, one scheduler step + one forward per ``step()``, outputs out.

Mirrors vLLM ``vllm/v1/engine/llm_engine.py`` + ``core.py`` (and nano-vllm's
``engine/llm_engine.py``), without processes or queues: one loop, readable top to bottom.

One step (the data path)::

    out    = scheduler.schedule()                  who runs, how many tokens each, new blocks
    result = executor.execute_model(out)           the worker: its own block tables from
                                                   out.for_worker(), block copies, forward, sample
    done   = scheduler.update_from_output(out, result.sampled_token_ids)   append, stop, free
    output_processor: stop strings -> scheduler.finish_requests(...)       (vLLM's frontend)
    trace.record(StepRecord)                       what the pictures are drawn from

The scheduler is vLLM v1's (``core/sched/scheduler.py``) unless a paper mechanism is asked
for (``preemption_mode="swap"``, ``parallel_sampling="fork"``, beam search): then the
paper's (``core/sched/paper.py``). The executor only ever sees the output's plain half.

Inputs
    ``add_request(request_id, prompt, sampling_params)``: a prompt string (tokenized with
    the model's tokenizer, special tokens added as by ``tokenizer(prompt)``) or a list of
    token ids. ``SamplingParams(n > 1)`` becomes n sequences ``"{id}.{j}"``: by default
    (``parallel_sampling="prefix"``, vLLM v1) n independent requests that share the prompt's
    full blocks through prefix caching; with ``"fork"`` a sequence group whose prompt is
    prefilled once and forked with copy-on-write (the paper, chapter 06).
Outputs
    ``step()`` -> the ``RequestOutput`` of every request that finished (or was refused)
    during that step. ``trace`` is the ``EngineTrace`` since the last ``reset_trace()``.

Invariants
    every request added is eventually returned by some ``step()`` exactly once;
    ``check_invariants()`` checks the scheduler, the cache manager and the trace.

Failure mode
    bad caller input (empty prompt, a prompt longer than the model's context, a token id
    outside the vocabulary, a duplicate request id, an unknown model) raises ``ValueError``
    before anything is queued. A request that can never fit in the KV pool is *refused* by
    the scheduler: it comes back with ``finish_reason == "refused"`` and the reason in
    ``stop_reason``; the other requests are unaffected.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from minipaged.config import EngineConfig, kv_cache_bytes_per_block
from minipaged.core.sched import (
    PaperScheduler,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    StaticBatchScheduler,
    spec,
)
from minipaged.engine.output_processor import OutputProcessor
from minipaged.engine.outputs import RequestOutput
from minipaged.engine.sampler import request_base_seed
from minipaged.executor import UniProcExecutor
from minipaged.sampling_params import SamplingParams, verify_sampling_params
from minipaged.trace import EngineTrace, record_step

PromptType = Union[str, Sequence[int]]


def normalize_prompts(prompts) -> list:
    """A list of prompts, each a string or a list of token ids."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string or a list, got {type(prompts).__name__}")
    if len(prompts) > 0 and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]  # one prompt given as token ids
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, (list, tuple)):
            out.append(list(p))
        else:
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
    return out


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "refused",
}


@dataclass
class _RequestGroup:
    """One caller request: its n sequences (scheduler Requests, each with its seed)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def load_model_checked(config: EngineConfig):
    """``minipaged.model.load_model`` with a ``ValueError`` for a model that is not there."""
    from minipaged.model import load_model

    model = config.model
    try:
        return load_model(
            model=model,
            dtype=config.dtype,
            device=config.device,
            attention_backend=config.attention_backend,
        )
    except OSError as e:  # e.g. a hub id that cannot be reached or does not exist
        raise ValueError(f"model {model!r} could not be loaded: {e}") from e


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None, model=None, tokenizer=None, **kwargs):
        if config is None:
            config = EngineConfig(**kwargs)
        elif kwargs:
            raise ValueError(f"pass either config or keyword arguments, not both: {sorted(kwargs)}")
        self.config = config
        torch.manual_seed(config.seed)
        tp = config.tensor_parallel_size
        if tp > 1 and model is not None:
            raise ValueError(
                f"tensor_parallel_size={tp}: pass the checkpoint as config.model (each worker loads its "
                "shard), not a model object"
            )
        if tp > 1:  # the driver holds no weights: the checkpoint's shapes only
            from minipaged.model.loader import load_model_meta

            model, tokenizer = load_model_meta(config.model, tp, config.device)
        elif model is None:
            model, tokenizer = load_model_checked(config)
        self.model = model
        self.tokenizer = tokenizer
        eos = getattr(model, "eos_token_ids", None)
        if eos is None:
            eos = [] if model.eos_token_id is None else [model.eos_token_id]
        self.eos_token_ids: list[int] = [int(e) for e in eos]
        self.max_model_len = self._resolve_max_model_len(config, model)
        # NOTE: with tensor parallelism, per worker (its KVH / N heads of every block), as
        # kv_cache_memory is per worker (vLLM's gpu_memory_utilization is per GPU)
        self.bytes_per_block = kv_cache_bytes_per_block(
            model.num_layers,
            config.block_size,
            model.num_kv_heads // tp,
            model.head_dim,
            config.dtype,
            config.kv_cache_dtype,
        )
        self.num_blocks = config.num_blocks_for(self.bytes_per_block)
        self.num_cpu_blocks = config.cpu_blocks_for(self.num_blocks)
        self.scheduler = self._make_scheduler()
        if tp > 1:
            from minipaged.executor.multiproc import MultiprocExecutor

            self.executor = MultiprocExecutor(
                config.model, config.dtype, config.attention_backend, config.device, tp,
                self.num_blocks, config.block_size, self.num_cpu_blocks, config.seed,
                config.kv_cache_dtype,
            )  # fmt: skip
        else:
            self.executor = UniProcExecutor(
                model,
                self.num_blocks,
                config.block_size,
                self.num_cpu_blocks,
                config.device,
                config.kv_cache_dtype,
            )
        self.output_processor = OutputProcessor(tokenizer)  # text, stop strings, logprobs
        self.groups: dict[str, _RequestGroup] = {}  # unfinished caller requests
        self.seq_to_group: dict[str, _RequestGroup] = {}  # scheduler request id -> group
        self.trace = self._new_trace()
        # seconds spent in each phase of step(), summed (for the benchmark's profile)
        self.step_times = dict.fromkeys(("schedule", "prepare", "forward", "sample", "update"), 0.0)
        if self.model_runner is not None:  # NOTE: the worker times its own phases (in-process)
            self.model_runner.step_times = self.step_times
        self.spec_decode_stats = None  # speculative decoding: drafts proposed and accepted
        if config.speculative_config is not None:
            self._enable_speculation(config.speculative_config)

    # -- construction helpers ------------------------------------------------------
    @staticmethod
    def _resolve_max_model_len(config: EngineConfig, model) -> int:
        limit = int(model.max_model_len)
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context ({limit})")
        return config.max_model_len

    def _enable_speculation(self, spec) -> None:
        """The worker proposes and verifies drafts; a draft model gets its own paged cache."""
        from minipaged.spec_decode.rejection_sampler import SpecDecodeStats

        draft = None
        if spec.method == "draft_model":
            draft, _ = load_model_checked(
                dataclasses.replace(self.config, model=spec.model, speculative_config=None)
            )
            spec.verify_draft_model(self.model.vocab_size, draft.vocab_size)
        self.model_runner.enable_speculation(spec, draft)
        self.spec_decode_stats = SpecDecodeStats()
        # per step, per request: (block ids, computed before, drafts, accepted, lookahead)
        self.spec_decode_log: list[dict[str, tuple]] = []

    def _make_scheduler(self, paper: bool = False):
        """vLLM v1's scheduler, or the paper's where a paper mechanism is asked for."""
        c = self.config
        kwargs = dict(
            num_blocks=self.num_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            enable_chunked_prefill=c.enable_chunked_prefill,
            max_model_len=self.max_model_len,
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
                num_cpu_blocks=self.num_cpu_blocks,
                parallel_sampling=c.parallel_sampling,
            )
        sched = Scheduler(
            **kwargs, scheduler_reserve_full_isl=c.scheduler_reserve_full_isl, watermark=c.watermark or 0.0
        )
        if c.speculative_config is not None:  # KV slots for a draft model's writes past each step
            sched.spec_decode.num_lookahead_tokens = c.speculative_config.num_lookahead_tokens
        return sched

    def _new_trace(self, meta: Optional[dict] = None) -> EngineTrace:
        c = self.config
        m = {
            "model": c.model or "course_model",
            "scheduling": c.scheduling,
            "preemption_mode": c.preemption_mode,
            "enable_chunked_prefill": c.enable_chunked_prefill,
            "num_cpu_blocks": self.num_cpu_blocks,
            "max_model_len": self.max_model_len,
        }
        m.update(meta or {})
        return EngineTrace(
            num_blocks=self.num_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            meta=m,
        )

    def reset_trace(self, meta: Optional[dict] = None) -> EngineTrace:
        """Start a fresh trace (step numbers restart at 0); returns the old one."""
        old, self.trace = self.trace, self._new_trace(meta)
        return old

    @property
    def kv_cache_manager(self):
        return self.scheduler.kv_cache_manager

    @property
    def model_runner(self):
        return self.executor.model_runner

    @property
    def step_index(self) -> int:
        """The number of the next step in the current trace."""
        return len(self.trace.steps)

    # -- requests ------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, name: str = "prompt") -> tuple[Optional[str], list[int]]:
        """(prompt string or None, token ids), validated: ``ValueError`` on bad input."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{name} is a string but this engine has no tokenizer")
            ids = list(self.tokenizer(prompt)["input_ids"]) if prompt else []
            text: Optional[str] = prompt
        else:
            if any(isinstance(t, bool) for t in prompt):  # NOTE: True / False are not token ids
                raise ValueError(f"{name} must be a string or a list of int token ids, got {prompt!r}")
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError(f"{name} must be a string or a list of int token ids, got {prompt!r}")
            text = None
        if len(ids) == 0:
            raise ValueError(f"{name} is empty: a request needs at least one prompt token")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"{name} has {len(ids)} tokens, longer than the model's context "
                f"(max_model_len={self.max_model_len})"
            )
        vocab = int(self.model.vocab_size)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} holds token id {bad[0]} outside the vocabulary [0, {vocab})")
        return text, ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        *,
        _tokenized: Optional[tuple[Optional[str], list[int]]] = None,
    ) -> None:
        """Queue one request (n sequences if ``sampling_params.n > 1``)."""
        request_id = str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        verify_sampling_params(
            params,
            int(self.model.vocab_size),
            self.config.max_num_seqs,
            has_tokenizer=self.tokenizer is not None,
        )
        text, ids = _tokenized if _tokenized is not None else self.tokenize(prompt)
        group = _RequestGroup(request_id, text, ids, params)
        seq_params = dataclasses.replace(params, n=1) if params.n > 1 else params
        # NOTE: a Request stops on one eos_token_id; a model with several (a generation
        # config listing more than one) stops on the others as stop tokens.
        extra_eos = [e for e in self.eos_token_ids[1:] if e not in seq_params.stop_token_ids]
        if extra_eos and not seq_params.ignore_eos:
            seq_params = dataclasses.replace(seq_params, stop_token_ids=seq_params.stop_token_ids + extra_eos)
        for j in range(params.n):
            sid = request_id if params.n == 1 else f"{request_id}.{j}"
            req = Request(
                request_id=sid,
                prompt_token_ids=ids,
                sampling_params=seq_params,
                eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
                arrival_time=float(self.step_index),
            )
            req.base_seed = request_base_seed(params, self.config.seed, request_id, j)
            group.seqs.append(req)
        self.groups[request_id] = group
        self.output_processor.add_request(group.seqs, ids, params)
        for req in group.seqs:
            self.seq_to_group[req.request_id] = group
            self.trace.requests[req.request_id] = {
                "prompt_len": len(ids),
                "output_len": 0,
                "arrival_step": self.step_index,
                "finish_step": None,
            }
        # NOTE: n > 1: n child requests sharing the prompt through prefix caching (vLLM v1),
        # or, with parallel_sampling="fork", a sequence group (the paper; see groups.py)
        self.scheduler.add_request_group(group.seqs)

    def abort_request(self, request_id: str) -> None:
        """Drop a request (all its sequences); its blocks are freed. Unknown ids: ValueError."""
        group = self.groups.get(str(request_id))
        if group is None:
            raise ValueError(f"unknown request_id {request_id!r}")
        for req in group.seqs:
            if not req.is_finished:
                self.scheduler.abort_request(req.request_id)
                self._note_finished(req)
        self._pop_group(group)

    def finish_sequence(self, seq_id: str, stop_reason: str) -> None:
        """Finish sequence ``seq_id`` as stopped (``FINISHED_STOPPED``, ``stop_reason``), now:
        its blocks are free before the next step. ``minipaged serve``'s engine core calls
        it when the frontend found a stop string in the sequence's text (vLLM v1: the
        output processor aborts the request). Unknown or finished sequences: a no-op."""
        group = self.seq_to_group.get(str(seq_id))
        req = None if group is None else next(r for r in group.seqs if r.request_id == seq_id)
        if req is None or req.is_finished:
            return
        self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED, stop_reason)
        self._note_finished(req)
        if group.finished:
            self._pop_group(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # -- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One schedule + execute + update. Returns the requests finished now."""
        step = self.step_index
        lap = self._stopwatch()
        out = self.scheduler.schedule()  # who runs this step, and how many tokens each
        lap("schedule")
        result = self.executor.execute_model(out)  # the worker sees out.for_worker() only
        lap(None)  # NOTE: the worker timed its own phases (prepare, forward, sample)
        self.output_processor.add_logprobs(self._sampled_requests(out, result), result.logprobs)
        # NOTE: the returned list starts with the requests refused this step.
        log = self._spec_log(out) if self.spec_decode_stats is not None else None
        finished = self.scheduler.update_from_output(out, result.sampled_token_ids)  # append, stop, free
        if log is not None:
            self._spec_observe(out, result, log)
        finished += self._check_stop_strings(out, result)
        out.finished = finished
        for req in finished:
            self._note_finished(req, step)
        self.trace.record(record_step(self.scheduler, out, step))
        outputs = self._collect_outputs(finished)
        if self.scheduler.finished_req_ids and not self.scheduler.has_unfinished_requests():
            # NOTE: finished ids ride on the next step's output (vLLM v1); an engine going
            # idle hands them over now, so the worker keeps nothing of a finished request
            idle = SchedulerOutput(finished_req_ids=self.scheduler.finished_req_ids)
            self.scheduler.finished_req_ids = set()
            self.executor.execute_model(idle)
        lap("update")
        return outputs

    def _spec_log(self, out) -> dict[str, tuple]:
        """Each scheduled request's table as the step runs it (before rejected slots go)."""
        kv = self.kv_cache_manager
        return {
            r.request_id: (
                kv.get_block_ids(r.request_id),
                r.num_computed_tokens,
                len(out.scheduled_spec_decode_tokens.get(r.request_id, ())),
                out.num_lookahead_slots.get(r.request_id, 0),
            )
            for r, _ in out.scheduled
        }

    def _spec_observe(self, out, result, log: dict[str, tuple]) -> None:
        """Acceptance statistics; the drafts proposed go to the scheduler for the next step."""
        step = {}
        for rid, (blocks, computed, num_drafts, ahead) in log.items():
            accepted = len(result.sampled_token_ids[rid]) - 1 if num_drafts else 0
            self.spec_decode_stats.observe(num_drafts, accepted)
            step[rid] = (blocks, computed, num_drafts, accepted, ahead)
        self.spec_decode_log.append(step)
        spec.update_draft_token_ids(self.scheduler, result.draft_token_ids)  # for the next step

    def _sampled_requests(self, out, result) -> list[Request]:
        """The requests that got a token this step (fork children after their parents)."""
        got = result.sampled_token_ids
        reqs = [r for r, _ in out.scheduled if r.request_id in got]
        return reqs + [c for _, c in out.fork_samples if c.request_id in got]

    def _check_stop_strings(self, out, result) -> list[Request]:
        """vLLM v1's output processor: a request whose text now ends a stop string is
        finished by the scheduler (``finish_requests``), in this very step, so its blocks
        are free before the next ``schedule()``. Returns the requests it finished."""
        stopped = []
        for req in self._sampled_requests(out, result):
            s = self.output_processor.check_stop_strings(req)
            if s is None:
                continue
            reason = f"stop string {s!r}"
            if req.is_finished:  # its last token also ended it by length or EOS
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, reason
            else:
                stopped += self.scheduler.finish_requests(
                    [req.request_id], RequestStatus.FINISHED_STOPPED, reason
                )
        return stopped

    def _stopwatch(self):
        """``lap(phase)`` adds the seconds since the previous lap to ``step_times[phase]``."""
        times, clock = self.step_times, time.perf_counter
        last = [clock()]

        def lap(phase: Optional[str]) -> None:
            now = clock()
            if phase is not None:
                times[phase] += now - last[0]
            last[0] = now

        return lap

    def _note_finished(self, req: Request, step: Optional[int] = None) -> None:
        info = self.trace.requests.get(req.request_id)
        if info is not None:
            info["output_len"] = req.num_output_tokens
            info["finish_step"] = self.step_index if step is None else step
            info["finish_reason"] = FINISH_REASONS.get(req.status, req.status.value)
            info["status"] = req.status.value
            info["stop_reason"] = req.stop_reason
            info["num_preemptions"] = req.num_preemptions

    def _collect_outputs(self, finished: list[Request]) -> list[RequestOutput]:
        outputs = []
        for group in {
            id(self.seq_to_group[r.request_id]): self.seq_to_group[r.request_id] for r in finished
        }.values():
            if group.finished and group.request_id in self.groups:
                outputs.append(self.make_output(group))
                self._pop_group(group)
        return outputs

    def _pop_group(self, group: _RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        self.output_processor.remove(group.seqs)
        for req in group.seqs:
            self.seq_to_group.pop(req.request_id, None)

    def make_output(self, group: _RequestGroup) -> RequestOutput:
        completions = []
        for j, req in enumerate(group.seqs):
            reason = FINISH_REASONS.get(req.status) if req.is_finished else None
            completions.append(self.output_processor.make_completion(j, req, reason))
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=list(group.prompt_token_ids),
            outputs=completions,
            finished=all(c.finish_reason is not None for c in completions),
        )

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def fail_step(self, exc: BaseException) -> list[RequestOutput]:
        """Recover from a ``step()`` that raised ``exc``: every request of the failed step
        (all the sequences of its caller request, and those it swapped out: their copy may
        be half made) is finished as "abort" with ``stop_reason`` naming the error, its
        blocks freed, the scheduler's in-flight step cleared, so the next ``step()`` runs.
        Returns the outputs of every request this leaves finished (the failed ones, and any
        the failed step had already finished or refused); the others go on unharmed."""
        reason = f"engine error: {type(exc).__name__}: {exc}"
        # NOTE: the step's SchedulerOutput, if schedule() returned and update_from_output()
        # did not finish; else the failure is traced to the requests of the last step.
        out = getattr(self.scheduler, "_in_flight", None)
        suspects = [r.request_id for r in self.scheduler.fail_step(out, reason)]
        if out is not None:
            suspects += [r.request_id for r in out.swapped_out]
        elif self.trace.steps:
            suspects += list(self.trace.steps[-1].scheduled)
        for sid in suspects:
            group = self.seq_to_group.get(sid)
            for r in [] if group is None else group.seqs:
                if not r.is_finished:
                    self.scheduler.abort_request(r.request_id)
                    r.stop_reason = reason
        done = []
        for group in list(self.groups.values()):
            if group.finished:
                for r in group.seqs:
                    self._note_finished(r)
                done.append(self.make_output(group))
                self._pop_group(group)
        return done

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor parallelism); a no-op in-process."""
        self.executor.shutdown()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        self.executor.check_invariants()
        self.trace.check_invariants()
        for rid, group in self.groups.items():
            assert not group.finished, f"request {rid} finished but is still held by the engine"
            for req in group.seqs:
                assert self.seq_to_group.get(req.request_id) is group, (
                    f"sequence {req.request_id} lost its group"
                )
