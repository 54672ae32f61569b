"""ModelInput: the tensors one engine step hands to the model.

Built by ``minipaged.worker.model_runner.ModelRunner.prepare`` from a SchedulerOutput;
consumed by the model's forward and, through it, by the attention backend.
Mirrors the attention metadata of vLLM ``vllm/v1/attention/backends/*``.

All scheduled tokens of all sequences are concatenated into one flat batch of ``T``
tokens (no padding between sequences): sequence ``b`` owns rows
``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``. A decoding sequence contributes 1 row, a
prefilling one its chunk. Its query rows are the *last* ``q_len`` positions of its
context of ``seq_lens[b]`` tokens; the earlier ones are already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64: token ids of every scheduled token
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64: cache slot to write each token's K/V (-1 = skip)
    block_tables: torch.Tensor  # [B, max_blocks] int32: per sequence, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: prefix sums of the query lengths
    logits_indices: torch.Tensor  # [B] int64: row of each sequence's last token in T
    max_query_len: int  # max over b of the query length
    max_seq_len: int  # max over b of seq_lens
    # NOTE: filled by the first attention layer of the step and read by all the others (the
    # "torch" backend's per-step plan, ``kernels.torch_backend.build_attn_metadata``); never set it by hand.
    attn_metadata: Optional[Any] = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes exactly one token: the decode kernel applies."""
        return self.max_query_len == 1

    def to(self, device) -> ModelInput:
        return ModelInput(
            **{
                k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                for k, v in self.__dict__.items()
                if k != "attn_metadata"  # built on the device it is used on
            }
        )
