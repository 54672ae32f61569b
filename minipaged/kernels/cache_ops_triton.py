"""The Triton kernel behind ``cache_ops.reshape_and_cache_triton`` (see ``cache_ops.py`` for
the contract). Its own module so that Triton is imported only when this kernel runs (on a
CUDA device, or under ``TRITON_INTERPRET=1``): ``minipaged.kernels`` and a CPU server never
import it. The caller has checked the arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minipaged.kernels.quant import QUANT_MAX


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) to the nearest e4m3 value, ties away from zero: 3 mantissa bits,
    so the step is 2^(e - 3) at 2^e <= |x| < 2^(e+1), and 2^-9 below 2^-6 (subnormals).
    NOTE: Triton's interpreter rounds fp32 -> e4m3 wrongly when the rounding carries into
    the next power of two (31.6 -> 16, not 32); values already on the grid convert exactly."""
    e = tl.maximum(tl.floor(tl.log2(tl.abs(x) + 1e-30)), -6.0)  # the binade, floored at 2^-6
    step = tl.exp2(e - 3.0)
    r = tl.floor(tl.abs(x) / step + 0.5) * step
    return tl.where(x < 0, -r, r)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, KVH, D] new keys
    value_ptr,  # [T, KVH, D] new values
    k_cache_ptr,  # [num_blocks, block_size, KVH, D] key cache, written in place
    v_cache_ptr,  # [num_blocks, block_size, KVH, D] value cache, written in place
    slot_mapping_ptr,  # [T] slot of each token, < 0 = skip
    stride_kt,
    stride_kh,  # key strides over tokens and heads (head_dim stride is 1)
    stride_vt,
    stride_vh,  # value strides over tokens and heads
    stride_cb,
    stride_cs,
    stride_ch,  # cache strides over blocks, slots, heads (shared by K and V)
    num_kv_heads,  # KVH
    head_dim,  # D
    k_scale,  # keys are stored as key / k_scale (QUANT > 0 only)
    v_scale,  # values are stored as value / v_scale (QUANT > 0 only)
    qmax,  # the top level of the cache dtype: 127 (int8) or 448 (fp8 e4m3)
    block_size: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # KVH rounded up to a power of two
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two
    QUANT: tl.constexpr,  # 0: store as is; 1: int8; 2: fp8 e4m3
):
    """One program per token: copy its [KVH, D] key and value tile to its slot.

    Pseudocode::

        t = program_id(0)
        slot = slot_mapping[t]
        if slot < 0: return                      # padding token
        block, offset = slot // block_size, slot % block_size
        k_cache[block, offset, :, :] = key[t, :, :]      (quantized: key / k_scale, rounded)
        v_cache[block, offset, :, :] = value[t, :, :]
    """
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
        src_k = key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        src_v = value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
        k = tl.load(src_k, mask=mask)
        v = tl.load(src_v, mask=mask)
        if QUANT > 0:  # a compile-time branch: scale, clamp to the levels, round
            k = tl.clamp(k.to(tl.float32) / k_scale, -qmax, qmax)
            v = tl.clamp(v.to(tl.float32) / v_scale, -qmax, qmax)
            if QUANT == 1:  # int8: round half up, as quant.quantize does
                k = tl.floor(k + 0.5)
                v = tl.floor(v + 0.5)
            else:  # fp8 e4m3: round onto its grid here, so that the cast below is exact
                k = _round_to_e4m3(k)
                v = _round_to_e4m3(v)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def launch_reshape_and_cache(
    key, value, k_cache, v_cache, slot_mapping, k_scale: float, v_scale: float
) -> None:
    """One program per token (arguments checked by ``cache_ops.reshape_and_cache_triton``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    grid = (num_tokens,)
    _reshape_and_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        float(k_scale),
        float(v_scale),
        QUANT_MAX.get(k_cache.dtype, 1.0),
        block_size=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT={torch.int8: 1, torch.float8_e4m3fn: 2}.get(k_cache.dtype, 0),
    )
