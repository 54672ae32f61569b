"""PagedAttention as a model layer: write this step's K/V into the cache, then attend
through the block tables.

Mirrors vLLM ``vllm/attention/layer.py`` (``Attention``): the layer holds the head geometry and
its cache scales; the work is its backend's (``impl.forward`` there, read from the forward
context). Here the step's ``ModelInput`` is the forward context: ``inp.attn_backend`` is the
model's backend, chosen once for the engine (``minipaged.kernels.selector``: "torch", the
readable reference of ``kernels/torch_backend.py``; "triton"; "cpu", C), and
``inp.attn_metadata`` its plan of this step, built once before the first layer
(``PagedCausalLM.prepare_attention``).

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
    - Backends compute the same function (``tests/kernels``).

Failure mode
    An input never planned (``inp.attn_backend`` None) is a ``ValueError``. "triton" without
    Triton installed, or "cpu" without a C compiler, raises ``RuntimeError`` from
    ``minipaged.kernels`` when called. A slot mapping or block table that points at
    another sequence's blocks silently mixes sequences: the scheduler and ``KVCacheManager``
    own that invariant, not this layer.
"""

from __future__ import annotations

import torch
from torch import nn

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
        # A quantized cache stores key / k_scale and value / v_scale (vLLM: layer._k_scale,
        # _v_scale); ``model/kv_scales.py`` calibrates them, 1.0 reads a cache as is.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        inp: ModelInput,
    ) -> torch.Tensor:
        if inp.attn_backend is None:
            raise ValueError("inp has no attention plan: call model.prepare_attention(inp, block_size) first")
        # 1. write k, v at inp.slot_mapping; 2. read each query's context through its block table
        return inp.attn_backend.forward(self, q, k, v, kv_cache, inp)  # [T, H, D]

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}, "
            f"k_scale={self.k_scale:.4g}, v_scale={self.v_scale:.4g}"
        )
