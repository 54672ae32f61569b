"""SpecDecodeStats: drafts proposed and accepted, summed over steps.

Mirrors vLLM v1 ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats``): the engine core
observes each verified request after the step (``observe``); ``LLMEngine.spec_decode_stats``
gives the acceptance rate and the mean acceptance length.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Drafts proposed and accepted, summed over steps (vLLM's ``SpecDecodingStats``)."""

    num_drafts: int = 0  # requests that were verified with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k] draft j accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: 1 + accepted drafts (vLLM's metric)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
