"""ModelInput: the tensors one engine step hands to the model.

Built by ``minipaged.worker.model_runner.ModelRunner.prepare_inputs`` from a SchedulerOutput;
consumed by the model's forward and, through it, by the attention backend.
Mirrors the attention metadata of vLLM ``vllm/v1/attention/backends/*``.

All scheduled tokens of all sequences are concatenated into one flat batch of ``T``
tokens (no padding between sequences): sequence ``b`` owns rows
``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``. A decoding sequence contributes 1 row, a
prefilling one its chunk. Its query rows are the *last* ``q_len`` positions of its
context of ``seq_lens[b]`` tokens; the earlier ones are already in the cache.

``compute_slot_mapping(block_ids, start, end, block_size)`` is the worker side's one slot
formula (vLLM: ``BlockTable.compute_slot_mapping``); ``build_model_input`` builds a whole input
from ``(block_ids, start, token_ids)`` per sequence, the one builder of the runner, the draft
model and a tensor-parallel shard. After the flat batch is built,
``PagedCausalLM.prepare_attention`` plans the step's attention once: it sets ``attn_backend`` and ``attn_metadata``, which every
attention layer reads (vLLM v1: the runner builds the attention metadata and the forward
context carries it to every layer).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    logits_indices: torch.Tensor  # [B (+ drafts)] int64: rows to sample (a verification: 1 + m)
    max_query_len: int  # max over b of the query length
    max_seq_len: int  # max over b of seq_lens
    # NOTE: set once per step by ``PagedCausalLM.prepare_attention``, read by every attention
    # layer: the model's backend (``kernels.selector.attn_backend``) and its plan of this step
    attn_backend: Optional[Any] = None
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
                if k not in ("attn_backend", "attn_metadata")  # planned on the device it runs on
            }
        )


def compute_slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slot of each position ``start .. end - 1`` of a sequence with these blocks: the
    slot formula of chapter 02 (``core/kv/block_table.py``'s ``BlockTable.slot``)."""
    if end > len(block_ids) * block_size:
        raise RuntimeError(f"{len(block_ids)} blocks of {block_size} cannot hold position {end - 1}")
    return [block_ids[i // block_size] * block_size + i % block_size for i in range(start, end)]


def build_model_input(
    items, block_size: int, device="cpu", num_logits: Optional[Sequence[int]] = None
) -> ModelInput:
    """A ``ModelInput`` on ``device`` from ``(block_ids, start, token_ids)`` per sequence: its new
    tokens, at positions ``start ..`` (the ones before are cached). ``num_logits[b]``: how many
    of sequence ``b``'s last rows want logits (default 1; a request verifying m drafts, 1 + m)."""
    ids, positions, slots, tables, seq_lens, cu, logits_indices = [], [], [], [], [], [0], []
    for b, (block_ids, start, tokens) in enumerate(items):
        end = start + len(tokens)
        ids.extend(tokens)
        positions.extend(range(start, end))
        # the slot formula of chapter 02
        slots.extend(compute_slot_mapping(block_ids, start, end, block_size))
        tables.append(block_ids)
        seq_lens.append(end)
        cu.append(cu[-1] + len(tokens))
        logits_indices.extend(range(cu[-1] - (num_logits[b] if num_logits else 1), cu[-1]))
    width = max(len(t) for t in tables)
    inp = ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.int64),  # [T]
        positions=torch.tensor(positions, dtype=torch.int64),  # [T]
        slot_mapping=torch.tensor(slots, dtype=torch.int64),  # [T]
        # NOTE: padded with 0; the attention never reads past seq_lens[b]
        block_tables=torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [B]
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),  # [B + 1]
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),  # [B (+ drafts)] rows to sample
        max_query_len=max(b - a for a, b in zip(cu, cu[1:])),
        max_seq_len=max(seq_lens),
    )
    return inp if torch.device(device).type == "cpu" else inp.to(device)
