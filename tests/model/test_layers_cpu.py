"""The small layers' C pass (``forward_cpu``, ``minipaged/kernels/csrc/layers_cpu.c``) against their
``forward_native`` (torch): RMSNorm with and without the fused residual add, neox RoPE in place
on the q/k columns of a fused qkv output, SiLU-and-mul; bad input; and a whole model built for
``attention_backend="cpu"`` against the same weights on ``"torch"``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from minipaged.kernels import cpu
from minipaged.model import load_model
from minipaged.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no C compiler here: {cpu.build_error()}")

TOL = dict(rtol=1e-5, atol=1e-6)


def tiny_llama_config(**kw):
    args = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    return transformers.LlamaConfig(**{**args, **kw})


def _randn(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hidden", [1, 7, 64, 256, 1000])
def test_rms_norm_equals_native(hidden):
    x, w = _randn(5, hidden, seed=1, scale=3.0), _randn(hidden, seed=2)
    native, c = RMSNorm(hidden, 1e-5), RMSNorm(hidden, 1e-5, impl="cpu")
    native.weight.data.copy_(w)
    c.weight.data.copy_(w)
    torch.testing.assert_close(c(x), native(x), **TOL)


def test_fused_residual_add_equals_native_and_updates_the_residual_in_place():
    x, res, w = _randn(6, 96, seed=3), _randn(6, 96, seed=4), _randn(96, seed=5)
    native, c = RMSNorm(96, 1e-6), RMSNorm(96, 1e-6, impl="cpu")
    native.weight.data.copy_(w)
    c.weight.data.copy_(w)
    want_out, want_res = native(x, res.clone())
    res_c = res.clone()
    out, got_res = c(x, res_c)
    assert got_res is res_c, "forward_cpu adds into the residual it is given"
    assert torch.equal(got_res, x + res), "the residual stream is x + residual exactly"
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (4, 4, 64), (2, 1, 6)])
def test_rope_in_place_equals_native_rotate(heads, kv_heads, head_dim):
    config = tiny_llama_config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    rope = RotaryEmbedding(config, head_dim)
    T, width = 9, (heads + 2 * kv_heads) * head_dim
    qkv = _randn(T, width, seed=6)
    positions = torch.tensor([0, 1, 2, 50, 3, 7, 7, 100, config.max_position_embeddings - 1])
    qk = (heads + kv_heads) * head_dim
    want = rope.rotate(qkv[:, :qk].reshape(T, -1, head_dim), rope.cos_sin(positions)).reshape(T, qk)
    got = qkv.clone()
    rope.impl = "cpu"
    out = rope.rotate_heads(got, heads + kv_heads, head_dim, None, positions)
    assert out.data_ptr() == got.data_ptr(), "rotated in place, in qkv's own columns"
    torch.testing.assert_close(got[:, :qk], want, **TOL)
    assert torch.equal(got[:, qk:], qkv[:, qk:]), "v's columns are not rotated"


def test_silu_and_mul_equals_native_and_stays_finite_at_large_inputs():
    x = _randn(7, 2 * 352, seed=7, scale=4.0)
    x[0, :6] = torch.tensor([-200.0, -88.0, -30.0, 0.0, 30.0, 200.0])
    got = SiluAndMul(impl="cpu")(x)
    want = SiluAndMul.forward_native(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(want, F.silu(x[:, :352]) * x[:, 352:])


def test_bad_input_names_the_problem():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="float32"):
        cpu.rms_norm_cpu(torch.ones(2, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        cpu.rms_norm_cpu(torch.ones(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        cpu.rms_norm_cpu(torch.ones(2, 8), w, 1e-5, residual=torch.ones(3, 8))
    with pytest.raises(ValueError, match="contiguous"):
        cpu.rms_norm_cpu(torch.ones(8, 2).t(), torch.ones(2), 1e-5)
    with pytest.raises(ValueError, match="even number"):
        cpu.silu_and_mul_cpu(torch.ones(2, 5))
    cos = sin = torch.ones(16, 4)
    x = torch.ones(3, 16)
    with pytest.raises(ValueError, match="positions must be"):
        cpu.rotary_neox_cpu(x, torch.zeros(2, dtype=torch.long), cos, sin, 2, 8)
    with pytest.raises(IndexError, match=r"positions\[1\] = 16 is outside the RoPE table"):
        cpu.rotary_neox_cpu(x, torch.tensor([0, 16, 1]), cos, sin, 2, 8)
    assert torch.equal(x, torch.ones(3, 16)), "a bad position rotates nothing"
    with pytest.raises(ValueError, match="impl must be one of"):
        RMSNorm(8, impl="cuda")


def test_a_cpu_model_runs_its_small_layers_in_c(tmp_path):
    """Which layers ``attention_backend="cpu"`` builds in C (their results: tests/model/test_model.py
    runs every architecture on both backends against transformers)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    on_cpu, _ = load_model(str(tmp_path), attention_backend="cpu")
    on_torch, _ = load_model(str(tmp_path), attention_backend="torch")
    layer_c, layer_t = on_cpu.model.layers[0], on_torch.model.layers[0]
    assert on_cpu.model.norm.impl == layer_c.input_layernorm.impl == layer_c.mlp.act_fn.impl == "cpu"
    assert (
        on_torch.model.norm.impl
        == layer_t.post_attention_layernorm.impl
        == layer_t.mlp.act_fn.impl
        == "torch"
    )
    assert on_cpu.model.rotary_emb.impl == "cpu" and on_torch.model.rotary_emb.impl == "torch"
    assert on_cpu.attn_backend.name == "cpu" and on_torch.attn_backend.name == "torch"


def test_use_backend_switches_every_layer_and_back(tmp_path):
    """What the profile does to compare backends on one model: the switched model computes
    what a model built for that backend computes, and switching back restores it."""
    from minipaged import LLM, SamplingParams

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    llm = LLM(str(tmp_path), attention_backend="cpu")
    want_cpu = run(llm)
    model = llm.llm_engine.model
    assert model.use_backend("torch") == "cpu"
    assert model.model.norm.impl == model.model.layers[0].self_attn.rotary_emb.impl == "torch"
    assert model.attn_backend.name == "torch"
    assert run(llm) == run(LLM(str(tmp_path), attention_backend="torch")) == want_cpu
    assert model.use_backend("cpu") == "torch"
    assert model.model.layers[1].mlp.act_fn.impl == model.model.rotary_emb.impl == "cpu"
    assert run(llm) == want_cpu
    model.check_invariants()
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        model.use_backend("cuda")
    model.model.norm.impl = "torch"  # one layer left behind: the model says so
    with pytest.raises(AssertionError, match="small layers on"):
        model.check_invariants()
