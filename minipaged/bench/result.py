"""ServeResult: what one served system returns to the serving benchmark
(``minipaged/bench/serving.py``), minipaged or a transformers baseline alike. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServeResult:
    """One system's run: per request its tokens and the times (s from the start) of its first and last token."""

    token_ids: list[list[int]]
    wall_s: float
    cpu_s: float
    first_token_s: list[float]
    last_token_s: list[float]
    steps: int
    info: dict = field(default_factory=dict)
