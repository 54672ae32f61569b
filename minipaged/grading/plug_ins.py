"""How the student build runs the notebook's own functions inside a scheduler's step.

Concept
    The student build (``student_build.py``) strips every package function that answers an
    exercise. A scheduler's ``schedule()`` answers two exercises at once, one per phase:
    its admission loop is ex4.1 (``schedule_waiting``) and its running phase, with
    preemption, is ex5.4 (``schedule_running``). Stripping all of ``schedule()`` would stop
    the rest of the chapter (ex4.3's and ex4.5's checks drive a scheduler, ex5.6 measures a
    rule on the paper scheduler), so in a chapter's build only that chapter's phase is
    taken out of the method's body (``student_build.PHASE_PLUGS``) and replaced by a call of
    a helper here, which runs the notebook's function for the phase and writes what it did
    into the step's ``SchedulerOutput`` as the package's loop would ("your code powers the
    rest", as tiny-llm's student tree does). ``update_from_output`` (ex4.3) is stood in for
    the same way (``v1_update``).

    A helper only moves what the notebook's function decided into the step's output (the
    scheduled pairs, their new block ids, the preempted requests); it decides nothing:
    with a wrong notebook function the scheduler is wrong. A configuration the exercise
    does not cover (speculative decoding, prefix caching, a watermark, the whole prompt
    reserved at admission, sequence groups, swap) raises ``NotImplementedError`` naming the
    exercise, as a stripped function does.

Inputs / outputs
    ``v1_waiting_phase(scheduler, out, budget, ex, name) -> budget``;
    ``v1_running_phase(...) -> budget``; ``paper_running_phase(...) -> (budget, preempted)``;
    ``v1_update(fn, scheduler, output, sampled_token_ids) -> finished`` (an adapter:
    ``fn`` is the notebook's ``update_from_output``; it gets request id -> token, whether
    the caller passed a dict or the worker's ``ModelRunnerOutput``).

Invariants
    the notebook's function is found in ``__main__`` through the build's hook
    (``minipaged._student_build``: the same lookup, message and recursion guard as every
    stub); in the real package (a local check) the hook's source is loaded from
    ``student_build.HOOK_SOURCE``.

Failure mode
    ``NotImplementedError("ex5.4: your notebook's schedule_running is used here")`` when the
    notebook has no such function; ``TypeError`` when it returns something of another shape.
"""

from __future__ import annotations

import sys
import types


def _hook():
    """``minipaged._student_build`` (the build's), or the same module made from its source."""
    try:
        import minipaged._student_build as hook

        return hook
    except ImportError:
        pass
    hook = sys.modules.get("minipaged._student_build_local")
    if hook is None:
        from minipaged.grading.student_build import HOOK_SOURCE

        hook = types.ModuleType("minipaged._student_build_local")
        exec(compile(HOOK_SOURCE, "minipaged/_student_build.py", "exec"), hook.__dict__)
        sys.modules[hook.__name__] = hook
    return hook


def _call(ex: str, name: str, *args):
    """The notebook's ``name(*args)``; its handed-out stub (a bare ``NotImplementedError``)
    says which exercise the phase is, as a stripped function does."""
    try:
        return _hook().plug_with(ex, name, lambda fn: fn(*args))
    except NotImplementedError as e:
        if str(e).startswith("ex"):  # a stub further down names its own exercise
            raise
        raise NotImplementedError(f"{ex}: your notebook's {name} is used here") from None


def _unsupported(ex: str, name: str, what: str):
    return NotImplementedError(f"{ex}: your notebook's {name} stands in for this phase only {what}")


def _pairs(ex: str, name: str, got) -> list:
    from minipaged.core.sched.request import Request

    if type(got) not in (list, tuple) or not all(
        type(p) in (list, tuple)
        and len(p) == 2
        and isinstance(p[0], Request)
        and type(p[1]) is int
        and p[1] > 0
        for p in got
    ):
        raise TypeError(f"{ex}: {name} must return a list of (request, num_new_tokens > 0) pairs")
    return [tuple(p) for p in got]


def _blocks(ids) -> list:
    """Block ids as the objects ``_schedule`` reads (it only reads ``block_id``)."""
    return [types.SimpleNamespace(block_id=b) for b in ids]


# -- ex4.1: the admission loop of vLLM v1's Scheduler.schedule ------------------------------


