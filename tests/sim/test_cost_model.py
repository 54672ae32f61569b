"""Cost model: sizes against published numbers, roofline regimes, monotonicity."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.sim.cost_model import (
    A100_40GB,
    GPUS,
    H200,
    LLAMA_7B,
    OPT_13B,
    CostModel,
    GiB,
    ModelConfig,
)


def test_kv_bytes_per_token_opt13b_is_800kb():
    # The paper (§3): "the KV cache of a single token demands 800 KB of space ...
    # 2 (key and value vectors) x 5120 (hidden state size) x 40 (number of layers) x 2 (bytes per FP16)".
    assert OPT_13B.kv_bytes_per_token == 2 * 5120 * 40 * 2 == 819_200


def test_parameter_counts_match_published_sizes():
    # OPT-13B has 12.85e9 parameters, Llama-2-7B 6.74e9 (biases/norms/positions left out here).
    assert OPT_13B.num_params == pytest.approx(12.85e9, rel=0.01)
    assert LLAMA_7B.num_params == pytest.approx(6.74e9, rel=0.01)
    assert LLAMA_7B.kv_bytes_per_token == 2 * 32 * 4096 * 2


def test_kv_budget_is_memory_minus_weights_minus_reserve():
    cm = CostModel(OPT_13B, A100_40GB, gpu_memory_utilization=0.9, activation_reserve_bytes=GiB)
    expected = 40 * GiB * 0.9 - OPT_13B.num_params * 2 - GiB
    assert cm.kv_cache_bytes() == pytest.approx(expected)
    # Paper Fig. 1: on a 40 GB A100, 13B weights take ~65%, the KV cache ~30% (~12 GB).
    assert 10e9 < cm.kv_cache_bytes() < 14e9
    assert cm.num_kv_tokens() == int(expected // 819_200)
    assert cm.num_gpu_blocks(16) == cm.num_kv_tokens() // 16
    # a bigger GPU holds more KV; the H200 the most
    sizes = [CostModel(OPT_13B, g).num_kv_tokens() for g in GPUS.values()]
    assert CostModel(OPT_13B, H200).num_kv_tokens() == max(sizes)


def test_model_that_does_not_fit_raises():
    tiny = type(A100_40GB)("tiny", peak_flops=1e12, mem_bandwidth=1e11, memory_bytes=16 * GiB)
    with pytest.raises(ValueError, match="do not fit"):
        CostModel(OPT_13B, tiny).num_gpu_blocks(16)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CostModel(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="block_size"):
        CostModel().num_gpu_blocks(0)
    with pytest.raises(ValueError, match="token counts"):
        CostModel().step_time([(-1, 0)])
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig("x", 0, 8, 1, 1, 8, 8, 8, 8)


def test_decode_step_by_hand():
    # One decode token with 99 tokens of context, zero overhead: the step reads all the
    # weights plus 100 tokens of KV (99 read + 1 written) and is memory-bound.
    cm = CostModel(OPT_13B, A100_40GB, flops_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=0.0)
    c = cm.breakdown([(1, 99)])
    m = OPT_13B
    assert c.bytes == m.num_params * 2 + 100 * 819_200
    attn = 100  # the one query sees 100 keys
    flops = 2 * m.layer_params + 2 * m.hidden_size * m.vocab_size + 4 * 40 * 40 * 128 * attn
    assert c.flops == pytest.approx(flops)
    assert c.bound == "memory"
    assert c.time_s == pytest.approx(c.bytes / A100_40GB.mem_bandwidth)
    # ~26 GB of weights at 1.555 TB/s: ~17 ms, the well-known decode floor of a 13B model on an A100
    assert 0.016 < c.time_s < 0.018


def test_roofline_regimes():
    cm = CostModel()
    assert cm.breakdown([(1, 500)] * 8).bound == "memory"  # small decode batch
    assert cm.breakdown([(2048, 0)]).bound == "compute"  # long prefill
    # short-context decode turns compute-bound past the ridge batch, not before it
    ridge = cm.decode_ridge_batch(0)
    assert 10 < ridge < 1000
    assert cm.breakdown([(1, 0)] * int(ridge * 0.9)).bound == "memory"
    assert cm.breakdown([(1, 0)] * int(ridge * 1.1 + 1)).bound == "compute"
    # with MHA, every context token costs as many bytes as FLOPs: long-context decode
    # never becomes compute-bound
    assert cm.decode_ridge_batch(2000) == float("inf")
    # the prefill of a long prompt costs far more than one decode step
    assert cm.step_time([(2048, 0)]) > 10 * cm.step_time([(1, 2047)])
    # an empty step costs exactly the overhead
    assert cm.step_time([]) == cm.step_overhead_s
    cm.check_invariants()


pair = st.tuples(st.integers(0, 2048), st.integers(0, 2048))


@settings(max_examples=200, deadline=None)
@given(
    batch=st.lists(pair, max_size=40),
    extra=pair,
    i=st.integers(0, 39),
    dq=st.integers(0, 64),
    dc=st.integers(0, 512),
)
def test_step_time_monotonic(batch, extra, i, dq, dc):
    cm = CostModel()
    t = cm.step_time(batch)
    assert t >= cm.step_overhead_s
    assert cm.step_time(batch + [extra]) >= t  # one more sequence never makes it cheaper
    if batch:
        j = i % len(batch)
        q, c = batch[j]
        more = list(batch)
        more[j] = (q + dq, c + dc)  # more new tokens / longer context for one sequence
        assert cm.step_time(more) >= t


def test_faster_gpu_is_faster_and_presets_consistent():
    batch = [(1, 400)] * 32
    times = {g.name: CostModel(OPT_13B, g).step_time(batch) for g in GPUS.values()}
    assert times["H200"] < times["H100"] < times["A100-80GB"] < times["A100-40GB"]
    for g in GPUS.values():
        CostModel(LLAMA_7B, g).check_invariants()
