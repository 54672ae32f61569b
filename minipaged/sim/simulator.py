"""The serving simulator: the real scheduler, a cost model in place of the GPU.

Mirrors the experiment of the vLLM paper's section 6.2 (Fig. 12): requests arrive as a
Poisson process, a serving system batches them, and we measure latency per output token
against the request rate. vLLM itself has no simulator; the loop below is
``LLMEngine.step`` (``vllm/v1/engine/core.py``) with ``ModelRunner`` replaced by
``CostModel.step_time``.

The policies (``POLICIES``; the same KV memory for all, from ``CostModel``)
    ``"paged"``        the paper's vLLM: ``minipaged.core.PaperScheduler`` (continuous batching,
                       block tables, its watermark admission, recompute or swap preemption);
                       memory grows a block at a time.
    ``"orca-max"``, ``"orca-pow2"``, ``"orca-oracle"``
                       Orca-like: ``minipaged.core.sched.orca.OrcaScheduler``, continuous (iteration-level)
                       batching over ``minipaged.core.kv.contiguous.ContiguousAllocator``: a
                       request is admitted (FCFS, no skipping) only if a contiguous region
                       for its whole reservation (2048 / next power of two / exact length)
                       fits first-fit; it keeps it to the end, so nothing is preempted.
    ``"static"``       FasterTransformer-like: ``minipaged.core.StaticBatchScheduler``: a new
                       batch starts when the last one has completely finished; each member
                       reserves ``max_model_len`` tokens (the server does not know the output
                       length: ``max_tokens = max_model_len - prompt``, the end comes from EOS).

How a step is simulated
    arrivals up to the current time are added; ``schedule()`` picks the batch; the step
    takes ``cost_model.step_time([(num_new, num_computed), ...])`` seconds; the "model"
    samples token 1 for every request whose prefill completes, or the EOS token once the
    request reaches its trace ``output_len``; ``update_from_output`` advances and finishes
    requests. When nothing is unfinished the clock jumps to the next arrival. Swap
    preemption adds ``cost_model.swap_time`` for the blocks copied. Chunked prefill is off
    by default (as in the paper's systems) and the token budget is ``max_model_len +
    max_num_seqs`` (``default_max_num_batched_tokens``). ``n > 1`` (parallel sampling):
    see ``simulate``.

Inputs
    ``TraceRequest`` list (``minipaged.sim.arrivals``), a policy name, a ``CostModel``.

Outputs
    ``SimResult``: per-request ``RequestRecord`` (arrival, first token, finish, simulated
    seconds), ``SimMetrics`` (normalized latency = mean over requests of
    ``(finish - arrival) / output_len`` in s/token, as in the paper; TTFT; TPOT; throughput)
    and, with ``record_trace=True``, an ``EngineTrace`` whose ``StepRecord.time`` is the
    simulated time at the end of the step.

Sustainable rate (``RateSweep.sustainable_rate``), defined precisely
    the request rate at which a policy's mean normalized latency reaches ``factor`` times
    its light-load value (the first point of its sweep, at a quarter of its capacity,
    where nothing queues), interpolated linearly between the last rate under and the
    first rate over that level in an increasing sweep (``sustainable_rate``); default
    ``factor = DEFAULT_LATENCY_FACTOR = 2``: the knee where queueing has doubled the time
    per token. Alternatively one absolute ``threshold`` in s/token for every policy
    (a horizontal line across the paper's Fig. 12).
    NOTE: why not the paper's reading of Fig. 12 (where the curves shoot up)? Its traces
    are an hour long; past capacity a queue then grows for an hour and the latency
    explodes. Our runs are a few hundred requests (CPU time), so past capacity the latency
    grows only in proportion to the run length, and any fixed absolute level is reached
    at an overload that depends on that length and on the workload's time scale (an
    Alpaca request takes a sixth of a ShareGPT one). A level relative to the light-load
    latency is reached just past the knee on every workload and GPU. ``offline_capacity``
    (the throughput with a full queue) is reported beside it; the notebook shows how the
    ratio moves with the factor, the threshold and the run length.

Invariants
    every request either finishes with exactly ``output_len`` tokens or is refused
    (``FINISHED_IGNORED``, counted in ``num_refused``); ``check=True`` runs the scheduler's
    ``check_invariants()`` after every step and checks the contiguous pool never holds
    more slots than it has.

Failure mode
    an unknown policy, a request longer than ``max_model_len`` (prompt + output) or another
    bad argument -> ``ValueError``; a scheduler that makes no progress
    while requests are pending, or more than ``max_steps`` steps -> ``RuntimeError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Optional

from minipaged.core.sched import (
    PaperScheduler,
    PaperSchedulerOutput,
    Request,
    RequestStatus,
    StaticBatchScheduler,
)
from minipaged.core.sched.orca import OrcaScheduler
from minipaged.sampling_params import SamplingParams
from minipaged.sim.arrivals import TraceRequest
from minipaged.sim.cost_model import CostModel
from minipaged.trace import EngineTrace, record_step

POLICIES = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")
POLICY_NAMES = {
    "paged": "vLLM (paged)",
    "orca-oracle": "Orca (Oracle)",
    "orca-pow2": "Orca (Pow2)",
    "orca-max": "Orca (Max)",
    "static": "FasterTransformer (static)",
}
DEFAULT_LATENCY_FACTOR = 2.0  # the knee: latency per token twice its light-load value
EOS_TOKEN_ID = 2  # the simulated model samples token 1, and EOS at the end of the output
OTHER_TOKEN_ID = 1


# -- results ------------------------------------------------------------------------------
@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0
    refused: bool = False

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def normalized_latency(self) -> float:
        """End-to-end latency divided by the output length (the paper's s/token)."""
        return self.latency / self.output_len

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first (None for a 1-token output)."""
        if self.output_len < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.output_len - 1)


@dataclass
class SimMetrics:
    num_requests: int  # finished (refused ones excluded from every mean below)
    num_refused: int
    duration: float  # s, from time 0 to the last finish
    normalized_latency: float  # mean over requests, s/token
    p90_normalized_latency: float
    mean_latency: float  # s
    mean_ttft: float  # s
    mean_tpot: float  # s/token, over requests with >= 2 output tokens
    request_throughput: float  # finished requests / duration
    token_throughput: float  # output tokens / duration
    num_steps: int = 0
    num_preemptions: int = 0
    mean_batch_size: float = 0.0  # sequences per step, averaged over steps
    # ... averaged over the steps that leave requests waiting, where memory (or the token
    # budget), not demand, limits the batch: the paper's Fig. 13
    mean_loaded_batch_size: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(
    records: Sequence[RequestRecord],
    num_steps: int = 0,
    num_preemptions: int = 0,
    mean_batch_size: float = 0.0,
    mean_loaded_batch_size: float = 0.0,
) -> SimMetrics:
    """Aggregate per-request records (see ``RequestRecord`` for each quantity)."""
    done = [r for r in records if not r.refused]
    if not done:
        raise ValueError("records has no finished request")
    if any(r.finish_time is None or r.first_token_time is None for r in done):
        raise ValueError("records has an unfinished request")
    n = len(done)
    norm = sorted(r.normalized_latency for r in done)
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    duration = max(r.finish_time for r in done)
    return SimMetrics(
        num_requests=n,
        num_refused=len(records) - n,
        duration=duration,
        normalized_latency=sum(norm) / n,
        p90_normalized_latency=norm[min(n - 1, math.ceil(0.9 * n) - 1)],
        mean_latency=sum(r.latency for r in done) / n,
        mean_ttft=sum(r.ttft for r in done) / n,
        mean_tpot=sum(tpots) / len(tpots) if tpots else 0.0,
        request_throughput=n / duration if duration > 0 else math.inf,
        token_throughput=sum(r.output_len for r in done) / duration if duration > 0 else math.inf,
        num_steps=num_steps,
        num_preemptions=num_preemptions,
        mean_batch_size=mean_batch_size,
        mean_loaded_batch_size=mean_loaded_batch_size,
    )


@dataclass
class SimResult:
    policy: str
    metrics: SimMetrics
    records: list[RequestRecord]
    trace: Optional[EngineTrace] = None
    config: dict = field(default_factory=dict)


# -- the simulation loop --------------------------------------------------------------------
def default_max_num_batched_tokens(max_model_len: int, max_num_seqs: int) -> int:
    """A token budget in which a whole prompt always fits beside a full batch of decodes.

    NOTE: with chunked prefill off, a prompt larger than what the running decodes leave of
    the budget waits, and (FCFS) everything behind it waits too, until the batch drains.
    vLLM v0 avoided that by running prompts in separate prefill-only steps; a budget of
    ``max_model_len + max_num_seqs`` does the same here for mixed steps.
    """
    return max_model_len + max_num_seqs


def make_scheduler(
    policy: str,
    cost_model: CostModel,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: Optional[int] = None,
    enable_chunked_prefill: bool = False,
    preemption_mode: str = "recompute",
    num_cpu_blocks: int = 0,
):
    """The scheduler of ``policy``, sized to the KV budget of ``cost_model``."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    max_model_len = cost_model.model.max_model_len
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_max_num_batched_tokens(max_model_len, max_num_seqs)
    if preemption_mode == "swap" and num_cpu_blocks == 0:
        # NOTE: vLLM's default swap space is 4 GiB of pinned host memory per GPU
        num_cpu_blocks = int(4 * 1024**3 // (block_size * cost_model.model.kv_bytes_per_token))
    if policy.startswith("orca-"):
        return OrcaScheduler(
            cost_model.num_kv_tokens(),
            max_model_len,
            policy[len("orca-") :],
            max_num_seqs,
            max_num_batched_tokens,
        )
    kwargs = dict(
        num_blocks=cost_model.num_gpu_blocks(block_size),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=max_model_len,
    )
    if policy == "static":
        return StaticBatchScheduler(**kwargs)
    return PaperScheduler(**kwargs, preemption_mode=preemption_mode, num_cpu_blocks=num_cpu_blocks)


def _make_request(tr: TraceRequest, policy: str, max_model_len: int, request_id: str) -> Request:
    if policy == "static":
        # NOTE: a static server does not know the output length: it caps it at the
        # context and reserves for that cap; the output ends when the model samples EOS.
        params = SamplingParams(max_tokens=max(1, max_model_len - tr.prompt_len))
    else:
        params = SamplingParams(max_tokens=tr.output_len, ignore_eos=True)
    # NOTE: token ids do not matter (no prefix caching); one id for the whole prompt.
    return Request(
        request_id,
        [OTHER_TOKEN_ID] * tr.prompt_len,
        params,
        eos_token_id=EOS_TOKEN_ID,
        arrival_time=tr.arrival_time,
    )


def simulate(
    requests: Sequence[TraceRequest],
    policy: str = "paged",
    cost_model: Optional[CostModel] = None,
    *,
    n: int = 1,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: Optional[int] = None,
    enable_chunked_prefill: bool = False,
    preemption_mode: str = "recompute",
    num_cpu_blocks: int = 0,
    record_trace: bool = False,
    check: bool = False,
    max_steps: int = 10_000_000,
) -> SimResult:
    """Serve ``requests`` under ``policy`` on the simulated GPU (see the module docstring).

    ``n > 1`` is parallel sampling: every request asks for ``n`` samples of its
    ``output_len`` tokens. The paged policy queues them as one sequence group (prompt
    prefilled once, blocks shared, copy-on-write); Orca-like and static policies serve them
    as ``n`` independent sequences, each with its own reservation. A request's first
    token is its group's first; it finishes when its last sample does. Samples are named
    ``<request_id>``, ``<request_id>.1``, ... in the trace.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    cost_model = cost_model or CostModel()
    max_model_len = cost_model.model.max_model_len
    sched = make_scheduler(
        policy,
        cost_model,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        enable_chunked_prefill,
        preemption_mode,
        num_cpu_blocks,
    )
    max_num_batched_tokens = sched.max_num_batched_tokens
    contiguous = isinstance(sched, OrcaScheduler)
    reqs = sorted(requests, key=lambda r: r.arrival_time)
    records = {
        r.request_id: RequestRecord(r.request_id, r.arrival_time, r.prompt_len, r.output_len) for r in reqs
    }
    if len(records) != len(reqs):
        raise ValueError("requests has duplicate request ids")
    for r in reqs:
        if r.prompt_len + r.output_len > max_model_len:
            raise ValueError(
                f"request {r.request_id!r}: prompt_len {r.prompt_len} + output_len "
                f"{r.output_len} exceeds max_model_len {max_model_len}"
            )
    owner: dict[str, RequestRecord] = {}  # sequence id -> its request's record
    remaining: dict[str, int] = {}  # request id -> samples not finished yet
    trace = None
    if record_trace:
        trace = EngineTrace(
            num_blocks=sched.allocator.num_slots if contiguous else sched.num_blocks,
            block_size=1 if contiguous else block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            meta={
                "simulated": True,
                "policy": policy,
                "model": cost_model.model.name,
                "gpu": cost_model.gpu.name,
                "time_unit": "s",
                "n": n,
            },
        )
    step_time = cost_model.step_time
    t = 0.0
    i = 0
    step = 0
    batch_sum = loaded_steps = loaded_batch_sum = 0
    while i < len(reqs) or sched.has_unfinished_requests():
        while i < len(reqs) and reqs[i].arrival_time <= t:
            tr = reqs[i]
            ids = [tr.request_id] + [f"{tr.request_id}.{k}" for k in range(1, n)]
            seqs = [_make_request(tr, policy, max_model_len, sid) for sid in ids]
            if contiguous:
                for seq in seqs:
                    sched.add_request(seq, tr.prompt_len + tr.output_len)
            elif n == 1:
                sched.add_request(seqs[0])
            else:
                sched.add_request_group(seqs)
            remaining[tr.request_id] = n
            for sid in ids:
                owner[sid] = records[tr.request_id]
                if trace is not None:
                    trace.requests[sid] = {
                        "prompt_len": tr.prompt_len,
                        "output_len": tr.output_len,
                        "arrival_time": tr.arrival_time,
                        "arrival_step": step,
                    }
            i += 1
        if not sched.has_unfinished_requests():
            t = reqs[i].arrival_time  # idle: jump to the next arrival
            continue
        if step >= max_steps:
            raise RuntimeError(f"not finished after {max_steps} steps")
        out = sched.schedule()
        batch = [(k, r.num_computed_tokens) for r, k in out.scheduled]
        sampled = {}
        # NOTE: a request samples exactly when update_from_output appends a token to it, so
        # a record still without a first token gets it this step iff one of its sequences
        # samples now (one pass over the batch, not a second one after the update)
        firsts = []
        for (r, k), (_, c) in zip(out.scheduled, batch):
            num_output = len(r.output_token_ids)
            if c + k == len(r.prompt_token_ids) + num_output:  # its prefill completes: it samples
                rec = owner[r.request_id]
                last = num_output + 1 >= rec.output_len
                sampled[r.request_id] = EOS_TOKEN_ID if last else OTHER_TOKEN_ID
                if rec.first_token_time is None:
                    firsts.append(rec)
        paper = isinstance(out, PaperSchedulerOutput)  # the paged policy: forks and swaps
        for _, child in out.fork_samples if paper else ():  # forked: sampled from the parent's row
            rec = owner[child.request_id]
            last = child.num_output_tokens + 1 >= rec.output_len
            sampled[child.request_id] = EOS_TOKEN_ID if last else OTHER_TOKEN_ID
            if rec.first_token_time is None:
                firsts.append(rec)
        if batch:
            t += step_time(batch)
            if paper and (out.blocks_to_swap_out or out.blocks_to_swap_in):
                moved = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
                t += cost_model.swap_time(moved * block_size)
        elif not out.refused:
            if i >= len(reqs):
                raise RuntimeError(f"step {step}: nothing schedulable and no arrival to wait for")
            sched.update_from_output(out, {})
            t = max(t, reqs[i].arrival_time)  # blocked until something changes
            continue
        finished = sched.update_from_output(out, sampled)
        for rec in firsts:
            rec.first_token_time = t
        for r in finished:
            rec = owner[r.request_id]
            if r.status == RequestStatus.FINISHED_IGNORED:
                rec.refused = True
                continue
            if r.num_output_tokens != rec.output_len:
                raise RuntimeError(
                    f"{r.request_id} finished with {r.num_output_tokens} tokens, expected {rec.output_len}"
                )
            rec.num_preemptions = max(rec.num_preemptions, r.num_preemptions)
            remaining[rec.request_id] -= 1
            if remaining[rec.request_id] == 0:
                rec.finish_time = t
        batch_sum += len(batch)
        if sched.waiting:
            loaded_steps += 1
            loaded_batch_sum += len(batch)
        if check:
            sched.check_invariants()
        if trace is not None:
            rec_ = sched.record(out, step) if contiguous else record_step(sched, out, step)
            rec_.time = t
            trace.record(rec_)
            for r in finished:
                trace.requests[r.request_id].update(
                    finish_step=step, finish_time=t, status=r.status.value, num_preemptions=r.num_preemptions
                )
        step += 1
    recs = list(records.values())
    for rec in recs:
        if rec.refused:  # NOTE: a group is refused as a whole; Orca may refuse some samples only
            rec.finish_time = rec.first_token_time = None
    metrics = compute_metrics(
        recs,
        num_steps=step,
        num_preemptions=sum(r.num_preemptions for r in recs),
        mean_batch_size=batch_sum / step if step else 0.0,
        mean_loaded_batch_size=loaded_batch_sum / loaded_steps if loaded_steps else 0.0,
    )
    config = {
        "policy": policy,
        "n": n,
        "block_size": block_size,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "model": cost_model.model.name,
        "gpu": cost_model.gpu.name,
        "num_kv_tokens": cost_model.num_kv_tokens(),
    }
    return SimResult(policy, metrics, recs, trace, config)


# -- sweeps ---------------------------------------------------------------------------------
# Rates of a sweep, as fractions of the policy's offline capacity: the knee of every
# policy's curve falls inside its own grid whatever its capacity; the first point is the
# light-load reference.
RATE_FRACTIONS = (0.25, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5)


def sustainable_rate(rates: Sequence[float], latencies: Sequence[float], threshold: float) -> float:
    """The rate where ``latencies`` first cross ``threshold``, linearly interpolated.

    ``rates`` strictly increasing. 0.0 if even the lowest rate is over; the highest rate if
    none is (a lower bound only: sweep further).
    """
    if len(rates) != len(latencies) or not rates:
        raise ValueError("rates and latencies must be non-empty and of equal length")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError("rates must be strictly increasing")
    if latencies[0] > threshold:
        return 0.0
    for k in range(1, len(rates)):
        if latencies[k] > threshold:
            r0, r1, l0, l1 = rates[k - 1], rates[k], latencies[k - 1], latencies[k]
            return r0 + (r1 - r0) * (threshold - l0) / (l1 - l0)
    return float(rates[-1])


@dataclass
class RateSweep:
    """One policy's normalized-latency-vs-rate curve."""

    policy: str
    capacity: float  # req/s with a full queue (``offline_capacity``)
    rates: list[float]
    metrics: list[SimMetrics]

    @property
    def normalized_latencies(self) -> list[float]:
        return [m.normalized_latency for m in self.metrics]

    def level(self, factor: float = DEFAULT_LATENCY_FACTOR, threshold: Optional[float] = None) -> float:
        """The latency level (s/token) that defines sustainable: ``threshold`` if given,
        else ``factor`` times the light-load latency (the first point of the sweep)."""
        if threshold is not None:
            return threshold
        if not factor > 1:
            raise ValueError(f"factor must be > 1, got {factor!r}")
        return factor * self.normalized_latencies[0]

    def sustainable_rate(
        self, factor: float = DEFAULT_LATENCY_FACTOR, threshold: Optional[float] = None
    ) -> float:
        return sustainable_rate(self.rates, self.normalized_latencies, self.level(factor, threshold))

    def saturated(self, factor: float = DEFAULT_LATENCY_FACTOR, threshold: Optional[float] = None) -> bool:
        """True if even the highest rate stayed under the level (the rate is a lower bound)."""
        return self.normalized_latencies[-1] <= self.level(factor, threshold)

    def to_dict(self, factor: float = DEFAULT_LATENCY_FACTOR, threshold: Optional[float] = None) -> dict:
        return {
            "policy": self.policy,
            "name": POLICY_NAMES[self.policy],
            "capacity": self.capacity,
            "rates": self.rates,
            "normalized_latency": self.normalized_latencies,
            "latency_level": self.level(factor, threshold),
            "sustainable_rate": self.sustainable_rate(factor, threshold),
            "saturated": self.saturated(factor, threshold),
            "metrics": [m.to_dict() for m in self.metrics],
        }


def _at_rate(lengths: Sequence[tuple[int, int]], rate: float, seed: int) -> list[TraceRequest]:
    from minipaged.sim.arrivals import poisson_workload

    return poisson_workload("", len(lengths), rate, seed, lengths=lengths)


def offline_capacity(
    lengths: Sequence[tuple[int, int]],
    policy: str,
    cost_model: Optional[CostModel] = None,
    seed: int = 0,
    **sim_kwargs,
) -> float:
    """Requests/s served while the queue is full: all of ``lengths`` arrive at once and we
    count the finishes between the 20th and 80th percentile of finish times.

    NOTE: not ``num_requests / duration``: the end of an offline run is a drain in which a
    few long requests run almost alone, which would understate the capacity.
    """
    res = simulate(_at_rate(lengths, math.inf, seed), policy, cost_model, **sim_kwargs)
    done = sorted(r.finish_time for r in res.records if not r.refused)
    if len(done) < 5:
        return res.metrics.request_throughput
    lo, hi = int(0.2 * len(done)), int(0.8 * len(done))
    span = done[hi] - done[lo]
    return (hi - lo) / span if span > 0 else res.metrics.request_throughput


def _run(args) -> SimMetrics:
    lengths, rate, policy, cost_model, seed, sim_kwargs = args
    return simulate(_at_rate(lengths, rate, seed), policy, cost_model, **sim_kwargs).metrics


def _map(fn, tasks: list, jobs: int) -> list:
    """``[fn(t) for t in tasks]``, in ``jobs`` processes when ``jobs > 1`` (same results)."""
    if jobs <= 1 or len(tasks) <= 1:
        return [fn(t) for t in tasks]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as ex:
        return list(ex.map(fn, tasks))


def _capacity(args) -> float:
    lengths, policy, cost_model, seed, sim_kwargs = args
    return offline_capacity(lengths, policy, cost_model, seed, **sim_kwargs)


def sweep_rates(
    lengths: Sequence[tuple[int, int]],
    policy: str,
    cost_model: Optional[CostModel] = None,
    rates: Optional[Sequence[float]] = None,
    rate_fractions: Sequence[float] = RATE_FRACTIONS,
    seed: int = 0,
    jobs: int = 1,
    **sim_kwargs,
) -> RateSweep:
    """Simulate ``policy`` on the requests ``lengths`` (``(prompt, output)`` pairs) arriving
    as a Poisson process at each rate; by default at ``rate_fractions`` of the offline
    capacity. The same seed gives the same arrival pattern at every rate."""
    return sweep_many(lengths, [policy], cost_model, rates, rate_fractions, seed, jobs, **sim_kwargs)[policy]


def sweep_many(
    lengths: Sequence[tuple[int, int]],
    policies: Sequence[str],
    cost_model: Optional[CostModel] = None,
    rates: Optional[Sequence[float]] = None,
    rate_fractions: Sequence[float] = RATE_FRACTIONS,
    seed: int = 0,
    jobs: int = 1,
    **sim_kwargs,
) -> dict[str, RateSweep]:
    """``sweep_rates`` for several policies, all runs spread over ``jobs`` processes."""
    cost_model = cost_model or CostModel()
    lengths = list(lengths)
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {p!r}")
    caps = _map(_capacity, [(lengths, p, cost_model, seed, sim_kwargs) for p in policies], jobs)
    grid = {
        p: (list(rates) if rates is not None else [round(c * f, 4) for f in rate_fractions])
        for p, c in zip(policies, caps)
    }
    tasks = [(lengths, r, p, cost_model, seed, sim_kwargs) for p in policies for r in grid[p]]
    results = iter(_map(_run, tasks, jobs))
    return {p: RateSweep(p, c, grid[p], [next(results) for _ in grid[p]]) for p, c in zip(policies, caps)}


@dataclass
class PolicyComparison:
    """Every policy's curve on one workload; ratios of sustainable rates."""

    workload: str
    sweeps: dict[str, RateSweep]
    factor: float = DEFAULT_LATENCY_FACTOR
    threshold: Optional[float] = None  # absolute s/token for all policies, instead of factor
    config: dict = field(default_factory=dict)

    def sustainable(self) -> dict[str, float]:
        return {p: s.sustainable_rate(self.factor, self.threshold) for p, s in self.sweeps.items()}

    def ratio(self, policy: str = "paged", baseline: str = "orca-oracle") -> float:
        """Sustainable rate of ``policy`` over that of ``baseline`` (inf if the baseline's is 0)."""
        s = self.sustainable()
        return s[policy] / s[baseline] if s[baseline] > 0 else math.inf

    def capacity_ratio(self, policy: str = "paged", baseline: str = "orca-oracle") -> float:
        return self.sweeps[policy].capacity / self.sweeps[baseline].capacity

    def to_dict(self) -> dict:
        s = self.sustainable()
        others = [p for p in s if p != "paged"] if "paged" in s else []
        return {
            "workload": self.workload,
            "latency_factor": self.factor,
            "threshold": self.threshold,
            "config": self.config,
            "sustainable_rate": s,
            "ratios": {f"paged/{p}": self.ratio("paged", p) for p in others},
            "capacity_ratios": {f"paged/{p}": self.capacity_ratio("paged", p) for p in others},
            "sweeps": {p: sw.to_dict(self.factor, self.threshold) for p, sw in self.sweeps.items()},
        }


def compare_policies(
    workload: str,
    num_requests: int = 500,
    seed: int = 0,
    cost_model: Optional[CostModel] = None,
    policies: Sequence[str] = POLICIES,
    factor: float = DEFAULT_LATENCY_FACTOR,
    threshold: Optional[float] = None,
    rate_fractions: Sequence[float] = RATE_FRACTIONS,
    lengths: Optional[Sequence[tuple[int, int]]] = None,
    jobs: int = 1,
    **sim_kwargs,
) -> PolicyComparison:
    """The paper's Fig. 12 on one workload: a rate sweep per policy, the same requests for all."""
    cost_model = cost_model or CostModel()
    if lengths is None:
        from minipaged.sim.workloads import sample_requests

        lengths = sample_requests(workload, num_requests, seed, cost_model.model.max_model_len)
    sweeps = sweep_many(lengths, policies, cost_model, None, rate_fractions, seed, jobs, **sim_kwargs)
    config = {
        "num_requests": len(lengths),
        "seed": seed,
        "model": cost_model.model.name,
        "gpu": cost_model.gpu.name,
        "num_kv_tokens": cost_model.num_kv_tokens(),
        "rate_fractions": list(rate_fractions),
        **sim_kwargs,
    }
    return PolicyComparison(workload, sweeps, factor, threshold, config)


def block_size_sweep(
    workload: str,
    block_sizes: Sequence[int] = (8, 16, 32, 64, 128, 256),
    num_requests: int = 500,
    seed: int = 0,
    cost_model: Optional[CostModel] = None,
    rate: Optional[float] = None,
    lengths: Optional[Sequence[tuple[int, int]]] = None,
    jobs: int = 1,
    **sim_kwargs,
) -> dict:
    """The paper's Fig. 18b on the paged policy: per block size, the capacity and the
    normalized latency at one request rate (default: the capacity at block size 16)."""
    cost_model = cost_model or CostModel()
    if lengths is None:
        from minipaged.sim.workloads import sample_requests

        lengths = sample_requests(workload, num_requests, seed, cost_model.model.max_model_len)
    lengths = list(lengths)
    block_sizes = list(block_sizes)
    caps = _map(
        _capacity,
        [(lengths, "paged", cost_model, seed, {**sim_kwargs, "block_size": b}) for b in block_sizes],
        jobs,
    )
    if rate is None:
        rate = round(caps[block_sizes.index(16)] if 16 in block_sizes else caps[0], 4)
    ms = _map(
        _run,
        [(lengths, rate, "paged", cost_model, seed, {**sim_kwargs, "block_size": b}) for b in block_sizes],
        jobs,
    )
    return {
        "workload": workload,
        "rate": rate,
        "block_sizes": block_sizes,
        "capacity": caps,
        "normalized_latency": [m.normalized_latency for m in ms],
        "num_preemptions": [m.num_preemptions for m in ms],
        "num_requests": len(lengths),
        "seed": seed,
    }
