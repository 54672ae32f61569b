"""LLMEngine: the offline frontend. Prompts in, one engine-core step per ``step()``, outputs out.

Mirrors vLLM v1 ``vllm/v1/engine/llm_engine.py``: a ``Processor`` (validate, tokenize, fan
``n`` out), an ``EngineCoreClient`` (here always in-process: ``InprocClient``) and an
``OutputProcessor`` (detokenize, stop strings, logprobs, ``n > 1`` fan-in). One step::

    outputs   = engine_core.get_output()             EngineCore.step(): schedule, execute, update
    processed = output_processor.process_outputs(outputs.outputs)   text, stop strings
    engine_core.stop_requests(processed.reqs_to_stop)                (vLLM: abort_requests)
    return the finished RequestOutputs

The scheduler is vLLM v1's (``core/sched/scheduler.py``) unless a paper mechanism is asked
for (``preemption_mode="swap"``, ``parallel_sampling="fork"``, beam search): then the
paper's (``core/sched/paper.py``); see ``engine/core.py``.

Inputs
    ``add_request(request_id, prompt, sampling_params)``: a prompt string or a list of
    token ids. ``SamplingParams(n > 1)`` becomes n sequences ``"{id}.{j}"``.
Outputs
    ``step()`` -> the ``RequestOutput`` of every request that finished (or was refused)
    during that step. ``trace`` is the core's ``EngineTrace`` since the last ``reset_trace()``.
    NOTE: ``scheduler``, ``executor``, ``kv_cache_manager``, ``model_runner`` and ``trace``
    look into the in-process core, for the course's pictures and tests (vLLM's
    ``LLMEngine`` has no such window).
Invariants
    every request added is eventually returned by some ``step()`` exactly once, unless
    aborted; ``check_invariants()`` checks the core (scheduler, cache manager, trace).
Failure mode
    bad caller input (empty prompt, a prompt longer than the model's context, a token id
    outside the vocabulary, a duplicate request id, an unknown model) raises ``ValueError``
    before anything is queued. A request that can never fit in the KV pool is *refused* by
    the scheduler: it comes back with ``finish_reason == "refused"`` and the reason in
    ``stop_reason``; the other requests are unaffected.
"""

from __future__ import annotations

from typing import Optional

import torch

from minipaged.config import EngineConfig
from minipaged.engine.core import EngineCore, load_model_for
from minipaged.engine.core_client import InprocClient
from minipaged.engine.output_processor import OutputProcessor
from minipaged.engine.outputs import RequestOutput
from minipaged.engine.processor import Processor, PromptType, normalize_prompts
from minipaged.sampling_params import SamplingParams

__all__ = ["LLMEngine", "normalize_prompts"]


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
        if model is None:
            model, tokenizer = load_model_for(config)
        self.model = model
        self.tokenizer = tokenizer
        core = EngineCore.from_config(config, model)
        self.engine_core = InprocClient(core)
        info = core.model_info
        self.max_model_len = info.max_model_len
        self.processor = Processor(info, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a request (the first as its EOS, the others as stop tokens)."""
        return self.processor.model_info.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.processor.model_info.eos_token_ids = [int(e) for e in ids]

    # -- a window onto the in-process core (see the module docstring) ----------------------
    @property
    def core(self) -> EngineCore:
        return self.engine_core.engine_core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def executor(self):
        return self.core.executor

    @property
    def kv_cache_manager(self):
        return self.core.scheduler.kv_cache_manager

    @property
    def model_runner(self):
        return self.core.executor.model_runner

    @property
    def trace(self):
        return self.core.trace

    @property
    def num_blocks(self) -> int:
        return self.core.model_info.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.core.num_cpu_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.core.bytes_per_block

    @property
    def step_times(self) -> dict:
        """Seconds spent in each phase of the core's steps, summed (the benchmark's profile)."""
        return self.core.step_times

    @property
    def spec_decode_stats(self):
        return self.core.spec_decode_stats

    @property
    def spec_decode_log(self) -> list:
        return self.core.spec_decode_log

    @property
    def step_index(self) -> int:
        return self.core.step_index

    def reset_trace(self, meta: Optional[dict] = None):
        """Start a fresh trace (step numbers restart at 0); returns the old one."""
        return self.core.reset_trace(meta)

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, name: str = "prompt") -> tuple[Optional[str], list[int]]:
        """(prompt string or None, token ids), validated: ``ValueError`` on bad input."""
        return self.processor.tokenize(prompt, name)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        *,
        stream: bool = False,
        _tokenized: Optional[tuple[Optional[str], list[int]]] = None,
    ) -> None:
        """Queue one request (n sequences if ``sampling_params.n > 1``). ``stream``: every
        ``step()`` that moves it returns its partial (cumulative) output too."""
        request_id = str(request_id)
        if request_id in self.output_processor.request_states:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        params = self.processor.verify_params(sampling_params)
        text, ids = _tokenized if _tokenized is not None else self.tokenize(prompt)
        children = self.processor.process_inputs(request_id, ids, params)
        self.engine_core.add_request_group(children)
        self.output_processor.add_request(request_id, text, ids, params, children, stream=stream)

    def abort_request(self, request_id: str) -> None:
        """Drop a request (all its sequences); its blocks are freed. Unknown ids: ValueError."""
        if str(request_id) not in self.output_processor.request_states:
            raise ValueError(f"unknown request_id {request_id!r}")
        self.engine_core.abort_requests(self.output_processor.abort_request(str(request_id)))

    def get_unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.request_states)

    def has_unfinished_requests(self) -> bool:
        """Requests not yet returned, or (a server's ``AsyncLLM`` steps this engine's
        core) sequences its core still runs."""
        return self.output_processor.has_unfinished_requests() or self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine-core step; returns the requests finished now (and the partial
        outputs of the streamed ones that moved)."""
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_stop:  # NOTE: their blocks are free before the next step
            self.engine_core.stop_requests(processed.reqs_to_stop)
        return processed.request_outputs

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor parallelism); a no-op in-process."""
        self.engine_core.shutdown()

    def check_invariants(self) -> None:
        self.core.check_invariants()
        held = set(self.core.requests)
        for rid, state in self.output_processor.request_states.items():
            assert not state.finished, f"request {rid} finished but is still held by the engine"
            for s in state.samples:
                assert s.finished or s.seq_id in held, f"sequence {s.seq_id} is unknown to the engine core"
