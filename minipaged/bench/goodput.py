"""Latency targets and goodput: TTFT and ITL percentiles, and the requests that met both.

Concept
    Users judge a server by two latencies: the time to the first token (TTFT, from arrival
    to the first token) and the gaps between the tokens that follow (ITL, inter-token
    latency; TPOT is one request's mean ITL). *Goodput* is the rate of requests that met
    every target (DistServe's measure; ``vllm bench serve --goodput ttft:MS tpot:MS``):
    a server that finishes many requests late has throughput but no goodput.

Inputs / outputs
    ``token_times(trace, step_times)``: the time each request's tokens left, read off an
    ``EngineTrace`` (a request samples in each decode step and in the step that ends its
    prefill) and each step's end time (the trace's own ``time`` for the
    simulator, wall-clock times for the engine: ``drive_engine``).
    ``latency_report(arrivals, times, slo, duration)`` -> ``LatencyReport``: TTFT, ITL and
    TPOT percentiles, the requests meeting ``slo`` and the goodput in requests/s.
    ``drive_engine(engine, requests, arrivals)`` serves requests on a real ``LLMEngine`` as
    they arrive in wall-clock time and returns arrivals, token times and duration.

Invariants
    each request's token times are non-decreasing and the first is not before its arrival;
    goodput <= finished requests / duration; a request meets the SLO iff its TTFT and its
    TPOT are both within target (a one-token request: TTFT only).

Failure mode
    a request with no token (never scheduled) counts as missing the SLO; a bad target
    (not a positive number) raises ``ValueError``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds: TTFT and TPOT (a request's mean inter-token gap)."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (numpy's linear rule); nan if there are no values."""
    return float(np.percentile(values, p)) if len(values) else math.nan


@dataclass
class LatencyReport:
    num_requests: int
    num_good: int  # requests that met both targets
    duration: float  # s
    ttft: dict = field(default_factory=dict)  # percentile -> s
    itl: dict = field(default_factory=dict)  # percentile -> s, over every gap of every request
    tpot: dict = field(default_factory=dict)  # percentile -> s, one value per request
    slo: Optional[SLO] = None

    @property
    def goodput(self) -> float:
        """Requests per second that met every target."""
        return self.num_good / self.duration if self.duration > 0 else 0.0

    @property
    def throughput(self) -> float:
        return self.num_requests / self.duration if self.duration > 0 else 0.0

    def check_invariants(self) -> None:
        assert 0 <= self.num_good <= self.num_requests, (self.num_good, self.num_requests)
        assert self.goodput <= self.throughput + 1e-12

    def line(self, label: str = "") -> str:
        ms = lambda d: "/".join(f"{d[p] * 1e3:.0f}" for p in PERCENTILES)  # noqa: E731
        pct = "/".join(f"p{p}" for p in PERCENTILES)
        return (
            f"{label}TTFT {pct} {ms(self.ttft)} ms, ITL {ms(self.itl)} ms, TPOT {ms(self.tpot)} ms; "
            f"{self.num_good}/{self.num_requests} met the targets: goodput {self.goodput:.2f} req/s "
            f"of {self.throughput:.2f}"
        )


def token_times(trace, step_times: Optional[dict] = None, first_step: int = 0) -> dict[str, list[float]]:
    """request id -> the time each of its tokens left (the end of the step that sampled it).

    A request samples a token in every decode step, and in the prefill step that computes
    the last of its known tokens (its prompt, plus what it had produced before a
    recompute-preemption). ``step_times``: step -> time, for a trace without its own times
    (the engine's); ``first_step``: the first step to read.
    """
    out: dict[str, list[float]] = {}
    for rec in trace.steps[first_step:]:
        t = step_times[rec.step] if step_times is not None else rec.time
        if t is None:
            raise ValueError(f"step {rec.step} has no time: pass step_times (wall clock) for an engine trace")
        decoding = set(rec.decode_ids)
        for rid in rec.scheduled:
            known = trace.requests[rid]["prompt_len"] + len(out.get(rid, ()))
            computed = rec.num_tokens.get(rid)  # None: finished at this step
            if rid in decoding or computed is None or computed >= known:
                out.setdefault(rid, []).append(t)
    return out


def latency_report(
    arrivals: dict[str, float], times: dict[str, list[float]], slo: SLO, duration: float
) -> LatencyReport:
    """TTFT / ITL / TPOT percentiles over ``arrivals``' requests, and who met ``slo``."""
    ttfts, itls, tpots, good = [], [], [], 0
    for rid, arrived in arrivals.items():
        ts = times.get(rid, [])
        if not ts:
            continue  # never produced a token: misses the targets
        if ts[0] < arrived - 1e-9 or any(b < a for a, b in zip(ts, ts[1:])):
            raise ValueError(f"request {rid!r}: token times {ts[:4]}... not ordered after arrival {arrived}")
        ttft = ts[0] - arrived
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        ttfts.append(ttft)
        itls += gaps
        tpot = sum(gaps) / len(gaps) if gaps else None
        if tpot is not None:
            tpots.append(tpot)
        good += ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)
    rep = LatencyReport(
        num_requests=len(arrivals),
        num_good=good,
        duration=duration,
        ttft={p: percentile(ttfts, p) for p in PERCENTILES},
        itl={p: percentile(itls, p) for p in PERCENTILES},
        tpot={p: percentile(tpots, p) for p in PERCENTILES},
        slo=slo,
    )
    rep.check_invariants()
    return rep


def drive_engine(engine, requests: Sequence[tuple], arrivals: Sequence[float], clock=time.perf_counter):
    """Serve ``(request_id, prompt, SamplingParams)`` on ``engine`` as they arrive (seconds from now).

    Returns ``(arrivals by id, token times by id, duration)``, all in seconds from the start.
    Between arrivals an idle engine sleeps; a busy one steps, and a request that arrives
    during a step joins at the next one (as in a server's engine loop).
    """
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    arrived: dict[str, float] = {}
    step_times: dict[int, float] = {}
    first = len(engine.trace.steps)
    t0 = clock()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = clock() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            rid, prompt, params = requests[order[nxt]]
            engine.add_request(rid, prompt, params)
            arrived[str(rid)] = float(arrivals[order[nxt]])
            nxt += 1
        if engine.has_unfinished_requests():
            engine.step()
            step_times[engine.trace.steps[-1].step] = clock() - t0
        elif nxt < len(order):
            time.sleep(max(0.0, arrivals[order[nxt]] - (clock() - t0)))
    duration = clock() - t0
    times = token_times(engine.trace, step_times, first)
    return arrived, times, duration
