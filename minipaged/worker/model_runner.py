"""ModelRunner: the worker's side of a step. It keeps its own copy of every request it
runs (tokens, block table), updated only from ``SchedulerOutput``, and turns each step's
output into the tensors of one forward pass, then samples (``minipaged/sample/``).

Mirrors vLLM v1 ``vllm/v1/worker/gpu_model_runner.py`` (``_update_states``,
``_prepare_inputs``, ``execute_model``, ``propose_draft_token_ids``; its
``CachedRequestState`` and ``BlockTable``; ``vllm/v1/outputs.py``); the paper's block moves
(swap, copy-on-write) and forks are ``PaperModelRunner``'s (``paper_runner.py``). It never
sees the scheduler's objects: what it knows is what the output says
(``SchedulerOutput.for_worker()``, plain data), which is why the same output can be sent to
several workers (tensor parallelism, paper section 4.6).

Inputs
    ``execute_model(scheduler_output)``; in order: drop ``finished_req_ids`` and
    ``preempted_req_ids``; (re)build ``scheduled_new_reqs`` whole; append each
    ``scheduled_cached_reqs``' ``new_block_ids``; build the batch; forward; sample the rows
    whose tokens are all known (the ``Sampler``), or, for a request scheduled with ``m``
    drafts, verify them on its ``1 + m`` rows (the ``RejectionSampler``); with speculative
    decoding, propose the next step's drafts (``drafter``: n-gram or a draft model). For
    token ``i`` of a request with block table ``table``::

        position = i
        slot     = table[i // block_size] * block_size + i % block_size
        seq_len  = num_computed_tokens + num_scheduled_tokens   (context after this step)
Outputs
    ``ModelRunnerOutput``: per request of the batch (``req_ids``, in batch order) the list of
    tokens it sampled: ``[]`` for a prefill chunk, one token, or a verified request's
    accepted drafts + 1; the ``Logprobs`` of those that asked, and the drafts proposed for
    the next step. The runner appends the tokens to its own copy, as vLLM's does, so the
    next decode's input token is known without asking anyone; a verified request's copy
    advances by its accepted tokens only, exactly as the scheduler's does.
Proposals
    ``ngram``: from the request's tokens. ``draft_model``: a ``DraftModelProposer`` whose
    cache is addressed by the runner's block tables; *every* scheduled request runs its
    pass 0 (a prefill chunk too), so that its draft K/V stays valid for the positions the
    target computed (its ``prepare_inputs``). Requests with ``logprobs`` or stop strings get
    no drafts (``spec_decode.config.wants_drafts``).
Invariants (``check_invariants``)
    every state's table holds its computed tokens; ``len(input_ids) == len(positions) ==
    len(slot_mapping) == total scheduled tokens``; the caches have the pool's shape.
Failure mode
    an output naming a request the runner does not hold, or a table too short for the
    scheduled tokens, is a scheduler bug: ``RuntimeError`` naming the request; so are logits
    rows that do not match the drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from minipaged.model.input import ModelInput, build_model_input
from minipaged.sample.logprobs import Logprobs
from minipaged.sample.rejection_sampler import RejectionSampler
from minipaged.sample.sampler import Sampler, sample_seed
from minipaged.sampling_params import SamplingParams
from minipaged.spec_decode.config import wants_drafts
from minipaged.spec_decode.draft_model import DraftModelProposer
from minipaged.spec_decode.ngram_proposer import NgramProposer


@dataclass(slots=True)
class CachedRequestState:
    """The runner's copy of one request (vLLM's ``CachedRequestState`` + its block-table row)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: Optional[int] = None
    base_seed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Its tokens ``start .. end - 1`` (prompt, then output), without building the whole list.
        NOTE: max(.., 0): a negative slice end would count from the end."""
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[start:end] + self.output_token_ids[max(start - p, 0) : max(end - p, 0)]


@dataclass
class ModelRunnerOutput:
    """What a step gives back: plain data (vLLM's ``ModelRunnerOutput``, ``vllm/v1/outputs.py``)."""

    req_ids: list[str] = field(default_factory=list)  # the batch, in order
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    # one list per request, in req_ids order: [] (a prefill chunk), one token, or a
    # verified request's accepted drafts + 1
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)  # request id -> its token's
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # for the next step

    def __post_init__(self) -> None:
        if not self.req_id_to_index:
            self.req_id_to_index = {rid: i for i, rid in enumerate(self.req_ids)}
        if not self.sampled_token_ids:
            self.sampled_token_ids = [[] for _ in self.req_ids]


