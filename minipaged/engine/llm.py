"""LLM: the offline-inference front door, ``LLM(...).generate(prompts, params)``.

Mirrors vLLM ``vllm/entrypoints/llm.py``.

Inputs
    ``LLM(**kwargs)``: the fields of ``minipaged.config.EngineConfig`` (the public ones are
    named in ``LLM.__init__``; ``kv_cache_memory``, ``num_cpu_blocks``, ``max_model_len`` and
    ``parallel_sampling`` are extras).
    ``generate(prompts, sampling_params=None, use_tqdm=True)``: ``prompts`` is a string, a
    list of strings, one list of token ids, or a list of token-id lists;
    ``sampling_params`` is one ``SamplingParams`` for all or a list with one per prompt
    (None -> ``SamplingParams()``).
Outputs
    one ``RequestOutput`` per prompt, in prompt order. ``llm.trace`` is the ``EngineTrace``
    of the last ``generate`` call (steps numbered from 0; every prompt arrives at step 0).

Determinism
    request ``i`` of a call gets id ``str(i)``; unless its params carry a ``seed``, its
    random draws are seeded from (the engine ``seed``, ``str(i)``, the output position),
    so the same call on a fresh or a used ``LLM`` gives the same texts, and a request's
    text does not depend on the other prompts (see ``minipaged/sample/sampler.py``).

Failure mode
    every prompt and every ``SamplingParams`` is validated before any is queued: an empty
    prompt, one longer than the model's context, a mismatched number of
    ``sampling_params``, a stop token id outside the vocabulary, ``n > max_num_seqs``
    (never schedulable), ``logprobs`` above ``MAX_LOGPROBS`` -> ``ValueError``, and nothing
    runs. ``LLM(...)`` raises ``ValueError`` for a bad configuration before it allocates
    anything (``minipaged/config.py``), including a KV cache larger than the free memory. A request that can never fit in the KV pool is not an error of the
    call: its ``CompletionOutput`` has ``finish_reason == "refused"`` and the reason in
    ``stop_reason`` (a warning is printed too); the other requests are unaffected.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Optional, Union

from minipaged.config import EngineConfig
from minipaged.engine.beam_search import beam_search
from minipaged.engine.llm_engine import LLMEngine
from minipaged.engine.outputs import RequestOutput
from minipaged.engine.processor import normalize_prompts
from minipaged.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    verify_sampling_params,
)
from minipaged.trace import EngineTrace

PromptsType = Union[str, Sequence[str], Sequence[int], Sequence[Sequence[int]]]


class LLM:
    def __init__(
        self,
        model: Optional[str] = None,
        block_size: int = 16,
        num_blocks: Optional[int] = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = False,
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "recompute",
        scheduling: str = "continuous",
        attention_backend: str = "torch",
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        **kwargs,
    ) -> None:
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {sorted(unknown)}")
        self.config = EngineConfig(
            model=model,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=preemption_mode,
            scheduling=scheduling,
            attention_backend=attention_backend,
            device=device,
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        self.llm_engine = LLMEngine(self.config)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit, on KeyboardInterrupt
        and when the LLM is garbage-collected). The LLM cannot generate afterwards."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def trace(self) -> EngineTrace:
        """The ``EngineTrace`` of the last ``generate`` call."""
        return self.llm_engine.trace

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptsType,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Serve every prompt to completion; one ``RequestOutput`` per prompt, in order."""
        engine = self.llm_engine
        if engine.executor.closed:
            raise RuntimeError(
                "the tensor-parallel workers have been shut down (a worker failed, or shutdown())"
            )
        prompt_list = normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
            for i, p in enumerate(params_list):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams")
        # Validate everything before queueing anything.
        tokenized = [engine.tokenize(p, name=f"prompts[{i}]") for i, p in enumerate(prompt_list)]
        checked: set[int] = set()
        for i, p in enumerate(params_list):
            if id(p) not in checked:
                name = (
                    "sampling_params"
                    if isinstance(sampling_params, SamplingParams)
                    else f"sampling_params[{i}]"
                )
                verify_sampling_params(
                    p,
                    int(engine.model.vocab_size),
                    self.config.max_num_seqs,
                    name,
                    has_tokenizer=engine.tokenizer is not None,
                )
                checked.add(id(p))
        if engine.has_unfinished_requests():
            raise RuntimeError("the engine still holds requests from an interrupted call")
        engine.reset_trace()
        for i, (p, params, tok) in enumerate(zip(prompt_list, params_list, tokenized)):
            engine.add_request(str(i), p, params, _tokenized=tok)
        return self._run_engine(len(prompt_list), use_tqdm)

    def _run_engine(self, num_requests: int, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        outputs: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=num_requests, desc="Processed prompts", dynamic_ncols=True)
        idle = 0
        try:
            while engine.has_unfinished_requests():
                done = engine.step()
                last = engine.trace.steps[-1]
                idle = 0 if (last.scheduled or done) else idle + 1
                if idle > 2:
                    raise RuntimeError(
                        "the scheduler made no progress for 3 steps with requests waiting "
                        f"({engine.get_num_unfinished_requests()} unfinished)"
                    )
                for o in done:
                    outputs[o.request_id] = o
                    for c in o.outputs:
                        if c.finish_reason == "refused":
                            warnings.warn(f"request {o.request_id} refused: {c.stop_reason}")
                if pbar is not None and done:
                    pbar.update(len(done))
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):  # NOTE: workers in a half-done step cannot go on
                engine.shutdown()
            for rid in engine.get_unfinished_request_ids():  # leave the engine empty for the next call
                engine.abort_request(rid)
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [outputs[str(i)] for i in range(num_requests)]

    def beam_search(self, prompts, params: BeamSearchParams):
        """Beam search over forked block tables (``minipaged/engine/beam_search.py``): one
        ``BeamSearchOutput`` per prompt, equal to transformers' ``generate(num_beams=...)``."""
        return beam_search(self.llm_engine, prompts, params)
