"""Tests for minipaged/kernels/reference.py (the torch attention everything else is graded by)
and for the vectorized "torch" backend, minipaged/kernels/torch_backend.py.

The readable references are checked against an independent float64 loop that reads each
token through the slot formula; ``paged_attention_torch`` (the vectorized engine backend)
is checked against the readable references, and contiguous attention against torch SDPA.
Tolerance: fp32 atol = rtol = 1e-5; fp16 3e-3; bf16 2e-2 (against fp32 math on the same inputs).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _paged_cases import TOL, cu_from, make_paged
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels import torch_backend
from minipaged.kernels.reference import (
    contiguous_attention,
    paged_attention_prefill_ref,
    paged_attention_ref,
)
from minipaged.kernels.torch_backend import paged_attention_torch


def loop_attention_f64(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=None):
    """Independent reference: scalar slot arithmetic, float64, explicit softmax."""
    total_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(total_q, num_heads, head_dim, dtype=torch.float64)
    for b in range(len(seq_lens)):
        start, end, seq_len = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        q_len = end - start
        keys, values = [], []
        for i in range(seq_len):
            block = int(block_tables[b, i // block_size])
            keys.append(k_cache[block, i % block_size].double())
            values.append(v_cache[block, i % block_size].double())
        for j in range(q_len):
            pos = seq_len - q_len + j
            for h in range(num_heads):
                kvh = h // group
                s = torch.stack([keys[i][kvh] @ q[start + j, h].double() for i in range(pos + 1)]) * scale
                p = torch.exp(s - s.max())
                p = p / p.sum()
                out[start + j, h] = sum(p[i] * values[i][kvh] for i in range(pos + 1))
    return out


# --------------------------------------------------------------------------- readable refs


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_decode_ref_matches_float64_loop(block_size, num_heads, num_kv_heads):
    seq_lens = [1, block_size, block_size + 1, 3 * block_size + 2]
    k, v, bt, sl = make_paged(seq_lens, block_size, num_kv_heads, 8, extra_cols=2, seed=block_size)
    q = torch.randn(len(seq_lens), num_heads, 8, generator=torch.Generator().manual_seed(1))
    out = paged_attention_ref(q, k, v, bt, sl)
    want = loop_attention_f64(q, k, v, bt, cu_from([1] * len(seq_lens)), sl)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_prefill_ref_matches_float64_loop_with_cached_prefix():
    seq_lens = [7, 5, 12, 1]
    q_lens = [3, 5, 12, 1]  # cached prefix of 4, none, none, decode-like
    k, v, bt, sl = make_paged(seq_lens, 4, 2, 8, seed=3)
    q = torch.randn(sum(q_lens), 4, 8, generator=torch.Generator().manual_seed(4))
    cu = cu_from(q_lens)
    out = paged_attention_prefill_ref(q, k, v, bt, cu, sl, scale=0.3)
    want = loop_attention_f64(q, k, v, bt, cu, sl, scale=0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_prefill_ref_decode_rows_equal_decode_ref():
    k, v, bt, sl = make_paged([3, 9, 16], 8, 2, 8, seed=5)
    q = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(6))
    a = paged_attention_ref(q, k, v, bt, sl)
    b = paged_attention_prefill_ref(q, k, v, bt, cu_from([1, 1, 1]), sl)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_empty_sequence_gives_zeros():
    k, v, bt, sl = make_paged([0, 5, 0, 300], 4, 1, 8)
    q = torch.randn(4, 2, 8)
    out = paged_attention_ref(q, k, v, bt, sl)
    assert torch.equal(out[0], torch.zeros(2, 8)) and torch.equal(out[2], torch.zeros(2, 8))
    fast = paged_attention_torch(q, k, v, bt, cu_from([1, 1, 1, 1]), sl, 1, 300)
    torch.testing.assert_close(fast, out, **TOL[torch.float32])


# --------------------------------------------------------------------------- contiguous


@pytest.mark.parametrize("causal", [True, False])
def test_contiguous_attention_matches_sdpa(causal):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 6, 4, 16, generator=g)  # [B, T, H, D]
    k = torch.randn(2, 6, 2, 16, generator=g)
    v = torch.randn(2, 6, 2, 16, generator=g)
    out = contiguous_attention(q, k, v, causal=causal)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=causal,
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


def test_contiguous_attention_causal_is_bottom_right_aligned():
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3, 2, 8, generator=g)
    k = torch.randn(10, 2, 8, generator=g)
    v = torch.randn(10, 2, 8, generator=g)
    out = contiguous_attention(q, k, v, causal=True)
    for j in range(3):  # query j sits at position 7 + j
        want = contiguous_attention(q[j : j + 1], k[: 8 + j], v[: 8 + j], causal=False)
        torch.testing.assert_close(out[j : j + 1], want, **TOL[torch.float32])


def test_paged_equals_contiguous_through_block_table():
    """Scatter contiguous K/V through a shuffled block table, attend paged: same answer."""
    g = torch.Generator().manual_seed(9)
    seq_len, block_size = 11, 4
    k = torch.randn(seq_len, 2, 8, generator=g)
    v = torch.randn(seq_len, 2, 8, generator=g)
    q = torch.randn(1, 4, 8, generator=g)
    table = torch.tensor([5, 0, 3], dtype=torch.int32)
    k_cache = torch.zeros(6, block_size, 2, 8)
    v_cache = torch.zeros(6, block_size, 2, 8)
    for i in range(seq_len):
        k_cache[table[i // block_size], i % block_size] = k[i]
        v_cache[table[i // block_size], i % block_size] = v[i]
    paged = paged_attention_ref(q, k_cache, v_cache, table[None], torch.tensor([seq_len], dtype=torch.int32))
    torch.testing.assert_close(paged, contiguous_attention(q, k, v, causal=False), **TOL[torch.float32])


# --------------------------------------------------------------------------- vectorized


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_decode_matches_ref(dtype):
    seq_lens = [1, 16, 17, 40, 3]
    k, v, bt, sl = make_paged(seq_lens, 16, 2, 16, dtype=dtype, extra_cols=3, seed=10)
    q = torch.randn(5, 8, 16, generator=torch.Generator().manual_seed(11)).to(dtype)
    out = paged_attention_torch(q, k, v, bt, cu_from([1] * 5), sl, 1, max(seq_lens))
    assert out.dtype == dtype and out.shape == q.shape
    want = paged_attention_ref(q.float(), k.float(), v.float(), bt, sl)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_mixed_batch_matches_ref(dtype):
    seq_lens = [9, 1, 33, 20, 8]
    q_lens = [9, 1, 1, 6, 0]  # full prefill, decode, decode, chunk over a cached prefix, idle
    k, v, bt, sl = make_paged(seq_lens, 8, 1, 16, dtype=dtype, seed=12)
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(13)).to(dtype)
    cu = cu_from(q_lens)
    out = paged_attention_torch(q, k, v, bt, cu, sl, max(q_lens), max(seq_lens), scale=0.2)
    want = paged_attention_prefill_ref(q.float(), k.float(), v.float(), bt, cu, sl, scale=0.2)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@settings(max_examples=25, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8, 16, 32]),
    kv_heads_and_group=st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2, 4])),
    head_dim=st.sampled_from([4, 8, 12]),
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=5),
    extra_cols=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_torch_vectorized_matches_loop_reference(
    block_size, kv_heads_and_group, head_dim, seqs, extra_cols, seed
):
    num_kv_heads, group = kv_heads_and_group
    seq_lens = [s for s, _ in seqs]
    q_lens = [min(s, max(1, ql)) for s, ql in seqs]
    k, v, bt, sl = make_paged(seq_lens, block_size, num_kv_heads, head_dim, seed=seed, extra_cols=extra_cols)
    q = torch.randn(
        sum(q_lens), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed)
    )
    cu = cu_from(q_lens)
    out = paged_attention_torch(q, k, v, bt, cu, sl, max(q_lens), max(seq_lens))
    want = paged_attention_prefill_ref(q, k, v, bt, cu, sl)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


# --------------------------------------------------------------------------- length buckets


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (8, 8)])
def test_torch_bucketed_decode_with_very_different_lengths_matches_ref(num_heads, num_kv_heads):
    """Contexts 1..450 in shuffled order: several buckets, rows scattered back in place."""
    g = torch.Generator().manual_seed(20)
    seq_lens = torch.randint(1, 451, (60,), generator=g).tolist() + [1, 450, 16, 17]
    k, v, bt, sl = make_paged(seq_lens, 16, num_kv_heads, 32, seed=21, extra_cols=1)
    cu = cu_from([1] * len(seq_lens))
    assert len(torch_backend._length_buckets(cu.tolist(), seq_lens, 16, num_heads * 32)) > 1
    q = torch.randn(len(seq_lens), num_heads, 32, generator=g)
    out = paged_attention_torch(q, k, v, bt, cu, sl, 1, max(seq_lens))
    want = paged_attention_ref(q, k, v, bt, sl)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


def test_torch_bucketed_mixed_prefill_decode_with_very_different_lengths_matches_ref():
    g = torch.Generator().manual_seed(22)
    seqs = [  # (seq_len, q_len): decodes short and long, prompts, chunks over a cached prefix
        (300, 1),
        (5, 1),
        (120, 1),
        (1, 1),
        (451, 1),
        (33, 1),
        (64, 64),
        (200, 1),
        (7, 7),
        (260, 20),
        (90, 90),
        (2, 1),
        (400, 1),
        (48, 0),
        (130, 2),
        (17, 1),
    ]
    seq_lens = [s for s, _ in seqs]
    q_lens = [ql for _, ql in seqs]
    k, v, bt, sl = make_paged(seq_lens, 8, 2, 16, seed=23)
    cu = cu_from(q_lens)
    assert (
        len(torch_backend._length_buckets(cu.tolist(), seq_lens, 8, 4 * 16)) >= 3
    )  # decodes + 2 prefill buckets
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    out = paged_attention_torch(q, k, v, bt, cu, sl, max(q_lens), max(seq_lens), scale=0.25)
    want = paged_attention_prefill_ref(q, k, v, bt, cu, sl, scale=0.25)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


def padded_work(bucket, q_lens, seq_lens, block_size):
    """Query rows x key slots of one padded call over ``bucket``."""
    blocks = max(max(1, -(-seq_lens[b] // block_size)) for b in bucket)
    return len(bucket) * max(q_lens[b] for b in bucket) * blocks * block_size


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 500), st.integers(0, 3)), min_size=1, max_size=30),
    block_size=st.sampled_from([1, 8, 16]),
    row_cost=st.sampled_from([64, 256, 2**19]),
)
def test_length_buckets_cover_each_sequence_once_and_only_cut_when_it_pays(seqs, block_size, row_cost):
    seq_lens = [s for s, _ in seqs]
    q_lens = [min(s, ql) if s else min(1, ql) for s, ql in seqs]
    cu = cu_from(q_lens).tolist()
    buckets = torch_backend._length_buckets(cu, seq_lens, block_size, row_cost)
    flat = sorted(b for bucket in buckets for b in bucket)
    assert flat == [b for b, n in enumerate(q_lens) if n > 0], "each sequence with queries, exactly once"
    cost = torch_backend.BUCKET_COST // row_cost
    for bucket in buckets:
        assert len({q_lens[b] == 1 for b in bucket}) == 1, f"decodes and prefills mixed in {bucket}"
        whole = padded_work(bucket, q_lens, seq_lens, block_size)
        for cut in range(1, len(bucket)):  # no cut left that would pay for another call
            parts = padded_work(bucket[:cut], q_lens, seq_lens, block_size) + padded_work(
                bucket[cut:], q_lens, seq_lens, block_size
            )
            assert parts >= whole - cost, f"cutting {bucket} at {cut} saves more than a bucket costs"


def test_length_buckets_cut_a_wide_spread_of_decodes():
    """Batch 64, contexts 20..450 (the serving benchmark's spread), course model shapes."""
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(20, 451, (64,), generator=g).tolist()
    q_lens = [1] * 64
    buckets = torch_backend._length_buckets(cu_from(q_lens).tolist(), seq_lens, 16, 8 * 32)
    assert 1 < len(buckets) <= 8
    total = sum(padded_work(b, q_lens, seq_lens, 16) for b in buckets)
    assert total < padded_work(list(range(64)), q_lens, seq_lens, 16)


# --------------------------------------------------------------------------- errors


def test_bad_shapes_raise_value_error_naming_the_argument():
    k, v, bt, sl = make_paged([4], 4, 2, 8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention_ref(torch.randn(1, 3, 8), k, v, bt, sl)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_ref(torch.randn(1, 4, 4), k, v, bt, sl)
    with pytest.raises(ValueError, match="v_cache"):
        paged_attention_ref(torch.randn(1, 4, 8), k, v[:, :2], bt, sl)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_ref(torch.randn(1, 4, 8), k, v, bt[0], sl)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_torch(torch.randn(1, 4, 8), k, v, bt, torch.zeros(3, dtype=torch.int32), sl, 1, 4)
    with pytest.raises(ValueError, match="q_len"):
        contiguous_attention(torch.randn(5, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8))


# --------------------------------------------------------------------------- without Triton


def test_torch_paths_work_and_triton_paths_explain_without_triton():
    """macOS has no Triton: the package imports, torch ops work, Triton ops raise RuntimeError."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # make `import triton` fail as if it were not installed
        import torch
        import minipaged.kernels as K
        assert K.HAS_TRITON is False
        k = torch.randn(4, 2, 1, 8); v = torch.randn(4, 2, 1, 8)
        bt = torch.tensor([[2, 0]], dtype=torch.int32); sl = torch.tensor([3], dtype=torch.int32)
        q = torch.randn(1, 2, 8)
        K.paged_attention_ref(q, k, v, bt, sl)
        K.paged_attention_torch(q, k, v, bt, torch.tensor([0, 1], dtype=torch.int32), sl, 1, 3)
        K.reshape_and_cache(torch.randn(1, 1, 8), torch.randn(1, 1, 8), k, v, torch.tensor([5]))
        for call in (lambda: K.paged_attention_decode(q, k, v, bt, sl),
                     lambda: K.reshape_and_cache_triton(torch.randn(1, 1, 8), torch.randn(1, 1, 8), k, v,
                                                        torch.tensor([5]))):
            try:
                call()
            except RuntimeError as e:
                assert "Triton" in str(e), e
            else:
                raise AssertionError("no RuntimeError")
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
