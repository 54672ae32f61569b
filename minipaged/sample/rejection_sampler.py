"""RejectionSampler: verify a request's draft tokens against the target model in one step.

Mirrors vLLM ``vllm/v1/sample/rejection_sampler.py`` (``RejectionSampler``), the rule of
Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023, written request by request.

Inputs
    ``target_logits [sum_r (m_r + 1), V]``: the target's logits at every position it ran for
    each request, in batch order. A request that was scheduled its last token ``x`` and
    ``m`` drafts ``d_1 .. d_m`` owns ``m + 1`` rows: row ``j`` is the target's distribution
    ``p_j`` of the token after ``x, d_1 .. d_j`` (so rows ``0 .. m-1`` judge ``d_1 .. d_m``
    and row ``m`` is the *bonus* row). ``draft_token_ids[r]`` (``m_r`` may be 0: an ordinary
    decode), ``reqs[r]`` (its ``SamplingParams`` and tokens, for penalties and
    ``min_tokens``), ``seeds[r]`` (one seed for this request's draws this step) and
    ``draft_probs [sum_r m_r, V]``, the distributions ``q_j`` the drafts were drawn from
    (``None`` for n-gram drafts: ``q_j`` is one-hot at ``d_j``, vLLM's convention).
Outputs
    per request the tokens to append, ``d_1 .. d_a`` and one more (``1 <= len <= m + 1``):
    ``a`` drafts accepted, then the token the target chose where it first disagreed
    (the *recovered* token), or the bonus token when all ``m`` were accepted.
The rule
    greedy (``temperature == 0``): accept ``d_j`` while it equals the target's argmax of
    ``p_{j-1}``; the next token is that argmax. The output is then exactly what
    non-speculative greedy decoding would produce, token for token.
    sampling: accept ``d_j`` with probability ``min(1, p(d_j) / q(d_j))``; at the first
    rejection draw from the residual ``max(0, p - q)`` (renormalised); if all are accepted
    draw the bonus token from ``p_m``. Each output token is then distributed exactly as
    the target's ``p`` (the theorem; ``tests/sample/test_rejection_sampler.py``
    checks it statistically).
    ``p`` is the target's distribution *after* the request's sampling rules (``min_tokens``,
    penalties with the drafts before it counted as output, temperature, min-p, top-k,
    top-p), in the order of ``sampler.py``.
Determinism
    a request's uniforms and its one exponential-race noise come from a generator seeded by
    ``seeds[r]`` alone: the result does not depend on the batch.
Failure mode
    ``ValueError`` when the row counts of ``target_logits`` / ``draft_probs`` do not match
    the drafts, or the lengths of ``reqs`` / ``seeds`` / ``draft_token_ids`` differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from minipaged.sample.sampler import apply_min_p, apply_min_tokens, apply_penalties, apply_top_k_top_p
from minipaged.sampling_params import SamplingParams


@dataclass
class RowContext:
    """What the sampling rules read of one target row: its request as if the drafts
    before the row were already output tokens."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None


def row_contexts(req, draft_token_ids: Sequence[int]) -> list[RowContext]:
    """The ``m + 1`` rows of a request with drafts ``d_1 .. d_m``: row j sees d_1 .. d_j."""
    out = list(req.output_token_ids)
    return [
        RowContext(
            req.prompt_token_ids, out + list(draft_token_ids[:j]), req.sampling_params, req.eos_token_id
        )
        for j in range(len(draft_token_ids) + 1)
    ]


