"""NgramProposer: draft tokens by prompt lookup, no second model.

Mirrors vLLM ``vllm/v1/spec_decode/ngram_proposer.py`` (``NgramProposer``, its
``_find_longest_matched_ngram_and_propose_tokens``), written as a plain search instead of
vLLM's KMP scan: the same answer, readable at a glance.

Rule
    Take the request's tokens so far (prompt + output). Find the longest ``n`` in
    ``[prompt_lookup_min, prompt_lookup_max]`` for which the last ``n`` tokens occur earlier
    in the context, followed by at least one token; of the occurrences of that ``n``-gram,
    take the *earliest*. Propose the (up to) ``k = num_speculative_tokens`` tokens that
    followed it, fewer when the context ends sooner. Example (vLLM's): tokens
    ``[1, 2, 3, 4, 2, 3]``, min 2, max 3, k 4: ``[4, 2, 3]`` has no earlier match, ``[2, 3]``
    matches at position 1, so the proposal is ``[4, 2, 3]`` (only three tokens follow).
Inputs / outputs
    ``propose(token_ids, max_num_drafts=None) -> list[int]`` (possibly empty); the caller may
    cap the count (``max_num_drafts``: the request's remaining ``max_tokens``, its room in
    the model's context). ``max_model_len`` caps it as vLLM does: no draft past the context.
Why it works
    Repetition: code, quoted text, lists, a story that repeats its names. A greedy model
    that has fallen into a loop is predicted exactly; on fresh text nothing matches and the
    proposer costs nothing (no draft, the step is an ordinary decode).
Failure mode
    ``ValueError`` for bad bounds (``prompt_lookup_min`` < 1 or above the max, ``k`` < 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(
        self,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        num_speculative_tokens: int,
        max_model_len: Optional[int] = None,
    ) -> None:
        for name, v in (
            ("prompt_lookup_min", prompt_lookup_min),
            ("prompt_lookup_max", prompt_lookup_max),
            ("num_speculative_tokens", num_speculative_tokens),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={prompt_lookup_min} is larger than prompt_lookup_max={prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[int], max_num_drafts: Optional[int] = None) -> list[int]:
        """The tokens that followed the earliest match of the longest matching suffix."""
        tokens = np.asarray(token_ids, dtype=np.int64)  # [N]
        N = tokens.shape[0]
        k = self.k if max_num_drafts is None else min(self.k, max_num_drafts)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - N)  # NOTE: vLLM's cap: no draft past the context
        if k <= 0:
            return []
        for n in range(min(self.max_n, N - 1), self.min_n - 1, -1):
            suffix = tokens[N - n :]  # [n]
            # every n-gram that ends before the last token: window s is tokens[s : s + n],
            # s = 0 .. N - 1 - n, so at least one token follows it
            windows = sliding_window_view(tokens[: N - 1], n)  # [N - n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n  # the earliest occurrence
                return tokens[start : start + k].tolist()
        return []
