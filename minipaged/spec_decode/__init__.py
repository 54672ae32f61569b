"""minipaged.spec_decode: speculative decoding on the paged KV cache (vLLM v1's way).

- ``SpeculativeConfig`` (``config.py``): ``LLM(speculative_config={...})``, validated.
- ``NgramProposer`` (``ngram_proposer.py``): drafts by prompt lookup, no second model.
- ``DraftModelProposer`` (``draft_model.py``): a small model drafts; its KV lives in its own
  paged cache addressed by the target's block tables.
- ``SpecDecodeStats`` (``metrics.py``): drafts proposed and accepted.
- the verification is ``minipaged/sample/rejection_sampler.py`` (as vLLM's
  ``v1/sample/``): one target forward scores every draft; greedy acceptance keeps outputs
  identical to plain greedy decoding, the accept-with-min(1, p/q) rule keeps the target's
  distribution when sampling.
- the scheduler's side is inline in ``minipaged/core/sched/scheduler.py``, as vLLM's:
  ``Request.spec_token_ids`` scheduled like known tokens, ``num_lookahead_tokens`` passed to
  ``allocate_slots``, ``num_computed_tokens`` rolled back by the rejected drafts (their
  blocks kept); the worker's side is ``minipaged/worker/model_runner.py``, which holds the
  proposer and the rejection sampler (vLLM's ``gpu_model_runner``).
- ``analysis.py``: acceptance replayed offline; when speculation pays (the cost model).
- ``viz.py``: one request's block table across speculative steps.

Mirrors vLLM ``vllm/v1/spec_decode/``.

NOTE: the names below are imported on first use, so that ``minipaged.config`` can import
the torch-free ``config`` without importing torch.
"""

import importlib

_EXPORTS = {
    "SPEC_METHODS": "config",
    "SpeculativeConfig": "config",
    "NgramProposer": "ngram_proposer",
    "DraftModelProposer": "draft_model",
    "DraftSeq": "draft_model",
    "build_model_input": "draft_model",
    "write_layer_skip_draft": "draft_model",
    "SpecDecodeStats": "metrics",
    "cost_model_speedup": "analysis",
    "expected_tokens_per_step": "analysis",
    "replay_greedy": "analysis",
    "teacher_forced_proposer": "analysis",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minipaged.spec_decode' has no attribute {name!r}")
    return getattr(importlib.import_module(f"minipaged.spec_decode.{_EXPORTS[name]}"), name)
