"""minipaged.model against transformers: same logits, same greedy tokens, over a paged cache.

Each tiny checkpoint (Llama with GQA and untied embeddings, Mistral with a head_dim that is
not hidden / heads, Qwen2 with its q/k/v biases, GPT-2 with Conv1D weights) is randomly
initialised, perturbed (so biases and norm weights are not 0 / 1), saved with
``save_pretrained`` and loaded through ``load_model``. ModelInputs are built by hand here,
independently of the engine's ModelRunner (``tests/_model_cases.py``), over a *shuffled* block
table with block_size 4.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from _model_cases import BLOCK_SIZE, NUM_BLOCKS, VOCAB, build_input, prompt, shuffled_tables

from minipaged.model import load_model
from minipaged.model.layers import RotaryEmbedding, rope_parameters

ATOL = 1e-4


def _configs():
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return {
        "llama": transformers.LlamaConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500.0,
            tie_word_embeddings=False,
        ),
        "mistral": transformers.MistralConfig(
            **common, num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True
        ),
        "qwen2": transformers.Qwen2Config(
            **common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
        ),
        "gpt2": transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
        ),
    }


def _cpu_available() -> bool:
    from minipaged.kernels import cpu

    return cpu.available()


# every architecture on the readable torch backend, and on the "cpu" backend (the C kernels:
# attention, RMSNorm, RoPE, SiLU-and-mul) where a C compiler builds them
_PAIRS = [(arch, "torch") for arch in ("llama", "mistral", "qwen2", "gpt2")] + [
    pytest.param((arch, "cpu"), marks=pytest.mark.skipif(not _cpu_available(), reason="no C compiler"))
    for arch in ("llama", "mistral", "qwen2", "gpt2")
]


@pytest.fixture(scope="module", params=_PAIRS, ids=lambda p: "-".join(p) if isinstance(p, tuple) else str(p))
def pair(request, tmp_path_factory):
    """(name, transformers model, minipaged model) with the same weights."""
    torch.manual_seed(0)
    arch, backend = request.param
    config = _configs()[arch]
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))  # biases != 0, norm weights != 1
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path)
    # NOTE: greedy generate must not stop at EOS: the paged loop below never does.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    model, tokenizer = load_model(str(path), attention_backend=backend)
    assert tokenizer is None  # the tiny checkpoints ship no tokenizer
    return f"{arch} ({backend})", hf, model


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits for the last token of ``ids`` (no cache), [vocab] fp32."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0, -1].float()


# ---------------------------------------------------------------------------------------
# Equivalence with transformers
# ---------------------------------------------------------------------------------------


def test_prefill_then_decode_matches_transformers(pair):
    name, hf, model = pair
    kv_caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    ids = prompt(11, seed=1)
    (table,) = shuffled_tables(1, 5, seed=2)
    num_new = 6

    with torch.no_grad():
        logits = model(build_input([(ids, 0)], [table]), kv_caches)  # prefill
    assert logits.shape == (1, VOCAB) and logits.dtype == torch.float32
    generated = []
    for step in range(num_new):
        torch.testing.assert_close(
            logits[0], hf_last_logits(hf, ids), atol=ATOL, rtol=0, msg=lambda m: f"{name} step {step}: {m}"
        )
        tok = int(logits[0].argmax())
        generated.append(tok)
        if step < num_new - 1:  # decode: one new token, the rest read from the cache
            with torch.no_grad():
                logits = model(build_input([([tok], len(ids))], [table]), kv_caches)
        ids = ids + [tok]

    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt(11, seed=1)]), max_new_tokens=num_new, do_sample=False)
    assert generated == ref[0, 11:].tolist(), name


def test_mixed_batch_prefill_and_decode(pair):
    """One step: sequence A decodes (6 tokens cached) while B prefills 9 tokens."""
    name, hf, model = pair
    kv_caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    a, b = prompt(6, seed=3), prompt(9, seed=4)
    tab_a, tab_b = shuffled_tables(2, 4, seed=5)

    with torch.no_grad():
        first = model(build_input([(a, 0)], [tab_a]), kv_caches)  # A's prefill, alone
        a_next = int(first[0].argmax())
        inp = build_input([([a_next], len(a)), (b, 0)], [tab_a, tab_b])
        assert not inp.is_decode_only and inp.max_query_len == 9
        logits = model(inp, kv_caches)  # [2, vocab]
    torch.testing.assert_close(logits[0], hf_last_logits(hf, a + [a_next]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_last_logits(hf, b), atol=ATOL, rtol=0)

    with torch.no_grad():  # then both decode together
        toks = logits.argmax(-1).tolist()
        inp = build_input([([toks[0]], len(a) + 1), ([toks[1]], len(b))], [tab_a, tab_b])
        assert inp.is_decode_only
        logits = model(inp, kv_caches)
    torch.testing.assert_close(logits[0], hf_last_logits(hf, a + [a_next, toks[0]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_last_logits(hf, b + [toks[1]]), atol=ATOL, rtol=0)


def test_chunked_prefill(pair):
    """A 13-token prompt in two chunks (6 + 7): each chunk's last logits match transformers."""
    name, hf, model = pair
    kv_caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    ids = prompt(13, seed=6)
    (table,) = shuffled_tables(1, 4, seed=7)
    with torch.no_grad():
        first = model(build_input([(ids[:6], 0)], [table]), kv_caches)
        second = model(build_input([(ids[6:], 6)], [table]), kv_caches)
    torch.testing.assert_close(first[0], hf_last_logits(hf, ids[:6]), atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], hf_last_logits(hf, ids), atol=ATOL, rtol=0)


