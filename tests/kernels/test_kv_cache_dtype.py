"""A quantized KV cache (``kv_cache_dtype`` "fp8" / "fp8_e4m3" / "int8", minipaged/kernels/quant.py).

Every backend against the *dequantized reference*: ``paged_attention_ref`` on the fp32 caches
``stored * scale``. Tolerances: fp32 queries 1e-5 (the backends read the same dequantized floats
and differ only in summation order); bf16 queries through Triton ``TOL[bf16]``. The quantization
error itself (quantized cache against the unquantized one, random N(0, 1) keys and values, scale
from their max) is held to stated bounds: max |error| of the attention output <= 0.05 for int8
and <= 0.1 for fp8 (measured here: about 0.02 and 0.04).
"""

from __future__ import annotations

import math

import pytest
import torch
from _paged_cases import TOL, cu_from, make_paged

from minipaged.config import EngineConfig, kv_cache_bytes_per_block
from minipaged.kernels import (
    HAS_TRITON,
    copy_blocks,
    cpu,
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    paged_attention_ref,
    paged_attention_torch,
    reshape_and_cache,
    reshape_and_cache_triton,
    selector,
    swap_blocks,
)
from minipaged.kernels.quant import QUANT_MAX, dequantize, kv_cache_torch_dtype, quantize, scale_for
from minipaged.model import ModelInput

QDTYPES = [torch.int8, torch.float8_e4m3fn]
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler builds the cpu kernel")


def quantized_paged(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """Random float caches, their quantized copies and scales: (kf, vf, k, v, ks, vs, bt, sl)."""
    kf, vf, bt, sl = make_paged(seq_lens, block_size, num_kv_heads, head_dim, seed=seed)
    ks, vs = scale_for(kf.abs().max(), dtype), scale_for(vf.abs().max(), dtype)
    k, v = quantize(kf, dtype, ks), quantize(vf, dtype, vs)
    return kf, vf, k, v, ks, vs, bt, sl


# --------------------------------------------------------------------------- the format


def test_int8_hand_check_one_block_of_four_tokens():
    """One head of dim 1, four tokens, scale 0.01: each value / 0.01, rounded, clamped to 127."""
    x = torch.tensor([0.5, -1.3, 0.024, 1.0]).view(4, 1, 1)  # [T, KVH, D]
    k = torch.zeros(1, 4, 1, 1, dtype=torch.int8)
    v = torch.zeros_like(k)
    reshape_and_cache(x, x, k, v, torch.arange(4), k_scale=0.01, v_scale=0.01)
    assert k.flatten().tolist() == [50, -127, 2, 100]  # -1.3 saturates at -127
    assert torch.allclose(dequantize(k, 0.01).flatten(), torch.tensor([0.5, -1.27, 0.02, 1.0]))


def test_fp8_hand_check_one_block_of_four_tokens():
    """e4m3 keeps 3 mantissa bits: 0.3 / 0.01 = 30 = 1.875 * 16 is on the grid; -1.23 -> -1.25
    (steps of 1/8 in [1, 2)); 1000 saturates at 448; 100 lies halfway between 96 and 104
    (steps of 8 in [64, 128)) and goes to the even mantissa, 96 = 1.5 * 64."""
    x = torch.tensor([0.3, -0.0123, 10.0, 1.0]).view(4, 1, 1)
    k = torch.zeros(1, 4, 1, 1, dtype=torch.float8_e4m3fn)
    reshape_and_cache(x, x, k, k.clone(), torch.arange(4), k_scale=0.01, v_scale=0.01)
    assert k.float().flatten().tolist() == [30.0, -1.25, 448.0, 96.0]


@pytest.mark.parametrize("dtype", QDTYPES)
def test_quantize_round_trip_is_within_half_a_level(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g) * 3
    s = scale_for(x.abs().max(), dtype)
    err = (dequantize(quantize(x, dtype, s), s) - x).abs()
    bound = s / 2 if dtype == torch.int8 else x.abs() * 2**-4 + s * 2**-10
    assert bool((err <= bound + 1e-6).all())
    big = quantize(torch.tensor([1e9, -1e9, float("inf")]), dtype, s)  # saturates, never NaN
    assert dequantize(big, s).abs().tolist() == [QUANT_MAX[dtype] * s] * 3


# --------------------------------------------------------------------------- the writers


@needs_triton
@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_writer_stores_what_the_torch_writer_stores(dtype):
    g = torch.Generator().manual_seed(2)
    key, value = torch.randn(20, 2, 16, generator=g) * 5, torch.randn(20, 2, 16, generator=g)
    slots = torch.tensor([3, -1, *range(4, 22)])[:20]
    caches = [torch.zeros(6, 4, 2, 16, dtype=dtype) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale=0.04, v_scale=0.01)
    reshape_and_cache_triton(key, value, caches[2], caches[3], slots, k_scale=0.04, v_scale=0.01)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@pytest.mark.parametrize("dtype", QDTYPES)
def test_copy_and_swap_move_quantized_blocks_as_bytes(dtype):
    _, _, k, v, _, _, _, _ = quantized_paged([9], 4, 2, 8, dtype)
    before = k[1].clone()
    copy_blocks(k, v, [[1, 0]])
    assert torch.equal(k[0].view(torch.uint8), before.view(torch.uint8))
    host = torch.zeros_like(k)
    swap_blocks(k, host, [[1, 2]])
    assert host.dtype == dtype and torch.equal(host[2].view(torch.uint8), before.view(torch.uint8))


# --------------------------------------------------------------------------- the readers


def _decoders():
    out = [("torch", lambda q, k, v, bt, sl, ks, vs: paged_attention_torch(
        q, k, v, bt, cu_from([1] * len(sl)), sl, 1, int(sl.max()), k_scale=ks, v_scale=vs))]  # fmt: skip
    if HAS_TRITON:
        out.append(("triton", lambda q, k, v, bt, sl, ks, vs: paged_attention_decode(
            q, k, v, bt, sl, k_scale=ks, v_scale=vs, partition_size=16, block_n=16)))  # fmt: skip
        out.append(("triton_v2", lambda q, k, v, bt, sl, ks, vs: paged_attention_decode(
            q, k, v, bt, sl, k_scale=ks, v_scale=vs, partition_size=16, block_n=16, use_v2=True)))  # fmt: skip
    if cpu.available():
        out.append(("cpu", lambda q, k, v, bt, sl, ks, vs: cpu.paged_attention_decode_cpu(
            q, k, v, bt, sl, None, ks, vs)))  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("name,decode", _decoders(), ids=[n for n, _ in _decoders()])
def test_decode_backends_equal_the_dequantized_reference(dtype, name, decode):
    kf, vf, k, v, ks, vs, bt, sl = quantized_paged([1, 17, 40, 5], 4, 2, 32, dtype)
    q = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(3))
    want = paged_attention_ref(q, dequantize(k, ks), dequantize(v, vs), bt, sl)
    assert torch.equal(paged_attention_ref(q, k, v, bt, sl, k_scale=ks, v_scale=vs), want)
    torch.testing.assert_close(decode(q, k, v, bt, sl, ks, vs), want, **TOL[torch.float32])


