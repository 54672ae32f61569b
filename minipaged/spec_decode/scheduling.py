"""What the v1 scheduler asks of speculative decoding: which drafts to schedule, how many
lookahead slots to reserve, how far a verified request advances.

Mirrors the spec-decode lines of vLLM ``vllm/v1/core/sched/scheduler.py`` (``schedule``:
``num_tokens_with_spec``, ``scheduled_spec_decode_tokens``; ``update_from_output``:
``num_computed_tokens -= num_rejected``) and the ``num_lookahead_tokens`` argument of
``vllm/v1/core/kv_cache_manager.py::allocate_slots``. Pure Python, like ``minipaged.core``.

Inputs / outputs (plain functions of a ``Request``)
    ``usable_drafts(request, spec_token_ids, max_model_len, budget)``: the drafts worth
    scheduling: a step yields at most ``drafts + 1`` tokens, so no more than the request
    may still emit (``get_max_num_kv_tokens(request) - num_tokens``: its ``max_tokens`` and
    the model's context), and no more than the token budget left holds besides its own
    uncomputed tokens (drafts never make a decode wait, chunked prefill on or off).
    ``num_lookahead_slots(request, num_tokens_after, num_lookahead_tokens, max_model_len)``:
    the extra KV slots past this step's tokens (the draft model's proposal passes write
    there), capped so that a table never outgrows ``get_max_num_kv_tokens``: the refusal
    check at ``add_request`` stays the bound.
    ``num_verified(num_scheduled, num_drafts, num_sampled)``: how far
    ``num_computed_tokens`` advances: the scheduled tokens minus the rejected drafts.
Invariant
    ``num_computed_tokens + num_new_tokens + lookahead <= get_max_num_kv_tokens(request)``.
Failure mode
    ``ValueError`` when the sampled count is impossible (0, or more than drafts + 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from minipaged.core.sched.request import Request, get_max_num_kv_tokens


def usable_drafts(
    request: Request,
    spec_token_ids: Sequence[int],
    max_model_len: Optional[int],
    budget: Optional[int] = None,
) -> list[int]:
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


# -- the scheduler's calls (each one line in its loop) ------------------------------------
def take_drafts(
    spec_token_ids: dict, request: Request, max_model_len: Optional[int], budget: int
) -> list[int]:
    """Pop ``request``'s proposed drafts and keep the usable ones (``usable_drafts``)."""
    return usable_drafts(request, spec_token_ids.pop(request.request_id, []), max_model_len, budget)


def record_drafts(out, request: Request, num_new_tokens: int, drafts: list[int]) -> None:
    """Put the drafts this step schedules (those after the last known token) into ``out``."""
    num_spec = request.num_computed_tokens + num_new_tokens - request.num_tokens
    if num_spec > 0:
        out.scheduled_spec_decode_tokens[request.request_id] = drafts[:num_spec]


def reserve_lookahead(
    out, request: Request, num_tokens_after: int, num_lookahead_tokens: int, max_model_len: Optional[int]
) -> int:
    """``num_lookahead_slots``, recorded in ``out.num_lookahead_slots`` (the invariants read it)."""
    n = num_lookahead_slots(request, num_tokens_after, num_lookahead_tokens, max_model_len)
    out.num_lookahead_slots[request.request_id] = n
    return n


def advance(request: Request, num_new_tokens: int, drafts: Sequence[int], sampled) -> list[int]:
    """After the forward: move ``num_computed_tokens`` past the verified tokens and return the
    tokens to append (none for a prefill chunk). ``sampled``: a token, a list (accepted
    drafts + 1), or ``[]``."""
    tokens = sampled if isinstance(sampled, list) else [sampled]
    done = request.num_computed_tokens + num_new_tokens >= request.num_tokens  # else a chunk
    request.num_computed_tokens += (
        num_verified(num_new_tokens, len(drafts), len(tokens)) if drafts else num_new_tokens
    )
    return tokens if done else []
