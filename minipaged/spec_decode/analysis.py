"""When speculation pays: acceptance replayed offline, and the speedup in the cost model.

No vLLM file; the arithmetic of Leviathan et al. 2023 (section 3) on the simulator's
roofline (``minipaged/sim/cost_model.py``).

``replay_greedy(prompt, output, propose, k)``
    Greedy speculative decoding produces exactly the non-speculative greedy output, so its
    acceptance can be measured *offline*: run the target once without speculation, then
    replay the output step by step, proposing from the context each step would have seen
    and accepting the longest prefix of the proposal that matches the real continuation.
    Returns ``(num_drafts, num_accepted)`` per decode step (the prefill that made
    ``output[0]`` is not a decode step). Each step yields ``num_accepted + 1`` tokens; the
    last step may propose fewer than ``k`` (only ``max_tokens - 1`` more are useful).
``teacher_forced_proposer(draft_model, prompt, output)``
    the ``propose`` of a greedy draft model for ``replay_greedy``, from *one* forward of the
    draft over prompt + output: while the drafts match, the draft's context is the real
    one, so its argmax at each real position is the draft it would have proposed there;
    after the first mismatch the drafts differ but are rejected anyway, so the counts are
    exactly those of the online run.
``expected_tokens_per_step(acceptance_rate, k)``
    With each draft accepted independently with probability ``a``, a step yields
    ``(1 - a^(k+1)) / (1 - a)`` tokens (``k + 1`` when ``a == 1``).
``cost_model_speedup(cost, batch_size, context_len, k, acceptance_rate, draft_cost=None)``
    tokens/s with speculation over tokens/s without, for ``batch_size`` decodes at
    ``context_len``: a plain step computes 1 token per sequence, a verification step
    ``1 + k`` (one prefill-like chunk per sequence), plus ``k`` draft-model decode steps if
    ``draft_cost`` (a ``CostModel`` of the draft) is given (n-gram: free). Decode at small
    batch is memory-bound, so ``1 + k`` tokens cost about what 1 does and the speedup is
    near the tokens per step; at large batch the step is compute-bound, ``1 + k`` tokens
    cost ``1 + k`` times more, and speculation loses unless nearly every draft is accepted.
    NOTE: the cost model charges the LM head once per sequence; a verification runs it on
    ``1 + k`` rows, so the figure slightly flatters speculation.
Failure mode
    ``ValueError`` for ``k`` < 1, an acceptance rate outside [0, 1], a batch below 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional


def replay_greedy(
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    propose: Callable[[list[int], int], list[int]],
    k: int,
) -> list[tuple[int, int]]:
    """``(num_drafts, num_accepted)`` per decode step of greedy speculative decoding."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    prompt, out = list(prompt_token_ids), list(output_token_ids)
    steps = []
    i = 1  # output[0] came from the prefill
    while i < len(out):
        # NOTE: drafts past the last output token are never useful: at most len(out) - 1 - i
        drafts = propose(prompt + out[:i], min(k, len(out) - 1 - i))
        a = 0
        while a < len(drafts) and drafts[a] == out[i + a]:
            a += 1
        steps.append((len(drafts), a))
        i += a + 1
    return steps


def teacher_forced_proposer(draft_model, prompt_token_ids, output_token_ids, block_size: int = 16):
    """``propose(ctx, n)`` for ``replay_greedy``: the draft's argmax at every real position."""
    import torch

    from minipaged.model.input import build_model_input

    seq = list(prompt_token_ids) + list(output_token_ids)
    num_blocks = -(-len(seq) // block_size)
    kv = draft_model.allocate_kv_caches(num_blocks, block_size)
    inp = build_model_input([(list(range(num_blocks)), 0, seq)], block_size, draft_model.device)
    inp.logits_indices = torch.arange(len(seq), device=inp.input_ids.device)  # every row
    with torch.inference_mode():
        preds = draft_model.forward(inp, kv).argmax(dim=-1).tolist()  # [T]

    def propose(ctx: list[int], n: int) -> list[int]:
        return preds[len(ctx) - 1 : len(ctx) - 1 + n]

    return propose


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate!r}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    a = acceptance_rate
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def cost_model_speedup(
    cost,
    batch_size: int,
    context_len: int,
    k: int,
    acceptance_rate: float,
    draft_cost: Optional[object] = None,
) -> float:
    """tokens/s with speculation / tokens/s without, in the roofline ``cost`` model."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    tokens = expected_tokens_per_step(acceptance_rate, k)
    plain = cost.step_time([(1, context_len)] * batch_size)
    spec = cost.step_time([(1 + k, context_len)] * batch_size)
    if draft_cost is not None:  # k decode passes of the draft model
        spec += sum(draft_cost.step_time([(1, context_len + j)] * batch_size) for j in range(k))
    return tokens * plain / spec
