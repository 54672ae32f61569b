"""Triton PagedAttention kernels (work in progress; see issue 3)."""

from __future__ import annotations


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    raise NotImplementedError("paged_attention_decode: Triton kernel not written yet")


def paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=None):
    raise NotImplementedError("paged_attention_prefill: Triton kernel not written yet")
