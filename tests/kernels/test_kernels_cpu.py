"""The "cpu" attention backend (C kernel, ``minipaged/kernels/cpu.py``) against the torch
reference loops: decode, mixed decode + prefill, the cache write, bad input, and what loading
the library must not change (the process's floating-point mode)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _paged_cases import TOL, cu_from, make_paged

from minipaged.kernels import cpu, reshape_and_cache
from minipaged.kernels.reference import paged_attention_prefill_ref, paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no C compiler here: {cpu.build_error()}")

# (num_heads, num_kv_heads, head_dim, block_size): GQA, MHA, MQA; head_dim 32/64/128 take the
# specialised paths, 17 and 8 the generic one; block sizes that are and are not powers of two.
# Groups of 4 and 8 query heads per KV head with head_dim a multiple of 16 take the four-heads-
# at-a-time passes (logits_x4 / values_x4); groups of 1, 6 and 3 the plain loops.
SHAPES = [
    (8, 2, 32, 16),
    (4, 4, 64, 3),
    (6, 1, 128, 1),
    (2, 2, 17, 32),
    (3, 3, 8, 5),
    (8, 1, 64, 5),
    (16, 2, 128, 16),
    (4, 1, 48, 7),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_equals_the_loop_reference(shape):
    num_heads, num_kv_heads, head_dim, block_size = shape
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 0, 37]
    k, v, tables, lens = make_paged(seq_lens, block_size, num_kv_heads, head_dim, seed=1, extra_cols=2)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(2))
    want = paged_attention_ref(q, k, v, tables, lens)
    got = cpu.paged_attention_decode_cpu(q, k, v, tables, lens)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got[4], torch.zeros_like(got[4])), "an empty sequence attends to nothing"


def test_decode_reads_strided_query_rows():
    """q as the model hands it over: a slice of the rotated [T, H + KVH, D] tensor."""
    k, v, tables, lens = make_paged([5, 40, 17], 16, 2, 32, seed=3)
    qk = torch.randn(3, 10, 32)
    q = qk[:, :8]
    assert not q.is_contiguous()
    torch.testing.assert_close(
        cpu.paged_attention_decode_cpu(q, k, v, tables, lens),
        paged_attention_ref(q.contiguous(), k, v, tables, lens),
        **TOL[torch.float32],
    )


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_mixed_decode_and_prefill_rows_equal_the_reference(shape):
    num_heads, num_kv_heads, head_dim, block_size = shape
    q_lens, seq_lens = [1, 4, 1, 7, 1], [9, 4, 2 * block_size, 12, 1]
    k, v, tables, lens = make_paged(seq_lens, block_size, num_kv_heads, head_dim, seed=4)
    cu = cu_from(q_lens)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    want = paged_attention_prefill_ref(q, k, v, tables, cu, lens)
    got = cpu.paged_attention_cpu(q, k, v, tables, cu, lens, max(q_lens), max(seq_lens))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("long_chunk", [False, True], ids=["rows-in-c", "sdpa-buckets"])
def test_prefill_chunks_short_in_c_and_long_in_sdpa_equal_the_reference(long_chunk):
    """Chunks of at most ROWS_AS_DECODES_MAX_QUERY tokens go to the C kernel row by row (each row a
    decode of its causal prefix, cached tokens before the chunk included); a longer chunk sends
    the step's prefill rows to the SDPA buckets. Both equal the reference."""
    limit = cpu.ROWS_AS_DECODES_MAX_QUERY
    q_lens = [1, 3, limit + 6 if long_chunk else limit, 1, 2]
    seq_lens = [9, 3, q_lens[2] + 5, 40, 18]  # chunks after 0, 5 and 16 cached tokens too
    k, v, tables, lens = make_paged(seq_lens, 16, 2, 32, seed=6)
    cu = cu_from(q_lens)
    q = torch.randn(sum(q_lens), 8, 32, generator=torch.Generator().manual_seed(7))
    want = paged_attention_prefill_ref(q, k, v, tables, cu, lens)
    got = cpu.paged_attention_cpu(q, k, v, tables, cu, lens, max(q_lens), max(seq_lens))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_rows_as_decodes_by_hand():
    """Two sequences: 2 cached + a chunk of 3, and a decode after 4 cached tokens."""
    tables = torch.tensor([[7, 9], [3, 0]], dtype=torch.int32)
    plan = cpu.plan_rows_as_decodes(tables, torch.tensor([0, 3, 4]), torch.tensor([5, 5]))
    assert plan.seq_lens.tolist() == [3, 4, 5, 5]  # row i of the chunk sees 2 + i + 1 tokens
    assert plan.block_tables.tolist() == [[7, 9], [7, 9], [7, 9], [3, 0]]


