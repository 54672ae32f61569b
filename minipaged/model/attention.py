"""PagedAttention as a model layer: write this step's K/V into the cache, then attend
through the block tables.

Mirrors vLLM ``vllm/attention/layer.py`` (``Attention``) with the backend choice of
``vllm/v1/attention/backends/`` reduced to three: ``"torch"`` (the readable reference),
``"triton"`` (GPU kernels) and ``"cpu"`` (a C decode kernel, ``minipaged/kernels/cpu.py``).

Inputs
    q [T, H, D], k [T, KVH, D], v [T, KVH, D] for the T scheduled tokens of one step (RoPE
    already applied); this layer's ``(k_cache, v_cache)``, each
    ``[num_blocks, block_size, KVH, D]``; the step's ``ModelInput`` (slot_mapping,
    block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len).
Output
    [T, H, D]: for each token, softmax attention over its own sequence's context (every
    cached token plus the new ones up to and including itself).

Invariants
    - The cache is written *before* it is read: a prefill chunk attends to itself through
      the cache like any earlier chunk, so prefill, chunked prefill and decode are one path.
    - Token ``i`` of the step is written at ``slot_mapping[i]``; slot -1 (padding) is skipped.
    - An int8 / fp8 cache (``kv_cache_dtype``) stores ``k / k_scale`` and ``v / v_scale``, this
      layer's two scales, and every backend reads ``stored * scale`` back (``kernels/quant.py``).
    - Backends compute the same function; "triton" picks the decode kernel when every
      sequence has exactly one query (``inp.is_decode_only``), the varlen kernel otherwise;
      "cpu" sends decode rows to its C kernel, and prefill rows too while every chunk of the
      step is short (``ROWS_AS_DECODES_MAX_QUERY``), else those to the torch backend's buckets.
    - "torch" plans once per step (``build_attn_metadata``: block ids, masks, buckets) in the
      first layer and keeps the plan on ``inp.attn_metadata`` for the other layers, as vLLM
      builds its attention metadata once per step for all layers.

The backend is chosen once for the engine (``minipaged.kernels.selector.get_attn_backend``) and
set on every layer by ``PagedCausalLM.use_backend``; ``backend`` is one of its ``ATTENTION_BACKENDS``.

Failure mode
    "triton" without Triton installed, or "cpu"
    without a C compiler, raises ``RuntimeError`` from ``minipaged.kernels`` when called. A slot mapping or block table
    that points at another sequence's blocks silently mixes sequences: the scheduler and
    ``KVCacheManager`` own that invariant, not this layer.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minipaged import kernels
from minipaged.kernels import cpu as cpu_kernels
from minipaged.kernels.quant import is_quantized
from minipaged.kernels.torch_backend import build_attn_metadata, paged_attention_torch
from minipaged.model.input import ModelInput


class PagedAttention(nn.Module):
    """Attention over a paged KV cache. Holds no weights, only the head geometry."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = "torch"  # set for the whole model by PagedCausalLM.use_backend
        # A quantized cache stores key / k_scale and value / v_scale (vLLM: layer._k_scale,
        # _v_scale); PagedCausalLM.calibrate_kv_scales sets them, 1.0 reads a cache as is.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_amax: Optional[list[float]] = None  # [max|k|, max|v|] seen while calibrating

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        inp: ModelInput,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache  # each [num_blocks, block_size, KVH, D]
        on_cpu = self.backend == "cpu"  # the C kernel: the same two steps, reading K/V in place
        if self.kv_amax is not None:  # calibrating (PagedCausalLM.calibrate_kv_scales)
            self.kv_amax = [
                max(self.kv_amax[0], float(k.abs().max())),
                max(self.kv_amax[1], float(v.abs().max())),
            ]
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        # 1. Write: token i's key and value go to slot_mapping[i] (quantized for an int8 / fp8 cache;
        #    the C writer copies float32 only).
        if on_cpu and not is_quantized(k_cache.dtype):
            cpu_kernels.reshape_and_cache_cpu(k, v, k_cache, v_cache, inp.slot_mapping)
        else:
            kernels.reshape_and_cache(k, v, k_cache, v_cache, inp.slot_mapping, **scales)

        # 2. Read: each query attends to its sequence's tokens, found through its block table.
        if self.backend in ("torch", "cpu"):
            # NOTE: the step's first layer plans and the others reuse the plan; a decode-only
            # step on the "cpu" backend needs none
            if inp.attn_metadata is None and not (on_cpu and inp.is_decode_only):
                tables, cu, lens = inp.block_tables, inp.cu_seqlens_q, inp.seq_lens
                row_cost = self.num_heads * self.head_dim
                if on_cpu:  # short chunks row by row in C, else SDPA buckets for the prefill rows
                    inp.attn_metadata = cpu_kernels.plan_attention(
                        tables, cu, lens, inp.max_query_len, k_cache.shape[1], row_cost
                    )
                else:
                    inp.attn_metadata = build_attn_metadata(tables, cu, lens, k_cache.shape[1], row_cost)
            attend = cpu_kernels.paged_attention_cpu if on_cpu else paged_attention_torch
            return attend(
                q,
                k_cache,
                v_cache,
                inp.block_tables,
                inp.cu_seqlens_q,
                inp.seq_lens,
                inp.max_query_len,
                inp.max_seq_len,
                self.scale,
                metadata=inp.attn_metadata,
                **scales,
            )  # [T, H, D]
        if inp.is_decode_only:
            # NOTE: decode-only means T == num_seqs, so q is already [num_seqs, H, D].
            return kernels.paged_attention_decode(
                q,
                k_cache,
                v_cache,
                inp.block_tables,
                inp.seq_lens,
                self.scale,
                max_seq_len=inp.max_seq_len,
                **scales,
            )  # [B, H, D]
        return kernels.paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            inp.block_tables,
            inp.cu_seqlens_q,
            inp.seq_lens,
            self.scale,
            max_query_len=inp.max_query_len,
            **scales,
        )  # [T, H, D]

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}, backend={self.backend!r}, "
            f"k_scale={self.k_scale:.4g}, v_scale={self.v_scale:.4g}"
        )
