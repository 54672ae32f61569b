"""SpeculativeConfig: ``LLM(speculative_config={...})``, validated once.

Mirrors vLLM ``vllm/config/speculative.py`` (``SpeculativeConfig``), cut down to the two
methods the course teaches, with vLLM's field names.

Inputs
    a dict (or ``None``: no speculation)::

        {"method": "ngram", "num_speculative_tokens": k,
         "prompt_lookup_max": 4, "prompt_lookup_min": 2}       # prompt lookup, no model
        {"method": "draft_model", "num_speculative_tokens": k,
         "model": "path/or/hub-id"}                            # a small draft model

    ``prompt_lookup_min`` / ``prompt_lookup_max`` default as in vLLM: both missing -> 5 and 5,
    one missing -> the other's value.
Outputs
    a ``SpeculativeConfig``; ``num_lookahead_tokens`` is the number of KV slots the
    scheduler reserves beyond the scheduled tokens of a request (``allocate_slots``):
    ``k`` for a draft model, whose proposal passes write K/V for positions the target has
    not scheduled yet, 0 for n-gram, which writes no K/V.
Invariants
    ``1 <= prompt_lookup_min <= prompt_lookup_max`` (ngram); ``model`` set exactly when
    ``method == "draft_model"``; ``num_speculative_tokens >= 1``.
Failure mode
    ``ValueError`` naming the field: an unknown key or method, ``num_speculative_tokens`` < 1
    or, in ``verify_budget``, more than one step's token budget can verify
    (``1 + k > max_num_batched_tokens``), and in ``verify_draft_model`` a draft model whose
    vocabulary differs from the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

SPEC_METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds when neither is given


def wants_drafts(sampling_params) -> bool:
    """Whether a request is drafted for: not with ``logprobs`` or stop strings (one token a
    step: the output processor reads them one at a time); vLLM drafts for them too."""
    return sampling_params.logprobs is None and not sampling_params.stop


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Optional[str] = None  # the draft model (method "draft_model")
    prompt_lookup_max: Optional[int] = None  # the longest n-gram matched (method "ngram")
    prompt_lookup_min: Optional[int] = None  # the shortest

    @classmethod
    def from_dict(cls, spec) -> Optional[SpeculativeConfig]:
        """``None`` -> ``None``; a dict (or a ``SpeculativeConfig``) -> a validated config."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be None or a dict, got {type(spec).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise ValueError(f"speculative_config has unknown field {unknown[0]!r} (known: {known})")
        for name in ("method", "num_speculative_tokens"):
            if name not in spec:
                raise ValueError(f"speculative_config.{name} is required")
        return cls(**spec)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int >= 1, got {k!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model: method 'ngram' uses no draft model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not _is_int(v) or v < 1:
                    raise ValueError(f"speculative_config.{name} must be an int >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}"
                )
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    f"speculative_config.model must name the draft model (a path or hub id), got {self.model!r}"
                )
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram' only")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved per request beyond its scheduled tokens (vLLM's name)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def verify_budget(self, max_num_batched_tokens: int) -> None:
        """A decode with ``k`` drafts schedules ``1 + k`` tokens: one step must hold them."""
        k = self.num_speculative_tokens
        if 1 + k > max_num_batched_tokens:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={k}: a decode verifies 1 + {k} tokens "
                f"in one step, more than max_num_batched_tokens={max_num_batched_tokens}"
            )

    def verify_draft_model(self, target_vocab_size: int, draft_vocab_size: int) -> None:
        """The rejection sampler compares the two distributions token by token."""
        if int(draft_vocab_size) != int(target_vocab_size):
            raise ValueError(
                f"speculative_config.model={self.model!r}: the draft model's vocabulary has "
                f"{draft_vocab_size} tokens, the target's {target_vocab_size}; they must be the same"
            )
