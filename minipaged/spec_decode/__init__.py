"""minipaged.spec_decode: speculative decoding on the paged KV cache (vLLM v1's way).

- ``SpeculativeConfig`` (``config.py``): ``LLM(speculative_config={...})``, validated.
- ``NgramProposer`` (``ngram_proposer.py``): drafts by prompt lookup, no second model.
- ``DraftModelProposer`` (``draft_model.py``): a small model drafts; its KV lives in its own
  paged cache addressed by the target's block tables.
- ``RejectionSampler`` (``rejection_sampler.py``): one target forward scores every draft;
  greedy acceptance keeps outputs identical to plain greedy decoding, the
  accept-with-min(1, p/q) rule keeps the target's distribution when sampling.
- ``analysis.py``: acceptance replayed offline; when speculation pays (the cost model).

Mirrors vLLM ``vllm/v1/spec_decode/`` and ``vllm/v1/sample/rejection_sampler.py``.
"""

from minipaged.spec_decode.analysis import (
    cost_model_speedup,
    expected_tokens_per_step,
    replay_greedy,
    teacher_forced_proposer,
)
from minipaged.spec_decode.config import SPEC_METHODS, SpeculativeConfig
from minipaged.spec_decode.draft_model import (
    DraftModelProposer,
    DraftSeq,
    build_model_input,
    write_layer_skip_draft,
)
from minipaged.spec_decode.ngram_proposer import NgramProposer
from minipaged.spec_decode.rejection_sampler import (
    RejectionSampler,
    RowContext,
    SpecDecodeStats,
    compute_probs,
    row_contexts,
)

__all__ = [
    "SPEC_METHODS",
    "DraftModelProposer",
    "DraftSeq",
    "NgramProposer",
    "RejectionSampler",
    "RowContext",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "build_model_input",
    "cost_model_speedup",
    "expected_tokens_per_step",
    "replay_greedy",
    "compute_probs",
    "row_contexts",
    "teacher_forced_proposer",
    "write_layer_skip_draft",
]