class ModelRunner:
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}  # the requests this worker runs
        # speculative decoding (``enable_speculation``): vLLM's drafter and rejection sampler
        self.drafter: Optional[NgramProposer | DraftModelProposer] = None
        self.rejection_sampler: Optional[RejectionSampler] = None
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> q of its pending drafts
        self.step_times: Optional[dict[str, float]] = None  # the engine's profile, if it wants it
        # Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
        # An int8 / fp8 cache (kv_cache_dtype) is allocated in 8 bits, its scales calibrated first.
        self.kv_caches = (
            model.allocate_kv_caches(num_blocks, block_size)
            if kv_cache_dtype == "auto"
            else model.allocate_kv_caches(num_blocks, block_size, kv_cache_dtype)
        )

    def enable_speculation(self, speculative_config, draft_model=None) -> None:
        """Propose drafts after each step and verify them in the next."""
        sc, k = speculative_config, speculative_config.num_speculative_tokens
        if sc.method == "ngram":
            self.drafter = NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max, k)
        else:
            self.drafter = DraftModelProposer(draft_model, self.num_blocks, self.block_size, k, self.device)
        self.rejection_sampler = RejectionSampler()

    # -- the step --------------------------------------------------------------------
    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        """One step: update, forward; sample, or rejection-sample the requests scheduled
        with drafts; propose the next drafts (see the module docstring)."""
        logits, req_ids = self.compute_logits(scheduler_output)
        out = ModelRunnerOutput(req_ids)
        if logits is None:
            return out
        t0 = time.perf_counter()
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        num_scheduled = scheduler_output.num_scheduled_tokens if self.drafter is not None else {}
        # the rows whose request has all its known tokens computed now get a new one; a
        # request scheduled with m drafts owns 1 + m rows (prepare_inputs)
        rows, reqs, verified, row = [], [], [], 0
        for rid in req_ids:
            r = self.requests[rid]
            if r.num_computed_tokens >= r.num_tokens and rid in drafts_of:
                verified.append((row, r))
            elif r.num_computed_tokens >= r.num_tokens:
                rows.append(row)
                reqs.append(r)
            row += 1 + len(drafts_of.get(rid, ()))
        if row != logits.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} logits rows for {row} sampled positions")
        # NOTE: before the verification rolls the rejected drafts back: the drafter's start
        starts = {rid: self.requests[rid].num_computed_tokens - n for rid, n in num_scheduled.items()}
        if rows:
            self._sample(logits, rows, reqs, out)
        if verified:
            self._verify(logits, verified, drafts_of, out)
        self._lap("sample", t0)
        if self.drafter is not None:
            out.draft_token_ids = self.propose_draft_token_ids(out, starts)
        return out

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list[CachedRequestState], out) -> None:
        # NOTE: a greedy row needs no seed; a random one is seeded by its request and its
        # output position alone (see sampler.py), never by its place in the batch.
        seeds = [
            0 if r.sampling_params.temperature == 0.0 else sample_seed(r.base_seed, len(r.output_token_ids))
            for r in reqs
        ]
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]  # [S, V]
        with torch.inference_mode():
            tokens, logprobs = self.sampler.sample(logits, reqs, seeds)
        for r, t, lp in zip(reqs, tokens, logprobs):
            r.output_token_ids.append(int(t))  # NOTE: the runner knows its next input token
            out.sampled_token_ids[out.req_id_to_index[r.req_id]] = [int(t)]
            if lp is not None:
                out.logprobs[r.req_id] = lp

    def _verify(self, logits: torch.Tensor, verified: list, drafts_of: dict, out) -> None:
        """The rejection sampler on the ``1 + m`` rows of each ``(first row, request)``
        scheduled with ``m`` drafts; its copy keeps the accepted drafts + 1."""
        reqs = [r for _, r in verified]
        drafts = [drafts_of[r.req_id] for r in reqs]
        rows = [i for (row, _), d in zip(verified, drafts) for i in range(row, row + 1 + len(d))]
        seeds = [sample_seed(r.base_seed, len(r.output_token_ids)) for r in reqs]
        qs = None
        if any(r.req_id in self.draft_probs for r in reqs):
            V = logits.shape[1]
            qs = torch.cat(
                [self.draft_probs.pop(r.req_id, torch.zeros(0, V))[: len(d)] for r, d in zip(reqs, drafts)]
            )  # [sum m, V]
        with torch.inference_mode():
            target = logits[torch.tensor(rows, device=logits.device)]  # [sum (m + 1), V]
            results = self.rejection_sampler(target, drafts, reqs, seeds, qs)
        for r, d, tokens in zip(reqs, drafts, results):
            r.num_computed_tokens -= len(d) + 1 - len(tokens)  # rejected: rewritten next step
            r.output_token_ids.extend(tokens)
            out.sampled_token_ids[out.req_id_to_index[r.req_id]] = tokens

    def propose_draft_token_ids(self, out: ModelRunnerOutput, starts: dict[str, int]) -> dict[str, list[int]]:
        """The drafts for the next step (vLLM's ``propose_draft_token_ids``); ``starts``: each
        scheduled request's computed tokens before this step."""
        sampled = {rid for rid, tokens in zip(out.req_ids, out.sampled_token_ids) if tokens}
        if isinstance(self.drafter, NgramProposer):
            return {
                rid: d
                for rid in out.req_ids
                if rid in sampled
                and wants_drafts((r := self.requests[rid]).sampling_params)
                and (d := self.drafter.propose(r.prompt_token_ids + r.output_token_ids))
            }
        pairs = self.drafter.prepare_inputs(self.requests, starts, sampled)  # (request id, DraftSeq)
        drafts, probs = self.drafter.propose([seq for _, seq in pairs])
        proposed, row = {}, 0
        for (rid, _), d in zip(pairs, drafts):
            if d:
                proposed[rid] = d
                if probs is not None:
                    self.draft_probs[rid] = probs[row : row + len(d)]
            row += len(d)
        return proposed

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        if self.step_times is not None:
            self.step_times[phase] += now - since
        return now

    def compute_logits(self, scheduler_output) -> tuple[Optional[torch.Tensor], list[str]]:
        """Update the states and run the forward: logits ``[B, V]`` (each scheduled
        request's last token) and the request id of each row."""
        t = time.perf_counter()
        self.update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return None, []
        inp = self.prepare_inputs(scheduler_output)
        t = self._lap("prepare", t)
        with torch.inference_mode():
            logits = self.model.forward(inp, self.kv_caches)  # [B, V]
        self._lap("forward", t)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        return logits, req_ids

    def update_states(self, scheduler_output) -> None:
        """vLLM's ``_update_states``: the runner's copies follow the output, nothing else."""
        for rid in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.requests.pop(rid, None)
            self.draft_probs.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
                new.eos_token_id,
                new.base_seed,
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            r = self.requests.get(cached.req_id)
            if r is None:
                raise RuntimeError(
                    f"the scheduler sent request {cached.req_id!r} as cached, but this worker never got it"
                )
            r.block_ids.extend(cached.new_block_ids)  # NOTE: a table only grows (vLLM's)
            r.num_computed_tokens = cached.num_computed_tokens

    def prepare_inputs(self, scheduler_output) -> ModelInput:
        """The flat batch of this step's tokens (vLLM's ``_prepare_inputs``): per scheduled
        request its new known tokens, then its drafts; the logits of its last row, or of all
        ``1 + m`` rows of a request that verifies ``m`` drafts."""
        items, num_logits = [], []
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            r = self.requests.get(rid)
            if r is None:
                raise RuntimeError(f"request {rid!r} is scheduled but this worker does not hold it")
            if len(r.block_ids) * self.block_size < r.num_computed_tokens + n:
                raise RuntimeError(f"request {rid!r}: {len(r.block_ids)} blocks cannot hold its tokens")
            drafts = drafts_of.get(rid, [])
            start = r.num_computed_tokens
            end = start + n - len(drafts)  # NOTE: the drafts come after the request's known tokens
            items.append((r.block_ids, start, r.token_slice(start, end) + drafts))
            num_logits.append(1 + len(drafts))
        inp = build_model_input(items, self.block_size, self.device, num_logits)
        # the step's attention plan, once for every layer
        return self.model.prepare_attention(inp, self.block_size)

    def check_invariants(self) -> None:
        """Every layer has a K and a V cache of the pool's shape; every request's table can
        hold its computed tokens."""
        assert len(self.kv_caches) == self.model.num_layers, (
            f"{len(self.kv_caches)} cache pairs for {self.model.num_layers} layers"
        )
        for i, (k, v) in enumerate(self.kv_caches):
            assert k.shape == v.shape and k.shape[:2] == (self.num_blocks, self.block_size), (
                f"layer {i}: caches {tuple(k.shape)} / {tuple(v.shape)}, want [{self.num_blocks}, {self.block_size}, KVH, D]"
            )
        for r in self.requests.values():
            assert len(r.block_ids) * self.block_size >= r.num_computed_tokens, f"{r.req_id}: table too short"
            assert all(0 <= b < self.num_blocks for b in r.block_ids), f"{r.req_id}: block outside the pool"
