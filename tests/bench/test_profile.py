"""The forward breakdown of ``--profile`` (minipaged/bench/serving.py): its parts add up, the
unfused floor counts the checkpoint's separate matrices, and the figure draws recorded numbers.

No timed assertions: only structure and arithmetic of the reported numbers.
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from _model_cases import BLOCK_SIZE, NUM_BLOCKS, build_input, prompt, shuffled_tables  # noqa: E402

from minipaged.bench.serving import _weight_matrices, forward_breakdown, plot_forward_breakdown  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu_profile.json"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import torch
    import transformers

    from minipaged.model import load_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return load_model(str(path))[0]


def test_weight_matrices_fused_and_unfused(tiny_llama):
    fused = _weight_matrices(tiny_llama)
    unfused = _weight_matrices(tiny_llama, unfused=True)
    assert len(fused) == 4 * 2 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert len(unfused) == 7 * 2 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert sum(w.numel() for _, w, _ in fused) == sum(w.numel() for _, w, _ in unfused)


def test_forward_breakdown_adds_up(tiny_llama):
    import torch

    caches = tiny_llama.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    tables = shuffled_tables(3, 4, seed=1)
    with torch.no_grad():  # fill the caches with a prefill, then split one decode step
        tiny_llama(build_input([(prompt(9, s), 0) for s in range(3)], tables), caches)
    inp = build_input([([5], 9)] * 3, tables)
    b = forward_breakdown(tiny_llama, inp, caches, calls=2, repeats=3)
    assert b["num_seqs"] == 3 and b["tokens"] == 3 and b["max_context"] == 10
    assert b["forward_ms"] > 0 and b["floor_ms"] > 0 and b["attention_ms"] > 0
    assert b["other_ms"] >= 0
    assert abs(b["floor_share"] + b["attention_share"] + b["other_share"] - 1) < 0.01 or b["other_ms"] == 0
    # NOTE: the ms fields are rounded to 4 decimals and the ratio (to 2) before rounding: the
    # ratio lies between what the rounded fields allow at either end of their rounding
    fwd, floor, r = b["forward_ms"], b["floor_ms"], 5e-5
    assert (fwd - r) / (floor + r) - 0.005 <= b["ratio_to_floor"] <= (fwd + r) / max(floor - r, 1e-9) + 0.005


def test_plot_draws_the_recorded_numbers():
    runs = json.loads(RESULTS.read_text())["runs"]
    ax = plot_forward_breakdown(runs)
    assert len(ax.patches) == 3 * len(runs)  # floor, attention, the rest per run
    first = runs[list(runs)[-1]]  # drawn bottom-up: the last label is the lowest bar
    assert abs(ax.patches[0].get_width() - first["floor_ms"]) < 1e-9
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="runs"):
        plot_forward_breakdown({})
