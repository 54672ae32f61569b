"""What the v1 scheduler asks of speculative decoding: which drafts to schedule, how many
lookahead slots to reserve, how far a verified request advances, which slots go back.

Mirrors the spec-decode lines of vLLM ``vllm/v1/core/sched/scheduler.py`` (``schedule``:
``num_tokens_with_spec``, ``scheduled_spec_decode_tokens``; ``update_from_output``:
``num_computed_tokens -= num_rejected``; ``update_draft_token_ids``) and the
``num_lookahead_tokens`` argument of ``vllm/v1/core/kv_cache_manager.py::allocate_slots``.
Plain functions, so that ``scheduler.py`` stays one short loop (each is one line there).
The proposers and the rejection sampler are ``minipaged/spec_decode/``.

Inputs / outputs
    ``SpecDecodeState`` (``Scheduler.spec_decode``): ``num_lookahead_tokens`` (0 = off;
    ``k`` for a draft model) and the drafts proposed for each decoding request.
    ``plan(sched, out, request, budget) -> (num_new_tokens, lookahead)``: a running
    request's tokens this step (its uncomputed ones + the usable drafts,
    ``usable_drafts``) and its lookahead slots; the drafts go to
    ``out.scheduled_spec_decode_tokens``.
    ``advance(kv, request, n, out, sampled_token_ids) -> tokens to append``: moves
    ``num_computed_tokens`` by the scheduled tokens minus the rejected drafts
    (``num_verified``) and gives the other slots back (``KVCacheManager.trim_slots``).
Invariants
    ``num_computed_tokens + num_new_tokens + lookahead <= get_max_num_kv_tokens(request)``:
    the refusal check at ``add_request`` stays the bound; between steps a table holds the
    slots of its computed tokens only; drafts exist only for decoding requests.
Failure mode
    ``ValueError`` when the sampled count is impossible (0, or more than drafts + 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from minipaged.core.sched import utils
from minipaged.core.sched.request import Request, RequestStatus, get_max_num_kv_tokens


@dataclass
class SpecDecodeState:
    num_lookahead_tokens: int = 0  # KV slots past the scheduled tokens (vLLM's name)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> drafts


def usable_drafts(
    request: Request,
    spec_token_ids: Sequence[int],
    max_model_len: Optional[int],
    budget: Optional[int] = None,
) -> list[int]:
    """No more drafts than the request may still emit (a step yields drafts + 1 tokens) and
    than the budget holds besides its uncomputed tokens (drafts never make a decode wait)."""
    room = get_max_num_kv_tokens(request, max_model_len) - request.num_tokens
    if budget is not None:
        room = min(room, budget - (request.num_tokens - request.num_computed_tokens))
    return list(spec_token_ids[: max(0, room)])


def num_lookahead_slots(
    request: Request, num_tokens_after: int, num_lookahead_tokens: int, max_model_len: Optional[int]
) -> int:
    """Slots to reserve past ``num_tokens_after`` (computed + scheduled this step)."""
    if num_lookahead_tokens == 0:
        return 0
    room = get_max_num_kv_tokens(request, max_model_len) - num_tokens_after
    return max(0, min(num_lookahead_tokens, room))


def num_verified(num_scheduled: int, num_drafts: int, num_sampled: int) -> int:
    """``num_scheduled`` minus the rejected drafts (``num_sampled`` = accepted + 1)."""
    if not 1 <= num_sampled <= num_drafts + 1:
        raise ValueError(
            f"num_sampled={num_sampled} must be in [1, {num_drafts + 1}] for {num_drafts} drafts"
        )
    return num_scheduled - (num_drafts + 1 - num_sampled)


# -- the scheduler's calls (``sched`` is the v1 Scheduler) -----------------------------------
def reserve_lookahead(sched, out, request: Request, num_tokens_after: int) -> int:
    """``num_lookahead_slots``, recorded in ``out.num_lookahead_slots`` (the invariants read it)."""
    n = num_lookahead_slots(
        request, num_tokens_after, sched.spec_decode.num_lookahead_tokens, sched.max_model_len
    )
    out.num_lookahead_slots[request.request_id] = n
    return n


def plan(sched, out, request: Request, budget: int) -> tuple[int, int]:
    """A running request's ``(num_new_tokens, lookahead)``; its drafts go into ``out``.

    NOTE: recorded before the allocation: if the request then preempts itself, the entries
    stay in ``out`` unread (it is not in ``out.scheduled``)."""
    proposed = sched.spec_decode.spec_token_ids
    drafts = (  # NOTE: most steps propose nothing: skip the room arithmetic then
        usable_drafts(request, proposed.pop(request.request_id), sched.max_model_len, budget)
        if request.request_id in proposed
        else []
    )
    left = request.num_tokens + len(drafts) - request.num_computed_tokens
    n = utils.num_new_tokens(left, budget, sched.enable_chunked_prefill, sched.max_num_batched_tokens)
    num_spec = request.num_computed_tokens + n - request.num_tokens
    if num_spec > 0:
        out.scheduled_spec_decode_tokens[request.request_id] = drafts[:num_spec]
    return n, (reserve_lookahead(sched, out, request, request.num_computed_tokens + n) if n else 0)


def advance(
    kv_cache_manager, request: Request, num_new_tokens: int, out, sampled_token_ids: dict
) -> list[int]:
    """After the forward: move ``num_computed_tokens`` past the verified tokens, give back the
    other slots (rejected drafts, lookahead), and return the tokens to append (none for a
    prefill chunk). A request's ``sampled_token_ids`` entry is a token, or a list (accepted
    drafts + 1) when ``out`` scheduled drafts for it."""
    rid = request.request_id
    # else a chunk (num_tokens spelled out: this runs per request per step)
    done = request.num_computed_tokens + num_new_tokens >= len(request.prompt_token_ids) + len(
        request.output_token_ids
    )
    drafts = out.scheduled_spec_decode_tokens.get(rid) if out.scheduled_spec_decode_tokens else None
    if not drafts:  # NOTE: the common case (no speculation), kept short: it runs per request per step
        request.num_computed_tokens += num_new_tokens
        if out.num_lookahead_slots and out.num_lookahead_slots.get(rid):
            kv_cache_manager.trim_slots(request, request.num_computed_tokens)
        if not done:
            return []
        sampled = sampled_token_ids.get(rid, [])
        return sampled if isinstance(sampled, list) else [sampled]
    sampled = sampled_token_ids.get(rid, [])
    tokens = sampled if isinstance(sampled, list) else [sampled]
    request.num_computed_tokens += num_verified(num_new_tokens, len(drafts), len(tokens))
    kv_cache_manager.trim_slots(request, request.num_computed_tokens)
    return tokens if done else []


def slots_in_flight(out) -> dict[str, int]:
    """Slots each request holds past its computed tokens while ``out`` (None: none) runs."""
    if out is None:
        return {}
    return {rid: n + out.num_lookahead_slots.get(rid, 0) for rid, n in out.num_scheduled_tokens.items()}


def update_draft_token_ids(sched, draft_token_ids: dict[str, list[int]]) -> None:
    """vLLM's ``update_draft_token_ids``: the drafts proposed after a step replace the old
    ones, for the running requests that decode (all their tokens but the newest computed);
    a request preempted or finished meanwhile keeps none."""
    sched.spec_decode.spec_token_ids = {
        rid: list(d)
        for rid, d in draft_token_ids.items()
        if (r := sched.requests.get(rid)) is not None
        and r.status == RequestStatus.RUNNING
        and r.num_computed_tokens == r.num_tokens - 1
    }
