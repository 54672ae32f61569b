"""Synthetic request workloads: how long prompts and outputs are.

The vLLM paper (Kwon et al., SOSP 2023, Fig. 11) drives its experiments with two
datasets, summarised here by their mean lengths in tokens:

=========  ===========  ============
workload   mean input   mean output
=========  ===========  ============
ShareGPT       161.3         338.0     long conversations, long answers
Alpaca          19.3          58.5     short instructions, short answers
=========  ===========  ============

We do not ship the datasets. Instead each workload is a pair of log-normal length
distributions with those means (lengths are positive and right-skewed, like the real
histograms), rounded to integers and clipped so that ``prompt_len + output_len`` never
exceeds the model's context (``max_model_len``, 2048 for OPT as in the paper).

Inputs / outputs
    ``sample_requests(workload, num_requests, seed, max_model_len=2048)`` ->
    ``[(prompt_len, output_len), ...]``. Same seed, same list, on every machine
    (``random.Random``, not numpy's global state).

Invariants
    ``1 <= prompt_len < max_model_len``; ``1 <= output_len``;
    ``prompt_len + output_len <= max_model_len``. The sample means are within a few
    per cent of the targets for a few hundred requests or more (clipping trims the tail
    a little).

Failure mode
    an unknown workload name, a non-positive ``num_requests`` or a ``max_model_len``
    below 2 raise ``ValueError``.

No vLLM counterpart: vLLM's ``benchmarks/`` sample the real datasets.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Log-normal prompt and output lengths with given means (in tokens)."""

    name: str
    mean_prompt_len: float
    mean_output_len: float
    # NOTE: sigma is the spread of log(length); about 1 means lengths vary by ~e-fold
    # around the median, as in the paper's histograms. The means are what the paper reports.
    prompt_sigma: float
    output_sigma: float


WORKLOADS: dict[str, LengthDistribution] = {
    "sharegpt": LengthDistribution("sharegpt", 161.31, 337.99, prompt_sigma=0.9, output_sigma=0.8),
    "alpaca": LengthDistribution("alpaca", 19.31, 58.45, prompt_sigma=0.6, output_sigma=0.8),
}


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2), so this mu gives the wanted mean.
    mu = math.log(mean) - sigma * sigma / 2
    return rng.lognormvariate(mu, sigma)


def sample_requests(
    workload: str, num_requests: int, seed: int, max_model_len: int = 2048
) -> list[tuple[int, int]]:
    """``num_requests`` seeded ``(prompt_len, output_len)`` pairs from ``workload``."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    if not isinstance(num_requests, int) or num_requests <= 0:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
    dist = WORKLOADS[workload]
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        p = _lognormal(rng, dist.mean_prompt_len, dist.prompt_sigma)
        o = _lognormal(rng, dist.mean_output_len, dist.output_sigma)
        prompt_len = min(max(1, round(p)), max_model_len - 1)
        output_len = min(max(1, round(o)), max_model_len - prompt_len)
        out.append((prompt_len, output_len))
    return out
