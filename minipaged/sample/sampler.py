"""Sampler: next-token ids from the last-position logits of each sequence.

Mirrors vLLM v1 ``vllm/v1/sample/sampler.py``, ``ops/penalties.py``,
``ops/topk_topp_sampler.py`` and the min-tokens / min-p logits processors.

Inputs
    ``logits`` ``[B, V]`` (one row per sequence that needs a token this step), and per row
    its ``SamplingParams``, a 63-bit seed for *this* token (``sample_seed``) and, when a
    row uses penalties or ``min_tokens``, its request (``prompt_token_ids``,
    ``output_token_ids``, ``eos_token_id``).
Outputs
    ``[B]`` int64 token ids; ``sample()`` also returns, per row that asked for
    ``logprobs=k``, the top-k log-probabilities and the sampled token's (``Logprobs``,
    ``logprobs.py``).

Rules, row by row, in vLLM v1's order
    1. log-probabilities for ``logprobs`` come from the *raw* logits (vLLM v1's default
       ``logprobs_mode="raw_logprobs"``): before penalties, temperature and truncation.
    2. ``min_tokens``: while the request has fewer output tokens, EOS (unless
       ``ignore_eos``) and ``stop_token_ids`` get logit -inf (transformers'
       ``MinNewTokensLengthLogitsProcessor``).
    3. penalties: ``repetition_penalty`` r on every token of prompt + output (logit / r if
       positive, * r otherwise; transformers' ``RepetitionPenaltyLogitsProcessor``); then
       ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the
       output tokens only (OpenAI's formula, as vLLM).
    4. temperature 0 -> argmax (greedy); otherwise logits / temperature, then ``min_p``
       (drop tokens with probability < min_p * the top probability; transformers'
       ``MinPLogitsWarper``), then top-k (keep the k largest; 0 = off), then top-p (keep
       the smallest prefix of the sorted distribution whose mass reaches p; at least one
       token), then one draw.

    The draw uses the exponential race (``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)``,
    which picks ``i`` with probability ``p_i``), with the noise ``E`` drawn from a
    ``torch.Generator`` seeded for that row alone. The seed of a row is a sha256 of
    (the request's seed, or the engine seed and the request id; the sample index; the
    output position) -- never Python's ``hash()`` -- so a request's text is the same
    whatever its batch-mates, its place in the batch, and however often it was preempted
    and recomputed (penalties depend on the request's own tokens only).

Failure mode
    ``ValueError`` if the numbers of rows, params, seeds and requests disagree, or a row
    needs its request (penalties, ``min_tokens``) and none was given. Numbers that overflow
    float32 never become NaN probabilities: NaN logits are -inf, +inf the largest float32
    (``finite_logits``), top-p keeps the top token whatever p, ``top_k`` is clamped to the
    vocabulary before it becomes a tensor, and a row with no finite logit left keeps its
    greedy token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Optional

import torch

from minipaged.sample.logprobs import Logprobs, compute_logprobs, gather_logprobs
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
        drop = mass_before >= top_p[:, None]  # [B, V]
        drop[:, 0] = False  # NOTE: a top_p that is 0 in float32 (1e-320) still keeps the top token
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    out = torch.empty_like(logits)
    out.scatter_(-1, logits_idx, logits_sort)  # back to vocabulary order
    return out


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with NaN -> -inf and +inf -> the dtype's largest value, so that a softmax
    over them is never NaN while one finite (or formerly +inf) logit remains."""
    # NOTE: always applied (no data-dependent branch: no device sync on a GPU)
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def apply_min_tokens(logits: torch.Tensor, rows: list[int], reqs: Sequence) -> torch.Tensor:
    """EOS (unless ``ignore_eos``) and ``stop_token_ids`` -> -inf in each row whose request
    has fewer than ``min_tokens`` output tokens (in place)."""
    V = logits.shape[1]
    for i in rows:
        r = reqs[i]
        p = r.sampling_params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        ids = list(p.stop_token_ids)
        if not p.ignore_eos and r.eos_token_id is not None:
            ids.append(r.eos_token_id)
        ids = [t for t in ids if 0 <= t < V]
        if ids:
            logits[i, torch.tensor(ids, device=logits.device)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[int], reqs: Sequence) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties, in
    place, on the given rows (vLLM v1 ``apply_penalties``)."""
    V = logits.shape[1]
    dev = logits.device
    for i in rows:
        r = reqs[i]
        p = r.sampling_params
        out_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)  # [O]
        counts = torch.bincount(out_ids, minlength=V)[:V].to(logits.dtype)  # [V]
        row = logits[i]  # [V] a view: edits land in logits
        if p.repetition_penalty != 1.0:
            seen = counts > 0  # [V]
            seen[torch.tensor(r.prompt_token_ids, dtype=torch.long, device=dev)] = True
            rp = p.repetition_penalty
            penalized = torch.where(row > 0, row / rp, row * rp)
            row.copy_(torch.where(seen, penalized, row))
        if p.frequency_penalty != 0.0:
            row.sub_(p.frequency_penalty * counts)
        if p.presence_penalty != 0.0:
            row.sub_(p.presence_penalty * (counts > 0).to(logits.dtype))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens whose probability is below ``min_p`` times the row's top
    probability. ``logits`` [R, V] already divided by the temperature; ``min_p`` [R]."""
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Penalties, min-tokens, greedy / temperature / min-p / top-k / top-p, a seed per row."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        reqs: Optional[Sequence] = None,
    ) -> torch.Tensor:
        return self.forward(logits, params, seeds, reqs)

    def sample(
        self, logits: torch.Tensor, reqs: Sequence, seeds: Sequence[int]
    ) -> tuple[list[int], list[Optional[Logprobs]]]:
        """Tokens for the requests ``reqs`` (one per row) and, for each row whose params ask
        for ``logprobs``, its ``Logprobs`` (None for the others; ``logprobs.py``)."""
        params = [r.sampling_params for r in reqs]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        # NOTE: from the raw logits, before anything below changes them
        raw_logprobs = compute_logprobs(logits, want) if want else None  # [W, V]
        tokens_t = self.forward(logits, params, seeds, reqs)  # [B]
        out: list[Optional[Logprobs]] = [None] * len(reqs)
        if want:
            ks = [params[i].logprobs for i in want]
            for i, lp in zip(want, gather_logprobs(raw_logprobs, ks, want, tokens_t)):
                out[i] = lp
        return tokens_t.tolist(), out

    def forward(
        self,
        logits: torch.Tensor,  # [B, V]
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        reqs: Optional[Sequence] = None,
    ) -> torch.Tensor:
        B = logits.shape[0]
        if len(params) != B or len(seeds) != B or (reqs is not None and len(reqs) != B):
            raise ValueError(
                f"logits has {B} rows but got {len(params)} params, {len(seeds)} seeds"
                + ("" if reqs is None else f" and {len(reqs)} requests")
            )
        logits = logits.float()
        min_tok_rows = [i for i, p in enumerate(params) if p.min_tokens > 0]
        penalty_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if (min_tok_rows or penalty_rows) and reqs is None:
            raise ValueError("reqs is required: some rows use penalties or min_tokens")
        if min_tok_rows or penalty_rows:
            logits = logits.clone()  # NOTE: never edit the caller's tensor
            apply_min_tokens(logits, min_tok_rows, reqs)
            apply_penalties(logits, penalty_rows, reqs)
            logits = finite_logits(logits)
        out = logits.argmax(dim=-1)  # [B] greedy for every row first
        random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if not random_rows:
            return out
        dev = logits.device
        rows = torch.tensor(random_rows, device=dev)  # [R]
        temps = torch.tensor([float(params[i].temperature) for i in random_rows], device=dev)  # [R]
        x = logits.index_select(0, rows) / temps[:, None]  # [R, V]
        if any(params[i].min_p > 0.0 for i in random_rows):
            min_p = torch.tensor([float(params[i].min_p) for i in random_rows], device=dev)  # [R]
            x = apply_min_p(x, min_p)
        x = finite_logits(x)  # NOTE: a huge logit / a small temperature may overflow to inf
        top_k = top_p = None
        V = logits.shape[1]
        if any(params[i].top_k > 0 for i in random_rows):
            # NOTE: clamped here, in Python: a top_k beyond int64 must not reach torch
            top_k = torch.tensor([min(params[i].top_k, V) for i in random_rows], device=dev)  # [R]
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
        # NOTE: a row left with no finite logit (cannot happen with validated params) keeps
        # its greedy token rather than an argmax over NaN probabilities.
        ok = torch.isfinite(x).any(dim=-1)  # [R]
        out[rows] = torch.where(ok, sampled, out[rows])
        return out
