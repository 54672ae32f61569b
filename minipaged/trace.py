"""EngineTrace: what happened at every engine step, as plain data.

The pictures (``minipaged.viz``), the widgets and the notebooks are drawn from a trace,
never from live engine state, so everything they show can be tested, saved as JSON,
reloaded and compared. The engine and the simulator record the same ``StepRecord``.

Invariants (``EngineTrace.check_invariants``)
    steps are numbered 0, 1, 2, ...; per step the scheduled tokens fit the token budget
    and the running requests fit ``max_num_seqs``; every block id in a block table is in
    ``range(num_blocks)`` and is not listed as free; a block held by k tables has
    ``ref_cnt`` k (shared blocks are listed in ``shared_blocks``).

``record_step(scheduler, output, step)`` takes one ``StepRecord`` after
``update_from_output`` (the engine, the simulator and the notebooks all use it);
``run_scheduler(scheduler, arrivals, next_token)`` drives any scheduler with a fake model
and returns its ``EngineTrace`` (``RuntimeError`` after ``max_steps``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional


def count_holders(block_tables: dict[str, list[int]]) -> dict[int, int]:
    """Block id -> how many of these block tables hold it (its ref_cnt, when the tables
    are all of them); blocks held by more than one are the shared ones."""
    holders: dict[int, int] = {}
    for table in block_tables.values():
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    return holders


@dataclass(slots=True)
class StepRecord:
    step: int
    # request_id -> number of tokens computed for it this step (prefill chunk or 1)
    scheduled: dict[str, int] = field(default_factory=dict)
    prefill_ids: list[str] = field(default_factory=list)  # scheduled and still prefilling
    decode_ids: list[str] = field(default_factory=list)  # scheduled for one decode token
    waiting_ids: list[str] = field(default_factory=list)  # arrived, not running, after the step
    preempted_ids: list[str] = field(default_factory=list)  # preempted this step (recompute)
    swapped_out_ids: list[str] = field(default_factory=list)
    swapped_in_ids: list[str] = field(default_factory=list)
    swapped_ids: list[str] = field(default_factory=list)  # in the CPU pool after the step
    finished_ids: list[str] = field(default_factory=list)  # finished at the end of the step
    arrived_ids: list[str] = field(default_factory=list)  # arrived before this step
    # request_id -> its block table (physical block ids) after allocation this step
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> tokens held in its blocks after the step
    num_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: list[int] = field(default_factory=list)  # allocated this step
    shared_blocks: dict[int, int] = field(default_factory=dict)  # block id -> ref_cnt (> 1)
    num_free_blocks: int = 0
    time: Optional[float] = None  # simulated seconds (simulator); None for the engine


@dataclass
class EngineTrace:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    steps: list[StepRecord] = field(default_factory=list)
    # request_id -> {"prompt_len", "output_len", "arrival_step", "finish_step", ...}
    requests: dict[str, dict] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # free-form: scheduling, model, workload

    def record(self, rec: StepRecord) -> None:
        if rec.step != len(self.steps):
            raise RuntimeError(f"step {rec.step} recorded out of order (have {len(self.steps)})")
        self.steps.append(rec)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> StepRecord:
        return self.steps[i]

    # -- JSON ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        for s in d["steps"]:  # JSON object keys are strings
            s["shared_blocks"] = {str(k): v for k, v in s["shared_blocks"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EngineTrace:
        steps = []
        for s in d["steps"]:
            s = dict(s)
            s["shared_blocks"] = {int(k): v for k, v in s.get("shared_blocks", {}).items()}
            steps.append(StepRecord(**s))
        return cls(
            num_blocks=d["num_blocks"],
            block_size=d["block_size"],
            max_num_seqs=d["max_num_seqs"],
            max_num_batched_tokens=d["max_num_batched_tokens"],
            steps=steps,
            requests=d.get("requests", {}),
            meta=d.get("meta", {}),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> EngineTrace:
        return cls.from_dict(json.loads(s))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> EngineTrace:
        return cls.from_json(Path(path).read_text())

    def check_invariants(self) -> None:
        for i, s in enumerate(self.steps):
            assert s.step == i, f"step {i} is numbered {s.step}"
            total = sum(s.scheduled.values())
            assert total <= self.max_num_batched_tokens, (
                f"step {i}: {total} tokens > budget {self.max_num_batched_tokens}"
            )
            assert len(s.scheduled) <= self.max_num_seqs, (
                f"step {i}: {len(s.scheduled)} sequences > max_num_seqs {self.max_num_seqs}"
            )
            for rid, table in s.block_tables.items():
                for b in table:
                    assert 0 <= b < self.num_blocks, f"step {i}: {rid} holds block {b}"
            holders = count_holders(s.block_tables)
            for b, n in holders.items():
                if n > 1:
                    assert s.shared_blocks.get(b) == n, (
                        f"step {i}: block {b} held by {n} tables, shared_blocks says {s.shared_blocks.get(b)}"
                    )
            assert len(holders) + s.num_free_blocks <= self.num_blocks, (
                f"step {i}: {len(holders)} held + {s.num_free_blocks} free > {self.num_blocks}"
            )


# -- filling a trace from a scheduler ----------------------------------------------------
def _paper_scheduler():
    from minipaged.core.sched.paper import PaperScheduler

    return PaperScheduler


def _paper_output():
    from minipaged.core.sched.paper_output import PaperSchedulerOutput

    return PaperSchedulerOutput


def swapped_queue(scheduler) -> list:
    """The requests in the CPU pool, in arrival order: the paper's scheduler keeps them in
    its ``swapped`` queue; vLLM v1's scheduler (and the baselines built on it) never swaps."""
    return list(scheduler.swapped) if isinstance(scheduler, _paper_scheduler()) else []


