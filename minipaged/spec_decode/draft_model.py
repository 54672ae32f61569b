"""DraftModelProposer: a small model proposes ``k`` tokens, its KV in its own paged cache.

Mirrors vLLM ``vllm/v1/spec_decode/draft_model.py`` (``DraftModelProposer``, on the base of
``eagle.py``). In vLLM v1 the drafter's attention layers get KV cache tensors of their own,
but they are addressed by the *target's* block table and slot mapping (the drafter reads
the target's ``CommonAttentionMetadata``): one set of block ids, two caches. The scheduler
allocates, frees, preempts and prefix-caches blocks once, for both models. The same here:
``kv_caches`` is the draft model's ``[num_blocks, block_size, KVH_draft, D_draft]`` per
draft layer, and every pass takes the target's block ids.

One step, per request (``DraftSeq``)::

    start   = the target's num_computed_tokens when the step began
    tokens  = what the target kept this step (a prefill chunk, or x and the accepted
              drafts), then, if the target sampled, its new token last
    pass 0  : the draft runs tokens at positions start .. start + L - 1 (writes their K/V
              at the target's slots), samples y_1 from its last row
    pass j  : y_j at position start + L - 1 + j, samples y_{j+1}     (j = 1 .. k - 1)

Invariant (what makes the shared table work)
    before a step the draft cache holds valid K/V for exactly the positions the target
    has computed (``< num_computed_tokens``); pass 0 starts there. Its proposal passes
    write ``k - 1`` positions past the target's new tokens, slots the target has not
    scheduled yet: those are the scheduler's *lookahead* slots (``num_lookahead_tokens =
    k`` in ``allocate_slots``). Whatever the target rejects keeps its slots (the blocks stay
    in the table, ``num_computed_tokens`` goes back): the next step rewrites both caches at
    those positions before any attention reads them. After a recompute
    preemption ``num_computed_tokens`` is 0 and both caches are refilled together; a
    prefix-cache hit skips both, because both were written at those block ids.
Inputs / outputs
    ``propose(seqs) -> (draft_token_ids per seq, draft_probs [sum, V] or None)``:
    greedy requests take the draft's argmax (no probabilities needed), sampled ones draw
    from the draft's distribution under the request's sampling rules, and ``draft_probs``
    holds ``q`` for the rejection sampler.
Failure mode
    a position outside a seq's block table or the draft model's context is a bug of the
    caller's: ``RuntimeError``. ``num_drafts`` is capped by the draft's ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from minipaged.model.input import build_model_input
from minipaged.sample.rejection_sampler import compute_probs, exponential_race, row_contexts
from minipaged.sample.sampler import derive_seed, sample_seed
from minipaged.spec_decode.config import wants_drafts


@dataclass
class DraftSeq:
    """One request's part of a draft step (plain data, from the step's output)."""

    block_ids: list[int]  # the target's block table (lookahead slots included)
    start: int  # position of tokens[0]: the target's num_computed_tokens at step start
    token_ids: list[int]  # to run: kept tokens, then the newly sampled one (if any)
    num_drafts: int = 0  # drafts to propose (0: only write this chunk's K/V)
    request: Optional[object] = None  # sampling params + tokens (needed when num_drafts > 0)
    seed: int = 0  # this step's draws of a sampled request


class DraftModelProposer:
    def __init__(self, model, num_blocks: int, block_size: int, num_speculative_tokens: int, device="cpu"):
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {num_speculative_tokens!r}")
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.device = torch.device(device)
        # NOTE: the draft's own cache, indexed by the target's block ids
        self.kv_caches = model.allocate_kv_caches(num_blocks, block_size)

    def check_invariants(self) -> None:
        assert len(self.kv_caches) == self.model.num_layers, "one draft cache pair per draft layer"
        for k, v in self.kv_caches:
            assert k.shape == v.shape and k.shape[:2] == (self.num_blocks, self.block_size), (
                f"draft cache {tuple(k.shape)} is not [{self.num_blocks}, {self.block_size}, KVH, D]"
            )

    def prepare_inputs(
        self, requests, starts: dict[str, int], sampled: set[str]
    ) -> list[tuple[str, DraftSeq]]:
        """The step of the module docstring, per scheduled request (vLLM: the proposer's
        ``prepare_inputs``): ``requests``, the runner's states by id, after the step;
        ``starts``, each one's computed tokens before it; ``sampled``, the ids that got a token.
        Drafts only for a request that wants them and whose new token has a slot, at most
        the slots its table holds past it (the scheduler's lookahead)."""
        out = []
        for rid, start in starts.items():
            r = requests[rid]
            end = r.num_computed_tokens  # K/V valid below this position after the step
            capacity = len(r.block_ids) * self.block_size
            feed_last = rid in sampled and end < capacity  # the new token, if it has a slot
            n = min(self.k, capacity - end) if feed_last and wants_drafts(r.sampling_params) else 0
            new = r.token_slice(start, end + int(feed_last))  # the tokens its draft K/V lacks
            if new:
                seed = sample_seed(r.base_seed, len(r.output_token_ids))
                out.append((rid, DraftSeq(list(r.block_ids), start, new, n, r, seed)))
        return out

    @torch.inference_mode()
    def propose(self, seqs: Sequence[DraftSeq]) -> tuple[list[list[int]], Optional[torch.Tensor]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        if not seqs:
            return drafts, None
        limit = int(self.model.max_model_len)
        # how many each seq may propose: pass j writes position start + L - 1 + j
        want = [min(s.num_drafts, limit - (s.start + len(s.token_ids)) + 1, self.k) for s in seqs]
        logits = self._forward([(s.block_ids, s.start, s.token_ids) for s in seqs])  # [B, V] last rows
        live = [i for i, n in enumerate(want) if n > 0]
        for j in range(max(want, default=0)):
            if j > 0:  # one more decode pass over the seqs that still propose
                live = [i for i in live if want[i] > j]
                items = [
                    (seqs[i].block_ids, seqs[i].start + len(seqs[i].token_ids) - 1 + j, [drafts[i][-1]])
                    for i in live
                ]
                logits = self._forward(items)
                rows = list(range(len(live)))
            else:
                rows = live
            if not live:
                break
            self._sample(seqs, live, logits[torch.tensor(rows, dtype=torch.long)], drafts, probs)
        any_random = any(s.num_drafts and s.request.sampling_params.temperature != 0.0 for s in seqs)
        if not any_random:
            return drafts, None
        flat = [p for per in probs for p in per]
        V = int(self.model.vocab_size)
        return drafts, (torch.stack(flat) if flat else torch.empty(0, V, device=self.device))

    def _forward(self, items) -> torch.Tensor:
        """One draft pass over ``(block_ids, start, token_ids)`` per seq, at the target's slots."""
        inp = build_model_input(items, self.block_size, self.device)
        return self.model.forward(self.model.prepare_attention(inp, self.block_size), self.kv_caches)

    def _sample(self, seqs, live, logits, drafts, probs) -> None:
        """Append one draft to each live seq: argmax if greedy, else a draw from q."""
        rows = [row_contexts(seqs[i].request, drafts[i])[-1] for i in live]
        argmax, q = compute_probs(logits, rows)  # [L], [L, V]
        gen = torch.Generator(device=logits.device)
        for r, i in enumerate(live):
            s = seqs[i]
            if s.request.sampling_params.temperature == 0.0:
                tok = int(argmax[r])
            else:
                gen.manual_seed(derive_seed("draft", s.seed, len(drafts[i])))
                noise = torch.empty(q.shape[1], device=q.device).exponential_(generator=gen)
                tok = exponential_race(q[r], noise)
            drafts[i].append(tok)
            probs[i].append(q[r])


def write_layer_skip_draft(model_dir, out_dir, num_layers: int) -> str:
    """Write a draft checkpoint made of the first ``num_layers`` decoder layers of the model in
    ``model_dir``, with its embeddings, final norm and LM head (an early-exit "self-draft", as
    in LayerSkip, Elhoushi et al. 2024): same vocabulary and tokenizer, a fraction of the cost,
    no training. Returns ``out_dir`` as a string."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir))
    total = hf.config.num_hidden_layers
    if not isinstance(num_layers, int) or not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be an int in [1, {total - 1}], got {num_layers!r}")
    hf.model.layers = hf.model.layers[:num_layers]
    hf.config.num_hidden_layers = num_layers
    if getattr(hf.config, "layer_types", None):
        hf.config.layer_types = hf.config.layer_types[:num_layers]
    out = Path(out_dir)
    hf.save_pretrained(out)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        src = Path(model_dir) / name
        if src.exists():
            shutil.copy(src, out / name)
    return str(out)
