"""Tests for minipaged/kernels/paged_attention.py: the Triton kernels against the torch reference.

On CPU they run under ``TRITON_INTERPRET=1`` (set here, before triton is imported), so the
shapes are tiny and the tile sizes are shrunk (``block_n``/``block_m``/``partition_size`` = 16)
to make short sequences span several tiles and partitions.

Tolerance, kernel output vs ``paged_attention_ref`` in fp32 on the same (rounded) inputs:
fp32 atol = rtol = 1e-5; fp16 3e-3; bf16 2e-2.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported through the package
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from _paged_cases import TOL, cu_from  # noqa: E402
from _paged_cases import make_paged as _make_paged  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import minipaged.kernels.paged_attention as pa  # noqa: E402
from minipaged.kernels import (  # noqa: E402
    HAS_TRITON,
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    paged_attention_ref,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(block_n=16)  # several K/V tiles even for short sequences


def make_paged(*args, **kw):
    kw.setdefault("spare_blocks", 2)
    return _make_paged(*args, device=DEVICE, **kw)


def rand_q(rows, num_heads, head_dim, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)


def check_decode(q, k, v, bt, sl, dtype=torch.float32, **kw):
    out = paged_attention_decode(q, k, v, bt, sl, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = paged_attention_ref(q.float(), k.float(), v.float(), bt, sl, scale=kw.get("scale"))
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    return out


# --------------------------------------------------------------------------- setup


def test_interpreter_is_on_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: kernels are compiled")
    assert pa._INTERPRETED and os.environ["TRITON_INTERPRET"] == "1"


def test_package_import_turns_on_interpreter_even_after_triton_import():
    """Triton reads TRITON_INTERPRET when @triton.jit decorates, so importing triton first is fine."""
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: kernels are compiled")
    import subprocess
    import sys

    script = (
        "import triton, torch\n"
        "import minipaged.kernels.paged_attention as pa\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "assert pa._INTERPRETED and isinstance(pa._paged_attention_decode_kernel, InterpretedFunction)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_without_triton_kernels_raise_runtime_error(monkeypatch):
    monkeypatch.setattr(pa, "HAS_TRITON", False)
    k, v, bt, sl = make_paged([3], 4, 1, 8)
    with pytest.raises(RuntimeError, match="Triton"):
        pa.paged_attention_decode(rand_q(1, 1, 8), k, v, bt, sl)
    with pytest.raises(RuntimeError, match="Triton"):
        pa.paged_attention_prefill(rand_q(3, 1, 8), k, v, bt, cu_from([3]), sl)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 64, 256])
def test_decode_block_sizes_and_lengths(block_size):
    """Lengths 1, one block, one block + 1, and long, through shuffled padded tables."""
    seq_lens = [1, block_size, block_size + 1, 3 * 16 + 5 if block_size < 16 else 2 * block_size + 3]
    k, v, bt, sl = make_paged(seq_lens, block_size, 2, 16, extra_cols=2, seed=block_size)
    q = rand_q(len(seq_lens), 4, 16, seed=block_size)
    check_decode(q, k, v, bt, sl, use_v2=False, **SMALL)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1)])
def test_decode_gqa_ratios(num_heads, num_kv_heads):
    k, v, bt, sl = make_paged([5, 16, 33], 8, num_kv_heads, 16, seed=num_heads)
    q = rand_q(3, num_heads, 16, seed=num_kv_heads)
    check_decode(q, k, v, bt, sl, use_v2=False, **SMALL)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_decode_head_dims(head_dim):
    k, v, bt, sl = make_paged([7, 20], 16, 1, head_dim, seed=head_dim)
    q = rand_q(2, 2, head_dim, seed=head_dim)
    check_decode(q, k, v, bt, sl, use_v2=False, **SMALL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_v2", [False, True])
def test_decode_low_precision(dtype, use_v2):
    k, v, bt, sl = make_paged([3, 17, 40], 8, 2, 64, dtype=dtype, seed=7)
    q = rand_q(3, 4, 64, dtype=dtype, seed=8)
    check_decode(q, k, v, bt, sl, dtype=dtype, use_v2=use_v2, partition_size=16, block_n=16)


@pytest.mark.parametrize("partition_size", [16, 32])
def test_decode_split_kv_v2_matches_ref_and_v1(partition_size):
    """Sequences shorter than, equal to, and spanning several partitions (some programs idle)."""
    seq_lens = [1, 16, 17, 50, 2 * partition_size + 1]
    k, v, bt, sl = make_paged(seq_lens, 4, 2, 16, extra_cols=1, seed=partition_size)
    q = rand_q(len(seq_lens), 4, 16, seed=partition_size)
    v2 = check_decode(q, k, v, bt, sl, use_v2=True, partition_size=partition_size, block_n=16)
    v1 = paged_attention_decode(q, k, v, bt, sl, use_v2=False, block_n=16)
    torch.testing.assert_close(v1, v2, **TOL[torch.float32])


def test_decode_auto_choice_and_max_seq_len_hint():
    """use_v2=None picks a path by itself; passing max_seq_len gives the same answer."""
    k, v, bt, sl = make_paged([9, 40], 8, 1, 16, seed=11)
    q = rand_q(2, 2, 16, seed=11)
    a = check_decode(q, k, v, bt, sl, partition_size=16, block_n=16)
    b = paged_attention_decode(q, k, v, bt, sl, max_seq_len=40, partition_size=16, block_n=16)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_decode_empty_sequence_gives_zeros_and_padding_ids_ignored():
    k, v, bt, sl = make_paged([0, 6], 4, 1, 16, extra_cols=3, seed=12)
    bt[0, :] = 10_000 if DEVICE == "cuda" else 0  # never read: no tokens
    bt[1, 2:] = -1  # padding past the sequence's blocks is never read either
    q = rand_q(2, 2, 16, seed=12)
    for use_v2 in (False, True):
        out = check_decode(q, k, v, bt, sl, use_v2=use_v2, partition_size=16, block_n=16)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_decode_scale_and_strided_q():
    k, v, bt, sl = make_paged([12, 30], 8, 2, 16, seed=13)
    qkv = rand_q(2, 3 * 4, 16, seed=13).reshape(2, 3, 4, 16)
    q = qkv[:, 0]  # a view with a token stride of 3 * 4 * 16
    assert not q.is_contiguous()
    check_decode(q, k, v, bt, sl, scale=0.05, use_v2=False, **SMALL)


@settings(max_examples=12, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16, 32]),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16, 24]),
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    use_v2=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decode_hypothesis_shapes(block_size, num_kv_heads, group, head_dim, seq_lens, use_v2, seed):
    k, v, bt, sl = make_paged(seq_lens, block_size, num_kv_heads, head_dim, seed=seed, extra_cols=1)
    q = rand_q(len(seq_lens), num_kv_heads * group, head_dim, seed=seed)
    check_decode(q, k, v, bt, sl, use_v2=use_v2, partition_size=32, block_n=16)


# --------------------------------------------------------------------------- prefill


def check_prefill(q, k, v, bt, cu, sl, dtype=torch.float32, **kw):
    out = paged_attention_prefill(q, k, v, bt, cu, sl, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = paged_attention_prefill_ref(q.float(), k.float(), v.float(), bt, cu, sl, scale=kw.get("scale"))
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_prefill_with_cached_prefix(block_size):
    """Full prompt, chunk after a cached prefix, a decode row, an idle sequence."""
    seq_lens = [20, 37, 9, 5]
    q_lens = [20, 17, 1, 0]
    k, v, bt, sl = make_paged(seq_lens, block_size, 2, 16, extra_cols=1, seed=block_size)
    q = rand_q(sum(q_lens), 4, 16, seed=block_size)
    check_prefill(q, k, v, bt, cu_from(q_lens), sl, block_m=16, block_n=16)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (4, 1)])
@pytest.mark.parametrize("head_dim", [16, 80])
def test_prefill_gqa_and_head_dims(num_heads, num_kv_heads, head_dim):
    seq_lens, q_lens = [18, 6], [10, 6]
    k, v, bt, sl = make_paged(seq_lens, 8, num_kv_heads, head_dim, seed=head_dim)
    q = rand_q(sum(q_lens), num_heads, head_dim, seed=num_heads)
    check_prefill(q, k, v, bt, cu_from(q_lens), sl, block_m=16, block_n=16, scale=0.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_low_precision(dtype):
    seq_lens, q_lens = [21, 8], [13, 8]
    k, v, bt, sl = make_paged(seq_lens, 8, 1, 64, dtype=dtype, seed=21)
    q = rand_q(sum(q_lens), 2, 64, dtype=dtype, seed=21)
    check_prefill(q, k, v, bt, cu_from(q_lens), sl, dtype=dtype, block_m=16, block_n=16)


def test_prefill_decode_rows_equal_decode_kernel():
    k, v, bt, sl = make_paged([3, 19, 33], 8, 2, 16, seed=31)
    q = rand_q(3, 4, 16, seed=31)
    a = paged_attention_prefill(q, k, v, bt, cu_from([1, 1, 1]), sl, block_m=16, block_n=16)
    b = paged_attention_decode(q, k, v, bt, sl, use_v2=False, block_n=16)
    torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_prefill_default_tiles():
    seq_lens, q_lens = [70, 5], [66, 5]
    k, v, bt, sl = make_paged(seq_lens, 16, 1, 16, seed=41)
    q = rand_q(sum(q_lens), 1, 16, seed=41)
    check_prefill(q, k, v, bt, cu_from(q_lens), sl, max_query_len=66)


@settings(max_examples=10, deadline=None)
@given(
    block_size=st.sampled_from([1, 8, 16]),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_prefill_hypothesis_shapes(block_size, num_kv_heads, group, seqs, seed):
    seq_lens = [s for s, _ in seqs]
    q_lens = [min(s, ql) for s, ql in seqs]
    k, v, bt, sl = make_paged(seq_lens, block_size, num_kv_heads, 8, seed=seed)
    q = rand_q(sum(q_lens), num_kv_heads * group, 8, seed=seed)
    check_prefill(q, k, v, bt, cu_from(q_lens), sl, block_m=16, block_n=16)


# --------------------------------------------------------------------------- errors


def test_wrappers_raise_value_error_naming_the_problem():
    k, v, bt, sl = make_paged([5, 9], 4, 2, 16)
    q = rand_q(2, 4, 16)
    cases = [
        ("num_kv_heads", lambda: paged_attention_decode(rand_q(2, 3, 16), k, v, bt, sl)),
        ("head_dim", lambda: paged_attention_decode(rand_q(2, 4, 8), k, v, bt, sl)),
        ("dtype", lambda: paged_attention_decode(q.half(), k, v, bt, sl)),
        ("dtype", lambda: paged_attention_decode(q.double(), k.double(), v.double(), bt, sl)),
        ("block_tables", lambda: paged_attention_decode(q, k, v, bt[:1], sl)),
        ("block_tables", lambda: paged_attention_decode(q, k, v, bt.float(), sl)),
        ("seq_lens", lambda: paged_attention_decode(q, k, v, bt, sl[:1])),
        ("v_cache", lambda: paged_attention_decode(q, k, v[:, :2], bt, sl)),
        ("block_size", lambda: paged_attention_decode(q, k[:, :3], v[:, :3], bt, sl)),
        ("partition_size", lambda: paged_attention_decode(q, k, v, bt, sl, partition_size=24)),
        ("block_n", lambda: paged_attention_decode(q, k, v, bt, sl, partition_size=16, block_n=32)),
        ("cu_seqlens_q", lambda: paged_attention_prefill(q, k, v, bt, cu_from([1]), sl)),
        ("cu_seqlens_q", lambda: paged_attention_prefill(q, k, v, bt, cu_from([1, 2]), sl)),
        ("block_m", lambda: paged_attention_prefill(q, k, v, bt, cu_from([1, 1]), sl, block_m=8)),
    ]
    if DEVICE == "cpu":  # value checks run where they cost no device sync
        bad = bt.clone()
        bad[1, 0] = 99
        cases += [
            ("block_tables", lambda: paged_attention_decode(q, k, v, bad, sl)),
            (
                "seq_lens",
                lambda: paged_attention_decode(q, k, v, bt, torch.tensor([5, 99], dtype=torch.int32)),
            ),
            ("query rows", lambda: paged_attention_prefill(rand_q(7, 4, 16), k, v, bt, cu_from([6, 1]), sl)),
        ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()


# --------------------------------------------------------------------------- launch options


def test_num_stages_keeps_kv_tiles_in_the_shared_memory_budget():
    """Triton's default 3 stages where K+V tiles fit; fewer where 3 would not (fp32 x 128)."""
    assert pa._num_stages(64, 128, torch.bfloat16) == 3  # 32 KiB a stage
    assert pa._num_stages(64, 64, torch.float32) == 3
    assert pa._num_stages(64, 128, torch.float32) == 1  # 64 KiB a stage
    assert pa._num_stages(64, 256, torch.float16) == 1
    assert pa._num_stages(16, 256, torch.float32) == 3
    for block_n in (16, 32, 64, 128):
        for block_d in (16, 64, 128, 256):
            for dtype in (torch.float32, torch.bfloat16):
                stages = pa._num_stages(block_n, block_d, dtype)
                per_stage = 2 * block_n * block_d * dtype.itemsize
                assert 1 <= stages <= 3 and (stages == 1 or stages * per_stage <= pa.KV_SMEM_BUDGET)


def test_launch_options_are_accepted_and_checked():
    k, v, bt, sl = make_paged([9, 30], 8, 2, 16, seed=51)
    q = rand_q(2, 4, 16, seed=51)
    for use_v2 in (False, True):
        check_decode(q, k, v, bt, sl, use_v2=use_v2, partition_size=16, block_n=16, num_warps=2, num_stages=1)
    check_prefill(
        rand_q(11, 4, 16, seed=52),
        k,
        v,
        bt,
        cu_from([5, 6]),
        sl,
        block_m=16,
        block_n=16,
        num_warps=8,
        num_stages=2,
    )
    with pytest.raises(ValueError, match="num_warps"):
        paged_attention_decode(q, k, v, bt, sl, num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        paged_attention_prefill(q, k, v, bt, cu_from([1, 1]), sl, num_stages=0)
