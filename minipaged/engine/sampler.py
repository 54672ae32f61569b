"""Sampler: next-token ids from the last-position logits of each sequence.

Mirrors vLLM ``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``.

Inputs
    ``logits`` ``[B, V]`` (one row per sequence that needs a token this step), and per row
    its ``SamplingParams`` and a 63-bit seed for *this* token (``sample_seed``).
Outputs
    ``[B]`` int64 token ids.

Rules, row by row
    temperature 0 -> argmax (greedy); otherwise logits / temperature, then top-k (keep the
    k largest; 0 = off), then top-p (keep the smallest prefix of the sorted distribution
    whose mass reaches p; at least one token), then one draw.

    The draw uses the exponential race (``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)``,
    which picks ``i`` with probability ``p_i``), with the noise ``E`` drawn from a
    ``torch.Generator`` seeded for that row alone. The seed of a row is a sha256 of
    (the request's seed, or the engine seed and the request id; the sample index; the
    output position) -- never Python's ``hash()`` -- so a request's text is the same
    whatever its batch-mates, its place in the batch, and however often it was preempted
    and recomputed.

Failure mode
    ``ValueError`` if the numbers of rows, params and seeds disagree.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from minipaged.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1


def derive_seed(*parts) -> int:
    """A 63-bit seed from any printable parts, stable across processes (sha256)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & _SEED_MASK


def request_base_seed(
    params: SamplingParams, engine_seed: int, request_id: str, sample_index: int = 0
) -> int:
    """The seed of one sample stream: from ``params.seed`` if set, else engine seed + id."""
    if params.seed is not None:
        return derive_seed("request", params.seed, sample_index)
    return derive_seed("engine", engine_seed, request_id, sample_index)


def sample_seed(base_seed: int, output_index: int) -> int:
    """The seed of the draw that makes output token number ``output_index``."""
    return derive_seed(base_seed, output_index)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k and top-p sets.

    ``top_k`` [B] int64 (0 = off), ``top_p`` [B] float (1 = off); either may be None.
    """
    if top_k is None and top_p is None:
        return logits
    B, V = logits.shape
    logits_sort, logits_idx = logits.sort(dim=-1, descending=True)  # [B, V]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)  # [B]
        ranks = torch.arange(V, device=logits.device)  # [V]
        logits_sort = logits_sort.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    if top_p is not None:
        probs_sort = logits_sort.softmax(dim=-1)  # [B, V]
        mass_before = probs_sort.cumsum(dim=-1) - probs_sort  # [B, V]
        # NOTE: a token is kept while the mass *before* it is below p, so the first
        # (largest) token is always kept.
        logits_sort = logits_sort.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    out = torch.empty_like(logits)
    out.scatter_(-1, logits_idx, logits_sort)  # back to vocabulary order
    return out


class Sampler:
    """Greedy / temperature / top-k / top-p sampling with a seed per row."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
    ) -> torch.Tensor:
        return self.forward(logits, params, seeds)

    def forward(
        self,
        logits: torch.Tensor,  # [B, V]
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
    ) -> torch.Tensor:
        B = logits.shape[0]
        if len(params) != B or len(seeds) != B:
            raise ValueError(
                f"logits has {B} rows but got {len(params)} params and {len(seeds)} seeds"
            )
        logits = logits.float()
        out = logits.argmax(dim=-1)  # [B] greedy for every row first
        random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if not random_rows:
            return out
        dev = logits.device
        rows = torch.tensor(random_rows, device=dev)  # [R]
        temps = torch.tensor(
            [float(params[i].temperature) for i in random_rows], device=dev
        )  # [R]
        x = logits.index_select(0, rows) / temps[:, None]  # [R, V]
        top_k = top_p = None
        if any(params[i].top_k > 0 for i in random_rows):
            top_k = torch.tensor([params[i].top_k for i in random_rows], device=dev)  # [R]
        if any(params[i].top_p < 1.0 for i in random_rows):
            top_p = torch.tensor([float(params[i].top_p) for i in random_rows], device=dev)
        x = apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)  # [R, V]
        noise = torch.empty_like(probs)  # [R, V] Exp(1), each row from its own generator
        gen = torch.Generator(device=dev)
        for r, i in enumerate(random_rows):
            gen.manual_seed(int(seeds[i]))
            noise[r].exponential_(generator=gen)
        sampled = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)  # [R]
        out[rows] = sampled
        return out