def test_padding_slot_is_not_written(pair):
    """A token with slot -1 (PAD_SLOT_ID) leaves the cache untouched."""
    _, _, model = pair
    kv_caches = model.allocate_kv_caches(4, BLOCK_SIZE)
    inp = build_input([(prompt(3, seed=8), 0)], [[1]])
    inp.slot_mapping[:] = -1
    with torch.no_grad():
        model(inp, kv_caches)
    assert all(float(k.abs().sum()) == 0 and float(v.abs().sum()) == 0 for k, v in kv_caches)


def test_model_attributes(pair):
    name, hf, model = pair
    config = hf.config
    assert model.num_layers == config.num_hidden_layers
    assert model.vocab_size == VOCAB
    assert model.max_model_len == 64
    assert model.eos_token_id == 2 and model.eos_token_ids == [2]
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    expected_kv = {"llama": 2, "mistral": 1, "qwen2": 2, "gpt2": 4}[name.split()[0]]
    expected_d = {"llama": 16, "mistral": 24, "qwen2": 16, "gpt2": 16}[name.split()[0]]
    assert (model.num_kv_heads, model.head_dim, model.num_heads) == (expected_kv, expected_d, 4)
    caches = model.allocate_kv_caches(7, BLOCK_SIZE)
    assert len(caches) == model.num_layers
    for k, v in caches:
        assert k.shape == v.shape == (7, BLOCK_SIZE, expected_kv, expected_d)
    model.check_invariants()


def test_triton_backend_matches_torch(tmp_path):
    """The "triton" backend (interpreter on CPU) gives the torch backend's logits."""
    from minipaged.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    ref, _ = load_model(str(tmp_path), attention_backend="torch")
    tri, _ = load_model(str(tmp_path), attention_backend="triton")
    ids = prompt(7, seed=9)
    (table,) = shuffled_tables(1, 3, seed=10)
    caches = {m: m.allocate_kv_caches(8 * 4, BLOCK_SIZE) for m in (ref, tri)}
    with torch.no_grad():
        for inp in (build_input([(ids, 0)], [table]), build_input([([5], 7)], [table])):
            torch.testing.assert_close(tri(inp, caches[tri]), ref(inp, caches[ref]), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------
# RoPE config handling and errors
# ---------------------------------------------------------------------------------------


def test_rope_theta_read_from_config():
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=1234.0)
    assert rope_parameters(config)["rope_theta"] == 1234.0
    rope = RotaryEmbedding(config, head_dim=16)
    expected = 1.0 / 1234.0 ** (torch.arange(0, 16, 2).float() / 16)
    torch.testing.assert_close(rope.inv_freq, expected)


def test_rope_parameters_from_old_style_config():
    """transformers 4.x style: rope_theta on the config, scaling in rope_scaling."""

    class Old:
        rope_theta = 5e5
        rope_scaling = None

    assert rope_parameters(Old()) == {"rope_theta": 5e5, "rope_type": "default"}


def test_unknown_path_raises_value_error():
    with pytest.raises(ValueError, match="/no/such/checkpoint"):
        load_model("/no/such/checkpoint")
    with pytest.raises(ValueError, match="not a Hugging Face hub id"):
        load_model("not a model id!")


def test_unsupported_architecture_raises_value_error(tmp_path):
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="not supported"):
        load_model(str(tmp_path))


def test_a_llama_config_with_another_activation_is_refused_by_name():
    """As vLLM's LlamaMLP: only silu; a config asking for another activation gets a
    ValueError naming ``config.hidden_act``, not a model that computes something else."""
    from minipaged.model.llama import LlamaForCausalLM

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    LlamaForCausalLM(config)  # silu: built
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="config.hidden_act 'gelu'"):
        LlamaForCausalLM(config)


@pytest.mark.parametrize("kwargs", [{"dtype": "float64"}, {"attention_backend": "cuda"}])
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        load_model(None, **kwargs)