def preemption_mode(scheduler) -> str:
    """``"swap"`` or ``"recompute"``: the paper's scheduler does either; vLLM v1 recomputes."""
    return scheduler.preemption_mode if isinstance(scheduler, _paper_scheduler()) else "recompute"


def record_step(scheduler, output, step: int) -> StepRecord:
    """A ``StepRecord`` of ``output``, taken after ``update_from_output``.

    Shared by the engine, the simulator and the notebooks, so that every trace means the
    same thing. ``num_tokens`` is the tokens each running request's blocks hold (its
    ``num_computed_tokens``; a static reservation holds more slots than tokens).
    """
    kv = scheduler.kv_cache_manager
    tables = {r.request_id: kv.get_block_ids(r.request_id) for r in scheduler.running}
    holders = count_holders(tables)
    paper = isinstance(output, _paper_output())  # NOTE: only the paper's scheduler swaps
    return StepRecord(
        step=step,
        scheduled=dict(output.num_scheduled_tokens),
        prefill_ids=list(output.prefill_ids),
        decode_ids=list(output.decode_ids),
        waiting_ids=[r.request_id for r in scheduler.waiting],
        preempted_ids=[r.request_id for r in output.preempted],
        swapped_out_ids=[r.request_id for r in output.swapped_out] if paper else [],
        swapped_in_ids=[r.request_id for r in output.swapped_in] if paper else [],
        swapped_ids=[r.request_id for r in swapped_queue(scheduler)],
        finished_ids=[r.request_id for r in output.finished],
        arrived_ids=[r.request_id for r in output.arrived],
        block_tables=tables,
        num_tokens={r.request_id: r.num_computed_tokens for r in scheduler.running},
        new_block_ids=list(output.new_block_ids),
        shared_blocks={b: n for b, n in holders.items() if n > 1},
        num_free_blocks=kv.get_num_free_blocks(),
    )


def run_scheduler(
    scheduler,
    arrivals: dict[int, Iterable] | Iterable,
    next_token: Callable,
    max_steps: int = 100_000,
) -> EngineTrace:
    """Drive ``scheduler`` with a fake model; return the ``EngineTrace``.

    ``arrivals`` maps a step to the requests added before it (or is one list, all added
    before step 0); an entry that is itself a list of requests is a sequence group
    (``add_request_group``). ``next_token(request)`` plays the model: it is called for each
    request whose prefill completes at a step (and for each sequence forked with no token
    yet), and returns the token to append. Used by the
    notebooks and tests to watch the scheduler without a model.
    """
    if not isinstance(arrivals, dict):
        arrivals = {0: list(arrivals)}
    trace = EngineTrace(
        num_blocks=scheduler.num_blocks,
        block_size=scheduler.block_size,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        meta={
            "scheduler": type(scheduler).__name__,
            "preemption_mode": preemption_mode(scheduler),
            "enable_chunked_prefill": scheduler.enable_chunked_prefill,
        },
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
                    "prompt_len": req.num_prompt_tokens,
                    "arrival_step": step,
                }
        out = scheduler.schedule()
        sampled = {
            r.request_id: next_token(r) for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens
        }
        if isinstance(out, _paper_output()):  # a forked child samples from its parent's row
            for _, child in out.fork_samples:
                sampled[child.request_id] = next_token(child)
        scheduler.update_from_output(out, sampled)
        trace.record(record_step(scheduler, out, step))
        for r in out.finished:
            trace.requests[r.request_id].update(
                output_len=r.num_output_tokens,
                finish_step=step,
                status=r.status.value,
                stop_reason=r.stop_reason,
                num_preemptions=r.num_preemptions,
            )
        step += 1
    return trace
