"""RequestOutput and CompletionOutput: what ``LLM.generate`` returns, as in vLLM.

Mirrors vLLM ``vllm/outputs.py``.

Outputs
    one ``RequestOutput`` per prompt, in prompt order: ``request_id``, ``prompt`` (the
    string, or None when token ids were given), ``prompt_token_ids``, ``outputs`` (one
    ``CompletionOutput`` per sample, ``n`` of them) and ``finished``.

    ``CompletionOutput.finish_reason`` is ``"stop"`` (EOS or a stop token), ``"length"``
    (``max_tokens`` or the model's context), ``"abort"``, or ``"refused"``: the request
    could never fit (for example it needs more KV blocks than the whole pool). A refused
    completion has no tokens and ``stop_reason`` holds the scheduler's explanation; the
    other requests of the batch are served as if it had not been there. ``stop_reason``
    is the stop token id or the stop string that ended a "stop" completion (None for EOS).

    ``CompletionOutput.logprobs`` (when ``SamplingParams.logprobs=k``): one dict per
    generated token, token id -> ``Logprob`` (log-probability from the raw logits, rank,
    decoded text), holding the k most likely tokens and the sampled one (k or k + 1
    entries); ``cumulative_logprob`` is the sum of the sampled tokens' log-probabilities.
    None when logprobs were not asked for.

Invariants
    ``finished`` is True iff every completion has a ``finish_reason``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    """As vLLM's ``vllm.sequence.Logprob``."""

    logprob: float
    rank: Optional[int] = None  # 1 = the most likely token
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "refused" | None
    # The stop token id or stop string that ended it, or (for "refused") the reason in words.
    stop_reason: Union[int, str, None] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False

    def check_invariants(self) -> None:
        assert self.finished == all(o.finished() for o in self.outputs), (
            f"request {self.request_id}: finished={self.finished} but completions "
            f"{[o.finish_reason for o in self.outputs]}"
        )
        assert [o.index for o in self.outputs] == list(range(len(self.outputs))), (
            f"request {self.request_id}: completion indices out of order"
        )
