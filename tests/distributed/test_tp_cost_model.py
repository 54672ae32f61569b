"""The simulator's tensor-parallel cost model against hand arithmetic and the paper's Table 1."""

import pytest

from minipaged.sim.cost_model import (
    A100_40GB,
    A100_80GB,
    OPT_13B,
    OPT_66B,
    OPT_175B,
    CostModel,
    GiB,
    paper_tp_settings,
)


def test_world_size_one_is_the_single_gpu_model():
    one, plain = CostModel(OPT_13B, A100_40GB, tensor_parallel_size=1), CostModel(OPT_13B, A100_40GB)
    batch = [(1, 300)] * 16 + [(200, 0)]
    assert one.breakdown(batch) == plain.breakdown(batch)
    assert one.breakdown(batch).comm_s == 0.0
    assert one.num_kv_tokens() == plain.num_kv_tokens()


def test_kv_budget_is_every_gpu_minus_its_shard_of_the_weights():
    cm = CostModel(OPT_66B, A100_40GB, tensor_parallel_size=4)
    per_gpu = 40 * GiB * 0.9 - OPT_66B.weight_bytes / 4 - 1 * GiB
    assert cm.kv_cache_bytes() == pytest.approx(4 * per_gpu)
    assert cm.num_kv_tokens() == int(4 * per_gpu // OPT_66B.kv_bytes_per_token)
    # the paper's Table 1: 9.7K KV slots for OPT-66B on 4 A100s, 60.1K for OPT-175B on 8 A100-80GB;
    # our activation reserve and 0.9 utilisation leave somewhat less
    settings = paper_tp_settings()
    assert 7_000 < settings["OPT-66B, 4 x A100"].num_kv_tokens() < 9_700
    assert 50_000 < settings["OPT-175B, 8 x A100-80GB"].num_kv_tokens() < 60_100


def test_step_time_splits_the_work_and_adds_the_all_reduces():
    one = CostModel(OPT_175B, A100_80GB, tensor_parallel_size=1, gpu_memory_utilization=1.0)
    cm = CostModel(OPT_175B, A100_80GB, tensor_parallel_size=8)
    batch = [(1, 500)] * 32
    a, b = one.breakdown(batch), cm.breakdown(batch)
    assert b.flops == pytest.approx(a.flops / 8) and b.bytes == pytest.approx(a.bytes / 8)
    # 2 all-reduces per layer of 32 tokens x 12288 fp16 values, ring over 8 GPUs
    want = 2 * 96 * (2 * 7 / 8 * 32 * 12288 * 2 / A100_80GB.nvlink_bandwidth + 10e-6)
    assert b.comm_s == pytest.approx(want)
    assert b.time_s == pytest.approx(max(b.compute_s, b.memory_s) + want + cm.step_overhead_s)
    for c in paper_tp_settings().values():
        c.check_invariants()


def test_bad_tensor_parallel_size_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=5 does not divide OPT-66B's 72 heads"):
        CostModel(OPT_66B, A100_40GB, tensor_parallel_size=5)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        CostModel(OPT_66B, A100_40GB, tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"weights .* do not fit"):
        CostModel(OPT_175B, A100_80GB, tensor_parallel_size=2).kv_cache_bytes()
