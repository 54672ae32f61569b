"""The engine's "torch" attention backend: paged attention for a whole batch in a few
vectorized torch calls.

Mirrors vLLM's torch SDPA backend (``vllm/v1/attention/backends/cpu_attn.py`` before its C
kernels, ``vllm/attention/ops/paged_attn.py``) and, for decode, the split-KV idea of the Triton
V2 kernel (``paged_attention.py``) and FlashDecoding. The readable version of the same function
is ``reference.py``; ``tests/kernels/test_fast_path.py`` and ``tests/kernels/test_kernels_reference.py`` hold
this one to it.

Inputs / outputs
    ``paged_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
    max_query_len, max_seq_len, scale=None, metadata=None)``: the varlen contract of
    ``reference.paged_attention_prefill_ref`` (q [total_q, H, D] -> [total_q, H, D]).
    ``build_attn_metadata(...)``: the per-step plan (which blocks each decode reads, the prefill
    buckets), built once per step and shared by every layer (vLLM's ``AttentionMetadataBuilder``).
    ``attend_prefills(...)``: the prefill half alone (the "cpu" backend uses it for its prefill rows).
    ``TorchAttentionBackend``: what an attention layer calls (``kernels.selector.attn_backend``):
    ``build_metadata`` (the plan, once per step, by the runner) and ``forward`` (write, then read).

Invariants
    Decode rows go through ``_decode_split_kv`` (every sequence's blocks packed, per-block softmax,
    merged per sequence), prefill rows through padded SDPA calls over length buckets; decode and
    prefill rows never share a call. Computed in fp32, returned in ``q.dtype``; equal to the
    reference to float rounding.

Failure mode
    Shapes are checked as in the reference (``ValueError`` naming the argument); a plan built with
    ``decodes=False`` handed to ``paged_attention_torch`` is a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Optional

import torch
import torch.nn.functional as F

from minipaged.kernels.cache_ops import reshape_and_cache
from minipaged.kernels.quant import check_kv_scales, is_quantized
from minipaged.kernels.reference import _check_cache, _default_scale


class TorchAttentionBackend:
    """The "torch" backend, the course's reference path (vLLM: an ``AttentionBackend`` with its
    metadata builder and impl in one object). Every backend has this face:

    ``name``; ``layer_impl``: what the small layers run ("torch"; the "cpu" backend's are in C);
    ``build_metadata(inp, block_size, row_cost)``: the step's plan, once for every layer;
    ``forward(layer, q, k, v, kv_cache, inp)``: write this step's K/V at ``inp.slot_mapping``,
    then attend through the block tables with ``layer.scale``, ``layer.k_scale``, ``layer.v_scale``.
    """

    name = "torch"
    layer_impl = "torch"

    def build_metadata(self, inp, block_size: int, row_cost: int):
        return build_attn_metadata(inp.block_tables, inp.cu_seqlens_q, inp.seq_lens, block_size, row_cost)

    def forward(self, layer, q, k, v, kv_cache, inp):
        k_cache, v_cache = kv_cache  # each [num_blocks, block_size, KVH, D]
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
        reshape_and_cache(k, v, k_cache, v_cache, inp.slot_mapping, **scales)  # 1. write
        return paged_attention_torch(  # 2. read, through the block tables
            q, k_cache, v_cache, inp.block_tables, inp.cu_seqlens_q, inp.seq_lens,
            inp.max_query_len, inp.max_seq_len, layer.scale, inp.attn_metadata, **scales,
        )  # fmt: skip


def _as_float(kv: torch.Tensor, scale: float) -> torch.Tensor:
    """Gathered cache rows in fp32: dequantized (``stored * scale``) when the cache is quantized."""
    return kv.float() * scale if is_quantized(kv.dtype) else kv.float()


def _gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks_used: int, scale: float = 1.0
) -> torch.Tensor:
    """All sequences' K (or V) at once: [B, max_blocks] ids -> [B, KVH, nb * block_size, D] fp32."""
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    table = block_tables[:, :num_blocks_used].reshape(-1).long()  # [B * nb]
    # NOTE: index_select of whole flattened blocks is a row memcpy, 2-4x faster on CPU than
    # ``cache[table]`` (advanced indexing); the values are the same.
    kv = cache.flatten(1).index_select(0, table)  # [B * nb, block_size * KVH * D]
    kv = kv.view(num_seqs, num_blocks_used * block_size, num_kv_heads, head_dim)  # [B, Lk, KVH, D]
    return _as_float(kv.transpose(1, 2), scale)  # [B, KVH, Lk, D]


def _sdpa_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float):
    """SDPA with GQA folded into the query axis: the G query heads of a kv head are extra rows.

    q [B, Mq, H, D]; k, v [B, KVH, Lk, D]; allowed [B, Mq, Lk] bool -> [B, Mq, H, D] fp32.
    """
    num_seqs, max_q, num_heads, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.float().reshape(num_seqs, max_q, num_kv_heads, group, head_dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(
        num_seqs, num_kv_heads, group * max_q, head_dim
    )  # [B, KVH, G*Mq, D]
    mask = allowed[:, None, None].expand(num_seqs, 1, group, max_q, kv_len)
    mask = mask.reshape(num_seqs, 1, group * max_q, kv_len)  # [B, 1, G*Mq, Lk], broadcast over KVH
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [B, KVH, G*Mq, D]
    out = out.reshape(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, max_q, num_heads, head_dim)  # [B, Mq, H, D]


@dataclass
class TorchAttnMetadata:
    """What every layer's attention needs to know about one step's batch, built once per step
    by ``build_attn_metadata`` and read by all layers (vLLM v1: a backend's
    ``AttentionMetadataBuilder.build()``). Index tensors live on the cache's device.

    Decode sequences (one query row each) are attended block by block (``_decode_split_kv``):
    their ``NB`` (sequence, logical block) pairs are packed one after the other, so no key
    slot is gathered or scored beyond each sequence's last, partial block.
    """

    decode_rows: Optional[torch.Tensor]  # [Bd] query row of each decode sequence; None = every row
    # the decode pairs; None when planned with decodes=False (another kernel attends the decodes)
    block_ids: Optional[torch.Tensor]  # [NB] physical block of each (decode sequence, logical block) pair
    seq_of_block: Optional[torch.Tensor]  # [NB] the decode sequence (0 .. Bd - 1) the pair belongs to
    key_bias: Optional[torch.Tensor]  # [NB, block_size] fp32: 0, or -inf at slots past seq_len
    num_decodes: int  # Bd
    decode_seqs: Optional[torch.Tensor] = None  # [Bd] the decode sequences (batch index); None = all
    # one padded call per bucket of prefill sequences: (rows [t], seqs [b], cu [b + 1], max q_len, max seq_len)
    prefill_buckets: list = field(default_factory=list)


def build_attn_metadata(
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    row_cost: int = 1,
    decodes: bool = True,
) -> TorchAttnMetadata:
    """The plan of one step for ``paged_attention_torch``: which blocks each decode reads,
    and the prefill buckets. ``row_cost`` = num_heads * head_dim (see ``_length_buckets``).
    ``decodes=False`` plans the prefill buckets only (another kernel attends the decodes).
    Reads the lengths on the host: free on CPU, one device sync per step on a GPU."""
    device = block_tables.device
    cu_host = cu_seqlens_q.tolist()  # [B + 1]
    seq_lens_host = seq_lens.tolist()  # [B]
    num_seqs = len(seq_lens_host)

    decode_seqs = [b for b in range(num_seqs) if cu_host[b + 1] - cu_host[b] == 1]

    # 1. Decodes: every (sequence, logical block j) pair, packed sequence after sequence.
    block_ids = seq_of_block = key_bias = None
    if decodes:
        dec = torch.tensor(decode_seqs, dtype=torch.long, device=device)  # [Bd]
        dec_lens = seq_lens.to(device=device, dtype=torch.long)[dec]  # [Bd]
        nb = (dec_lens + block_size - 1) // block_size  # [Bd] blocks of each decode sequence
        seq_of_block = torch.repeat_interleave(torch.arange(dec.shape[0], device=device), nb)  # [NB]
        first = nb.cumsum(0) - nb  # [Bd] first pair of each sequence
        j = torch.arange(seq_of_block.shape[0], device=device) - first[seq_of_block]  # [NB] logical block
        block_ids = block_tables[dec].long()[seq_of_block, j]  # [NB] physical block
        slot_pos = j[:, None] * block_size + torch.arange(block_size, device=device)  # [NB, bs] position
        key_bias = torch.zeros(slot_pos.shape, device=device)  # [NB, bs]
        key_bias.masked_fill_(slot_pos >= dec_lens[seq_of_block, None], float("-inf"))

    # 2. Prefills (rows with q_len > 1): a few padded calls over length buckets (``_length_buckets``).
    buckets = []
    for bucket in (
        _length_buckets(cu_host, seq_lens_host, block_size, row_cost) if len(decode_seqs) < num_seqs else []
    ):
        q_lens = [cu_host[b + 1] - cu_host[b] for b in bucket]
        if max(q_lens) == 1:
            continue  # the decodes' bucket: step 1 covers it
        rows = [r for b in bucket for r in range(cu_host[b], cu_host[b + 1])]
        buckets.append(
            (
                torch.tensor(rows, device=device),  # [t] query rows, packed order
                torch.tensor(bucket, device=device),  # [b] sequences
                torch.tensor([0] + q_lens, device=device).cumsum(0),  # [b + 1]
                max(q_lens),
                max(seq_lens_host[b] for b in bucket),
            )
        )
    every_row = len(decode_seqs) == num_seqs
    return TorchAttnMetadata(
        decode_rows=None
        if every_row
        else torch.tensor([cu_host[b] for b in decode_seqs], dtype=torch.long, device=device),
        block_ids=block_ids,
        seq_of_block=seq_of_block,
        key_bias=key_bias,
        num_decodes=len(decode_seqs),
        decode_seqs=None if every_row else torch.tensor(decode_seqs, dtype=torch.long, device=device),
        prefill_buckets=buckets,
    )


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: Optional[float] = None,
    metadata: Optional[TorchAttnMetadata] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Vectorized paged attention for a whole batch (decode, prefill or both), in torch.

    Same contract as ``paged_attention_prefill_ref`` (q [total_q, H, D] -> [total_q, H, D]);
    ``max_query_len`` / ``max_seq_len`` (host ints from ``ModelInput``) are accepted for
    the backend interface. ``metadata`` is ``build_attn_metadata(...)`` for this step (the
    runner builds it once, ``PagedCausalLM.prepare_attention``, for every layer); ``None`` builds it here.

    Decode rows, all in one call: ``_decode_split_kv`` scores each query against the blocks
    of its own sequence only, packed (no padding to the longest sequence), and merges the
    per-block softmaxes. Prefill rows: per bucket of similar lengths, gather the blocks,
    pad the query rows, one masked SDPA call (``_paged_attention_padded``); decode rows and
    prefill rows never share a call. Computed in fp32, returned in ``q.dtype``. A quantized
    cache is dequantized as it is gathered (``k_scale`` / ``v_scale``, ``quant.py``).
    """
    _check_cache(q, k_cache, v_cache)
    check_kv_scales("paged_attention_torch", k_cache, k_scale, v_scale)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens_q must be [{num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    total_q = q.shape[0]
    if total_q == 0 or num_seqs == 0:
        return torch.empty_like(q)
    scale = _default_scale(q.shape[2], scale)
    if metadata is None:
        metadata = build_attn_metadata(
            block_tables, cu_seqlens_q, seq_lens, k_cache.shape[1], q.shape[1] * q.shape[2]
        )
    if metadata.block_ids is None:
        raise ValueError("metadata was planned without decodes (decodes=False); plan it with decodes=True")
    rows = metadata.decode_rows
    if rows is None:  # a decode-only step: every row is a decode, in order
        return _decode_split_kv(q, k_cache, v_cache, metadata, scale, k_scale, v_scale).to(q.dtype)

    out = torch.empty_like(q)  # [T, H, D]
    if rows.shape[0] > 0:
        out[rows] = _decode_split_kv(q[rows], k_cache, v_cache, metadata, scale, k_scale, v_scale).to(q.dtype)
    attend_prefills(q, k_cache, v_cache, block_tables, seq_lens, metadata, scale, out, k_scale, v_scale)
    return out


def attend_prefills(
    q, k_cache, v_cache, block_tables, seq_lens, metadata, scale, out, k_scale=1.0, v_scale=1.0
) -> None:
    """Write the prefill rows of ``out`` (q_len > 1): one padded, masked SDPA call per
    bucket of ``metadata.prefill_buckets`` (``_paged_attention_padded``)."""
    for rows_t, idx, bucket_cu, bucket_max_q, bucket_max_seq in metadata.prefill_buckets:
        out[rows_t] = _paged_attention_padded(
            q[rows_t],
            k_cache,
            v_cache,
            block_tables[idx],
            bucket_cu,
            seq_lens[idx],
            bucket_max_q,
            bucket_max_seq,
            scale,
            k_scale,
            v_scale,
        )  # [t, H, D]


def _decode_split_kv(
    q, k_cache, v_cache, meta: TorchAttnMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0
) -> torch.Tensor:
    """Decode attention over every decode sequence's blocks at once, block by block.

    q [Bd, H, D] (one query per sequence) -> [Bd, H, D] fp32. Split-KV, as in the Triton
    V2 kernel (``paged_attention.py``) and FlashDecoding: each (sequence, block) pair gives
    a partial softmax over its ``block_size`` keys -- its max ``m``, its sum ``l`` and its
    unnormalised output ``o`` -- and the pairs of a sequence are merged at the end:
    ``out = sum_j exp(m_j - M) o_j / sum_j exp(m_j - M) l_j`` with ``M = max_j m_j``.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    nb = meta.block_ids.shape[0]
    seq = meta.seq_of_block  # [NB]

    # 1. Gather each pair's block: whole blocks, a plain row copy each.
    k = _as_float(
        k_cache.flatten(1).index_select(0, meta.block_ids).view(nb, block_size, num_kv_heads, head_dim),
        k_scale,
    )  # [NB, bs, KVH, D] fp32
    v = _as_float(
        v_cache.flatten(1).index_select(0, meta.block_ids).view(nb, block_size, num_kv_heads, head_dim),
        v_scale,
    )  # [NB, bs, KVH, D] fp32
    # 2. Each pair's query, kv-head major: the G query heads of a kv head are G rows (GQA).
    qb = (
        q.float().reshape(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).index_select(1, seq)
    )  # [KVH, NB, G, D]

    # 3. Scores against the block's keys: per kv head, one batched matmul over all pairs.
    # NOTE: k[:, :, h] is a strided view; bmm reads it in place (no copy per head).
    s = q.new_empty(num_kv_heads, nb, group, block_size, dtype=torch.float32)
    for h in range(num_kv_heads):
        torch.bmm(qb[h], k[:, :, h].transpose(1, 2), out=s[h])  # [NB, G, bs]
    s.mul_(scale).add_(meta.key_bias.view(1, nb, 1, block_size))  # [KVH, NB, G, bs]
    # 4. Partial softmax per pair: max m, sum l, unnormalised output o.
    m = s.amax(-1, keepdim=True)  # [KVH, NB, G, 1]; finite: every block holds >= 1 key
    p = s.sub_(m).exp_()  # [KVH, NB, G, bs]
    l = p.sum(-1, keepdim=True)  # [KVH, NB, G, 1]
    o = q.new_empty(num_kv_heads, nb, group, head_dim, dtype=torch.float32)
    for h in range(num_kv_heads):
        torch.bmm(p[h], v[:, :, h], out=o[h])  # [NB, G, D]

    # 5. Merge the pairs of each sequence: rescale each to the sequence's max M, then sum.
    big_m = m.new_full((num_kv_heads, num_seqs, group, 1), float("-inf"))
    big_m.scatter_reduce_(1, seq[None, :, None, None].expand_as(m), m, "amax")  # [KVH, Bd, G, 1]
    w = (m - big_m.index_select(1, seq)).exp_()  # [KVH, NB, G, 1]
    num = o.new_zeros(num_kv_heads, num_seqs, group, head_dim).index_add_(1, seq, o * w)  # [KVH, Bd, G, D]
    den = l.new_zeros(num_kv_heads, num_seqs, group, 1).index_add_(1, seq, l * w)  # [KVH, Bd, G, 1]
    # NOTE: den >= 1 (the pair holding the max adds exp(0) * l >= 1), except for an empty
    # sequence (seq_len 0, no pairs): 0 / 1 gives it the zeros the reference gives.
    out = (num / den.clamp_min(1.0)).transpose(0, 1)  # [Bd, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


BUCKET_COST = 2**19
"""What one more bucket costs, in units of padded work (query rows x key slots x heads x
head_dim): about 60 small torch ops, ~160 us on one CPU thread, as much as attending ~2000
more key slots with the course model's 8 heads of 32 (measured, ``benchmarks/serving.py``)."""


def _length_buckets(
    cu_host: list[int], seq_lens_host: list[int], block_size: int, row_cost: int = 1
) -> list[list[int]]:
    """Group sequence indices so that little work is spent on padding, in few groups.

    Decodes (q_len 1) and prefills (q_len > 1) are bucketed apart; sequences without
    query rows are dropped (they produce no output). Each group is sorted longest first
    and cut by ``_split_bucket``. ``row_cost`` is what one query row x key slot costs
    (``num_heads * head_dim``), the unit of ``BUCKET_COST``.
    """
    q_lens = [cu_host[b + 1] - cu_host[b] for b in range(len(seq_lens_host))]
    keys = [max(1, -(-n // block_size)) * block_size for n in seq_lens_host]  # whole blocks
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    prefills = [b for b, n in enumerate(q_lens) if n > 1]
    buckets: list[list[int]] = []
    for group in (decodes, prefills):
        if group:
            group.sort(key=lambda b: (keys[b], q_lens[b]), reverse=True)
            buckets += _split_bucket(group, q_lens, keys, BUCKET_COST // max(1, row_cost))
    return buckets


def _split_bucket(bucket: list[int], q_lens: list[int], keys: list[int], cost: int) -> list[list[int]]:
    """Cut a bucket (sorted longest first) in two where that saves the most padded work,
    and recurse, as long as the cut saves more than ``cost`` (query rows x key slots).

    A padded call on ``bucket[i:j]`` spends ``(j - i) * max q_len * keys[bucket[i]]``.
    """
    n = len(bucket)
    q_head = list(accumulate((q_lens[b] for b in bucket), max))  # q_head[i]: max q_len of bucket[:i + 1]
    q_tail = list(accumulate((q_lens[b] for b in reversed(bucket)), max))[::-1]  # max q_len of bucket[i:]
    best_cut, best_work = 0, n * q_head[-1] * keys[bucket[0]] - cost
    for cut in range(1, n):
        work = cut * q_head[cut - 1] * keys[bucket[0]] + (n - cut) * q_tail[cut] * keys[bucket[cut]]
        if work < best_work:
            best_cut, best_work = cut, work
    if best_cut == 0:
        return [bucket]
    return _split_bucket(bucket[:best_cut], q_lens, keys, cost) + _split_bucket(
        bucket[best_cut:], q_lens, keys, cost
    )


def _paged_attention_padded(
    q, k_cache, v_cache, block_tables, cu, seq_lens, max_query_len, max_seq_len, scale, k_scale, v_scale
):
    """The body of ``paged_attention_torch``: pad queries, one masked SDPA, unpad."""
    total_q, num_heads, head_dim = q.shape
    device = q.device
    block_size = k_cache.shape[1]
    num_blocks_used = max(1, min(-(-int(max_seq_len) // block_size), block_tables.shape[1]))
    kv_len = num_blocks_used * block_size

    # 1. Gather K/V through the block tables.
    k = _gather_blocks(k_cache, block_tables, num_blocks_used, k_scale)  # [B, KVH, Lk, D]
    v = _gather_blocks(v_cache, block_tables, num_blocks_used, v_scale)  # [B, KVH, Lk, D]

    # 2. Pad the packed query rows: row j of sequence b is q[cu[b] + j] when j < q_len[b].
    seq_lens_l = seq_lens.to(device=device, dtype=torch.long)  # [B]
    q_lens = cu[1:] - cu[:-1]  # [B]
    j = torch.arange(max_query_len, device=device)  # [Mq]
    row_valid = j[None, :] < q_lens[:, None]  # [B, Mq]
    rows = (cu[:-1, None] + j[None, :]).clamp(max=total_q - 1)  # [B, Mq]
    q_pad = q[rows]  # [B, Mq, H, D]

    # 3. Mask: query j sits at position seq_len - q_len + j and sees keys 0..that position.
    q_pos = (seq_lens_l - q_lens)[:, None] + j[None, :]  # [B, Mq]
    k_pos = torch.arange(kv_len, device=device)  # [Lk]
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < seq_lens_l[:, None, None]
    )  # [B, Mq, Lk]
    # NOTE: padding rows, and the rows of an empty sequence (seq_len 0), would see no key
    # at all and softmax to NaN; let them see key 0 and overwrite them below.
    empty = ~row_valid | (seq_lens_l == 0)[:, None]  # [B, Mq]
    allowed[:, :, 0] |= empty

    # 4. Attention, 5. unpad: boolean indexing keeps (b, j) order, the packed row order.
    out = _sdpa_grouped(q_pad, k, v, allowed, scale)  # [B, Mq, H, D]
    out = out.masked_fill(empty[:, :, None, None], 0.0)
    return out[row_valid].to(q.dtype)  # [T, H, D]
