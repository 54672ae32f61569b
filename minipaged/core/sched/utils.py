"""Bookkeeping every scheduler shares (vLLM v1's, the paper's, the baselines), as plain
functions: request validation, refusal of what can never fit, the stop check (vLLM's
``vllm/v1/core/sched/utils.py: check_stop``), the token count of one request for a step,
the worker's view of a request, the sampled tokens of a step in one shape
(``sampled_tokens``), and the end-of-step checks.

Inputs / outputs: ``Request`` objects and numbers in, booleans / strings / plain data out.
Failure mode: ``ValueError`` naming the request for a caller's bad input;
``RuntimeError`` for a scheduler bug (over budget).
"""

from __future__ import annotations

from typing import Optional

from minipaged.core.kv.kv_cache_manager import max_num_blocks
from minipaged.core.sched.output import NewRequestData, SchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus, get_max_num_kv_tokens


def check_stop(request: Request, max_model_len: Optional[int]) -> bool:
    """Set a finished status on ``request`` if its newest token ends it (vLLM's order):
    ``max_tokens``, then the model's context, then (once ``min_tokens`` are out) EOS and
    ``stop_token_ids``. Stop *strings* are the output processor's (they need text)."""
    out = request.output_token_ids
    tok = out[-1]
    params = request.sampling_params
    num_output = len(out)  # NOTE: computed once: this runs per request per step
    if num_output >= params.max_tokens:
        request.status, request.stop_reason = (
            RequestStatus.FINISHED_LENGTH,
            f"max_tokens={params.max_tokens} reached",
        )
    elif max_model_len is not None and len(request.prompt_token_ids) + num_output >= max_model_len:
        request.status, request.stop_reason = (
            RequestStatus.FINISHED_LENGTH,
            f"max_model_len={max_model_len} reached",
        )
    elif num_output < params.min_tokens:
        return False  # NOTE: as vLLM, EOS and stop tokens do not count before min_tokens
    elif not params.ignore_eos and request.eos_token_id is not None and tok == request.eos_token_id:
        request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, f"eos token {tok}"
    elif tok in params.stop_token_ids:
        request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, f"stop token {tok}"
    else:
        return False
    return True


def validate_new_request(request, requests: dict, max_model_len: Optional[int]) -> None:
    """ValueError unless ``request`` is a fresh ``Request`` whose id is not in ``requests``
    (the scheduler's unfinished requests) and whose prompt fits ``max_model_len``."""
    if not isinstance(request, Request):
        raise ValueError(f"request must be a Request, got {type(request).__name__}")
    rid = request.request_id
    if rid in requests:
        raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
    if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
        raise ValueError(
            f"request {rid!r} is not fresh (status {request.status.name}, "
            f"{request.num_computed_tokens} computed tokens)"
        )
    if max_model_len is not None and request.num_prompt_tokens > max_model_len:
        raise ValueError(
            f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens is longer "
            f"than max_model_len={max_model_len}"
        )


def refusal_reason(request: Request, sched, num_seqs: int = 1) -> Optional[str]:
    """Why ``sched`` can never serve ``request`` (with ``num_seqs`` sequences sharing its
    prompt's full blocks: a paper sequence group), or None."""
    n = get_max_num_kv_tokens(request, sched.max_model_len)
    blocks = max_num_blocks(n, sched.block_size)
    if blocks > sched.num_blocks:
        return (
            f"refused: needs {blocks} KV blocks for {n} tokens (prompt "
            f"{request.num_prompt_tokens} + max_tokens {request.max_tokens} - 1) but the "
            f"whole pool has {sched.num_blocks} blocks of {sched.block_size} tokens"
        )
    if not sched.enable_chunked_prefill and request.num_prompt_tokens > sched.max_num_batched_tokens:
        return (
            f"refused: prompt of {request.num_prompt_tokens} tokens exceeds "
            f"max_num_batched_tokens={sched.max_num_batched_tokens} and chunked prefill is off"
        )
    if num_seqs > sched.max_num_seqs:
        return f"refused: a group of {num_seqs} sequences exceeds max_num_seqs={sched.max_num_seqs}"
    need = max_num_blocks(n, sched.block_size, num_seqs, request.num_prompt_tokens)
    if num_seqs > 1 and need > sched.num_blocks:
        return (
            f"refused: {num_seqs} sequences sharing their prompt's full blocks may need {need} "
            f"KV blocks but the whole pool has {sched.num_blocks}"
        )
    return None