def v1_waiting_phase(sched, out, budget: int, ex: str, name: str) -> int:
    """``Scheduler.schedule``'s phase 2 (WAITING) by the notebook's ``schedule_waiting``."""
    from minipaged.core.sched import utils

    if out.preempted or not sched.waiting or budget <= 0 or len(sched.running) >= sched.max_num_seqs:
        return budget  # the package's loop does not start either
    if sched.enable_prefix_caching or sched.scheduler_reserve_full_isl or sched.watermark_blocks:
        raise _unsupported(
            ex,
            name,
            "with scheduler_reserve_full_isl=False, no prefix caching and no watermark (ex4.1's setting)",
        )
    if sched.num_lookahead_tokens:
        raise _unsupported(ex, name, "without speculative decoding")
    kv = sched.kv_cache_manager
    admitted = _pairs(ex, name, _call(ex, name, sched, budget))
    for request, n in admitted:
        out.admitted.append(request)
        ids = kv.get_block_ids(request.request_id)  # NOTE: a waiting request held no block
        sched._schedule(request, n, _blocks(ids), out)
        out.scheduled_new_reqs.append(utils.new_request_data(request, ids))
        budget -= n
    return budget


# -- ex4.3: update_from_output --------------------------------------------------------------


def v1_update(fn, sched, output, sampled_token_ids) -> list:
    """``Scheduler.update_from_output(output, sampled)`` by the notebook's
    ``update_from_output(scheduler, scheduled, sampled_token_ids)``: refused requests come
    first (as the package's), requests aborted since ``schedule()`` are not handed over."""
    if output is not sched._in_flight:
        raise ValueError("update_from_output() needs the output of the last schedule()")
    if output.scheduled_spec_decode_tokens or sched.num_lookahead_tokens:
        raise NotImplementedError(
            "ex4.3: your notebook's update_from_output stands in only without speculative decoding"
        )
    from minipaged.core.sched import utils

    scheduled = [(r, n) for r, n in output.scheduled if not r.is_finished]
    # NOTE: the exercise's shape, whatever the caller's (a ModelRunnerOutput from the engine):
    # request id -> its one token (no drafts here)
    sampled = {rid: tokens[0] for rid, tokens in utils.sampled_tokens(sampled_token_ids).items()}
    got = fn(sched, scheduled, sampled)
    if type(got) is not list:
        raise TypeError("ex4.3: update_from_output must return the list of finished requests")
    finished = list(output.refused) + got
    output.finished = finished
    sched._in_flight = None
    return finished


# -- ex5.4: the running phase, v1's and the paper's -------------------------------------------


def _running(sched, budget: int, ex: str, name: str):
    """The notebook's ``schedule_running``: ``(scheduled, preempted, new block ids per request)``."""
    from minipaged.core.sched.request import Request

    kv = sched.kv_cache_manager
    before = {r.request_id: len(kv.get_block_ids(r.request_id)) for r in sched.running}
    got = _call(ex, name, sched, budget)
    if type(got) is not tuple or len(got) != 2:
        raise TypeError(f"{ex}: {name} must return a (scheduled, preempted) tuple")
    scheduled, preempted = _pairs(ex, name, got[0]), got[1]
    if type(preempted) not in (list, tuple) or not all(isinstance(v, Request) for v in preempted):
        raise TypeError(f"{ex}: {name} must return the preempted requests as a list")
    new_ids = {
        r.request_id: kv.get_block_ids(r.request_id)[before.get(r.request_id, 0) :] for r, _ in scheduled
    }
    return scheduled, list(preempted), new_ids


def v1_running_phase(sched, out, budget: int, ex: str, name: str) -> int:
    """``Scheduler.schedule``'s phase 1 (RUNNING, with recompute preemption) by the
    notebook's ``schedule_running``."""
    from minipaged.core.sched.output import CachedRequestData

    if not sched.running or budget <= 0:
        return budget
    if sched.num_lookahead_tokens or any(r.spec_token_ids for r in sched.running):
        raise _unsupported(ex, name, "without speculative decoding")
    scheduled, preempted, new_ids = _running(sched, budget, ex, name)
    for v in preempted:
        out.preempted.append(v)
        out.preempted_req_ids.add(v.request_id)
    for request, n in scheduled:
        ids = new_ids[request.request_id]
        sched._schedule(request, n, _blocks(ids), out)
        out.scheduled_cached_reqs.append(
            CachedRequestData(request.request_id, list(ids), request.num_computed_tokens)
        )
        budget -= n
    return budget


def paper_running_phase(sched, out, budget: int, ex: str, name: str):
    """``PaperScheduler.schedule``'s phase 1 by the notebook's ``schedule_running``: lone
    sequences and recompute only. -> ``(budget, preempted this step)``."""
    if not sched.running or budget <= 0:
        return budget, False
    if sched.seq_groups or sched.preemption_mode != "recompute":
        raise _unsupported(ex, name, "for lone sequences and recompute preemption (no groups, no swap)")
    scheduled, preempted, new_ids = _running(sched, budget, ex, name)
    for v in preempted:
        sched._synced.discard(v.request_id)
        out.preempted_req_ids.add(v.request_id)
        out.preempted.append(v)
    for request, n in scheduled:
        sched._schedule([(request, n)], [_blocks(new_ids[request.request_id])], out)
        budget -= n
    return budget, bool(preempted)
