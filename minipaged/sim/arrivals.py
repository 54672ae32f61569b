"""Request arrivals: when each simulated request reaches the server, and how long it is.

Mirrors the request generator of vLLM's ``benchmarks/benchmark_serving.py``
(``get_request``: exponential gaps at ``request_rate``, all at once when the rate is
infinite) and the paper's §6.1 setup (Poisson arrivals, lengths from a dataset).

Inputs
    a rate (requests/s), a count and a seed; lengths from ``minipaged.sim.workloads``
    (``sample_requests``) or from a trace file (JSON list of objects, or CSV with a header,
    with fields ``arrival_time``, ``prompt_len``, ``output_len``; ``request_id`` optional).

Outputs
    ``TraceRequest`` records sorted by arrival time (``arrival_time`` in seconds from 0).

Invariants
    arrival times are non-decreasing and >= 0; lengths are positive ints; request ids are
    unique. ``poisson_arrivals(n, r, seed)`` equals ``poisson_arrivals(n, 1, seed) / r``:
    the same seed gives the same arrival *pattern* at every rate, so a rate sweep compares
    like with like (common random numbers).

Failure mode
    a non-positive rate or count, a negative or unsorted arrival, a non-positive length, or
    a trace file with a missing column -> ``ValueError`` naming it.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    arrival_time: float  # seconds
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if not (isinstance(self.prompt_len, int) and self.prompt_len > 0):
            raise ValueError(
                f"prompt_len of {self.request_id!r} must be a positive int, got {self.prompt_len!r}"
            )
        if not (isinstance(self.output_len, int) and self.output_len > 0):
            raise ValueError(
                f"output_len of {self.request_id!r} must be a positive int, got {self.output_len!r}"
            )
        if not (self.arrival_time >= 0 and math.isfinite(self.arrival_time)):
            raise ValueError(
                f"arrival_time of {self.request_id!r} must be finite and >= 0, got {self.arrival_time!r}"
            )


def poisson_arrivals(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process at ``request_rate`` requests/s (first gap included).

    ``request_rate=inf`` puts every request at time 0 (the offline/batch setting).
    """
    if not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf = all at once), got {request_rate!r}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(1.0)  # unit-rate gaps, scaled below: same pattern at every rate
        out.append(t / request_rate)
    return out


def make_requests(
    lengths: Sequence[tuple[int, int]], arrival_times: Sequence[float], prefix: str = "r"
) -> list[TraceRequest]:
    """Pair ``(prompt_len, output_len)`` with arrival times; ids ``r0, r1, ...``."""
    if len(lengths) != len(arrival_times):
        raise ValueError(
            f"lengths ({len(lengths)}) and arrival_times ({len(arrival_times)}) differ in length"
        )
    reqs = [
        TraceRequest(f"{prefix}{i}", float(t), int(p), int(o))
        for i, ((p, o), t) in enumerate(zip(lengths, arrival_times))
    ]
    _check_sorted(reqs)
    return reqs


def poisson_workload(
    workload: str,
    num_requests: int,
    request_rate: float,
    seed: int = 0,
    lengths: Optional[Sequence[tuple[int, int]]] = None,
) -> list[TraceRequest]:
    """``num_requests`` requests of ``workload`` ("sharegpt" / "alpaca") arriving as a
    Poisson process at ``request_rate``. Pass ``lengths`` to reuse an already drawn sample."""
    if lengths is None:
        from minipaged.sim.workloads import sample_requests

        lengths = sample_requests(workload, num_requests, seed)
    if len(lengths) != num_requests:
        raise ValueError(f"lengths has {len(lengths)} entries, num_requests is {num_requests}")
    return make_requests(lengths, poisson_arrivals(num_requests, request_rate, seed + 1))


def _check_sorted(reqs: Sequence[TraceRequest]) -> None:
    ids = set()
    for a, b in zip(reqs, reqs[1:]):
        if b.arrival_time < a.arrival_time:
            raise ValueError(
                f"arrival_time must be non-decreasing: {b.request_id!r} arrives before {a.request_id!r}"
            )
    for r in reqs:
        if r.request_id in ids:
            raise ValueError(f"request_id {r.request_id!r} appears twice")
        ids.add(r.request_id)


# -- trace files ------------------------------------------------------------------
_FIELDS = ("arrival_time", "prompt_len", "output_len")


def _from_rows(rows: list[dict], source: str) -> list[TraceRequest]:
    reqs = []
    for i, row in enumerate(rows):
        missing = [f for f in _FIELDS if f not in row or row[f] in (None, "")]
        if missing:
            raise ValueError(f"{source}: row {i} has no {', '.join(missing)}")
        try:
            reqs.append(
                TraceRequest(
                    str(row.get("request_id") or f"r{i}"),
                    float(row["arrival_time"]),
                    int(row["prompt_len"]),
                    int(row["output_len"]),
                )
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: row {i}: {e}") from None
    reqs.sort(key=lambda r: r.arrival_time)  # a trace file need not be sorted
    _check_sorted(reqs)
    return reqs


def load_trace(path) -> list[TraceRequest]:
    """Read a trace from ``.json`` (a list of objects) or ``.csv`` (header row)."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of objects")
        return _from_rows(rows, str(path))
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            return _from_rows(list(csv.DictReader(f)), str(path))
    raise ValueError(f"path must end in .json or .csv, got {path.name!r}")


def save_trace(requests: Sequence[TraceRequest], path) -> None:
    """Write a trace that ``load_trace`` reads back unchanged."""
    path = Path(path)
    rows = [asdict(r) for r in requests]
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix.lower() == ".csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["request_id", *_FIELDS])
            w.writeheader()
            for r in rows:
                w.writerow({**r, "arrival_time": repr(r["arrival_time"])})
    else:
        raise ValueError(f"path must end in .json or .csv, got {path.name!r}")
