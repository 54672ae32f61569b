"""minipaged.sample: from the target's logits to tokens, beside the worker (vLLM v1's
``vllm/v1/sample/``). The runner calls them; nothing here knows a scheduler or an engine.

- ``Sampler`` (``sampler.py``): penalties, min-tokens, greedy / temperature / min-p / top-k
  / top-p, one seed per row (``derive_seed``, ``request_base_seed``, ``sample_seed``).
- ``Logprobs`` (``logprobs.py``): the top-k log-probabilities and the sampled token's.
- ``RejectionSampler`` (``rejection_sampler.py``): verifies a request's drafts in one step.
"""

from minipaged.sample.logprobs import Logprobs
from minipaged.sample.rejection_sampler import RejectionSampler, RowContext, compute_probs, row_contexts
from minipaged.sample.sampler import Sampler, derive_seed, request_base_seed, sample_seed

__all__ = [
    "Logprobs",
    "RejectionSampler",
    "RowContext",
    "Sampler",
    "compute_probs",
    "derive_seed",
    "request_base_seed",
    "row_contexts",
    "sample_seed",
]