def refuse(request: Request, reason: str) -> None:
    request.status = RequestStatus.FINISHED_IGNORED
    request.stop_reason = reason


def num_new_tokens(num_left: int, budget: int, chunked: bool, max_num_batched_tokens: int) -> int:
    """Tokens to schedule for a request with ``num_left`` to compute under ``budget``
    (0 = it must wait). With chunked prefill off a prompt runs whole or waits; a
    re-prefill larger than the whole budget is still chunked, or it could never run."""
    if num_left <= budget:
        return num_left
    if chunked or num_left > max_num_batched_tokens:
        return budget
    return 0


def sampled_tokens(sampled) -> dict[str, list[int]]:
    """What a step sampled, as request id -> its tokens, from either shape a caller hands
    ``update_from_output``: the worker's ``ModelRunnerOutput`` (``req_ids`` and, in their
    order, one list per request; ``[]`` = none this step), or a dict request id -> one
    token or a list (tests, the simulator, the baselines). The one place it is normalised.

    NOTE: duck-typed, so that ``core/`` never imports the worker (nor torch)."""
    if isinstance(sampled, dict):
        return {rid: list(t) if isinstance(t, (list, tuple)) else [t] for rid, t in sampled.items()}
    if not hasattr(sampled, "req_ids"):
        raise ValueError(
            f"sampled_token_ids must be a ModelRunnerOutput or a dict, got {type(sampled).__name__}"
        )
    return {rid: t for rid, t in zip(sampled.req_ids, sampled.sampled_token_ids) if len(t)}


