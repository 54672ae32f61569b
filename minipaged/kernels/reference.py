"""Attention over a paged KV cache, in plain torch: the reference every kernel is graded by.

Mirrors vLLM ``tests/kernels/attention/test_attention.py::ref_single_query_cached_kv_attention``:
readable loops, one sequence at a time. Nothing here is tuned; the engine's fast torch
backend is ``torch_backend.py``, and it, the Triton kernels and the C kernel are all tested
against the functions of this file.

Concept (PagedAttention's attention half)
    A sequence's keys and values do not sit in one contiguous tensor. They sit in
    fixed-size *blocks* of a shared cache ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    and the sequence's *block table* says which physical block holds its logical block
    ``j``. Token ``i`` of sequence ``b`` lives at::

        k_cache[block_tables[b, i // block_size], i % block_size]

    Attention is ordinary softmax attention once K/V are gathered through that map.

Inputs / outputs (shapes as in ``minipaged.model.input.ModelInput``)
    q             [num_seqs, num_heads, head_dim]          decode: one query per sequence
                  [total_q, num_heads, head_dim]           prefill/varlen: all query rows packed
    k_cache       [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)
    block_tables  [num_seqs, max_blocks] int32             entries past a sequence's length unused
    seq_lens      [num_seqs] int32                         context length, cached + new
    cu_seqlens_q  [num_seqs + 1] int32                     sequence b's queries: rows cu[b]:cu[b+1]
    -> output shaped like ``q``.

Invariants
    - GQA: ``num_kv_heads`` divides ``num_heads``; query head ``h`` reads kv head
      ``h // (num_heads // num_kv_heads)``.
    - The queries of sequence ``b`` are the *last* ``q_len`` positions of its context of
      ``seq_lens[b]`` tokens (earlier positions are already cached); query ``j`` sees keys
      ``0 .. seq_lens[b] - q_len + j`` (causal, aligned bottom-right).
    - ``scale`` defaults to ``1 / sqrt(head_dim)``. Low-precision inputs are computed in
      fp32 and cast back to ``q.dtype``.
    - A quantized cache (int8 or float8_e4m3fn, ``quant.py``) is read as ``stored * k_scale``
      (keys) and ``stored * v_scale`` (values), in fp32: the *dequantized reference* every
      backend's quantized path is tested against.

Failure mode
    Inconsistent shapes, or a bad ``k_scale`` / ``v_scale``, raise ``ValueError`` naming the argument. Values are not checked
    (that would need a device sync): a block table entry outside the cache raises torch's
    ``IndexError``; a sequence with ``seq_lens[b] < q_len`` is the caller's bug.

Functions
    ``paged_attention_ref``          decode, a loop over sequences: read it first.
    ``paged_attention_prefill_ref``  causal varlen over a cached prefix, a loop too.
    ``contiguous_attention``         plain attention on contiguous tensors.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from minipaged.kernels.quant import check_kv_scales, dequantize, is_quantized


def _default_scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Shape checks shared by every entry point (cheap; no device sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}) for GQA")


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of one sequence as contiguous tensors, read token by token through its table
    (dequantized to fp32 when the cache is quantized)."""
    block_size = k_cache.shape[1]
    positions = torch.arange(seq_len, device=k_cache.device)  # [L]
    block_ids = block_table.long()[positions // block_size]  # [L] physical block of each token
    offsets = positions % block_size  # [L] slot inside that block
    k = k_cache[block_ids, offsets]  # [L, KVH, D]
    v = v_cache[block_ids, offsets]  # [L, KVH, D]
    if is_quantized(k_cache.dtype):
        return dequantize(k, k_scale), dequantize(v, v_scale)  # [L, KVH, D] fp32 each
    return k, v


def contiguous_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Softmax attention on contiguous tensors, computed in fp32.

    q [Tq, H, D], k/v [Tk, KVH, D] -> [Tq, H, D]; or batched q [B, Tq, H, D],
    k/v [B, Tk, KVH, D] -> [B, Tq, H, D]. With ``causal`` the queries are the last
    ``Tq`` of the ``Tk`` positions (query ``j`` sees keys ``0 .. Tk - Tq + j``).
    """
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.shape != k.shape:
        raise ValueError(
            "contiguous_attention wants q [Tq, H, D] with k, v [Tk, KVH, D] "
            "(or all with a leading batch dim); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"k head_dim {k.shape[-1]} / num_kv_heads {num_kv_heads} do not fit q "
            f"(head_dim {head_dim}, num_heads {num_heads})"
        )
    q_len, kv_len = q.shape[-3], k.shape[-3]
    if causal and q_len > kv_len:
        raise ValueError(f"causal attention needs q_len ({q_len}) <= kv_len ({kv_len})")
    scale = _default_scale(head_dim, scale)
    group = num_heads // num_kv_heads
    qf = q.float().transpose(-3, -2)  # [(B,) H, Tq, D]
    kf = k.float().repeat_interleave(group, dim=-2).transpose(-3, -2)  # [(B,) H, Tk, D]
    vf = v.float().repeat_interleave(group, dim=-2).transpose(-3, -2)  # [(B,) H, Tk, D]
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [(B,) H, Tq, Tk]
    if causal:
        q_pos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)  # [Tq, 1]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]  # [1, Tk]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [(B,) H, Tq, Tk]
    out = (probs @ vf).transpose(-3, -2)  # [(B,) Tq, H, D]
    return out.to(q.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: Optional[float] = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention through block tables, one sequence at a time (readable, slow).

    q [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]. The single query
    of sequence ``b`` is its newest token and attends to all ``seq_lens[b]`` cached tokens.
    ``k_scale`` / ``v_scale``: the scales of a quantized cache (``quant.py``).
    """
    _check_cache(q, k_cache, v_cache)
    check_kv_scales("paged_attention_ref", k_cache, k_scale, v_scale)
    num_seqs = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    out = torch.empty_like(q)  # [B, H, D]
    for b in range(num_seqs):
        seq_len = int(seq_lens[b])
        k, v = _gather_kv(k_cache, v_cache, block_tables[b], seq_len, k_scale, v_scale)  # [L, KVH, D]
        out[b] = contiguous_attention(q[b : b + 1], k, v, causal=False, scale=scale)[0]
    return out


def paged_attention_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: Optional[float] = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal varlen attention through block tables over a cached prefix (readable, slow).

    q [total_q, num_heads, head_dim] -> [total_q, num_heads, head_dim]. Sequence ``b``'s
    queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last ``q_len`` positions of
    its ``seq_lens[b]`` tokens. Decode rows (``q_len == 1``) are a special case.
    """
    _check_cache(q, k_cache, v_cache)
    check_kv_scales("paged_attention_prefill_ref", k_cache, k_scale, v_scale)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 0 or cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(
            f"cu_seqlens_q must be [num_seqs + 1] and seq_lens [num_seqs]; got "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(seq_lens.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    out = torch.empty_like(q)  # [T, H, D]
    for b in range(num_seqs):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        seq_len = int(seq_lens[b])
        k, v = _gather_kv(k_cache, v_cache, block_tables[b], seq_len, k_scale, v_scale)  # [L, KVH, D]
        out[start:end] = contiguous_attention(q[start:end], k, v, causal=True, scale=scale)
    return out
