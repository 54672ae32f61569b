"""How the student build calls the notebook's own function where a package function was stripped.

Concept
    The student build (``student_build.py``) replaces every package function that answers
    an exercise by a stub. Where the rest of the package needs that function (the
    scheduler asks ``num_new_tokens`` every step; ``max_batch`` reads
    ``ModelConfig.kv_bytes_per_token``), the stub runs the notebook's own function of the
    exercise instead ("your code powers the rest", as tiny-llm's student tree does). When
    the package function and the exercise's function take the same arguments, the stub
    passes them on as they are; when they do not, an *adapter* here turns the package
    call into a call of the exercise's function, and the answer back into the package's.

Inputs / outputs
    ``ADAPTERS``: ``{"module:qualname": adapter}``; ``adapter(student_fn, *args, **kwargs)``
    takes the stripped function's own arguments (``self`` first for a method) and returns
    what the package function returns. ``adapter_for(frame)`` -> the adapter of the stripped
    function whose stub runs in ``frame``, or ``None``.

Invariants
    an adapter only calls ``student_fn`` and the package's plain data classes; it never
    computes the exercise's answer itself (with a wrong ``student_fn`` the package is wrong).

Failure mode
    whatever ``student_fn`` raises propagates, as it would from the package function.
"""

from __future__ import annotations


def _num_new_tokens(student_fn, num_left, budget, chunked, max_num_batched_tokens):
    """``utils.num_new_tokens(num_left, ...)`` -> ex5.1's ``num_new_tokens(request, ...)``
    on a request with ``num_left`` tokens still to compute."""
    from minipaged.core.sched.request import Request

    request = Request("plug-in", list(range(max(0, int(num_left)))))
    return student_fn(request, budget, chunked, max_num_batched_tokens)


def _scheduler_num_new_tokens(student_fn, scheduler, request, num_computed, budget):
    """``Scheduler._num_new_tokens(request, num_computed, budget)``: the request with
    ``num_computed`` tokens computed (a prefix-cache hit counts before it is recorded)."""
    before = request.num_computed_tokens
    request.num_computed_tokens = num_computed
    try:
        return student_fn(request, budget, scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens)
    finally:
        request.num_computed_tokens = before


def _paper_num_new_tokens(student_fn, scheduler, request, budget):
    """``PaperScheduler._num_new_tokens(request, budget)``: tokens left as the paper's
    scheduler counts them (a group's leader stops at its prompt's end)."""
    left = scheduler._num_to_compute(request)
    return _num_new_tokens(
        student_fn, left, budget, scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens
    )


def _scheduler_preempt(student_fn, scheduler, request, out):
    """``Scheduler._preempt(victim, out)`` (the victim already popped from ``running``) ->
    ex5.3's ``preempt_recompute(scheduler, victim)`` (which takes it out of ``running``)."""
    scheduler.running.append(request)
    student_fn(scheduler, request)
    out.preempted.append(request)
    out.preempted_req_ids.add(request.request_id)


def _paper_preempt(student_fn, scheduler, victims, out):
    """``PaperScheduler._preempt(victims, out)`` (the victims already taken out of
    ``running``), recompute of one sequence -> ex5.3's ``preempt_recompute``; the paper's
    swap and its sequence groups are not what ex5.3 asks, so they still raise."""
    if scheduler.preemption_mode == "swap" or len(victims) != 1:
        raise NotImplementedError(
            "ex5.3: your preempt_recompute stands in for the paper scheduler's recompute of one "
            "sequence only, not for swap or a sequence group"
        )
    (victim,) = victims
    scheduler._synced.discard(victim.request_id)
    out.preempted_req_ids.add(victim.request_id)
    scheduler.running.append(victim)
    student_fn(scheduler, victim)
    out.preempted.append(victim)
    group = scheduler.seq_groups.get(victim.request_id)
    if group is not None:
        group.forked = False


def _kv_bytes_per_token(student_fn, model):
    """``ModelConfig.kv_bytes_per_token`` (a property) -> ex1.1's
    ``kv_bytes_per_token(config, dtype_bytes)`` on the model's Hugging Face config."""
    config = {
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
    }
    return student_fn(config, model.dtype_bytes)


ADAPTERS = {
    "minipaged.core.sched.utils:num_new_tokens": _num_new_tokens,
    "minipaged.core.sched.scheduler:Scheduler._num_new_tokens": _scheduler_num_new_tokens,
    "minipaged.core.sched.paper:PaperScheduler._num_new_tokens": _paper_num_new_tokens,
    "minipaged.core.sched.scheduler:Scheduler._preempt": _scheduler_preempt,
    "minipaged.core.sched.paper:PaperScheduler._preempt": _paper_preempt,
    "minipaged.sim.cost_model:ModelConfig.kv_bytes_per_token": _kv_bytes_per_token,
}


def adapter_for(frame):
    """The adapter of the stripped function running in ``frame`` (its stub's frame)."""
    if frame is None:
        return None
    module = frame.f_globals.get("__name__", "")
    code = frame.f_code
    qualname = getattr(code, "co_qualname", None)  # Python >= 3.11
    if qualname is not None:
        return ADAPTERS.get(f"{module}:{qualname}")
    hits = [
        a
        for t, a in ADAPTERS.items()
        if t.startswith(module + ":") and t.rsplit(".", 1)[-1].split(":")[-1] == code.co_name
    ]
    return hits[0] if len(hits) == 1 else None