def compute_probs(logits: torch.Tensor, rows: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling rules of each row applied to ``logits [R, V]``: ``(argmax [R], probs [R, V])``.

    ``argmax`` is the greedy choice (after ``min_tokens`` and penalties, as the Sampler's);
    ``probs`` the distribution a sampled row draws from (greedy rows: at temperature 1)."""
    logits = logits.float().clone()  # NOTE: never edit the caller's tensor
    params = [r.sampling_params for r in rows]
    apply_min_tokens(logits, [i for i, p in enumerate(params) if p.min_tokens > 0], rows)
    apply_penalties(logits, [i for i, p in enumerate(params) if p.uses_penalties], rows)
    argmax = logits.argmax(dim=-1)  # [R]
    dev = logits.device
    temps = torch.tensor([p.temperature if p.temperature != 0.0 else 1.0 for p in params], device=dev)
    x = logits / temps[:, None]  # [R, V]
    if any(p.min_p > 0.0 for p in params):
        x = apply_min_p(x, torch.tensor([float(p.min_p) for p in params], device=dev))
    top_k = top_p = None
    if any(p.top_k > 0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=dev)  # [R]
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([float(p.top_p) for p in params], device=dev)  # [R]
    x = apply_top_k_top_p(x, top_k, top_p)
    return argmax, x.softmax(dim=-1)


def exponential_race(weights: torch.Tensor, noise: torch.Tensor) -> int:
    """Index i with probability weights[i] / sum(weights) (weights need no normalising)."""
    return int((weights / noise.clamp(min=1e-20)).argmax())


class RejectionSampler:
    def __call__(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: Sequence[Sequence[int]],
        reqs: Sequence,
        seeds: Sequence[int],
        draft_probs: Optional[torch.Tensor] = None,
    ) -> list[list[int]]:
        B = len(draft_token_ids)
        if len(reqs) != B or len(seeds) != B:
            raise ValueError(f"{B} draft lists but {len(reqs)} requests and {len(seeds)} seeds")
        num_drafts = [len(d) for d in draft_token_ids]
        N = sum(num_drafts)
        if target_logits.shape[0] != N + B:
            raise ValueError(
                f"target_logits has {target_logits.shape[0]} rows, want {N + B} "
                f"({N} drafts + one bonus row per request)"
            )
        if draft_probs is not None and draft_probs.shape != (N, target_logits.shape[1]):
            raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, want ({N}, V)")
        rows = [row for req, d in zip(reqs, draft_token_ids) for row in row_contexts(req, d)]
        argmax, probs = compute_probs(target_logits, rows)  # [N + B], [N + B, V]
        argmax = argmax.tolist()
        gen = torch.Generator(device=target_logits.device)
        out: list[list[int]] = []
        row = q_row = 0
        for req, drafts, seed in zip(reqs, draft_token_ids, seeds):
            m = len(drafts)
            if req.sampling_params.temperature == 0.0:
                out.append(self._greedy(drafts, argmax[row : row + m + 1]))
            else:
                q = None if draft_probs is None else draft_probs[q_row : q_row + m]
                gen.manual_seed(int(seed))
                out.append(self._random(drafts, probs[row : row + m + 1], q, gen))
            row += m + 1
            q_row += m
        return out

    @staticmethod
    def _greedy(drafts: Sequence[int], target_argmax: list[int]) -> list[int]:
        """Accept while the draft is the target's argmax; then the argmax itself."""
        a = 0
        while a < len(drafts) and drafts[a] == target_argmax[a]:
            a += 1
        return target_argmax[: a + 1]

    @staticmethod
    def _random(
        drafts: Sequence[int],
        p: torch.Tensor,  # [m + 1, V] target
        q: Optional[torch.Tensor],  # [m, V] draft; None = one-hot at each draft
        gen: torch.Generator,
    ) -> list[int]:
        m = len(drafts)
        dev = p.device
        u = torch.rand(m, generator=gen, device=dev)  # [m] one uniform per draft
        noise = torch.empty(p.shape[1], device=dev).exponential_(generator=gen)  # [V]
        d = torch.tensor(list(drafts), dtype=torch.long, device=dev)  # [m]
        p_d = p[torch.arange(m, device=dev), d]  # [m] target prob of each draft
        q_d = torch.ones_like(p_d) if q is None else q[torch.arange(m, device=dev), d]  # [m]
        # NOTE: accept with probability min(1, p/q): u < p/q, written without dividing
        accepted = ((q_d > 0) & (u * q_d < p_d)).tolist()
        a = 0
        while a < m and accepted[a]:
            a += 1
        if a == m:  # every draft accepted: the bonus token, from the last row
            return list(drafts) + [exponential_race(p[m], noise)]
        if q is None:
            residual = p[a].clone()
            residual[drafts[a]] = 0.0  # max(0, p - onehot(d_a))
        else:
            residual = (p[a] - q[a]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # NOTE: p == q: rejection has probability 0
            residual = p[a]
        return list(drafts[:a]) + [exponential_race(residual, noise)]
