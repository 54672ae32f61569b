"""Logprobs: the log-probabilities a request asked for (``SamplingParams.logprobs = k``).

Mirrors the logprobs half of vLLM v1 ``vllm/v1/sample/sampler.py`` (``compute_logprobs``,
``gather_logprobs``) and ``vllm/v1/outputs.py`` (``LogprobsLists``), one ``Logprobs`` per
row where vLLM keeps one tensor for the batch.

Inputs
    ``compute_logprobs(logits, rows)``: the *raw* logits ``[B, V]`` (vLLM v1's default
    ``logprobs_mode="raw_logprobs"``: before penalties, temperature and truncation) and the
    rows that asked; ``gather_logprobs(raw, ks, rows, tokens_t)``: their log-softmax
    ``[W, V]``, each row's ``k`` and the sampled tokens ``[B]``.
Outputs
    per asking row a ``Logprobs``: the top ``k`` (best first), the sampled token's
    log-probability and its rank (1 = the most likely).
Failure mode
    none of its own: ``k`` larger than the vocabulary is clamped to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Logprobs:
    """One generated token's log-probabilities (raw logits): the top ``k`` and the sampled one."""

    token_ids: list[int]  # the top k, best first
    logprobs: list[float]
    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int  # 1 = the most likely token


def compute_logprobs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The log-softmax ``[W, V]`` of the given rows of the raw ``logits [B, V]``."""
    idx = torch.tensor(rows, device=logits.device)  # [W]
    return logits.index_select(0, idx).float().log_softmax(dim=-1)  # [W, V]


def gather_logprobs(
    raw_logprobs: torch.Tensor, ks: list[int], rows: list[int], tokens_t: torch.Tensor
) -> list[Logprobs]:
    """One ``Logprobs`` per row of ``raw_logprobs [W, V]`` (batch row ``rows[w]``, ``ks[w]``
    asked), for the sampled ``tokens_t [B]``.

    NOTE: one top-k (the largest k asked) and one rank count over all the rows, then one
    ``tolist()``: the cost per step is one batched op, whatever the number of rows and their k."""
    V = raw_logprobs.shape[1]
    max_k = min(V, max(ks))
    chosen_ids = tokens_t.index_select(0, torch.tensor(rows, device=tokens_t.device))  # [W]
    chosen = raw_logprobs.gather(1, chosen_ids[:, None])  # [W, 1]
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1  # [W] 1 = the most likely token
    top_vals = top_ids = [[] for _ in rows]
    if max_k > 0:
        top = raw_logprobs.topk(max_k, dim=-1)  # values, indices [W, max_k]
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for w, (k, tok, lp, rank) in enumerate(
        zip(ks, chosen_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist())
    ):
        k = min(k, V)
        out.append(Logprobs(top_ids[w][:k], top_vals[w][:k], tok, lp, int(rank)))
    return out
