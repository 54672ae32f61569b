"""Request and its lifecycle.

Mirrors vLLM ``vllm/v1/request.py``.

Lifecycle::

    WAITING --schedule--> RUNNING --stop/length--> FINISHED_*
       ^                     |
       +---- PREEMPTED <-----+  (recompute: blocks freed, re-prefilled later)
             SWAPPED   <-----+  (swap: blocks copied to CPU, copied back later)

Prefill and decode are one mechanism (as in vLLM v1): ``num_computed_tokens`` moves
toward ``num_tokens`` (prompt + output so far). While it lags by more than one token the
request is prefilling (possibly in chunks); when it lags by exactly one it is decoding.
After a recompute preemption ``num_computed_tokens`` is reset to 0 and the prompt *and*
the output so far are prefilled again.

Sharing (chapter 06): ``block_hashes`` holds the chained hashes of the request's full
blocks (``hash_block_tokens``), filled lazily by the ``KVCacheManager`` when prefix
caching is on; tokens only ever grow, so a hash once computed never changes. A request of
a ``SamplingParams(n > 1)`` group is one sequence of the group (``Scheduler.add_request_group``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from minipaged.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: waiting again, at the front
    SWAPPED = "swapped"  # swap: its KV lives in the CPU pool
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"  # abort_request
    FINISHED_IGNORED = "finished_ignored"  # refused: can never fit

    def __init__(self, value: str) -> None:
        # NOTE: computed once per member: schedulers and the simulator ask it per request
        # per step, and an Enum's ``value`` is a slow property
        self._finished = value.startswith("finished")

    def is_finished(self) -> bool:
        return self._finished


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: Optional[int] = None
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    arrival_order: int = -1  # FCFS rank, set by the scheduler's add_request
    base_seed: int = 0  # the sampler's per-request seed (the engine sets it)
    stop_reason: Optional[str] = None  # why it finished, in words (for refusals too)
    # chained hashes of the full blocks of all_token_ids, filled lazily (prefix caching)
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # speculative decoding: the drafts proposed after its last token, for the next step
    # (vLLM's name; set by Scheduler.update_draft_token_ids, consumed by schedule())
    spec_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status._finished

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


def get_max_num_kv_tokens(request: Request, max_model_len: Optional[int] = None) -> int:
    """The most tokens whose K/V ``request`` can ever hold at once.

    ``prompt + max_tokens - 1``: the last sampled token is never fed back. Generation
    stops when ``num_tokens`` reaches ``max_model_len``, so at most ``max_model_len - 1``
    tokens are fed, but the prompt itself always is.
    """
    n = request.num_prompt_tokens + request.max_tokens - 1
    if max_model_len is not None:
        n = min(n, max_model_len - 1)
    return max(n, request.num_prompt_tokens)