def _prefillers():
    out = [("torch", lambda q, k, v, bt, cu, sl, mq, ks, vs: paged_attention_torch(
        q, k, v, bt, cu, sl, mq, int(sl.max()), k_scale=ks, v_scale=vs))]  # fmt: skip
    if HAS_TRITON:
        out.append(("triton", lambda q, k, v, bt, cu, sl, mq, ks, vs: paged_attention_prefill(
            q, k, v, bt, cu, sl, k_scale=ks, v_scale=vs, block_m=16, block_n=16)))  # fmt: skip
    if cpu.available():
        out.append(("cpu", lambda q, k, v, bt, cu, sl, mq, ks, vs: cpu.paged_attention_cpu(
            q, k, v, bt, cu, sl, mq, int(sl.max()), None, None, ks, vs)))  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("name,attend", _prefillers(), ids=[n for n, _ in _prefillers()])
def test_mixed_batch_backends_equal_the_dequantized_reference(dtype, name, attend):
    """A mixed step: a prefill chunk over a cached prefix, a decode, a whole prompt."""
    q_lens, seq_lens = [5, 1, 20], [13, 30, 20]
    _, _, k, v, ks, vs, bt, sl = quantized_paged(seq_lens, 8, 2, 16, dtype, seed=4)
    cu = cu_from(q_lens)
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(5))
    want = paged_attention_prefill_ref(q, dequantize(k, ks), dequantize(v, vs), bt, cu, sl)
    got = attend(q, k, v, bt, cu, sl, max(q_lens), ks, vs)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@needs_triton
def test_triton_bf16_queries_read_an_fp8_cache():
    """FP8 is the storage format: the dots run in q's dtype (bf16 here), tolerance TOL[bf16]."""
    _, _, k, v, ks, vs, bt, sl = quantized_paged([9, 33], 4, 2, 32, torch.float8_e4m3fn)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    want = paged_attention_ref(q.float(), dequantize(k, ks), dequantize(v, vs), bt, sl)
    got = paged_attention_decode(q, k, v, bt, sl, k_scale=ks, v_scale=vs, partition_size=16, block_n=16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype,bound", [(torch.int8, 0.05), (torch.float8_e4m3fn, 0.1)], ids=["int8", "fp8"])
def test_quantization_error_of_attention_is_within_its_stated_bound(dtype, bound):
    """The cost of the format itself: quantized cache against the unquantized one."""
    kf, vf, k, v, ks, vs, bt, sl = quantized_paged([64, 100, 31, 7], 16, 2, 32, dtype, seed=7)
    q = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(8))
    err = paged_attention_ref(q, k, v, bt, sl, k_scale=ks, v_scale=vs) - paged_attention_ref(
        q, kf, vf, bt, sl
    )
    assert 0 < float(err.abs().max()) <= bound


