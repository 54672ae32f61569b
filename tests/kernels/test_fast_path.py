"""The fast decode path (issue 18) against the readable references.

- ``paged_attention_torch``'s split-KV decode and its per-step plan (``build_attn_metadata``)
  against the loop reference ``paged_attention_ref`` / ``paged_attention_prefill_ref``:
  seeded random batches (GQA groups, block sizes, empty and one-token sequences, decode rows
  mixed with prefill rows), and one plan reused by several layers' caches as the model does.
- The Llama model's fused ``qkv_proj`` / ``gate_up_proj``: loaded from transformers'
  separate matrices row for row; a missing shard is refused.
- ``RotaryEmbedding`` (cos/sin looked up in a table, halves rotated) against transformers'
  ``apply_rotary_pos_emb``: the same floats, bit for bit.
- ``ModelInput.to`` does not carry a plan built for another device.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from _paged_cases import TOL, cu_from, make_paged

from minipaged.kernels.reference import paged_attention_prefill_ref, paged_attention_ref
from minipaged.kernels.torch_backend import build_attn_metadata, paged_attention_torch
from minipaged.model import ModelInput, load_model
from minipaged.model.layers import RotaryEmbedding


def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 12, (1,), generator=g))
    block_size = [1, 4, 8, 16][int(torch.randint(0, 4, (1,), generator=g))]
    num_kv_heads, group = [(1, 4), (2, 2), (4, 1), (2, 4)][int(torch.randint(0, 4, (1,), generator=g))]
    seq_lens = torch.randint(1, 70, (num_seqs,), generator=g).tolist()
    return seq_lens, block_size, num_kv_heads, group


@pytest.mark.parametrize("seed", range(12))
def test_split_kv_decode_equals_the_loop_reference(seed):
    seq_lens, block_size, num_kv_heads, group = _random_case(seed)
    k, v, bt, sl = make_paged(seq_lens, block_size, num_kv_heads, 16, seed=seed, extra_cols=2)
    q = torch.randn(len(seq_lens), num_kv_heads * group, 16, generator=torch.Generator().manual_seed(seed))
    want = paged_attention_ref(q, k, v, bt, sl, scale=0.3)
    got = paged_attention_torch(q, k, v, bt, cu_from([1] * len(seq_lens)), sl, 1, max(seq_lens), scale=0.3)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_split_kv_handles_empty_and_one_token_sequences():
    seq_lens = [0, 1, 16, 17, 0, 33]
    k, v, bt, sl = make_paged(seq_lens, 16, 2, 8, seed=3)
    q = torch.randn(len(seq_lens), 4, 8, generator=torch.Generator().manual_seed(4))
    got = paged_attention_torch(q, k, v, bt, cu_from([1] * 6), sl, 1, 33)
    want = paged_attention_ref(q, k, v, bt, sl)
    assert torch.equal(got[0], torch.zeros(4, 8)) and torch.equal(got[4], torch.zeros(4, 8))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("seed", range(6))
def test_mixed_decode_and_prefill_rows_equal_the_reference(seed):
    g = torch.Generator().manual_seed(100 + seed)
    q_lens = torch.randint(1, 4, (7,), generator=g).tolist()  # decodes (1) and short chunks
    q_lens[seed % 7] = 9  # at least one prefill chunk, anywhere in the batch
    seq_lens = [n + int(torch.randint(0, 40, (1,), generator=g)) for n in q_lens]
    k, v, bt, sl = make_paged(seq_lens, 8, 2, 16, seed=seed)
    q = torch.randn(sum(q_lens), 8, 16, generator=g)
    cu = cu_from(q_lens)
    got = paged_attention_torch(q, k, v, bt, cu, sl, max(q_lens), max(seq_lens))
    want = paged_attention_prefill_ref(q, k, v, bt, cu, sl)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_one_plan_serves_every_layer():
    """The model plans once per step and hands the plan to each layer's (different) cache."""
    seq_lens = [5, 40, 17, 1, 64]
    layers = [make_paged(seq_lens, 16, 2, 16, seed=s) for s in range(3)]  # same shapes, other values
    _, _, bt, sl = layers[0]  # one step: the same block tables for every layer
    cu = cu_from([1] * len(seq_lens))
    plan = build_attn_metadata(bt, cu, sl, block_size=16)
    q = torch.randn(len(seq_lens), 4, 16, generator=torch.Generator().manual_seed(9))
    for k, v, _, _ in layers:
        got = paged_attention_torch(q, k, v, bt, cu, sl, 1, 64, metadata=plan)
        torch.testing.assert_close(got, paged_attention_ref(q, k, v, bt, sl), **TOL[torch.float32])


