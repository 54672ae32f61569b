"""ModelRunner: turn one SchedulerOutput into the tensors of one forward pass.

Mirrors vLLM ``vllm/v1/worker/gpu_model_runner.py`` (``_prepare_inputs``) and the cache
side of ``vllm/worker/cache_engine.py`` (device and CPU caches, swaps).

Inputs
    ``prepare(scheduler_output, kv_cache_manager)``: the scheduled ``(Request,
    num_new_tokens)`` pairs in batch order. A request's new tokens are its tokens
    ``start .. start + n - 1`` with ``start = request.num_computed_tokens`` (the scheduler
    advances ``num_computed_tokens`` in ``update_from_output``, after the forward).
Outputs
    a ``ModelInput`` (``minipaged/model/input.py``) and ``sample_rows``: the batch rows whose
    last token ends the request's known tokens (prefill done, or a decode), i.e. the rows
    whose logits become a new token. A row in the middle of a chunked prefill is computed
    but not sampled.

    For token ``i`` of a request with block table ``table``::

        position   = i
        slot       = table[i // block_size] * block_size + i % block_size   (BlockTable.slot)
        seq_len    = start + n            (context after this step: cached + new)

    Block tables are padded with 0 to the longest one: the attention never reads past
    ``seq_lens[b]``, so the padding is never followed.

``apply_cache_ops(scheduler_output)`` runs the block moves the scheduler decided, *before*
the forward: swap-out (device -> CPU pool), then swap-in (CPU -> device), then
copy-on-write copies. NOTE: swap-out goes first because the blocks it frees may be handed
to someone in this very step; their old contents must be saved before they are overwritten.

Invariants
    ``len(input_ids) == len(positions) == len(slot_mapping) == total scheduled tokens``;
    ``cu_seqlens_q[-1] == T``; every slot is inside the device pool.

Failure mode
    a scheduled request with no block table, or too few blocks for its new tokens, is an
    internal bug: ``RuntimeError``.
"""

from __future__ import annotations

import torch

from minipaged.model.input import ModelInput


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
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.device = torch.device(device)
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

    def check_invariants(self) -> None:
        """Every layer has a K and a V cache of the pool's shape; the CPU pool mirrors it."""
        assert len(self.kv_caches) == self.model.num_layers, (
            f"{len(self.kv_caches)} cache pairs for {self.model.num_layers} layers"
        )
        for i, (k, v) in enumerate(self.kv_caches):
            assert k.shape == v.shape and k.shape[:2] == (self.num_blocks, self.block_size), (
                f"layer {i}: caches {tuple(k.shape)} / {tuple(v.shape)}, want "
                f"[{self.num_blocks}, {self.block_size}, KVH, D]"
            )
        assert len(self.cpu_kv_caches) == (len(self.kv_caches) if self.num_cpu_blocks else 0), (
            "the CPU pool must have one cache pair per layer when num_cpu_blocks > 0"
        )
        for (k, _), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
            assert ck.shape == cv.shape == (self.num_cpu_blocks,) + tuple(k.shape[1:]), (
                f"CPU cache {tuple(ck.shape)} does not mirror device cache {tuple(k.shape)}"
            )

    # -- inputs --------------------------------------------------------------------
    def prepare(self, scheduler_output, kv_cache_manager) -> tuple[ModelInput, list[int]]:
        """The flat batch of this step's tokens, and the rows that get a new token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        cu_seqlens_q = [0]
        sample_rows: list[int] = []
        for row, (req, n) in enumerate(scheduler_output.scheduled):
            start = req.num_computed_tokens
            end = start + n
            num_prompt = req.num_prompt_tokens
            # the new tokens, without building prompt + output for a decode
            if start >= num_prompt:
                input_ids.extend(req.output_token_ids[start - num_prompt : end - num_prompt])
            elif end <= num_prompt:
                input_ids.extend(req.prompt_token_ids[start:end])
            else:
                input_ids.extend(req.prompt_token_ids[start:])
                input_ids.extend(req.output_token_ids[: end - num_prompt])
            table = kv_cache_manager.get_block_table(req)
            if len(table.blocks) * bs < end:
                raise RuntimeError(
                    f"request {req.request_id!r}: {len(table.blocks)} blocks cannot hold {end} tokens"
                )
            positions.extend(range(start, end))
            # NOTE: the slot formula of chapter 02, BlockTable.slot
            if n == 1:
                slot_mapping.append(table.slot(start))
            else:
                slot_mapping.extend(table.slot(i) for i in range(start, end))
            tables.append(table.block_ids())
            seq_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            if end == req.num_tokens:
                sample_rows.append(row)
        if len(input_ids) != cu_seqlens_q[-1]:
            raise RuntimeError(f"{len(input_ids)} input ids for {cu_seqlens_q[-1]} tokens")
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        cu = torch.tensor(cu_seqlens_q, dtype=torch.int32)  # [B + 1]
        inp = ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),  # [T]
            positions=torch.tensor(positions, dtype=torch.int64),  # [T]
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),  # [T]
            block_tables=torch.tensor(padded, dtype=torch.int32),  # [B, max_blocks]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [B]
            cu_seqlens_q=cu,  # [B + 1]
            logits_indices=(cu[1:] - 1).long(),  # [B] last row of each sequence
            max_query_len=max(b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])),
            max_seq_len=max(seq_lens),
        )
        if dev.type != "cpu":
            inp = inp.to(dev)
        return inp, sample_rows

    # -- cache moves ---------------------------------------------------------------
    def apply_cache_ops(self, scheduler_output) -> None:
        """Swap out, swap in, copy-on-write: the block moves decided this step."""
        from minipaged.kernels import copy_blocks, swap_blocks

        swap_out = scheduler_output.blocks_to_swap_out
        swap_in = scheduler_output.blocks_to_swap_in
        to_copy = scheduler_output.blocks_to_copy
        if (swap_out or swap_in) and not self.cpu_kv_caches:
            raise RuntimeError("the scheduler swapped blocks but there is no CPU pool")
        if swap_out:
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
                swap_blocks(k, ck, swap_out)  # device block -> CPU block
                swap_blocks(v, cv, swap_out)
        if swap_in:
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
                swap_blocks(ck, k, swap_in)  # CPU block -> device block
                swap_blocks(cv, v, swap_in)
        if to_copy:
            copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], to_copy)
