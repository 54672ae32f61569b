"""SpecDecodeRunner: the worker's half of speculative decoding, after the target's forward.

Mirrors the spec-decode part of vLLM v1 ``vllm/v1/worker/gpu_model_runner.py``
(``execute_model``: the rejection sampler on the draft rows, then ``propose_draft_token_ids``).

Inputs
    ``sample_and_propose(runner, scheduler_output, logits, req_ids, out)``: the runner's states
    (already advanced by every scheduled token), the step's output (plain half: its
    ``scheduled_spec_decode_tokens``) and the target's logits: one row per request, or
    ``1 + m`` rows for a request verified with ``m`` drafts (``prepare_inputs`` asks the
    model for all of them).
Outputs
    a ``ModelRunnerOutput``: per request that sampled, a token (no drafts, the engine's
    ``Sampler`` as without speculation) or a list (accepted drafts + 1, the
    ``RejectionSampler``), and ``draft_token_ids``, the drafts for the next step.
    The runner's copy of each request advances by the verified tokens only and appends
    the sampled ones, exactly as the scheduler's does.
Proposals
    ``ngram``: from the request's tokens. ``draft_model``: a ``DraftModelProposer`` whose
    cache is addressed by the runner's block tables; *every* scheduled request runs its
    pass 0 (a prefill chunk too), so that its draft K/V stays valid for the positions the
    target computed. Requests with ``logprobs`` or stop strings get no drafts (one token a
    step: the output processor reads them one at a time); vLLM drafts for them too.
Failure mode
    a proposal past a request's block table is capped to the slots it holds (the
    scheduler's lookahead reserves them); inconsistent rows are a bug: ``RuntimeError``.
"""

from __future__ import annotations

import torch

from minipaged.engine.sampler import sample_seed
from minipaged.spec_decode.draft_model import DraftModelProposer, DraftSeq
from minipaged.spec_decode.ngram_proposer import NgramProposer
from minipaged.spec_decode.rejection_sampler import RejectionSampler


class SpecDecodeRunner:
    def __init__(self, config, draft_model, num_blocks: int, block_size: int, device) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.block_size = block_size
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)
        else:
            self.proposer = DraftModelProposer(draft_model, num_blocks, block_size, self.k, device)
        self.rejection_sampler = RejectionSampler()
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> q of its pending drafts

    @staticmethod
    def wants_drafts(r) -> bool:
        p = r.sampling_params
        return p.logprobs is None and not p.stop

    def sample_and_propose(self, runner, so, logits: torch.Tensor, req_ids: list[str], out):
        """Fill ``out`` (an empty ``ModelRunnerOutput``): tokens, then the next drafts."""
        drafts_of = so.scheduled_spec_decode_tokens
        starts, first_row, row = {}, {}, 0
        for rid in req_ids:  # the runner advanced each by every scheduled token
            starts[rid] = runner.requests[rid].num_computed_tokens - so.num_scheduled_tokens[rid]
            first_row[rid] = row
            row += 1 + len(drafts_of.get(rid, ()))
        if row != logits.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} logits rows for {row} sampled positions")
        sampled = [
            rid
            for rid in req_ids
            if runner.requests[rid].num_computed_tokens >= runner.requests[rid].num_tokens
        ]
        plain = [rid for rid in sampled if rid not in drafts_of]
        verified = [rid for rid in sampled if rid in drafts_of]
        if plain:  # no drafts: the engine's Sampler, exactly as without speculation
            rows = [first_row[rid] for rid in plain]
            runner._sample(logits, rows, [runner.requests[rid] for rid in plain], out)
        if verified:
            self._verify(runner, logits, verified, drafts_of, first_row, out)
        out.draft_token_ids = self._propose(runner, so, req_ids, starts, set(sampled))
        return out

    def _verify(self, runner, logits, verified, drafts_of, first_row, out) -> None:
        reqs = [runner.requests[rid] for rid in verified]
        rows = [
            i for rid in verified for i in range(first_row[rid], first_row[rid] + 1 + len(drafts_of[rid]))
        ]
        seeds = [sample_seed(r.base_seed, len(r.output_token_ids)) for r in reqs]
        qs = None
        if any(rid in self.draft_probs for rid in verified):
            V = logits.shape[1]
            qs = torch.cat(
                [self.draft_probs.pop(rid, torch.zeros(0, V))[: len(drafts_of[rid])] for rid in verified]
            )  # [sum m, V]
        with torch.inference_mode():
            target = logits[torch.tensor(rows, device=logits.device)]  # [sum (m + 1), V]
            results = self.rejection_sampler(target, [drafts_of[rid] for rid in verified], reqs, seeds, qs)
        for rid, r, tokens in zip(verified, reqs, results):
            r.num_computed_tokens -= len(drafts_of[rid]) + 1 - len(tokens)  # rejected: rewritten next step
            r.output_token_ids.extend(tokens)
            out.sampled_token_ids[rid] = tokens

    def _propose(self, runner, so, req_ids, starts, sampled: set) -> dict[str, list[int]]:
        if isinstance(self.proposer, NgramProposer):
            return {
                rid: d
                for rid in req_ids
                if rid in sampled
                and self.wants_drafts(runner.requests[rid])
                and (
                    d := self.proposer.propose(
                        runner.requests[rid].prompt_token_ids + runner.requests[rid].output_token_ids
                    )
                )
            }
        seqs, ids = [], []
        for rid in req_ids:
            r = runner.requests[rid]
            tokens = r.prompt_token_ids + r.output_token_ids
            end = r.num_computed_tokens  # K/V valid below this position after the step
            capacity = len(r.block_ids) * self.block_size
            feed_last = rid in sampled and end < capacity  # the new token, if it has a slot
            n = min(self.k, capacity - end) if feed_last and self.wants_drafts(r) else 0
            seed = sample_seed(r.base_seed, len(r.output_token_ids))
            seqs.append(
                DraftSeq(
                    list(r.block_ids), starts[rid], tokens[starts[rid] : end + int(feed_last)], n, r, seed
                )
            )
            ids.append(rid)
        seqs_ids = [(s, rid) for s, rid in zip(seqs, ids) if s.token_ids]
        drafts, probs = self.proposer.propose([s for s, _ in seqs_ids])
        out, row = {}, 0
        for (_, rid), d in zip(seqs_ids, drafts):
            if d:
                out[rid] = d
                if probs is not None:
                    self.draft_probs[rid] = probs[row : row + len(d)]
            row += len(d)
        return out
