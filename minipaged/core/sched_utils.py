"""Scheduler helpers: the KV bound of a request, and the trace drivers.

Mirrors vLLM ``vllm/v1/core/sched/utils.py`` (helpers the scheduler calls) for
``get_max_num_kv_tokens``; ``record_step`` / ``run_scheduler`` are minipaged's: they turn
scheduler steps into a ``StepRecord`` / ``EngineTrace`` (``minipaged/trace.py``).

Inputs / outputs
    ``get_max_num_kv_tokens(request, max_model_len)`` -> int (refusal rule, static
    reservation); ``record_step(scheduler, output, step)`` -> ``StepRecord`` after
    ``update_from_output``; ``run_scheduler(scheduler, arrivals, next_token)`` ->
    ``EngineTrace``, driving any scheduler with a fake model.
Invariants
    One ``record_step`` per step, taken after ``update_from_output``, so the engine, the
    simulator and the notebooks record the same thing.
Failure mode
    ``run_scheduler`` raises RuntimeError after ``max_steps`` steps (a scheduler that
    never finishes); the scheduler's own checks catch the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional

from minipaged.core.request import Request
from minipaged.core.sched_output import SchedulerOutput

if TYPE_CHECKING:  # NOTE: type names only; scheduler.py imports this module
    from minipaged.core.scheduler import _SchedulerBase


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


# -- traces ---------------------------------------------------------------------------
def record_step(scheduler: _SchedulerBase, output: SchedulerOutput, step: int):
    """A ``StepRecord`` of ``output``, taken after ``update_from_output``.

    Shared by the engine, the simulator and the notebooks, so that every trace means the
    same thing. ``num_tokens`` is the tokens each running request's blocks hold (its
    ``num_computed_tokens``; a static reservation holds more slots than tokens).
    """
    from minipaged.trace import StepRecord, count_holders

    kv = scheduler.kv_cache_manager
    tables = {r.request_id: kv.get_block_ids(r.request_id) for r in scheduler.running}
    holders = count_holders(tables)
    return StepRecord(
        step=step,
        scheduled=dict(output.num_scheduled_tokens),
        prefill_ids=list(output.prefill_ids),
        decode_ids=list(output.decode_ids),
        waiting_ids=[r.request_id for r in scheduler.waiting],
        preempted_ids=[r.request_id for r in output.preempted],
        swapped_out_ids=[r.request_id for r in output.swapped_out],
        swapped_in_ids=[r.request_id for r in output.swapped_in],
        swapped_ids=[r.request_id for r in scheduler.swapped],
        finished_ids=[r.request_id for r in output.finished],
        arrived_ids=[r.request_id for r in output.arrived],
        block_tables=tables,
        num_tokens={r.request_id: r.num_computed_tokens for r in scheduler.running},
        new_block_ids=list(output.new_block_ids),
        shared_blocks={b: n for b, n in holders.items() if n > 1},
        num_free_blocks=kv.get_num_free_blocks(),
    )


def run_scheduler(
    scheduler: _SchedulerBase,
    arrivals: dict[int, Iterable[Request]] | Iterable[Request],
    next_token: Callable[[Request], int],
    max_steps: int = 100_000,
):
    """Drive ``scheduler`` with a fake model; return the ``EngineTrace``.

    ``arrivals`` maps a step to the requests added before it (or is one list, all added
    before step 0); an entry that is itself a list of requests is a sequence group
    (``add_request_group``). ``next_token(request)`` plays the model: it is called for each
    request whose prefill completes at a step (and for each sequence forked with no token
    yet), and returns the token to append. Used by the
    notebooks and tests to watch the scheduler without a model.
    """
    from minipaged.trace import EngineTrace

    if not isinstance(arrivals, dict):
        arrivals = {0: list(arrivals)}
    trace = EngineTrace(
        num_blocks=scheduler.num_blocks,
        block_size=scheduler.block_size,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        meta={"scheduler": type(scheduler).__name__,
              "preemption_mode": scheduler.preemption_mode,
              "enable_chunked_prefill": scheduler.enable_chunked_prefill},
    )
    last_arrival = max(arrivals, default=0)
    step = 0
    while step <= last_arrival or scheduler.has_unfinished_requests():
        if step >= max_steps:
            raise RuntimeError(f"not finished after {max_steps} steps")
        for item in arrivals.get(step, ()):
            group = list(item) if isinstance(item, (list, tuple)) else [item]
            if isinstance(item, (list, tuple)):
                scheduler.add_request_group(group)
            else:
                scheduler.add_request(item)
            for req in group:
                trace.requests[req.request_id] = {
                    "prompt_len": req.num_prompt_tokens, "arrival_step": step,
                }
        out = scheduler.schedule()
        sampled = {
            r.request_id: next_token(r)
            for r, n in out.scheduled
            if r.num_computed_tokens + n == r.num_tokens
        }
        for _, child in out.fork_samples:
            sampled[child.request_id] = next_token(child)
        scheduler.update_from_output(out, sampled)
        trace.record(record_step(scheduler, out, step))
        for r in out.finished:
            trace.requests[r.request_id].update(
                output_len=r.num_output_tokens, finish_step=step,
                status=r.status.value, stop_reason=r.stop_reason,
                num_preemptions=r.num_preemptions,
            )
        step += 1
    return trace