def check_sampled(out: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> None:
    """ValueError unless every unfinished scheduled request whose known tokens are all
    computed after ``out`` has an entry in ``sampled_token_ids`` (``sampled_tokens``' shape),
    and each one verified with ``m`` drafts sampled 1 to ``m + 1`` tokens (its accepted
    drafts and one of the target's)."""
    need = [  # NOTE: the dict lookup first: it rules out almost every request at once
        r.request_id
        for r, n in out.scheduled
        if r.request_id not in sampled_token_ids
        and not r.is_finished
        and r.num_computed_tokens + n >= r.num_tokens
    ]
    if need:
        raise ValueError(f"sampled_token_ids lacks a token for requests {need}")
    for rid, drafts in out.scheduled_spec_decode_tokens.items():
        got = sampled_token_ids.get(rid, [])
        if not 1 <= len(got) <= len(drafts) + 1:
            raise ValueError(f"request {rid!r}: {got} sampled for {len(drafts)} drafts")


def new_request_data(request: Request, block_ids: list[int]) -> NewRequestData:
    """The worker's view of ``request``: everything it needs to build its rows."""
    return NewRequestData(
        req_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=list(request.output_token_ids),
        sampling_params=request.sampling_params,
        block_ids=list(block_ids),
        num_computed_tokens=request.num_computed_tokens,
        eos_token_id=request.eos_token_id,
        base_seed=request.base_seed,
    )


def finish_step(out: SchedulerOutput, max_num_batched_tokens: int, max_num_seqs: int) -> SchedulerOutput:
    """Fill the step's totals and its prefill / decode split; RuntimeError if over budget."""
    out.num_scheduled_tokens = {r.request_id: n for r, n in out.scheduled}
    out.total_num_scheduled_tokens = total = sum(out.num_scheduled_tokens.values())
    if total > max_num_batched_tokens or len(out.scheduled) > max_num_seqs:
        raise RuntimeError(f"over budget: {total} tokens, {len(out.scheduled)} sequences")
    decode, prefill = out.decode_ids, out.prefill_ids
    for req, n in out.scheduled:
        # NOTE: a request that computes only its newest sampled token is decoding
        # (lengths read directly: this runs per request per step)
        num_output = len(req.output_token_ids)
        if n == 1 and num_output and req.num_computed_tokens == len(req.prompt_token_ids) + num_output - 1:
            decode.append(req.request_id)
        else:
            prefill.append(req.request_id)
    return out


def check_output(out: Optional[SchedulerOutput], max_num_batched_tokens: int) -> None:
    """The last output's own invariants (``check_invariants`` of every scheduler)."""
    if out is None:
        return
    total = sum(n for _, n in out.scheduled)
    assert total == out.total_num_scheduled_tokens, "total_num_scheduled_tokens is wrong"
    assert total <= max_num_batched_tokens, (
        f"{total} tokens scheduled > max_num_batched_tokens {max_num_batched_tokens}"
    )
    assert all(n >= 1 for _, n in out.scheduled), "a request was scheduled 0 tokens"
    ids = [r.request_id for r, _ in out.scheduled]
    assert len(set(ids)) == len(ids), f"a request scheduled twice: {ids}"
    assert ids == list(out.num_scheduled_tokens), "num_scheduled_tokens is not in batch order"


def check_scheduler(sched, queues: dict) -> None:
    """What every scheduler over block tables asserts in ``check_invariants``: its manager's
    own invariants, ``running <= max_num_seqs``, the last output's, the queues'
    (``check_queues``), exactly the running requests hold device blocks, and nothing that
    waits has computed tokens. Each scheduler then checks what is its own."""
    kv = sched.kv_cache_manager
    kv.check_invariants()
    assert len(sched.running) <= sched.max_num_seqs, (
        f"{len(sched.running)} running > max_num_seqs {sched.max_num_seqs}"
    )
    check_output(sched._last_output, sched.max_num_batched_tokens)
    check_queues(queues, sched.requests)
    running = {r.request_id for r in sched.running}
    assert set(kv.block_tables) == running, (
        f"device blocks held by {sorted(kv.block_tables)}, running {sorted(running)}"
    )
    for name, (queue, statuses, _) in queues.items():
        if RequestStatus.WAITING in statuses:
            for r in queue:
                assert r.num_computed_tokens == 0, f"{name} {r.request_id} has computed tokens"


def check_queues(queues: dict, requests: dict) -> None:
    """Every unfinished request is in exactly one queue with an allowed status, and each
    ordered queue is in arrival order. ``queues``: name -> (requests, statuses, ordered)."""
    where: dict[str, str] = {}
    for name, (queue, statuses, ordered) in queues.items():
        for r in queue:
            assert r.request_id not in where, f"{r.request_id} is in both {where[r.request_id]} and {name}"
            where[r.request_id] = name
            assert r.status in statuses, f"{r.request_id} is {name} with status {r.status.name}"
            assert 0 <= r.num_computed_tokens <= r.num_tokens, f"{r.request_id}: computed > tokens"
        if ordered:
            s = [r.arrival_order for r in queue]
            assert s == sorted(s), f"{name} is not in arrival order: {[r.request_id for r in queue]}"
    assert set(where) == set(requests), (
        f"queued {sorted(set(where) - set(requests))} unknown, "
        f"{sorted(set(requests) - set(where))} in no queue"
    )
    for rid, r in requests.items():
        assert not r.is_finished, f"{rid} is finished but the scheduler still holds it"


def validate_group(requests, known: dict, max_model_len: Optional[int]) -> list[Request]:
    """The sequences of one ``SamplingParams(n > 1)`` request: distinct ids, one prompt."""
    requests = list(requests)
    if not requests:
        raise ValueError("requests: a sequence group needs at least one sequence")
    ids = [r.request_id if isinstance(r, Request) else None for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"requests: sequence ids must be distinct, got {ids}")
    for r in requests:
        validate_new_request(r, known, max_model_len)
        if r.prompt_token_ids != requests[0].prompt_token_ids:
            raise ValueError("requests: the sequences of a group share one prompt")
    return requests


def insert_by_arrival(queue, request: Request) -> None:
    """Put ``request`` into ``queue`` (kept in arrival order; after equal ranks). The
    paper's scheduler needs it: swapped groups and forked beams rejoin mid-queue."""
    i = 0
    while i < len(queue) and queue[i].arrival_order <= request.arrival_order:
        i += 1
    queue.insert(i, request)