# --------------------------------------------------------------------------- sizes, config, bad input


def test_bytes_per_block_and_blocks_per_budget_follow_the_dtype():
    shape = dict(num_layers=4, block_size=16, num_kv_heads=2, head_dim=32)
    bf16 = kv_cache_bytes_per_block(**shape, dtype="bfloat16")
    fp8 = kv_cache_bytes_per_block(**shape, dtype="bfloat16", kv_cache_dtype="fp8")
    assert bf16 == 2 * 4 * 16 * 2 * 32 * 2 and fp8 * 2 == bf16
    assert kv_cache_bytes_per_block(**shape, dtype="float32", kv_cache_dtype="int8") == fp8
    budget = 10 * bf16 + 7
    blocks = {
        kd: EngineConfig(kv_cache_memory=budget, kv_cache_dtype=kd, dtype="bfloat16")
        for kd in ("auto", "fp8")
    }
    n = {
        kd: c.num_blocks_for(kv_cache_bytes_per_block(**shape, dtype="bfloat16", kv_cache_dtype=kd))
        for kd, c in blocks.items()
    }
    assert n["fp8"] >= 1.9 * n["auto"] and n == {"auto": 10, "fp8": 20}


@pytest.mark.parametrize("kd", ["fp8", "fp8_e4m3", "int8"])
def test_llm_allocates_the_cache_in_the_dtype_with_calibrated_scales(kd):
    from minipaged import LLM

    llm = LLM(kv_cache_dtype=kd, num_blocks=8)
    engine = llm.llm_engine
    k_cache = engine.executor.model_runner.kv_caches[0][0]
    assert k_cache.dtype == kv_cache_torch_dtype(kd, torch.float32) and k_cache.element_size() == 1
    assert engine.bytes_per_block * 4 == kv_cache_bytes_per_block(
        engine.model.num_layers, 16, engine.model.num_kv_heads, engine.model.head_dim, "float32"
    )
    model, layer = engine.model, engine.model.attention_layers()[0]
    assert model.kv_cache_dtype == kd and layer.k_scale != 1.0 and layer.v_scale != 1.0
    # calibrated on some ids, the same ids' largest |k| and |v| land on the top level, none beyond
    ids = torch.tensor(model.calibration_ids[:40])
    model.calibrate_kv_scales(kd, ids)
    caches = model.allocate_kv_caches(3, 16, kd)  # the scales are kept: set for this dtype
    n, i32 = len(ids), dict(dtype=torch.int32)
    model(ModelInput(ids, torch.arange(n), torch.arange(n), torch.arange(3, **i32)[None],
                     torch.tensor([n], **i32), torch.tensor([0, n], **i32), torch.tensor([n - 1]), n, n),
          caches)  # fmt: skip
    qmax = QUANT_MAX[k_cache.dtype]
    assert [max(float(c.float().abs().max()) for c in kv) for kv in caches] == [qmax] * len(caches)


def test_bad_kv_cache_dtype_and_scales_raise_value_errors_naming_them(monkeypatch):
    from minipaged import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="e5m2")
    k, v, bt, sl = make_paged([5], 4, 1, 8)
    with pytest.raises(ValueError, match="k_scale=0.5 applies to a quantized cache"):
        paged_attention_ref(torch.randn(1, 2, 8), k, v, bt, sl, k_scale=0.5)
    with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
        reshape_and_cache(torch.randn(1, 1, 8), torch.randn(1, 1, 8), k.to(torch.int8), v.to(torch.int8),
                          torch.tensor([0]), v_scale=math.nan)  # fmt: skip
    # a GPU without e4m3 in Triton: the error names the dtype and the backend
    monkeypatch.setattr(selector, "_cuda_capability", lambda device: (8, 0))
    monkeypatch.setattr(selector.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8' is not supported by attention_backend='triton'"
    ):
        selector.get_attn_backend("triton", "cuda", "bfloat16", "fp8")
    assert selector.get_attn_backend("auto", "cuda", "bfloat16", "fp8") == "torch"
    assert selector.get_attn_backend("auto", "cuda", "bfloat16", "int8") == "triton"


@needs_cc
@pytest.mark.parametrize("kd", ["fp8", "int8"])
def test_torch_and_cpu_backends_generate_the_same_greedy_tokens_on_a_quantized_cache(kd):
    """End to end through the engine: the two CPU backends read the same 8-bit cache alike."""
    from minipaged import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["Once upon a time", "Tom had a red ball."]
    outs = {
        be: [
            o.outputs[0].token_ids
            for o in LLM(kv_cache_dtype=kd, attention_backend=be).generate(prompts, params)
        ]
        for be in ("torch", "cpu")
    }
    assert outs["torch"] == outs["cpu"] and all(len(t) == 12 for t in outs["torch"])