def test_plan_reads_each_block_of_each_decode_once():
    seq_lens = [33, 1, 16, 0, 20]
    block_size = 16
    _, _, bt, sl = make_paged(seq_lens, block_size, 1, 8, seed=5, extra_cols=3)
    q_lens = [1, 1, 1, 1, 1]
    plan = build_attn_metadata(bt, cu_from(q_lens), sl, block_size)
    want_pairs = [(b, j) for b, n in enumerate(seq_lens) for j in range(-(-n // block_size))]
    assert plan.seq_of_block.tolist() == [b for b, _ in want_pairs]
    assert plan.block_ids.tolist() == [int(bt[b, j]) for b, j in want_pairs]
    # -inf exactly at the slots past each sequence's length, in its last block
    masked = (plan.key_bias == float("-inf")).sum(1).tolist()
    assert masked == [block_size * (j + 1) - min(seq_lens[b], block_size * (j + 1)) for b, j in want_pairs]
    assert plan.decode_rows is None and plan.prefill_buckets == [] and plan.num_decodes == 5


# --------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=True,
        mlp_bias=True,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama_fused")
    hf.save_pretrained(path)
    model, _ = load_model(str(path))
    return hf, model, path


def test_fused_projections_hold_the_checkpoint_rows(llama_pair):
    hf, model, _ = llama_pair
    for hf_layer, layer in zip(hf.model.layers, model.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        for shard in ("q", "k", "v"):
            src = getattr(hf_layer.self_attn, f"{shard}_proj")
            assert torch.equal(att.qkv_proj.weight[att.shard_rows(shard)], src.weight)
            assert torch.equal(att.qkv_proj.bias[att.shard_rows(shard)], src.bias)
        for shard in ("gate", "up"):
            src = getattr(hf_layer.mlp, f"{shard}_proj")
            assert torch.equal(mlp.gate_up_proj.weight[mlp.shard_rows(shard)], src.weight)
            assert torch.equal(mlp.gate_up_proj.bias[mlp.shard_rows(shard)], src.bias)


def test_a_missing_shard_is_refused(llama_pair):
    hf, model, _ = llama_pair
    state = hf.state_dict()
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="k_proj"):
        model.load_weights(state)
    model.load_weights(hf.state_dict())  # leave the shared fixture intact


def test_rotary_equals_transformers_bit_for_bit():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=300,
        rope_theta=500.0,
    )
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 300, (23,), generator=g)
    q = torch.randn(23, 4, 16, generator=g)
    k = torch.randn(23, 2, 16, generator=g)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])  # [1, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(config, head_dim=16)(positions, torch.cat((q, k), dim=1))  # [T, 6, D]
    assert torch.equal(ours[:, :4], q_hf[0].transpose(0, 1))
    assert torch.equal(ours[:, 4:], k_hf[0].transpose(0, 1))


def test_model_input_to_drops_the_plan():
    inp = ModelInput(
        input_ids=torch.tensor([1]),
        positions=torch.tensor([0]),
        slot_mapping=torch.tensor([0]),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        logits_indices=torch.tensor([0]),
        max_query_len=1,
        max_seq_len=1,
    )
    inp.attn_metadata = build_attn_metadata(inp.block_tables, inp.cu_seqlens_q, inp.seq_lens, 4)
    assert inp.to("cpu").attn_metadata is None
