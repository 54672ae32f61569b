"""ModelRunner: the worker's side of a step. It keeps its own copy of every request it
runs (tokens, block table), updated only from ``SchedulerOutput``, and turns each step's
output into the tensors of one forward pass, then samples.

Mirrors vLLM v1 ``vllm/v1/worker/gpu_model_runner.py`` (``_update_states``,
``_prepare_inputs``; its ``CachedRequestState`` and ``BlockTable``) and the cache side of
v0's ``cache_engine.py`` (CPU caches, swaps). It never sees the scheduler's objects: what it
knows is what the output says (``SchedulerOutput.for_worker()``, plain data), which is
why the same output can be sent to several workers (tensor parallelism, paper section 4.6).

Inputs
    ``execute_model(scheduler_output)``; in order: drop ``finished_req_ids`` and
    ``preempted_req_ids``; (re)build ``scheduled_new_reqs`` whole; append each
    ``scheduled_cached_reqs``' ``new_block_ids``; do the block copies (swap out, swap in,
    copy-on-write); build the batch; forward; sample the rows whose tokens are all known.
    For token ``i`` of a request with block table ``table``::

        position = i
        slot     = table[i // block_size] * block_size + i % block_size
        seq_len  = num_computed_tokens + num_scheduled_tokens   (context after this step)
Outputs
    ``ModelRunnerOutput``: the sampled token of each request that got one (and its
    ``Logprobs`` if asked). The runner appends it to its own copy, as vLLM's does, so the
    next decode's input token is known without asking anyone.
Invariants (``check_invariants``)
    every state's table holds its computed tokens; ``len(input_ids) == len(positions) ==
    len(slot_mapping) == total scheduled tokens``; the caches have the pool's shape.
Failure mode
    an output naming a request the runner does not hold, or a table too short for the
    scheduled tokens, is a scheduler bug: ``RuntimeError`` naming the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from minipaged.model.input import ModelInput, compute_slot_mapping
from minipaged.sampling_params import SamplingParams


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


@dataclass
class ModelRunnerOutput:
    """What a step gives back: plain data (vLLM's ``ModelRunnerOutput``)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> token
    logprobs: dict[str, object] = field(default_factory=dict)  # request id -> Logprobs
    # speculative decoding: a verified request's sampled_token_ids entry is a list (its
    # accepted drafts + 1); draft_token_ids are the drafts proposed for the next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        device: str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        from minipaged.engine.sampler import Sampler

        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}  # the requests this worker runs
        self.spec = None  # speculative decoding (``enable_speculation``)
        self.step_times: Optional[dict[str, float]] = None  # the engine's profile, if it wants it
        # Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
        # An int8 / fp8 cache (kv_cache_dtype) is allocated in 8 bits, its scales calibrated first.
        self.kv_caches = (
            model.allocate_kv_caches(num_blocks, block_size)
            if kv_cache_dtype == "auto"
            else model.allocate_kv_caches(num_blocks, block_size, kv_cache_dtype)
        )
        self.cpu_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if num_cpu_blocks > 0:
            pin = self.device.type == "cuda"
            for k, _ in self.kv_caches:
                shape = (num_cpu_blocks,) + tuple(k.shape[1:])  # [num_cpu_blocks, bs, KVH, D]
                self.cpu_kv_caches.append(
                    (
                        torch.zeros(shape, dtype=k.dtype, pin_memory=pin),
                        torch.zeros(shape, dtype=k.dtype, pin_memory=pin),
                    )
                )

    def enable_speculation(self, speculative_config, draft_model=None) -> None:
        """Propose drafts after each step and verify them in the next (``SpecDecodeRunner``)."""
        from minipaged.worker.spec_decode import SpecDecodeRunner

        self.spec = SpecDecodeRunner(
            speculative_config, draft_model, self.num_blocks, self.block_size, self.device
        )

    # -- the step --------------------------------------------------------------------
    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        """One step: update, copy blocks, forward, sample (see the module docstring)."""
        logits, req_ids = self.compute_logits(scheduler_output)
        if self.spec is not None and logits is not None:
            return self.spec.sample_and_propose(self, scheduler_output, logits, req_ids, ModelRunnerOutput())
        t0 = time.perf_counter()
        out = ModelRunnerOutput()
        # the rows whose request has all its known tokens computed now get a new one
        rows = [
            b
            for b, rid in enumerate(req_ids)
            if self.requests[rid].num_computed_tokens == self.requests[rid].num_tokens
        ]
        reqs = [self.requests[req_ids[b]] for b in rows]
        for parent, child in scheduler_output.fork_sample_ids:  # paper: the child samples
            rows.append(req_ids.index(parent))  # from its parent's row (one prefill for all)
            reqs.append(self.requests[child])
        if rows:
            self._sample(logits, rows, reqs, out)
        self._lap("sample", t0)
        return out

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list[CachedRequestState], out) -> None:
        # NOTE: a greedy row needs no seed; a random one is seeded by its request and its
        # output position alone (see sampler.py), never by its place in the batch.
        from minipaged.engine.sampler import sample_seed

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
            out.sampled_token_ids[r.req_id] = int(t)
            if lp is not None:
                out.logprobs[r.req_id] = lp

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        if self.step_times is not None:
            self.step_times[phase] += now - since
        return now

    def compute_logits(self, scheduler_output) -> tuple[Optional[torch.Tensor], list[str]]:
        """Update the states, do the block copies and run the forward: logits ``[B, V]``
        (each scheduled request's last token) and the request id of each row."""
        t = time.perf_counter()
        self.update_states(scheduler_output)
        self.apply_cache_ops(scheduler_output)
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
            if self.spec is not None:
                self.spec.draft_probs.pop(rid, None)
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
        """The flat batch of this step's tokens (vLLM's ``_prepare_inputs``)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        cu_seqlens_q = [0]
        logits_indices: list[int] = []
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            r = self.requests.get(rid)
            if r is None:
                raise RuntimeError(f"request {rid!r} is scheduled but this worker does not hold it")
            drafts = drafts_of.get(rid, [])
            n -= len(drafts)  # NOTE: the drafts come after the request's known tokens
            start, end, num_prompt = r.num_computed_tokens, r.num_computed_tokens + n, len(r.prompt_token_ids)
            # the new tokens, without building prompt + output for a decode
            if start >= num_prompt:
                input_ids.extend(r.output_token_ids[start - num_prompt : end - num_prompt])
            elif end <= num_prompt:
                input_ids.extend(r.prompt_token_ids[start:end])
            else:
                input_ids.extend(r.prompt_token_ids[start:])
                input_ids.extend(r.output_token_ids[: end - num_prompt])
            input_ids.extend(drafts)
            n, end = n + len(drafts), end + len(drafts)
            table = r.block_ids
            if len(table) * bs < end:
                raise RuntimeError(f"request {rid!r}: {len(table)} blocks cannot hold {end} tokens")
            positions.extend(range(start, end))
            slot_mapping.extend(compute_slot_mapping(table, start, end, bs))  # the slot formula of chapter 02
            tables.append(table)
            seq_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            # a verified request needs the logits of every row (one per draft + the bonus)
            logits_indices.extend(range(cu_seqlens_q[-1] - 1 - len(drafts), cu_seqlens_q[-1]))
        if len(input_ids) != cu_seqlens_q[-1]:
            raise RuntimeError(f"{len(input_ids)} input ids for {cu_seqlens_q[-1]} tokens")
        max_blocks = max(len(t) for t in tables)
        cu = torch.tensor(cu_seqlens_q, dtype=torch.int32)  # [B + 1]
        inp = ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),  # [T]
            positions=torch.tensor(positions, dtype=torch.int64),  # [T]
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),  # [T]
            # NOTE: padded with 0; the attention never reads past seq_lens[b]
            block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [B]
            cu_seqlens_q=cu,  # [B + 1]
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),  # [B + drafts] rows to sample
            max_query_len=max(b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])),
            max_seq_len=max(seq_lens),
        )
        inp = inp if self.device.type == "cpu" else inp.to(self.device)
        return self.model.prepare_attention(inp, bs)  # the step's attention plan, once for every layer

    # -- cache moves ---------------------------------------------------------------
    def apply_cache_ops(self, scheduler_output) -> None:
        """Swap out, swap in, copy-on-write: the block moves decided this step, before the
        forward. NOTE: swap-out first: the blocks it frees may be handed to someone in this
        very step, and their old contents must be saved before they are overwritten."""
        from minipaged.kernels import copy_blocks, swap_blocks

        swap_out, swap_in = scheduler_output.blocks_to_swap_out, scheduler_output.blocks_to_swap_in
        if (swap_out or swap_in) and not self.cpu_kv_caches:
            raise RuntimeError("the scheduler swapped blocks but there is no CPU pool")
        for pairs, to_cpu in ((swap_out, True), (swap_in, False)):
            if pairs:
                for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
                    swap_blocks(k, ck, pairs) if to_cpu else swap_blocks(ck, k, pairs)
                    swap_blocks(v, cv, pairs) if to_cpu else swap_blocks(cv, v, pairs)
        if scheduler_output.blocks_to_copy:
            copy_blocks(
                [k for k, _ in self.kv_caches],
                [v for _, v in self.kv_caches],
                scheduler_output.blocks_to_copy,
            )

    def check_invariants(self) -> None:
        """Every layer has a K and a V cache of the pool's shape; the CPU pool mirrors it;
        every request's table can hold its computed tokens."""
        assert len(self.kv_caches) == self.model.num_layers, (
            f"{len(self.kv_caches)} cache pairs for {self.model.num_layers} layers"
        )
        for i, (k, v) in enumerate(self.kv_caches):
            assert k.shape == v.shape and k.shape[:2] == (self.num_blocks, self.block_size), (
                f"layer {i}: caches {tuple(k.shape)} / {tuple(v.shape)}, want [{self.num_blocks}, {self.block_size}, KVH, D]"
            )
        assert len(self.cpu_kv_caches) == (len(self.kv_caches) if self.num_cpu_blocks else 0), (
            "the CPU pool must have one cache pair per layer when num_cpu_blocks > 0"
        )
        for (k, _), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
            assert ck.shape == cv.shape == (self.num_cpu_blocks,) + tuple(k.shape[1:]), (
                f"CPU cache {tuple(ck.shape)} does not mirror device cache {tuple(k.shape)}"
            )
        for r in self.requests.values():
            assert len(r.block_ids) * self.block_size >= r.num_computed_tokens, f"{r.req_id}: table too short"
            assert all(0 <= b < self.num_blocks for b in r.block_ids), f"{r.req_id}: block outside the pool"
