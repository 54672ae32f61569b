"""PagedAttention in Triton: decode (V1 and split-KV V2) and varlen causal prefill.

Mirrors vLLM ``csrc/attention/paged_attention_v1.cu`` / ``paged_attention_v2.cu`` (the
paper's kernel and its split-KV successor) and
``vllm/attention/ops/triton_unified_attention.py`` (the Triton formulation used here).

Concept
    Attention is computed tile by tile over a sequence's keys with an *online softmax*
    (running max ``m``, running sum ``l``, running output ``acc``), exactly as in
    FlashAttention. What makes it *paged* is only the address of each key: token ``n`` of
    sequence ``b`` is read from ``k_cache[block_tables[b, n // block_size], n % block_size]``.
    A tile of ``BLOCK_N`` tokens may span several small physical blocks or part of one large
    block, so one kernel serves every ``block_size`` from 1 to 256.

    PagedAttention (where K/V live, how they are addressed) and FlashAttention (never
    materializing the score matrix, keeping the softmax online) are separate ideas; these
    kernels use both, and ``paged_attention_ref`` is the same math without either.

Inputs / outputs
    ``paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=None)``
        q [num_seqs, num_heads, head_dim] (one new token per sequence) -> same shape.
    ``paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=None)``
        q [total_q, num_heads, head_dim], the last ``q_len`` positions of each sequence,
        causal, over cached tokens too (chunked prefill, prefix caching) -> same shape.
    Caches [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs,
    max_blocks] int32; seq_lens [num_seqs] int32; cu_seqlens_q [num_seqs + 1] int32.

Invariants
    - GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``. Decode runs
      one program per (sequence, kv head) and stacks the group's query heads as the rows
      of one tile, so each K/V tile is loaded once per group.
    - ``head_dim`` may be any size (80, 96, ...): tiles are padded to the next power of
      two and the padding is masked. ``block_size`` is any power of two 1..256.
    - fp32 / fp16 / bf16 inputs; scores, softmax and the accumulator are fp32; the output
      has ``q``'s dtype. fp32 inputs use IEEE (not TF32) dot products.
    - An int8 / fp8 cache (``kv_cache_dtype``, ``quant.py``) is dequantized as each tile is
      loaded (``k * k_scale`` in fp32, then ``q``'s dtype for the dot): FP8 is the storage
      format, the dots run in ``q``'s dtype.
    - Sequences with ``seq_lens[b] == 0`` (padding) produce zeros.

Split-KV ("PagedAttention V2")
    With few sequences, one program per (sequence, kv head) leaves most of a GPU idle
    while each program walks a long context. V2 cuts each context into partitions of
    ``partition_size`` tokens, attends to them in parallel (each writes its partial output,
    max logit and exp-sum), then a reduce kernel rescales and sums the partials. Chosen
    automatically (long context or too few programs for the GPU) or forced by ``use_v2``.

Failure mode
    ``ValueError`` naming the argument for wrong ranks, shapes, dtypes, devices, or (for
    tensors on the CPU, where checking is free) block ids outside the cache.
    ``RuntimeError`` if Triton is not installed.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from minipaged.kernels.quant import check_kv_scales, is_quantized

try:  # Triton is optional (absent on macOS); the package __init__ set TRITON_INTERPRET first.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    HAS_TRITON = False

# Read when the kernels below were decorated: True means they run in Triton's interpreter.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634  # scores are kept in base 2 so the kernels can use exp2

# Tile sizes (powers of two, >= 16 because tl.dot needs that on a GPU).
DECODE_BLOCK_N = 64  # tokens per K/V tile in decode
PREFILL_BLOCK_M = 64  # query rows per program in prefill
PREFILL_BLOCK_N = 64  # tokens per K/V tile in prefill
PARTITION_SIZE = 512  # tokens per split-KV partition (vLLM's V2 uses 512 too)
V2_MIN_SEQ_LEN = 8192  # always split contexts longer than this
# Launch options on a GPU (the interpreter ignores them). Triton's defaults on NVIDIA are
# 4 warps and 3 pipeline stages; each stage keeps one K and one V tile in shared memory.
NUM_WARPS = 4
MAX_NUM_STAGES = 3
KV_SMEM_BUDGET = 96 * 1024  # bytes of K/V tiles over all stages (shared memory per program: L4 99 KiB)


# =========================================================================== kernels

if HAS_TRITON:

    @triton.jit
    def _attend_kv_range(
        acc,  # [BLOCK_M, BLOCK_D] fp32 running output (unnormalized)
        l_i,  # [BLOCK_M] fp32 running sum of exp2(score - m_i)
        m_i,  # [BLOCK_M] fp32 running max of the scores (base-2 logits)
        q,  # [BLOCK_M, BLOCK_D] query tile, rows are query heads (decode) or positions (prefill)
        q_pos,  # [BLOCK_M] position of each query row: it may see keys 0..q_pos
        k_cache_ptr,  # [num_blocks, block_size, KVH, D] key cache
        v_cache_ptr,  # [num_blocks, block_size, KVH, D] value cache
        block_table_ptr,  # this sequence's row of block_tables: logical -> physical block
        kv_head,  # which kv head to read
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,  # key cache strides
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,  # value cache strides
        start,  # first token position to visit
        end,  # one past the last token position to visit
        qk_scale,  # softmax scale * log2(e)
        k_scale,  # a quantized cache holds key / k_scale (KV_QUANT only)
        v_scale,  # ... and value / v_scale
        head_dim,  # D (BLOCK_D may be larger)
        block_size: tl.constexpr,  # tokens per cache block
        BLOCK_N: tl.constexpr,  # tokens per K/V tile
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two
        COMPUTE_DTYPE: tl.constexpr,  # dtype of the dot-product operands (see _compute_dtype)
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands, "tf32" otherwise (ignored for 16-bit)
        KV_QUANT: tl.constexpr,  # True: the cache is int8 / fp8, dequantized as each tile is loaded
    ):
        """Online softmax over tokens ``start..end-1`` of one sequence, read through its block table.

        Pseudocode::

            for each tile n = start .. end in steps of BLOCK_N:
                block = block_table[n // block_size]; slot = n % block_size   # the paging
                k, v  = k_cache[block, slot, kv_head], v_cache[...]           # [BLOCK_N, D]
                        (quantized: k * k_scale, v * v_scale, in fp32)
                s     = q @ k.T * scale, masked where n > q_pos or n >= end    # [BLOCK_M, BLOCK_N]
                m_new = max(m, rowmax(s)); alpha = exp(m - m_new); p = exp(s - m_new)
                l     = l * alpha + rowsum(p);  acc = acc * alpha + p @ v;  m = m_new
        """
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)  # token positions of this tile
            mask_n = offs_n < end
            # The paging: logical block n // block_size -> physical block, then the slot in it.
            block_ids = tl.load(block_table_ptr + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
            slots = offs_n % block_size
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k_ptrs = (
                k_cache_ptr
                + block_ids[:, None] * stride_kb
                + slots[:, None] * stride_ks
                + kv_head * stride_kh
                + offs_d[None, :] * stride_kd
            )
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            if KV_QUANT:  # a compile-time branch: dequantize the tile
                k = k.to(tl.float32) * k_scale
            k = k.to(COMPUTE_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            # NOTE: every row sees key `start` in the first tile (q_pos >= start), so m_new
            # is finite from then on and exp2(-inf - m_new) = 0 for masked entries.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = (
                v_cache_ptr
                + block_ids[:, None] * stride_vb
                + slots[:, None] * stride_vs
                + kv_head * stride_vh
                + offs_d[None, :] * stride_vd
            )
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            if KV_QUANT:
                v = v.to(tl.float32) * v_scale
            v = v.to(COMPUTE_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _paged_attention_decode_kernel(
        out_ptr,  # [num_seqs, H, D] output (V1) -- or, when PARTITION_SIZE > 0 (V2):
        exp_sums_ptr,  # [num_seqs, H, max_parts] fp32 partial softmax sums (V2 only)
        max_logits_ptr,  # [num_seqs, H, max_parts] fp32 partial max logits (V2 only)
        tmp_out_ptr,  # [num_seqs, H, max_parts, D] fp32 partial outputs (V2 only)
        q_ptr,  # [num_seqs, H, D] one query per sequence
        k_cache_ptr,  # [num_blocks, block_size, KVH, D]
        v_cache_ptr,  # [num_blocks, block_size, KVH, D]
        block_tables_ptr,  # [num_seqs, max_blocks] int32
        seq_lens_ptr,  # [num_seqs] int32 context length of each sequence
        qk_scale,  # softmax scale * log2(e)
        k_scale,  # scale of a quantized key cache (KV_QUANT only)
        v_scale,  # scale of a quantized value cache (KV_QUANT only)
        stride_qs,
        stride_qh,
        stride_qd,  # q strides
        stride_os,
        stride_oh,
        stride_od,  # out strides
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,  # key cache strides
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,  # value cache strides
        stride_bt,  # block_tables stride over sequences
        stride_ps,
        stride_ph,  # exp_sums / max_logits strides (sequence, head); partition stride 1
        stride_ts,
        stride_th,
        stride_tp,  # tmp_out strides (sequence, head, partition); D stride 1
        head_dim,  # D
        num_queries_per_kv,  # H // KVH: the GQA group size
        block_size: tl.constexpr,  # tokens per cache block
        PARTITION_SIZE: tl.constexpr,  # 0 = V1 (whole context, write out); > 0 = V2 partition size
        BLOCK_G: tl.constexpr,  # group size rounded up to a power of two >= 16 (tile rows)
        BLOCK_N: tl.constexpr,  # tokens per K/V tile
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two
        COMPUTE_DTYPE: tl.constexpr,  # dtype of the dot-product operands
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands
        KV_QUANT: tl.constexpr,  # the cache is int8 / fp8 (read through k_scale, v_scale)
    ):
        """Decode: program (seq, kv_head[, partition]) attends the group's queries to its keys.

        Pseudocode::

            seq, kv_head, part = program_id(0), program_id(1), program_id(2)
            heads = kv_head * group + [0 .. group)          # the GQA group, as tile rows
            q     = q[seq, heads, :]                        # [G, D]
            V1:  acc, l, m = attend(q, tokens 0 .. seq_len);   out[seq, heads] = acc / l
            V2:  tokens part*P .. min((part+1)*P, seq_len)  (skip if empty);
                 tmp_out[seq, heads, part] = acc / l; exp_sums[...] = l; max_logits[...] = m
        """
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq)
        if PARTITION_SIZE > 0:  # a compile-time branch: V2 attends to one partition
            part = tl.program_id(2)
            start = part * PARTITION_SIZE
            if start >= seq_len:
                return  # this partition lies past the end of a shorter sequence
            end = tl.minimum(start + PARTITION_SIZE, seq_len)
        else:  # V1 attends to the whole context
            part = 0
            start = 0
            end = seq_len

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kv_head * num_queries_per_kv + offs_g  # query heads of this group
        mask_g = offs_g < num_queries_per_kv
        mask_d = offs_d < head_dim
        q_mask = mask_g[:, None] & mask_d[None, :]
        q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(COMPUTE_DTYPE)  # [BLOCK_G, BLOCK_D]
        q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)  # the new token sees every key

        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) + float("-inf")
        acc, l_i, m_i = _attend_kv_range(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + seq * stride_bt,
            kv_head,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            start,
            end,
            qk_scale,
            k_scale,
            v_scale,
            head_dim,
            block_size,
            BLOCK_N,
            BLOCK_D,
            COMPUTE_DTYPE,
            DOT_PRECISION,
            KV_QUANT,
        )
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len == 0 (padding) -> output 0
        out = acc / l_safe[:, None]  # [BLOCK_G, BLOCK_D]

        if PARTITION_SIZE > 0:
            p_offs = seq * stride_ps + heads * stride_ph + part
            tl.store(exp_sums_ptr + p_offs, l_i, mask=mask_g)
            tl.store(max_logits_ptr + p_offs, m_i, mask=mask_g)
            t_ptrs = (
                tmp_out_ptr
                + seq * stride_ts
                + heads[:, None] * stride_th
                + part * stride_tp
                + offs_d[None, :]
            )
            tl.store(t_ptrs, out, mask=q_mask)
        else:
            o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _paged_attention_reduce_kernel(
        out_ptr,  # [num_seqs, H, D] final output
        exp_sums_ptr,  # [num_seqs, H, max_parts] fp32: l of each partition
        max_logits_ptr,  # [num_seqs, H, max_parts] fp32: m of each partition (base 2)
        tmp_out_ptr,  # [num_seqs, H, max_parts, D] fp32: normalized output of each partition
        seq_lens_ptr,  # [num_seqs] int32
        stride_os,
        stride_oh,
        stride_od,  # out strides
        stride_ps,
        stride_ph,  # exp_sums / max_logits strides; partition stride 1
        stride_ts,
        stride_th,
        stride_tp,  # tmp_out strides; D stride 1
        head_dim,  # D
        PARTITION_SIZE: tl.constexpr,  # tokens per partition
        BLOCK_P: tl.constexpr,  # max_parts rounded up to a power of two
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two
    ):
        """V2 reduce: merge the partitions of one (sequence, head).

        Pseudocode::

            n = ceil(seq_len / PARTITION_SIZE)
            M = max(max_logits[:n]);  w = exp_sums[:n] * exp(max_logits[:n] - M)
            out = sum(w[p] * tmp_out[p]) / sum(w)          # tmp_out[p] was already / l[p]
        """
        seq = tl.program_id(0)
        head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq)
        num_parts = tl.cdiv(seq_len, PARTITION_SIZE)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_D)
        mask_p = offs_p < num_parts
        mask_d = offs_d < head_dim
        p_offs = seq * stride_ps + head * stride_ph + offs_p
        # NOTE: a finite stand-in for the missing partitions keeps m - m_global free of
        # (-inf) - (-inf) = NaN when a sequence is empty; their weight is zeroed below anyway.
        m = tl.load(max_logits_ptr + p_offs, mask=mask_p, other=-1.0e30)  # [BLOCK_P]
        l = tl.load(exp_sums_ptr + p_offs, mask=mask_p, other=0.0)  # [BLOCK_P]
        m_global = tl.max(m, 0)
        w = tl.where(mask_p, l * tl.exp2(m - m_global), 0.0)  # weight of each partition
        w_sum = tl.sum(w, 0)
        w_sum = tl.where(w_sum == 0.0, 1.0, w_sum)  # seq_len == 0 -> output 0
        t_ptrs = (
            tmp_out_ptr + seq * stride_ts + head * stride_th + offs_p[:, None] * stride_tp + offs_d[None, :]
        )
        tmp = tl.load(t_ptrs, mask=mask_p[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_P, BLOCK_D]
        out = tl.sum(w[:, None] * tmp, 0) / w_sum  # [BLOCK_D]
        o_ptrs = out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)

    @triton.jit
    def _paged_attention_prefill_kernel(
        out_ptr,  # [total_q, H, D] output
        q_ptr,  # [total_q, H, D] packed query rows of all sequences
        k_cache_ptr,  # [num_blocks, block_size, KVH, D]
        v_cache_ptr,  # [num_blocks, block_size, KVH, D]
        block_tables_ptr,  # [num_seqs, max_blocks] int32
        cu_seqlens_q_ptr,  # [num_seqs + 1] int32: sequence b owns rows cu[b]:cu[b+1]
        seq_lens_ptr,  # [num_seqs] int32: context length (cached + new)
        qk_scale,  # softmax scale * log2(e)
        k_scale,  # scale of a quantized key cache (KV_QUANT only)
        v_scale,  # scale of a quantized value cache (KV_QUANT only)
        stride_qt,
        stride_qh,
        stride_qd,  # q strides
        stride_ot,
        stride_oh,
        stride_od,  # out strides
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,  # key cache strides
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,  # value cache strides
        stride_bt,  # block_tables stride over sequences
        head_dim,  # D
        num_queries_per_kv,  # H // KVH
        block_size: tl.constexpr,  # tokens per cache block
        BLOCK_M: tl.constexpr,  # query rows per program
        BLOCK_N: tl.constexpr,  # tokens per K/V tile
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two
        COMPUTE_DTYPE: tl.constexpr,  # dtype of the dot-product operands
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands
        KV_QUANT: tl.constexpr,  # the cache is int8 / fp8 (read through k_scale, v_scale)
    ):
        """Varlen causal prefill: program (query tile, head, seq) over the paged context.

        Pseudocode::

            q_start, q_len = cu[seq], cu[seq + 1] - cu[seq];  skip tile if past q_len
            context = seq_len - q_len                       # tokens cached before this chunk
            rows    = tile*BLOCK_M + [0 .. BLOCK_M)         # query j is at position context + j
            acc, l, m = attend(q[q_start + rows, head], keys 0 .. context + last row, causal)
            out[q_start + rows, head] = acc / l
        """
        tile_m = tl.program_id(0)
        head = tl.program_id(1)
        seq = tl.program_id(2)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if tile_m * BLOCK_M >= q_len:
            return  # this sequence has fewer query rows than the longest one
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len
        kv_head = head // num_queries_per_kv

        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < q_len
        mask_d = offs_d < head_dim
        q_mask = mask_m[:, None] & mask_d[None, :]
        rows = q_start + offs_m
        q_ptrs = q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(COMPUTE_DTYPE)  # [BLOCK_M, BLOCK_D]
        q_pos = context_len + offs_m  # position of each query in its sequence

        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
        # Causal: no row of this tile sees past its last row's position.
        end = tl.minimum(seq_len, context_len + (tile_m + 1) * BLOCK_M)
        acc, l_i, m_i = _attend_kv_range(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + seq * stride_bt,
            kv_head,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            0,
            end,
            qk_scale,
            k_scale,
            v_scale,
            head_dim,
            block_size,
            BLOCK_N,
            BLOCK_D,
            COMPUTE_DTYPE,
            DOT_PRECISION,
            KV_QUANT,
        )
        out = acc / l_i[:, None]  # every valid row saw key 0, so l_i > 0 there
        o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# =========================================================================== wrappers

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)


def _require_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            f"{name} needs Triton, which is not installed on this platform; "
            "use paged_attention_torch (or attention_backend='torch') instead"
        )


def _next_pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, 1 << max(0, (int(n) - 1).bit_length()))


def _check_common(name, q, k_cache, v_cache, block_tables, seq_lens, num_seqs) -> None:
    """Shape, dtype and device checks shared by decode and prefill (no device sync)."""
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"{name}: k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{name}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"{name}: k_cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{name}: num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"{name}: block_size must be a power of two in 1..256, got {block_size}")
    if head_dim < 1 or head_dim > 256:
        raise ValueError(f"{name}: head_dim must be in 1..256, got {head_dim}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"{name}: q dtype must be one of {_DTYPES}, got {q.dtype}")
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype and not (is_quantized(t.dtype) and v_cache.dtype == k_cache.dtype):
            raise ValueError(
                f"{name}: {arg} dtype {t.dtype} must be q's ({q.dtype}) or a quantized cache's "
                "(int8 / float8_e4m3fn, both caches alike)"
            )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{name}: block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"{name}: seq_lens must be [{num_seqs}], got shape {tuple(seq_lens.shape)}")
    for arg, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in _INT_DTYPES:
            raise ValueError(f"{name}: {arg} must be int32 or int64, got {t.dtype}")
    for arg, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if t.device != q.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but q is on {q.device}")
    if not _INTERPRETED and q.device.type != "cuda":
        raise ValueError(
            f"{name}: tensors are on {q.device}, but Triton was set up to compile for a GPU; "
            "move them to CUDA, or set TRITON_INTERPRET=1 before importing minipaged.kernels"
        )
    # Value checks only where they are free (CPU tensors): catch what would read wild memory.
    if seq_lens.device.type == "cpu" and num_seqs > 0:
        lens = seq_lens.long()
        if int(lens.min()) < 0:
            raise ValueError(f"{name}: seq_lens must be >= 0")
        max_len = block_tables.shape[1] * block_size
        if int(lens.max()) > max_len:
            raise ValueError(
                f"{name}: seq_lens holds {int(lens.max())} tokens but block_tables has room for {max_len}"
            )
        used = torch.arange(block_tables.shape[1])[None, :] < (lens[:, None] + block_size - 1) // block_size
        ids = block_tables.long()[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"{name}: block_tables uses a block id outside 0..{num_blocks - 1}")


def _compute_dtype(dtype: torch.dtype):
    """The dtype the kernels feed to ``tl.dot``: the input dtype, except bf16 in the interpreter.

    NOTE: Triton's interpreter stores bf16 as raw uint16 and does not support arithmetic on
    it (its ``tl.dot`` multiplies the bit patterns; triton-lang/triton#11584), so under
    ``TRITON_INTERPRET=1`` bf16 tiles are upcast to fp32 after loading. On a GPU nothing changes.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if _INTERPRETED else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def _scale_and_precision(q: torch.Tensor, scale: Optional[float]):
    """(softmax scale * log2 e, COMPUTE_DTYPE, DOT_PRECISION) for the kernels."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    compute_dtype = _compute_dtype(q.dtype)
    return scale * _LOG2E, compute_dtype, ("ieee" if compute_dtype == tl.float32 else "tf32")


def _num_stages(block_n: int, block_d: int, dtype: torch.dtype) -> int:
    """Pipeline depth for the K/V loop: Triton's default (3) unless the K and V tiles of all
    stages would outgrow ``KV_SMEM_BUDGET``. E.g. fp32 at head_dim 128 with 64-token tiles
    (64 KiB a stage) gets 1: with 3, the compiled prefill kernel asks for more shared memory
    than an sm_86/sm_89 GPU (L4, RTX 4090: 99 KiB) gives a program; ``benchmarks/gpu_aot_check.py``
    prints what each launch asks for."""
    per_stage = 2 * block_n * block_d * dtype.itemsize  # one K tile + one V tile, bytes
    return max(1, min(MAX_NUM_STAGES, KV_SMEM_BUDGET // per_stage))


def _check_launch(name: str, num_warps, num_stages) -> None:
    if num_warps is not None and (not isinstance(num_warps, int) or num_warps not in (1, 2, 4, 8, 16)):
        raise ValueError(f"{name}: num_warps must be None or one of 1, 2, 4, 8, 16, got {num_warps!r}")
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"{name}: num_stages must be None or an int >= 1, got {num_stages!r}")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: Optional[float] = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_seq_len: Optional[int] = None,
    use_v2: Optional[bool] = None,
    partition_size: int = PARTITION_SIZE,
    block_n: int = DECODE_BLOCK_N,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Decode attention through block tables: q [num_seqs, H, D] -> [num_seqs, H, D].

    ``max_seq_len`` (a host int, as ``ModelInput`` carries) avoids a device sync.
    ``use_v2``: None picks V1 or split-KV V2 from the sequence lengths and the GPU's size;
    True/False forces one. ``partition_size`` (V2) and ``block_n`` (K/V tile) are powers of
    two >= 16 with ``block_n <= partition_size``; tests shrink them to exercise several tiles.
    ``num_warps`` / ``num_stages``: GPU launch options (None: ``NUM_WARPS`` and
    ``_num_stages``); ``benchmarks/kernels.py --tune`` sweeps them.
    """
    _require_triton("paged_attention_decode")
    num_seqs = q.shape[0] if q.dim() == 3 else -1
    _check_common("paged_attention_decode", q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    for arg, val in (("partition_size", partition_size), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"paged_attention_decode: {arg} must be a power of two >= 16, got {val}")
    if block_n > partition_size:
        raise ValueError(
            f"paged_attention_decode: block_n ({block_n}) must be <= partition_size ({partition_size})"
        )
    _check_launch("paged_attention_decode", num_warps, num_stages)

    out = torch.empty_like(q)  # [B, H, D]
    if num_seqs == 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qk_scale, compute_dtype, precision = _scale_and_precision(q, scale)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())  # one device sync; pass it in to avoid this
    max_num_partitions = max(1, triton.cdiv(max_seq_len, partition_size))
    if use_v2 is None:
        # V2 pays off when one program per (seq, kv head) would leave SMs idle while each
        # walks a long context, or when contexts are very long (vLLM uses the same idea).
        too_few_programs = num_seqs * num_kv_heads < 2 * _num_sms(q.device)
        use_v2 = max_num_partitions > 1 and (max_seq_len > V2_MIN_SEQ_LEN or too_few_programs)

    common = dict(
        block_size=block_size,
        BLOCK_G=_next_pow2(group),
        BLOCK_N=block_n,
        BLOCK_D=_next_pow2(head_dim),
        COMPUTE_DTYPE=compute_dtype,
        DOT_PRECISION=precision,
        KV_QUANT=is_quantized(k_cache.dtype),
        num_warps=NUM_WARPS if num_warps is None else num_warps,
        num_stages=_num_stages(block_n, _next_pow2(head_dim), q.dtype) if num_stages is None else num_stages,
    )
    cache_strides = (*k_cache.stride(), *v_cache.stride())
    if not use_v2:
        grid = (num_seqs, num_kv_heads)
        dummy = out  # V1 never touches the V2 buffers
        _paged_attention_decode_kernel[grid](
            out,
            dummy,
            dummy,
            dummy,
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            qk_scale,
            k_scale,
            v_scale,
            *q.stride(),
            *out.stride(),
            *cache_strides,
            block_tables.stride(0),
            0,
            0,
            0,
            0,
            0,
            head_dim,
            group,
            PARTITION_SIZE=0,
            **common,
        )
        return out

    exp_sums = torch.empty(num_seqs, num_heads, max_num_partitions, dtype=torch.float32, device=q.device)
    max_logits = torch.empty_like(exp_sums)  # [B, H, P]
    tmp_out = torch.empty(
        num_seqs, num_heads, max_num_partitions, head_dim, dtype=torch.float32, device=q.device
    )
    grid = (num_seqs, num_kv_heads, max_num_partitions)
    _paged_attention_decode_kernel[grid](
        out,
        exp_sums,
        max_logits,
        tmp_out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        qk_scale,
        k_scale,
        v_scale,
        *q.stride(),
        *out.stride(),
        *cache_strides,
        block_tables.stride(0),
        exp_sums.stride(0),
        exp_sums.stride(1),
        tmp_out.stride(0),
        tmp_out.stride(1),
        tmp_out.stride(2),
        head_dim,
        group,
        PARTITION_SIZE=partition_size,
        **common,
    )
    _paged_attention_reduce_kernel[(num_seqs, num_heads)](
        out,
        exp_sums,
        max_logits,
        tmp_out,
        seq_lens,
        *out.stride(),
        exp_sums.stride(0),
        exp_sums.stride(1),
        tmp_out.stride(0),
        tmp_out.stride(1),
        tmp_out.stride(2),
        head_dim,
        PARTITION_SIZE=partition_size,
        BLOCK_P=_next_pow2(max_num_partitions, at_least=1),
        BLOCK_D=_next_pow2(head_dim),
    )
    return out


def paged_attention_prefill(
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
    max_query_len: Optional[int] = None,
    block_m: int = PREFILL_BLOCK_M,
    block_n: int = PREFILL_BLOCK_N,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Varlen causal attention over paged K/V: q [total_q, H, D] -> [total_q, H, D].

    Sequence ``b``'s queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and are the last
    ``q_len`` positions of its ``seq_lens[b]`` tokens; earlier tokens are read from the cache
    (chunked prefill, prefix caching). Decode rows (``q_len == 1``) may be mixed in.
    ``max_query_len`` (a host int) avoids a device sync. ``block_m`` / ``block_n``: tile sizes;
    ``num_warps`` / ``num_stages``: GPU launch options, as in ``paged_attention_decode``.
    """
    _require_triton("paged_attention_prefill")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_common("paged_attention_prefill", q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    check_kv_scales("paged_attention_prefill", k_cache, k_scale, v_scale)
    if cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.dtype not in _INT_DTYPES:
        raise ValueError(
            f"paged_attention_prefill: cu_seqlens_q must be int [{num_seqs + 1}], "
            f"got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}"
        )
    if cu_seqlens_q.device != q.device:
        raise ValueError(
            f"paged_attention_prefill: cu_seqlens_q is on {cu_seqlens_q.device} but q is on {q.device}"
        )
    for arg, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"paged_attention_prefill: {arg} must be a power of two >= 16, got {val}")
    _check_launch("paged_attention_prefill", num_warps, num_stages)
    if cu_seqlens_q.device.type == "cpu" and num_seqs > 0:
        q_lens = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
        if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != q.shape[0] or int(q_lens.min()) < 0:
            raise ValueError(
                f"paged_attention_prefill: cu_seqlens_q must rise from 0 to total_q = {q.shape[0]}"
            )
        if bool((q_lens > seq_lens.long()).any()):
            raise ValueError("paged_attention_prefill: a sequence has more query rows than seq_lens tokens")

    out = torch.empty_like(q)  # [T, H, D]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    qk_scale, compute_dtype, precision = _scale_and_precision(q, scale)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one device sync
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _paged_attention_prefill_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        qk_scale,
        k_scale,
        v_scale,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        head_dim,
        num_heads // num_kv_heads,
        block_size=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_next_pow2(head_dim),
        COMPUTE_DTYPE=compute_dtype,
        DOT_PRECISION=precision,
        KV_QUANT=is_quantized(k_cache.dtype),
        num_warps=NUM_WARPS if num_warps is None else num_warps,
        num_stages=_num_stages(block_n, _next_pow2(head_dim), q.dtype) if num_stages is None else num_stages,
    )
    return out
