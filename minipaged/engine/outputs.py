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

    ``CompletionOutput.logprobs`` (when ``SamplingParams.logprobs=k``): a ``FlatLogprobs``,
    read as a list of one dict per generated token, token id -> ``Logprob``
    (log-probability from the raw logits, rank, decoded text), holding the k most likely
    tokens and the sampled one (k or k + 1 entries); ``cumulative_logprob`` is the sum of
    the sampled tokens' log-probabilities. None when logprobs were not asked for.

Invariants
    ``finished`` is True iff every completion has a ``finish_reason``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass(slots=True)
class Logprob:
    """As vLLM's ``vllm.logprobs.Logprob``."""

    logprob: float
    rank: Optional[int] = None  # 1 = the most likely token
    decoded_token: Optional[str] = None


class FlatLogprobs(Sequence):
    """A completion's logprobs, read as ``list[dict[int, Logprob]]`` (one dict per token,
    built when read), stored flat as vLLM's ``vllm.logprobs.FlatLogprobs``: position ``i``'s
    candidates are entries ``start[i]:start[i + 1]`` of ``token_ids``, ``logprobs``,
    ``ranks`` and ``decoded``. Where vLLM keeps plain lists, the numbers here sit in typed
    arrays: a long answer is a few buffers, not a Python object per candidate (whose freed
    memory CPython's small-object arenas kept: docs/serving.md). Append-only: a partial
    output shares it, reading only its first tokens."""

    __slots__ = ("start", "token_ids", "logprobs", "ranks", "decoded")

    def __init__(self) -> None:
        self.start = array("q", [0])
        self.token_ids, self.logprobs, self.ranks = array("q"), array("d"), array("q")
        self.decoded: list = []  # the token texts (shared strings from the decode cache)

    def append_position(self, entry, piece: Callable) -> None:
        """One generated token's ``sample.logprobs.Logprobs``: the sampled token first, then
        the top k (the sampled one not twice); ``piece(token_id)`` is its text."""
        ids = [entry.sampled_token_id]
        self.logprobs.append(entry.sampled_logprob)
        self.ranks.append(entry.sampled_rank)
        for rank, (tid, lp) in enumerate(zip(entry.token_ids, entry.logprobs), start=1):
            if tid != entry.sampled_token_id:
                ids.append(tid)
                self.logprobs.append(lp)
                self.ranks.append(rank)
        self.token_ids.extend(ids)
        self.decoded.extend(piece(t) for t in ids)
        self.start.append(len(self.token_ids))

    def __len__(self) -> int:
        return len(self.start) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"logprobs position {i} of {len(self)}")
        a, b = self.start[i], self.start[i + 1]
        return {
            self.token_ids[k]: Logprob(self.logprobs[k], self.ranks[k], self.decoded[k]) for k in range(a, b)
        }

    def __eq__(self, other) -> bool:
        if not isinstance(other, (FlatLogprobs, list)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"FlatLogprobs({len(self)} positions, {len(self.token_ids)} entries)"


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "refused" | None
    # The stop token id or stop string that ended it, or (for "refused") the reason in words.
    stop_reason: Union[int, str, None] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[FlatLogprobs] = None  # reads as list[dict[int, Logprob]]

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
