"""One rank's shard of a model and of its KV cache, running the ModelInputs it is given.

The model-level half of a tensor-parallel worker (vLLM ``vllm/v1/worker/gpu_worker.py``
without the model runner): ``WorkerGroup`` builds one per rank; tests, the benchmark and the
chapter drive it with hand-built ``ModelInput``s. The engine's worker adds the model runner
that turns a ``SchedulerOutput`` into those inputs (its own block tables).

Inputs
    ``ModelShardWorker(rank, tp, device, model, dtype, attention_backend, num_blocks,
    block_size)``; then ``execute_model(inp)`` with the same ``ModelInput`` on every rank.
    ``build_model_input(chunks, tables, block_size)`` builds such an input by hand.
Outputs
    ``execute_model``: fp32 logits ``[B, vocab]``, the same on every rank (the all-gathered
    LM head), returned by rank 0 only (``None`` from the others: nothing to send back); ``kv_blocks(layer, block_ids)``: this rank's K and V of those physical
    blocks, ``[n, block_size, KVH / N, D]`` each; ``info()``: plain numbers about the shard.

Invariants
    every rank has the same ``num_blocks`` and ``block_size``, and block id b means the same
    tokens on every rank: rank r's block b holds KV heads r*KVH/N .. (r+1)*KVH/N - 1 of them.

Failure mode
    bad shapes or sizes raise ``ValueError`` in the worker; ``WorkerGroup`` re-raises it in
    the driver as a ``WorkerError`` naming the rank.
"""

from __future__ import annotations

from typing import Optional

import torch

from minipaged.model import input as model_input
from minipaged.model.input import ModelInput


def build_model_input(chunks, tables, block_size: int) -> ModelInput:
    """A step's ``ModelInput`` by hand: ``chunks[b] = (new token ids, tokens of b already
    cached)``, ``tables[b]`` its block ids (``model.input.build_model_input``). For hand-checks
    and benchmarks; the engine's model runner builds the same from the scheduler's output."""
    return model_input.build_model_input(
        [(table, done, new) for (new, done), table in zip(chunks, tables)], block_size
    )


class ModelShardWorker:
    def __init__(
        self,
        rank: int,
        tp,
        device,
        model=None,
        dtype: str = "float32",
        attention_backend: str = "torch",
        num_blocks: int = 64,
        block_size: int = 16,
    ) -> None:
        from minipaged.model.loader import load_model

        self.rank = rank
        self.tp = tp
        self.model, _ = load_model(model, dtype, device, attention_backend, tp=tp)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_caches = self.model.allocate_kv_caches(num_blocks, block_size)  # [nb, bs, KVH/N, D]

    @torch.inference_mode()
    def execute_model(self, inp: ModelInput, every_rank: bool = False) -> Optional[torch.Tensor]:
        """The step's forward on this rank's shard; logits from rank 0, ``None`` from the others
        (``every_rank``: from every rank, to check that they are the same)."""
        inp = self.model.prepare_attention(inp.to(self.model.device), self.block_size)
        logits = self.model(inp, self.kv_caches)
        return logits.cpu() if self.rank == 0 or every_rank else None

    def kv_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V of physical blocks ``block_ids`` in ``layer``."""
        k, v = self.kv_caches[layer]
        idx = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        return k[idx].cpu(), v[idx].cpu()  # [n, bs, KVH / N, D] each

    def info(self) -> dict:
        """Plain numbers about this rank: its heads, cache shape, KV bytes, weight bytes."""
        m = self.model
        k, _ = self.kv_caches[0]
        return {
            "rank": self.rank,
            "tp_size": self.tp.size,
            "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads,
            "cache_shape": list(k.shape),
            "kv_cache_bytes": sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv),
            "weight_bytes": sum(p.numel() * p.element_size() for p in m.parameters()),
            "param_shapes": {n: list(p.shape) for n, p in m.named_parameters()},
        }

    def time_all_reduce(self, shape, iters: int = 50, via: str = "group") -> float:
        """Seconds per all-reduce of ``shape`` with every rank ready (call on all ranks);
        ``via="torch"``: through torch.distributed even where the group has shared memory."""
        from minipaged.distributed.process_group import time_all_reduce

        return time_all_reduce(self.tp, shape, iters, self.model.device, via)

    def comm_stats(self, reset: bool = False) -> dict:
        return self.tp.comm_stats(reset)