def test_cache_write_equals_the_torch_op():
    k_cache, v_cache, _, _ = make_paged([30], 4, 2, 8, seed=6)
    key_rows = torch.randn(5, 4, 8)[:, 1:3]  # strided rows, as the model's k slice
    value = torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 7, 0, k_cache.shape[0] * 4 - 1])  # -1: padding, skipped
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key_rows, value, want_k, want_v, slots)
    cpu.reshape_and_cache_cpu(key_rows, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_bad_input_is_refused_before_anything_is_read_out_of_bounds():
    k, v, tables, lens = make_paged([5, 9], 4, 2, 8, seed=7)
    q = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="q must be a torch.float32"):
        cpu.paged_attention_decode_cpu(q.double(), k, v, tables, lens)
    with pytest.raises(ValueError, match="seq_lens"):
        cpu.paged_attention_decode_cpu(q, k, v, tables, lens[:1])
    bad = tables.clone()
    bad[1, 0] = k.shape[0]  # one past the last block
    with pytest.raises(IndexError, match="sequence 1"):
        cpu.paged_attention_decode_cpu(q, k, v, bad, lens)
    with pytest.raises(IndexError, match="sequence 1"):  # seq_len beyond the table's width
        cpu.paged_attention_decode_cpu(q, k, v, tables, torch.tensor([5, 4 * tables.shape[1] + 1]))
    with pytest.raises(IndexError, match=r"slot_mapping\[1\]"):
        cpu.reshape_and_cache_cpu(
            torch.randn(2, 2, 8), torch.randn(2, 2, 8), k, v, torch.tensor([0, k.shape[0] * 4])
        )


def test_loading_the_library_leaves_subnormals_alone():
    """-ffast-math is a compile flag only: linking with it would set flush-to-zero process-wide."""
    cpu._library()
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a subnormal float32
    assert (tiny * 0.5).item() > 0.0


def test_engine_refuses_the_backend_when_it_cannot_be_built(tmp_path):
    """No compiler: EngineConfig says why, naming the argument (in a fresh process and cache)."""
    code = (
        "from minipaged.config import EngineConfig\n"
        "try:\n    EngineConfig(attention_backend='cpu')\n"
        "except ValueError as e:\n    print('ValueError:', e)\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), MINIPAGED_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PATH", None)  # NOTE: CC is tried first; without PATH no fallback compiler is found either
    env["PATH"] = str(tmp_path)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "ValueError: attention_backend='cpu' is unavailable here" in res.stdout, res.stderr


@pytest.mark.parametrize("kwargs", [dict(device="cuda"), dict(dtype="bfloat16")])
def test_engine_refuses_the_backend_off_cpu_or_float32(kwargs):
    from minipaged.config import EngineConfig

    with pytest.raises(ValueError, match="attention_backend='cpu' runs float32 on the CPU"):
        EngineConfig(attention_backend="cpu", **kwargs)


def test_auto_picks_the_fastest_backend_that_runs_here():
    import importlib.util

    from minipaged.config import EngineConfig

    assert EngineConfig(attention_backend="auto").attention_backend == "cpu"  # this module needs a compiler
    assert EngineConfig(attention_backend="auto", dtype="bfloat16").attention_backend == "torch"
    on_gpu = "triton" if importlib.util.find_spec("triton") else "torch"
    assert EngineConfig(attention_backend="auto", device="cuda").attention_backend == on_gpu
    # a block size the Triton kernel cannot address falls back to the torch reference
    assert EngineConfig(attention_backend="auto", device="cuda", block_size=12).attention_backend == "torch"
