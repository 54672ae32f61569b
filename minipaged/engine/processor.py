"""Processor: a caller's prompt and ``SamplingParams`` -> validated ``EngineCoreRequest``s.

Mirrors vLLM v1 ``vllm/v1/engine/processor.py`` (``Processor.process_inputs``) and the
``n > 1`` fan-out of ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``): both
frontends (``LLMEngine``, ``AsyncLLM``) hold one.

Inputs
    ``tokenize(prompt, name)``: a string (tokenized as ``tokenizer(prompt)``, special tokens
    added) or a list of token ids. ``process_inputs(request_id, prompt_token_ids, params)``.
Outputs
    ``tokenize`` -> ``(text or None, token ids)``; ``process_inputs`` -> one
    ``EngineCoreRequest`` per sample: ``request_id`` itself when ``n == 1``, else
    ``"{request_id}.{j}"``, each with ``n=1``, its own seed (``request_base_seed``), and the
    model's further EOS ids as stop tokens (a ``Request`` stops on one ``eos_token_id``).
Failure mode
    ``ValueError`` naming the argument: an empty prompt, one longer than the model's
    context, a token id outside the vocabulary, a bool for a token id, a string prompt
    without a tokenizer, bad ``SamplingParams`` (``verify_sampling_params``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Optional, Union

from minipaged.engine.core import EngineCoreRequest, ModelInfo
from minipaged.sample.sampler import request_base_seed
from minipaged.sampling_params import SamplingParams, verify_sampling_params

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


def sequence_params(params: SamplingParams, eos_token_ids: list[int]) -> SamplingParams:
    """The parameters each of the n sequences runs with: ``n=1``, and the model's further
    EOS ids (a generation config may list several) as stop tokens."""
    p = dataclasses.replace(params, n=1) if params.n > 1 else params
    extra = [e for e in eos_token_ids[1:] if e not in p.stop_token_ids]
    if extra and not p.ignore_eos:
        p = dataclasses.replace(p, stop_token_ids=p.stop_token_ids + extra)
    return p


def child_id(request_id: str, n: int, j: int) -> str:
    """The id of sample ``j`` of a request of ``n`` samples."""
    return request_id if n == 1 else f"{request_id}.{j}"


class Processor:
    def __init__(self, model_info: ModelInfo, tokenizer) -> None:
        self.model_info = model_info
        self.config = model_info.config
        self.tokenizer = tokenizer

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
        limit = self.model_info.max_model_len
        if len(ids) > limit:
            raise ValueError(
                f"{name} has {len(ids)} tokens, longer than the model's context (max_model_len={limit})"
            )
        vocab = self.model_info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} holds token id {bad[0]} outside the vocabulary [0, {vocab})")
        return text, ids

    def verify_params(self, params, name: str = "sampling_params") -> SamplingParams:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{name} must be a SamplingParams, got {type(params).__name__}")
        verify_sampling_params(
            params,
            self.model_info.vocab_size,
            self.config.max_num_seqs,
            name,
            has_tokenizer=self.tokenizer is not None,
        )
        return params

    def process_inputs(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[EngineCoreRequest]:
        """The ``EngineCoreRequest`` of each of the ``params.n`` samples (``params`` verified)."""
        eos = self.model_info.eos_token_ids
        sp = sequence_params(params, eos)
        return [
            EngineCoreRequest(
                request_id=child_id(request_id, params.n, j),
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=sp,
                eos_token_id=eos[0] if eos else None,
                base_seed=request_base_seed(params, self.config.seed, request_id, j),
            )
            for j in range(params.n)
        ]
