"""Random paged caches for the kernel tests (shared by the reference and Triton tests).

``TOL`` is the tolerance per dtype that every kernel is held to against the reference.
"""

from __future__ import annotations

import math

import torch

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def make_paged(
    seq_lens,
    block_size,
    num_kv_heads,
    head_dim,
    *,
    dtype=torch.float32,
    seed=0,
    extra_cols=0,
    pad_value=0,
    spare_blocks=3,
    device="cpu",
):
    """Random caches and shuffled block tables holding ``seq_lens`` tokens per sequence.

    -> (k_cache, v_cache, block_tables [B, width] int32 padded with ``pad_value``, seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need + [1]) + extra_cols
    block_tables = torch.full((len(seq_lens), width), pad_value, dtype=torch.int32)
    for b, n in enumerate(need):
        block_tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (k_cache, v_cache, block_tables, sl)]


def cu_from(q_lens):
    """cu_seqlens_q [B + 1] int32 from per-sequence query lengths."""
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return cu
