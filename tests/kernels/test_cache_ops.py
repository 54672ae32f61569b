"""Tests for minipaged/kernels/cache_ops.py: reshape_and_cache, copy_blocks, swap_blocks.

Each op is checked against a plain Python loop over slots / block pairs; the Triton
``reshape_and_cache`` (interpreter on CPU) must give bit-identical caches to the torch one.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported through the package
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minipaged.core.kv.block_table import PAD_SLOT_ID  # noqa: E402
from minipaged.kernels import HAS_TRITON, copy_blocks, reshape_and_cache, swap_blocks  # noqa: E402
from minipaged.kernels.cache_ops import reshape_and_cache_triton  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


def loop_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def make(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, seed=0, num_pad=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:num_pad]] = PAD_SLOT_ID
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return key, value, k_cache, v_cache, slots


# --------------------------------------------------------------------------- reshape_and_cache


def test_reshape_and_cache_writes_slot_and_skips_padding():
    key, value, k_cache, v_cache, _ = make(4, 3, 4, 2, 8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, PAD_SLOT_ID, 0, 11])
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[1, 1], value[0])
    assert torch.equal(k_cache[0, 0], key[2]) and torch.equal(k_cache[2, 3], key[3])
    untouched = torch.ones(3, 4, dtype=torch.bool)
    untouched[1, 1] = untouched[0, 0] = untouched[2, 3] = False
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])


@settings(max_examples=30, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 8, 16]),
    num_blocks=st.integers(1, 6),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 4, 8]),
    frac=st.floats(0.0, 1.0),
    num_pad=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_reshape_and_cache_matches_loop(block_size, num_blocks, num_kv_heads, head_dim, frac, num_pad, seed):
    num_tokens = int(frac * num_blocks * block_size)
    num_pad = min(num_pad, num_tokens)
    key, value, k_cache, v_cache, slots = make(
        num_tokens, num_blocks, block_size, num_kv_heads, head_dim, seed=seed, num_pad=num_pad
    )
    k_want, v_want = k_cache.clone(), v_cache.clone()
    loop_reshape_and_cache(key, value, k_want, v_want, slots)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(1, 1, 8), (16, 2, 80), (4, 3, 96)])
def test_triton_reshape_and_cache_equals_torch(dtype, block_size, num_kv_heads, head_dim):
    key, value, k_cache, v_cache, slots = make(
        9, 10, block_size, num_kv_heads, head_dim, dtype=dtype, seed=block_size, num_pad=2
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_ref, v_ref, slots)
    reshape_and_cache_triton(key, value, k_cache, v_cache, slots.to(torch.int32))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@needs_triton
def test_triton_reshape_and_cache_strided_key():
    """key/value as views into a fused qkv projection (non-contiguous over tokens)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 3, 2, 16, generator=g)  # [T, q|k|v, KVH, D]
    key, value = qkv[:, 1], qkv[:, 2]
    k_cache = torch.zeros(4, 4, 2, 16)
    v_cache = torch.zeros(4, 4, 2, 16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, 2, 9, PAD_SLOT_ID, 15, 0])
    reshape_and_cache(key, value, k_ref, v_ref, slots)
    reshape_and_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("fn", [reshape_and_cache, reshape_and_cache_triton])
def test_reshape_and_cache_errors(fn):
    if fn is reshape_and_cache_triton and not HAS_TRITON:
        pytest.skip("Triton is not installed")
    key, value, k_cache, v_cache, slots = make(3, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="value"):
        fn(key, value[:2], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        fn(key, value, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        fn(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="num_kv_heads"):
        fn(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        fn(key.half(), value.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="num_slots"):
        fn(key, value, k_cache, v_cache, torch.tensor([0, 1, 8]))


# --------------------------------------------------------------------------- copy_blocks


def test_copy_blocks_every_layer_and_simultaneous():
    g = torch.Generator().manual_seed(4)
    k_caches = [torch.randn(6, 4, 2, 8, generator=g) for _ in range(3)]
    v_caches = [torch.randn(6, 4, 2, 8, generator=g) for _ in range(3)]
    k_before = [c.clone() for c in k_caches]
    v_before = [c.clone() for c in v_caches]
    mapping = [(0, 3), (0, 4), (5, 1)]  # one source fanned out to two forks
    copy_blocks(k_caches, v_caches, mapping)
    for layer in range(3):
        want_k, want_v = k_before[layer].clone(), v_before[layer].clone()
        for src, dst in mapping:
            want_k[dst] = k_before[layer][src]
            want_v[dst] = v_before[layer][src]
        assert torch.equal(k_caches[layer], want_k) and torch.equal(v_caches[layer], want_v)


def test_copy_blocks_accepts_tensor_mapping_single_cache_and_empty():
    k = torch.arange(4.0).reshape(4, 1, 1, 1).repeat(1, 2, 1, 3)
    v = -k.clone()
    copy_blocks(k, v, torch.tensor([[2, 0]]))
    assert torch.equal(k[0], k[2]) and torch.equal(v[0], v[2])
    before = k.clone()
    copy_blocks(k, v, [])
    assert torch.equal(k, before)


def test_copy_blocks_errors():
    k = torch.zeros(4, 2, 1, 3)
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks([k], [k.clone()], [(0, 4)])
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks([k], [k.clone()], [(0, 1, 2)])
    with pytest.raises(ValueError, match="v_caches"):
        copy_blocks([k, k], [k], [(0, 1)])


# --------------------------------------------------------------------------- swap_blocks


def test_swap_out_and_back_in_roundtrip():
    g = torch.Generator().manual_seed(5)
    device_pool = torch.randn(8, 4, 2, 8, generator=g)  # stands in for the GPU pool
    cpu_pool = torch.zeros(3, 4, 2, 8)
    out_mapping = [(6, 0), (1, 2)]
    swap_blocks(device_pool, cpu_pool, out_mapping)
    assert torch.equal(cpu_pool[0], device_pool[6]) and torch.equal(cpu_pool[2], device_pool[1])
    assert torch.equal(cpu_pool[1], torch.zeros(4, 2, 8))
    fresh = torch.zeros_like(device_pool)
    swap_blocks(cpu_pool, fresh, [(0, 3), (2, 5)])
    assert torch.equal(fresh[3], device_pool[6]) and torch.equal(fresh[5], device_pool[1])


def test_swap_blocks_errors():
    a = torch.zeros(4, 2, 1, 3)
    with pytest.raises(ValueError, match="block shape"):
        swap_blocks(a, torch.zeros(4, 3, 1, 3), [(0, 0)])
    with pytest.raises(ValueError, match="dtype"):
        swap_blocks(a, a.half(), [(0, 0)])
    with pytest.raises(ValueError, match="src block"):
        swap_blocks(a, torch.zeros(2, 2, 1, 3), [(4, 0)])
    with pytest.raises(ValueError, match="dst block"):
        swap_blocks(a, torch.zeros(2, 2, 1, 3), [(0, 2)])
    with pytest.raises(ValueError, match="negative"):
        swap_blocks(a, a.clone(), [(-1, 0)])
